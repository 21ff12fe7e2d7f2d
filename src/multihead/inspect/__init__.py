"""See inside the heads: capture per-head attention, measure it, label each head's role, report it.

model, tokenizer = multihead.models.load_minilm()
with multihead.inspect.capture(model) as rec:
    model.encode("The bank was full of money.")
rec.weights(0, 2)                                   # (b, i, j): layer 0, head 2
stats = multihead.inspect.head_stats(model, multihead.inspect.bundled_corpus())
stats.roles()[0][2].label                           # 'prev'
inspection = multihead.inspect.inspect_text(model, "The bank was full of money.", token="bank")
multihead.inspect.write_reports(inspection, "report", ["terminal", "html"])
multihead.inspect.report(model, "The bank was full of money.", out_dir="report")   # both steps at once
extras = multihead.inspect.saved_model_extras(folder, model)   # a `multihead train` checkpoint's part, probes, text

The modules, data first: stats (statistics, roles), inspection (the Inspection of one text),
then its renderers terminal, html (a packaged jinja2 template), plots, and write (all of them, to files);
importance and syntax (per-head scores; prune_by_importance removes the least important heads);
saved (what a `multihead train` checkpoint folder adds: its part, probes and task); headreport (the tables and
files of `multihead heads`).
"""

from multihead._lab import require_lab

require_lab("multihead.inspect")  # one line naming the extra, before any lab import fails

import importlib
import sys
import types
import warnings

# the module at the old path (multihead.inspect.capture), loaded first: loaded after the line below, its import
# would rebind this package's `capture` from the function to the module
importlib.import_module("multihead.inspect.capture")

from multihead.capture import Recorder, attention_layers, attention_sites, capture  # noqa: E402
from multihead.inspect.importance import (  # noqa: E402
    PruneResult,
    ablation_importance,
    gradient_importance,
    prune_by_importance,
    pruning_curve,
)
from multihead.inspect.inspection import Inspection, bundled_corpus, inspect_text, read_corpus  # noqa: E402
from multihead.inspect.long import LongInspection, inspect_long  # noqa: E402
from multihead.inspect.roles import ROLE_RULES, Role, label_head  # noqa: E402
from multihead.inspect.saved import SavedModelExtras, saved_model_extras  # noqa: E402
from multihead.inspect.stats import STAT_NAMES, HeadStats, head_stats  # noqa: E402
from multihead.inspect.syntax import SyntaxScores, bundled_treebank, read_conllu, syntax_scores  # noqa: E402
from multihead.inspect.write import report, write_reports  # noqa: E402


class _MovedModule(types.ModuleType):
    """The old path of a module that moved: a name read from it comes from the new module, with a
    DeprecationWarning. Kept in sys.modules, so an import of the old path never rebinds this package's attribute
    of that name (``multihead.inspect.report`` stays the function that writes reports)."""

    def __init__(self, old: str, new: str):
        super().__init__(old, f"Moved to {new}; this path stays for this release.")
        self._new = new

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        warnings.warn(f"{self.__name__} is now {self._new}: import {name} from there", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(self._new), name)


# the Inspection of one text lived in inspect.report, which was also the name of the function writing its reports
sys.modules.setdefault(
    "multihead.inspect.report", _MovedModule("multihead.inspect.report", "multihead.inspect.inspection")
)

__all__ = [
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
