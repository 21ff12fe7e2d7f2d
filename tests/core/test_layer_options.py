"""MultiHeadAttention's options of recent models (qk_norm, output_gate, rotary_dim, sinks) against the layer written
out per head from its weights, on every path (no cache, contiguous, window and paged cache, need_weights, the fused
QKV matmul, cross-attention), with their errors, pruning, gradcheck and proof that each option changes the output.

The comparison with the transformers modules that ship each option is tests/lab/test_layer_options_hf.py."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import multihead.layer as layer_module
from multihead import MultiHeadAttention
from multihead.positional import RotaryEmbedding
from support import is_input_error, randn

pytestmark = pytest.mark.portable

# embed 20, h = 6 query heads over g = 3 kv heads, d = 6, e = 5, out 7: pairwise-distinct sizes where they can be
SHAPE = dict(embed_dim=20, num_heads=6, num_kv_heads=3, head_dim=6, value_head_dim=5, out_dim=7)
OPTIONS = {
    "qk_norm": dict(qk_norm=True),
    "qk_norm_eps": dict(qk_norm=True, qk_norm_eps=0.25),
    "headwise": dict(output_gate="headwise"),
    "elementwise": dict(output_gate="elementwise"),
    "rotary_dim": dict(rotary=True, rotary_dim=4),
    "sinks": dict(sinks=True),
    "all": dict(qk_norm=True, output_gate="elementwise", rotary=True, rotary_dim=2, sinks=True),
}


def make(device, seed=0, **options) -> MultiHeadAttention:
    """A float64 layer of SHAPE with ``options`` and every parameter drawn (norm weights and sinks not at their
    initial ones and zeros, so that a parameter read wrong shows)."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(**SHAPE, **options, dtype=torch.float64, device=device).eval()
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(torch.linspace(0.5, 1.5, parameter.numel()))
            elif name == "sinks":
                parameter.copy_(torch.linspace(-1.0, 2.0, parameter.numel()))
            elif name.endswith("bias"):
                parameter.copy_(torch.randn(parameter.shape, dtype=torch.float64) * 0.1)
    return layer


def rms(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, r, base, positions):
    """x (b, n, heads, d) with its first r dims rotated (rotate-half pairs (m, m + r/2), angle pos * base^(-2m/r))."""
    inverse = base ** (-torch.arange(0, r, 2, dtype=torch.float64, device=x.device) / r)  # (r/2,)
    angles = positions.to(torch.float64)[:, None] * inverse  # (n, r/2)
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]  # (1, n, 1, r/2)
    x1, x2 = x[..., : r // 2], x[..., r // 2 : r]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., r:]), dim=-1)


def reference(layer, query, key=None, *, causal=False, start=0):
    """The layer's definition written out one head at a time from its weights: (output (b, i, out), weights
    (b, h, i, j)). Head n's rows of W^Q are its d query rows then its c gate rows; q, k RMS-normed, then their first
    rotary_dim dims rotated; the softmax over the keys and the sink logit, the sink's column dropped; the head's
    output times sigmoid(gate)."""
    key = query if key is None else key
    (b, i), j = query.shape[:2], key.shape[1]
    h, g, d, e = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.value_head_dim
    c = layer.q_proj.out_features // h - d
    q_and_gate = F.linear(query, layer.q_proj.weight, layer.q_proj.bias).view(b, i, h, d + c)
    q, gate = q_and_gate[..., :d], q_and_gate[..., d:]  # (b, i, h, d), (b, i, h, c)
    k = F.linear(key, layer.k_proj.weight, layer.k_proj.bias).view(b, j, g, d)
    v = F.linear(key, layer.v_proj.weight, layer.v_proj.bias).view(b, j, g, e)
    if layer.q_norm is not None:
        q, k = rms(q, layer.q_norm.weight, layer.q_norm.eps), rms(k, layer.k_norm.weight, layer.k_norm.eps)
    if layer.rotary is not None:
        positions = torch.arange(start, start + i, device=query.device)
        q, k = (
            rope(q, layer.rotary_dim, layer.rotary.base, positions),
            rope(k, layer.rotary_dim, layer.rotary.base, positions),
        )
    heads, weights = [], []
    for n in range(h):
        scores = q[:, :, n] @ k[:, :, n // (h // g)].transpose(-1, -2) / math.sqrt(d)  # (b, i, j)
        if causal:  # bottom-right
            keep = torch.ones(i, j, dtype=torch.bool, device=query.device).tril(j - i)
            scores = scores.masked_fill(~keep, -math.inf)
        if layer.sinks is not None:
            sink = layer.sinks[n].expand(b, i, 1)
            p = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(scores, dim=-1)
        out = p @ v[:, :, n // (h // g)]  # (b, i, e)
        if c:
            out = out * torch.sigmoid(gate[:, :, n])  # c = 1 broadcasts over e
        heads.append(out)
        weights.append(p)
    return layer.out_proj(torch.cat(heads, dim=-1)), torch.stack(weights, dim=1)


# --------------------------------------------------------------------------- shapes and state dict


@pytest.mark.parametrize("name", list(OPTIONS))
def test_parameters_have_the_documented_names_and_shapes(name, device):
    layer = make(device, **OPTIONS[name])
    h, d, e = 6, 6, 5
    c = {"headwise": 1, "elementwise": e}.get(OPTIONS[name].get("output_gate"), 0)
    shapes = {key: tuple(value.shape) for key, value in layer.state_dict().items()}
    assert shapes["q_proj.weight"] == (h * (d + c), 20) and shapes["q_proj.bias"] == (h * (d + c),)
    assert shapes.pop("q_norm.weight", None) == ((d,) if layer.q_norm is not None else None)
    assert shapes.pop("k_norm.weight", None) == ((d,) if layer.k_norm is not None else None)
    assert shapes.pop("sinks", None) == ((h,) if OPTIONS[name].get("sinks") else None)
    assert set(shapes) == {f"{p}_proj.{w}" for p in ("q", "k", "v", "out") for w in ("weight", "bias")}
    assert layer.rotary_dim == OPTIONS[name].get("rotary_dim", d if OPTIONS[name].get("rotary") else None)
    assert layer.qk_norm_eps == (OPTIONS[name].get("qk_norm_eps", 1e-6) if OPTIONS[name].get("qk_norm") else None)


def test_initial_values_are_ones_for_the_norms_and_zero_for_the_sinks():
    layer = MultiHeadAttention(**SHAPE, qk_norm=True, sinks=True)
    assert torch.equal(layer.q_norm.weight, torch.ones(6)) and torch.equal(layer.k_norm.weight, torch.ones(6))
    assert torch.equal(layer.sinks, torch.zeros(6))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_config_and_state_dict_rebuild_the_layer(name, device):
    layer = make(device, **OPTIONS[name])
    rebuilt = MultiHeadAttention(**layer.config(), dtype=torch.float64, device=device).eval()
    rebuilt.load_state_dict(layer.state_dict())
    x = randn(2, 5, 20, seed=1, device=device)
    torch.testing.assert_close(rebuilt(x, causal=True)[0], layer(x, causal=True)[0], rtol=0, atol=0)


# --------------------------------------------------------------------------- against the written-out definition


@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_layer_equals_its_definition_with_its_weights(name, device):
    layer = make(device, **OPTIONS[name])
    x = randn(2, 7, 20, seed=1, device=device)
    out, weights = layer(x, causal=True, need_weights=True)
    expected, expected_weights = reference(layer, x, causal=True)
    assert out.shape == (2, 7, 7) and weights.shape == (2, 6, 7, 7)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer(x, causal=True)[0], out, rtol=0, atol=1e-12)  # need_weights: the same


@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_fused_qkv_matmul_gives_the_same(name, device, monkeypatch):
    layer = make(device, **OPTIONS[name])
    x = randn(2, 5, 20, seed=1, device=device)
    unfused = layer(x, causal=True)[0]
    monkeypatch.setattr(layer_module, "FUSED_QKV_MIN_ROWS", 1)  # every self-attention call fuses W^Q, W^K, W^V
    torch.testing.assert_close(layer(x, causal=True)[0], unfused, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["qk_norm", "headwise", "elementwise", "sinks"])
def test_cross_attention_equals_its_definition(name, device):
    layer = make(device, **OPTIONS[name])
    query, key = randn(2, 3, 20, seed=1, device=device), randn(2, 8, 20, seed=2, device=device)
    torch.testing.assert_close(layer(query, key)[0], reference(layer, query, key)[0], rtol=0, atol=1e-12)


def test_the_sinks_reach_the_kernel_through_the_attend_seam(device):
    layer = make(device, sinks=True)
    seen = []
    layer.attend.register_forward_hook(lambda module, args, kwargs, out: seen.append(kwargs["sinks"]), with_kwargs=True)
    x = randn(1, 4, 20, seed=1, device=device)
    _, weights = layer(x, causal=True, need_weights=True)
    assert len(seen) == 1 and seen[0] is layer.sinks
    assert (weights.sum(-1) < 1 - 1e-3).all()  # each row keeps a share on the sink


def test_a_headwise_gate_is_an_elementwise_gate_with_each_heads_rows_repeated(device):
    headwise = make(device, output_gate="headwise")
    elementwise = make(device, output_gate="elementwise")
    d, e = 6, 5
    state = headwise.state_dict()
    weight, bias = state["q_proj.weight"].view(6, d + 1, 20), state["q_proj.bias"].view(6, d + 1)
    state["q_proj.weight"] = torch.cat((weight[:, :d], weight[:, d:].expand(6, e, 20)), dim=1).reshape(-1, 20)
    state["q_proj.bias"] = torch.cat((bias[:, :d], bias[:, d:].expand(6, e)), dim=1).reshape(-1)
    elementwise.load_state_dict(state)
    x = randn(2, 5, 20, seed=1, device=device)
    torch.testing.assert_close(elementwise(x, causal=True)[0], headwise(x, causal=True)[0], rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- decoding with caches


def decode(layer, x, steps, cache):
    outputs, start = [], 0
    for size in steps:
        outputs.append(layer(x[:, start : start + size], causal=True, cache=cache)[0])
        start += size
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_decoding_with_a_kv_cache_equals_the_full_forward(name, device):
    layer = make(device, **OPTIONS[name])
    x = randn(3, 11, 20, seed=1, device=device)
    full, _ = layer(x, causal=True)
    torch.testing.assert_close(full, reference(layer, x, causal=True)[0], rtol=0, atol=1e-12)
    stepped = decode(layer, x, [5, 1, 1, 3, 1], layer.new_cache(batch_size=3, max_len=16))
    torch.testing.assert_close(stepped, full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_decoding_with_a_window_cache_equals_the_windowed_forward(name, device):
    from multihead import masks

    layer = make(device, **OPTIONS[name])
    x = randn(2, 10, 20, seed=1, device=device)
    full, _ = layer(x, causal=True, mask=masks.window(3, 0))
    stepped = decode(layer, x, [4, 1, 2, 1, 2], layer.new_cache(batch_size=2, max_len=16, window=4))
    torch.testing.assert_close(stepped, full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_decoding_with_a_paged_cache_equals_the_full_forward(name, device):
    layer = make(device, **OPTIONS[name])
    x = randn(2, 9, 20, seed=1, device=device)
    full, full_weights = layer(x, causal=True, need_weights=True)
    pool = layer.new_paged_cache(num_pages=16, page_size=3)
    handles = [pool.add(), pool.add()]
    outputs, start = [], 0
    for size in (4, 1, 3, 1):
        out, weights = layer(x[:, start : start + size], causal=True, cache=pool.batch(handles), need_weights=True)
        end = start + size
        torch.testing.assert_close(weights[..., :end], full_weights[:, :, start:end, :end], rtol=0, atol=1e-12)
        outputs.append(out)
        start = end
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- each option does something


def plain_twin(layer: MultiHeadAttention, device, **options) -> MultiHeadAttention:
    """A layer with ``options`` instead of the layer's, sharing every weight the two have in common (W^Q's query
    rows without the gate rows)."""
    twin = make(device, **options)
    h, d = layer.num_heads, layer.head_dim
    state = {key: value for key, value in layer.state_dict().items() if key in twin.state_dict()}
    rows = layer.q_proj.out_features // h
    state["q_proj.weight"] = layer.q_proj.weight.detach().view(h, rows, -1)[:, :d].reshape(h * d, -1)
    state["q_proj.bias"] = layer.q_proj.bias.detach().view(h, rows)[:, :d].reshape(h * d)
    twin.load_state_dict(state, strict=False)
    return twin


@pytest.mark.parametrize(
    "name, without",
    [
        ("qk_norm", {}),
        ("headwise", {}),
        ("elementwise", {}),
        ("rotary_dim", {"rotary": True}),  # partial against full rotary
        ("rotary_dim", {}),  # and against none
        ("sinks", {}),
    ],
)
def test_each_option_changes_the_output(name, without, device):
    layer = make(device, **OPTIONS[name])
    if name == "sinks":
        with torch.no_grad():
            layer.sinks.zero_()  # even at its initial value, a sink takes a share of every row
    twin = plain_twin(layer, device, **without)
    x = randn(2, 6, 20, seed=1, device=device)
    assert torch.equal(twin.v_proj.weight, layer.v_proj.weight)  # the same weights ...
    assert (layer(x, causal=True)[0] - twin(x, causal=True)[0]).abs().max() > 1e-3  # ... another output


def test_without_its_gate_rows_a_gated_layer_would_be_the_plain_one(device):
    """The twin construction used above is sound: a gate of +inf logits (sigmoid 1) gives the plain layer."""
    layer = make(device, output_gate="headwise")
    twin = plain_twin(layer, device)
    with torch.no_grad():
        gate_rows = layer.q_proj.weight.view(6, 7, 20)[:, 6:]
        gate_rows.zero_()
        layer.q_proj.bias.view(6, 7)[:, 6:] = 100.0
    x = randn(2, 6, 20, seed=1, device=device)
    torch.testing.assert_close(layer(x, causal=True)[0], twin(x, causal=True)[0], rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- head surgery


@pytest.mark.parametrize("name", ["sinks", "elementwise", "headwise", "all"])
@pytest.mark.parametrize("removed", [[1, 2, 5], [2, 3]], ids=["one per group", "a whole group"])
def test_pruning_equals_zero_ablation_and_takes_the_sinks_and_gate_rows(name, removed, device):
    layer = make(device, **OPTIONS[name])
    x = randn(2, 6, 20, seed=1, device=device)
    layer.ablate_heads(removed)
    ablated = layer(x, causal=True)[0]
    layer.restore_heads()
    sinks = None if layer.sinks is None else layer.sinks.detach().clone()
    rows = layer.q_proj.out_features // 6
    q_rows = layer.q_proj.weight.detach().view(6, rows, 20).clone()
    kept = layer.prune_heads(removed)
    assert kept == [n for n in range(6) if n not in removed]
    assert layer.q_proj.weight.shape == (len(kept) * rows, 20)
    torch.testing.assert_close(layer.q_proj.weight.view(len(kept), rows, 20), q_rows[kept], rtol=0, atol=0)
    if sinks is not None:
        assert layer.sinks.shape == (len(kept),) and isinstance(layer.sinks, torch.nn.Parameter)
        torch.testing.assert_close(layer.sinks, sinks[kept], rtol=0, atol=0)
        assert "sinks" in dict(layer.named_parameters())
    pruned = layer(x, causal=True)[0]
    torch.testing.assert_close(pruned, ablated, rtol=0, atol=1e-12)
    torch.testing.assert_close(pruned, reference(layer, x, causal=True)[0], rtol=0, atol=1e-12)
    rebuilt = MultiHeadAttention(**layer.config(), dtype=torch.float64, device=device).eval()
    rebuilt.load_state_dict(layer.state_dict())
    torch.testing.assert_close(rebuilt(x, causal=True)[0], pruned, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_gates_and_ablations_still_act_on_each_head(name, device):
    layer = make(device, **OPTIONS[name])
    x = randn(2, 5, 20, seed=1, device=device)
    layer.head_gate = torch.zeros(6, dtype=torch.float64, device=device)
    gated = layer(x, causal=True)[0]
    torch.testing.assert_close(gated, layer.out_proj.bias.expand_as(gated), rtol=0, atol=0)  # every head off
    layer.restore_heads()
    gate = torch.linspace(-1.0, 2.0, 6, dtype=torch.float64, device=device, requires_grad=True)
    layer.head_gate = gate
    layer(x, causal=True)[0].sum().backward()
    assert gate.grad is not None and gate.grad.abs().min() > 0
    layer.restore_heads()
    layer.ablate_heads([0, 5], how="uniform")
    assert (
        layer(x, causal=True)[0] - layer.out_proj(torch.zeros(1, 30, dtype=torch.float64, device=device))
    ).abs().max() > 0


# --------------------------------------------------------------------------- gradients


def test_gradcheck_of_a_tiny_layer_with_every_option(device):
    torch.manual_seed(0)
    layer = MultiHeadAttention(
        6,
        2,
        num_kv_heads=1,
        head_dim=4,
        value_head_dim=3,
        qk_norm=True,
        output_gate="elementwise",
        rotary=True,
        rotary_dim=2,
        sinks=True,
        dtype=torch.float64,
        device=device,
    )
    names = [name for name, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for _, p in layer.named_parameters()]
    with torch.no_grad():
        params[names.index("sinks")].copy_(torch.tensor([0.3, -0.7]))
        params[names.index("q_norm.weight")].copy_(torch.tensor([0.5, 1.5, -1.0, 2.0]))
    x = randn(2, 3, 6, seed=1, device=device, requires_grad=True)

    def run(x, *values):
        out, _ = torch.func.functional_call(layer, dict(zip(names, values, strict=True)), (x,), {"causal": True})
        return out

    assert torch.autograd.gradcheck(run, (x, *params), eps=1e-6, atol=1e-5)
    out = run(x, *params)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in params)  # every option's parameter learns


@pytest.mark.parametrize("name", list(OPTIONS))
def test_gradients_equal_those_of_the_definition(name, device):
    layer = make(device, **OPTIONS[name])
    x = randn(2, 5, 20, seed=1, device=device)
    weights = randn(2, 5, 7, seed=2, device=device)
    (layer(x, causal=True)[0] * weights).sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    (reference(layer, x, causal=True)[0] * weights).sum().backward()
    for n, p in layer.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=0, atol=1e-11, msg=n)


def test_autocast_runs_every_option_in_half_precision(device):
    layer = make(device, **OPTIONS["all"]).float()
    x = randn(2, 6, 20, seed=1, device=device, dtype=torch.float32)
    full = layer(x, causal=True)[0]
    with torch.autocast(device.type, dtype=torch.bfloat16):
        half = layer(x, causal=True)[0]
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), full, rtol=0, atol=0.1)


# --------------------------------------------------------------------------- errors


BAD_OPTIONS = [
    (dict(qk_norm="yes"), TypeError, "qk_norm: expected True or False, got str 'yes'"),
    (dict(qk_norm_eps=1e-5), ValueError, "qk_norm_eps: expected None unless qk_norm=True, got float 1e-05"),
    (dict(qk_norm=True, qk_norm_eps="1e-6"), TypeError, "qk_norm_eps: expected a positive finite float"),
    (dict(qk_norm=True, qk_norm_eps=0.0), ValueError, "qk_norm_eps: expected a positive finite float"),
    (dict(qk_norm=True, qk_norm_eps=math.nan), ValueError, "got nan. Fix: pass e.g. qk_norm_eps=1e-6"),
    (dict(output_gate="channelwise"), ValueError, 'output_gate: expected None, "headwise" or "elementwise"'),
    (dict(output_gate=True), TypeError, 'output_gate: expected None, "headwise" or "elementwise", got bool'),
    (dict(rotary_dim=4), ValueError, "rotary_dim: expected None without rotary positions"),
    (dict(rotary=False, rotary_dim=4), ValueError, "Fix: pass rotary=True too, or drop rotary_dim"),
    (dict(rotary=True, rotary_dim=3), ValueError, "rotary_dim: expected an even int <= head_dim = 6"),
    (dict(rotary=True, rotary_dim=8), ValueError, "rotary_dim: expected an even int <= head_dim = 6 (rotary turns"),
    (dict(rotary=True, rotary_dim=0), ValueError, "rotary_dim: expected a positive int, got 0"),
    (dict(rotary=True, rotary_dim=2.0), TypeError, "rotary_dim: expected a positive int, got float 2.0"),
    (dict(rotary=RotaryEmbedding(6), rotary_dim=4), ValueError, "a RotaryEmbedding of head_dim = 4 (rotary_dim)"),
    (dict(rotary=RotaryEmbedding(4)), ValueError, "Fix: use RotaryEmbedding(6), or pass rotary_dim=4"),
    (dict(rotary="yes", rotary_dim=4), TypeError, "rotary: expected True, False/None or a multihead.positional"),
    (dict(sinks=1), TypeError, "sinks: expected True or False, got int 1"),
    (dict(sinks=None), TypeError, "sinks: expected True or False, got NoneType None"),
]


@pytest.mark.parametrize("options, kind, fragment", BAD_OPTIONS)
def test_bad_options_are_refused_at_construction_with_the_fix(options, kind, fragment):
    with pytest.raises(kind, match=re.escape(fragment)) as caught:
        MultiHeadAttention(**SHAPE, **options)
    assert is_input_error(caught.value, kind)


def test_a_matching_partial_rotary_embedding_is_accepted():
    rotary = RotaryEmbedding(4, base=500.0)
    layer = MultiHeadAttention(**SHAPE, rotary=rotary, rotary_dim=4)
    assert layer.rotary is rotary and layer.rotary_dim == 4
    assert MultiHeadAttention(**SHAPE, rotary=True, rotary_dim=6).config()["rotary_dim"] is None  # full: the default


@pytest.mark.parametrize(
    "options, named",
    [(dict(qk_norm=True), "qk_norm"), (dict(output_gate="headwise"), "output_gate"), (dict(sinks=True), "sinks")],
)
def test_to_torch_refuses_what_torch_cannot_express(options, named):
    layer = MultiHeadAttention(24, 4, **options)
    with pytest.raises(
        ValueError, match=f"layer: expected a configuration torch.nn.MultiheadAttention can express, got {named}"
    ):
        layer.to_torch()


def test_the_repr_names_the_options():
    layer = MultiHeadAttention(**OPTIONS["all"], **SHAPE)
    text = repr(layer)
    assert "rotary_dim=2, output_gate='elementwise', sinks=True" in text
    assert "(q_norm): HeadRMSNorm((6,), eps=1e-06)" in text
