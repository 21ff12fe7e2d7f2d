"""multihead: multi-head attention for PyTorch: correct in every corner, fast, and transparent."""

from multihead import backends, masks
from multihead.functional import AttentionResult, WeightSelection, attention, explain

__version__ = "0.1.0"

__all__ = ["attention", "explain", "AttentionResult", "WeightSelection", "masks", "backends", "__version__"]
