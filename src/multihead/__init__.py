"""multihead: multi-head attention for PyTorch: correct in every corner, fast, and transparent.

``import multihead`` loads the core: the kernel, masks, backends, the layer, positions and the cache. Every other
public module (``multihead.cost``, ``.compat``, ``.parallel``, ``.capture``, ``.paged``, ``.integrations``, ...) and
the lab (:mod:`multihead.lab`: inspect, models, circuits, train, the reports; ``pip install 'multihead[lab]'``) load
on first use, as an attribute (``multihead.cost.estimate``, ``multihead.lab.inspect``) or an import.
"""

from multihead import backends, masks, positional
from multihead._modules import submodule_on_first_use
from multihead.cache import KVCache
from multihead.functional import AttentionResult, WeightSelection, attention, attention_result, explain
from multihead.latent import LatentAttention, LatentCache
from multihead.layer import MultiHeadAttention
from multihead.streamed_stats import AttentionStats, attention_stats
from multihead.varlen import attention_varlen, attention_varlen_result

__version__ = "0.1.0"


def __getattr__(name: str):
    return submodule_on_first_use(__name__, name)


__all__ = [
    "attention",
    "attention_result",
    "explain",
    "AttentionResult",
    "WeightSelection",
    "attention_stats",
    "AttentionStats",
    "attention_varlen",
    "attention_varlen_result",
    "MultiHeadAttention",
    "KVCache",
    "LatentAttention",
    "LatentCache",
    "masks",
    "backends",
    "positional",
    "lab",
    "__version__",
]
