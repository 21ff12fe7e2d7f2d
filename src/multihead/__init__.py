"""multihead: multi-head attention for PyTorch: correct in every corner, fast, and transparent.

``import multihead`` loads the core: the kernel, masks, backends, the layer, positions and the cache. The lab
(:mod:`multihead.lab`: inspect, models, circuits, train, the reports; ``pip install 'multihead[lab]'``) loads on
first use, as an attribute (``multihead.lab.inspect``) or an import (``import multihead.lab.inspect``).
"""

import importlib

from multihead import backends, masks, positional
from multihead.cache import KVCache
from multihead.functional import AttentionResult, WeightSelection, attention, attention_result, explain
from multihead.latent import LatentAttention, LatentCache
from multihead.layer import MultiHeadAttention
from multihead.streamed_stats import AttentionStats, attention_stats
from multihead.varlen import attention_varlen, attention_varlen_result

__version__ = "0.1.0"

# the lab, loaded on first use: it builds on the core and needs more than torch
_ON_FIRST_USE = ("lab",)


def __getattr__(name: str):
    if name in _ON_FIRST_USE:
        return importlib.import_module(f"multihead.{name}")
    raise AttributeError(f"module 'multihead' has no attribute {name!r}")


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
