"""What a page table's calls work out once: the layers of a decode step share one append plan and one table, the
table keeps its checks, bound mask and read plan by what its tensors hold, and sequences of one length are read
with no mask. Each is checked against dense attention over each sequence's keys, and against a table changed in
place (what was derived from it must not be served stale)."""

from __future__ import annotations

import pytest
import torch

import multihead
from multihead import attention, attention_result
from multihead.backends.paged import PageTable
from multihead.lab.models.decoder import Decoder, DecoderConfig
from multihead.paged import PagedBatch
from support import is_input_error, randn

pytestmark = pytest.mark.portable

G, PAGE, D, E = 2, 3, 4, 4  # e = d: torch's fused (flash) kernel serves the reads, as in a real model


def pools(device):
    """A pool of 6 pages of 3 slots; every slot holds 1e6 unless a test fills it: a slot read where it should be
    masked shows at once."""
    keys = torch.full((6, G, PAGE, D), 1e6, dtype=torch.float64, device=device)
    values = torch.full((6, G, PAGE, E), 1e6, dtype=torch.float64, device=device)
    return keys, values


def fill(pool_k, pool_v, tables, lengths, seed=0):
    """Random keys and values in the first lengths[s] slots of sequence s's pages (the rest stay 1e6)."""
    for row, (pages, length) in enumerate(zip(tables.tolist(), lengths, strict=True)):
        for slot in range(length):
            page, offset = pages[slot // PAGE], slot % PAGE
            pool_k[page, :, offset] = randn(G, D, seed=seed + 100 * row + slot, device=pool_k.device)
            pool_v[page, :, offset] = randn(G, E, seed=seed + 100 * row + slot + 50, device=pool_v.device)


def dense_reference(q, pool_k, pool_v, tables, ends, causal, positions, window=None, scale=None):
    """Each sequence's own keys gathered and attended with the reference backend (the same rule as the table:
    causal by position, and the window)."""
    out = []
    for row in range(q.shape[0]):
        pages = tables[row][tables[row] >= 0]
        keys = pool_k[pages].transpose(0, 1).reshape(G, -1, D)[:, : ends[row]]
        values = pool_v[pages].transpose(0, 1).reshape(G, -1, E)[:, : ends[row]]
        at = positions[row][:, None]  # (i, 1)
        key_at = torch.arange(int(ends[row]), device=q.device)[None, :]
        keep = torch.ones_like(key_at, dtype=torch.bool) & (key_at <= at if causal else True)
        if window is not None:
            keep = keep & (key_at > at - window)
        one = attention(q[row : row + 1], keys[None], values[None], mask=keep, scale=scale, backend="reference")
        out.append(one)
    return torch.cat(out)


@pytest.mark.parametrize(
    "positions, causal, window, scale, rule",
    [
        ([[4], [4]], True, None, None, "every key"),  # a decode step of two sequences of 5 keys
        ([[3, 4], [3, 4]], True, None, None, None),  # a query before the last key: causal hides it
        ([[3, 4], [3, 4]], False, None, None, "every key"),  # without causal it sees them all
        ([[4], [4]], True, 3, None, None),  # a window of 3 hides keys 0 and 1
        ([list(range(5))] * 2, True, None, None, "causal"),  # a prefill of 5 queries: a causal square
        ([list(range(5))] * 2, True, None, -0.7, "causal"),  # the same, with a negative scale
        ([list(range(5))] * 2, True, 5, None, "causal"),  # a window of 5 hides none of 5 keys
        ([list(range(5))] * 2, True, 4, None, None),  # a window of 4 hides key 0 from query 4
        ([[0, 2, 1, 3, 4]] * 2, True, None, None, None),  # queries out of order
    ],
    ids=[
        "decode",
        "two-queries-causal",
        "two-queries-full",
        "window",
        "prefill",
        "prefill-negative-scale",
        "prefill-window-5",
        "prefill-window-4",
        "prefill-out-of-order",
    ],
)
def test_a_table_is_read_unmasked_only_where_its_rule_holds(positions, causal, window, scale, rule, device):
    """Two sequences of 5 keys on pages of 3: width 5, and slot 5 of each last page holds 1e6. Read by a rule
    (every key, or a causal square), the kernel must stop at the width; masked, the mask must hide what the table
    says. Both equal dense attention over each sequence's keys, and the weights (computed over the dense
    equivalent, on the backend that returns them) sum to 1."""
    pool_k, pool_v = pools(device)
    tables = torch.tensor([[4, 1], [0, 5]], device=device)
    fill(pool_k, pool_v, tables, [5, 5])
    ends = torch.tensor([5, 5], device=device)
    at = torch.tensor(positions, device=device)
    pages = PageTable(tables, torch.zeros(2, dtype=torch.long, device=device), ends, at, width=5, window=window)
    assert pages.dense_rule(causal) == (rule if device.type == "cpu" else None)  # a device's table is not read
    q = randn(2, 4, at.shape[1], D, seed=7, device=device)
    assert multihead.explain(q, pool_k, pool_v, pages=pages, causal=causal).chosen == "paged"
    out = attention(q, pool_k, pool_v, pages=pages, causal=causal, scale=scale)  # the paged kernel's
    expected = dense_reference(q, pool_k, pool_v, tables, ends, causal, at, window, scale)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    # asked for weights, the call runs where they are returned: over the dense equivalent the rule binds
    result = attention_result(q, pool_k, pool_v, pages=pages, causal=causal, scale=scale, return_weights=True)
    torch.testing.assert_close(result.output, expected, atol=1e-12, rtol=0)
    assert result.weights is not None and result.weights.shape == (2, 4, at.shape[1], 5)
    torch.testing.assert_close(result.weights.sum(-1), torch.ones_like(result.weights.sum(-1)), atol=1e-12, rtol=0)


def test_a_table_changed_in_place_is_checked_and_read_afresh():
    """A table keeps what it derived by its tensors' version counters: shortening a sequence in place makes the
    next call mask the dropped keys (not serve the kept unmasked plan), and a key end past the pages, set in place
    after a call that passed, is refused."""
    pool_k, pool_v = pools("cpu")
    tables = torch.tensor([[4, 1], [0, 5]])
    fill(pool_k, pool_v, tables, [5, 5])
    ends, at = torch.tensor([5, 5]), torch.tensor([[4], [4]])
    pages = PageTable(tables, torch.zeros(2, dtype=torch.long), ends, at, width=5)
    q = randn(2, 4, 1, D, seed=3)
    attention(q, pool_k, pool_v, pages=pages, causal=True)
    assert pages.dense_rule(True) == "every key"
    ends[1] = 3  # sequence 1 now holds 3 keys: its last two columns are masked
    out = attention(q, pool_k, pool_v, pages=pages, causal=True)
    assert pages.dense_rule(True) is None
    torch.testing.assert_close(out, dense_reference(q, pool_k, pool_v, tables, ends, True, at), atol=1e-12, rtol=0)
    ends[0] = 7  # past the 6 keys its two pages hold
    with pytest.raises(ValueError, match=r"sequence 0's table holds: 5") as raised:
        attention(q, pool_k, pool_v, pages=pages, causal=True)
    assert is_input_error(raised.value, ValueError) and "pages.key_ends" in str(raised.value)


def test_one_table_serves_calls_with_and_without_causal():
    """The kept bound mask and plan are per causal flag: the same table read causally and not gives each its own
    answer."""
    pool_k, pool_v = pools("cpu")
    tables = torch.tensor([[4, 1], [0, 5]])
    fill(pool_k, pool_v, tables, [5, 5])
    ends, at = torch.tensor([5, 5]), torch.tensor([[3, 4], [3, 4]])
    pages = PageTable(tables, torch.zeros(2, dtype=torch.long), ends, at, width=5)
    q = randn(2, 4, 2, D, seed=5)
    for causal in (True, False, True):
        out = attention(q, pool_k, pool_v, pages=pages, causal=causal)
        expected = dense_reference(q, pool_k, pool_v, tables, ends, causal, at)
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


def test_every_layer_of_a_decode_step_attends_through_one_table(monkeypatch, device):
    """generate_batch's layers append in step: the first layer plans each append, the others take its plan (their
    pools hold equal tables), and every layer of a step reads one PageTable; the tokens are generate()'s."""
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=20, max_positions=40, hidden=32, layers=3, heads=4, kv_heads=2, mlp=64)
    decoder = Decoder(config).to(device=device, dtype=torch.float64)
    plans, tables = [], []
    make_plan, stage = PagedBatch._append_plan, PagedBatch.stage

    def counted_plan(self, *args):
        plans.append(1)
        return make_plan(self, *args)

    def seen_stage(self, keys, values):
        pending = stage(self, keys, values)
        tables.append(pending.pages)
        return pending

    monkeypatch.setattr(PagedBatch, "_append_plan", counted_plan)
    monkeypatch.setattr(PagedBatch, "stage", seen_stage)
    prompts, budget = [[1, 2, 3, 4], [5, 6]], 5
    out = decoder.generate_batch(prompts, budget, max_batch=2, page_size=3)
    calls = len(tables) // config.layers  # model calls: two prefills and the decode steps
    assert len(plans) == calls
    for step in range(calls):
        assert all(table is tables[step * config.layers] for table in tables[step * config.layers :][: config.layers])
    for prompt, tokens in zip(prompts, out, strict=True):
        assert tokens.tolist() == decoder.generate(prompt, budget)[0].tolist()


def test_sequences_at_one_length_share_a_rotary_offset():
    """A paged batch of sequences that have seen as many tokens rotates by one offset (the contiguous path's);
    sequences at different lengths by each one's positions."""
    layer = multihead.MultiHeadAttention(12, 2, rotary=True, dtype=torch.float64)
    cache = layer.new_paged_cache(num_pages=8, page_size=4)
    a, b = cache.add(), cache.add()
    layer(randn(2, 3, 12, seed=1), causal=True, cache=cache.batch([a, b]))
    assert cache.batch([a, b]).shared_offset() == 3
    layer(randn(1, 2, 12, seed=2), causal=True, cache=cache.batch([a]))
    assert cache.batch([a, b]).shared_offset() is None
    assert cache.batch([a]).shared_offset() == 5
