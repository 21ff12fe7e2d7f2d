"""The oracle: textbook attention, readable, any dtype (float64 included), returns weights and LSE.

Every other backend is tested against this one. It copies K/V to every query
head and materialises the (b, h, i, j) scores: clarity over speed. It is also the
most robust path: it computes in float32 for half types (float64 for float64) and
scales q before the product, so a score the input dtype can hold never overflows
on the way (a float16 score of -40000 stays -40000).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from multihead.backends._blocks import apply_mask as apply_mask  # re-exported: scores + bias, -inf where masked
from multihead.backends._blocks import masked_scores
from multihead.backends.precision import autocast_inputs, autocast_off, compute_dtype
from multihead.backends.registry import BackendOutput, Capabilities
from multihead.masks import BoundMask


def masked_softmax(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last axis that gives 0 (weights and gradient) on rows that are all -inf.

    scores: (..., j) with -inf where masked. Returns weights (..., j) and log-sum-exp (...),
    which is -inf on fully masked rows.
    """
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = row_max.masked_fill(row_max == -math.inf, 0.0)
    exp = torch.exp(scores - row_max)
    total = exp.sum(dim=-1, keepdim=True)
    alive = total > 0
    weights = exp / torch.where(alive, total, torch.ones_like(total))
    # log of a clamped total keeps the gradient finite on dead rows, which are then set to -inf
    lse = torch.where(
        alive, torch.log(torch.where(alive, total, torch.ones_like(total))) + row_max, torch.full_like(total, -math.inf)
    )
    return weights, lse.squeeze(-1)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: BoundMask,
    scale: float,
    dropout: float,
    need_weights: bool,
    need_lse: bool,
) -> BackendOutput:
    """softmax(softcap(q k^T * scale) + mask) v. q (b, h, i, d), k (b, g, j, d), v (b, g, j, e).

    softcap(s) = cap * tanh(s / cap) when the mask has a soft-cap (``mask.softcap``), else s.
    """
    q, k, v = autocast_inputs(q, k, v)  # as the other kernels: the autocast dtype in, then autocast off inside
    return _reference(q, k, v, mask=mask, scale=scale, dropout=dropout, need_weights=need_weights, need_lse=need_lse)


@autocast_off
def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: BoundMask,
    scale: float,
    dropout: float,
    need_weights: bool,
    need_lse: bool,
) -> BackendOutput:
    groups = q.shape[1] // k.shape[1]
    work = compute_dtype(q.dtype)  # float32 for half types, float64 for float64: the oracle never overflows first
    k = k.to(work).repeat_interleave(groups, dim=1)  # (b, h, j, d): query head n reads key head n // groups
    v = v.to(work).repeat_interleave(groups, dim=1)  # (b, h, j, e)
    # scale before the product: q k^T can overflow where (q * scale) k^T does not
    scores = (q.to(work) * scale) @ k.transpose(-2, -1)  # (b, h, i, j)
    weights, lse = masked_softmax(masked_scores(scores, mask))  # soft-cap, bias, -inf where masked
    if dropout > 0:
        weights = F.dropout(weights, p=dropout, training=True)
    output = weights @ v  # (b, h, i, e)
    # the LSE stays in the compute dtype (float32 for half inputs), as every backend returns it: rounded to half
    # precision it would lose what merging partial results by their LSEs needs
    return BackendOutput(output.to(q.dtype), weights.to(q.dtype) if need_weights else None, lse if need_lse else None)


CAPABILITIES = Capabilities(
    lse=True, weights=True, dropout=True, backward=True, bias_grad=True, softcap=True, sinks=True
)
