"""multihead.paged: the paged KV cache. Decoding through it equals decoding each sequence with its own contiguous
KVCache, token for token, for any schedule of sequences added, decoded and freed (a property test), with GQA,
rotary positions and a window; pages are taken as sequences grow and come back when they are freed (or fall out of
the window); a call that fails leaves the pool, the block tables and the lengths as they were."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multihead import MultiHeadAttention, attention
from multihead.backends.paged import PageTable
from multihead.paged import PagedKVCache
from support import is_input_error, randn

pytestmark = pytest.mark.portable

EMBED, HEADS, KV_HEADS = 24, 6, 2


def make_layer(device, *, rotary=True, seed=0):
    torch.manual_seed(seed)
    return MultiHeadAttention(EMBED, HEADS, num_kv_heads=KV_HEADS, rotary=rotary, dtype=torch.float64, device=device)


def tokens(n, seed, device, rows=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n, EMBED, generator=generator, dtype=torch.float64).to(device)


def snapshot(cache: PagedKVCache) -> tuple:
    """What counts in a paged cache: its free pages, every table and length, and the keys and values held."""
    held = []
    for handle in cache.sequences:
        pages = cache.pages(handle)
        length = cache.length(handle)
        keys = cache.keys[pages].transpose(1, 2).reshape(-1, cache.num_kv_heads, cache.head_dim)[:length]
        values = cache.values[pages].transpose(1, 2).reshape(-1, cache.num_kv_heads, cache.value_head_dim)[:length]
        held.append((handle, tuple(pages), length, cache.seen(handle), keys.clone(), values.clone()))
    return tuple(cache._free), held


def assert_same_snapshot(before, after):
    assert before[0] == after[0]
    assert len(before[1]) == len(after[1])
    for a, b in zip(before[1], after[1], strict=True):
        assert a[:4] == b[:4]
        assert torch.equal(a[4], b[4]) and torch.equal(a[5], b[5])


def test_a_paged_batchs_positions_grow_the_rotary_tables_and_later_steps_read_them(device, monkeypatch):
    """A paged batch rotates by a tensor of positions, each sequence at its own length. On the CPU those are read:
    once a call has succeeded the tables cover them, and the next step reads its angles there (per-call float64
    angles, for q and for k, were half of a decode step's rotary time). A device's positions are never read: its
    steps compute their angles per call."""
    layer = make_layer(device, rotary=True)
    paged = layer.new_paged_cache(num_pages=32, page_size=3)
    handles = [paged.add() for _ in range(2)]
    for index, handle in enumerate(handles):
        layer(tokens(5 + 3 * index, index, device), causal=True, cache=paged.batch([handle]))
    assert layer.rotary._cos_sin.shape[-2] >= 8  # the longer prompt's positions 0 .. 7
    per_call = []
    angles = type(layer.rotary)._cos_sin_of
    monkeypatch.setattr(type(layer.rotary), "_cos_sin_of", lambda self, *a: per_call.append(1) or angles(self, *a))
    steps = 6
    for step in range(steps):  # a step that reaches past the table rotates per call; the table then grows, doubling
        layer(tokens(1, 100 + step, device, rows=2), causal=True, cache=paged.batch(handles))
    assert layer.rotary._cos_sin.shape[-2] >= 8 + steps
    # q and k: at most one step's per-call angles on the CPU (the one growth), every step's on a device
    assert len(per_call) <= 2 if device.type == "cpu" else len(per_call) == 2 * steps


@pytest.mark.parametrize("window", [None, 4], ids=["full", "window 4"])
@pytest.mark.parametrize("rotary", [True, False], ids=["rotary", "plain"])
def test_paged_decoding_equals_a_contiguous_cache_per_sequence(rotary, window, device):
    layer = make_layer(device, rotary=rotary)
    paged = layer.new_paged_cache(num_pages=32, page_size=3, window=window)
    lengths = [5, 1, 7]
    handles = [paged.add() for _ in lengths]
    contiguous = [layer.new_cache(1, 32, window=window) for _ in lengths]
    for index, (handle, cache, length) in enumerate(zip(handles, contiguous, lengths, strict=True)):
        prompt = tokens(length, index, device)
        got, _ = layer(prompt, causal=True, cache=paged.batch([handle]))
        expected, _ = layer(prompt, causal=True, cache=cache)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    for step in range(6):  # every sequence at its own length, in one call
        new = tokens(1, 100 + step, device, rows=3)
        got, _ = layer(new, causal=True, cache=paged.batch(handles))
        for row, cache in enumerate(contiguous):
            expected, _ = layer(new[row : row + 1], causal=True, cache=cache)
            torch.testing.assert_close(got[row : row + 1], expected, atol=1e-12, rtol=0)
    for handle, cache in zip(handles, contiguous, strict=True):
        assert paged.seen(handle) == cache.seen and paged.length(handle) <= paged.page_size * len(paged.pages(handle))
        if window is None:
            assert paged.length(handle) == len(cache)
            assert len(paged.pages(handle)) == math.ceil(cache.seen / 3)
        else:  # only pages a later query can reach: the last 4 keys span at most 3 pages of 3
            assert len(paged.pages(handle)) <= 3


@settings(max_examples=20, deadline=None)
@given(
    schedule=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 9)),
            st.tuples(st.just("decode"), st.integers(1, 2)),
            st.tuples(st.just("free"), st.integers(0, 7)),
        ),
        min_size=1,
        max_size=18,
    ),
    page_size=st.integers(1, 5),
    window=st.sampled_from([None, 3]),
)
def test_any_schedule_of_adding_decoding_and_freeing_equals_contiguous_caches(schedule, page_size, window):
    layer = make_layer("cpu", seed=1)
    paged = layer.new_paged_cache(num_pages=200, page_size=page_size, window=window)
    contiguous: dict[int, object] = {}
    for step, (action, amount) in enumerate(schedule):
        if action == "add":
            handle = paged.add()
            contiguous[handle] = layer.new_cache(1, 64, window=window)
            prompt = tokens(amount, step, "cpu")
            got, _ = layer(prompt, causal=True, cache=paged.batch([handle]))
            expected, _ = layer(prompt, causal=True, cache=contiguous[handle])
            torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
        elif action == "decode" and contiguous:
            handles = list(contiguous)
            new = tokens(amount, step, "cpu", rows=len(handles))
            got, _ = layer(new, causal=True, cache=paged.batch(handles))
            for row, handle in enumerate(handles):
                expected, _ = layer(new[row : row + 1], causal=True, cache=contiguous[handle])
                torch.testing.assert_close(got[row : row + 1], expected, atol=1e-12, rtol=0)
        elif action == "free" and contiguous:
            handle = list(contiguous)[amount % len(contiguous)]
            paged.free(handle)
            del contiguous[handle]
        # every page is free or in exactly one table
        tables = [page for handle in paged.sequences for page in paged.pages(handle)]
        assert len(tables) == len(set(tables)) and sorted(tables + paged._free) == list(range(200))
        if window is None:
            assert paged.pages_in_use == sum(math.ceil(paged.seen(h) / page_size) for h in paged.sequences)


def test_a_failed_call_leaves_the_pool_and_the_tables_as_they_were(monkeypatch):
    layer = make_layer("cpu")
    paged = layer.new_paged_cache(num_pages=6, page_size=2)
    first, second = paged.add(), paged.add()
    layer(tokens(3, 0, "cpu"), causal=True, cache=paged.batch([first]))
    layer(tokens(4, 1, "cpu"), causal=True, cache=paged.batch([second]))
    before = snapshot(paged)
    failures = [
        (ValueError, lambda: layer(tokens(3, 2, "cpu", rows=2), causal=True, cache=paged.batch([first, second]))),
        (ValueError, lambda: layer(tokens(1, 3, "cpu"), causal=True, cache=paged.batch([first, second]))),
        (ValueError, lambda: layer(tokens(1, 4, "cpu", rows=2), causal=True, cache=paged.batch([first, first]))),
        (ValueError, lambda: layer(tokens(1, 5, "cpu"), causal=True, cache=paged.batch([99]))),
    ]
    for kind, call in failures:
        with pytest.raises(kind) as raised:
            call()
        assert is_input_error(raised.value, kind)
        assert_same_snapshot(before, snapshot(paged))
    # a failure after the keys were written (the kernel raising): nothing counts
    import multihead.backends.paged

    def broken(*args, **kwargs):
        raise RuntimeError("the kernel failed")

    monkeypatch.setattr(multihead.backends.paged, "_paged_kernel", broken)
    with pytest.raises(RuntimeError):
        layer(tokens(1, 6, "cpu", rows=2), causal=True, cache=paged.batch([first, second]))
    assert_same_snapshot(before, snapshot(paged))


def test_pages_come_back_when_a_sequence_is_freed_and_are_reused():
    paged = PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=3)
    first = paged.add()
    paged.batch([first]).stage(torch.randn(1, 1, 5, 3), torch.randn(1, 1, 5, 3)).commit()
    assert paged.pages_in_use == 3 and paged.length(first) == 5
    second = paged.add()
    with pytest.raises(ValueError) as raised:  # 3 pages for 5 tokens, 1 free
        paged.batch([second]).stage(torch.randn(1, 1, 5, 3), torch.randn(1, 1, 5, 3))
    assert "cache: expected 3 free page(s)" in str(raised.value) and "free finished sequences" in str(raised.value)
    paged.free(first)
    assert paged.pages_in_use == 0 and paged.sequences == [second]
    paged.batch([second]).stage(torch.randn(1, 1, 5, 3), torch.randn(1, 1, 5, 3)).commit()
    assert paged.pages_in_use == 3
    with pytest.raises(ValueError) as raised:
        paged.free(first)
    assert is_input_error(raised.value, ValueError) and "handle: expected a handle of a sequence" in str(raised.value)


@pytest.mark.parametrize("keys_per_step", [3, 7, 256], ids=["a page a step", "two pages a step", "all at once"])
def test_the_paged_backend_equals_dense_attention_over_each_sequences_keys(keys_per_step, monkeypatch, device):
    # three sequences of 7, 2 and 5 keys on pages of 3, scattered over the pool, queried by their last 2 tokens
    import multihead.backends.paged

    monkeypatch.setattr(multihead.backends.paged, "KEYS_PER_STEP", keys_per_step)
    monkeypatch.setattr(multihead.backends.paged, "FUSED_READ_KEYS", keys_per_step)
    generator = torch.Generator().manual_seed(0)
    pool_k = torch.randn(9, 2, 3, 4, generator=generator, dtype=torch.float64).to(device)
    pool_v = torch.randn(9, 2, 3, 5, generator=generator, dtype=torch.float64).to(device)
    tables = torch.tensor([[4, 0, 7], [2, -1, -1], [8, 1, -1]], device=device)
    ends = torch.tensor([7, 2, 5], device=device)
    positions = torch.stack([ends - 2, ends - 1], 1)
    q = torch.randn(3, 6, 2, 4, generator=generator, dtype=torch.float64).to(device)
    first = torch.zeros(3, dtype=torch.long, device=device)
    pages = PageTable(tables, first, ends, positions, width=7)
    assert multihead.explain(q, pool_k, pool_v, pages=pages, causal=True).chosen == "paged"
    out = attention(q, pool_k, pool_v, pages=pages, causal=True)
    for row in range(3):
        pages = tables[row][tables[row] >= 0]
        keys = pool_k[pages].transpose(0, 1).reshape(2, -1, 4)[:, : ends[row]]  # (g, L, d)
        values = pool_v[pages].transpose(0, 1).reshape(2, -1, 5)[:, : ends[row]]
        expected = attention(q[row : row + 1], keys[None], values[None], causal=True)
        torch.testing.assert_close(out[row : row + 1], expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("keys_per_step", [3, 256], ids=["a page a step", "all at once"])
def test_a_query_that_sees_no_key_gives_zero_even_where_its_scores_overflow(keys_per_step, monkeypatch, device):
    """Sequence 1's query sits past its window (position 100, window 2, keys 0-2): it sees no key, and gives 0
    (its scores, 1e20 x 1e20, overflow float32: unguarded, inf - inf would be NaN) on both paths of the kernel."""
    import multihead.backends.paged

    monkeypatch.setattr(multihead.backends.paged, "KEYS_PER_STEP", keys_per_step)
    monkeypatch.setattr(multihead.backends.paged, "FUSED_READ_KEYS", keys_per_step)
    generator = torch.Generator().manual_seed(1)
    pool_k = (torch.randn(4, 1, 3, 4, generator=generator) * 1e20).to(device)
    pool_v = torch.randn(4, 1, 3, 4, generator=generator).to(device)
    tables = torch.tensor([[0, 1], [2, -1]], device=device)
    ends, first = torch.tensor([5, 3], device=device), torch.zeros(2, dtype=torch.long, device=device)
    positions = torch.tensor([[4], [100]], device=device)
    q = (torch.randn(2, 2, 1, 4, generator=generator) * 1e20).to(device)
    pages = PageTable(tables, first, ends, positions, width=5, window=2)
    assert multihead.explain(q, pool_k, pool_v, pages=pages, causal=True).chosen == "paged"
    out = attention(q, pool_k, pool_v, pages=pages, causal=True)
    assert (out[1] == 0).all()


def test_a_paged_call_takes_no_mask():
    layer = make_layer("cpu")
    paged = layer.new_paged_cache(num_pages=4, page_size=4)
    handle = paged.add()
    with pytest.raises(ValueError) as raised:
        layer(tokens(3, 0, "cpu"), causal=True, cache=paged.batch([handle]), mask=torch.ones(3, 3, dtype=torch.bool))
    assert is_input_error(raised.value, ValueError) and "mask: expected None in a paged call" in str(raised.value)
    assert paged.seen(handle) == 0 and paged.pages_in_use == 0


@pytest.mark.parametrize(
    "ends, first, fragment",
    [
        ([7, 3], [0, 0], r"sequence 0's table holds: 6 .* got key_ends\[0\] - first_slots\[0\] = 7"),
        ([5, 5], [0, 0], r"sequence 1's table holds: 4 \(2 pages of 2 before its first -1"),
        ([5, 1], [0, 2], r"key_ends\[1\] = 1 below first_slots\[1\] = 2"),
    ],
    ids=["past-the-width", "into-a-missing-page", "end-before-start"],
)
def test_key_ends_past_what_the_table_holds_are_named(ends, first, fragment):
    """FlashAttention's test_flash_attn_kvcache_paged_block_table_bounds: a key end past the table's pages was
    served over the keys the table holds (fewer than asked). CPU tables are read on the host and refused."""
    g, page = 2, 2
    key_pool, value_pool = randn(6, g, page, 6, seed=1), randn(6, g, page, 9, seed=2)
    tables = torch.tensor([[0, 3, 5], [2, 4, -1]])
    ends_t = torch.tensor(ends)
    pages = PageTable(tables, torch.tensor(first), ends_t, (ends_t - 1).clamp(min=0)[:, None], width=6)
    with pytest.raises(ValueError, match=fragment) as raised:
        attention(randn(2, 4, 1, 6, seed=3), key_pool, value_pool, pages=pages, causal=True)
    assert is_input_error(raised.value, ValueError) and "pages.key_ends" in str(raised.value)
    within = torch.tensor([6, 4])  # the same table with key ends it holds: served
    table = PageTable(tables, torch.zeros(2, dtype=torch.long), within, (within - 1)[:, None], width=6)
    attention(randn(2, 4, 1, 6, seed=3), key_pool, value_pool, pages=table, causal=True)
