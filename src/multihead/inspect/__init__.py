"""See inside the heads: capture per-head attention, measure it, label each head's role, report it.

model, tokenizer = multihead.models.load_minilm()
with multihead.inspect.capture(model) as rec:
    model.encode("The bank was full of money.")
rec.weights(0, 2)                                   # (b, i, j): layer 0, head 2
stats = multihead.inspect.head_stats(model, multihead.inspect.bundled_corpus())
stats.roles()[0][2].label                           # 'prev'
multihead.inspect.report(model, "The bank was full of money.", out_dir="report")
"""

from multihead.inspect.capture import Recorder, attention_layers, capture
from multihead.inspect.importance import ablation_importance, gradient_importance, pruning_curve
from multihead.inspect.report import Inspection, bundled_corpus, inspect_text, read_corpus, report
from multihead.inspect.stats import STAT_NAMES, HeadStats, Role, head_stats, label_head
from multihead.inspect.syntax import SyntaxScores, bundled_treebank, read_conllu, syntax_scores

__all__ = [
    "capture",
    "Recorder",
    "attention_layers",
    "head_stats",
    "HeadStats",
    "Role",
    "label_head",
    "STAT_NAMES",
    "inspect_text",
    "Inspection",
    "report",
    "bundled_corpus",
    "read_corpus",
    "ablation_importance",
    "gradient_importance",
    "pruning_curve",
    "syntax_scores",
    "SyntaxScores",
    "bundled_treebank",
    "read_conllu",
]
