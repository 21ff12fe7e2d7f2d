"""multihead.attention_stats against the dense computation: every statistic equals the same reduction of the weights
attention(..., return_weights=True) materializes, for every mask kind, GQA, selections and lengths up to 2k."""

from __future__ import annotations

import math

import pytest
import torch

from multihead import attention_result, attention_stats, masks, streamed_stats
from multihead.streamed_stats import DISTANCE_BANDS, PoolGrid
from support import is_input_error

pytestmark = pytest.mark.portable


def inputs(device, b=2, h=4, g=2, i=37, j=37, d=8, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, i, d, generator=generator, dtype=dtype) * 2  # peaked rows as well as broad ones
    k = torch.randn(b, g, j, d, generator=generator, dtype=dtype) * 2
    v = torch.randn(b, g, j, d, generator=generator, dtype=dtype)
    return q.to(device), k.to(device), v.to(device)


def dense(weights: torch.Tensor, *, first_keys: int, far: int, top_k: int, pooled: int | None, pool: str) -> dict:
    """The statistics of (b, h, i, j) weights, computed from the whole matrix (positions aligned bottom-right)."""
    i, j = weights.shape[-2:]
    distance = (torch.arange(i, device=weights.device) + j - i)[:, None] - torch.arange(j, device=weights.device)
    log_w = torch.where(weights > 0, weights.log(), torch.zeros_like(weights))
    best, where = weights.max(-1)
    far_from = distance.abs()
    ends = [*DISTANCE_BANDS[1:], math.inf]  # band n: DISTANCE_BANDS[n] <= |distance| < the next band's start
    in_band = [(far_from >= low) & (far_from < high) for low, high in zip(DISTANCE_BANDS, ends, strict=True)]
    found = {
        "entropy": -(weights * log_w).sum(-1),
        "max_weight": best,
        "max_key": torch.where(best > 0, where, torch.full_like(where, -1)),
        "ahead": (weights * (distance < 0)).sum(-1),
        "bands": torch.stack([(weights * band).sum(-1) for band in in_band], -1),
        "first": weights[..., :first_keys],
        "received": weights.sum(-2),
        "received_far": (weights * (distance >= far)).sum(-2),
    }
    if top_k:
        top = weights.topk(top_k, dim=-1)
        found["top_weights"] = top.values
        found["top_keys"] = torch.where(top.values > 0, top.indices, torch.full_like(top.indices, -1))
    if pooled is not None:
        rows, cols = -(-i // min(pooled, i)), -(-j // min(pooled, j))
        grid = torch.zeros(*weights.shape[:2], -(-i // rows), -(-j // cols), dtype=weights.dtype)
        for r in range(grid.shape[-2]):
            for c in range(grid.shape[-1]):
                cell = weights[..., r * rows : (r + 1) * rows, c * cols : (c + 1) * cols]
                grid[..., r, c] = cell.amax((-2, -1)) if pool == "max" else cell.mean((-2, -1))
        found["pooled"] = grid.to(weights.device)
    return found


def assert_stats_equal(stats, weights, *, first_keys=4, far=512, top_k=0, pooled=None, pool="max", atol=1e-10):
    expected = dense(weights, first_keys=first_keys, far=far, top_k=top_k, pooled=pooled, pool=pool)
    for name, value in expected.items():
        got = getattr(stats, name)
        assert got is not None, name
        if name in ("max_key", "top_keys"):
            assert torch.equal(got, value), name
        else:
            torch.testing.assert_close(got, value.to(got.dtype), rtol=0, atol=atol, msg=name)


def mask_cases(device, b, h, i, j):
    lengths = torch.tensor([j, j - 9], device=device)
    bias = torch.randn(b, h, i, j, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(device)
    allowed = torch.rand(i, j, generator=torch.Generator().manual_seed(6)).to(device) > 0.3
    return {
        "none": None,
        "causal": masks.causal(),
        "window": masks.window(5, 0),
        "two-sided window": masks.window(3, 4),
        "padding": masks.padding(lengths),
        "alibi": masks.causal() & masks.alibi(masks.alibi_slopes(h)),
        "softcap": masks.softcap(2.0),
        "everything": masks.causal() & masks.padding(lengths) & masks.alibi(masks.alibi_slopes(h)) & masks.softcap(3.0),
        "bias tensor": bias,
        "bool tensor (some rows empty)": allowed & (torch.arange(i, device=device) % 7 != 3)[:, None],
        # packed documents (one of a single token), a different split per batch row, causal within each
        "documents": masks.documents(torch.tensor([[0] * 10 + [1] + [2] * (j - 11), [4] * 20 + [5] * (j - 20)]))
        & masks.causal(),
    }


@pytest.mark.parametrize(
    "case",
    [
        "none",
        "causal",
        "window",
        "two-sided window",
        "padding",
        "alibi",
        "softcap",
        "everything",
        "bias tensor",
        "bool tensor (some rows empty)",
        "documents",
    ],
)
def test_every_mask_kind_equals_the_dense_weights(case, device):
    q, k, v = inputs(device)
    mask = mask_cases(device, 2, 4, 37, 37)[case]
    expected = attention_result(q, k, v, mask=mask, return_weights=True)
    stats = attention_stats(q, k, v, mask=mask, first_keys=3, far=10, top_k=5, pooled=8, pool="mean")
    assert_stats_equal(stats, expected.weights, first_keys=3, far=10, top_k=5, pooled=8, pool="mean")
    torch.testing.assert_close(stats.output, expected.output, rtol=0, atol=1e-12)


def test_queries_after_the_keys_they_extend_and_max_pooling(device):
    # 5 queries at the end of 300 keys (a prefix cached), bottom-right causal: distances from position 295 on
    q, k, v = inputs(device, i=5, j=300)
    weights = attention_result(q, k, v, causal=True, return_weights=True).weights
    stats = attention_stats(q, k, v, causal=True, far=64, top_k=3, pooled=4, pool="max")
    assert_stats_equal(stats, weights, far=64, top_k=3, pooled=4, pool="max")
    assert stats.pooled is not None and stats.pooled.shape == (2, 4, 3, 4)  # 5 rows in bins of 2, 300 keys of 75


def test_heads_and_rows_are_selected_and_only_those_rows_add_to_the_columns(device):
    q, k, v = inputs(device)
    weights = attention_result(q, k, v, causal=True, return_weights=True).weights
    rows = [36, 0, 10]
    stats = attention_stats(q, k, v, causal=True, heads=[3, -4], rows=rows, top_k=2, far=5, pooled=6, pool="mean")
    assert stats.heads == [3, 0] and stats.rows == rows
    chosen = weights[:, [3, 0]]
    expected = dense(chosen, first_keys=4, far=512, top_k=2, pooled=None, pool="max")
    torch.testing.assert_close(stats.entropy, expected["entropy"][:, :, rows], rtol=0, atol=1e-10)
    torch.testing.assert_close(stats.bands, expected["bands"][:, :, rows], rtol=0, atol=1e-10)
    assert torch.equal(stats.top_keys, expected["top_keys"][:, :, rows])
    # the columns and the map: the weights of the three rows, the other rows counting as 0
    only_rows = torch.zeros_like(chosen)
    only_rows[:, :, rows] = chosen[:, :, rows]
    columns = dense(only_rows, first_keys=4, far=5, top_k=0, pooled=6, pool="mean")
    for name in ("received", "received_far", "pooled"):
        torch.testing.assert_close(getattr(stats, name), columns[name], rtol=0, atol=1e-10, msg=name)
    assert float(stats.received.sum()) == pytest.approx(2 * 2 * 3)  # 2 texts x 2 heads x 3 rows of weight 1


def pooled_over(weights: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, shape, pool: str) -> torch.Tensor:
    """(b, h, i, j) weights pooled over the cells of a PoolGrid, pair by pair (an empty cell is 0)."""
    found = torch.zeros(*weights.shape[:2], *shape, dtype=weights.dtype)
    pairs = torch.zeros(shape, dtype=weights.dtype)
    for r, row_cell in enumerate(rows.tolist()):
        for c, key_cell in enumerate(keys.tolist()):
            value = weights[..., r, c].cpu()
            cell = found[..., row_cell, key_cell]
            found[..., row_cell, key_cell] = torch.maximum(cell, value) if pool == "max" else cell + value
            pairs[row_cell, key_cell] += 1
    return found / pairs.clamp_min(1) if pool == "mean" else found


@pytest.mark.parametrize("pool", ["max", "mean", "sum"])
def test_a_pool_grid_places_each_row_and_key_in_its_cell(pool, device):
    # a window of a longer text: its rows and keys binned by the text's positions, not evenly by its own (a
    # leading special piece, a stretch from the middle, a cell that nothing falls in, a query row counted twice
    # as far along), across several 128 x 256 blocks
    q, k, v = inputs(device, b=1, h=2, g=1, i=300, j=300, d=8, seed=3)
    weights = attention_result(q, k, v, causal=True, return_weights=True).weights
    places = torch.cat([torch.zeros(1, dtype=torch.long), 1000 + torch.arange(299)])
    grid = PoolGrid(rows=places // 97, keys=(places // 160).flip(0), shape=(14, 9))
    rows = list(range(40, 300))
    stats = attention_stats(q, k, v, causal=True, rows=rows, pooled=grid, pool=pool)
    only_rows = torch.zeros_like(weights)
    only_rows[:, :, rows] = weights[:, :, rows]
    expected = pooled_over(only_rows, grid.rows, grid.keys, grid.shape, pool)
    assert stats.pooled is not None and stats.pooled.shape == (1, 2, 14, 9)
    torch.testing.assert_close(stats.pooled, expected.to(stats.pooled), rtol=0, atol=1e-10)
    if pool == "sum":  # each measured row gives weight 1
        assert float(stats.pooled.sum()) == pytest.approx(2 * len(rows))


def test_sum_pooling_totals_each_even_cell(device):
    q, k, v = inputs(device)
    weights = attention_result(q, k, v, mask=masks.window(5, 0), return_weights=True).weights
    stats = attention_stats(q, k, v, mask=masks.window(5, 0), pooled=5, pool="sum")
    mean = dense(weights, first_keys=4, far=512, top_k=0, pooled=5, pool="mean")["pooled"]
    cells = torch.tensor([8, 8, 8, 8, 5], dtype=torch.float64, device=weights.device)  # 37 rows/keys in 8s
    torch.testing.assert_close(stats.pooled, mean * cells[:, None] * cells[None, :], rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "grid, fragment",
    [
        (PoolGrid(torch.zeros(36, dtype=torch.long), torch.zeros(37, dtype=torch.long), (1, 1)), "shape (37,)"),
        (PoolGrid(torch.zeros(37), torch.zeros(37, dtype=torch.long), (1, 1)), "rows is an int tensor"),
        (PoolGrid(torch.zeros(37, dtype=torch.long), torch.full((37,), 3), (1, 3)), "keys cell indices in [0, 3)"),
        (PoolGrid(torch.zeros(37, dtype=torch.long), torch.zeros(37, dtype=torch.long), (0, 1)), "two ints >= 1"),
    ],
)
def test_a_bad_pool_grid_is_named(grid, fragment, device):
    q, k, v = inputs(device)
    with pytest.raises(ValueError) as raised:
        attention_stats(q, k, v, pooled=grid)
    assert is_input_error(raised.value, ValueError) and "pooled" in str(raised.value) and fragment in str(raised.value)


@pytest.mark.parametrize("both_sides", [False, True], ids=["causal window", "two-sided window"])
def test_two_thousand_tokens_in_float32_and_unbatched(both_sides, device):
    # blocks far from the diagonal lie in one band (and, two-sided, wholly ahead of their queries): summed whole
    q, k, v = inputs(device, b=1, h=2, g=1, i=2048, j=2048, d=16, dtype=torch.float32, seed=1)
    mask = masks.window(600, 900) if both_sides else masks.causal() & masks.window(700, 0)
    weights = attention_result(q, k, v, mask=mask, return_weights=True).weights
    stats = attention_stats(q[0], k[0], v[0], mask=mask, top_k=4, pooled=512)
    assert stats.entropy.shape == (2, 2048) and stats.pooled is not None and stats.pooled.shape == (2, 512, 512)
    expected = dense(weights, first_keys=4, far=512, top_k=4, pooled=512, pool="max")
    for name in ("entropy", "max_weight", "ahead", "bands", "received", "received_far", "first", "pooled"):
        torch.testing.assert_close(getattr(stats, name), expected[name][0], rtol=0, atol=2e-5, msg=name)
    torch.testing.assert_close(stats.top_weights, expected["top_weights"][0], rtol=0, atol=2e-5)
    assert float(stats.bands[..., 5].max()) > 0 and torch.allclose(stats.bands.sum(-1), torch.ones(()), atol=1e-5)
    assert (float(stats.ahead.max()) > 0) == both_sides


def test_the_largest_weight_is_held_by_its_first_key_across_blocks(device):
    """Keys 3, 7 and 300 are one vector, far above the others for every query: each row's largest weight is on
    all three at once (300 in the second block of keys), and max_key names the first of them, as argmax does."""
    q, k, v = inputs(device, b=1, h=2, g=1, i=40, j=400, d=8, seed=2)
    q = 1 + 0.1 * q  # every query near the all-ones direction
    k[..., [3, 7, 300], :] = 6.0  # one key, three times, along it: scores near 48 against at most about 20
    stats = attention_stats(q, k, v)
    weights = attention_result(q, k, v, return_weights=True).weights
    assert torch.equal(weights[..., 3], weights[..., 7]) and torch.equal(weights[..., 3], weights[..., 300])
    assert torch.equal(weights.argmax(-1), torch.full_like(stats.max_key, 3)), "the three keys lead every row"
    assert torch.equal(stats.max_key, torch.full_like(stats.max_key, 3))
    torch.testing.assert_close(stats.max_weight, weights[..., 3], rtol=0, atol=1e-12)


def test_inputs_that_need_gradients_build_no_graph(device):
    q, k, v = (t.requires_grad_() for t in inputs(device))
    stats = attention_stats(q, k, v, causal=True)
    assert not stats.output.requires_grad and not stats.entropy.requires_grad and not stats.received.requires_grad


def test_rows_sum_to_one_and_entropy_is_within_its_bounds(device):
    q, k, v = inputs(device)
    stats = attention_stats(q, k, v, causal=True)
    torch.testing.assert_close(stats.bands.sum(-1), torch.ones_like(stats.entropy), rtol=0, atol=1e-12)
    visible = torch.arange(1, 38, device=device, dtype=torch.float64)  # row r sees r + 1 keys
    assert bool((stats.entropy >= -1e-12).all()) and bool((stats.entropy <= visible.log() + 1e-12).all())
    assert float(stats.ahead.abs().max()) == 0.0  # causal: nothing after the query
    assert stats.entropy[..., 0].abs().max() < 1e-12  # row 0 sees one key


@pytest.mark.parametrize(
    "arguments, kind, fragment",
    [
        ({"heads": [4]}, ValueError, "heads: expected head indices in 0..3"),
        ({"rows": [37]}, ValueError, "rows: expected query indices in 0..36"),
        ({"first_keys": -1}, ValueError, "first_keys: expected an int in [0, 37]"),
        ({"top_k": 38}, ValueError, "top_k: expected an int in [0, 37]"),
        ({"top_k": 1.5}, TypeError, "top_k: expected an int"),
        ({"far": -2}, ValueError, "far: expected an int >= 0"),
        ({"pooled": 0}, ValueError, "pooled: expected an int >= 1"),
        ({"pool": "median"}, ValueError, "pool: expected one of ['max', 'mean', 'sum']"),
        ({"mask": "causal"}, TypeError, "mask: expected a multihead.masks mask"),
    ],
)
def test_bad_arguments_are_named(arguments, kind, fragment, device):
    q, k, v = inputs(device)
    with pytest.raises(kind) as raised:
        attention_stats(q, k, v, **arguments)
    assert is_input_error(raised.value, kind) and fragment in str(raised.value)


def test_memory_stays_linear_in_the_length(monkeypatch):
    # the statistics of 4096 x 4096 weights without a 4096 x 4096 tensor: every tensor of weights exponentiated in
    # the statistics' pass is one block (256 x 256 at i = 4096: block_rows), and in the kernel's pass (where it is a
    # Python block loop: tiled's 256 x 256 blocks, in place; spans runs torch's fused kernel, exponentiating nothing
    # in Python) one block too
    q, k, v = inputs("cpu", b=1, h=1, g=1, i=4096, j=4096, d=8, dtype=torch.float32)
    sizes: dict[str, list[int]] = {"exp": [], "exp_": []}
    for name in sizes:
        original = getattr(torch.Tensor, name)

        def watched(tensor, original=original, name=name):
            sizes[name].append(tensor.numel())
            return original(tensor)

        monkeypatch.setattr(torch.Tensor, name, watched)
    stats = attention_stats(q, k, v, causal=True)
    assert stats.received.shape == (1, 1, 4096)
    assert sizes["exp"]  # the statistics' pass was watched
    block = streamed_stats.block_rows(4096) * streamed_stats.BLOCK_K
    assert max(sizes["exp"]) == block < 4096 * 4096 / 100 and max(sizes["exp_"], default=0) <= 256 * 256
    assert math.isclose(float(stats.received.sum()), 4096.0, rel_tol=1e-4)


def test_capture_records_the_statistics_of_a_transformers_llama():
    # GQA and RoPE, through the Attend seam: each recorded head's statistics are those of the weights it applies
    from multihead.capture import capture
    from multihead.integrations import transformers as integration
    from multihead.streamed_stats import StatsSettings
    from test_integrations_transformers import VOCAB, build

    model = build("llama").to(torch.float64).eval()
    model.set_attn_implementation(integration.IMPLEMENTATION)
    ids = torch.randint(3, VOCAB, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), capture(model, heads=[1, 3], stats=StatsSettings(far=3, top_k=2, pooled=5)) as rec:
        model(ids)
    for layer in rec.layers:
        stats = rec.stats(layer)
        assert stats.heads == [1, 3]
        assert_stats_equal(stats, rec.weights(layer), far=3, top_k=2, pooled=5)


def test_capture_records_minilm_with_padding_without_weights():
    from multihead.capture import capture
    from multihead.lab.models import load_minilm

    model, _ = load_minilm()
    texts = ["The bank was full of money.", "A river bank flooded after the long rain of the spring."]
    with (
        capture(model, layers=[0, 5], weights=True) as weights,
        capture(model, layers=[0, 5], weights=False, stats=True) as streamed,
    ):
        model.encode(texts)
    with pytest.raises(ValueError, match="weights: expected True to record weights"):
        streamed.weights(0)
    for layer in (0, 5):
        assert_stats_equal(streamed.stats(layer), weights.weights(layer), atol=2e-6)  # float32
