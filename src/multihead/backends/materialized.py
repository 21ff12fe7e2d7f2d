"""All weights in one materialised pass: the fast path for ``return_weights=True``.

The textbook code allocates scores, scaled scores, masked scores and weights as
separate (b, h, i, j) tensors. Here each head's block of query rows is written
once, straight into the returned weights tensor, masked and softmaxed in place,
and multiplied by V. Blocks of 1024 rows measured faster than smaller,
cache-sized ones: fewer, larger matrix products outweigh the cache misses. A row
block computes only the keys its mask leaves alive and masks only the band the
mask partly keeps (:func:`_key_spans`); the returned tensor is advised onto huge
pages before its first write (:mod:`multihead._memory`). The only i x j memory is
the tensor returned to the caller. Backward reads the
saved weights (no recomputation) block by block. Asked for the log-sum-exp (the call's LSE, or learned sinks
folded in from it), each row's is one more pass over the row block's scores before their softmax (which stays
the same: the output and weights do not depend on whether it was asked for); its gradient adds P * dlse to dS.
With a logit soft-cap (masks.softcap) it also recomputes each row block's scores, since dS is multiplied by the
cap's derivative 1 - (t / cap)^2 at the capped score t.

The autograd stack, as in tiled.py: the backward kernel is an autograd Function
of its own whose backward (double backward) differentiates the dense closed-form
gradients; torch.func.vmap, grad, vjp and jacrev work through vmap rules that
fold the vmapped dim into the batch dim (the mask is not vmapped); gradients
batched by ``is_grads_batched=True`` take the dense closed form; under
torch.autocast the inputs are cast to the autocast dtype (float64 excepted) and
the kernels run with autocast off. No forward-mode AD (torch.func.jvp).
"""

from __future__ import annotations

import math

import torch

from multihead._memory import empty_written_once
from multihead.backends._blocks import (
    Blocks,
    FoldedMask,
    KernelFunction,
    dense_input_grads,
    double_backward,
    fold,
    legacy_batched,
    mask_scores_and_slope_,
    softcap_,
    softcap_slope_,
    softmax_rows_,
    unfold,
)
from multihead.backends.costs import block_kernel_estimate
from multihead.backends.precision import autocast_inputs, autocast_off, compute_dtype
from multihead.backends.registry import BackendOutput, Capabilities
from multihead.masks import BlockState, BoundMask

ROWS_PER_BLOCK = 1024  # rows per head block: 1024 measured 17% faster than 256 at n = 2048 (BENCHMARKS.md)
KEY_BLOCK = 128  # granularity of a row block's live and masked key spans (_key_spans)


def _row_blocks(n: int):
    """Blocks of ROWS_PER_BLOCK query rows, as slices (made as they are iterated)."""
    return (slice(rows.start, rows.stop) for rows in Blocks(n, ROWS_PER_BLOCK))


def _head_slice(t: torch.Tensor, bb: int, hh: int) -> torch.Tensor:
    """The (n, j) slice for batch bb, head hh of a tensor broadcastable to (b, h, n, j)."""
    return t[bb if t.shape[0] > 1 else 0, hh if t.shape[1] > 1 else 0]


def _heads(b: int, h: int, group: int) -> list[tuple[int, int, int]]:
    """(batch, query head, key/value head) triples; query head n reads key head n // group."""
    return [(bb, hh, hh // group) for bb in range(b) for hh in range(h)]


def _key_spans(mask: BoundMask | FoldedMask, rows: slice, j: int) -> tuple[range, range]:
    """(live, partial): the keys some query in ``rows`` may attend (from the first to the last key block of
    KEY_BLOCK the mask does not empty), and within them the keys the mask must be applied to (from the first to
    the last block it does not keep whole: an empty block between live ones is masked too). Outside ``live``
    every weight is 0 and no score needs computing: a causal mask's first row block of 1024 at n = 2048 attends
    half the keys, and only its diagonal band of 1024 keys needs masking."""
    states = [(cols, mask.state(range(rows.start, rows.stop), cols)) for cols in Blocks(j, KEY_BLOCK)]
    live = [cols for cols, state in states if state is not BlockState.EMPTY]
    if not live:
        return range(0), range(0)
    start, stop = live[0].start, live[-1].stop
    # within the live keys, a block not kept whole needs the mask: a partial one, or an empty one between live ones
    masked = [cols for cols, state in states if state is not BlockState.FULL and start <= cols.start < stop]
    return range(start, stop), range(masked[0].start, masked[-1].stop) if masked else range(0)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BoundMask | FoldedMask, scale: float, need_lse: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Output (b, h, i, e) and weights (b, h, i, j), both in q's dtype; with ``need_lse`` each row's log-sum-exp
    (b, h, i) in the compute dtype (float32 for half inputs, -inf for a row with no key), else None."""
    b, h, i, _ = q.shape
    g, j, e = k.shape[1], k.shape[2], v.shape[3]
    work = compute_dtype(q.dtype)
    q_scaled, k_work, v_work = q.to(work) * scale, k.to(work), v.to(work)  # scale after the upcast
    weights = empty_written_once(b, h, i, j, dtype=q.dtype, device=q.device)  # first touch on huge pages
    out = torch.empty(b, h, i, e, dtype=work, device=q.device)
    lse = torch.full((b, h, i), -math.inf, dtype=work, device=q.device) if need_lse else None
    heads = _heads(b, h, h // g)
    rows_may_be_empty = mask.may_empty_rows()
    cap = mask.softcap
    for rows in _row_blocks(i):
        keys, masked = _key_spans(mask, rows, j)
        if not keys:  # every pair of these rows masked: weights and output 0 (the fully-masked-row rule)
            weights[:, :, rows].zero_()
            out[:, :, rows].zero_()
            continue
        cols = slice(keys.start, keys.stop)
        keep, bias = mask.block(rows, cols, dtype=work)  # once per row block, shared by every head
        # only the band the keep terms partly keep is masked; a bias's -inf (turned into keep=False by block)
        # may lie anywhere, so with a bias the whole span is
        band = slice(masked.start - keys.start, masked.stop - keys.start) if bias is None else slice(None)
        drop = None if keep is None or (bias is None and not masked) else keep[..., band].logical_not()
        # scores go straight into the returned tensor when they fill its rows in its dtype; else into one
        # contiguous buffer per row block (the fused softmax needs contiguous rows), copied in after
        in_place = work == q.dtype and len(keys) == j
        buffer = None if in_place else torch.empty(rows.stop - rows.start, len(keys), dtype=work, device=q.device)
        if len(keys) < j:
            weights[:, :, rows, : keys.start].zero_()
            weights[:, :, rows, keys.stop :].zero_()
        for bb, hh, kv in heads:
            scores = weights[bb, hh, rows] if buffer is None else buffer
            torch.mm(q_scaled[bb, hh, rows], k_work[bb, kv, cols].t(), out=scores)
            if cap is not None:
                softcap_(scores, cap)  # before the bias
            if bias is not None:
                scores.add_(_head_slice(bias, bb, hh))
            if drop is not None:
                scores[:, band].masked_fill_(_head_slice(drop, bb, hh), -math.inf)
            if lse is not None:  # a pass of its own: the weights stay those of the call without it, to the bit
                torch.logsumexp(scores, dim=-1, out=lse[bb, hh, rows])
            softmax_rows_(scores, rows_may_be_empty=rows_may_be_empty)
            torch.mm(scores, v_work[bb, kv, cols], out=out[bb, hh, rows])
            if buffer is not None:
                weights[bb, hh, rows, cols] = scores
    return out.to(q.dtype), weights, lse


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    grad_out: torch.Tensor | None,
    grad_weights: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    mask: BoundMask | FoldedMask,
    scale: float,
):
    """Gradients for q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) from the saved weights (b, h, i, j), given
    those of the output (b, h, i, e), the weights and the log-sum-exp (b, h, i), each None where none flows.

    Half-precision weights are not read back: rounded to 8 bits of mantissa, they would make
    dS = P * (dP - rowsum(P * dP)) about 20 times less accurate than the other kernels' gradients. Each
    row block's weights are recomputed in float32 from q, k and the mask instead (one more product).
    """
    b, h, i, d = q.shape
    g, j = k.shape[1], k.shape[2]
    work = compute_dtype(q.dtype)
    q_work, k_work, v_work = q.to(work), k.to(work), v.to(work)
    d_out = grad_out.to(work) if grad_out is not None else None
    dq = torch.empty(b, h, i, d, dtype=work, device=q.device)
    dk = torch.zeros_like(k_work)  # (b, g, j, d)
    dv = torch.zeros_like(v_work)  # (b, g, j, e)
    heads = _heads(b, h, h // g)
    recompute = weights.dtype != work
    rows_may_be_empty = recompute and mask.may_empty_rows()
    cap = mask.softcap
    for rows in _row_blocks(i):
        slope = None  # the soft-cap's derivative 1 - (t / cap)^2 at each pair, (b, h, n, j)
        if recompute or cap is not None:  # (b, g, r, n, d) @ (b, g, 1, d, j): each query head against its k/v head
            scores = (q_work[:, :, rows] * scale).view(b, g, h // g, -1, d) @ k_work[:, :, None].transpose(-2, -1)
            scores = scores.view(b, h, -1, j)  # (b, h, n, j)
        if recompute:
            scores, slope = mask_scores_and_slope_(scores, mask, rows, slice(None))
            p = softmax_rows_(scores, rows_may_be_empty=rows_may_be_empty)  # (b, h, n, j) in float32
        else:
            if cap is not None:  # the saved weights do not hold the capped scores: one more product for them
                slope = softcap_slope_(scores, cap)
            p = weights[:, :, rows].to(work)  # (b, h, n, j)
        dp = torch.zeros_like(p) if grad_weights is None else grad_weights[:, :, rows].to(work, copy=True)
        if d_out is not None:
            for bb, hh, kv in heads:
                dv[bb, kv].addmm_(p[bb, hh].t(), d_out[bb, hh, rows])
                dp[bb, hh].addmm_(d_out[bb, hh, rows], v_work[bb, kv].t())
        ds = dp.sub_((p * dp).sum(-1, keepdim=True))
        if grad_lse is not None:  # d lse / dS = P
            ds.add_(grad_lse[:, :, rows].to(work).unsqueeze(-1))
        ds.mul_(p)  # dS = P * (dP - rowsum(P * dP) + d lse)
        if slope is not None:
            ds.mul_(slope)  # through the soft-cap: dS with respect to the raw scaled scores
        for bb, hh, kv in heads:
            torch.mm(ds[bb, hh], k_work[bb, kv], out=dq[bb, hh, rows])
            dk[bb, kv].addmm_(ds[bb, hh].t(), q_work[bb, hh, rows])
    dq.mul_(scale)
    dk.mul_(scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _MaterializedAttention(KernelFunction):
    """(q, k, v) -> (output, weights, lse or None); backward is :class:`_MaterializedBackward`.

    The torch.func-style Function (forward without ctx, setup_context, an explicit vmap rule), so it
    works under vmap, grad, vjp and jacrev as well as under plain autograd.
    """

    @staticmethod
    @autocast_off
    def forward(q, k, v, mask: BoundMask, scale: float, need_lse: bool):
        return _forward(q, k, v, mask, scale, need_lse)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, scale, _ = inputs
        ctx.save_for_backward(q, k, v, output[1])
        ctx.mask, ctx.scale = mask, scale
        ctx.set_materialize_grads(False)  # a gradient on only one of output / weights arrives as None

    @staticmethod
    @autocast_off
    def backward(ctx, grad_out, grad_weights, grad_lse):
        if grad_out is None and grad_weights is None and grad_lse is None:  # from a double backward (None for them)
            return None, None, None, None, None, None
        q, k, v, weights = ctx.saved_tensors
        if legacy_batched(grad_out, grad_weights, grad_lse):
            dq, dk, dv = dense_input_grads(q, k, v, grad_out, grad_weights, grad_lse, mask=ctx.mask, scale=ctx.scale)
            return dq, dk, dv, None, None, None
        # a Function of its own, so that the gradients are differentiable (double backward) and batchable
        # (vmap over vjp); with create_graph=False and no transform it just runs the kernel
        dq, dk, dv = _MaterializedBackward.call_or_run(
            q, k, v, weights, grad_out, grad_weights, grad_lse, ctx.mask, ctx.scale
        )
        return dq, dk, dv, None, None, None

    @staticmethod
    def vmap(info, in_dims, q, k, v, mask, scale, need_lse):
        q, k, v = (fold(t, dim, info.batch_size) for t, dim in zip((q, k, v), in_dims[:3], strict=True))
        out, weights, lse = _MaterializedAttention.apply(q, k, v, FoldedMask(mask, info.batch_size), scale, need_lse)
        size = info.batch_size
        unfolded = (unfold(out, size), unfold(weights, size), None if lse is None else unfold(lse, size))
        return unfolded, (0, 0, None if lse is None else 0)


class _MaterializedBackward(KernelFunction):
    """(q, k, v, weights, grad_out, grad_weights, grad_lse) -> (dq, dk, dv): the blocked backward kernel.

    Its own backward (double backward) differentiates the dense closed-form gradients
    (:func:`~multihead.backends._blocks.dense_input_grads`), recomputing the weights from q and k: the
    saved weights are a function of q and k, so their contribution is in the derivative through q, k.
    """

    @staticmethod
    @autocast_off
    def forward(q, k, v, weights, grad_out, grad_weights, grad_lse, mask: BoundMask, scale: float):
        return _backward(q, k, v, weights, grad_out, grad_weights, grad_lse, mask, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, weights, grad_out, grad_weights, grad_lse, mask, scale = inputs
        ctx.save_for_backward(q, k, v, grad_out, grad_weights, grad_lse)
        ctx.mask, ctx.scale = mask, scale

    @staticmethod
    @autocast_off
    def backward(ctx, grad_dq, grad_dk, grad_dv):
        q, k, v, grad_out, grad_weights, grad_lse = ctx.saved_tensors
        given = {"q": q, "k": k, "v": v, "grad_out": grad_out, "grad_weights": grad_weights, "grad_lse": grad_lse}
        dq, dk, dv, d_grad_out, d_grad_weights, d_grad_lse = double_backward(
            given, (grad_dq, grad_dk, grad_dv), mask=ctx.mask, scale=ctx.scale
        )
        return dq, dk, dv, None, d_grad_out, d_grad_weights, d_grad_lse, None, None

    @staticmethod
    def vmap(info, in_dims, q, k, v, weights, grad_out, grad_weights, grad_lse, mask, scale):
        tensors = (
            fold(t, dim, info.batch_size)
            for t, dim in zip((q, k, v, weights, grad_out, grad_weights, grad_lse), in_dims[:7], strict=True)
        )
        grads = _MaterializedBackward.apply(*tensors, FoldedMask(mask, info.batch_size), scale)
        return tuple(unfold(t, info.batch_size) for t in grads), (0, 0, 0)


def materialized_attention(
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
    """q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) -> output (b, h, i, e), weights (b, h, i, j), and with
    ``need_lse`` the log-sum-exp (b, h, i) (differentiable: learned sinks are folded in from it).

    Output and weights in q's dtype; under torch.autocast, in the autocast dtype (float64 excepted), as torch's
    SDPA; the LSE in float32 for half inputs.
    """
    q, k, v = autocast_inputs(q, k, v)
    output, weights, lse = _MaterializedAttention.call(q, k, v, mask, scale, need_lse)
    return BackendOutput(output, weights if need_weights else None, lse)


CAPABILITIES = Capabilities(
    lse=True,
    weights=True,
    dropout=False,
    backward=True,
    bias_grad=False,
    compiles_dynamic=False,
    python_block_loop=True,  # a few small kernels per block: passed over on CUDA where a fused kernel serves
    softcap=True,
    sinks=True,  # folded in from its differentiable LSE
    # each row block's live key span, masked apart; weights written once, into a new (b, h, i, j) tensor; its
    # backward masks again only when it recomputes half-precision weights in float32
    estimate=lambda call: block_kernel_estimate(
        call,
        "materialized",
        ROWS_PER_BLOCK,
        KEY_BLOCK,
        half="as given",
        masks_blocks=True,
        remasks_in_backward=call.dtype in (torch.bfloat16, torch.float16),
        fresh_bytes=call.batch * call.heads * call.q_len * call.k_len * call.dtype.itemsize,
    ),
)
