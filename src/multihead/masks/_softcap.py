"""Logit soft-capping: :func:`softcap`, which transforms the score rather than masking pairs."""

from __future__ import annotations

import math
import numbers

from multihead._errors import bad_argument, describe
from multihead.masks._base import AttentionShape, BoundTerm
from multihead.masks._mask import Mask


class _Softcap(Mask):
    kind = "softcap"

    def __init__(self, cap: float):
        if not isinstance(cap, numbers.Real) or isinstance(cap, bool):
            raise bad_argument(
                "softcap(cap=...)",
                "a finite real number > 0",
                describe(cap),
                "pass the cap as a float, e.g. softcap(50.0)",
                kind=TypeError,
            )
        try:
            value = float(cap)
        except OverflowError:  # an int beyond float's range
            value = math.inf
        if not (math.isfinite(value) and value > 0):  # NaN fails both tests
            raise bad_argument(
                "softcap(cap=...)",
                "a finite real number > 0",
                cap if math.isfinite(value) or not isinstance(cap, int) else describe(cap),  # a huge int: shortened
                "pass a positive cap, e.g. softcap(50.0) (Gemma 2 uses 50.0); leave the term out for no cap",
            )
        self.cap: float = value

    def __repr__(self) -> str:
        return f"softcap(cap={self.cap!r})"

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        return _BoundSoftcap(self.cap)


def softcap(cap: float) -> Mask:
    """Logit soft-capping: each scaled score s becomes ``cap * tanh(s / cap)``, smoothly bounded to (-cap, cap).

    Per (query, key) pair, the order is::

        s = (q . k) * scale
        s = cap * tanh(s / cap)      # this term
        s = s + bias                 # alibi(...), bias(...), float tensors: added after the cap
        s = -inf where masked        # causal, window, padding, allowed, -inf biases
        weights = softmax(s)

    The cap applies to the scaled score before any bias is added, as in Gemma 2 (Gemma Team, "Gemma 2:
    Improving Open Language Models at a Practical Size", 2024: attention logits capped at 50.0) and in
    FlashAttention's and FlexAttention's ``softcap`` option. Combine with ``&``
    (``causal() & softcap(50.0)``); a mask holds at most one soft-cap. ``cap`` must be a finite real > 0.
    Backends that apply no transform to the scores (torch's SDPA) do not serve it; ``auto`` picks another.
    """
    return _Softcap(cap)


class _BoundSoftcap(BoundTerm):
    """Not a mask of pairs: :class:`BoundMask` takes its cap out of the terms (``BoundMask.softcap``)."""

    def __init__(self, cap: float):
        self.cap: float = cap
