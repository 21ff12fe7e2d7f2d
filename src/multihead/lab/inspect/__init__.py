"""See inside the heads: capture per-head attention, measure it, label each head's role, report it.

model, tokenizer = multihead.lab.models.load_minilm()
with multihead.lab.inspect.capture(model) as rec:
    model.encode("The bank was full of money.")
rec.weights(0, 2)                                   # (b, i, j): layer 0, head 2
stats = multihead.lab.inspect.head_stats(model, multihead.lab.inspect.bundled_corpus())
stats.roles()[0][2].label                           # 'prev'
inspection = multihead.lab.inspect.inspect_text(model, "The bank was full of money.", token="bank")
found = multihead.lab.inspect.browse_corpus(model, documents)    # every head's top contexts over a corpus
multihead.lab.inspect.write_reports(inspection, "report", ["terminal", "html"])
multihead.lab.inspect.report(model, "The bank was full of money.", out_dir="report")   # both steps at once
extras = multihead.lab.inspect.saved_model_extras(folder, model)   # a `multihead train` checkpoint's part, probes, text

The modules, data first: stats (statistics, roles), inspection (the Inspection of one text),
then its renderers terminal, html (a packaged jinja2 template), plots, and write (all of them, to files);
importance and syntax (per-head scores; prune_by_importance removes the least important heads);
saved (what a `multihead train` checkpoint folder adds: its part, probes and task); headreport (the tables and
files of `multihead heads`).
"""

from multihead.lab.extra import require_lab

require_lab("multihead.lab.inspect")  # one line naming the extra, before any lab import fails

from multihead.capture import Recorder, attention_layers, attention_sites, capture
from multihead.lab.inspect.browse import CorpusBrowse, browse_corpus
from multihead.lab.inspect.importance import (
    PruneResult,
    ablation_importance,
    gradient_importance,
    prune_by_importance,
    pruning_curve,
)
from multihead.lab.inspect.inspection import Inspection, bundled_corpus, inspect_text, read_corpus
from multihead.lab.inspect.long import LongInspection, inspect_long
from multihead.lab.inspect.roles import ROLE_RULES, Role, label_head
from multihead.lab.inspect.saved import SavedModelExtras, saved_model_extras
from multihead.lab.inspect.stats import STAT_NAMES, HeadStats, head_stats
from multihead.lab.inspect.syntax import SyntaxScores, bundled_treebank, read_conllu, syntax_scores
from multihead.lab.inspect.write import report, write_reports

__all__ = [
    "browse_corpus",
    "CorpusBrowse",
    "inspect_long",
    "LongInspection",
    "capture",
    "Recorder",
    "attention_layers",
    "attention_sites",
    "head_stats",
    "HeadStats",
    "Role",
    "label_head",
    "ROLE_RULES",
    "STAT_NAMES",
    "inspect_text",
    "Inspection",
    "report",
    "write_reports",
    "bundled_corpus",
    "read_corpus",
    "ablation_importance",
    "gradient_importance",
    "pruning_curve",
    "prune_by_importance",
    "PruneResult",
    "saved_model_extras",
    "SavedModelExtras",
    "syntax_scores",
    "SyntaxScores",
    "bundled_treebank",
    "read_conllu",
]
