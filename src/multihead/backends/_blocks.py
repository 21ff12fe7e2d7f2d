"""Pieces shared by the blocked kernels (tiled, materialized).

Block masking, softmax and dropout; and what the kernels need to take part in the PyTorch stack (autocast lives in
:mod:`multihead.backends.precision`, with the blocks' dtype): torch.func.vmap (fold the vmapped dim into the batch
dim), and the dense closed-form gradients that double backward differentiates.
"""

from __future__ import annotations

import math

import torch

from multihead.backends.precision import compute_dtype
from multihead.masks import BlockState, BoundMask, Index


class Blocks:
    """Consecutive blocks of ``size`` positions covering 0 .. n - 1, as ranges, made as they are iterated.

    A sequence (len, iteration, indexing) that holds two ints: no Python list grows with the length.
    """

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size

    def __len__(self) -> int:
        return -(-self.n // self.size)

    def __getitem__(self, index: int) -> range:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.size
        return range(start, min(start + self.size, self.n))

    def __iter__(self):
        for start in range(0, self.n, self.size):
            yield range(start, min(start + self.size, self.n))


# Scaled scores become masked scores in one order everywhere (kernels, double backward, selected weights):
#
#     s = (q . k) * scale;  t = cap * tanh(s / cap) (mask.softcap; t = s without);  t + bias;  -inf where masked
#
# in place (mask_scores_, mask_scores_and_slope_) or out of place for autograd (masked_scores).


def softcap_(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(scores / cap), in place (logit soft-capping, see :func:`multihead.masks.softcap`)."""
    return scores.div_(cap).tanh_().mul_(cap)


def softcap_slope_(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """The soft-cap's derivative at the raw scaled scores, in place: 1 - tanh(s / cap)^2 = 1 - (t / cap)^2."""
    return scores.div_(cap).tanh_().square_().neg_().add_(1.0)


def _bias_and_keep_(
    scores: torch.Tensor, mask: BoundMask | FoldedMask, rows: Index, cols: Index, heads: torch.Tensor | None
) -> torch.Tensor:
    keep, bias = mask.block(rows, cols, heads, dtype=scores.dtype)
    if bias is not None:
        scores.add_(bias)
    if keep is not None:
        scores.masked_fill_(keep.logical_not(), -math.inf)
    return scores


def mask_scores_(
    scores: torch.Tensor, mask: BoundMask | FoldedMask, rows: Index, cols: Index, heads: torch.Tensor | None = None
) -> torch.Tensor:
    """Soft-cap (when the mask has one), add the bias and fill disallowed pairs with -inf, in place.

    scores: (b, h or len(heads), rows, cols), the scaled scores.
    """
    if mask.softcap is not None:
        softcap_(scores, mask.softcap)
    return _bias_and_keep_(scores, mask, rows, cols, heads)


def mask_scores_and_slope_(
    scores: torch.Tensor, mask: BoundMask | FoldedMask, rows: Index, cols: Index, heads: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`mask_scores_`, and the soft-cap's derivative at each pair for backward (None without a cap).

    The derivative of t = cap * tanh(s / cap) is 1 - (t / cap)^2, t the capped score before the bias: a
    backward multiplies dS (with respect to the capped, biased scores) by it to get dS for the raw ones.
    """
    cap = mask.softcap
    if cap is None:
        return _bias_and_keep_(scores, mask, rows, cols, heads), None
    ratio = scores.div_(cap).tanh_()  # t / cap
    slope = torch.square(ratio).neg_().add_(1.0)
    ratio.mul_(cap)
    return _bias_and_keep_(scores, mask, rows, cols, heads), slope


def apply_mask(scores: torch.Tensor, keep: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """scores + bias, with -inf where keep is False (out of place, so autograd sees it)."""
    if bias is not None:
        scores = scores + bias
    if keep is not None:
        scores = scores.masked_fill(~keep, -math.inf)
    return scores


def masked_scores(
    scores: torch.Tensor,
    mask: BoundMask | FoldedMask,
    rows: Index = slice(None),
    cols: Index = slice(None),
    heads: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`mask_scores_` out of place, so autograd differentiates it (the soft-cap included)."""
    if mask.softcap is not None:
        scores = torch.tanh(scores / mask.softcap) * mask.softcap
    return apply_mask(scores, *mask.block(rows, cols, heads, dtype=scores.dtype))


def finite_or_zero(row_max: torch.Tensor) -> torch.Tensor:
    """Row maxima with -inf (fully masked so far) replaced by 0, so exp(s - max) gives 0, not NaN."""
    return row_max.masked_fill(row_max == -math.inf, 0.0)


def softmax_rows_(scores: torch.Tensor, *, rows_may_be_empty: bool = True) -> torch.Tensor:
    """In-place softmax over the last axis (no autograd); rows that are all -inf become 0.

    When no row can be all -inf, torch's fused softmax kernel runs in place (one pass fewer). It is
    given only contiguous tensors: on a strided view (a column range of a wider tensor) its ``out=``
    written over its own input returns wrong values (torch 2.13: errors of order 1).
    """
    if not rows_may_be_empty and scores.is_contiguous():
        return torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    row_max = finite_or_zero(scores.amax(dim=-1, keepdim=True))
    scores.sub_(row_max).exp_()
    total = scores.sum(dim=-1, keepdim=True)
    return scores.div_(total.masked_fill_(total == 0, 1.0))


def dropout_keep(
    shape: tuple[int, ...], p: float, seed: int, block_id: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Keep-and-rescale factors for one block, reproducible from (seed, block_id) so backward regenerates them."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed + 1_000_003 * block_id) % (2**63 - 1))
    keep = torch.rand(shape, generator=generator, device=device, dtype=dtype) >= p
    return keep.to(dtype).mul_(1.0 / (1.0 - p))


# --------------------------------------------------------------------------- autocast


# --------------------------------------------------------------------------- the kernels' autograd Functions


# private torch entries that torch.autograd.Function.apply itself uses; without them, always torch's apply
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
try:
    from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead_wrappers
except ImportError:  # pragma: no cover - another torch
    _transforms_active = None


def transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad) is running: a kernel's host reads (a dropout seed) are not
    possible under it."""
    return _transforms_active is None or bool(_transforms_active())


def _plain_call() -> bool:
    """Whether a Function call can skip torch's apply: no torch.func transform and no torch.compile tracing
    (both need torch's apply: custom_function_call and the vmap rules; dynamo's autograd.Function support)."""
    return _transforms_active is not None and not _transforms_active() and not torch.compiler.is_compiling()


class KernelFunction(torch.autograd.Function):
    """An autograd Function in torch.func style (forward without ctx, setup_context) with a cheap entry.

    torch's ``Function.apply`` binds the arguments to forward's signature with ``inspect.signature`` on every
    call once setup_context is defined: about 100 us, as much as a whole small attention call. The binding
    only fills in default arguments, which the kernels' forwards do not have, so :meth:`call` goes straight
    to the C++ entry that torch's apply ends in, unless a transform or torch.compile needs torch's apply.
    """

    @classmethod
    def call(cls, *args):
        """``cls.apply(*args)``, without the per-call signature binding where it is not needed."""
        if not _plain_call():
            return cls.apply(*args)
        # as torch's apply: tensors left over from a finished torch.func transform are unwrapped first
        # the C++ entry (_C._FunctionBase.apply), which torch's stubs leave out
        return super(torch.autograd.Function, cls).apply(*_unwrap_dead_wrappers(args))  # type: ignore[misc]

    @classmethod
    def call_or_run(cls, *args):
        """:meth:`call`, or just forward where apply would neither record a node nor meet a vmap rule.

        For the backward kernels, called from a first-order backward (grad mode off, no transform): the
        plain path then costs no more than the kernel itself.
        """
        if torch.is_grad_enabled() or not _plain_call():
            return cls.call(*args)
        return cls.forward(*_unwrap_dead_wrappers(args))


# --------------------------------------------------------------------------- torch.func.vmap
#
# The kernels' autograd Functions carry explicit vmap rules rather than generate_vmap_rule: the kernels
# write into buffers they allocate (torch.empty, out=, in-place accumulation), which a generated rule
# would batch element by element, if at all. The rules fold the vmapped dim into the batch dim b and run
# the kernel once on (B*b, ...): one call, the same blocks, full speed.


def fold(t: torch.Tensor | None, dim: int | None, size: int) -> torch.Tensor | None:
    """A vmapped tensor with its vmap dim (size B, at ``dim``; None = not batched) folded into b.

    (..., b, ...) with the vmap dim at ``dim`` -> (B*b, ...). Unbatched tensors are repeated B times.
    """
    if t is None:
        return None
    t = t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)  # (B, b, ...)
    return t.reshape(size * t.shape[1], *t.shape[2:])  # (B*b, ...)


def unfold(t: torch.Tensor, size: int) -> torch.Tensor:
    """(B*b, ...) -> (B, b, ...): the kernel's result with the vmap dim back in front."""
    return t.view(size, t.shape[0] // size, *t.shape[1:])


def vmap_by_loop(function: type[torch.autograd.Function], info, in_dims: tuple, args: tuple):
    """A vmap rule that runs ``function`` once per vmapped element and stacks the outputs along dim 0.

    For dropout: its keep-masks are drawn per block from (seed, block shape), so an element must be run
    with its unbatched shapes to draw the same masks in forward and in backward.
    """
    outputs = []
    for n in range(info.batch_size):
        element = [a if dim is None else a.select(dim, n) for a, dim in zip(args, in_dims, strict=True)]
        outputs.append(function.apply(*element))
    stacked = tuple(None if parts[0] is None else torch.stack(parts) for parts in zip(*outputs, strict=True))
    return stacked, tuple(None if t is None else 0 for t in stacked)


def legacy_batched(*tensors: torch.Tensor | None) -> bool:
    """Whether a gradient comes batched by ``torch.autograd.grad(..., is_grads_batched=True)``.

    That batches the backward with torch's older vmap, which knows plain torch ops but no vmap rules of
    autograd Functions, and cannot run the kernels' in-place buffers: the backward then takes the dense
    closed form (:func:`dense_input_grads`) instead.
    """
    if _is_legacy_batched is None or torch.compiler.is_compiling():  # dynamo traces backward: no legacy vmap there
        return False
    return any(t is not None and _is_legacy_batched(t) for t in tensors)


_is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)  # private: may be absent


class FoldedMask:
    """A bound mask for a batch folded from ``copies`` vmapped elements: (B*b, ...) where the mask has b.

    Masks are bound to the unbatched sizes and are not vmapped themselves (a mask is a Python object,
    not a tensor argument): every vmapped element gets the same mask, so a per-batch tensor (padding,
    a (b, ...) bool or bias) is tiled B times. Implements the part of :class:`BoundMask` kernels use.
    """

    def __init__(self, mask: BoundMask | FoldedMask, copies: int):
        self.mask, self.copies = mask, copies
        self.softcap: float | None = mask.softcap  # applies to every element alike

    def state(self, rows: range, cols: range) -> BlockState:
        return self.mask.state(rows, cols)

    def may_empty_rows(self) -> bool:
        return self.mask.may_empty_rows()

    def block(
        self, rows: Index, cols: Index, heads: torch.Tensor | None = None, *, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        keep, bias = self.mask.block(rows, cols, heads, dtype=dtype)
        return self._tile(keep), self._tile(bias)

    def _tile(self, t: torch.Tensor | None) -> torch.Tensor | None:
        # the fold order is (vmap element, batch row): tiling dim 0 gives folded row n the mask of row n % b
        return t if t is None or t.shape[0] == 1 else t.repeat(self.copies, 1, 1, 1)

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.block(slice(None), slice(None), dtype=dtype)


# --------------------------------------------------------------------------- double backward
#
# The first-order backward is a blocked kernel (in-place buffers, no graph). Its own backward, needed only
# for double backward (create_graph=True, gradgradcheck, Hessians), differentiates the closed-form
# gradients below: dense (b, h, i, j) math in differentiable torch ops, built only when asked for.


def dense_input_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor | None,
    grad_weights: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    *,
    mask: BoundMask,
    scale: float,
    drop: torch.Tensor | None = None,
):
    """(dq, dk, dv) of attention as a differentiable function of the inputs and the incoming gradients.

    q (b, h, i, d), k (b, g, j, d), v (b, g, j, e); grad_out (b, h, i, e), grad_weights (b, h, i, j) (on
    the weights before dropout), grad_lse (b, h, i), each None when no gradient flows there; ``drop`` the
    (b, h, i, j) dropout multipliers (0 or 1 / (1 - p)) or None. With P the weights and Z = drop:

        O = (P * Z) V,  dV = (P * Z)^T dO,  dP = Z * (dO V^T) + dW,  dS = P * (dP - rowsum(P * dP) + dlse),
        dQ = scale * dS K,  dK = scale * dS^T Q     (dV, dK summed over the query heads sharing a k/v head)

    With a soft-cap (``mask.softcap``), dS is multiplied by the cap's derivative 1 - (t / cap)^2, t the
    capped score before the bias.
    """
    b, h, i, _ = q.shape
    g, j = k.shape[1], k.shape[2]
    work = compute_dtype(q.dtype)
    q_scaled = q.to(work) * scale  # (b, h, i, d)
    k_heads = k.to(work).repeat_interleave(h // g, dim=1)  # (b, h, j, d): query head n reads k head n // (h/g)
    v_heads = v.to(work).repeat_interleave(h // g, dim=1)  # (b, h, j, e)
    scores = q_scaled @ k_heads.transpose(-2, -1)  # (b, h, i, j)
    slope = None  # the soft-cap's derivative 1 - (t / cap)^2, differentiable (double backward)
    if mask.softcap is not None:
        ratio = torch.tanh(scores / mask.softcap)  # t / cap
        slope = 1.0 - ratio * ratio
        scores = ratio * mask.softcap
    scores = apply_mask(scores, *mask.dense(dtype=work))
    row_max = finite_or_zero(scores.amax(dim=-1, keepdim=True).detach())  # softmax is shift-invariant
    p = torch.exp(scores - row_max)
    total = p.sum(dim=-1, keepdim=True)
    p = p / total.masked_fill(total == 0, 1.0)  # rows with every key masked stay 0
    dp = torch.zeros_like(p) if grad_weights is None else grad_weights.to(work)
    dv = torch.zeros_like(v_heads)
    if grad_out is not None:
        d_out = grad_out.to(work)
        applied = p if drop is None else p * drop
        dv = applied.transpose(-2, -1) @ d_out  # (b, h, j, e)
        d_applied = d_out @ v_heads.transpose(-2, -1)  # (b, h, i, j)
        dp = dp + (d_applied if drop is None else d_applied * drop)
    ds = dp - (p * dp).sum(dim=-1, keepdim=True)
    if grad_lse is not None:
        ds = ds + grad_lse.to(work).unsqueeze(-1)
    ds = p * ds  # (b, h, i, j): with respect to the capped scores
    if slope is not None:
        ds = ds * slope  # with respect to the raw scaled scores
    dq = (ds @ k_heads) * scale
    dk = ds.transpose(-2, -1) @ q_scaled  # (b, h, j, d)

    def per_kv_head(t: torch.Tensor) -> torch.Tensor:  # (b, h, j, x) -> (b, g, j, x)
        return t.view(b, g, h // g, j, t.shape[-1]).sum(2)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


def double_backward(
    primals: dict[str, torch.Tensor | None],
    cotangents: tuple[torch.Tensor, ...],
    *,
    mask: BoundMask,
    scale: float,
    drop: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """The vector-Jacobian product of :func:`dense_input_grads` at ``primals`` (its tensor arguments by
    name: q, k, v and some of grad_out, grad_weights, grad_lse; a name left out or None is absent) with
    ``cotangents`` for (dq, dk, dv): one gradient per primal, in order.

    torch.func.vjp rather than torch.autograd.grad: it needs no leaves (so it stays differentiable, for
    third order) and it composes with torch.func transforms (vmap, jacrev) around the backward.
    """
    names = [name for name, t in primals.items() if t is not None]

    def first_order(*tensors: torch.Tensor):
        given = dict(zip(names, tensors, strict=True))  # the differentiated tensors, by name
        return dense_input_grads(
            given["q"],
            given["k"],
            given["v"],
            given.get("grad_out"),
            given.get("grad_weights"),
            given.get("grad_lse"),
            mask=mask,
            scale=scale,
            drop=drop,
        )

    vjp = torch.func.vjp(first_order, *(primals[name] for name in names))[1]  # (output, vjp_fn): no aux
    grads = dict(zip(names, vjp(cotangents), strict=True))
    return tuple(grads.get(name) for name in primals)
