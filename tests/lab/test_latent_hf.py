"""multihead.LatentAttention against transformers' DeepseekV3Attention with the same weights: forward, gradients and
decoding with each library's cache, in float64 and float32, with and without q_lora_rank, in both rotary layouts.

Tiny configs built in memory (nothing downloaded). transformers computes a few steps in float32 whatever the input
(its RMSNorm casts to float32, its rotary tables are float32, its eager softmax runs in float32): run as it is, it
agrees with us to ~1e-7 in float64. With those casts lifted (the same formulas in float64, its sdpa attention),
the two agree to rounding, which pins every weight, split, order and scale exactly.
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # in-memory configs only, never the hub

import pytest
import torch
from transformers import DynamicCache
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from multihead import LatentAttention
from support import TINY, assert_within_rule, randn

HIDDEN, HEADS, ROPE = 24, 3, 6
SIZES = dict(kv_lora_rank=5, qk_nope_head_dim=4, qk_rope_head_dim=ROPE, v_head_dim=7)
Q_LORA = {"q_lora": 11, "q_proj": None}
LAYOUT = {"interleave": True, "rotate_half": False}


def theirs(q_lora_rank, rope_interleave, *, bias=False, rope=None, seed=0):
    """A DeepseekV3Attention in float64 whose every parameter is random (norm weights and biases too)."""
    config = DeepseekV3Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        rope_interleave=rope_interleave,
        attention_bias=bias,
        num_hidden_layers=1,
        vocab_size=11,
        max_position_embeddings=64,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
        **SIZES,
    )
    module = DeepseekV3Attention(config, layer_idx=0).double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return module


def lift_float32_casts(module):
    """transformers' RMSNorm without its cast to float32 (the same formula in the input's dtype)."""
    for norm in (module.q_a_layernorm, module.kv_a_layernorm):
        if norm is not None:
            norm.forward = lambda h, norm=norm: (
                norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
            )
    return module


def run_theirs(module, x, *, start=0, cache=None, exact=False, implementation="eager"):
    """transformers' forward of x (b, i, hidden) at positions start .. start + i - 1, causal over the cached
    tokens and these (bottom-right), with its own rotary tables (``exact``: the same in float64)."""
    module.config._attn_implementation = implementation
    b, i = x.shape[:2]
    positions = torch.arange(start, start + i)[None].expand(b, i)
    if exact:
        inverse = 10000.0 ** (-torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
        angles = positions.double()[..., None] * inverse
        angles = torch.cat((angles, angles), dim=-1)  # (b, i, r): transformers' cat(freqs, freqs)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    else:
        cos, sin = DeepseekV3RotaryEmbedding(module.config)(x, positions)
    j = start + i
    blocked = torch.ones(i, j, dtype=torch.bool).triu(j - i + 1)  # query q sees keys 0 .. start + q
    mask = torch.zeros(i, j, dtype=x.dtype).masked_fill(blocked, float("-inf"))[None, None]
    return module(x, (cos, sin), mask, cache=cache)[0]


def gradients(out, x, module):
    """d sum(out^2) / d x and each parameter, by name."""
    names, params = zip(*module.named_parameters(), strict=True)
    grads = torch.autograd.grad(out.square().sum(), [x, *params])
    return grads[0], dict(zip(names, grads[1:], strict=True))


def test_their_state_dict_loads_as_it_is_and_from_transformers_reads_the_config():
    module = theirs(11, True, bias=True)
    ours = LatentAttention.from_transformers(module)
    assert set(ours.state_dict()) == set(module.state_dict())
    for name, tensor in module.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    assert (ours.num_heads, ours.q_lora_rank, ours.kv_lora_rank, ours.v_head_dim) == (3, 11, 5, 7)
    assert ours.scale == module.scaling and ours.rope_interleave and ours.rotary.base == 10000.0
    assert ours.kv_a_layernorm.eps == module.kv_a_layernorm.variance_epsilon == 1e-6
    fresh = LatentAttention(HIDDEN, HEADS, **SIZES, q_lora_rank=11, bias=True, dtype=torch.float64)
    fresh.load_state_dict(module.state_dict())  # strict: the same names and shapes
    assert not LatentAttention.from_transformers(theirs(None, False)).rope_interleave


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("absorb", [False, True], ids=["plain", "absorbed"])
@pytest.mark.parametrize("layout", list(LAYOUT))
@pytest.mark.parametrize("q_lora", list(Q_LORA))
def test_equal_to_transformers_in_float64_forward_and_gradients(q_lora, layout, absorb, implementation):
    module = theirs(Q_LORA[q_lora], LAYOUT[layout])
    ours = LatentAttention.from_transformers(module)
    x = randn(2, 7, HIDDEN, seed=1, requires_grad=True)
    mine = ours(x, causal=True, absorb=absorb)[0]
    as_is = run_theirs(module, x, implementation=implementation)
    torch.testing.assert_close(mine, as_is, rtol=0, atol=2e-6)  # their float32 norms, tables (and eager softmax)
    exact = run_theirs(lift_float32_casts(module), x, exact=True, implementation="sdpa")
    torch.testing.assert_close(mine, exact, rtol=0, atol=1e-13)
    (my_x, my_params), (their_x, their_params) = gradients(mine, x, ours), gradients(exact, x, module)
    torch.testing.assert_close(my_x, their_x, rtol=0, atol=1e-12)
    assert set(my_params) == set(their_params)
    for name, grad in their_params.items():
        torch.testing.assert_close(my_params[name], grad, rtol=0, atol=1e-11, msg=name)


@pytest.mark.parametrize("absorb", [False, True], ids=["plain", "absorbed"])
@pytest.mark.parametrize("layout", list(LAYOUT))
@pytest.mark.parametrize("q_lora", list(Q_LORA))
def test_float32_is_within_the_rule_of_transformers_float32(q_lora, layout, absorb):
    """|ours in float32 - exact float64| <= 2 |transformers in float32 - exact float64| + tiny, outputs and
    gradients (DESIGN.md's rule, transformers in float32 as the low-precision reference)."""
    module32 = theirs(Q_LORA[q_lora], LAYOUT[layout], bias=True).float()
    module = copy.deepcopy(module32).double()  # the reference from the same float32 weights and inputs
    ours = LatentAttention.from_transformers(module32)
    assert ours.o_proj.weight.dtype == torch.float32
    x32 = randn(2, 7, HIDDEN, seed=2, dtype=torch.float32, requires_grad=True)
    x64 = x32.detach().double().requires_grad_(True)
    mine = ours(x32, causal=True, absorb=absorb)[0]
    low = run_theirs(module32, x32)
    ref = run_theirs(lift_float32_casts(module), x64, exact=True, implementation="sdpa")
    assert_within_rule(mine, ref, low)
    (my_x, my_params), (low_x, low_params) = gradients(mine, x32, ours), gradients(low, x32, module32)
    ref_x, ref_params = gradients(ref, x64, module)
    assert_within_rule(my_x, ref_x, low_x, what="grad x")
    for name, ref_grad in ref_params.items():
        # a parameter's gradient sums over every token and row: its values reach hundreds (kv_a_layernorm's 380),
        # where one float32 ulp is 4.5e-5, above the rule's tiny of 1e-5. The floor is one ulp of its largest value:
        # on an AMD EPYC (AVX-512) ours was off by 4.9e-5 where transformers' float32 happened to be off by 1.8e-5
        floor = max(TINY[torch.float32], torch.finfo(torch.float32).eps * ref_grad.abs().max().item())
        assert_within_rule(my_params[name], ref_grad, low_params[name], what=f"grad {name}", tiny=floor)


@pytest.mark.parametrize("absorb", [None, False, True], ids=["default", "plain", "absorbed"])
@pytest.mark.parametrize("q_lora", list(Q_LORA))
def test_decoding_equals_transformers_with_its_cache_and_caches_what_it_caches(q_lora, absorb):
    module = lift_float32_casts(theirs(Q_LORA[q_lora], True))
    ours = LatentAttention.from_transformers(module)
    x = randn(2, 9, HIDDEN, seed=3)
    their_cache, my_cache = DynamicCache(), ours.new_cache(batch_size=2, max_len=12)
    start = 0
    with torch.no_grad():
        for size in (4, 1, 1, 3):
            step = x[:, start : start + size]
            expected = run_theirs(module, step, start=start, cache=their_cache, exact=True, implementation="sdpa")
            got = ours(step, causal=True, cache=my_cache, absorb=absorb)[0]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-13)
            start += size
    # transformers caches the latent after kv_a_layernorm as keys and the rotated shared key as values
    layer = their_cache.layers[0]
    assert layer.keys.shape == (2, 1, 9, 5) and layer.values.shape == (2, 1, 9, ROPE)
    torch.testing.assert_close(my_cache.latent, layer.keys[:, 0], rtol=0, atol=1e-14)
    torch.testing.assert_close(my_cache.rope_keys, layer.values[:, 0], rtol=0, atol=1e-14)


def test_rope_scaling_is_refused_not_run_differently():
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    module = theirs(11, True, rope=yarn)
    assert module.scaling != (4 + ROPE) ** -0.5  # transformers folds yarn's mscale^2 into the softmax scale
    with pytest.raises(ValueError, match=r"module: expected rotary of the default kind .* got rope_type 'yarn'"):
        LatentAttention.from_transformers(module)
