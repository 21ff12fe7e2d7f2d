"""A call's ``mask`` and ``causal`` flag bound to its sizes (:func:`bind_mask`), with the unmasked calls' bound
masks kept."""

from __future__ import annotations

import torch

from multihead.masks._base import AttentionShape
from multihead.masks._bound_mask import BoundMask
from multihead.masks._diagonal import causal
from multihead.masks._mask import Combined, Mask, as_mask

# (causal, b, h, i, j, device) -> the bound mask of a call with no mask (causal or not): it holds no data, so one
# serves every call of those sizes, and a decode step does not build it again (about 2 us of a 25 us step)
_PLAIN_BOUND: dict[tuple, BoundMask] = {}
PLAIN_BOUND_LIMIT = 256  # sizes kept; past it the cache starts again (a long run over many lengths)


def bind_mask(mask: Mask | torch.Tensor | None, causal_flag: bool, shape: AttentionShape) -> BoundMask:
    """Combine ``mask`` with ``causal=True`` (bottom-right) and bind to the call's sizes."""
    if mask is None and not torch.compiler.is_compiling():  # traced sizes are symbols: never a cache key
        key = (causal_flag, shape.batch, shape.heads, shape.q_len, shape.k_len, shape.device)
        bound = _PLAIN_BOUND.get(key)
        if bound is None:
            if len(_PLAIN_BOUND) >= PLAIN_BOUND_LIMIT:
                _PLAIN_BOUND.clear()
            bound = _PLAIN_BOUND[key] = _bind(None, causal_flag, shape)
        return bound
    return _bind(mask, causal_flag, shape)


def _bind(mask: Mask | torch.Tensor | None, causal_flag: bool, shape: AttentionShape) -> BoundMask:
    parts: list[Mask] = []
    if mask is not None:
        parts.extend(as_mask(mask).terms())
    if causal_flag:
        parts.append(causal())
    return Combined(tuple(parts)).bind(shape) if parts else BoundMask.none(shape)
