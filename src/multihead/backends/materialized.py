"""All weights in one materialised pass: the fast path for ``return_weights=True``.

The textbook code allocates scores, scaled scores, masked scores and weights as
separate (b, h, i, j) tensors. Here each head's block of query rows is written
once, straight into the returned weights tensor, masked and softmaxed in place,
and multiplied by V. Blocks of 1024 rows measured faster than smaller,
cache-sized ones: fewer, larger matrix products outweigh the cache misses. The only i x j memory is the tensor returned to the
caller. Backward reads the saved weights (no recomputation) block by block.
"""

from __future__ import annotations

import math

import torch

from multihead.backends._blocks import compute_dtype, softmax_rows_
from multihead.backends.registry import BackendOutput, Capabilities
from multihead.masks import BoundMask

ROWS_PER_BLOCK = 1024  # rows per head block: 1024 measured 17% faster than 256 at n = 2048 (BENCHMARKS.md)


def _row_blocks(n: int) -> list[slice]:
    return [slice(start, min(start + ROWS_PER_BLOCK, n)) for start in range(0, n, ROWS_PER_BLOCK)]


def _head_slice(t: torch.Tensor, bb: int, hh: int) -> torch.Tensor:
    """The (n, j) slice for batch bb, head hh of a tensor broadcastable to (b, h, n, j)."""
    return t[bb if t.shape[0] > 1 else 0, hh if t.shape[1] > 1 else 0]


def _heads(b: int, h: int, group: int) -> list[tuple[int, int, int]]:
    """(batch, query head, key/value head) triples; query head n reads key head n // group."""
    return [(bb, hh, hh // group) for bb in range(b) for hh in range(h)]


class _MaterializedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask: BoundMask, scale: float):
        b, h, i, _ = q.shape
        g, j, e = k.shape[1], k.shape[2], v.shape[3]
        work = compute_dtype(q.dtype)
        q_scaled, k_work, v_work = q.to(work) * scale, k.to(work), v.to(work)  # scale after the upcast
        weights = torch.empty(b, h, i, j, dtype=q.dtype, device=q.device)
        out = torch.empty(b, h, i, e, dtype=work, device=q.device)
        in_place = work == q.dtype
        heads = _heads(b, h, h // g)
        rows_may_be_empty = mask.may_empty_rows()
        for rows in _row_blocks(i):
            keep, bias = mask.block(rows, slice(None), dtype=work)  # once per row block, shared by every head
            drop = None if keep is None else keep.logical_not()
            for bb, hh, kv in heads:
                # this head's (n, j) scores, written into the returned tensor when dtypes agree, then masked,
                # softmaxed and multiplied by V in place
                scores = weights[bb, hh, rows] if in_place else torch.empty(
                    rows.stop - rows.start, j, dtype=work, device=q.device)
                torch.mm(q_scaled[bb, hh, rows], k_work[bb, kv].t(), out=scores)
                if bias is not None:
                    scores.add_(_head_slice(bias, bb, hh))
                if drop is not None:
                    scores.masked_fill_(_head_slice(drop, bb, hh), -math.inf)
                softmax_rows_(scores, rows_may_be_empty=rows_may_be_empty)
                torch.mm(scores, v_work[bb, kv], out=out[bb, hh, rows])
                if not in_place:
                    weights[bb, hh, rows] = scores
        ctx.save_for_backward(q, k, v, weights)
        ctx.scale = scale
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), weights

    @staticmethod
    def backward(ctx, grad_out, grad_weights):
        q, k, v, weights = ctx.saved_tensors
        b, h, i, d = q.shape
        g = k.shape[1]
        work = compute_dtype(q.dtype)
        q_work, k_work, v_work = q.to(work), k.to(work), v.to(work)
        d_out = grad_out.to(work) if grad_out is not None else None
        dq = torch.empty(b, h, i, d, dtype=work, device=q.device)
        dk = torch.zeros_like(k_work)  # (b, g, j, d)
        dv = torch.zeros_like(v_work)  # (b, g, j, e)
        heads = _heads(b, h, h // g)
        for rows in _row_blocks(i):
            p = weights[:, :, rows].to(work)  # (b, h, n, j)
            dp = torch.zeros_like(p) if grad_weights is None else grad_weights[:, :, rows].to(work, copy=True)
            if d_out is not None:
                for bb, hh, kv in heads:
                    dv[bb, kv].addmm_(p[bb, hh].t(), d_out[bb, hh, rows])
                    dp[bb, hh].addmm_(d_out[bb, hh, rows], v_work[bb, kv].t())
            ds = dp.sub_((p * dp).sum(-1, keepdim=True)).mul_(p)  # dS = P * (dP - rowsum(P * dP))
            for bb, hh, kv in heads:
                torch.mm(ds[bb, hh], k_work[bb, kv], out=dq[bb, hh, rows])
                dk[bb, kv].addmm_(ds[bb, hh].t(), q_work[bb, hh, rows])
        dq.mul_(ctx.scale)
        dk.mul_(ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def materialized_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: BoundMask, scale: float,
                           dropout: float, need_weights: bool, need_lse: bool) -> BackendOutput:
    """q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) -> output (b, h, i, e), weights (b, h, i, j)."""
    output, weights = _MaterializedAttention.apply(q, k, v, mask, scale)
    return BackendOutput(output, weights if need_weights else None, None)


CAPABILITIES = Capabilities(lse=False, weights=True, dropout=False, backward=True, bias_grad=False)
