"""multihead: multi-head attention for PyTorch: correct in every corner, fast, and transparent."""

from multihead import backends, masks, positional
from multihead.cache import KVCache
from multihead.functional import AttentionResult, WeightSelection, attention, explain
from multihead.layer import MultiHeadAttention

from multihead import inspect, models  # isort: skip  (they build on the layer above)

__version__ = "0.1.0"


__all__ = [
    "attention",
    "explain",
    "AttentionResult",
    "WeightSelection",
    "MultiHeadAttention",
    "KVCache",
    "masks",
    "backends",
    "positional",
    "models",
    "inspect",
    "__version__",
]
