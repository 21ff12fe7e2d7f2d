"""Every backend against the float64 reference: outputs, gradients, LSE, weights, for every mask kind."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead
from multihead import masks
from multihead.backends._blocks import softmax_rows_
from multihead.functional import WeightSelection, attention, attention_result
from support import assert_within_rule, make_qkv, textbook_lowp, tiny_blocks

FAST_BACKENDS = ["sdpa", "tiled", "spans", "materialized"]
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def make_mask(kind: str, b: int, h: int, i: int, j: int, seed: int = 1, device: torch.device | str = "cpu"):
    """One mask of each kind for a (b, h, i, j) call on ``device``; some kinds leave rows with no key at all.

    Random parts are drawn on the CPU and moved, so every device gets the same mask."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "causal":
        return masks.causal()
    if kind == "causal_top_left":
        return masks.causal("top_left")
    if kind == "window":
        return masks.window(2, 1)
    if kind == "padding_lengths":
        return masks.padding(torch.tensor([j, 2] + [1] * (b - 2), device=device)[:b])
    if kind == "padding_valid":
        valid = (torch.rand(b, j, generator=gen, device="cpu") < 0.6).to(device)
        valid[0] = False  # batch 0 has no real key: every row fully masked
        return masks.padding(valid)
    if kind == "alibi":
        return masks.alibi(masks.alibi_slopes(h).to(device))
    if kind == "bias":
        return masks.bias(torch.randn(b, 1, i, j, generator=gen, dtype=torch.float64, device="cpu").to(device))
    if kind == "bool_tensor":
        keep = (torch.rand(i, j, generator=gen, device="cpu") < 0.7).to(device)
        keep[1] = False  # one fully masked row
        return keep
    if kind == "float_neg_inf":
        bias = torch.randn(h, i, j, generator=gen, dtype=torch.float64, device="cpu").to(device)
        bias[:, 0] = -math.inf  # a row masked through the bias alone
        return bias
    if kind == "documents":  # packed documents of random lengths, a different split in each batch row
        return masks.documents(packed_documents(b, j, gen).to(device))
    if kind == "documents_combo":
        return (
            masks.documents(packed_documents(b, j, gen).to(device))
            & masks.causal()
            & masks.padding(torch.tensor([j, 3] + [2] * (b - 2), device=device)[:b])
            & masks.alibi(masks.alibi_slopes(h).to(device))
        )
    if kind == "combo":
        return (
            masks.causal()
            & masks.padding(torch.tensor([j, 3] + [2] * (b - 2), device=device)[:b])
            & masks.alibi(masks.alibi_slopes(h).to(device))
        )
    raise ValueError(kind)


def packed_documents(b: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """(b, n) document indices of b packed rows: each row cut at random places into documents numbered up from a
    random start (a document of one position included where the cuts fall so)."""
    cuts = torch.rand(b, n, generator=generator) < 0.35
    cuts[:, 0] = False
    start = torch.randint(0, 5, (b, 1), generator=generator)
    return start + cuts.long().cumsum(1)


MASK_KINDS = [
    "none",
    "causal",
    "causal_top_left",
    "window",
    "padding_lengths",
    "padding_valid",
    "alibi",
    "bias",
    "bool_tensor",
    "float_neg_inf",
    "combo",
    "documents",
    "documents_combo",
]


def cast_mask(mask, dtype):
    """Float mask tensors follow the inputs' dtype, as a user's would."""
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        return mask.to(dtype)
    return mask


def run(backend, q, k, v, mask, *, dout, **kwargs):
    """Output and input gradients of one backend; q, k, v are leaves that require grad."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    if backend == "textbook_lowp":
        out = textbook_lowp(q, k, v, mask=cast_mask(mask, q.dtype), **kwargs)[0]
    else:
        out = attention(q, k, v, mask=cast_mask(mask, q.dtype), backend=backend, **kwargs)
    out.backward(dout.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.portable
@pytest.mark.parametrize("lengths", [(5, 7), (7, 5)], ids=["i<j", "i>j"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_backend_matches_reference(backend, kind, dtype, lengths, small_blocks, device):
    i, j = lengths
    q, k, v = make_qkv(b=2, h=6, g=3, i=i, j=j, d=4, e=3, device=device)
    mask = make_mask(kind, 2, 6, i, j, device=device)
    dout = torch.randn(2, 6, i, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64, device="cpu").to(
        device
    )
    ref64 = run("reference", q, k, v, mask, dout=dout)
    low = [t.to(dtype) for t in (q, k, v)]
    ref_lowp = run("textbook_lowp", *low, mask, dout=dout)
    fast = run(backend, *low, mask, dout=dout)
    for name, f, r64, rlp in zip(("output", "dq", "dk", "dv"), fast, ref64, ref_lowp, strict=True):
        assert f.dtype == dtype
        assert_within_rule(f, r64, rlp, what=f"{backend}/{kind}/{dtype} {name}")


@pytest.mark.portable
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_tiled_lse_and_weights_from_lse_match_reference(kind, small_blocks, device):
    q, k, v = make_qkv(b=2, h=6, g=2, i=7, j=5, d=4, e=3, device=device)
    mask = make_mask(kind, 2, 6, 7, 5, device=device)
    ref = attention_result(q, k, v, mask=mask, backend="reference", return_weights=True, return_lse=True)
    tiled = attention_result(q, k, v, mask=mask, backend="tiled", return_lse=True)
    dead = ref.lse == -math.inf
    assert torch.equal(dead, tiled.lse == -math.inf)
    torch.testing.assert_close(tiled.lse[~dead], ref.lse[~dead], rtol=0, atol=1e-12)
    # weights recovered from the LSE alone: exp(q k^T * scale + mask - lse)
    keep, bias = multihead.masks.bind_mask(mask, False, multihead.masks.AttentionShape(2, 6, 7, 5, q.device)).dense(
        torch.float64
    )
    scores = q @ k.repeat_interleave(3, 1).transpose(-2, -1) / 2.0
    scores = scores + (bias if bias is not None else 0)
    if keep is not None:
        scores = scores.masked_fill(~keep, -math.inf)
    weights = torch.exp(scores - torch.where(dead, 0.0, tiled.lse)[..., None])
    torch.testing.assert_close(weights, ref.weights, rtol=0, atol=1e-12)


@pytest.mark.portable
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["materialized", "reference", "sdpa", "tiled"])
def test_returned_weights_match_reference(backend, dtype, small_blocks, device):
    q, k, v = make_qkv(b=2, h=6, g=3, i=5, j=7, dtype=torch.float64, device=device)
    mask = masks.causal() & masks.padding(torch.tensor([7, 4], device=device))
    ref64 = attention_result(q, k, v, mask=mask, backend="reference", return_weights=True)
    low = [t.to(dtype) for t in (q, k, v)]
    lowp_output, lowp_weights, _ = textbook_lowp(*low, mask=mask)
    fast = attention_result(*low, mask=mask, backend=backend, return_weights=True)
    assert_within_rule(fast.weights, ref64.weights, lowp_weights, what="weights")
    assert_within_rule(fast.output, ref64.output, lowp_output, what="output")


@pytest.mark.parametrize("backend", ["materialized", "tiled"])
def test_bfloat16_blocks_scale_after_the_float32_upcast(backend):
    """Scaling q in bf16 before the upcast rounds it twice: 4x the error of the fp32-blocked kernels."""
    low_inputs = [(3 * t).to(torch.bfloat16) for t in make_qkv(b=2, h=4, g=4, i=64, j=64, d=48, e=48, seed=3)]
    # exact attention of the bf16 inputs themselves, so the error measured is the kernel's alone
    exact = attention(*(t.double() for t in low_inputs), backend="reference")  # scale 1/sqrt(48)
    error = {}
    for name in ("sdpa", backend):
        low = attention(*low_inputs, backend=name)
        error[name] = (low.double() - exact).abs().max().item()
    assert error[backend] <= 1.5 * error["sdpa"], error


@pytest.mark.portable
def test_weights_gradient_flows_through_materialized(device):
    """A loss on the returned weights reaches q and k through the materialized backward."""
    q, k, v = make_qkv(b=2, h=4, g=2, i=5, j=7, requires_grad=True, device=device)
    target = torch.randn(2, 4, 5, 7, dtype=torch.float64, device=device)
    grads = {}
    for backend in ("reference", "materialized"):
        q.grad = k.grad = v.grad = None
        res = attention_result(q, k, v, causal=True, backend=backend, return_weights=True)
        ((res.weights * target).sum() + res.output.square().sum()).backward()
        grads[backend] = [t.grad.clone() for t in (q, k, v)]
    for ref, fast in zip(grads["reference"], grads["materialized"], strict=True):
        torch.testing.assert_close(fast, ref, rtol=0, atol=1e-12)


@pytest.mark.portable
@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled", "materialized"])
def test_gradcheck_float64(backend, small_blocks, device):
    q, k, v = make_qkv(b=1, h=4, g=2, i=5, j=6, d=3, e=2, requires_grad=True, device=device)
    mask = (
        masks.window(3, 1) & masks.padding(torch.tensor([5], device=device)) & masks.alibi([0.5, 0.25, 0.125, 0.0625])
    )

    def fn(q, k, v):
        return attention(q, k, v, mask=mask, backend=backend)

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.portable
def test_gradcheck_tiled_through_lse_and_dropout(small_blocks, device):
    """Backward regenerates the dropout keep-mask from its seed, and takes a gradient on the LSE."""
    q, k, v = make_qkv(b=1, h=2, g=1, i=5, j=6, d=3, e=2, requires_grad=True, device=device)

    def fn(q, k, v):
        torch.manual_seed(0)  # the same dropout pattern on every evaluation
        res = attention_result(q, k, v, causal=True, dropout=0.3, training=True, backend="tiled", return_lse=True)
        return res.output, res.lse.masked_fill(res.lse == -math.inf, 0.0)

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.portable
def test_gradcheck_materialized_weights_output(device):
    q, k, v = make_qkv(b=1, h=2, g=2, i=4, j=5, d=3, e=2, requires_grad=True, device=device)
    assert torch.autograd.gradcheck(
        lambda q, k, v: tuple(attention_result(q, k, v, causal=True, backend="materialized", return_weights=True)[:2]),
        (q, k, v),
    )


@pytest.mark.portable
@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled", "materialized"])
@pytest.mark.parametrize("case", ["bottom_right_i>j", "padding_zero", "bool_row", "neg_inf_bias"])
def test_fully_masked_rows_give_zero_output_weights_and_gradient(backend, case, small_blocks, device):
    i, j = (7, 4) if case == "bottom_right_i>j" else (5, 6)
    q, k, v = make_qkv(b=2, h=4, g=2, i=i, j=j, requires_grad=True, device=device)
    mask = {
        "bottom_right_i>j": masks.causal(),
        "padding_zero": masks.padding(torch.tensor([0, 4], device=device)),
        "bool_row": torch.ones(i, j, dtype=torch.bool, device=device).index_fill_(
            0, torch.tensor([2], device=device), False
        ),
        "neg_inf_bias": torch.zeros(i, j, dtype=torch.float64, device=device).index_fill_(
            0, torch.tensor([2], device=device), -math.inf
        ),
    }[case]
    dead = {
        "bottom_right_i>j": (slice(None), slice(None), slice(0, 3)),
        "padding_zero": (0, slice(None), slice(None)),
        "bool_row": (slice(None), slice(None), 2),
        "neg_inf_bias": (slice(None), slice(None), 2),
    }[case]
    res = attention_result(q, k, v, mask=mask, backend=backend, return_weights=True)
    assert not res.output.isnan().any() and not res.weights.isnan().any()
    assert (res.output[dead] == 0).all() and (res.weights[dead] == 0).all()
    grad_out = torch.zeros_like(res.output)
    grad_out[dead] = 1.0  # gradient only into the dead rows
    res.output.backward(grad_out)
    for t in (q, k, v):
        assert not t.grad.isnan().any()
        assert (t.grad == 0).all()


@pytest.mark.portable
@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled", "materialized"])
@pytest.mark.parametrize("i,j", [(3, 5), (5, 3), (4, 4)])
def test_causal_alignments_match_explicit_triangles(backend, i, j, small_blocks, device):
    q, k, v = make_qkv(b=1, h=2, g=1, i=i, j=j, device=device)
    ones = torch.ones(i, j, dtype=torch.bool, device=device)
    expected = {"bottom_right": ones.tril(diagonal=j - i), "top_left": ones.tril()}
    for align, keep in expected.items():
        got = attention(q, k, v, mask=masks.causal(align), backend=backend)
        want = attention(q, k, v, mask=keep, backend="reference")
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # causal=True is the bottom-right mask
    torch.testing.assert_close(
        attention(q, k, v, causal=True, backend=backend),
        attention(q, k, v, mask=expected["bottom_right"], backend="reference"),
        rtol=0,
        atol=1e-12,
    )


@pytest.mark.portable
@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_dropout_is_off_outside_training(backend, small_blocks, device):
    q, k, v = make_qkv(device=device)
    plain = attention(q, k, v, causal=True, backend=backend)
    torch.testing.assert_close(
        attention(q, k, v, causal=True, backend=backend, dropout=0.5, training=False), plain, rtol=0, atol=0
    )


@pytest.mark.portable
@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_dropout_in_training_drops_weights_with_probability_p_and_rescales(backend, small_blocks, device):
    """With one-hot values the output row is the dropped weights row itself: P * Z / (1 - p)."""
    torch.manual_seed(0)
    p, i, j, trials = 0.3, 6, 8, 400
    q = torch.randn(1, 2, i, 4, dtype=torch.float64, device=device)
    k = torch.randn(1, 1, j, 4, dtype=torch.float64, device=device)
    v = torch.eye(j, dtype=torch.float64, device=device).view(
        1, 1, j, j
    )  # e = j, value of key n is the n-th unit vector
    weights = attention_result(q, k, v, causal=True, backend="reference", return_weights=True).weights
    allowed = weights > 0
    samples = torch.stack(
        [attention(q, k, v, causal=True, dropout=p, training=True, backend=backend) for _ in range(trials)]
    )
    kept = samples[:, allowed] != 0
    dropped_share = 1 - kept.double().mean().item()
    n = kept.numel()
    assert abs(dropped_share - p) < 4 * math.sqrt(p * (1 - p) / n)  # within 4 standard errors
    # every kept weight is rescaled by exactly 1 / (1 - p); masked weights are never revived
    torch.testing.assert_close(
        samples[:, allowed][kept], (weights[allowed] / (1 - p)).expand(trials, -1)[kept], rtol=1e-12, atol=0
    )
    assert (samples[:, ~allowed] == 0).all()
    # and the expectation is the dropout-free output: each mean within 5 standard errors of P
    standard_error = weights * math.sqrt(p / (1 - p)) / math.sqrt(trials)
    assert ((samples.mean(0) - weights).abs() <= 5 * standard_error + 1e-12).all()


def test_weights_under_dropout_are_the_applied_ones():
    torch.manual_seed(1)
    q, k, v = make_qkv(b=1, h=2, g=2, i=4, j=6)
    res = attention_result(q, k, v, dropout=0.5, training=True, return_weights=True)
    torch.testing.assert_close(res.output, res.weights @ v, rtol=0, atol=1e-12)
    assert multihead.explain(q, k, v, dropout=0.5, training=True, return_weights=True).chosen == "reference"


@pytest.mark.portable
@pytest.mark.parametrize("mask_kind", ["softcap", "softcap & causal", "window"])
def test_under_dropout_asking_for_the_weights_never_changes_the_output(mask_kind, small_blocks, device):
    """A soft-cap call went to tiled without weights and to reference with them, whose dropout streams differ: the
    outputs were 0.30 apart at the same RNG state. auto now keeps tiled, which returns the weights it applied."""
    q, k, v = make_qkv(b=2, h=4, g=2, i=6, j=9, device=device)
    mask = {
        "softcap": masks.softcap(2.0),
        "softcap & causal": masks.softcap(2.0) & masks.causal(),
        "window": masks.window(2, 1) & masks.softcap(5.0),
    }[mask_kind]
    options = dict(mask=mask, dropout=0.4, training=True)
    selection = WeightSelection(heads=[3, 0], queries=[5, 1])
    torch.manual_seed(7)
    plain = attention(q, k, v, **options)
    for asked in (True, selection):
        torch.manual_seed(7)
        result = attention_result(q, k, v, **options, return_weights=asked)
        torch.testing.assert_close(result.output, plain, rtol=0, atol=0)
        explanation = multihead.explain(q, k, v, **options, return_weights=asked)
        assert explanation.chosen == multihead.explain(q, k, v, **options).chosen == "tiled"
        assert any("returns the weights it applies under dropout" in note for note in explanation.notes)
    # and the weights are those applied: after dropout, so that they give the output
    torch.manual_seed(7)
    result = attention_result(q, k, v, **options, return_weights=True)
    group = q.shape[1] // k.shape[1]
    torch.testing.assert_close(result.output, result.weights @ v.repeat_interleave(group, 1), rtol=0, atol=1e-12)


def test_under_dropout_on_the_cpu_sdpa_and_the_weights_backend_drop_the_same_weights():
    """torch's CPU SDPA draws its dropout as the reference does (one Bernoulli draw over the (b, h, i, j) weights),
    so a call auto gives SDPA, asked for its weights (which SDPA does not return) and run by the reference instead,
    drops the same weights at the same RNG state. On other devices SDPA's fused kernels draw their own stream."""
    q, k, v = make_qkv(b=2, h=4, g=2, i=6, j=9, dtype=torch.float32)
    options = dict(causal=True, dropout=0.4, training=True)
    assert multihead.explain(q, k, v, **options).chosen == "sdpa"
    assert multihead.explain(q, k, v, **options, return_weights=True).chosen == "reference"
    torch.manual_seed(7)
    plain = attention(q, k, v, **options)
    torch.manual_seed(7)
    weighted = attention_result(q, k, v, **options, return_weights=True)
    torch.testing.assert_close(weighted.output, plain, rtol=1e-6, atol=1e-6)


@pytest.mark.portable
@pytest.mark.parametrize("backend", ["auto", "sdpa", "tiled", "materialized", "reference"])
def test_weight_selection_equals_slice_of_all_weights(backend, small_blocks, device):
    q, k, v = make_qkv(b=2, h=6, g=3, i=5, j=7, device=device)
    mask = (
        masks.causal()
        & masks.alibi(masks.alibi_slopes(6).to(device))
        & masks.padding(torch.tensor([7, 5], device=device))
    )
    full = attention_result(q, k, v, mask=mask, backend="reference", return_weights=True)
    heads, queries = [4, 1], [0, 3, 4]
    sub = attention_result(q, k, v, mask=mask, backend=backend, return_weights=WeightSelection(heads, queries))
    torch.testing.assert_close(sub.weights, full.weights[:, heads][:, :, queries], rtol=0, atol=1e-12)
    torch.testing.assert_close(sub.output, full.output, rtol=0, atol=1e-12)
    sliced = attention_result(q, k, v, mask=mask, backend=backend, return_weights=WeightSelection([5], slice(1, 4)))
    torch.testing.assert_close(sliced.weights, full.weights[:, [5], 1:4], rtol=0, atol=1e-12)


@pytest.mark.portable
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_asking_for_weights_does_not_change_the_output(backend, small_blocks, device):
    q, k, v = make_qkv(dtype=torch.float32, device=device)
    plain = attention(q, k, v, causal=True, backend=backend)
    for request in (True, WeightSelection(heads=[2])):
        with_weights = attention_result(q, k, v, causal=True, backend=backend, return_weights=request).output
        torch.testing.assert_close(with_weights, plain, rtol=0, atol=0)
    # auto switches kernel when every weight is asked for: equal within float32 rounding
    auto = attention_result(q, k, v, causal=True, return_weights=True).output
    torch.testing.assert_close(auto, plain, rtol=1e-6, atol=1e-6)


@pytest.mark.portable
def test_unbatched_inputs_match_batched(device):
    q, k, v = make_qkv(b=1, h=6, g=2, i=5, j=7, device=device)
    batched = attention_result(q, k, v, causal=True, return_weights=True, return_lse=True, backend="tiled")
    single = attention_result(q[0], k[0], v[0], causal=True, return_weights=True, return_lse=True, backend="tiled")
    assert single.output.shape == (6, 5, 3) and single.weights.shape == (6, 5, 7) and single.lse.shape == (6, 5)
    for a, b in zip(single, batched, strict=True):
        torch.testing.assert_close(a, b[0], rtol=0, atol=0)


def test_default_scale_is_inverse_sqrt_d_and_custom_scale_applies():
    q, k, v = make_qkv(d=9)
    torch.testing.assert_close(attention(q, k, v), attention(q, k, v, scale=1 / 3), rtol=0, atol=0)
    torch.testing.assert_close(
        attention(q, k, v, scale=0.7, backend="tiled"),
        attention(q * 0.7, k, v, scale=1.0, backend="reference"),
        rtol=0,
        atol=1e-12,
    )


def test_bias_that_requires_grad_goes_to_reference_and_gets_its_gradient():
    q, k, v = make_qkv(requires_grad=True)
    bias = torch.randn(1, 6, 5, 7, dtype=torch.float64, requires_grad=True)
    explanation = multihead.explain(q, k, v, mask=bias)
    assert explanation.chosen == "reference"
    assert "bias that requires grad" in " ".join(explanation.rejected["sdpa"])
    assert torch.autograd.gradcheck(lambda b_: attention(q.detach(), k.detach(), v.detach(), mask=b_), (bias,))


def test_auto_dispatch_and_reasons():
    q, k, v = make_qkv()
    assert multihead.explain(q, k, v, causal=True).chosen == "sdpa"
    assert multihead.explain(q, k, v, return_lse=True).chosen == "tiled"
    lse_reasons = multihead.explain(q, k, v, return_lse=True).rejected["sdpa"]
    assert any("return_lse" in r for r in lse_reasons)
    every = multihead.explain(q, k, v, return_weights=True)
    assert every.chosen == "materialized"
    assert "one pass" in " ".join(every.rejected["sdpa"])
    assert multihead.explain(q, k, v, return_weights=WeightSelection(heads=[0])).chosen == "sdpa"
    assert multihead.explain(q, k, v, dropout=0.1, training=True, return_lse=True).chosen == "tiled"
    assert "chosen: sdpa" in str(multihead.explain(q, k, v))
    with pytest.raises(ValueError, match="return_lse"):
        attention_result(q, k, v, backend="sdpa", return_lse=True)


def test_auto_overhead_passes_plain_causal_to_sdpa_as_is_causal(monkeypatch):
    """For equal lengths auto hands SDPA is_causal=True (its fastest kernel), not a dense mask."""
    seen = {}
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q, k, v = make_qkv(i=6, j=6)
    attention(q, k, v, causal=True)
    assert seen["is_causal"] is True and seen["attn_mask"] is None
    attention(q, k[:, :, :5], v[:, :, :5], causal=True)  # unequal lengths: explicit bottom-right mask
    assert seen["is_causal"] is False and seen["attn_mask"].shape[-2:] == (6, 5)


def test_custom_backend_registers_and_is_ranked_by_priority():
    calls = []

    def doubling(q, k, v, *, mask, scale, dropout, need_weights, need_lse):
        calls.append(q.shape)
        return multihead.backends.reference.reference_attention(
            q, k, v, mask=mask, scale=scale, dropout=dropout, need_weights=need_weights, need_lse=need_lse
        )

    multihead.backends.register("mine", doubling, multihead.backends.Capabilities(lse=True), priority=1)
    try:
        q, k, v = make_qkv()
        assert multihead.explain(q, k, v).chosen == "mine"
        attention(q, k, v)
        assert calls == [q.shape]
        assert "mine" in multihead.backends.available_backends()
    finally:
        multihead.backends.unregister("mine")
    assert "mine" not in multihead.backends.available_backends()


def test_sdpa_cpu_gives_zero_for_fully_masked_rows():
    """Pins the torch behaviour the sdpa backend relies on (see backends/sdpa.py)."""
    q, k, v = make_qkv(b=1, h=2, g=2, i=64, j=80, d=64, e=64, dtype=torch.float32, requires_grad=True)
    keep = torch.ones(64, 80, dtype=torch.bool)
    keep[5] = False
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    out.sum().backward()
    assert (out[:, :, 5] == 0).all()
    assert all(not t.grad.isnan().any() for t in (q, k, v)) and (q.grad[:, :, 5] == 0).all()


# --------------------------------------------------------------------------- property-based

sizes = st.integers(min_value=1, max_value=9)


@st.composite
def attention_cases(draw, device):
    b, g, r = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    i, j, d, e = draw(sizes), draw(sizes), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    parts = []
    if draw(st.booleans()):
        parts.append(masks.causal(draw(st.sampled_from(["bottom_right", "top_left"]))))
    if draw(st.booleans()):
        left = draw(st.one_of(st.none(), st.integers(0, 4)))
        parts.append(masks.window(left, draw(st.one_of(st.none(), st.integers(0, 4)))))
    if draw(st.booleans()):
        parts.append(
            masks.padding(torch.tensor(draw(st.lists(st.integers(0, j), min_size=b, max_size=b)), device=device))
        )
    if draw(st.booleans()):
        parts.append(masks.alibi(torch.rand(g * r, dtype=torch.float64, device=device)))
    if draw(st.booleans()):
        seed = draw(st.integers(0, 99))
        parts.append((torch.rand(i, j, generator=torch.Generator().manual_seed(seed), device="cpu") < 0.7).to(device))
    mask = None
    for part in parts:
        mask = part if mask is None else mask & part
    return (b, g * r, g, i, j, d, e), mask


def draw_block(seed: int, largest: int) -> int:
    return 1 + seed % largest


@pytest.mark.portable
@settings(max_examples=60, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_property_every_backend_equals_reference_in_float64(data, seed, device):
    (b, h, g, i, j, d, e), mask = data.draw(attention_cases(device))
    q, k, v = make_qkv(b, h, g, i, j, d, e, seed=seed, requires_grad=True, device=device)
    dout = torch.randn(b, h, i, e, dtype=torch.float64, generator=torch.Generator().manual_seed(seed), device="cpu").to(
        device
    )
    ref = run("reference", q, k, v, mask, dout=dout)
    for backend in FAST_BACKENDS:
        with tiny_blocks(block_q=draw_block(seed, 3), block_k=draw_block(seed // 3, 4), rows=draw_block(seed, 2)):
            got = run(backend, q, k, v, mask, dout=dout)
        for name, a, want in zip(("output", "dq", "dk", "dv"), got, ref, strict=True):
            torch.testing.assert_close(a, want, rtol=0, atol=1e-10, msg=f"{backend} {name} {mask!r}")


@pytest.mark.portable
@pytest.mark.parametrize("kind", ["none", "causal", "padding_valid", "bool_tensor", "float_neg_inf", "combo"])
def test_selected_weights_carry_gradients_like_the_reference(kind, device):
    """With inputs that require grad the selection path stays differentiable, and exact."""
    q, k, v = make_qkv(b=2, h=6, g=3, i=5, j=7, requires_grad=True, device=device)
    mask = make_mask(kind, 2, 6, 5, 7, device=device)
    target = torch.randn(2, 2, 3, 7, dtype=torch.float64, device=device)
    grads = []
    for request in ("reference", "selection"):
        q.grad = k.grad = v.grad = None
        if request == "reference":
            weights = attention_result(q, k, v, mask=mask, backend="reference", return_weights=True).weights[:, [4, 1]][
                :, :, [0, 3, 4]
            ]
        else:
            weights = attention_result(q, k, v, mask=mask, return_weights=WeightSelection([4, 1], [0, 3, 4])).weights
        (weights * target).sum().backward()
        grads.append([t.grad.clone() for t in (q, k)])
    for ref, got in zip(*grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- extreme but valid magnitudes


@pytest.mark.portable
@pytest.mark.parametrize("backend", ["reference", "tiled", "materialized", "sdpa"])
def test_float16_scores_of_minus_40000_are_not_a_masked_row(backend, device):
    """q k^T = -80000 overflows float16 to -inf on the way (the row then looked fully masked: output 0);
    (q * scale) k^T = -40000 does not, and two equal scores average the values."""
    q = torch.tensor([[[[200.0, 0, 0, 0]]]], dtype=torch.float16, device=device)
    k = torch.tensor([[[[-400.0, 0, 0, 0], [-400.0, 0, 0, 0]]]], dtype=torch.float16, device=device)
    v = torch.tensor([[[[1.0], [2.0]]]], dtype=torch.float16, device=device)
    assert attention(q, k, v, scale=0.5, backend=backend).item() == 1.5


@pytest.mark.portable
def test_the_oracle_stays_finite_on_large_float16_inputs(device):
    """Random inputs x100 overflowed the oracle's float16 product (NaN); it now computes in float32."""
    q, k, v = make_qkv(b=2, h=4, g=2, i=9, j=11, d=16, e=8, seed=5, device=device)
    q16, k16, v16 = (100 * q).half(), (100 * k).half(), v.half()
    result = attention_result(q16, k16, v16, backend="reference", return_weights=True, return_lse=True)
    assert all(t.isfinite().all() for t in result)
    exact = attention(q16.double(), k16.double(), v16.double(), backend="reference")
    torch.testing.assert_close(result.output.double(), exact, rtol=0, atol=2e-3)  # float16 output rounding


@pytest.mark.portable
@pytest.mark.parametrize("as_bias", [False, True], ids=["bool", "minus-inf-bias"])
@pytest.mark.parametrize("backend", ["reference", "tiled", "materialized", "sdpa"])
def test_fully_masked_rows_stay_zero_when_their_scores_would_overflow(backend, as_bias, device):
    """+inf (overflowed) scores in masked pairs: a -inf bias must mask them as a bool mask does, not make NaN."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 3, 4, generator=gen, device="cpu").to(device)
    q[0, 0, 1] *= 1e30  # the row that sees no key: its scores overflow float32
    k = (torch.randn(1, 1, 5, 4, generator=gen, device="cpu").to(device) * 1e10).requires_grad_()
    v = torch.randn(1, 1, 5, 4, generator=gen, device="cpu").to(device).requires_grad_()
    q.requires_grad_()
    keep = torch.ones(3, 5, dtype=torch.bool, device=device)
    keep[1] = False
    keep[0, 3:] = False
    mask = torch.zeros(3, 5, device=device).masked_fill(~keep, -math.inf) if as_bias else keep
    result = attention_result(q, k, v, mask=mask, backend=backend, return_weights=True)
    assert torch.equal(result.output[0, 0, 1], torch.zeros(4, device=device)) and torch.equal(
        result.weights[0, 0, 1], torch.zeros(5, device=device)
    )
    result.output.sum().backward()
    assert torch.equal(q.grad[0, 0, 1], torch.zeros(4, device=device))
    assert all(t.grad.isfinite().all() for t in (q, k, v))


@pytest.mark.portable
@pytest.mark.parametrize("seed", range(4))
def test_materialized_bfloat16_gradients_are_as_accurate_as_the_other_kernels(seed, device):
    """Its backward used to read the weights it saved in bfloat16: up to 20x the others' error in dq."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(1, 1, n, d, generator=gen, device="cpu").to(device).bfloat16() for n, d in ((1, 6), (3, 6), (3, 8))
    )

    def dq(dtype, backend):
        leaf = q.to(dtype, copy=True).requires_grad_()
        attention(leaf, k.to(dtype), v.to(dtype), scale=1.7, backend=backend).sum().backward()
        return leaf.grad.double()

    exact = dq(torch.float64, "reference")
    errors = {b: (dq(torch.bfloat16, b) - exact).abs().max().item() for b in ("reference", "tiled", "materialized")}
    assert errors["materialized"] <= 2 * max(errors["reference"], errors["tiled"]) + 1e-4, errors


@pytest.mark.parametrize("rows_may_be_empty", [False, True])
def test_in_place_softmax_is_right_on_a_column_range_of_a_wider_tensor(rows_may_be_empty):
    # torch's fused softmax, written over its own input, returns wrong values on a strided view (torch
    # 2.13); softmax_rows_ must give the softmax of exactly those columns and leave the others alone
    wide = torch.randn(4, 10, generator=torch.Generator().manual_seed(0), device="cpu")
    before = wide.clone()
    expected = torch.softmax(before[:, 2:7], dim=-1)
    softmax_rows_(wide[:, 2:7], rows_may_be_empty=rows_may_be_empty)
    torch.testing.assert_close(wide[:, 2:7], expected)
    assert torch.equal(wide[:, :2], before[:, :2]) and torch.equal(wide[:, 7:], before[:, 7:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_repeats_kv_heads_where_enable_gqa_would_fall_to_the_math_kernel(monkeypatch, dtype, masked):
    """On CUDA torch's fused kernels take enable_gqa only without a mask and in half precision; elsewhere the sdpa
    backend hands SDPA k and v repeated to h heads. The CPU is made to follow CUDA's rule here, so both paths run
    and each must equal the reference (query head n reads kv head n // (h / g))."""
    from multihead.backends import costs, sdpa

    monkeypatch.setattr(sdpa, "GQA_NEEDS_REPEAT_DEVICES", frozenset({"cpu"}))
    seen: list[tuple[int, bool]] = []
    real = sdpa.F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((k.shape[1], kwargs["enable_gqa"]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    q, k, v = (t.to(dtype) for t in make_qkv(b=2, h=6, g=2, i=9, j=9, d=8, e=5))  # i = j: SDPA's own causal
    mask = masks.window(3) if masked else None
    with costs.native_precision():  # the kernel in the call's dtype (the CPU tables would run bf16 in float32)
        out = attention(q, k, v, mask=mask, causal=True, backend="sdpa")
    repeated = masked or dtype == torch.float32
    assert seen == [(6, False)] if repeated else seen == [(2, True)]
    reference = attention(q.double(), k.double(), v.double(), mask=mask, causal=True, backend="reference")
    assert_within_rule(out, reference, textbook_lowp(q, k, v, mask=mask, causal=True)[0])


@pytest.mark.parametrize("i, j", [(3, 9), (9, 9), (9, 4)])
def test_sdpa_hands_a_bottom_right_causal_to_torch_where_its_kernels_compute_it(monkeypatch, i, j):
    """On CUDA a bottom-right causal with i <= j (a chunk of queries after a cache) goes to SDPA as torch's
    causal_lower_right, no dense mask; the CPU is made to follow that rule here (torch builds the mask itself on
    the CPU), and the result and gradients must equal the reference. i > j (rows with no key) keeps our own mask."""
    from torch.nn.attention.bias import CausalBias

    from multihead.backends import sdpa

    monkeypatch.setattr(sdpa, "LOWER_RIGHT_DEVICES", frozenset({"cpu"}))
    handed: list[object] = []
    real = sdpa.sdpa_mask

    def spy(mask, dtype):  # what the backend hands SDPA (torch's own function is left alone: its CausalBias
        handed.append(real(mask, dtype)[0])  # dispatch checks that it is called)
        return real(mask, dtype)

    monkeypatch.setattr(sdpa, "sdpa_mask", spy)
    q, k, v = make_qkv(b=2, h=4, g=2, i=i, j=j, d=8, e=5, dtype=torch.float32, requires_grad=True)
    out = attention(q, k, v, causal=True, backend="sdpa")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected = attention(*leaves, causal=True, backend="reference")
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    got, want = torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, leaves, grad)
    for name, ours, reference in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(ours, reference, msg=lambda text, name=name: f"d{name}: {text}")
    if i < j:  # handed over as torch's own, and estimated as SDPA computing it (no dense mask to build)
        assert isinstance(handed[-1], CausalBias)
        call = registry_call(q, k, v)
        estimate = sdpa._estimate(call)
        assert estimate is not None and estimate.dense_mask_bytes == 0 and sdpa.rates_label(call.mask) == "sdpa"
    else:  # equal lengths: its is_causal; i > j: our own mask (rows with no key)
        assert not isinstance(handed[-1], CausalBias)


def registry_call(q, k, v):
    """The AttentionCall of a causal call on q, k, v, as attention describes it."""
    from multihead.functional import _prepare

    options = dict(scale=None, dropout=0.0, training=False, backend="auto", return_weights=False, return_lse=False)
    return _prepare(q, k, v, mask=None, causal=True, **options).call


@pytest.mark.parametrize(
    "mask, causal, i, j",
    [
        (masks.padding([0, 5]), False, 6, 7),  # batch row 0 has no key at all
        (None, True, 8, 5),  # bottom-right causal with i > j: the first rows see no key
        (masks.window(2) & masks.padding([7, 3]), True, 7, 7),  # a window past the last real key
        (masks.alibi(masks.alibi_slopes(4)) & masks.padding([0, 7]), False, 5, 7),  # a bias, and an empty row
    ],
    ids=["no keys", "causal i > j", "window past the keys", "alibi and no keys"],
)
def test_sdpa_gives_zero_for_empty_rows_where_its_kernels_are_not_verified(monkeypatch, mask, causal, i, j):
    """Off the CPU torch's kernels are not verified to give 0 for a row with every key masked: there the mask goes
    with the dtype's lowest finite value for -inf and such rows' output is set to 0. The CPU is made to take that
    path here: output and gradients equal the reference's (0 on empty rows), nothing is NaN."""
    from multihead.backends import sdpa

    monkeypatch.setattr(sdpa, "VERIFIED_EMPTY_ROW_DEVICES", frozenset())
    handed: list[torch.Tensor] = []
    real = sdpa.finite_mask
    monkeypatch.setattr(sdpa, "finite_mask", lambda *args: handed.append(real(*args)) or handed[-1])
    q, k, v = make_qkv(b=2, h=4, g=2, i=i, j=j, d=8, e=5, dtype=torch.float32, requires_grad=True)
    bound = masks.bind_mask(mask, causal, masks.AttentionShape(2, 4, i, j, q.device))
    assert bound.may_empty_rows()
    out = attention(q, k, v, mask=mask, causal=causal, backend="sdpa")
    assert len(handed) == 1 and handed[0].isfinite().all()  # SDPA saw no -inf
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected = attention(*leaves, mask=mask, causal=causal, backend="reference")
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    got, want = torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, leaves, grad)
    for name, ours, reference in zip("qkv", got, want, strict=True):
        assert not ours.isnan().any(), name
        torch.testing.assert_close(ours, reference, msg=lambda text, name=name: f"d{name}: {text}")
