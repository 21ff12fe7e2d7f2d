"""Learned attention sinks (gpt-oss): one logit per query head that joins every row's softmax and is then dropped.

With a sink logit s_h for head h (or s_hi for each row), row i's weights over its keys are

    p_ij = exp(x_ij - lse'_i),   lse'_i = logaddexp(lse_i, s_h),   lse_i = log sum_j exp(x_ij)

so they sum to 1 - p_sink, p_sink = exp(s_h - lse'_i): the rest of the row's mass sits on a column whose value is 0.
That is the sink-free attention scaled row by row, which is how every backend serves it: from the log-sum-exp it
returns, ``out' = out * exp(lse - lse')``. The scale is sigmoid(lse - s_h) (stable at both ends: a row with every
key masked has lse = -inf, keeps nothing and puts its whole weight on the sink, output 0), and autograd through the
backend's differentiable LSE gives the gradients, the sink's own being ds_h = -sum_rows p_sink * rowsum(dO * O').
Dropout acts on each weight alone, so it commutes with the row scale.
"""

from __future__ import annotations

import torch

from multihead._errors import bad_argument, describe

__all__ = ["check_sinks", "heads_of", "kept_share", "per_row", "sink_lse"]


def check_sinks(sinks: object, q: torch.Tensor) -> torch.Tensor:
    """``sinks`` checked against q (b, h, i, d): a floating tensor on q's device of shape (h,), one learned logit per
    query head (gpt-oss), or (b, h, i), one per query row (a sink computed from each token, Inkling 2); returned
    as it is. Its dtype may differ from q's (a float32 parameter beside half activations): the scale is computed
    in the LSE's dtype (float32 at least)."""
    b, h, i = q.shape[:3]
    fix = f"pass a floating tensor of shape ({h},) (one logit per query head) or ({b}, {h}, {i}) on {q.device}"
    if not isinstance(sinks, torch.Tensor):
        raise bad_argument(
            "sinks", f"a tensor of shape ({h},) or ({b}, {h}, {i}), or None", describe(sinks), fix, kind=TypeError
        )
    if not sinks.is_floating_point():
        raise bad_argument(
            "sinks", "a floating dtype (float16, bfloat16, float32 or float64)", sinks.dtype, fix, kind=TypeError
        )
    if tuple(sinks.shape) not in ((h,), (b, h, i)):
        raise bad_argument(
            "sinks",
            f"shape ({h},) (one logit per query head h = {h}) or ({b}, {h}, {i}) (per row)",
            f"shape {tuple(sinks.shape)}",
            fix,
        )
    if sinks.device != q.device:
        raise bad_argument("sinks", f"a tensor on {q.device} (the device of q)", f"one on {sinks.device}", fix)
    return sinks


def per_row(sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The sinks, (h,) or (b, h, i), in the LSE's dtype and broadcastable to an LSE (b, h, i)."""
    sinks = sinks.to(lse.dtype)
    return sinks[None, :, None] if sinks.ndim == 1 else sinks


def heads_of(sinks: torch.Tensor, heads: torch.Tensor | slice) -> torch.Tensor:
    """The sinks of some query heads: (len(heads),) of (h,), or (b, len(heads), i) of (b, h, i)."""
    axis = 0 if sinks.ndim == 1 else 1
    if isinstance(heads, slice):
        return sinks[heads] if axis == 0 else sinks[:, heads]
    return sinks.index_select(axis, heads)


def kept_share(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Each row's share of weight on its keys, 1 - p_sink = sigmoid(lse - s): (b, h, i) from the sink-free LSE
    (b, h, i) and the sinks ((h,) or (b, h, i)); 0 where the row has no key (lse = -inf)."""
    return torch.sigmoid(lse - per_row(sinks, lse))


def sink_lse(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp over the keys and the sink, logaddexp(lse, s): (b, h, i); s on a row with no key."""
    return torch.logaddexp(lse, per_row(sinks, lse))
