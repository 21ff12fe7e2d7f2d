"""MultiHeadAttention against the formula written per head, KV-cache decoding against the full forward."""

from __future__ import annotations

import math
import re

import pytest
import torch

from multihead import KVCache, MultiHeadAttention, masks
from multihead.positional import RotaryEmbedding
from support import is_input_error, randn

OF_THE_PARAMETERS = "(the dtype of the layer's parameters)"  # what a query of another dtype is told

torch.manual_seed(0)


def per_head_formula(layer: MultiHeadAttention, query, key, value, keep=None):
    """Concat_n(softmax(Q W_n^Q (K W_n^K)^T / sqrt(d) + mask) V W_n^V) W^O, one head at a time, from the weights.

    query (b, i, E), key (b, j, kdim), value (b, j, vdim), keep (i, j) bool or None -> (b, i, out_dim).
    """
    h, g, d, e = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.value_head_dim

    def rows(proj, n, size):
        weight = proj.weight[n * size : (n + 1) * size]  # this head's rows of the stacked projection
        bias = None if proj.bias is None else proj.bias[n * size : (n + 1) * size]
        return weight, bias

    heads = []
    for n in range(h):
        wq, bq = rows(layer.q_proj, n, d)
        wk, bk = rows(layer.k_proj, n // (h // g), d)
        wv, bv = rows(layer.v_proj, n // (h // g), e)
        q = torch.nn.functional.linear(query, wq, bq)
        k = torch.nn.functional.linear(key, wk, bk)
        v = torch.nn.functional.linear(value, wv, bv)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        if keep is not None:
            scores = scores.masked_fill(~keep, -math.inf)
        heads.append(torch.softmax(scores, dim=-1) @ v)
    return layer.out_proj(torch.cat(heads, dim=-1))


CONFIGS = {
    "classic": dict(embed_dim=24, num_heads=4),
    "gqa": dict(embed_dim=24, num_heads=6, num_kv_heads=2),
    "mqa": dict(embed_dim=24, num_heads=6, num_kv_heads=1),
    "head_dims": dict(embed_dim=24, num_heads=3, head_dim=5, value_head_dim=7, out_dim=11),
    "cross_dims": dict(embed_dim=24, num_heads=4, kdim=9, vdim=13),
    "no_bias": dict(embed_dim=24, num_heads=4, bias=False),
}


@pytest.mark.portable
@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_equals_the_per_head_formula(name, device):
    layer = MultiHeadAttention(**CONFIGS[name], dtype=torch.float64, device=device)
    b, i, j = 2, 5, 7
    query = randn(b, i, 24, seed=1, device=device)
    key = randn(b, j, layer.kdim, seed=2, device=device)
    value = randn(b, j, layer.vdim, seed=3, device=device)
    out, weights = layer(query, key, value)
    assert weights is None and out.shape == (b, i, layer.out_dim)
    torch.testing.assert_close(out, per_head_formula(layer, query, key, value), rtol=0, atol=1e-12)
    if layer.kdim == layer.vdim == 24:  # self-attention: the fused QKV path
        self_out, _ = layer(query, causal=True)
        keep = torch.ones(i, i, dtype=torch.bool, device=device).tril()
        torch.testing.assert_close(self_out, per_head_formula(layer, query, query, query, keep), rtol=0, atol=1e-12)


def test_defaults_reproduce_the_classic_layer():
    layer = MultiHeadAttention(512, 8)
    assert (layer.head_dim, layer.value_head_dim, layer.num_kv_heads, layer.out_dim) == (64, 64, 8, 512)
    weights = sum(p.numel() for n, p in layer.named_parameters() if n.endswith("weight"))
    biases = sum(p.numel() for n, p in layer.named_parameters() if n.endswith("bias"))
    assert weights == 4 * 512**2 == 1_048_576  # the textbook's d = 512, h = 8 count
    assert biases == 4 * 512


def test_grouped_heads_store_fewer_key_value_weights():
    layer = MultiHeadAttention(64, 8, num_kv_heads=2)
    assert layer.k_proj.weight.shape == (2 * 8, 64) and layer.v_proj.weight.shape == (2 * 8, 64)


@pytest.mark.portable
def test_need_weights_never_changes_the_output_and_average_is_the_head_mean(device):
    layer = MultiHeadAttention(24, 6, num_kv_heads=3, device=device)
    x = randn(2, 5, 24, dtype=torch.float32, device=device)
    plain, _ = layer(x, causal=True)
    out, weights = layer(x, causal=True, need_weights=True)
    torch.testing.assert_close(out, plain, rtol=1e-6, atol=1e-6)
    assert weights.shape == (2, 6, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 6, 5, device=device))
    _, averaged = layer(x, causal=True, need_weights=True, average_weights=True)
    torch.testing.assert_close(averaged, weights.mean(1))


@pytest.mark.portable
def test_value_defaults_to_key_and_self_attention_equals_cross_attention_on_itself(device):
    layer = MultiHeadAttention(24, 4, dtype=torch.float64, device=device)
    x = randn(2, 5, 24, seed=1, device=device)
    memory = randn(2, 7, 24, seed=2, device=device)
    torch.testing.assert_close(layer(x, memory)[0], layer(x, memory, memory)[0], rtol=0, atol=0)
    # the fused QKV path and three separate projections agree; nothing depends on `query is key`
    torch.testing.assert_close(layer(x)[0], layer(x, x.clone(), x.clone())[0], rtol=0, atol=1e-12)


@pytest.mark.portable
def test_dropout_only_in_training(device):
    layer = MultiHeadAttention(24, 4, dropout=0.5, device=device)
    x = randn(2, 5, 24, dtype=torch.float32, device=device)
    layer.eval()
    torch.testing.assert_close(layer(x)[0], layer(x)[0], rtol=0, atol=0)
    layer.train()
    torch.manual_seed(0)
    first = layer(x)[0]
    assert not torch.allclose(first, layer(x)[0])
    # weights returned under dropout are the ones applied: rows no longer sum to 1
    _, weights = layer(x, need_weights=True)
    assert not torch.allclose(weights.sum(-1), torch.ones(2, 4, 5, device=device))


@pytest.mark.portable
def test_gradients_flow_to_every_projection(device):
    layer = MultiHeadAttention(24, 6, num_kv_heads=2, rotary=True, device=device)
    layer(randn(2, 5, 24, dtype=torch.float32, device=device), causal=True)[0].square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# --------------------------------------------------------------------------- KV cache


def decode_in_steps(layer, x, steps, cache):
    """Feed x (b, n, E) in chunks of the given sizes through the cache; concatenate the outputs."""
    outputs, start = [], 0
    for size in steps:
        outputs.append(layer(x[:, start : start + size], causal=True, cache=cache)[0])
        start += size
    return torch.cat(outputs, dim=1)


@pytest.mark.portable
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("kv_heads", [6, 2, 1], ids=["mha", "gqa", "mqa"])
def test_decoding_with_a_cache_equals_the_full_causal_forward(rotary, kv_heads, device):
    layer = MultiHeadAttention(24, 6, num_kv_heads=kv_heads, rotary=rotary, dtype=torch.float64, device=device)
    x = randn(3, 11, 24, device=device)
    full, _ = layer(x, causal=True)
    cache = layer.new_cache(batch_size=3, max_len=16)
    assert cache.keys.shape == (3, kv_heads, 16, 4)  # g heads cached, not h
    assert cache.keys.device == device
    stepped = decode_in_steps(layer, x, [5, 1, 1, 3, 1], cache)  # prefill, then one or more per step
    torch.testing.assert_close(stepped, full, rtol=0, atol=1e-12)
    assert len(cache) == 11 and cache.seen == 11


@pytest.mark.portable
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_window_cache_keeps_only_the_last_keys_and_matches_the_windowed_forward(rotary, device):
    w = 4
    layer = MultiHeadAttention(24, 6, num_kv_heads=3, rotary=rotary, dtype=torch.float64, device=device)
    x = randn(2, 13, 24, device=device)
    full, _ = layer(x, causal=True, mask=masks.window(w - 1, 0))
    cache = layer.new_cache(batch_size=2, max_len=32, window=w)
    assert cache.keys.shape == (2, 3, w, 4)  # storage bounded by the window
    stepped = decode_in_steps(layer, x, [6, 1, 2, 1, 3], cache)
    torch.testing.assert_close(stepped, full, rtol=0, atol=1e-12)
    assert len(cache) == w and cache.seen == 13


@pytest.mark.portable
def test_cache_reset_and_reuse(device):
    layer = MultiHeadAttention(24, 4, dtype=torch.float64, device=device)
    x = randn(2, 6, 24, device=device)
    cache = layer.new_cache(2, 8)
    first = decode_in_steps(layer, x, [3, 3], cache)
    cache.reset()
    assert len(cache) == 0 and cache.seen == 0
    torch.testing.assert_close(decode_in_steps(layer, x, [2, 4], cache), first, rtol=0, atol=1e-12)


@pytest.mark.portable
def test_explicit_rotary_positions_match_the_default_offsets(device):
    layer = MultiHeadAttention(24, 4, rotary=True, dtype=torch.float64, device=device)
    x = randn(2, 6, 24, device=device)
    cache = layer.new_cache(2, 8)
    layer(x[:, :4], causal=True, cache=cache)
    default, _ = layer(x[:, 4:], causal=True, cache=cache)
    cache.reset()
    layer(x[:, :4], causal=True, cache=cache, positions=torch.arange(4, device=device))
    explicit, _ = layer(x[:, 4:], causal=True, cache=cache, positions=torch.arange(4, 6, device=device).expand(2, 2))
    torch.testing.assert_close(explicit, default, rtol=0, atol=0)


@pytest.mark.portable
def test_rotary_makes_scores_depend_on_relative_position_only(device):
    """Shifting every position by the same amount leaves a rotary layer's output unchanged."""
    layer = MultiHeadAttention(24, 4, rotary=RotaryEmbedding(6), dtype=torch.float64, device=device)
    x = randn(1, 5, 24, device=device)
    at_zero, _ = layer(x, causal=True)
    shifted, _ = layer(x, causal=True, positions=torch.arange(100, 105, device=device))
    torch.testing.assert_close(shifted, at_zero, rtol=0, atol=1e-10)
    moved, _ = layer(x, causal=True, positions=torch.tensor([0, 1, 2, 3, 9], device=device))
    assert not torch.allclose(moved, at_zero)


BAD_CONSTRUCTION = [
    (dict(embed_dim=12, num_heads=2, dtype=torch.int64), ValueError, "dtype: expected a real floating dtype"),
    (dict(embed_dim=12, num_heads=2, dtype=torch.complex64), ValueError, "dtype: expected a real floating dtype"),
    (dict(embed_dim=12, num_heads=2, dtype="float32"), TypeError, "dtype: expected a torch.dtype"),
    (dict(embed_dim=12, num_heads=2, device="nope"), ValueError, "device: expected a device this torch can use"),
    (dict(embed_dim=2**17, num_heads=1), ValueError, "embed_dim: expected the projection weights to fit"),
    (dict(embed_dim=0, num_heads=2), ValueError, "embed_dim: expected a positive int"),
    (dict(embed_dim=10, num_heads=3), ValueError, "num_heads: expected a divisor of embed_dim = 10"),
    (dict(embed_dim=12, num_heads=6, num_kv_heads=4), ValueError, "num_kv_heads: expected a divisor of num_heads"),
    (dict(embed_dim=12, num_heads=2, head_dim=2.5), TypeError, "head_dim: expected a positive int"),
    (dict(embed_dim=12, num_heads=2, dropout=1.0), ValueError, "dropout: expected a probability in [0, 1)"),
    (dict(embed_dim=12, num_heads=2, bias="yes"), TypeError, "bias: expected True or False"),
    (dict(embed_dim=12, num_heads=2, backend="fastest"), ValueError, "backend: expected 'auto' or one of"),
    (
        dict(embed_dim=12, num_heads=2, rotary=RotaryEmbedding(4)),
        ValueError,
        "rotary: expected a RotaryEmbedding of head_dim = 6",
    ),
    (dict(embed_dim=12, num_heads=2, rotary="yes"), TypeError, "rotary: expected True, False/None"),
]


@pytest.mark.parametrize("kwargs,kind,fragment", BAD_CONSTRUCTION)
def test_bad_construction_raises_clearly(kwargs, kind, fragment):
    with pytest.raises(kind) as excinfo:
        MultiHeadAttention(**kwargs)
    assert is_input_error(excinfo.value, kind) and fragment in str(excinfo.value) and "Fix:" in str(excinfo.value)


def bad_calls(device: torch.device | str = "cpu"):
    """(call, error type, message fragment) for layers, tensors and caches on ``device``."""
    layer = MultiHeadAttention(12, 2, num_kv_heads=1, device=device)
    cross = MultiHeadAttention(12, 2, kdim=5, vdim=5, device=device)
    rotary = MultiHeadAttention(12, 2, rotary=True, device=device)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype).to(device)

    x = rand(2, 5, 12)
    other_layer_cache = MultiHeadAttention(12, 3, device=device).new_cache(2, 8)
    full_cache = layer.new_cache(2, 6)
    layer(x, causal=True, cache=full_cache)
    return [
        (lambda: layer(rand(5, 12)), ValueError, "query: expected shape (b, seq, 12)"),
        (lambda: layer(rand(2, 5, 11)), ValueError, "query: expected shape (b, seq, 12)"),
        (lambda: layer([1.0]), TypeError, "query: expected a torch.Tensor"),
        (lambda: layer(x, rand(3, 5, 12)), ValueError, "key: expected batch size 2"),
        (lambda: layer(x, rand(2, 5, 12), rand(2, 4, 12)), ValueError, "value: expected length j = 5"),
        (lambda: layer(x, None, x), ValueError, "key: expected a key tensor when value is given"),
        (lambda: cross(x), ValueError, "key: expected a key tensor (b, j, 5)"),
        (lambda: rotary(x, x), ValueError, "key: expected None: rotary positions are defined for self-attention"),
        (lambda: layer(x, positions=torch.arange(5, device=device)), ValueError, "positions: expected None"),
        (lambda: rotary(x, positions=torch.arange(4, device=device)), ValueError, "positions: expected shape (i,)"),
        (
            lambda: rotary(x, positions=torch.arange(5.0, device=device)),
            TypeError,
            "positions: expected an integer tensor",
        ),
        (lambda: layer(x, need_weights=1), TypeError, "need_weights: expected True or False"),
        (lambda: layer(x, cache={}), TypeError, "cache: expected a multihead.KVCache"),
        (lambda: layer(x, causal=True, cache=other_layer_cache), ValueError, "cache: expected a cache for key/value"),
        (
            lambda: layer(rand(3, 1, 12), causal=True, cache=layer.new_cache(2, 8)),
            ValueError,
            "cache: expected a cache for batch size = 3",
        ),
        (
            lambda: layer(x[:, :2], causal=True, cache=full_cache),
            ValueError,
            "cache: expected room for 2 more token(s) (max_len = 6)",
        ),
        (
            lambda: layer(x, mask=torch.ones(5, 6, dtype=torch.bool, device=device)),
            ValueError,
            "mask: expected a shape broadcastable",
        ),
        (lambda: KVCache(0, 4, 1, 8, device=device), ValueError, "batch_size: expected a positive int"),
        (lambda: layer.new_cache(2, 8, window=0), ValueError, "window: expected a positive int"),
        # dtypes and devices: checked against the layer's parameters, then the query's
        (lambda: layer(x.double()), TypeError, f"query: expected dtype torch.float32 {OF_THE_PARAMETERS}"),
        (lambda: layer(x.half()), TypeError, f"query: expected dtype torch.float32 {OF_THE_PARAMETERS}"),
        (lambda: layer(x.long()), TypeError, "query: expected a floating dtype"),
        (lambda: layer(x.to(torch.complex64)), TypeError, "query: expected a floating dtype"),
        (lambda: layer(torch.randn(2, 5, 12, device="meta")), ValueError, f"query: expected a tensor on {device}"),
        (lambda: layer(x, x.double()), TypeError, "key: expected dtype torch.float32 (the dtype of the query)"),
        (
            lambda: cross(x, rand(2, 5, 5), rand(2, 5, 5, dtype=torch.float64)),
            TypeError,
            "value: expected dtype torch.float32 (the dtype of the query)",
        ),
        (lambda: layer(rand(0, 5, 12)), ValueError, "query: expected at least one batch row and one position"),
        (
            lambda: MultiHeadAttention(12, 2, kdim=5, vdim=7, device=device)(x, rand(2, 5, 5)),
            ValueError,
            "value: expected a value tensor (b, j, 7)",
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
def test_fused_qkv_follows_every_weight_update_without_grad(device):
    """The fused self-attention matmul must see every change of a weight, through .data too."""
    layer = MultiHeadAttention(24, 4, dtype=torch.float64, device=device)
    x = randn(2, 5, 24, device=device)
    with torch.no_grad():
        before = layer(x)[0]
        layer.k_proj.weight.mul_(2.0)  # as an optimizer step would
        after = layer(x)[0]
        torch.testing.assert_close(after, per_head_formula(layer, x, x, x), rtol=0, atol=1e-12)
        assert not torch.allclose(after, before)
        layer.q_proj.weight.data.mul_(0.5)  # EMA-style update: does not bump the version counter
        torch.testing.assert_close(layer(x)[0], per_head_formula(layer, x, x, x), rtol=0, atol=1e-12)
        layer.load_state_dict(MultiHeadAttention(24, 4, dtype=torch.float64, device=device).state_dict())
        torch.testing.assert_close(layer(x)[0], per_head_formula(layer, x, x, x), rtol=0, atol=1e-12)
    # with gradients the stack is rebuilt per call and gradients reach the separate weights
    layer(x)[0].sum().backward()
    assert layer.q_proj.weight.grad is not None and layer.v_proj.bias.grad is not None


def _failing_steps(layer, x):
    """Cached calls of the token x[:, 3:4] that must raise, each for a different reason: {reason: (call, fragment)}.
    Every tensor is made on x's device."""
    token, device = x[:, 3:4], x.device
    return {
        "mask of the wrong shape": (
            lambda cache: layer(
                token, causal=True, cache=cache, mask=torch.ones(5, 5, dtype=torch.bool, device=device)
            ),
            "mask: expected a shape broadcastable",
        ),
        "mask of a bad type": (
            lambda cache: layer(token, causal=True, cache=cache, mask="causal"),
            "mask: expected a multihead.masks mask",
        ),
        "integer mask": (
            lambda cache: layer(
                token, causal=True, cache=cache, mask=torch.ones(1, 4, dtype=torch.int32, device=device)
            ),
            "mask: expected a bool tensor",
        ),
        "a backend that cannot serve it": (
            lambda cache: _with_backend(
                layer,
                "sdpa",
                lambda: layer(
                    token,
                    causal=True,
                    cache=cache,
                    mask=masks.bias(torch.zeros(4, dtype=torch.float64, device=device, requires_grad=True)),
                ),
            ),
            "gradient with respect to an additive bias",
        ),
        "weights asked of rows that do not exist": (
            lambda cache: _with_capture(layer, lambda: layer(token, causal=True, cache=cache)),
            "WeightSelection.queries",
        ),
        "a failure after attention (bad head gate)": (
            lambda cache: _with_gate(layer, lambda: layer(token, causal=True, cache=cache)),
            "head_gate: expected a tensor of shape (h,) = (3,)",
        ),
    }


def _with_backend(layer, name, call):
    saved = layer.backend
    layer.backend = name
    try:
        return call()
    finally:
        layer.backend = saved


def _with_capture(layer, call):
    from multihead.lab.inspect import capture

    with capture(layer, heads=[0], queries=[7]):  # row 7 of a one-token call: refused inside the kernel call
        return call()


def _with_gate(layer, call):
    layer.attend.head_gate = torch.ones(
        5, device=layer.out_proj.weight.device
    )  # wrong length, set past the layer's check: fails after the attention ran
    try:
        return call()
    finally:
        layer.attend.head_gate = None


@pytest.mark.portable
@pytest.mark.parametrize("window", [None, 3], ids=["plain", "window"])
def test_a_failed_cached_call_leaves_the_cache_as_it_was(window, device):
    layer = MultiHeadAttention(12, 3, num_kv_heads=1, rotary=True, dtype=torch.float64, device=device)
    x = randn(2, 6, 12, device=device)
    cache, uninterrupted = layer.new_cache(2, 8, window=window), layer.new_cache(2, 8, window=window)
    layer(x[:, :3], causal=True, cache=cache)
    layer(x[:, :3], causal=True, cache=uninterrupted)
    for reason, (step, fragment) in _failing_steps(layer, x).items():
        held = len(cache), cache.seen, cache.keys.clone(), cache.values.clone()
        table = layer.rotary._cos_sin.clone()
        with pytest.raises((ValueError, TypeError, RuntimeError), match=re.escape(fragment)):
            step(cache)
        assert torch.equal(layer.rotary._cos_sin, table), reason  # tables grow only when a call succeeds
        assert (len(cache), cache.seen) == held[:2], reason
        assert torch.equal(cache.keys[:, :, : len(cache)], held[2][:, :, : len(cache)]), reason
        assert torch.equal(cache.values[:, :, : len(cache)], held[3][:, :, : len(cache)]), reason
    for start in (3, 4, 5):  # the retried token and the next ones are exactly the uninterrupted run's
        torch.testing.assert_close(
            layer(x[:, start : start + 1], causal=True, cache=cache)[0],
            layer(x[:, start : start + 1], causal=True, cache=uninterrupted)[0],
            rtol=0,
            atol=0,
        )


@pytest.mark.portable
def test_rotary_positions_past_any_table_are_rotated_per_call(device):
    """A position of 2**40 needs no 2**40-row table: the layer computes those angles for the call."""
    layer = MultiHeadAttention(24, 4, rotary=True, dtype=torch.float64, device=device)
    x = randn(2, 5, 24, device=device)
    near, _ = layer(x, causal=True)
    table = layer.rotary._cos_sin.clone()
    far, _ = layer(x, causal=True, positions=torch.arange(5, device=device) + 2**40)
    assert torch.equal(layer.rotary._cos_sin, table)
    torch.testing.assert_close(far, near, rtol=0, atol=1e-3)  # relative positions; float64 angles lose ~2^-12 there
