"""BoundMask.block_states: every tile's state at once, on the mask's device, from whole-tensor operations. For one
term it says what the pairs say (a tile is empty where no batch row or head keeps a pair, full where all keep all);
terms combine tile by tile, so a combination is never wrong but may leave to the pairs what only they settle (a
tile each batch row loses to another term). It agrees with the tile-by-tile state() wherever that one is exact,
and reads no device tensor."""

from __future__ import annotations

import pytest
import torch

from multihead import masks
from multihead.masks import (
    STATE_EMPTY,
    STATE_FULL,
    STATE_PARTIAL,
    AttentionShape,
    BlockState,
    bind_mask,
)

pytestmark = pytest.mark.portable

B, H = 3, 2


def true_states(bound, block: int) -> torch.Tensor:
    """The states from the keep mask itself, pair by pair: (q_blocks, k_blocks) int8 on the CPU."""
    i, j = bound.shape.q_len, bound.shape.k_len
    keep, _ = bound.dense(torch.float32)
    keep = torch.ones(1, 1, i, j, dtype=torch.bool) if keep is None else keep.cpu().expand(B, H, i, j)
    rows, cols = -(-i // block), -(-j // block)
    states = torch.empty(rows, cols, dtype=torch.int8)
    for r in range(rows):
        for c in range(cols):
            tile = keep[..., r * block : (r + 1) * block, c * block : (c + 1) * block]
            states[r, c] = STATE_EMPTY if not tile.any() else STATE_FULL if tile.all() else STATE_PARTIAL
    return states


def cases(device: torch.device):
    """(name, mask, causal, i, j): every keep term alone and combined, unequal lengths both ways."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 0, 13])
    valid = torch.rand(B, 13, generator=generator) < 0.6
    valid[:, :4] = False  # a tile of keys no row has
    keep = torch.rand(B, 1, 11, 13, generator=generator) < 0.7
    keep[..., :4, :] = True  # full tiles
    keep[..., 8:, 4:8] = False  # empty tiles
    packed = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3])  # documents: whole tiles of one, tiles between
    packed = torch.stack([packed, packed + 7, torch.arange(13) // 6])
    shuffled = torch.randint(0, 3, (B, 7), generator=generator)  # not in order: the ranges still tell
    return [
        ("causal", None, True, 11, 13),
        ("causal i > j", None, True, 13, 7),
        ("window", masks.window(3), False, 11, 13),
        ("window both sides", masks.window(2, 5), False, 12, 9),
        ("top-left causal", masks.causal(align="top_left"), False, 9, 13),
        ("padding lengths", masks.padding(lengths.to(device)), False, 11, 13),
        ("padding ints", masks.padding([13, 5, 9]), True, 11, 13),
        ("padding valid", masks.padding(valid.to(device)), False, 11, 13),
        ("documents", masks.documents(packed.to(device)), False, 11, 13),
        ("documents out of order, i > j", masks.documents(shuffled.to(device)), False, 13, 7),
        ("documents top-left", masks.documents(packed.to(device), align="top_left"), False, 9, 13),
        ("dense keep", keep.to(device), False, 11, 13),
        ("everything", masks.window(6) & masks.padding(lengths.to(device)) & keep.to(device), True, 11, 13),
        ("alibi only", masks.alibi(masks.alibi_slopes(H)), False, 11, 13),
    ]


@pytest.mark.parametrize("block", [1, 2, 4, 5, 16])
@pytest.mark.parametrize("case", range(14))
def test_every_tile_says_what_its_pairs_say(device, case, block):
    name, mask, causal, i, j = cases(device)[case]
    bound = bind_mask(mask, causal, AttentionShape(B, H, i, j, device))
    states = bound.block_states(block)
    assert states.device == device and states.dtype == torch.int8, name
    truth = true_states(bound, block)
    if len(bound.keep_terms) <= 1 and "out of order" not in name:  # one term: exact
        assert torch.equal(states.cpu(), truth), name
    else:  # terms combine tile by tile, each over every batch row: never wrong, partial where only the pairs tell
        # (documents out of order: a tile whose ranges of indices overlap may still share none)
        said = states.cpu()
        assert torch.equal(truth[said != STATE_PARTIAL], said[said != STATE_PARTIAL]), name
        if block <= 4:  # the band and the lengths still settle tiles
            assert (said == STATE_PARTIAL).sum() < said.numel(), name


@pytest.mark.parametrize("case", range(11))  # the terms whose tile-by-tile state is exact (no dense keep tensor)
def test_the_tiles_agree_with_state_tile_by_tile(case):
    name, mask, causal, i, j = cases(torch.device("cpu"))[case]
    bound = bind_mask(mask, causal, AttentionShape(B, H, i, j, torch.device("cpu")))
    code = {BlockState.EMPTY: STATE_EMPTY, BlockState.PARTIAL: STATE_PARTIAL, BlockState.FULL: STATE_FULL}
    block = 4
    states = bound.block_states(block)
    for r in range(states.shape[0]):
        for c in range(states.shape[1]):
            rows, cols = range(r * block, min((r + 1) * block, i)), range(c * block, min((c + 1) * block, j))
            assert states[r, c] == code[bound.state(rows, cols)], (name, r, c)


def test_no_value_is_read_on_the_host():
    """Under FakeTensorMode a host read raises: the tiles come from tensor operations alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        lengths = torch.tensor([9, 0, 13])
        keep = torch.ones(B, 1, 11, 13, dtype=torch.bool)
        mask = masks.window(6) & masks.padding(lengths) & keep & masks.documents(torch.zeros(B, 13, dtype=torch.long))
        states = bind_mask(mask, True, AttentionShape(B, H, 11, 13, torch.device("cpu"))).block_states(4)
        assert states.shape == (3, 4)


def test_auto_counts_live_blocks_from_what_the_host_knows():
    """The estimates' block counts come from the mask's host side (BoundMask.on_host): lengths known on the host
    settle tiles exactly; lengths in a tensor the host cannot read (here on the meta device, as a CUDA tensor is
    never read) count every tile of theirs partial, and nothing is read from them."""
    from multihead.backends import costs

    n = 512
    cpu, meta = (AttentionShape(1, H, n, n, torch.device(name)) for name in ("cpu", "meta"))
    known = bind_mask(masks.padding([128]), False, cpu)
    assert costs.live_fraction(known, n, n, 64, 64) == 128 / n
    assert costs.masked_fraction(known, n, n, 64, 64) == 0.0  # whole tiles of real keys, then none
    unread = bind_mask(masks.padding(torch.tensor([128], device="meta")), True, meta)
    causal_alone = costs.live_fraction(bind_mask(None, True, cpu), n, n, 64, 64)
    assert costs.live_fraction(unread, n, n, 64, 64) == causal_alone  # the band still settles its tiles
    assert costs.masked_fraction(unread, n, n, 64, 64) == causal_alone  # every live tile evaluated pair by pair


def row_key_cases(device: torch.device):
    """(name, mask, causal, b, i, j, says): masks whose rows each keep one run of keys (says True) and masks that
    do not, or differ by batch row or head (says False)."""
    packed = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3]])
    cu = torch.tensor([0, 4, 4, 9, 13])  # an empty document among them
    return [
        ("causal", None, True, 1, 11, 13, True),
        ("causal i > j", None, True, 2, 13, 7, True),
        ("window both sides", masks.window(2, 5), False, 1, 12, 9, True),
        ("top-left causal & window", masks.causal(align="top_left") & masks.window(3), False, 1, 9, 13, True),
        ("padding of one length", masks.padding([9, 9]), True, 2, 11, 13, True),
        ("documents", masks.documents(packed.to(device)) & masks.window(2), True, 1, 13, 13, True),
        (
            "documents top-left, fewer queries",
            masks.documents(packed.to(device), align="top_left") & masks.causal(align="top_left"),
            False,
            1,
            9,
            13,
            True,
        ),
        (
            "documents out of order",
            masks.documents(torch.tensor([[1, 0, 1, 0, 2]], device=device)),
            False,
            1,
            5,
            5,
            False,
        ),
        ("varlen documents", masks.ragged_documents(cu, cu, (None, 0)), False, 1, 13, 13, True),
        ("padding of two lengths", masks.padding([9, 5]), True, 2, 11, 13, False),
        ("documents per batch row", masks.documents(torch.tensor([[0, 0, 1], [0, 1, 1]])), False, 2, 3, 3, False),
        ("alibi", masks.alibi(masks.alibi_slopes(H)), True, 1, 5, 5, False),
        ("dense keep", torch.ones(5, 5, dtype=torch.bool).tril(), False, 1, 5, 5, False),
    ]


@pytest.mark.parametrize("case", range(13))
def test_row_key_spans_say_each_rows_keys_where_they_say_anything(device, case):
    """BoundMask.row_key_spans: where every row keeps one run of keys alike in every batch row and head, the runs
    are exactly the pairs the mask keeps; elsewhere (and with a bias) None."""
    name, mask, causal, b, i, j, says = row_key_cases(device)[case]
    bound = bind_mask(mask, causal, AttentionShape(b, H, i, j, device))
    spans = bound.row_key_spans()
    assert (spans is not None) == says, name
    if spans is None:
        return
    lo, hi = spans
    assert lo.device.type == "cpu" and lo.shape == hi.shape == (i,), name
    keys = torch.arange(j)
    runs = (keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None])  # (i, j)
    keep, _ = bound.dense(torch.float32)
    keep = torch.ones(1, 1, i, j, dtype=torch.bool) if keep is None else keep.cpu()
    assert torch.equal(keep.expand(b, H, i, j), runs.expand(b, H, i, j)), name
