"""Logit soft-capping (masks.softcap): s -> cap * tanh(s / cap) on the scaled scores, before any bias.

Every backend that serves it against a plain-math float64 oracle written here (not multihead's reference),
forward (output, weights, LSE, a WeightSelection) and backward (gradcheck, gradgradcheck, bfloat16 against
the tolerance rule), fully masked rows, vmap, dispatch (SDPA refuses it, auto picks another) and the errors.
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead
from multihead import masks
from multihead.backends import Capabilities, registry
from multihead.functional import WeightSelection, attention, attention_result
from support import assert_within_rule, is_input_error, make_qkv, randn

CAP = 2.0  # small enough that the scaled scores below (|s| up to ~10) reach tanh's flat part
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)  # ALiBi, one per query head
BACKENDS = ["reference", "materialized", "tiled", "auto"]
MASK_KINDS = ["alone", "causal", "padding", "window", "alibi", "combo"]
# b, h, g, i, j, d, e: pairwise distinct but for the GQA grouping h = 4, g = 2
SIZES = dict(b=3, h=4, g=2, i=5, j=7, d=6, e=9)


def make_inputs(i: int = 5, j: int = 7, *, dtype=torch.float64, seed: int = 0, device: torch.device | str = "cpu"):
    """q, k, v on ``device`` with scores large enough that the cap bends them (q scaled up 4x)."""
    q, k, v = make_qkv(**{**SIZES, "i": i, "j": j}, seed=seed, device=device)
    return [t.to(dtype) for t in (q * 4.0, k, v)]


# --------------------------------------------------------------------------- the oracle: plain math, no multihead


def plain_mask(kind: str, b: int, h: int, i: int, j: int, device: torch.device | str = "cpu"):
    """(our typed mask, the oracle's keep (b|1, h|1, i, j) bool or None, the oracle's bias or None), on ``device``.

    Causal, window and ALiBi are aligned bottom-right: query n sits at key position n + (j - i).
    """
    p = torch.arange(i, device=device)[:, None] + (j - i)  # (i, 1) aligned query positions
    key = torch.arange(j, device=device)[None, :]  # (1, j)
    lengths = torch.tensor([j, 3, 0], device=device)[:b]  # batch row 2 has no key at all
    slopes = SLOPES.to(device)
    causal_keep = (key <= p)[None, None]
    padding_keep = (key[None] < lengths[:, None, None])[:, None]  # (b, 1, 1, j)
    alibi_bias = -slopes[:h, None, None] * (key - p).abs().double()  # (h, i, j)
    cap = masks.softcap(CAP)
    if kind == "alone":
        return cap, None, None
    if kind == "causal":
        return masks.causal() & cap, causal_keep, None
    if kind == "padding":
        return cap & masks.padding(lengths), padding_keep, None
    if kind == "window":
        return masks.window(2, 1) & cap, ((key >= p - 2) & (key <= p + 1))[None, None], None
    if kind == "alibi":
        return masks.alibi(slopes[:h].float()) & cap, None, alibi_bias[None]
    if kind == "combo":
        mask = masks.causal() & masks.padding(lengths) & masks.alibi(slopes[:h].float()) & cap
        return mask, causal_keep & padding_keep, alibi_bias[None]
    raise ValueError(kind)


def oracle(q, k, v, *, cap=CAP, keep=None, bias=None, scale=None, dtype=torch.float64):
    """softmax(cap * tanh(q k^T * scale / cap) + bias, -inf where not keep) v, in ``dtype`` throughout.

    Returns output (b, h, i, e), weights (b, h, i, j), lse (b, h, i); rows with no key give 0 and lse -inf.
    Differentiable (for the gradient checks).
    """
    q, k, v = (t.to(dtype) for t in (q, k, v))
    h, g, d = q.shape[1], k.shape[1], q.shape[-1]
    k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)  # query head n reads n // (h/g)
    s = (q @ k.transpose(-2, -1)) * (d**-0.5 if scale is None else scale)
    if cap is not None:
        s = cap * torch.tanh(s / cap)  # the cap first ...
    if bias is not None:
        s = s + bias.to(dtype)  # ... then the bias
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    dead = torch.isneginf(s).all(-1, keepdim=True)  # (b, h, i, 1): every key masked
    s = s.masked_fill(dead, 0.0)
    weights = torch.softmax(s, dim=-1).masked_fill(dead, 0.0)
    lse = torch.logsumexp(s, dim=-1).masked_fill(dead.squeeze(-1), -math.inf)
    return weights @ v, weights, lse


# --------------------------------------------------------------------------- forward


@pytest.mark.portable
@pytest.mark.parametrize("lengths", [(5, 7), (7, 5)], ids=["i<j", "i>j"])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_matches_the_plain_oracle(backend, kind, lengths, small_blocks, device):
    i, j = lengths
    q, k, v = make_inputs(i, j, device=device)
    mask, keep, bias = plain_mask(kind, SIZES["b"], SIZES["h"], i, j, device=device)
    want_out, want_weights, want_lse = oracle(q, k, v, keep=keep, bias=bias)
    lse_too = backend != "materialized"  # materialized returns no LSE
    got = attention_result(q, k, v, mask=mask, backend=backend, return_weights=True, return_lse=lse_too)
    torch.testing.assert_close(got.output, want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.weights, want_weights, rtol=0, atol=1e-12)
    if lse_too:
        assert torch.equal(torch.isneginf(got.lse), torch.isneginf(want_lse))
        torch.testing.assert_close(got.lse, want_lse, rtol=0, atol=1e-12)


@pytest.mark.portable
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_small_cap_changes_the_output_and_a_huge_one_does_not(backend, small_blocks, device):
    """Sanity: the tests above can fail. cap = 0.5 moves the output far; cap = 1e6 is no cap to tolerance."""
    q, k, v = make_inputs(device=device)
    plain = attention(q, k, v, causal=True, backend=backend)
    capped = attention(q, k, v, mask=masks.causal() & masks.softcap(0.5), backend=backend)
    assert (capped - plain).abs().max() > 0.1
    torch.testing.assert_close(capped, oracle(q, k, v, cap=0.5, keep=plain_mask("causal", 3, 4, 5, 7, device)[1])[0])
    huge = attention(q, k, v, mask=masks.causal() & masks.softcap(1e6), backend=backend)
    torch.testing.assert_close(huge, plain, rtol=0, atol=1e-9)


@pytest.mark.portable
def test_the_cap_applies_before_the_bias(small_blocks, device):
    """cap * tanh((s + bias) / cap) would differ: with a bias far below -cap the two orders part."""
    q, k, v = make_inputs(device=device)
    bias = torch.linspace(-20.0, 5.0, 7, dtype=torch.float64, device=device).expand(5, 7)  # (i, j)
    got = attention(q, k, v, mask=masks.softcap(CAP) & masks.bias(bias), backend="tiled")
    torch.testing.assert_close(got, oracle(q, k, v, bias=bias)[0], rtol=0, atol=1e-12)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    capped_after_bias = CAP * torch.tanh(((q @ kk.transpose(-2, -1)) * 6**-0.5 + bias) / CAP)  # the other order
    assert (got - torch.softmax(capped_after_bias, -1) @ vv).abs().max() > 0.1


@pytest.mark.portable
@pytest.mark.parametrize("needs_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("backend", ["tiled", "materialized", "reference"])
def test_weight_selection_matches_the_oracle(backend, needs_grad, small_blocks, device):
    """Selected heads and rows (computed apart from the kernel for tiled: both its in-place and its
    differentiable paths), and the gradient through them."""
    q, k, v = make_inputs(device=device)
    mask, keep, bias = plain_mask("combo", 3, 4, 5, 7, device)
    heads, queries = [3, 0], [4, 1, 2]
    leaves = [t.clone().requires_grad_(needs_grad) for t in (q, k, v)]
    got = attention_result(*leaves, mask=mask, backend=backend, return_weights=WeightSelection(heads, queries)).weights
    oracle_leaves = [t.clone().requires_grad_(needs_grad) for t in (q, k, v)]
    want = oracle(*oracle_leaves, keep=keep, bias=bias)[1][:, heads][:, :, queries]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    if needs_grad:
        cotangent = randn(*want.shape, seed=3, device=device)
        grads = torch.autograd.grad((got * cotangent).sum(), leaves[:2])
        want_grads = torch.autograd.grad((want * cotangent).sum(), oracle_leaves[:2])
        for a, b in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.portable
@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_forward_within_the_tolerance_rule(backend, small_blocks, device):
    q, k, v = make_inputs(device=device)
    mask, keep, bias = plain_mask("combo", 3, 4, 5, 7, device)
    ref64 = oracle(q, k, v, keep=keep, bias=bias)[0]
    low = [t.to(torch.bfloat16) for t in (q, k, v)]
    ref_lowp = oracle(*low, keep=keep, bias=bias, dtype=torch.bfloat16)[0]
    got = attention(*low, mask=mask, backend=backend)
    assert got.dtype == torch.bfloat16
    assert_within_rule(got, ref64, ref_lowp, what=f"{backend} bf16 output")
    float32 = attention(*(t.float() for t in (q, k, v)), mask=mask, backend=backend)
    torch.testing.assert_close(got.float(), float32, rtol=0, atol=3e-2)  # close to the float32 result


# --------------------------------------------------------------------------- backward


def with_finite_lse(res):
    """(output, lse with -inf on rows without keys set to 0) for the numerical checks."""
    return res.output, res.lse.masked_fill(torch.isneginf(res.lse), 0.0)


def differentiable(backend: str, mask):
    """The backend's outputs as a function of (q, k, v): output and LSE (tiled, reference) or weights."""
    if backend == "materialized":
        return lambda q, k, v: tuple(attention_result(q, k, v, mask=mask, backend=backend, return_weights=True)[:2])
    return lambda q, k, v: with_finite_lse(attention_result(q, k, v, mask=mask, backend=backend, return_lse=True))


@pytest.mark.portable
@pytest.mark.parametrize("kind", ["alone", "combo"])
@pytest.mark.parametrize("backend", ["tiled", "materialized", "reference"])
def test_gradcheck(backend, kind, small_blocks, device):
    q, k, v = (t.detach().requires_grad_(True) for t in make_inputs(7, 5, device=device))  # i > j: rows with no key
    mask = plain_mask(kind, 3, 4, 7, 5, device)[0]
    assert torch.autograd.gradcheck(differentiable(backend, mask), (q, k, v), fast_mode=True)


@pytest.mark.portable
@pytest.mark.parametrize("backend", ["tiled", "materialized"])
def test_gradgradcheck(backend, small_blocks, device):
    """Double backward differentiates the dense closed form, which carries the cap's derivative too."""
    q, k, v = (t.detach().requires_grad_(True) for t in make_inputs(7, 5, device=device))
    mask = plain_mask("combo", 3, 4, 7, 5, device)[0]
    assert torch.autograd.gradgradcheck(differentiable(backend, mask), (q, k, v), fast_mode=True)


@pytest.mark.portable
@pytest.mark.parametrize("backend", ["tiled", "materialized", "reference"])
def test_gradients_match_the_oracle(backend, small_blocks, device):
    q, k, v = make_inputs(device=device)
    mask, keep, bias = plain_mask("combo", 3, 4, 5, 7, device)
    dout = randn(3, 4, 5, 9, seed=5, device=device)
    got_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    got = torch.autograd.grad((attention(*got_leaves, mask=mask, backend=backend) * dout).sum(), got_leaves)
    want = torch.autograd.grad((oracle(*want_leaves, keep=keep, bias=bias)[0] * dout).sum(), want_leaves)
    for name, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=f"d{name}")


@pytest.mark.portable
@pytest.mark.parametrize("backend", ["tiled", "materialized", "reference"])
def test_bfloat16_gradients_within_the_tolerance_rule(backend, small_blocks, device):
    """Half types: materialized recomputes the float32 weights (and the cap's derivative) per row block."""
    q, k, v = make_inputs(device=device)
    mask, keep, bias = plain_mask("combo", 3, 4, 5, 7, device)
    dout = randn(3, 4, 5, 9, seed=5, device=device)

    def grads(fn, dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        return torch.autograd.grad((fn(*leaves) * dout.to(dtype)).sum(), leaves)

    ref64 = grads(lambda *a: oracle(*a, keep=keep, bias=bias)[0], torch.float64)
    ref_lowp = grads(lambda *a: oracle(*a, keep=keep, bias=bias, dtype=torch.bfloat16)[0], torch.bfloat16)
    fast = grads(lambda *a: attention(*a, mask=mask, backend=backend), torch.bfloat16)
    for name, f, r64, rlp in zip("qkv", fast, ref64, ref_lowp, strict=True):
        assert_within_rule(f, r64, rlp, what=f"{backend} bf16 d{name}")


@pytest.mark.portable
@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_give_zero_output_and_zero_gradient(backend, small_blocks, device):
    q, k, v = (t.detach().requires_grad_(True) for t in make_inputs(7, 5, device=device))
    mask = masks.causal() & masks.padding(torch.tensor([5, 3, 0], device=device)) & masks.softcap(CAP)
    out = attention(q, k, v, mask=mask, backend=backend)
    out.backward(torch.ones_like(out))
    dead_rows = out[:, :, :2], out[2]  # i > j: rows 0-1 see no key (bottom-right); batch row 2 has none
    for part in (*dead_rows, q.grad[:, :, :2], q.grad[2], k.grad[2], v.grad[2]):
        assert torch.equal(part, torch.zeros_like(part))
    for t in (out, q.grad, k.grad, v.grad):
        assert not t.isnan().any()


@pytest.mark.portable
def test_batched_gradients_take_the_dense_closed_form(small_blocks, device):
    """is_grads_batched runs the backward as dense_input_grads, which carries the cap's derivative."""
    q, k, v = (t.detach().requires_grad_(True) for t in make_inputs(device=device))
    mask = plain_mask("combo", 3, 4, 5, 7, device)[0]
    out = attention(q, k, v, mask=mask, backend="tiled")
    cotangents = randn(2, *out.shape, seed=4, device=device)
    batched = torch.autograd.grad(out, q, cotangents, is_grads_batched=True, retain_graph=True)[0]
    looped = torch.stack([torch.autograd.grad(out, q, c, retain_graph=True)[0] for c in cotangents])
    torch.testing.assert_close(batched, looped, rtol=0, atol=1e-12)


@pytest.mark.portable
def test_vmap_over_a_batch_equals_the_loop_for_tiled(small_blocks, device):
    """Forward and vjp under torch.func.vmap: the folded mask keeps the cap."""
    q, k, v = make_inputs(device=device)
    qs = torch.stack([q, q.flip(2) * 0.5])  # (2, b, h, i, d)
    mask = plain_mask("combo", 3, 4, 5, 7, device)[0]

    def fn(x):
        return attention(x, k, v, mask=mask, backend="tiled")

    torch.testing.assert_close(torch.func.vmap(fn)(qs), torch.stack([fn(x) for x in qs]), rtol=0, atol=1e-12)
    grad = torch.func.grad(lambda x: fn(x).square().sum())
    torch.testing.assert_close(torch.func.vmap(grad)(qs), torch.stack([grad(x) for x in qs]), rtol=0, atol=1e-12)
    keep, bias = plain_mask("combo", 3, 4, 5, 7, device)[1:]
    want = torch.stack([oracle(x, k, v, keep=keep, bias=bias)[0] for x in qs])
    torch.testing.assert_close(torch.func.vmap(fn)(qs), want, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- dispatch


def test_sdpa_is_passed_over_with_its_reason():
    q, k, v = make_inputs()
    explanation = multihead.explain(q, k, v, mask=masks.causal() & masks.softcap(50.0))
    assert explanation.chosen == "tiled"
    assert any("logit soft-capping" in why for why in explanation.rejected["sdpa"])
    assert "sdpa: logit soft-capping" in str(explanation)
    without = multihead.explain(q, k, v, mask=masks.causal())
    assert not any("soft-capping" in why for why in without.rejected.get("sdpa", []))


@pytest.mark.portable
def test_naming_sdpa_is_refused_clearly(device):
    q, k, v = make_inputs(device=device)
    with pytest.raises(ValueError, match=r"'sdpa' requested.*sdpa lacks logit soft-capping.*Fix: use backend='auto'"):
        attention(q, k, v, mask=masks.softcap(50.0), backend="sdpa")


def test_a_backend_that_does_not_declare_softcap_refuses_it(monkeypatch):
    """Capabilities.softcap defaults to False: a backend registered without it never silently drops the cap."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register("mine", lambda *a, **kw: None, Capabilities(), priority=1)
    q, k, v = make_inputs()
    explanation = multihead.explain(q, k, v, mask=masks.softcap(30.0))
    assert explanation.chosen == "tiled"
    assert explanation.rejected["mine"] == ["logit soft-capping (it applies no transform to the scores)"]


# --------------------------------------------------------------------------- the mask itself and its errors


@pytest.mark.parametrize(
    "cap, kind, fragment",
    [
        (0, ValueError, "got 0."),
        (0.0, ValueError, "got 0.0."),
        (-3.0, ValueError, "got -3.0."),
        (math.nan, ValueError, "got nan."),
        (math.inf, ValueError, "got inf."),
        (-math.inf, ValueError, "got -inf."),
        (10**400, ValueError, "got int 1000"),
        ("50", TypeError, "got str '50'"),
        (None, TypeError, "got NoneType None"),
        (True, TypeError, "got bool True"),
        (torch.tensor(50.0), TypeError, "got tensor of shape ()"),
    ],
)
def test_bad_caps_are_refused(cap, kind, fragment):
    with pytest.raises(kind) as caught:
        masks.softcap(cap)
    assert is_input_error(caught.value, kind)
    message = str(caught.value)
    assert message.startswith("softcap(cap=...): expected a finite real number > 0, got ")
    assert fragment in message and "Fix: " in message


def test_two_caps_in_one_mask_are_refused_naming_both():
    with pytest.raises(
        ValueError, match=r"mask: expected at most one softcap.*softcap\(cap=50.0\) and softcap\(cap=30.0\)"
    ):
        masks.softcap(50.0) & masks.causal() & masks.softcap(30.0)
    with pytest.raises(ValueError, match="at most one softcap"):
        attention(*make_inputs(), mask=masks.softcap(50.0) & masks.causal() & masks.softcap(30))


@pytest.mark.portable
def test_the_bound_mask_exposes_the_cap_and_lists_it(device):
    shape = masks.AttentionShape(3, 4, 5, 7, device)
    mask = masks.causal("top_left") & masks.softcap(50)
    assert repr(mask) == "causal(align='top_left') & softcap(cap=50.0)"
    bound = masks.bind_mask(mask, False, shape)
    assert bound.softcap == 50.0 and isinstance(bound.softcap, float)
    assert bound.kinds() == ["diagonal", "softcap"]
    assert "softcap=50.0" in repr(bound)
    assert not bound.is_plain_causal  # SDPA's is_causal alone would drop the cap
    alone = masks.bind_mask(masks.softcap(30.0), False, shape)
    assert not alone.is_empty and alone.kinds() == ["softcap"]
    assert not alone.may_empty_rows() and alone.dense(torch.float64) == (None, None)  # it masks no pair
    assert masks.bind_mask(masks.causal(), True, shape).softcap is None
    assert "softcap" in masks.__all__
