"""Pieces shared by the blocked kernels (tiled, materialized)."""

from __future__ import annotations

import math

import torch

from multihead.masks import BoundMask, Index


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Blocks are computed in float32 for half types (fp32 accumulation, as FlashAttention does)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def mask_scores_(scores: torch.Tensor, mask: BoundMask, rows: Index, cols: Index,
                 heads: torch.Tensor | None = None) -> torch.Tensor:
    """Add the bias and fill disallowed pairs with -inf, in place. scores: (b, h or len(heads), rows, cols)."""
    keep, bias = mask.block(rows, cols, heads, dtype=scores.dtype)
    if bias is not None:
        scores.add_(bias)
    if keep is not None:
        scores.masked_fill_(keep.logical_not(), -math.inf)
    return scores


def finite_or_zero(row_max: torch.Tensor) -> torch.Tensor:
    """Row maxima with -inf (fully masked so far) replaced by 0, so exp(s - max) gives 0, not NaN."""
    return row_max.masked_fill(row_max == -math.inf, 0.0)


def softmax_rows_(scores: torch.Tensor, *, rows_may_be_empty: bool = True) -> torch.Tensor:
    """In-place softmax over the last axis (no autograd); rows that are all -inf become 0.

    When no row can be all -inf, torch's fused softmax kernel runs in place (one pass fewer).
    """
    if not rows_may_be_empty:
        return torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    row_max = finite_or_zero(scores.amax(dim=-1, keepdim=True))
    scores.sub_(row_max).exp_()
    total = scores.sum(dim=-1, keepdim=True)
    return scores.div_(total.masked_fill_(total == 0, 1.0))


def dropout_keep(shape: torch.Size, p: float, seed: int, block_id: int, device: torch.device,
                 dtype: torch.dtype) -> torch.Tensor:
    """Keep-and-rescale factors for one block, reproducible from (seed, block_id) so backward regenerates them."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed + 1_000_003 * block_id) % (2**63 - 1))
    keep = torch.rand(shape, generator=generator, device=device, dtype=dtype) >= p
    return keep.to(dtype).mul_(1.0 / (1.0 - p))
