"""LatentAttention (MLA) against its formula written head by head, the absorbed call against the plain one, decoding
with the latent cache against the full causal forward, and the Attend seam (hooks, gates, ablations) on both calls.
No transformers here: tests/lab/test_latent_hf.py holds the layer against transformers' DeepseekV3Attention."""

from __future__ import annotations

import doctest
import math
import re

import pytest
import torch
import torch.nn.functional as F

import multihead
from multihead import KVCache, LatentAttention, LatentCache, latent
from multihead.attend import AttentionSite
from multihead.capture import Recorder
from support import is_input_error, randn

# pairwise-distinct sizes: hidden 24, h 3, c 5, dn 4, r 6, e 7, q_lora_rank 11
SIZES = dict(kv_lora_rank=5, qk_nope_head_dim=4, qk_rope_head_dim=6, v_head_dim=7)
CONFIGS = {
    "q_lora": dict(q_lora_rank=11),
    "q_proj": dict(q_lora_rank=None),
    "bias": dict(q_lora_rank=11, bias=True),
    "rotate_half": dict(q_lora_rank=None, rope_interleave=False),
    "base_and_scale": dict(q_lora_rank=11, rope_base=500.0, scale=0.3, norm_eps=1e-3),
}


def make_layer(name="q_lora", *, hidden=24, heads=3, device="cpu", dtype=torch.float64, seed=0, **overrides):
    """A layer of CONFIGS[name] whose every parameter (norm weights and biases too) is random, so that a weight
    left out or applied twice shows."""
    options = {**SIZES, **CONFIGS[name], **overrides}
    layer = LatentAttention(hidden, heads, **options, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return layer


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotated(x, positions, base, interleave):
    """x (..., n, r) turned pair by pair as the paper writes it: pairs (x[2m], x[2m+1]) kept in place when
    ``interleave``, else the pairs (x[m], x[m + r/2])."""
    r = x.shape[-1]
    angles = positions.double()[..., None] * base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)  # (n, r/2)
    cos, sin = angles.cos().to(x.device), angles.sin().to(x.device)
    first, second = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., : r // 2], x[..., r // 2 :])
    turned = (first * cos - second * sin, second * cos + first * sin)
    if not interleave:
        return torch.cat(turned, dim=-1)
    return torch.stack(turned, dim=-1).flatten(-2)  # back in place: (x[0]', x[1]', x[2]', ...)


def per_head_formula(layer: LatentAttention, x, keep=None, positions=None):
    """The module docstring's formula, one head at a time, from the weights: x (b, n, hidden) -> (b, n, hidden)."""
    h, c, r = layer.num_heads, layer.kv_lora_rank, layer.qk_rope_head_dim
    dn, e, n = layer.qk_nope_head_dim, layer.v_head_dim, x.shape[1]
    positions = torch.arange(n) if positions is None else positions
    base, interleave = layer.rotary.base, layer.rope_interleave
    if layer.q_proj is not None:
        q_all = x @ layer.q_proj.weight.T
    else:
        down = F.linear(x, layer.q_a_proj.weight, layer.q_a_proj.bias)
        q_all = _rms(down, layer.q_a_layernorm.weight, layer.q_a_layernorm.eps) @ layer.q_b_proj.weight.T
    kv_a = F.linear(x, layer.kv_a_proj_with_mqa.weight, layer.kv_a_proj_with_mqa.bias)
    c_kv = _rms(kv_a[..., :c], layer.kv_a_layernorm.weight, layer.kv_a_layernorm.eps)  # (b, n, c)
    k_pe = _rotated(kv_a[..., c:], positions, base, interleave)  # (b, n, r): one for every head
    heads = []
    for head in range(h):
        q = q_all[..., head * (dn + r) : (head + 1) * (dn + r)]
        q_nope, q_pe = q[..., :dn], _rotated(q[..., dn:], positions, base, interleave)
        up = layer.kv_b_proj.weight[head * (dn + e) : (head + 1) * (dn + e)]  # (dn + e, c)
        k_nope, v = c_kv @ up[:dn].T, c_kv @ up[dn:].T
        scores = (q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)) * layer.scale
        if keep is not None:
            scores = scores.masked_fill(~keep, -math.inf)
        heads.append(torch.softmax(scores, dim=-1) @ v)
    return F.linear(torch.cat(heads, dim=-1), layer.o_proj.weight, layer.o_proj.bias)


def decode_in_steps(layer, x, steps, cache, **options):
    outputs, start = [], 0
    for size in steps:
        outputs.append(layer(x[:, start : start + size], causal=True, cache=cache, **options)[0])
        start += size
    return torch.cat(outputs, dim=1)


# --------------------------------------------------------------------------- the formula, both calls


@pytest.mark.portable
@pytest.mark.parametrize("absorb", [False, True], ids=["plain", "absorbed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_equals_the_per_head_formula(name, absorb, device):
    layer = make_layer(name, device=device)
    x = randn(2, 7, 24, seed=1, device=device)
    keep = torch.ones(7, 7, dtype=torch.bool, device=device).tril()
    out, weights = layer(x, causal=True, absorb=absorb)
    assert out.shape == (2, 7, 24) and weights is None
    torch.testing.assert_close(out, per_head_formula(layer, x, keep), rtol=0, atol=1e-12)
    unmasked, _ = layer(x, absorb=absorb)
    torch.testing.assert_close(unmasked, per_head_formula(layer, x), rtol=0, atol=1e-12)


@pytest.mark.portable
@pytest.mark.parametrize("name", list(CONFIGS))
def test_absorbed_equals_plain_outputs_weights_and_gradients(name, device):
    layer = make_layer(name, device=device)
    x = randn(3, 6, 24, seed=2, device=device, requires_grad=True)
    mask = randn(3, 1, 6, 6, seed=3, device=device) > -0.5  # a boolean mask over (b, h, i, j), broadcast over h
    mask[..., 0] = True
    runs = []
    for absorb in (False, True):
        out, weights = layer(x, mask=mask, causal=True, need_weights=True, absorb=absorb)
        grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
        runs.append((out, weights, grads))
    (plain, plain_weights, plain_grads), (absorbed, absorbed_weights, absorbed_grads) = runs
    torch.testing.assert_close(absorbed, plain, rtol=0, atol=1e-12)
    torch.testing.assert_close(absorbed_weights, plain_weights, rtol=0, atol=1e-13)
    assert plain_weights.shape == (3, 3, 6, 6)
    for got, expected in zip(absorbed_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_shapes_parameters_and_names_follow_deepseek():
    layer = LatentAttention(24, 3, **SIZES, q_lora_rank=11)
    shapes = {name: tuple(p.shape) for name, p in layer.state_dict().items()}
    assert shapes == {
        "q_a_proj.weight": (11, 24),
        "q_a_layernorm.weight": (11,),
        "q_b_proj.weight": (3 * (4 + 6), 11),
        "kv_a_proj_with_mqa.weight": (5 + 6, 24),
        "kv_a_layernorm.weight": (5,),
        "kv_b_proj.weight": (3 * (4 + 7), 5),
        "o_proj.weight": (24, 3 * 7),
    }
    plain_q = LatentAttention(24, 3, **SIZES, bias=True)
    assert plain_q.q_proj.weight.shape == (30, 24) and plain_q.q_a_proj is None and plain_q.q_b_proj is None
    assert {name for name, _ in plain_q.named_parameters() if name.endswith("bias")} == {
        "kv_a_proj_with_mqa.bias",
        "o_proj.bias",
    }
    assert layer.scale == pytest.approx(1 / math.sqrt(10)) and layer.qk_head_dim == 10 and layer.num_kv_heads == 3
    rebuilt = LatentAttention(**layer.config())
    rebuilt.load_state_dict(layer.state_dict())
    x = torch.randn(2, 4, 24)
    torch.testing.assert_close(rebuilt(x, causal=True)[0], layer(x, causal=True)[0], rtol=0, atol=0)
    assert "kv_lora_rank=5" in repr(layer)


@pytest.mark.portable
def test_need_weights_never_changes_the_output_and_the_weights_are_the_softmax(device):
    layer = make_layer(device=device)
    x = randn(2, 5, 24, device=device)
    for absorb in (False, True):
        out, weights = layer(x, causal=True, need_weights=True, absorb=absorb)
        torch.testing.assert_close(out, layer(x, causal=True, absorb=absorb)[0], rtol=0, atol=1e-13)  # another kernel
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 5, dtype=torch.float64, device=device))
        assert torch.equal(weights.triu(1), torch.zeros_like(weights))  # causal: nothing above the diagonal


@pytest.mark.portable
def test_dropout_only_in_training(device):
    layer = make_layer(device=device, dropout=0.5)
    x = randn(2, 5, 24, device=device)
    layer.eval()
    assert torch.equal(layer(x)[0], layer(x)[0])
    layer.train()
    torch.manual_seed(0)
    first = layer(x)[0]
    assert not torch.allclose(first, layer(x)[0])


def test_float64_gradcheck_of_a_tiny_layer_on_both_calls():
    layer = LatentAttention(6, 2, kv_lora_rank=3, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3, q_lora_rank=4)
    layer = layer.double()
    names = [name for name, _ in layer.named_parameters()]
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    params = [p.detach().clone().requires_grad_(True) for p in layer.parameters()]
    for absorb in (False, True):

        def run(x, *weights, absorb=absorb):
            state = dict(zip(names, weights, strict=True))
            return torch.func.functional_call(layer, state, (x,), {"causal": True, "absorb": absorb})[0]

        assert torch.autograd.gradcheck(run, (x, *params))


# --------------------------------------------------------------------------- the cache


@pytest.mark.portable
@pytest.mark.parametrize("absorb", [None, False, True], ids=["default", "plain", "absorbed"])
@pytest.mark.parametrize("name", ["q_lora", "q_proj", "rotate_half"])
def test_decoding_with_the_latent_cache_equals_the_full_causal_forward(name, absorb, device):
    layer = make_layer(name, device=device)
    x = randn(3, 11, 24, seed=4, device=device)
    full, _ = layer(x, causal=True, absorb=False)
    cache = layer.new_cache(batch_size=3, max_len=16)
    assert cache.storage.shape == (3, 1, 16, 5 + 6) and cache.storage.device == device  # c + r, nothing per head
    stepped = decode_in_steps(layer, x, [5, 1, 1, 3, 1], cache, absorb=absorb)  # prefill, then one or more a step
    torch.testing.assert_close(stepped, full, rtol=0, atol=1e-12)
    assert len(cache) == cache.seen == 11


@pytest.mark.portable
def test_the_cache_holds_the_normed_latent_and_the_rotated_shared_key(device):
    layer = make_layer(device=device)
    x = randn(2, 4, 24, device=device)
    cache = layer.new_cache(2, 6)
    layer(x, causal=True, cache=cache)
    c = layer.kv_lora_rank
    kv_a = layer.kv_a_proj_with_mqa(x)  # (b, n, c + r)
    torch.testing.assert_close(cache.latent, layer.kv_a_layernorm(kv_a[..., :c]), rtol=0, atol=1e-14)
    # stored in rotate-half order: the interleaved pairs' results as halves, as transformers caches them
    rotated = _rotated(kv_a[..., c:], torch.arange(4), layer.rotary.base, True)  # (b, n, r) pairs in place
    halves = torch.cat((rotated[..., 0::2], rotated[..., 1::2]), dim=-1)
    torch.testing.assert_close(cache.rope_keys, halves, rtol=0, atol=1e-14)
    assert cache.latent.shape == (2, 4, 5) and cache.rope_keys.shape == (2, 4, 6)
    assert cache.bytes_per_token == (5 + 6) * 8
    assert cache.latent.nbytes + cache.rope_keys.nbytes == 2 * 4 * cache.bytes_per_token


@pytest.mark.portable
def test_explicit_positions_match_the_default_offsets_and_only_relative_positions_count(device):
    layer = make_layer(device=device)
    x = randn(2, 6, 24, device=device)
    cache = layer.new_cache(2, 8)
    layer(x[:, :4], causal=True, cache=cache)
    default, _ = layer(x[:, 4:], causal=True, cache=cache)
    cache.reset()
    layer(x[:, :4], causal=True, cache=cache, positions=cache.positions(4))
    rows = torch.arange(4, 6, device=device).expand(2, 2)  # (b, i): one row of positions per batch element
    explicit, _ = layer(x[:, 4:], causal=True, cache=cache, positions=rows)
    torch.testing.assert_close(explicit, default, rtol=0, atol=0)
    at_zero, _ = layer(x, causal=True)
    shifted, _ = layer(x, causal=True, positions=torch.arange(100, 106, device=device))
    torch.testing.assert_close(shifted, at_zero, rtol=0, atol=1e-10)
    moved, _ = layer(x, causal=True, positions=torch.tensor([0, 1, 2, 3, 4, 9], device=device))
    assert not torch.allclose(moved, at_zero)


@pytest.mark.portable
def test_cache_append_reset_and_reuse(device):
    cache = LatentCache(2, 5, kv_lora_rank=3, rope_head_dim=2, dtype=torch.float64, device=device)
    first = randn(2, 2, 3, device=device), randn(2, 2, 2, seed=1, device=device)
    latent_held, rope_held = cache.append(*first)
    assert torch.equal(latent_held, first[0]) and torch.equal(rope_held, first[1]) and len(cache) == 2
    assert torch.equal(cache.positions(3), torch.arange(2, 5))
    second = randn(2, 1, 3, seed=2, device=device), randn(2, 1, 2, seed=3, device=device)
    latent_held, _ = cache.append(*second)
    assert torch.equal(latent_held, torch.cat((first[0], second[0]), dim=1)) and cache.seen == 3
    assert torch.equal(cache.storage[:, 0, :3, :3], latent_held)  # one tensor: [latent, rope keys] per token
    cache.reset()
    assert len(cache) == 0 and cache.latent.shape == (2, 0, 3)
    assert "held=0" in repr(cache)
    layer = make_layer(device=device)
    x = randn(2, 6, 24, device=device)
    reused = layer.new_cache(2, 8)
    once = decode_in_steps(layer, x, [3, 3], reused)
    reused.reset()
    torch.testing.assert_close(decode_in_steps(layer, x, [2, 1, 3], reused), once, rtol=0, atol=1e-12)


def _failing_steps(layer, x):
    """reason -> (a cached call of one token that raises, a fragment of its message)."""
    token = x[:, 3:4]
    return {
        "bad mask": (lambda c: layer(token, causal=True, cache=c, mask=torch.ones(1, 9, dtype=torch.bool)), "mask"),
        "negative position": (
            lambda c: layer(token, causal=True, cache=c, positions=torch.tensor([-1])),
            "positions: expected non-negative positions",
        ),
        "wrong dtype": (lambda c: layer(token.float(), causal=True, cache=c), "x: expected dtype torch.float64"),
        "mean ablation absorbed": (
            lambda c: _mean_ablated(layer, lambda: layer(token, cache=c, absorb=True)),
            "absorb",
        ),
    }


def _mean_ablated(layer, call):
    layer.ablate_heads([1], how="mean", mean_outputs=torch.zeros(1, layer.v_head_dim, dtype=torch.float64))
    try:
        return call()
    finally:
        layer.restore_heads()


def test_a_failed_cached_call_leaves_the_cache_and_the_rotary_tables_as_they_were():
    layer = make_layer()
    x = randn(2, 6, 24)
    cache, uninterrupted = layer.new_cache(2, 8), layer.new_cache(2, 8)
    layer(x[:, :3], causal=True, cache=cache)
    layer(x[:, :3], causal=True, cache=uninterrupted)
    for reason, (step, fragment) in _failing_steps(layer, x).items():
        held, table = cache.storage[:, :, : len(cache)].clone(), layer.rotary._cos_sin.clone()
        before = len(cache)
        with pytest.raises((ValueError, TypeError), match=re.escape(fragment)):
            step(cache)
        assert len(cache) == before == 3, reason
        assert torch.equal(cache.storage[:, :, : len(cache)], held), reason
        assert torch.equal(layer.rotary._cos_sin, table), reason  # tables grow only when a call succeeds
    for start in (3, 4, 5):  # the retried token and the next ones are exactly the uninterrupted run's
        torch.testing.assert_close(
            layer(x[:, start : start + 1], causal=True, cache=cache)[0],
            layer(x[:, start : start + 1], causal=True, cache=uninterrupted)[0],
            rtol=0,
            atol=0,
        )


def test_a_failed_append_leaves_the_cache_as_it_was():
    cache = LatentCache(2, 4, 3, 2, dtype=torch.float64)
    cache.append(torch.ones(2, 2, 3, dtype=torch.float64), torch.ones(2, 2, 2, dtype=torch.float64))
    storage = cache.storage.clone()
    with pytest.raises(ValueError, match="rope_keys: expected n = 1 new tokens"):
        cache.append(torch.zeros(2, 1, 3, dtype=torch.float64), torch.zeros(2, 2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=re.escape("cache: expected room for 3 more token(s)")):
        cache.append(torch.zeros(2, 3, 3, dtype=torch.float64), torch.zeros(2, 3, 2, dtype=torch.float64))
    assert len(cache) == 2 and torch.equal(cache.storage, storage)  # not even a free slot was written
    pending = cache.stage(torch.zeros(2, 1, 3, dtype=torch.float64), torch.zeros(2, 1, 2, dtype=torch.float64))
    cache.reset()
    with pytest.raises(RuntimeError, match="the cache changed between stage"):
        pending.commit()


# --------------------------------------------------------------------------- the Attend seam


@pytest.mark.portable
def test_forward_hooks_on_attend_see_every_call_with_its_heads(device):
    layer = make_layer(device=device)
    x = randn(2, 4, 24, device=device)
    seen = []
    handle = layer.attend.register_forward_hook(
        lambda module, args, result: seen.append([tuple(t.shape) for t in (*args[:3], result.output)])
    )
    try:
        layer(x, causal=True)  # plain: per-head keys and values, g = h
        cache = layer.new_cache(2, 6)
        layer(x, causal=True, cache=cache)  # absorbed: multi-query over the latent, g = 1
        layer(x[:, :1], causal=True, cache=cache)
    finally:
        handle.remove()
    h, c, r, dn, e = 3, 5, 6, 4, 7
    assert seen == [
        [(2, h, 4, dn + r), (2, h, 4, dn + r), (2, h, 4, e), (2, h, 4, e)],
        [(2, h, 4, c + r), (2, 1, 4, c + r), (2, 1, 4, c), (2, h, 4, c)],
        [(2, h, 1, c + r), (2, 1, 5, c + r), (2, 1, 5, c), (2, h, 1, c)],
    ]


@pytest.mark.portable
def test_the_recorder_reads_the_weights_of_both_calls_through_attend(device):
    """capture's Recorder, given the layer's site (the lab's capture() finds MultiHeadAttention layers only), records
    the weights the kernel computed, on the plain call and on the absorbed one (the same weights)."""
    layer = make_layer(device=device)
    x = randn(2, 4, 24, device=device)
    site = AttentionSite(layer.attend, layer.num_heads, layer.num_kv_heads, "self", 0, "latent")
    with Recorder(layer, part="self", heads=[0, 2], sites=[site]) as rec:
        out, _ = layer(x, causal=True, absorb=False)
        absorbed, _ = layer(x, causal=True, absorb=True)
    _, weights = layer(x, causal=True, need_weights=True)
    assert rec.calls(0) == 2
    for call in (0, 1):
        torch.testing.assert_close(rec.weights(0, call=call), weights[:, [0, 2]], rtol=0, atol=1e-13)
    torch.testing.assert_close(out, layer(x, causal=True)[0], rtol=0, atol=1e-13)  # recording changed nothing
    torch.testing.assert_close(absorbed, out, rtol=0, atol=1e-12)


@pytest.mark.portable
@pytest.mark.parametrize("absorb", [False, True], ids=["plain", "absorbed"])
def test_zero_ablation_and_gates_act_on_the_heads(absorb, device):
    layer = make_layer(device=device)
    x = randn(2, 5, 24, device=device)
    intact, _ = layer(x, causal=True, absorb=absorb)
    layer.ablate_heads([1])
    ablated, _ = layer(x, causal=True, absorb=absorb)
    assert not torch.allclose(ablated, intact)
    without = make_layer(device=device)  # the same weights with head 1's columns of W^O zeroed
    with torch.no_grad():
        without.o_proj.weight[:, 7:14] = 0.0
    torch.testing.assert_close(ablated, without(x, causal=True)[0], rtol=0, atol=1e-12)
    layer.restore_heads()
    torch.testing.assert_close(layer(x, causal=True, absorb=absorb)[0], intact, rtol=0, atol=0)
    gate = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64, device=device, requires_grad=True)
    layer.head_gate = gate
    gated, _ = layer(x, causal=True, absorb=absorb)
    torch.testing.assert_close(gated, ablated, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(gated.sum(), gate)
    assert grad.abs().min() > 0  # every head's gate gets a gradient, the closed one too
    layer.restore_heads()
    with pytest.raises(ValueError, match=re.escape("head_gate: expected a tensor of shape (h,) = (3,)")):
        layer.head_gate = torch.ones(2)


@pytest.mark.portable
def test_uniform_ablation_is_the_same_on_both_calls_and_a_mean_ablation_runs_plain(device):
    layer = make_layer(device=device)
    x = randn(2, 5, 24, device=device)
    layer.ablate_heads([0, 2], how="uniform")
    uniform = [layer(x, causal=True, absorb=absorb)[0] for absorb in (False, True)]
    torch.testing.assert_close(uniform[1], uniform[0], rtol=0, atol=1e-12)
    means = randn(1, 7, device=device)
    layer.ablate_heads([2], how="mean", mean_outputs=means)
    cache = layer.new_cache(2, 5)
    decoded = decode_in_steps(layer, x, [3, 1, 1], cache)  # the default picks the plain call
    torch.testing.assert_close(decoded, layer(x, causal=True)[0], rtol=0, atol=1e-12)
    layer.restore_heads()
    assert not torch.allclose(decoded, layer(x, causal=True)[0])


def test_docstring_examples_run():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = finder.find(latent, globs={"torch": torch, "LatentAttention": LatentAttention, "LatentCache": LatentCache})
    assert sum(len(test.examples) for test in tests) >= 8
    for test in tests:
        runner.run(test)
    assert runner.failures == 0
    assert multihead.LatentAttention is LatentAttention and multihead.LatentCache is LatentCache


# --------------------------------------------------------------------------- errors

BAD_CONSTRUCTION = [
    (dict(hidden_size=0), ValueError, "hidden_size: expected a positive int"),
    (dict(num_heads=2.5), TypeError, "num_heads: expected a positive int"),
    (dict(kv_lora_rank=0), ValueError, "kv_lora_rank: expected a positive int"),
    (dict(qk_rope_head_dim=5), ValueError, "qk_rope_head_dim: expected a positive even int"),
    (dict(v_head_dim=None), TypeError, "v_head_dim: expected a positive int"),
    (dict(q_lora_rank=0), ValueError, "q_lora_rank: expected a positive int"),
    (dict(rope_base=-1.0), ValueError, "rope_base: expected a positive finite float"),
    (dict(rope_base="10000"), TypeError, "rope_base: expected a positive finite float"),
    (dict(norm_eps=0.0), ValueError, "norm_eps: expected a positive finite float"),
    (dict(scale=math.nan), ValueError, "scale: expected a positive finite float or None"),
    (dict(rope_interleave="yes"), TypeError, "rope_interleave: expected True or False"),
    (dict(bias=1), TypeError, "bias: expected True or False"),
    (dict(dropout=1.0), ValueError, "dropout: expected a probability in [0, 1)"),
    (dict(backend="fastest"), ValueError, "backend: expected 'auto' or one of"),
    (dict(backend=3), TypeError, "backend: expected a backend name (str)"),
    (dict(dtype=torch.int64), ValueError, "dtype: expected a real floating dtype"),
    (dict(device="nope"), ValueError, "device: expected a device this torch can use"),
    (dict(hidden_size=2**20, num_heads=2**12), ValueError, "hidden_size: expected the weights to fit"),
]


@pytest.mark.parametrize("overrides,kind,fragment", BAD_CONSTRUCTION)
def test_bad_construction_raises_clearly(overrides, kind, fragment):
    options = {"hidden_size": 24, "num_heads": 3, **SIZES, **overrides}
    with pytest.raises(kind) as excinfo:
        LatentAttention(options.pop("hidden_size"), options.pop("num_heads"), **options)
    message = str(excinfo.value)
    assert is_input_error(excinfo.value, kind) and fragment in message and "Fix:" in message, message


def bad_calls(device: torch.device | str = "cpu"):
    """(call, error type, message fragment) for layers, inputs and caches on ``device``."""
    layer = LatentAttention(24, 3, **SIZES, device=device)
    x = torch.randn(2, 5, 24).to(device)
    full = layer.new_cache(2, 6)
    layer(x, causal=True, cache=full)
    other = LatentAttention(24, 3, **{**SIZES, "kv_lora_rank": 4}, device=device).new_cache(2, 8)
    cache = LatentCache(2, 4, 5, 6, device=device)

    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=device)

    return [
        (lambda: layer([1.0]), TypeError, "x: expected a torch.Tensor"),
        (lambda: layer(x[0]), ValueError, "x: expected shape (b, i, 24) with b, i >= 1"),
        (lambda: layer(x[..., :23]), ValueError, "x: expected shape (b, i, 24)"),
        (lambda: layer(x[:0]), ValueError, "x: expected shape (b, i, 24) with b, i >= 1"),
        (lambda: layer(x.double()), TypeError, "x: expected dtype torch.float32 (the dtype of the layer's"),
        (lambda: layer(x.long()), TypeError, "x: expected a floating dtype"),
        (lambda: layer(x, causal=1), TypeError, "causal: expected True or False"),
        (lambda: layer(x, need_weights="yes"), TypeError, "need_weights: expected True or False"),
        (lambda: layer(x, absorb=1), TypeError, "absorb: expected True or False"),
        (lambda: layer(x, cache={}), TypeError, "cache: expected a multihead.LatentCache"),
        (lambda: layer(x, cache=KVCache(2, 8, 3, 10, device=device)), TypeError, "cache: expected a multihead."),
        (lambda: layer(x, cache=other), ValueError, "cache: expected a latent cache for kv_lora_rank c = 5"),
        (lambda: layer(x[:1], cache=layer.new_cache(2, 8)), ValueError, "cache: expected a latent cache for batch"),
        (
            lambda: layer(x, cache=LatentCache(2, 8, 5, 6, dtype=torch.float64, device=device)),
            ValueError,
            "cache: expected a latent cache of torch.float32",
        ),
        (lambda: layer(x[:, :2], cache=full), ValueError, "cache: expected room for 2 more token(s) (max_len = 6)"),
        (
            lambda: layer(x, positions=torch.arange(5.0, device=device)),
            TypeError,
            "positions: expected an integer tensor",
        ),
        (
            lambda: layer(x, positions=torch.arange(4, device=device)),
            ValueError,
            "positions: expected shape (i,) = (5,)",
        ),
        (
            lambda: layer(x, mask=torch.ones(5, 6, dtype=torch.bool, device=device)),
            ValueError,
            "mask: expected a shape broadcastable",
        ),
        (lambda: LatentCache(0, 4, 5, 6), ValueError, "batch_size: expected a positive int"),
        (lambda: LatentCache(2, 4, 5, 6, dtype=torch.int32), ValueError, "dtype: expected a real floating dtype"),
        (lambda: cache.append([0.0], None), TypeError, "latent: expected a torch.Tensor"),
        (
            lambda: cache.append(zeros(2, 1, 4), zeros(2, 1, 6)),
            ValueError,
            "latent: expected shape (b, n, c) = (2, n, 5) with n >= 1",
        ),
        (
            lambda: cache.append(zeros(2, 1, 5, dtype=torch.float64), zeros(2, 1, 6)),
            TypeError,
            "latent: expected dtype torch.float32 (the dtype of the cache)",
        ),
        (
            lambda: cache.append(zeros(2, 1, 5), zeros(2, 1, 5)),
            ValueError,
            "rope_keys: expected shape (b, n, r) = (2, n, 6)",
        ),
        (lambda: cache.positions(0), ValueError, "n: expected a positive int"),
        (
            lambda: LatentAttention.from_transformers(torch.nn.Linear(2, 2)),
            TypeError,
            "module: expected a transformers",
        ),
    ]


@pytest.mark.portable
@pytest.mark.parametrize("index", range(len(bad_calls())))
def test_bad_calls_raise_clearly(index, device):
    call, kind, fragment = bad_calls(device)[index]
    with pytest.raises(kind) as excinfo:
        call()
    message = str(excinfo.value)
    assert is_input_error(excinfo.value, kind) and fragment in message and "Fix:" in message, message


@pytest.mark.portable
@pytest.mark.parametrize("absorb", [False, True], ids=["plain", "absorbed"])
def test_capture_finds_the_layer_and_records_both_paths(absorb, device):
    """multihead.capture numbers LatentAttention layers as layers, and on the absorbed path (one key head shared by
    every query head) records each head's key as that one head's."""
    from multihead.capture import attention_sites, capture

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        LatentAttention(
            16, 4, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3, dtype=torch.float64
        )
    ).to(device)
    x = torch.randn(2, 5, 16, dtype=torch.float64, device=device)
    assert [(site.index, site.name) for site in attention_sites(model)] == [(0, "0")]
    cache = model[0].new_cache(2, 8) if absorb else None
    with capture(model, heads=[3, 1], qkv=True) as recorder:
        model[0](x, causal=True, cache=cache)
    weights = recorder.weights(0)
    assert weights.shape == (2, 2, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 5, dtype=torch.float64, device=device))
    assert recorder.k(0).shape[:3] == (2, 2, 5)
