"""Online-softmax attention over blocks of queries and keys: O(n) memory, any mask, LSE, backward.

Forward (Milakov & Gimelshein 2018; Dao et al. 2022): for each block of queries,
walk the key blocks keeping a running row maximum m, normaliser l and
accumulator acc; each new block rescales the old ones by exp(m_old - m_new).
Blocks the mask rules out entirely are skipped, so causal costs about half.
Backward recomputes each block's probabilities from the saved log-sum-exp
(FlashAttention-2's backward), so nothing of size i x j is ever stored. With a
logit soft-cap (masks.softcap) each block's scores are capped before the bias,
and backward multiplies dS by the cap's derivative 1 - (t / cap)^2.

Blocks are computed in float32 for half types and float64 for float64. Dropout
keep-masks are regenerated in backward from a per-call seed, not stored.
Grouped heads read their shared key/value head through a view: q (b, h, i, d)
is regrouped to (b*g, r*i, d), r = h / g, and K/V are never copied per head.

The autograd stack. The backward kernel is an autograd Function of its own, so
gradients are differentiable: double backward (create_graph=True, gradgradcheck,
Hessians) differentiates the dense closed-form gradients, which cost i x j
memory only when asked for, and the first-order path stays the blocked kernel.
Both Functions use the torch.func API (setup_context, and vmap rules that fold
the vmapped dim into the batch dim), so torch.func.vmap, grad, vjp and jacrev
work, and gradients batched by ``is_grads_batched=True`` take the dense closed
form. Under torch.autocast the inputs are cast to the autocast dtype (float64
excepted) and the kernels run with autocast off. Limits: the mask is not
vmapped (every vmapped element gets the mask bound to the unbatched sizes);
dropout under vmap follows vmap's ``randomness`` flag and runs element by
element; forward-mode AD (torch.func.jvp) is not implemented.
"""

from __future__ import annotations

import math

import torch

from multihead.backends._blocks import (
    Blocks,
    FoldedMask,
    KernelFunction,
    dense_input_grads,
    double_backward,
    dropout_keep,
    finite_or_zero,
    fold,
    legacy_batched,
    mask_scores_,
    mask_scores_and_slope_,
    transforms_active,
    unfold,
    vmap_by_loop,
)
from multihead.backends.costs import block_kernel_estimate, inputs_in_faster_dtype
from multihead.backends.precision import autocast_inputs, autocast_off, compute_dtype
from multihead.backends.registry import BackendOutput, Capabilities
from multihead.backends.weights import selected_weights
from multihead.masks import BlockState, BoundMask, is_fake

BLOCK_Q = 256  # query positions per block
BLOCK_K = 256  # key positions per block (256 x 256 measured fastest here, see BENCHMARKS.md)


def _blocks(n: int, size: int) -> Blocks:
    return Blocks(n, size)


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
        return t[:, :, :, block.start : block.stop].reshape(self.b * self.g, self.r * len(block), t.shape[-1])

    def per_head(self, t: torch.Tensor, n: int) -> torch.Tensor:
        """(b*g, r*n, x) -> (b, h, n, x), a view."""
        return t.view(self.b, self.h, n, t.shape[-1])

    def grouped(self, t: torch.Tensor) -> torch.Tensor:
        """(b, h, i, x) -> (b, g, r, i, x), a view."""
        return t.view(self.b, self.g, self.r, self.i, t.shape[-1])


def _block_scores(lay: _Layout, q_rows: torch.Tensor, qb: range, kb: range, mask: BoundMask) -> torch.Tensor:
    """Masked scaled scores of one block (soft-capped first when the mask has a cap), (b*g, r*len(qb), len(kb))."""
    scores = torch.bmm(q_rows, lay.k[:, kb.start : kb.stop].transpose(1, 2))
    mask_scores_(lay.per_head(scores, len(qb)), mask, slice(qb.start, qb.stop), slice(kb.start, kb.stop))
    return scores


def _block_scores_and_slope(
    lay: _Layout, q_rows: torch.Tensor, qb: range, kb: range, mask: BoundMask
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_block_scores`, and the soft-cap's derivative 1 - (t / cap)^2 at each pair (None without a cap)."""
    scores = torch.bmm(q_rows, lay.k[:, kb.start : kb.stop].transpose(1, 2))
    _, slope = mask_scores_and_slope_(
        lay.per_head(scores, len(qb)), mask, slice(qb.start, qb.stop), slice(kb.start, kb.stop)
    )
    return scores, None if slope is None else slope.view(scores.shape)  # (b, h, n, kb) -> (b*g, r*n, kb)


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
            acc.mul_(rescale).baddbmm_(p, lay.v[:, kb.start : kb.stop])
            row_max = new_max
        alive = row_sum > 0  # False on rows with every key masked: output 0, lse -inf
        block_out = acc / torch.where(alive, row_sum, torch.ones_like(row_sum))
        block_lse = torch.where(
            alive,
            torch.log(torch.where(alive, row_sum, torch.ones_like(row_sum))) + finite_or_zero(row_max),
            torch.full_like(row_sum, -math.inf),
        )
        out[:, :, :, qb.start : qb.stop] = block_out.view(lay.b, lay.g, lay.r, len(qb), lay.e)
        lse[:, :, :, qb.start : qb.stop] = block_lse.view(lay.b, lay.g, lay.r, len(qb), 1)
    return out.view(lay.b, lay.h, lay.i, lay.e), lse.view(lay.b, lay.h, lay.i)


def _backward(
    lay: _Layout,
    mask: BoundMask,
    dropout: float,
    seed: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    scale: float,
):
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
            k_block, v_block = lay.k[:, kb.start : kb.stop], lay.v[:, kb.start : kb.stop]
            scores, slope = _block_scores_and_slope(lay, q_rows, qb, kb, mask)
            p = scores.sub_(lse_rows).exp_()  # normalised probabilities
            dp = torch.bmm(do_rows, v_block.transpose(1, 2))  # (b*g, r*n, kb)
            if dropout > 0:
                keep = dropout_keep(p.shape, dropout, seed, qi * len(key_blocks) + ki, p.device, p.dtype)
                dv[:, kb.start : kb.stop] += torch.bmm((p * keep).transpose(1, 2), do_rows)
                dp.mul_(keep)
            else:
                dv[:, kb.start : kb.stop] += torch.bmm(p.transpose(1, 2), do_rows)
            ds = dp.sub_(delta_rows).mul_(p)  # dS = P * (dP - D)
            if slope is not None:
                ds.mul_(slope)  # through the soft-cap: dS with respect to the raw scaled scores
            dq_rows.baddbmm_(ds, k_block)
            dk[:, kb.start : kb.stop] += torch.bmm(ds.transpose(1, 2), q_rows)  # q_rows carries the scale
        dq[:, :, :, qb.start : qb.stop] = dq_rows.view(lay.b, lay.g, lay.r, len(qb), lay.d)
    dq = dq.view(lay.b, lay.h, lay.i, lay.d).mul_(scale)
    return dq, dk.view(lay.b, lay.g, lay.j, lay.d), dv.view(lay.b, lay.g, lay.j, lay.e)


def _dropout_dense(q: torch.Tensor, k: torch.Tensor, dropout: float, seed: int) -> torch.Tensor:
    """The dropout multipliers the blocks of a call drew, as one (b, h, i, j) tensor (double backward only).

    q (b, h, i, d), k (b, g, j, d) give the sizes; block n's keep-mask is drawn as :func:`_forward` draws it.
    """
    b, h, i, _ = q.shape
    g, j = k.shape[1], k.shape[2]
    r = h // g
    drop = torch.empty(b, g, r, i, j, dtype=compute_dtype(q.dtype), device=q.device)
    key_blocks = _blocks(j, BLOCK_K)
    for qi, qb in enumerate(_blocks(i, BLOCK_Q)):
        for ki, kb in enumerate(key_blocks):
            keep = dropout_keep(
                (b * g, r * len(qb), len(kb)), dropout, seed, qi * len(key_blocks) + ki, drop.device, drop.dtype
            )  # rows (b*g, r*n), as _Layout.rows orders them
            drop[:, :, :, qb.start : qb.stop, kb.start : kb.stop] = keep.view(b, g, r, len(qb), len(kb))
    return drop.view(b, h, i, j)


def _seed(seed: torch.Tensor | None) -> int:
    """The dropout seed travels as a tensor, so vmap's randomness modes can batch it; kernels read it here.

    It is drawn on the CPU (:func:`tiled_attention`), so reading it waits for no device. A fake seed
    (FakeTensorMode: shapes without values) has nothing to read, and its call draws no real mask either.
    """
    if seed is None or is_fake(seed):
        return 0
    return int(seed.item())


class _TiledAttention(KernelFunction):
    """(q, k, v) -> (output, lse) in the compute dtype; backward is :class:`_TiledBackward`.

    The torch.func-style Function (forward without ctx, setup_context, an explicit vmap rule), so it
    works under vmap, grad, vjp and jacrev as well as under plain autograd.
    """

    @staticmethod
    @autocast_off
    def forward(q, k, v, mask: BoundMask, scale: float, dropout: float, seed: torch.Tensor | None):
        return _forward(_Layout(q, k, v, scale), mask, dropout, _seed(seed))

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, scale, dropout, seed = inputs
        ctx.save_for_backward(q, k, v, *output, seed)
        ctx.mask, ctx.scale, ctx.dropout = mask, scale, dropout
        ctx.set_materialize_grads(False)  # a gradient on only one of output / lse arrives as None

    @staticmethod
    @autocast_off
    def backward(ctx, grad_out, grad_lse):
        if grad_out is None and grad_lse is None:  # reached from a double backward, which returns None for out, lse
            return None, None, None, None, None, None, None
        q, k, v, out, lse, seed = ctx.saved_tensors
        if legacy_batched(grad_out, grad_lse):
            if ctx.dropout > 0:
                raise NotImplementedError(
                    "tiled attention with dropout under torch.autograd.grad(..., is_grads_batched=True): that mode "
                    "refuses random ops, and backward redraws the dropout masks. Loop over the grad outputs, or "
                    "use torch.func.vmap over torch.func.vjp, which supports it"
                )
            dq, dk, dv = dense_input_grads(q, k, v, grad_out, None, grad_lse, mask=ctx.mask, scale=ctx.scale)
            return dq, dk, dv, None, None, None, None
        # a Function of its own, so that the gradients are differentiable (double backward) and batchable
        # (vmap over vjp); with create_graph=False and no transform it just runs the kernel
        dq, dk, dv = _TiledBackward.call_or_run(
            q, k, v, out, lse, grad_out, grad_lse, ctx.mask, ctx.scale, ctx.dropout, seed
        )
        return dq, dk, dv, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, q, k, v, mask, scale, dropout, seed):
        if dropout > 0:
            return vmap_by_loop(_TiledAttention, info, in_dims, (q, k, v, mask, scale, dropout, seed))
        q, k, v = (fold(t, dim, info.batch_size) for t, dim in zip((q, k, v), in_dims[:3], strict=True))
        out, lse = _TiledAttention.apply(q, k, v, FoldedMask(mask, info.batch_size), scale, dropout, seed)
        return (unfold(out, info.batch_size), unfold(lse, info.batch_size)), (0, 0)


class _TiledBackward(KernelFunction):
    """(q, k, v, out, lse, grad_out, grad_lse) -> (dq, dk, dv): the blocked backward kernel.

    Its own backward (double backward) differentiates the dense closed-form gradients
    (:func:`~multihead.backends._blocks.dense_input_grads`), recomputing the weights from q and k: out and
    lse are functions of q, k, v, so their contribution is in the derivative through q, k, v.
    """

    @staticmethod
    @autocast_off
    def forward(
        q, k, v, out, lse, grad_out, grad_lse, mask: BoundMask, scale: float, dropout: float, seed: torch.Tensor | None
    ):
        lay = _Layout(q, k, v, scale)
        dq, dk, dv = _backward(lay, mask, dropout, _seed(seed), out, lse, grad_out, grad_lse, scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, out, lse, grad_out, grad_lse, mask, scale, dropout, seed = inputs
        ctx.save_for_backward(q, k, v, grad_out, grad_lse, seed)
        ctx.mask, ctx.scale, ctx.dropout = mask, scale, dropout

    @staticmethod
    @autocast_off
    def backward(ctx, grad_dq, grad_dk, grad_dv):
        q, k, v, grad_out, grad_lse, seed = ctx.saved_tensors
        drop = _dropout_dense(q, k, ctx.dropout, _seed(seed)) if ctx.dropout > 0 else None
        dq, dk, dv, d_grad_out, d_grad_lse = double_backward(
            {"q": q, "k": k, "v": v, "grad_out": grad_out, "grad_lse": grad_lse},
            (grad_dq, grad_dk, grad_dv),
            mask=ctx.mask,
            scale=ctx.scale,
            drop=drop,
        )
        return dq, dk, dv, None, None, d_grad_out, d_grad_lse, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, q, k, v, out, lse, grad_out, grad_lse, mask, scale, dropout, seed):
        args = (q, k, v, out, lse, grad_out, grad_lse, mask, scale, dropout, seed)
        if dropout > 0:
            return vmap_by_loop(_TiledBackward, info, in_dims, args)
        tensor_args, tensor_dims = args[:7], in_dims[:7]  # q ... grad_lse
        tensors = (fold(t, dim, info.batch_size) for t, dim in zip(tensor_args, tensor_dims, strict=True))
        grads = _TiledBackward.apply(*tensors, FoldedMask(mask, info.batch_size), scale, dropout, seed)
        return tuple(unfold(t, info.batch_size) for t in grads), (0, 0, 0)


def tiled_attention(
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
    """q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) -> output (b, h, i, e), lse (b, h, i).

    The output in q's dtype; under torch.autocast, in the autocast dtype (float64 excepted), as torch's SDPA. The
    LSE in the dtype the blocks are computed in: float32 for half inputs (rounded to bfloat16 it would be off by up
    to 0.4% of its value, 0.06 at an LSE of 16, which merging partial results (ring attention) turns into weights
    off by a factor exp(0.06)), float64 for float64. A half call's blocks are float32 either way; where the rates
    say so (this project's AVX2 CPU: bf16 forward 96 GFLOP/s, backward 120, against 99 and 149 given float32) q, k
    and v are cast once before the Function, so that its backward reads float32 instead of casting every saved
    input again.
    """
    q, k, v = autocast_inputs(q, k, v)
    given = q.dtype
    q, k, v = inputs_in_faster_dtype("tiled", q, k, v)  # the rates alone: the Function casts to float32 either way
    seed = torch.randint(0, 2**62, (1,), device="cpu") if dropout > 0 else None  # read on the host (_seed)
    # the Function returns the compute dtype (float32 for half inputs), which backward reads; the output is cast
    # after, the LSE stays in it
    output, lse = _TiledAttention.call(q, k, v, mask, scale, dropout, seed)
    weights = None
    # the weights its blocks applied: exact, times the multipliers they drew (their seed is read on the host, which
    # a torch.func transform forbids: there the registry sends weights under dropout elsewhere)
    if need_weights and dropout > 0 and not transforms_active():
        every_head = torch.arange(q.shape[1], device=q.device)
        exact = selected_weights(q, k, mask, scale, every_head, slice(None)).to(compute_dtype(q.dtype))
        weights = (exact * _dropout_dense(q, k, dropout, _seed(seed))).to(given)
    return BackendOutput(output.to(given), weights, lse if need_lse else None)


CAPABILITIES = Capabilities(
    lse=True,
    weights=False,
    dropout=True,
    dropout_weights=True,  # the exact weights times the multipliers its blocks drew (_dropout_dense)
    backward=True,
    bias_grad=False,
    compiles_dynamic=False,
    python_block_loop=True,  # a few small kernels per block: passed over on CUDA where a fused kernel serves
    softcap=True,
    sinks=True,  # its LSE is differentiable
    # skips the masked-out blocks, masks the partial (or biased) ones apart; in the dtype it computes in
    estimate=lambda call: block_kernel_estimate(
        call, "tiled", BLOCK_Q, BLOCK_K, half="float32 blocks", masks_blocks=True
    ),
)
