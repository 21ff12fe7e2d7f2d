"""A paged cache's calls pass through the layer's ``Attend`` step like every other: head ablation (zero, uniform,
mean), head gates, capture (weights of chosen heads and rows, q/k/v, outputs, statistics), the weights the layer
returns and ``explain`` act on a paged call exactly as on the same tokens through a contiguous cache, with GQA and
rotary, in prefill and decode; a property test draws the page size, the schedule and the surgery."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead
from multihead import MultiHeadAttention
from multihead.capture import capture

pytestmark = pytest.mark.portable

EMBED, HEADS = 36, 6


def make_layer(device, *, kv_heads=2, rotary=True, seed=0):
    torch.manual_seed(seed)
    layer = MultiHeadAttention(
        EMBED, HEADS, num_kv_heads=kv_heads, rotary=rotary, dtype=torch.float64, device=device
    ).eval()
    return layer


def tokens(n, seed, device, rows=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n, EMBED, generator=generator, dtype=torch.float64).to(device)


def surgery(layer, kind):
    """Put head surgery of ``kind`` on ``layer``."""
    if kind == "zero, every head":
        layer.ablate_heads(list(range(HEADS)))
    elif kind == "zero":
        layer.ablate_heads([1, 4])
    elif kind == "uniform":
        layer.ablate_heads([0, 5], how="uniform")
    elif kind == "mean":
        means = torch.arange(2 * layer.value_head_dim, dtype=torch.float64).reshape(2, -1) / 7
        layer.ablate_heads([2, 3], how="mean", mean_outputs=means.to(layer.out_proj.weight.device))
    elif kind == "gate":
        layer.head_gate = torch.tensor(
            [1.0, 0.0, 0.5, -2.0, 1.5, 0.25], dtype=torch.float64, device=layer.out_proj.weight.device
        )
    elif kind == "uniform and gate":
        layer.ablate_heads([3], how="uniform")
        layer.head_gate = torch.linspace(-1, 1, HEADS, dtype=torch.float64, device=layer.out_proj.weight.device)


SURGERY = ("none", "zero, every head", "zero", "uniform", "mean", "gate", "uniform and gate")


def run_both(layer, prompts, decode_steps, page_size, device, *, window=None, need_weights=False):
    """The same prompts (one sequence each) through a paged cache (prefill alone, then decode all together) and
    through a contiguous cache per sequence: [(paged, contiguous)] outputs and weights per call and sequence."""
    pool = layer.new_paged_cache(num_pages=64, page_size=page_size, window=window)
    handles = [pool.add() for _ in prompts]
    caches = [layer.new_cache(1, 64, window=window) for _ in prompts]
    pairs = []
    for handle, cache, prompt in zip(handles, caches, prompts, strict=True):
        got = layer(prompt, causal=True, cache=pool.batch([handle]), need_weights=need_weights)
        want = layer(prompt, causal=True, cache=cache, need_weights=need_weights)
        pairs.append((got, want))
    for step in range(decode_steps):
        new = tokens(1, 100 + step, device, rows=len(prompts))
        got_out, got_weights = layer(new, causal=True, cache=pool.batch(handles), need_weights=need_weights)
        for row, cache in enumerate(caches):
            want = layer(new[row : row + 1], causal=True, cache=cache, need_weights=need_weights)
            row_weights = None if got_weights is None else got_weights[row : row + 1]
            pairs.append(((got_out[row : row + 1], row_weights), want))
    return pairs


def assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=0)
    if want[1] is not None:  # weight column c is the sequence's c-th key; past its length, zeros
        held = want[1].shape[-1]
        torch.testing.assert_close(got[1][..., :held], want[1], atol=1e-12, rtol=0)
        assert not got[1][..., held:].any()


@pytest.mark.parametrize("kind", SURGERY)
@pytest.mark.parametrize("kv_heads", [2, 6], ids=["GQA", "MHA"])
def test_paged_equals_contiguous_under_every_ablation_and_gate(kind, kv_heads, device):
    layer = make_layer(device, kv_heads=kv_heads)
    surgery(layer, kind)
    prompts = [tokens(n, seed, device) for seed, n in enumerate((5, 2, 7))]
    for got, want in run_both(layer, prompts, decode_steps=3, page_size=3, device=device):
        assert_same(got, want)


def test_every_head_ablated_gives_the_out_projection_bias_through_a_paged_cache(device):
    """The issue's repro: with all heads zeroed, a paged decode returns W^O's bias alone, as a contiguous one does."""
    layer = MultiHeadAttention(32, 4, rotary=True, device=device).eval()
    layer.ablate_heads([0, 1, 2, 3])
    x = torch.randn(1, 5, 32, device=device)
    pool = layer.new_paged_cache(8, 4)
    paged = layer(x, cache=pool.batch([pool.add()]), causal=True)[0]
    torch.testing.assert_close(paged, layer.out_proj.bias.expand_as(paged), atol=0, rtol=0)


@pytest.mark.parametrize("window", [None, 4], ids=["full", "window 4"])
def test_a_paged_call_returns_the_weights_of_a_contiguous_one(window, device):
    layer = make_layer(device)
    prompts = [tokens(n, 10 + seed, device) for seed, n in enumerate((4, 6))]
    for got, want in run_both(layer, prompts, 3, page_size=2, device=device, window=window, need_weights=True):
        if window is None:
            assert_same(got, want)
        else:  # a window cache holds other keys than a contiguous one: the weights still sum to one per row
            torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=0)
            torch.testing.assert_close(got[1].sum(-1), torch.ones_like(got[1].sum(-1)), atol=1e-12, rtol=0)


def test_capture_records_paged_calls_as_contiguous_ones(device):
    """Weights of chosen heads and rows, q/k/v, outputs and statistics, recorded from a paged decode, equal those of
    the same tokens through a contiguous cache (keys and weights over the sequence's held keys)."""
    layer = make_layer(device)
    layer.ablate_heads([1], how="uniform")
    prompt, step = tokens(6, 1, device), tokens(2, 2, device)
    options = dict(heads=[0, 1, 5], queries=[1], qkv=True, outputs=True, stats=True)
    recorded = []
    for paged in (True, False):
        cache = layer.new_paged_cache(16, 4) if paged else layer.new_cache(1, 16)
        view = cache.batch([cache.add()]) if paged else cache
        layer(prompt, causal=True, cache=view)
        with capture(layer, **options) as rec:
            layer(step, causal=True, cache=view)
        recorded.append(rec)
    paged, contiguous = recorded
    for read in ("weights", "q", "k", "v", "outputs"):
        torch.testing.assert_close(getattr(paged, read)(0), getattr(contiguous, read)(0), atol=1e-12, rtol=0)
    torch.testing.assert_close(paged.stats(0).entropy, contiguous.stats(0).entropy, atol=1e-12, rtol=0)


def test_a_weight_selection_acts_on_a_paged_call(device):
    """``Attend`` with a WeightSelection on a paged call: the selected heads' and rows' weights of its dense
    equivalent, and ``explain`` names the paged backend (the others gather)."""
    layer = make_layer(device)
    pool = layer.new_paged_cache(16, 3)
    handles = [pool.add(), pool.add()]
    layer(tokens(4, 0, device), causal=True, cache=pool.batch(handles[:1]))
    layer(tokens(7, 1, device), causal=True, cache=pool.batch(handles[1:]))
    pending = pool.batch(handles).stage(
        torch.randn(2, 2, 2, 6, dtype=torch.float64, device=device),
        torch.randn(2, 2, 2, 6, dtype=torch.float64, device=device),
    )
    q = torch.randn(2, HEADS, 2, 6, dtype=torch.float64, device=device)
    table = pending.pages
    selection = multihead.WeightSelection(heads=[4, 1], queries=[1])
    got = layer.attend(q, pool.keys, pool.values, pages=table, causal=True, return_weights=selection)
    k, v, mask = table.dense(pool.keys, pool.values, causal=True)
    want = multihead.attention_result(q, k, v, mask=mask, backend="reference", return_weights=selection)
    torch.testing.assert_close(got.output, want.output, atol=1e-12, rtol=0)
    torch.testing.assert_close(got.weights, want.weights, atol=1e-12, rtol=0)
    explanation = multihead.explain(q, pool.keys, pool.values, pages=table, causal=True)
    assert explanation.chosen == "paged"
    assert "gathered keys" in " ".join(explanation.rejected["sdpa"])
    assert "paged" in multihead.backends.available_backends()
    dense = multihead.explain(q, k, v, mask=mask)
    assert dense.chosen != "paged" and "dense keys" in " ".join(dense.rejected["paged"])


def test_a_named_dense_backend_serves_a_paged_call_on_gathered_keys(device):
    layer = make_layer(device)
    surgery(layer, "uniform")
    prompts = [tokens(5, 3, device), tokens(3, 4, device)]
    expected = [got[0] for got, _ in run_both(layer, prompts, 2, page_size=2, device=device)]
    layer.backend = "reference"
    for (got, _), want in zip(run_both(layer, prompts, 2, page_size=2, device=device), expected, strict=True):
        torch.testing.assert_close(got[0], want, atol=1e-12, rtol=0)


def test_a_paged_call_differentiates_like_a_contiguous_one(device):
    layer = make_layer(device)
    layer.head_gate = torch.ones(HEADS, dtype=torch.float64, device=device, requires_grad=True)
    x = tokens(5, 7, device)
    grads = []
    for paged in (True, False):
        cache = layer.new_paged_cache(8, 2) if paged else layer.new_cache(1, 8)
        view = cache.batch([cache.add()]) if paged else cache
        layer.zero_grad()
        layer.head_gate.grad = None
        layer(x, causal=True, cache=view)[0].square().sum().backward()
        grads.append((layer.head_gate.grad.clone(), layer.q_proj.weight.grad.clone()))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


@settings(max_examples=15, deadline=None)
@given(
    page_size=st.integers(1, 6),
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    decode_steps=st.integers(0, 3),
    kind=st.sampled_from(SURGERY),
    kv_heads=st.sampled_from([1, 2, 3, 6]),
    rotary=st.booleans(),
)
def test_any_page_size_and_surgery_equals_contiguous_caches(page_size, lengths, decode_steps, kind, kv_heads, rotary):
    layer = make_layer("cpu", kv_heads=kv_heads, rotary=rotary, seed=len(lengths))
    surgery(layer, kind)
    prompts = [tokens(n, 20 + seed, "cpu") for seed, n in enumerate(lengths)]
    for got, want in run_both(layer, prompts, decode_steps, page_size, "cpu", need_weights=True):
        assert_same(got, want)


def test_autotune_leaves_a_paged_call_to_the_paged_backend(device):
    """Under autotune a paged decode still runs (timing would call a dense backend with the pools) and gives what a
    contiguous cache gives."""
    layer = make_layer(device)
    prompts = [tokens(4, 30, device), tokens(6, 31, device)]
    expected = [got[0] for got, _ in run_both(layer, prompts, 2, page_size=3, device=device)]
    with multihead.backends.autotune():
        tuned = [got[0] for got, _ in run_both(layer, prompts, 2, page_size=3, device=device)]
    for got, want in zip(tuned, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_capture_of_a_paged_call_whose_caller_asked_a_selection_of_its_own(device):
    """The recorder's own weights come from one more call through the table when the caller asked for others."""
    layer = make_layer(device)
    pool = layer.new_paged_cache(16, 2)
    handle = pool.add()
    layer(tokens(5, 0, device), causal=True, cache=pool.batch([handle]))
    pending = pool.batch([handle]).stage(
        torch.randn(1, 2, 1, 6, dtype=torch.float64, device=device),
        torch.randn(1, 2, 1, 6, dtype=torch.float64, device=device),
    )
    q = torch.randn(1, HEADS, 1, 6, dtype=torch.float64, device=device)
    own = multihead.WeightSelection(heads=[0])
    with capture(layer, heads=[2, 5]) as rec:
        layer.attend(q, pool.keys, pool.values, pages=pending.pages, causal=True, return_weights=own)
    k, v, mask = pending.pages.dense(pool.keys, pool.values, causal=True)
    want = multihead.attention_result(q, k, v, mask=mask, return_weights=multihead.WeightSelection(heads=[2, 5]))
    torch.testing.assert_close(rec.weights(0), want.weights, atol=1e-12, rtol=0)
