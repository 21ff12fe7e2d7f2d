"""Typed masks: dense values, block states that kernels rely on for skipping, ALiBi slopes, combination."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead
from multihead import masks
from multihead.machine import measure_peak_bytes
from multihead.masks import AttentionShape, BlockState, bind_mask
from support import randn

CPU = torch.device("cpu")


def dense_keep(mask, b=2, h=3, i=5, j=7, device=CPU):
    """(b, h, i, j) bool of the pairs a mask allows, bound for a call on ``device`` (and on it)."""
    bound = bind_mask(mask, False, AttentionShape(b, h, i, j, device))
    keep, bias = bound.dense(torch.float64)
    keep = torch.ones(b, h, i, j, dtype=torch.bool, device=device) if keep is None else keep.expand(b, h, i, j)
    if bias is not None:
        keep = keep & (bias.expand(b, h, i, j) > -math.inf)
    return keep


@pytest.mark.portable
def test_causal_and_window_values_for_unequal_lengths(device):
    # i = 3, j = 5, as drawn in the module docstring
    assert dense_keep(masks.causal(), 1, 1, 3, 5, device)[0, 0].int().tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]
    assert dense_keep(masks.causal("top_left"), 1, 1, 3, 5, device)[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
    ]
    # window(1, 0): own key and one before; window(0, 1): own key and one after (square)
    assert dense_keep(masks.window(1, 0), 1, 1, 3, 3, device)[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    assert dense_keep(masks.window(0, 1), 1, 1, 3, 3, device)[0, 0].int().tolist() == [[1, 1, 0], [0, 1, 1], [0, 0, 1]]
    assert dense_keep(masks.window(None, None), 1, 1, 3, 3, device).all()


@pytest.mark.portable
def test_padding_from_lengths_equals_padding_from_valid(device):
    lengths = torch.tensor([7, 2], device=device)
    valid = torch.arange(7, device=device) < lengths[:, None]
    from_lengths = dense_keep(masks.padding(lengths), device=device)
    assert torch.equal(from_lengths, dense_keep(masks.padding(valid), device=device))
    assert torch.equal(from_lengths, dense_keep(masks.padding([7, 2]), device=device))  # host lengths, same pairs
    assert dense_keep(masks.padding([7, 2]), device=device)[1, :, :, 2:].any().item() is False


def test_alibi_slopes_follow_press_et_al():
    assert masks.alibi_slopes(8).tolist() == [2.0**-n for n in range(1, 9)]
    # 12 heads: the 8-head slopes, then every other slope of 16 heads (2^-0.5, 2^-1.5, ...)
    expected = [2.0**-n for n in range(1, 9)] + [2.0 ** -(k + 0.5) for k in range(4)]
    torch.testing.assert_close(masks.alibi_slopes(12), torch.tensor(expected), rtol=1e-6, atol=0)


@pytest.mark.portable
def test_alibi_bias_is_minus_slope_times_distance_to_the_aligned_query(device):
    bound = bind_mask(masks.alibi([0.5, 0.25]), False, AttentionShape(1, 2, 2, 4, device))
    _, bias = bound.dense(torch.float64)
    # query 0 sits at key position 2 (bottom-right), query 1 at key position 3
    assert bias[0, 0].tolist() == [[-1.0, -0.5, 0.0, -0.5], [-1.5, -1.0, -0.5, 0.0]]
    assert bias[0, 1].tolist() == [[-0.5, -0.25, 0.0, -0.25], [-0.75, -0.5, -0.25, 0.0]]


@pytest.mark.portable
@pytest.mark.parametrize("slopes_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_alibi_bias_built_a_head_at_a_time_is_the_slopes_dtype_product_rounded_once(slopes_dtype, monkeypatch, device):
    h, i, j = 5, 33, 40
    slopes = masks.alibi_slopes(h).to(device=device, dtype=slopes_dtype)
    keys, queries = torch.arange(j, device=device), torch.arange(i, device=device)
    distance = (keys[None] - (queries[:, None] + j - i)).abs().to(slopes_dtype)
    product = -slopes[:, None, None] * distance  # (h, i, j), in the slopes' dtype
    monkeypatch.setattr(masks._alibi, "ALIBI_CHUNK_ELEMENTS", 2 * i * j)  # two heads a chunk: 3 chunks, the last short
    bound = bind_mask(masks.alibi(slopes), False, AttentionShape(1, h, i, j, device))
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        _, bias = bound.dense(dtype)
        assert bias.shape == (1, h, i, j) and bias.dtype == dtype
        assert torch.equal(bias[0], product.to(dtype))
    heads = torch.tensor([3, 0], device=device)
    _, some = bound.block(slice(4, 9), slice(None), heads, dtype=torch.bfloat16)
    assert torch.equal(some[0], product[heads, 4:9].to(torch.bfloat16))


@pytest.mark.portable
def test_learned_alibi_slopes_get_their_gradient_through_the_bias(device):
    h, i, j = 3, 4, 6
    slopes = masks.alibi_slopes(h).to(device).requires_grad_()
    bound = bind_mask(masks.alibi(slopes), False, AttentionShape(1, h, i, j, device))
    _, bias = bound.dense(torch.float64)
    bias.sum().backward()
    keys, queries = torch.arange(j, device=device), torch.arange(i, device=device)
    distance = (keys[None] - (queries[:, None] + j - i)).abs().sum()
    assert torch.equal(slopes.grad, -distance.float().expand(h))
    with torch.no_grad():  # no graph wanted: built a few heads at a time, the same values
        assert torch.equal(bound.dense(torch.float64)[1], bias.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_alibi_as_one_additive_mask_peaks_at_one_bias(dtype, monkeypatch):
    """SDPA's dense causal & ALiBi mask: the bias is built a head at a time into the result and the causal -inf
    written into it in place (bfloat16: in float32 blocks of rows, each moved by its largest entry, then rounded
    into the result). Built in float32 whole, cast and then filled, it peaked at 6 bytes an entry for bfloat16
    (24 GiB at i = j = 16384 with 16 heads) where 2 are kept."""
    h, n = 8, 256
    monkeypatch.setattr(masks._alibi, "ALIBI_CHUNK_ELEMENTS", n * n)
    monkeypatch.setattr(masks._bound_mask, "ADDITIVE_BLOCK_ELEMENTS", n * n)
    bound = bind_mask(masks.alibi(masks.alibi_slopes(h)), True, AttentionShape(1, h, n, n, CPU))
    kept = h * n * n * dtype.itemsize
    peak = measure_peak_bytes(lambda: bound.additive(dtype))
    # beside the bias: the distances and one head's product (float32), the causal keep-mask and its negation
    assert kept <= peak <= kept + n * n * (4 + 4 + 1 + 1)
    additive = bound.additive(dtype)
    _, bias = bound.dense(torch.float32)
    upper = torch.ones(n, n, dtype=torch.bool).triu(1)
    expected = bias.masked_fill(upper, -math.inf)
    if dtype == torch.bfloat16:  # each row relative to its nearest key (its diagonal: bias 0 there anyway)
        expected = expected - expected.amax(-1, keepdim=True)
    assert torch.equal(additive, expected.to(dtype))


@pytest.mark.portable
def test_additive_mask_never_writes_the_callers_bias(device):
    bias = randn(1, 1, 6, 6, seed=1, dtype=torch.float32, device=device)
    given_bias = bias.clone()
    bound = bind_mask(masks.bias(bias), True, AttentionShape(1, 2, 6, 6, device))
    additive = bound.additive(torch.float32)
    assert torch.equal(bias, given_bias)
    upper = torch.ones(6, 6, dtype=torch.bool, device=device).triu(1)
    assert torch.equal(additive, given_bias.masked_fill(upper, -math.inf))
    # a bias built for the call (cast from float64) that broadcasts over rows cannot take the causal -inf in
    # place: a new (.., i, j) tensor
    row_bias = randn(1, 1, 1, 6, seed=2, device=device)
    bound = bind_mask(masks.bias(row_bias), True, AttentionShape(1, 2, 6, 6, device))
    additive = bound.additive(torch.float32)
    assert torch.equal(additive, row_bias.float().expand(1, 1, 6, 6).masked_fill(upper, -math.inf))
    # no bias: the keep-mask itself
    assert (
        bind_mask(masks.causal(), False, AttentionShape(1, 2, 6, 6, device)).additive(torch.float32).dtype == torch.bool
    )


@pytest.mark.portable
def test_masks_combine_with_and_and_biases_add(device):
    bias_a, bias_b = randn(5, 7, seed=1, device=device), randn(5, 7, seed=2, device=device)
    combined = masks.bias(bias_a) & masks.causal() & bias_b
    bound = bind_mask(combined, False, AttentionShape(2, 3, 5, 7, device))
    keep, bias = bound.dense(torch.float64)
    torch.testing.assert_close(bias[0, 0], bias_a + bias_b)
    assert torch.equal(keep[0, 0], torch.ones(5, 7, dtype=torch.bool, device=device).tril(2))
    # a plain tensor on the left works too
    everything = torch.ones(5, 7, dtype=torch.bool, device=device)
    assert torch.equal(
        dense_keep(everything & masks.causal(), device=device), dense_keep(masks.causal(), device=device)
    )
    assert "causal" in repr(combined) and "bias" in repr(combined)


@pytest.mark.portable
def test_causal_flag_adds_bottom_right_causal(device):
    bound = bind_mask(masks.padding([7, 3]), True, AttentionShape(2, 3, 5, 7, device))
    keep, _ = bound.dense(torch.float64)
    expected = dense_keep(masks.causal() & masks.padding([7, 3]), device=device)
    assert torch.equal(keep.expand(2, 3, 5, 7), expected)


@st.composite
def masks_and_blocks(draw):
    b, h, i, j = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 12)), draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["causal", "window", "padding", "combo"]))
    align = draw(st.sampled_from(["bottom_right", "top_left"]))
    window = masks.window(
        draw(st.one_of(st.none(), st.integers(0, 5))), draw(st.one_of(st.none(), st.integers(0, 5))), align=align
    )
    padding = masks.padding(torch.tensor(draw(st.lists(st.integers(0, j), min_size=b, max_size=b))))
    mask = {
        "causal": masks.causal(align),
        "window": window,
        "padding": padding,
        "combo": masks.causal(align) & padding & window,
    }[kind]
    i0 = draw(st.integers(0, i - 1))
    j0 = draw(st.integers(0, j - 1))
    rows = range(i0, draw(st.integers(i0 + 1, i)))
    cols = range(j0, draw(st.integers(j0 + 1, j)))
    return (b, h, i, j), mask, rows, cols


@pytest.mark.portable
@settings(max_examples=300, deadline=None)
@given(masks_and_blocks())
def test_block_state_never_contradicts_the_dense_mask(device, case):
    """EMPTY blocks are skipped by kernels and FULL blocks get no mask: both must be exact. The padding lengths are
    in a CPU tensor (known on the host), so the states and may_empty_rows are exact for a call on any device."""
    (b, h, i, j), mask, rows, cols = case
    keep = dense_keep(mask, b, h, i, j, device)[:, :, rows.start : rows.stop, cols.start : cols.stop]
    bound = bind_mask(mask, False, AttentionShape(b, h, i, j, device))
    state = bound.state(rows, cols)
    if state is BlockState.EMPTY:
        assert not keep.any()
    if state is BlockState.FULL:
        assert keep.all()
    # and the block evaluation equals the slice of the dense mask
    block_keep, _ = bound.block(slice(rows.start, rows.stop), slice(cols.start, cols.stop))
    block_keep = torch.ones_like(keep) if block_keep is None else block_keep.expand_as(keep)
    assert torch.equal(block_keep, keep)
    # may_empty_rows is exact: True iff some row has no allowed key
    assert bound.may_empty_rows() == bool((~dense_keep(mask, b, h, i, j, device).any(-1)).any())


@st.composite
def masks_that_may_empty_rows(draw):
    """Combinations of two or more masking terms (and biases that mask nothing), on sizes that span several of the
    row and key blocks may_empty_rows looks at when those are 2 x 3."""
    b, h, i, j = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 11)), draw(st.integers(1, 11))
    align = draw(st.sampled_from(["bottom_right", "top_left"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    options = {
        "causal": masks.causal(align),
        "window": masks.window(draw(st.integers(0, 3)), draw(st.integers(0, 3)), align=align),
        "padding": masks.padding(torch.tensor(draw(st.lists(st.integers(0, j), min_size=b, max_size=b)))),
        "allowed": torch.rand(b, 1, i, j, generator=gen) < draw(st.sampled_from([0.1, 0.5, 0.9])),
        "bias with -inf": torch.randn(1, h, i, j, dtype=torch.float64, generator=gen).masked_fill(
            torch.rand(1, h, i, j, generator=gen) < draw(st.sampled_from([0.2, 0.8])), -math.inf
        ),
        "alibi": masks.alibi(masks.alibi_slopes(h)),
    }
    chosen = draw(st.lists(st.sampled_from(sorted(options)), min_size=2, max_size=4, unique=True))
    mask = masks.as_mask(options[chosen[0]])
    for name in chosen[1:]:
        mask = mask & options[name]
    return (b, h, i, j), mask


@settings(max_examples=300, deadline=None)
@given(masks_that_may_empty_rows())
def test_may_empty_rows_is_exact_block_by_block(case):
    """Checked a few rows and keys at a time (blocks settled by their states, the rest evaluated), it still says
    True exactly when some row of the dense mask keeps no key."""
    (b, h, i, j), mask = case
    bound = bind_mask(mask, False, AttentionShape(b, h, i, j, CPU))
    with (
        patch.object(masks._bound_mask, "EMPTY_ROW_BLOCK", 3),
        patch.object(masks._bound_mask, "EMPTY_ROW_CHECK_ELEMENTS", 2 * b * h * j),
    ):
        assert bound.may_empty_rows() == bool((~dense_keep(mask, b, h, i, j).any(-1)).any())


@contextlib.contextmanager
def recording_blocks() -> Iterator[list[int]]:
    """Within it, every BoundMask.block call appends the number of keep entries it built to the yielded list."""
    built: list[int] = []
    block = masks.BoundMask.block

    def recording_block(self, rows, cols, *args, **kwargs):
        keep, bias = block(self, rows, cols, *args, **kwargs)
        built.append(keep.numel())
        return keep, bias

    with patch.object(masks.BoundMask, "block", recording_block):
        yield built


@pytest.mark.portable
def test_may_empty_rows_builds_no_i_by_j_tensor(device):
    """It runs on every kernel call: causal & ALiBi at n = 16384 with 16 heads once built a 17 GiB dense bias here.
    A finite bias is not evaluated at all, and other combinations a bounded block of rows at a time (from the
    values known on the host: the padding below is a CPU tensor, for a call on any device)."""
    n, heads = 16384, 16
    shape = AttentionShape(1, heads, n, n, device)
    with patch.object(masks._alibi._BoundAlibi, "evaluate", side_effect=AssertionError("ALiBi evaluated")):
        assert not bind_mask(masks.alibi(masks.alibi_slopes(heads)), True, shape).may_empty_rows()
    # a window narrower than a key block keeps no block whole: every row block is evaluated, over its live keys
    # (padding given as a (b, j) bool: key lengths are settled without any block, below)
    half = (torch.arange(n) < n // 2)[None]  # (1, j): the first half of the keys real
    narrow = masks.causal() & masks.window(8) & masks.padding(half)
    with recording_blocks() as built:
        assert bind_mask(narrow, False, shape).may_empty_rows()  # the rows past the padding see no key
        assert built and max(built) <= masks._bound_mask.EMPTY_ROW_BLOCK * 2 * masks._bound_mask.EMPTY_ROW_BLOCK
        built.clear()
        # causal & padding: every row block past the first keeps key block 0 whole, settled by its state alone
        assert not bind_mask(masks.causal() & masks.padding(half), False, shape).may_empty_rows()
        assert built == [masks._bound_mask.EMPTY_ROW_BLOCK**2]
        built.clear()
        # bands and key lengths known on the host: the same answers by arithmetic on the first and last rows
        assert bind_mask(masks.causal() & masks.window(8) & masks.padding([n // 2]), False, shape).may_empty_rows()
        assert not bind_mask(masks.causal() & masks.padding([n // 2]), False, shape).may_empty_rows()
        assert built == []


def test_may_empty_rows_bounds_blocks_that_broadcast_batch_and_heads():
    """Padding (per batch) and a per-head tensor broadcast to (b, h, rows, keys) blocks: the row count per block is
    set from b x h planes, so no block passes EMPTY_ROW_CHECK_ELEMENTS (counting only the larger of b and h built
    4 times as many entries here)."""
    b, h, n = 4, 8, 64
    allowed = torch.rand(1, h, n, n, generator=torch.Generator().manual_seed(0)) < 0.5
    mask = masks.as_mask(allowed) & masks.padding(torch.full((b,), n // 2))
    bound = bind_mask(mask, False, AttentionShape(b, h, n, n, CPU))
    limit = b * h * n * 2  # two rows of every plane at once
    some_row_empty = bool((~dense_keep(mask, b, h, n, n).any(-1)).any())
    with recording_blocks() as built, patch.object(masks._bound_mask, "EMPTY_ROW_CHECK_ELEMENTS", limit):
        assert bound.may_empty_rows() == some_row_empty
    assert built and max(built) <= limit
    assert bound.dense_extent() == (b, h, n)


@pytest.mark.portable
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.integers(0, 6)),
            st.one_of(st.none(), st.integers(0, 6)),
            st.sampled_from(["bottom_right", "top_left"]),
        ),
        min_size=2,
        max_size=4,
    ),
    st.integers(1, 9),
    st.integers(1, 9),
)
def test_diagonals_of_one_alignment_bind_as_one_band(device, windows, i, j):
    """causal & window(...) & window(...) of one alignment keep what each keeps, as one band per alignment."""
    parts = [masks.window(left, right, align=align) for left, right, align in windows]
    combined = parts[0]
    for part in parts[1:]:
        combined = combined & part
    bound = bind_mask(combined, False, AttentionShape(1, 1, i, j, device))
    expected = torch.ones(1, 1, i, j, dtype=torch.bool, device=device)
    for part in parts:
        expected &= dense_keep(part, 1, 1, i, j, device)
    assert torch.equal(dense_keep(combined, 1, 1, i, j, device), expected)
    assert len(bound.terms) <= len({align for _, _, align in windows})
    assert bound.may_empty_rows() == bool((~expected.any(-1)).any())


@pytest.mark.portable
def test_causal_and_a_window_are_one_band(device):
    bound = bind_mask(masks.causal() & masks.window(256), False, AttentionShape(1, 1, 1024, 1024, device))
    assert bound.kinds() == ["diagonal"] and not bound.is_plain_causal
    assert bind_mask(masks.causal() & masks.causal(), False, AttentionShape(1, 1, 8, 8, device)).is_plain_causal
    mixed = bind_mask(masks.causal() & masks.causal("top_left"), False, AttentionShape(1, 1, 4, 8, device))
    assert mixed.kinds() == ["diagonal", "diagonal"]  # two alignments: two bands


@pytest.mark.portable
def test_causal_blocks_above_the_diagonal_are_empty_and_below_full(device):
    bound = bind_mask(masks.causal(), False, AttentionShape(1, 1, 8, 8, device))
    assert bound.state(range(0, 4), range(4, 8)) is BlockState.EMPTY
    assert bound.state(range(4, 8), range(0, 4)) is BlockState.FULL
    assert bound.state(range(0, 4), range(0, 4)) is BlockState.PARTIAL
    assert bound.is_plain_causal
    assert not bind_mask(masks.causal(), False, AttentionShape(1, 1, 4, 8, device)).is_plain_causal


@pytest.mark.portable
def test_rows_and_heads_selection_of_a_bound_mask(device):
    slopes = torch.tensor([0.5, 0.25, 0.125], device=device)
    mask = masks.alibi(slopes) & masks.causal() & randn(2, 3, 5, 7, dtype=torch.float32, device=device)
    bound = bind_mask(mask, False, AttentionShape(2, 3, 5, 7, device))
    keep, bias = bound.dense(torch.float32)
    rows, heads = torch.tensor([4, 0], device=device), torch.tensor([2], device=device)
    sub_keep, sub_bias = bound.block(rows, slice(None), heads, dtype=torch.float32)
    torch.testing.assert_close(sub_bias, bias[:, [2]][:, :, [4, 0]])
    assert torch.equal(sub_keep.expand(2, 1, 2, 7), keep.expand(2, 3, 5, 7)[:, [2]][:, :, [4, 0]])


@pytest.mark.portable
def test_all_of_is_what_and_builds_and_traces_whole_with_a_tensor_part(device):
    """``mask & tensor`` cannot be traced by torch.compile(fullgraph=True) (dynamo takes it for a tensor
    operation); all_of builds the same mask as a call, which it traces."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, device=device) for _ in range(3))
    position_bias = torch.randn(1, 2, 4, 4, device=device)
    keep = torch.ones(1, 1, 4, 4, dtype=torch.bool, device=device)
    keep[..., -1] = False
    combined = masks.all_of(masks.bias(position_bias), masks.softcap(5.0), keep)
    assert repr(combined) == repr(masks.bias(position_bias) & masks.softcap(5.0) & keep)

    def attend(q, k, v, position_bias, keep):
        return multihead.attention(q, k, v, mask=masks.all_of(masks.bias(position_bias), masks.softcap(5.0), keep))

    torch._dynamo.reset()
    traced = torch.compile(attend, fullgraph=True, backend="eager")(q, k, v, position_bias, keep)
    torch.testing.assert_close(traced, multihead.attention(q, k, v, mask=combined))
