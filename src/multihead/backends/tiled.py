"""Online-softmax attention over blocks of queries and keys: O(n) memory, any mask, LSE, backward.

Forward (Milakov & Gimelshein 2018; Dao et al. 2022): for each block of queries,
walk the key blocks keeping a running row maximum m, normaliser l and
accumulator acc; each new block rescales the old ones by exp(m_old - m_new).
Blocks the mask rules out entirely are skipped, so causal costs about half.
Backward recomputes each block's probabilities from the saved log-sum-exp
(FlashAttention-2's backward), so nothing of size i x j is ever stored.

Blocks are computed in float32 for half types and float64 for float64. Dropout
keep-masks are regenerated in backward from a per-call seed, not stored.
Grouped heads read their shared key/value head through a view: q (b, h, i, d)
is regrouped to (b*g, r*i, d), r = h / g, and K/V are never copied per head.
"""

from __future__ import annotations

import math

import torch

from multihead.backends._blocks import compute_dtype, dropout_keep, finite_or_zero, mask_scores_
from multihead.backends.registry import BackendOutput, Capabilities
from multihead.masks import BlockState, BoundMask

BLOCK_Q = 256  # query positions per block
BLOCK_K = 256  # key positions per block (256 x 256 measured fastest here, see BENCHMARKS.md)


def _blocks(n: int, size: int) -> list[range]:
    return [range(start, min(start + size, n)) for start in range(0, n, size)]


class _Layout:
    """Sizes and the grouped views of one call."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        self.b, self.h, self.i, self.d = q.shape
        self.g, self.j, self.e = k.shape[1], k.shape[2], v.shape[3]
        self.r = self.h // self.g
        self.dtype = compute_dtype(q.dtype)
        # (b, g, r, i, d): query heads grouped under the key/value head they read, pre-scaled
        self.q = (q.to(self.dtype) * scale).view(self.b, self.g, self.r, self.i, self.d)
        self.k = k.to(self.dtype).reshape(self.b * self.g, self.j, self.d)  # (b*g, j, d)
        self.v = v.to(self.dtype).reshape(self.b * self.g, self.j, self.e)  # (b*g, j, e)

    def rows(self, t: torch.Tensor, block: range) -> torch.Tensor:
        """(b, g, r, i, x) -> the block's rows as (b*g, r*n, x), n = len(block)."""
        return t[:, :, :, block.start:block.stop].reshape(self.b * self.g, self.r * len(block), t.shape[-1])

    def per_head(self, t: torch.Tensor, n: int) -> torch.Tensor:
        """(b*g, r*n, x) -> (b, h, n, x), a view."""
        return t.view(self.b, self.h, n, t.shape[-1])

    def grouped(self, t: torch.Tensor) -> torch.Tensor:
        """(b, h, i, x) -> (b, g, r, i, x), a view."""
        return t.view(self.b, self.g, self.r, self.i, t.shape[-1])


def _block_scores(lay: _Layout, q_rows: torch.Tensor, qb: range, kb: range, mask: BoundMask) -> torch.Tensor:
    """Masked scaled scores of one block, (b*g, r*len(qb), len(kb))."""
    scores = torch.bmm(q_rows, lay.k[:, kb.start:kb.stop].transpose(1, 2))
    mask_scores_(lay.per_head(scores, len(qb)), mask, slice(qb.start, qb.stop), slice(kb.start, kb.stop))
    return scores


def _forward(lay: _Layout, mask: BoundMask, dropout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns output (b, h, i, e) and log-sum-exp (b, h, i), both in the compute dtype."""
    out = torch.empty(lay.b, lay.g, lay.r, lay.i, lay.e, dtype=lay.dtype, device=lay.q.device)
    lse = torch.empty(lay.b, lay.g, lay.r, lay.i, 1, dtype=lay.dtype, device=lay.q.device)
    key_blocks = _blocks(lay.j, BLOCK_K)
    for qi, qb in enumerate(_blocks(lay.i, BLOCK_Q)):
        q_rows = lay.rows(lay.q, qb)  # (b*g, r*n, d)
        rows = q_rows.shape[1]
        row_max = torch.full((lay.b * lay.g, rows, 1), -math.inf, dtype=lay.dtype, device=q_rows.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros(lay.b * lay.g, rows, lay.e, dtype=lay.dtype, device=q_rows.device)
        for ki, kb in enumerate(key_blocks):
            if mask.state(qb, kb) is BlockState.EMPTY:
                continue
            p = _block_scores(lay, q_rows, qb, kb, mask)
            new_max = torch.maximum(row_max, p.amax(dim=-1, keepdim=True))
            safe_max = finite_or_zero(new_max)
            p.sub_(safe_max).exp_()  # unnormalised probabilities
            rescale = torch.exp(row_max - safe_max)
            row_sum.mul_(rescale).add_(p.sum(dim=-1, keepdim=True))
            if dropout > 0:
                p.mul_(dropout_keep(p.shape, dropout, seed, qi * len(key_blocks) + ki, p.device, p.dtype))
            acc.mul_(rescale).baddbmm_(p, lay.v[:, kb.start:kb.stop])
            row_max = new_max
        alive = row_sum > 0  # False on rows with every key masked: output 0, lse -inf
        block_out = acc / torch.where(alive, row_sum, torch.ones_like(row_sum))
        block_lse = torch.where(alive, torch.log(torch.where(alive, row_sum, torch.ones_like(row_sum)))
                                + finite_or_zero(row_max), torch.full_like(row_sum, -math.inf))
        out[:, :, :, qb.start:qb.stop] = block_out.view(lay.b, lay.g, lay.r, len(qb), lay.e)
        lse[:, :, :, qb.start:qb.stop] = block_lse.view(lay.b, lay.g, lay.r, len(qb), 1)
    return out.view(lay.b, lay.h, lay.i, lay.e), lse.view(lay.b, lay.h, lay.i)


def _backward(lay: _Layout, mask: BoundMask, dropout: float, seed: int, out: torch.Tensor, lse: torch.Tensor,
              grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None, scale: float):
    """Gradients for q (b, h, i, d), k (b, g, j, d), v (b, g, j, e), recomputing blocks from the LSE."""
    dq = torch.empty(lay.b, lay.g, lay.r, lay.i, lay.d, dtype=lay.dtype, device=lay.q.device)
    dk = torch.zeros_like(lay.k)  # (b*g, j, d)
    dv = torch.zeros_like(lay.v)  # (b*g, j, e)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grad_out = lay.grouped(grad_out.to(lay.dtype))
    # D_i = sum_j P_ij dP_ij = dO_i . O_i; a gradient on the LSE enters as -dlse_i
    delta = (grad_out * lay.grouped(out.to(lay.dtype))).sum(-1, keepdim=True)  # (b, g, r, i, 1)
    if grad_lse is not None:
        delta = delta - lay.grouped(grad_lse.to(lay.dtype).unsqueeze(-1))
    safe_lse = lay.grouped(finite_or_zero(lse.to(lay.dtype)).unsqueeze(-1))
    key_blocks = _blocks(lay.j, BLOCK_K)
    for qi, qb in enumerate(_blocks(lay.i, BLOCK_Q)):
        q_rows = lay.rows(lay.q, qb)  # (b*g, r*n, d), already scaled
        do_rows = lay.rows(grad_out, qb)  # (b*g, r*n, e)
        delta_rows = lay.rows(delta, qb)  # (b*g, r*n, 1)
        lse_rows = lay.rows(safe_lse, qb)  # (b*g, r*n, 1)
        dq_rows = torch.zeros_like(q_rows)
        for ki, kb in enumerate(key_blocks):
            if mask.state(qb, kb) is BlockState.EMPTY:
                continue
            k_block, v_block = lay.k[:, kb.start:kb.stop], lay.v[:, kb.start:kb.stop]
            p = _block_scores(lay, q_rows, qb, kb, mask).sub_(lse_rows).exp_()  # normalised probabilities
            dp = torch.bmm(do_rows, v_block.transpose(1, 2))  # (b*g, r*n, kb)
            if dropout > 0:
                keep = dropout_keep(p.shape, dropout, seed, qi * len(key_blocks) + ki, p.device, p.dtype)
                dv[:, kb.start:kb.stop] += torch.bmm((p * keep).transpose(1, 2), do_rows)
                dp.mul_(keep)
            else:
                dv[:, kb.start:kb.stop] += torch.bmm(p.transpose(1, 2), do_rows)
            ds = dp.sub_(delta_rows).mul_(p)  # dS = P * (dP - D)
            dq_rows.baddbmm_(ds, k_block)
            dk[:, kb.start:kb.stop] += torch.bmm(ds.transpose(1, 2), q_rows)  # q_rows carries the scale
        dq[:, :, :, qb.start:qb.stop] = dq_rows.view(lay.b, lay.g, lay.r, len(qb), lay.d)
    dq = dq.view(lay.b, lay.h, lay.i, lay.d).mul_(scale)
    return dq, dk.view(lay.b, lay.g, lay.j, lay.d), dv.view(lay.b, lay.g, lay.j, lay.e)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask: BoundMask, scale: float, dropout: float, seed: int):
        lay = _Layout(q, k, v, scale)
        out, lse = _forward(lay, mask, dropout, seed)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale, ctx.dropout, ctx.seed = mask, scale, dropout, seed
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        lay = _Layout(q, k, v, ctx.scale)
        dq, dk, dv = _backward(lay, ctx.mask, ctx.dropout, ctx.seed, out, lse, grad_out, grad_lse, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: BoundMask, scale: float,
                    dropout: float, need_weights: bool, need_lse: bool) -> BackendOutput:
    """q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) -> output (b, h, i, e), lse (b, h, i)."""
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout > 0 else 0
    output, lse = _TiledAttention.apply(q, k, v, mask, scale, dropout, seed)
    return BackendOutput(output, None, lse if need_lse else None)


CAPABILITIES = Capabilities(lse=True, weights=False, dropout=True, backward=True, bias_grad=False)
