"""Learned attention sinks (``attention(..., sinks=s)``, gpt-oss): a sink column of logit s and value 0 in every
row's softmax, dropped after it.

Against a plain-math float64 oracle written here the way gpt-oss's eager code does it (concatenate the column,
softmax, drop it), on every backend that serves sinks, with every mask kind, GQA, per-row sinks, rows with no key,
weights and LSE; gradients by gradcheck (the sinks' own included); varlen, the paged cache, attention_stats and the
layer-level Attend seam; the backends that cannot serve them refuse, naming it, and bad sinks are named.
"""

from __future__ import annotations

import pytest
import torch

import multihead
from multihead import masks
from multihead.backends.paged import PageTable
from multihead.functional import WeightSelection, attention, attention_result
from multihead.varlen import attention_varlen_result
from support import assert_within_rule, is_input_error, make_qkv, randn, textbook_lowp, tiny_blocks

SIZES = dict(b=3, h=4, g=2, i=5, j=7, d=6, e=9)  # pairwise distinct but for the GQA grouping h = 4, g = 2
# flex serves sinks where it returns the LSE (CUDA), and refuses them on the CPU (see the refusal test); sdpa takes
# them as one more key, with no LSE and no soft-cap of its own
SERVING = ["reference", "tiled", "materialized", "sdpa", "auto"]
MASK_KINDS = ["none", "causal", "window", "padding", "documents", "alibi", "softcap", "bool", "bias"]


def served(backends: list[str], kinds: list[str]) -> list[tuple[str, str]]:
    """Every (backend, mask kind) pair the backend serves: sdpa applies no soft-cap (auto sends it elsewhere)."""
    return [(backend, kind) for backend in backends for kind in kinds if (backend, kind) != ("sdpa", "softcap")]


def returns_lse(backend: str) -> bool:
    return backend == "auto" or multihead.backends.registry.get_backend(backend).capabilities.lse


def plain_mask(kind: str, b: int, h: int, i: int, j: int, device):
    """(our mask, the oracle's keep (.., i, j) bool or None, the oracle's bias or None); bottom-right aligned."""
    p = torch.arange(i, device=device)[:, None] + (j - i)  # aligned query positions (i, 1)
    key = torch.arange(j, device=device)[None, :]
    if kind == "none":
        return None, None, None
    if kind == "causal":
        return masks.causal(), (key <= p)[None, None], None
    if kind == "window":
        return masks.window(2, 1), ((key >= p - 2) & (key <= p + 1))[None, None], None
    if kind == "padding":
        lengths = torch.tensor([j, 3, 0], device=device)[:b]  # batch row 2 has no key: every row on its sink
        return masks.padding(lengths), (key[None] < lengths[:, None, None])[:, None], None
    if kind == "documents":
        ids = torch.tensor([[0] * 3 + [1] * (j - 3)] * b, device=device)  # (b, j) two documents
        q_ids = ids[:, j - i :]
        return masks.documents(ids), (q_ids[:, :, None] == ids[:, None, :])[:, None], None
    if kind == "alibi":
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=device)[:h]
        return masks.alibi(slopes), None, (-slopes.double()[:, None, None] * (key - p).abs().double())[None]
    if kind == "softcap":
        return masks.softcap(2.0), None, None
    if kind == "bool":
        keep = randn(b, 1, i, j, seed=9, device=device) > -0.3
        keep[0, 0, 1] = False  # one row with no key
        return keep, keep, None
    bias = randn(1, h, i, j, seed=8, device=device)
    return bias, None, bias


def oracle(q, k, v, sinks, *, kind, b, h, i, j, scale=None):
    """(output, weights over the keys, lse over keys and sink) in float64, gpt-oss's eager way."""
    _, keep, bias = plain_mask(kind, b, h, i, j, q.device)
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if kind == "softcap":
        scores = 2.0 * torch.tanh(scores / 2.0)
    if bias is not None:
        scores = scores + bias
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    sinks = sinks.double()
    column = (sinks[None, :, None] if sinks.ndim == 1 else sinks).expand(scores.shape[:-1]).unsqueeze(-1)
    combined = torch.cat([scores, column], -1)
    lse = combined.logsumexp(-1)
    weights = (combined - lse[..., None]).exp()[..., :-1]
    return weights @ v, weights, lse


def inputs(*, per_row: bool = False, dtype=torch.float64, device="cpu", seed=0, requires_grad=False):
    q, k, v = make_qkv(**SIZES, dtype=dtype, seed=seed, device=device, requires_grad=requires_grad)
    shape = (SIZES["b"], SIZES["h"], SIZES["i"]) if per_row else (SIZES["h"],)
    sinks = randn(*shape, seed=seed + 5, device=device, dtype=dtype, requires_grad=requires_grad)
    return q, k, v, sinks


@pytest.mark.portable
@pytest.mark.parametrize("per_row", [False, True], ids=["per-head", "per-row"])
@pytest.mark.parametrize("backend, kind", served(SERVING, MASK_KINDS))
def test_output_weights_and_lse_equal_the_oracle(backend, kind, per_row, device):
    """The weights of a backend that returns none (sdpa) come from the call's own pass, sinks included."""
    q, k, v, sinks = inputs(per_row=per_row, device=device)
    mask, _, _ = plain_mask(kind, SIZES["b"], SIZES["h"], SIZES["i"], SIZES["j"], device)
    with tiny_blocks():
        got = attention_result(
            q, k, v, mask=mask, sinks=sinks, backend=backend, return_weights=True, return_lse=returns_lse(backend)
        )
    output, weights, lse = oracle(q, k, v, sinks, kind=kind, **{n: SIZES[n] for n in "bhij"})
    torch.testing.assert_close(got.output, output, atol=1e-12, rtol=1e-12, msg="output")
    torch.testing.assert_close(got.weights, weights, atol=1e-12, rtol=1e-12, msg="weights")
    if returns_lse(backend):
        torch.testing.assert_close(got.lse, lse, atol=1e-12, rtol=1e-12, msg="lse")
    # each row's weights sum to 1 - its sink share, exp(s - lse)
    share = (sinks.double()[None, :, None] if sinks.ndim == 1 else sinks) - lse
    torch.testing.assert_close(got.weights.sum(-1), 1 - share.exp(), atol=1e-12, rtol=0)


@pytest.mark.portable
@pytest.mark.parametrize("backend", SERVING)
def test_a_row_with_no_key_puts_its_whole_weight_on_the_sink(backend, device):
    q, k, v, sinks = inputs(device=device)
    nothing = torch.zeros(SIZES["b"], 1, SIZES["i"], SIZES["j"], dtype=torch.bool, device=device)
    lse = returns_lse(backend)
    result = attention_result(q, k, v, mask=nothing, sinks=sinks, backend=backend, return_weights=True, return_lse=lse)
    assert result.output.eq(0).all() and result.weights.eq(0).all()
    if lse:
        torch.testing.assert_close(result.lse, sinks[None, :, None].expand_as(result.lse))


@pytest.mark.portable
@pytest.mark.parametrize(
    "backend, kind", served(["reference", "tiled", "materialized", "sdpa"], ["causal", "padding", "alibi", "softcap"])
)
@pytest.mark.parametrize("per_row", [False, True], ids=["per-head", "per-row"])
def test_gradients_pass_gradcheck_sinks_included(backend, kind, per_row, device):
    q, k, v, sinks = inputs(per_row=per_row, device=device, requires_grad=True)
    mask, _, _ = plain_mask(kind, SIZES["b"], SIZES["h"], SIZES["i"], SIZES["j"], device)

    def run(q, k, v, sinks):
        with tiny_blocks():
            return attention(q, k, v, mask=mask, sinks=sinks, backend=backend)

    assert torch.autograd.gradcheck(run, (q, k, v, sinks))


@pytest.mark.portable
@pytest.mark.parametrize("per_row", [False, True], ids=["per-head", "per-row"])
def test_sdpas_sink_gradients_are_differentiable_at_every_order(per_row, device):
    """sdpa holds the sinks constant in its kernel and moves the output by their offset (1 / (1 + p expm1(ds))):
    second derivatives in the sinks pass gradgradcheck, where a detached first-order trick would give 0. (Torch's
    CPU kernel has no double backward in q, k, v, and says so, sinks or not.)"""
    q, k, v, sinks = inputs(per_row=per_row, device=device, requires_grad=True)

    def run(sinks):
        return attention(q, k, v, causal=True, sinks=sinks, backend="sdpa")

    assert torch.autograd.gradgradcheck(run, (sinks,))


@pytest.mark.portable
def test_the_sinks_gradient_is_the_issues_closed_form(device):
    """ds_h = -sum over rows of p_sink * rowsum(dO * O)."""
    q, k, v, sinks = inputs(device=device, requires_grad=True)
    out = attention(q, k, v, causal=True, sinks=sinks)
    grad_out = randn(*out.shape, seed=3, device=device)
    (ds,) = torch.autograd.grad(out, sinks, grad_out)
    lse = attention_result(q, k, v, causal=True, sinks=sinks, return_lse=True).lse
    p_sink = (sinks[None, :, None] - lse).exp()
    expected = -(p_sink * (grad_out * out).sum(-1)).sum((0, 2))
    torch.testing.assert_close(ds, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.portable
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_half_precision_is_within_the_tolerance_rule(dtype, device):
    q, k, v, sinks = inputs(dtype=dtype, device=device)
    q = q.detach().requires_grad_()
    out = attention(q, k, v, causal=True, sinks=sinks.float())
    ref64 = oracle(q, k, v, sinks, kind="causal", **{n: SIZES[n] for n in "bhij"})[0]
    low, _, lse = textbook_lowp(q, k, v, causal=True)
    low = low * torch.sigmoid(lse - sinks.float()[None, :, None]).to(dtype)[..., None]
    assert_within_rule(out, ref64, low)


@pytest.mark.portable
def test_a_weight_selection_scales_its_rows_as_the_whole(device):
    q, k, v, sinks = inputs(device=device)
    whole = attention_result(q, k, v, causal=True, sinks=sinks, return_weights=True).weights
    chosen = attention_result(
        q, k, v, causal=True, sinks=sinks, return_weights=WeightSelection(heads=[3, 1], queries=[4, 0, 2])
    ).weights
    torch.testing.assert_close(chosen, whole[:, [3, 1]][:, :, [4, 0, 2]], atol=1e-12, rtol=0)


@pytest.mark.portable
def test_dropout_drops_the_same_weights_with_and_without_sinks(device):
    """Dropout acts on each weight alone: with sinks the output is the sink-free one's rows scaled."""
    q, k, v, sinks = inputs(device=device)
    options = dict(causal=True, dropout=0.4, training=True, backend="reference")
    torch.manual_seed(11)
    plain = attention_result(q, k, v, **options, return_lse=True)
    torch.manual_seed(11)
    with_sinks = attention(q, k, v, **options, sinks=sinks)
    torch.testing.assert_close(with_sinks, plain.output * torch.sigmoid(plain.lse - sinks[None, :, None])[..., None])


@pytest.mark.portable
def test_varlen_documents_each_equal_their_own_call(device):
    q, k, v, sinks = inputs(device=device)
    total = 11
    packed = [randn(total, n, dim, seed=s, device=device) for s, (n, dim) in enumerate(((4, 6), (2, 6), (2, 9)))]
    cu = torch.tensor([0, 4, total], device=device)
    result = attention_varlen_result(*packed, cu, cu, 7, 7, causal=True, sinks=sinks, return_lse=True)
    for start, stop in ((0, 4), (4, total)):
        q1, k1, v1 = (t[start:stop].transpose(0, 1) for t in packed)
        alone = attention_result(q1, k1, v1, causal=True, sinks=sinks, return_lse=True)
        torch.testing.assert_close(result.output[start:stop], alone.output.transpose(0, 1), atol=1e-12, rtol=0)
        torch.testing.assert_close(result.lse[:, start:stop], alone.lse, atol=1e-12, rtol=0)


@pytest.mark.portable
def test_a_paged_call_equals_the_contiguous_one(device):
    """Two sequences of 5 and 3 keys in pages of 2, one query each (a decode step), against dense keys."""
    h, g, d, e, page = 4, 2, 6, 9, 2
    kpool, vpool = randn(6, g, page, d, seed=1, device=device), randn(6, g, page, e, seed=2, device=device)
    tables = torch.tensor([[0, 3, 5], [2, 4, 0]], device=device)
    lengths = torch.tensor([5, 3], device=device)
    table = PageTable(
        tables, torch.zeros(2, dtype=torch.long, device=device), lengths, (lengths - 1)[:, None], width=6, window=None
    )
    q = randn(2, h, 1, d, seed=3, device=device)
    sinks = randn(h, seed=4, device=device)
    paged = attention_result(q, kpool, vpool, pages=table, causal=True, sinks=sinks, return_weights=True)
    for s, n in enumerate((5, 3)):
        keys = table.gather(kpool)[s : s + 1, :, :n]
        values = table.gather(vpool)[s : s + 1, :, :n]
        dense = attention_result(q[s : s + 1], keys, values, sinks=sinks, return_weights=True)
        torch.testing.assert_close(paged.output[s : s + 1], dense.output, atol=1e-12, rtol=0)
        torch.testing.assert_close(paged.weights[s : s + 1, :, :, :n], dense.weights, atol=1e-12, rtol=0)


@pytest.mark.portable
def test_attention_stats_measure_the_sink_share(device):
    q, k, v, sinks = inputs(device=device)
    stats = multihead.attention_stats(q, k, v, causal=True, sinks=sinks, heads=[2, 0])
    _, weights, lse = oracle(q, k, v, sinks, kind="causal", **{n: SIZES[n] for n in "bhij"})
    p_sink = (sinks.double()[None, :, None] - lse).exp()
    torch.testing.assert_close(stats.sink_share, p_sink[:, [2, 0]], atol=1e-12, rtol=0)
    torch.testing.assert_close(stats.received, weights[:, [2, 0]].sum(-2), atol=1e-12, rtol=0)
    terms = torch.cat([weights, p_sink[..., None]], -1)[:, [2, 0]]
    entropy = -(terms * terms.clamp_min(1e-300).log()).sum(-1)
    torch.testing.assert_close(stats.entropy, entropy, atol=1e-10, rtol=0)
    plain = multihead.attention_stats(q, k, v, causal=True)
    assert plain.sink_share.eq(0).all()


@pytest.mark.portable
def test_the_attend_seam_takes_sinks_and_its_hooks_see_the_weights_applied(device):
    q, k, v, sinks = inputs(device=device)
    seen = []
    attend = multihead.attend.Attend()
    attend.register_forward_hook(lambda module, args, result: seen.append(result.weights))
    result = attend(q, k, v, causal=True, sinks=sinks, return_weights=True)
    torch.testing.assert_close(result.output, attention(q, k, v, causal=True, sinks=sinks))
    assert seen[0] is result.weights and (seen[0].sum(-1) < 1).all()


@pytest.mark.portable
def test_a_backend_registered_without_sinks_refuses_them_and_auto_passes_it_over(device, monkeypatch):
    """Capabilities default to no sinks: a backend written before them is never handed a call it would serve
    without them."""
    from multihead.backends import registry

    def never_called(*args, **kwargs):
        raise AssertionError("a backend without sinks was run on a call with sinks")

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register("old", never_called, multihead.backends.Capabilities(lse=True, weights=True), priority=0)
    monkeypatch.setattr(registry, "_REGISTRY", registry._REGISTRY)  # restored (and the epoch moved) afterwards
    q, k, v, sinks = inputs(device=device)
    with pytest.raises(ValueError, match=r"old lacks .*learned attention sinks") as raised:
        attention(q, k, v, sinks=sinks, backend="old")
    assert is_input_error(raised.value, ValueError)
    explanation = multihead.explain(q, k, v, sinks=sinks)
    assert "learned attention sinks" in " ".join(explanation.rejected["old"])
    assert explanation.chosen != "old"


@pytest.mark.portable
def test_flex_refuses_sinks_on_the_cpu_where_it_returns_no_lse():
    """torch 2.13's compiled CPU FlexAttention returns no LSE to fold the sinks into: refused with the reason,
    before anything compiles (it used to fail inside the compiler, blaming the mask)."""
    q, k, v, sinks = (t.float() for t in inputs())
    explanation = multihead.explain(q, k, v, causal=True, sinks=sinks, backend="flex")
    assert any("learned sinks on CPU" in reason for reason in explanation.rejected["flex"])
    with pytest.raises(ValueError, match="learned sinks on CPU"):
        attention(q, k, v, causal=True, sinks=sinks, backend="flex")


@pytest.mark.portable
def test_sdpa_refuses_learned_sinks_under_dropout_and_auto_passes_it_over(device):
    """Its sinks' gradient reads each row's sink share back from the kernel's output, which dropout would drop."""
    q, k, v, sinks = inputs(device=device, requires_grad=True)
    options = dict(causal=True, dropout=0.3, training=True, sinks=sinks)
    with pytest.raises(ValueError, match=r"sdpa lacks .*learned sinks that need a gradient under dropout"):
        attention(q, k, v, **options, backend="sdpa")
    assert multihead.explain(q, k, v, **options).chosen != "sdpa"
    attention(q, k, v, **{**options, "sinks": sinks.detach()}, backend="sdpa")  # constant sinks: served


@pytest.mark.parametrize(
    "sinks, kind, fragment",
    [
        ([0.0] * 4, TypeError, r"sinks: expected a tensor of shape \(4,\) or \(3, 4, 5\)"),
        (torch.zeros(4, dtype=torch.long), TypeError, "sinks: expected a floating dtype"),
        (torch.zeros(3), ValueError, r"sinks: expected shape \(4,\) .* got shape \(3,\)"),
        (torch.zeros(3, 4), ValueError, r"got shape \(3, 4\)"),
        (torch.zeros(4, device="meta"), ValueError, "sinks: expected a tensor on cpu"),
    ],
    ids=["list", "integer", "heads", "2-d", "device"],
)
def test_bad_sinks_are_named(sinks, kind, fragment):
    q, k, v, _ = inputs()
    with pytest.raises(kind, match=fragment) as raised:
        attention(q, k, v, sinks=sinks)
    assert is_input_error(raised.value, kind)
