"""The blocked kernels (tiled, spans, materialized) in the whole PyTorch autograd stack.

gradcheck and gradgradcheck, double backward against the reference's, batched gradients
(``is_grads_batched``), torch.func (vmap, grad, vjp, jacrev) and autocast. The backend functions are
called directly, with a bound mask; a few calls go through ``multihead.attention``. Every test is portable: its
inputs, masks and cotangents are drawn on the CPU and moved to the --device.
"""

from __future__ import annotations

import math

import pytest
import torch

from multihead import masks
from multihead.backends import materialized, reference, spans, tiled
from multihead.functional import attention_result
from multihead.masks import AttentionShape, bind_mask
from support import make_qkv

pytestmark = pytest.mark.portable

# b, h, g, i, j, d, e: grouped heads (g < h), d != e, i > j so bottom-right causal leaves rows 0-1 with no key
SIZES = dict(b=2, h=6, g=3, i=7, j=5, d=4, e=8)
KERNELS = {
    "tiled": tiled.tiled_attention,
    "spans": spans.spans_attention,
    "materialized": materialized.materialized_attention,
    "reference": reference.reference_attention,
}
LSE_KERNELS = ("tiled", "spans")  # the kernels returning the LSE (the others here: their weights)


def make_mask(b: int, h: int, i: int, j: int, *, seed: int = 3, device: torch.device | str = "cpu") -> masks.Mask:
    """Every kind of term, some per batch row (so a vmap fold must tile them): fully masked rows included.
    Its tensors on ``device`` (the random one drawn on the CPU and moved)."""
    keep = torch.rand(b, 1, i, j, generator=torch.Generator().manual_seed(seed)) < 0.8
    keep[-1, :, min(4, i - 1)] = False  # one more row with no key, through a boolean term alone
    return (
        masks.causal()
        & masks.padding(torch.tensor([j, 3] + [2] * (b - 2), device=device)[:b])
        & masks.alibi(masks.alibi_slopes(h).to(device))
        & masks.allowed(keep.to(device))
    )


def bound(q: torch.Tensor, k: torch.Tensor, mask: masks.Mask | None = None):
    b, h, i, _ = q.shape
    if mask is None:
        mask = make_mask(b, h, i, k.shape[2], device=q.device)
    return bind_mask(mask, False, AttentionShape(b, h, i, k.shape[2], q.device))


def call(backend: str, q, k, v, mask, *, like: str | None = None, dropout: float = 0.0, finite: bool = False):
    """``backend``'s kernel, called as dispatch calls it: (output, lse) like tiled and spans, or (output, weights)
    like materialized (``like`` defaults to ``backend``).

    ``finite``: the LSE's -inf (rows with no key) replaced by 0, for the numerical checks.
    """
    res = KERNELS[backend](q, k, v, mask=mask, scale=0.5, dropout=dropout, need_weights=True, need_lse=True)
    second = res.lse if (like or backend) in LSE_KERNELS else res.weights
    if finite:
        second = second.masked_fill(second == -math.inf, 0.0)
    return res.output, second


def reference_call(like: str, q, k, v, mask, *, finite: bool = False):
    """The reference's (output, lse) or (output, weights), matching ``like``'s kernel."""
    return call("reference", q, k, v, mask, like=like, finite=finite)


def weighted_loss(outputs, weights) -> torch.Tensor:
    return sum((o * w).sum() for o, w in zip(outputs, weights, strict=True))


def random_like(outputs, seed: int, batch: tuple[int, ...] = ()):
    """Seeded cotangents (batch..., *o.shape) in each output's dtype, drawn on the CPU, on its device."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*batch, *o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outputs)


# --------------------------------------------------------------------------- gradcheck, double backward


@pytest.mark.parametrize("backend", ["tiled", "spans", "materialized"])
def test_gradcheck_through_output_and_lse_or_weights(backend, small_blocks, device):
    q, k, v = make_qkv(**SIZES, requires_grad=True, device=device)
    mask = bound(q, k)
    assert torch.autograd.gradcheck(
        lambda q, k, v: call(backend, q, k, v, mask, finite=True), (q, k, v), fast_mode=True
    )


@pytest.mark.parametrize("backend,dropout", [("tiled", 0.0), ("tiled", 0.3), ("spans", 0.0), ("materialized", 0.0)])
def test_gradgradcheck(backend, dropout, small_blocks, device):
    """Double backward through the output and the LSE (tiled) or the weights (materialized); under dropout
    the double backward rebuilds the keep-masks the blocks drew."""
    q, k, v = make_qkv(**SIZES, requires_grad=True, device=device)
    mask = bound(q, k)

    def fn(q, k, v):
        torch.manual_seed(0)  # one dropout pattern for every evaluation
        return call(backend, q, k, v, mask, dropout=dropout, finite=True)

    assert torch.autograd.gradgradcheck(fn, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("backend", ["tiled", "spans", "materialized"])
def test_double_backward_equals_the_reference(backend, small_blocks, device):
    """create_graph=True: the first-order gradients are the plain ones, bit for bit, and the gradients of
    a loss on them equal the reference's (whose double backward is torch's own)."""
    q, k, v = make_qkv(**SIZES, seed=1, device=device)
    mask = bound(q, k)
    got, want, plain = {}, {}, {}
    for name, fn, store in (
        (backend, lambda *a: call(backend, *a, mask, finite=True), got),
        ("reference", lambda *a: reference_call(backend, *a, mask, finite=True), want),
    ):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        outputs = fn(*leaves)
        loss = weighted_loss(outputs, random_like(outputs, seed=5))
        first = torch.autograd.grad(loss, leaves, create_graph=True)
        second = torch.autograd.grad(weighted_loss(first, random_like(first, seed=6)), leaves)
        store.update(first=first, second=second)
        if name == backend:
            plain = torch.autograd.grad(weighted_loss(fn(*leaves), random_like(outputs, seed=5)), leaves)
    for a, b in zip(got["first"], plain, strict=True):
        assert torch.equal(a.detach(), b)
    for what in ("first", "second"):
        for name, a, b in zip("qkv", got[what], want[what], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"{what}-order d{name}")


def test_third_order_equals_the_reference(small_blocks, device):
    """The double backward is itself differentiable (torch.func.vjp, no detached leaves)."""
    q, k, v = make_qkv(b=1, h=4, g=2, i=5, j=3, d=2, e=6, seed=2, device=device)
    results = []
    for fn in (
        lambda *a: call("tiled", *a, bound(q, k), finite=True)[0],
        lambda *a: reference_call("tiled", *a, bound(q, k))[0],
    ):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        (dq,) = torch.autograd.grad(fn(qq, kk, vv).sin().sum(), qq, create_graph=True)
        (dk,) = torch.autograd.grad(dq.sin().sum(), kk, create_graph=True)
        results.append(torch.autograd.grad(dk.sin().sum(), (qq, kk, vv)))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


# --------------------------------------------------------------------------- batched gradients


@pytest.mark.parametrize("backend", ["tiled", "spans", "materialized"])
def test_is_grads_batched_equals_a_loop_over_grad_outputs(backend, small_blocks, device):
    q, k, v = make_qkv(**SIZES, requires_grad=True, device=device)
    outputs = call(backend, q, k, v, bound(q, k))
    grad_outputs = random_like(outputs, seed=4, batch=(3,))
    batched = torch.autograd.grad(outputs, (q, k, v), grad_outputs, retain_graph=True, is_grads_batched=True)
    for n in range(3):
        looped = torch.autograd.grad(outputs, (q, k, v), [g[n] for g in grad_outputs], retain_graph=True)
        for name, a, b in zip("qkv", batched, looped, strict=True):
            torch.testing.assert_close(a[n], b, rtol=0, atol=1e-12, msg=f"d{name}, grad output {n}")


def test_batched_grads_under_dropout_go_through_torch_func(small_blocks, device):
    """is_grads_batched refuses random ops, which a dropout backward needs: a clear error naming the
    way that works, vmap over vjp, which draws each element's masks as the forward did."""
    q, k, v = make_qkv(**SIZES, requires_grad=True, device=device)
    mask = bound(q, k)
    torch.manual_seed(0)
    outputs = call("tiled", q, k, v, mask, dropout=0.3)
    grad_outputs = random_like(outputs, seed=4, batch=(3,))
    with pytest.raises(NotImplementedError, match="torch.func.vmap over torch.func.vjp"):
        torch.autograd.grad(outputs, (q, k, v), grad_outputs, retain_graph=True, is_grads_batched=True)
    torch.manual_seed(0)
    outputs_again, vjp = torch.func.vjp(lambda q, k, v: call("tiled", q, k, v, mask, dropout=0.3), q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(outputs_again, outputs, strict=True))
    batched = torch.func.vmap(vjp)(grad_outputs)
    for n in range(3):
        looped = torch.autograd.grad(outputs, (q, k, v), [g[n] for g in grad_outputs], retain_graph=True)
        for name, a, b in zip("qkv", batched, looped, strict=True):
            torch.testing.assert_close(a[n], b, rtol=0, atol=1e-12, msg=f"d{name}, grad output {n}")


# --------------------------------------------------------------------------- torch.func


def stacked(rows):
    return tuple(torch.stack(parts) for parts in zip(*rows, strict=True))


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (0, None, None), (None, 2, 2)], ids=["all", "q_only", "kv_dim2"])
@pytest.mark.parametrize("backend", ["tiled", "materialized"])
def test_vmap_equals_the_loop(backend, in_dims, small_blocks, device):
    """The mask is bound to the unbatched sizes and shared by every vmapped element, per-batch terms
    (padding, a (b, 1, i, j) boolean) included."""
    batch = 3
    q, k, v = make_qkv(**SIZES, device=device)
    mask = bound(q, k)
    gen = torch.Generator().manual_seed(8)
    args = [
        t
        if dim is None
        else torch.randn(*t.shape[:dim], batch, *t.shape[dim:], generator=gen, dtype=t.dtype).to(device)
        for t, dim in zip((q, k, v), in_dims, strict=True)
    ]
    got = torch.func.vmap(lambda *a: call(backend, *a, mask), in_dims=in_dims)(*args)
    want = stacked(
        call(backend, *(a if dim is None else a.select(dim, n) for a, dim in zip(args, in_dims, strict=True)), mask)
        for n in range(batch)
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs",
    [dict(backend="tiled"), dict(backend="materialized"), dict(return_weights=True), dict(return_lse=True)],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()),
)
def test_vmap_through_attention_equals_the_loop(kwargs, small_blocks, device):
    q, k, v = make_qkv(**SIZES, device=device)
    qs = torch.stack([q, 2 * q, -q])  # (3, b, h, i, d)
    mask = make_mask(SIZES["b"], SIZES["h"], SIZES["i"], SIZES["j"], device=device)

    def fn(q):
        res = attention_result(q, k, v, mask=mask, **kwargs)
        return tuple(t for t in res if t is not None)

    for a, b in zip(torch.func.vmap(fn)(qs), stacked(fn(x) for x in qs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["tiled", "materialized"])
def test_vmap_of_grad_and_of_vjp_equal_the_loop(backend, small_blocks, device):
    q, k, v = make_qkv(**SIZES, device=device)
    mask = bound(q, k)
    qs = torch.stack([q, 2 * q, -q])

    def loss(q, k, v):
        out, second = call(backend, q, k, v, mask, finite=True)
        return out.sin().sum() + second.square().sum()

    grad = torch.func.grad(loss, argnums=(0, 1, 2))
    batched = torch.func.vmap(grad, in_dims=(0, None, None))(qs, k, v)
    for a, b in zip(batched, stacked(grad(x, k, v) for x in qs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    outputs, vjp = torch.func.vjp(lambda q, k, v: call(backend, q, k, v, mask), q, k, v)
    cotangents = random_like(outputs, seed=9, batch=(4,))
    batched = torch.func.vmap(vjp)(cotangents)
    for a, b in zip(batched, stacked(vjp(tuple(c[n] for c in cotangents)) for n in range(4)), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["tiled", "materialized"])
def test_jacrev_of_grad_is_the_reference_hessian(backend, small_blocks, device):
    """torch.func's Hessian: vmap over the double backward."""
    q, k, v = make_qkv(b=1, h=4, g=2, i=5, j=3, d=2, e=6, seed=4, device=device)
    mask = bound(q, k)

    def hessian(fn):
        return torch.func.jacrev(torch.func.grad(lambda q: sum(o.sin().sum() for o in fn(q))))(q)

    hessians = [
        hessian(lambda q: call(backend, q, k, v, mask, finite=True)),
        hessian(lambda q: reference_call(backend, q, k, v, mask, finite=True)),
    ]
    torch.testing.assert_close(*hessians, rtol=0, atol=1e-10)


def test_vmap_dropout_follows_the_randomness_flag(small_blocks, device):
    q, k, _ = make_qkv(**SIZES, device=device)
    v = torch.eye(5, dtype=torch.float64, device=device).expand(
        2, 3, 5, 5
    )  # one-hot values: the output is the applied weights
    mask = bound(q, k)
    qs = torch.stack([q, q, q])

    def fn(q):
        return call("tiled", q, k, v, mask, dropout=0.4)[0]

    with pytest.raises(RuntimeError, match="randomness"):
        torch.func.vmap(fn)(qs)
    # "same": every element gets the pattern an unbatched call draws from the same torch seed
    torch.manual_seed(0)
    same = torch.func.vmap(fn, randomness="same")(qs)
    torch.manual_seed(0)
    single = fn(q)
    assert all(torch.equal(x, single) for x in same)
    # "different": patterns differ between elements, and each element's backward uses its own pattern:
    # for loss = output.sum() and v = I, dv[..., j, :] is the sum of the applied weights on key j

    def loss_and_output(q, v):
        out = call("tiled", q, k, v, mask, dropout=0.4)[0]
        return out.sum(), out

    dv, (_, out) = torch.func.vmap(
        torch.func.grad_and_value(loss_and_output, argnums=1, has_aux=True), in_dims=(0, None), randomness="different"
    )(qs, v)
    assert not torch.equal(out[0], out[1])
    applied = out.view(3, 2, 3, 2, 7, 5).sum((3, 4))  # (vmap, b, g, j): summed over grouped heads and rows
    torch.testing.assert_close(dv, applied.unsqueeze(-1).expand_as(dv), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("backend", ["tiled", "spans", "materialized"])
def test_autocast_casts_the_inputs_and_keeps_out_of_the_kernels(backend, dtype, small_blocks, device):
    """Under autocast the kernels run in the autocast dtype, as torch's SDPA does (float64 is left alone),
    forward and backward; the result is the kernel's own result for inputs of that dtype."""
    q, k, v = (t.to(dtype).requires_grad_(True) for t in make_qkv(**SIZES, device=device))
    mask = bound(q, k)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        outputs = call(backend, q, k, v, mask)
        weighted_loss(outputs, random_like(outputs, seed=2)).backward()  # backward inside autocast too
    run_dtype = torch.float64 if dtype == torch.float64 else torch.bfloat16
    # the output in the run dtype, and so materialized's weights; the LSE in float32 for half inputs
    second_dtype = torch.float32 if backend in LSE_KERNELS and run_dtype == torch.bfloat16 else run_dtype
    assert [o.dtype for o in outputs] == [run_dtype, second_dtype]
    assert [t.grad.dtype for t in (q, k, v)] == [dtype] * 3
    plain = [t.detach().to(run_dtype).requires_grad_(True) for t in (q, k, v)]
    expected = call(backend, *plain, mask)
    weighted_loss(expected, random_like(expected, seed=2)).backward()
    for got, want in zip(outputs, expected, strict=True):
        assert torch.equal(got, want)
    for t, p in zip((q, k, v), plain, strict=True):
        assert torch.equal(t.grad, p.grad.to(dtype))
