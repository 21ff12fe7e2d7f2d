"""Mask.for_heads: every kind of mask cut to a range of query heads equals the whole mask on those heads (dense
keep and bias, bound to the cut's head count against the whole's slice), for every kind with per-head parts (ALiBi
(h,) and (b, h), aligned ALiBi, bias/allowed/plain tensors with a head axis, selected indexer heads, custom
functions reading h, combinations) and without; attention over the head slice equals the whole call's heads; the
errors for a mask built for other heads, and for bad arguments."""

from __future__ import annotations

import pytest
import torch

import multihead
from multihead import masks
from multihead.masks import AttentionShape, aligned_alibi
from support import is_input_error, make_qkv, tiny_blocks

B, H, Q_LEN, K_LEN = 2, 8, 5, 7
CPU = torch.device("cpu")
# (start, count) of H: all heads, a middle range, the last two, one head, and ranges that cut a group of 4 heads
RANGES = [(0, 8), (2, 4), (6, 2), (3, 1), (4, 4), (3, 2), (0, 2)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed), dtype=torch.float64)


def coin(*shape: int, seed: int = 0) -> torch.Tensor:
    keep = torch.rand(*shape, generator=gen(seed)) < 0.7
    keep[..., 0] = True  # every row keeps a key
    return keep


TABLE = rand(H, Q_LEN, K_LEN, seed=9)  # a per-head table the custom functions read by global head index


def head_mask(b, h, q, kv):  # a different pattern on every head: h's parity and size decide
    return (kv <= q + h % 3) | (h >= 6)


def head_scores(b, h, q, kv):
    return TABLE[h, q, kv]


def head_monotone(b, h, q, kv):  # causal, shifted right by the head's number: one change along rows and columns
    return kv <= q + h


def head_blocks(q_start, q_stop, kv_start, kv_stop):  # head_monotone's blocks, for heads 0 .. H - 1
    return kv_start > q_stop - 1 + (H - 1), kv_stop - 1 <= q_start


def documents_ids() -> torch.Tensor:
    return torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 2]])


def picks(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(-1, K_LEN, shape, generator=gen(seed))


KINDS = {
    "causal": lambda: masks.causal(),
    "window": lambda: masks.window(2, 1),
    "padding lengths": lambda: masks.padding(torch.tensor([7, 4])),
    "padding valid": lambda: masks.padding(coin(B, K_LEN, seed=1)),
    "documents": lambda: masks.documents(documents_ids()),
    "softcap": lambda: masks.softcap(3.0),
    "alibi (h,)": lambda: masks.alibi(masks.alibi_slopes(H)),
    "alibi (b, h)": lambda: masks.alibi(rand(B, H, seed=2).abs(), align="top_left"),
    "aligned alibi": lambda: aligned_alibi(rand(B, H, Q_LEN, seed=3).abs(), torch.tensor([[0, 1, 2, 4, 6]])),
    "bias (b, h, i, j)": lambda: masks.bias(rand(B, H, Q_LEN, K_LEN, seed=4)),
    "bias (h, i, j)": lambda: masks.bias(rand(H, Q_LEN, K_LEN, seed=5)),
    "bias (1, 1, i, j)": lambda: masks.bias(rand(1, 1, Q_LEN, K_LEN, seed=6)),
    "bias (i, j)": lambda: masks.bias(rand(Q_LEN, K_LEN, seed=6)),
    "allowed (b, h, i, j)": lambda: masks.allowed(coin(B, H, Q_LEN, K_LEN, seed=7)),
    "allowed (b, 1, 1, j)": lambda: masks.allowed(coin(B, 1, 1, K_LEN, seed=7)),
    "plain tensor (1, h, i, j)": lambda: masks.as_mask(rand(1, H, Q_LEN, K_LEN, seed=8)),
    "selected (b, i, k)": lambda: masks.selected(picks(B, Q_LEN, 3)),
    "selected (b, 2, i, k)": lambda: masks.selected(picks(B, 2, Q_LEN, 3, seed=1)),
    "selected (b, 8, i, k)": lambda: masks.selected(picks(B, 8, Q_LEN, 2, seed=2)),
    "selected (b, 4, i, k) blocks": lambda: masks.selected(picks(B, 4, Q_LEN, 1, seed=3) % 3, block_size=3),
    "custom mask_mod": lambda: masks.custom(head_mask),
    "custom score_mod": lambda: masks.custom(score_mod=head_scores),
    "custom both": lambda: masks.custom(head_mask, head_scores),
    "custom monotone": lambda: masks.custom(head_monotone, monotone=True),
    "custom block_mod": lambda: masks.custom(head_monotone, block_mod=head_blocks),
    "combined": lambda: (
        masks.causal()
        & masks.alibi(masks.alibi_slopes(H))
        & masks.bias(rand(B, H, Q_LEN, K_LEN, seed=10))
        & masks.custom(head_mask)
        & masks.softcap(5.0)
    ),
}
PER_HEAD = {name for name in KINDS if name.startswith(("alibi", "aligned", "selected (b, ", "custom", "combined"))}
PER_HEAD |= {"bias (b, h, i, j)", "bias (h, i, j)", "allowed (b, h, i, j)", "plain tensor (1, h, i, j)"}
PER_HEAD -= {"selected (b, i, k)"}


def dense(mask: masks.Mask, heads: int) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """(keep bool, bias float64, both (B, heads, Q_LEN, K_LEN), and the soft-cap): the mask bound to ``heads`` heads."""
    bound = mask.bind(AttentionShape(B, heads, Q_LEN, K_LEN, CPU))
    keep, bias = bound.dense(torch.float64)
    full = (B, heads, Q_LEN, K_LEN)
    keep = torch.ones(full, dtype=torch.bool) if keep is None else keep.expand(full)
    bias = torch.zeros(full, dtype=torch.float64) if bias is None else bias.expand(full)
    return keep, bias, bound.softcap


@pytest.mark.parametrize("name", list(KINDS))
def test_the_cut_is_the_whole_mask_on_those_heads(name):
    whole = KINDS[name]()
    keep, bias, cap = dense(whole, H)
    for start, count in RANGES:
        cut = whole.for_heads(start, count, H)
        cut_keep, cut_bias, cut_cap = dense(cut, count)
        heads = slice(start, start + count)
        assert torch.equal(cut_keep, keep[:, heads]), (name, start, count)
        assert torch.equal(cut_bias, bias[:, heads]), (name, start, count)
        assert cut_cap == cap
        # nothing per head, all heads, or a custom function's heads counted from 0 as they were: the mask itself
        unchanged = name not in PER_HEAD or (start, count) == (0, H) or (start == 0 and name.startswith("custom"))
        assert (cut is whole) == unchanged, (name, start, count)


@pytest.mark.parametrize("name", [name for name in KINDS if name.startswith("custom") or name == "combined"])
def test_a_cut_custom_function_is_called_with_global_heads_in_every_form(name):
    """The rule (FlexAttention's mods, plain and lifted with its offset as a tensor) and the block evaluation agree
    with the whole mask at global heads; the block states of the cut are the whole's (they hold for every head)."""
    whole = KINDS[name]()
    whole_bound = whole.bind(AttentionShape(B, H, Q_LEN, K_LEN, CPU))
    cut_bound = whole.for_heads(5, 3, H).bind(AttentionShape(B, 3, Q_LEN, K_LEN, CPU))
    b, h = torch.arange(B)[:, None, None, None], torch.arange(3)[None, :, None, None]
    q, k = torch.arange(Q_LEN)[None, None, :, None], torch.arange(K_LEN)[None, None, None, :]
    for mine, ref in zip(cut_bound.terms, whole_bound.terms, strict=True):
        want = ref.mod(b, h + 5, q, k)
        assert torch.equal(mine.mod(b, h, q, k), want)
        assert torch.equal(mine.lifted().mod(b, h, q, k), want)
        selected_heads = torch.tensor([0, 2])
        assert torch.equal(
            mine.evaluate(slice(1, 4), slice(0, 5), selected_heads),
            ref.evaluate(slice(1, 4), slice(0, 5), selected_heads + 5),
        )
    # the cut's block states are sound for its heads: an empty block keeps no pair of theirs, a full one every pair
    # (a monotone function's corners are read at its own heads' global numbers)
    keep = dense(whole, H)[0][:, 5:8]
    states = cut_bound.block_states(2, 3)
    for row in range(states.shape[0]):
        for col in range(states.shape[1]):
            block = keep[:, :, 2 * row : 2 * row + 2, 3 * col : 3 * col + 3]
            if states[row, col] == masks.STATE_EMPTY:
                assert not block.any(), (row, col)
            elif states[row, col] == masks.STATE_FULL:
                assert block.all(), (row, col)


def test_a_learned_bias_and_learned_slopes_keep_their_gradient_through_the_cut():
    slopes = masks.alibi_slopes(H).double().requires_grad_()
    table = rand(B, H, Q_LEN, K_LEN, seed=11).requires_grad_()
    whole = masks.alibi(slopes) & masks.bias(table)
    _, bias, _ = dense(whole.for_heads(2, 4, H), 4)
    bias.sum().backward()
    assert slopes.grad is not None and table.grad is not None
    heads = torch.zeros(H, dtype=torch.bool)
    heads[2:6] = True
    assert slopes.grad[heads].ne(0).all() and slopes.grad[~heads].eq(0).all()
    assert table.grad[:, heads].eq(1).all() and table.grad[:, ~heads].eq(0).all()


@pytest.mark.portable
@pytest.mark.parametrize("backend", ["reference", "tiled", "sdpa", "auto"])
def test_attention_over_a_head_slice_with_the_cut_mask_is_the_whole_call_on_those_heads(backend, device):
    q, k, v = make_qkv(b=B, h=H, g=H, i=Q_LEN, j=K_LEN, d=4, e=3, device=device)
    whole = (
        masks.causal()
        & masks.alibi(masks.alibi_slopes(H).to(device))
        & masks.bias(rand(B, H, Q_LEN, K_LEN, seed=12).to(device))
        & masks.custom(lambda b, h, q, kv: (kv <= q + h % 3) | (h >= 6))
    )
    ref = multihead.attention(q, k, v, mask=whole, backend="reference")
    for start, count in ((0, 4), (4, 4), (3, 2)):
        heads = slice(start, start + count)
        with tiny_blocks():
            out = multihead.attention(
                q[:, heads], k[:, heads], v[:, heads], mask=whole.for_heads(start, count, H), backend=backend
            )
        torch.testing.assert_close(out, ref[:, heads], atol=1e-12, rtol=0)


def test_the_transformers_typed_mask_holds_nothing_per_head():
    from multihead.integrations.transformers_masks import TransformersMask

    mask = TransformersMask(
        [masks.causal(), masks.padding(torch.tensor([7, 5]))], batch=B, q_length=Q_LEN, kv_length=K_LEN, device=CPU
    )
    assert mask.for_heads(2, 4, H) is mask
    assert torch.equal(dense(mask.for_heads(2, 4, H), 4)[0], dense(mask, H)[0][:, 2:6])


@pytest.mark.parametrize(
    "build, fragment",
    [
        (lambda: masks.alibi(masks.alibi_slopes(4)), "alibi(slopes): expected a head axis of size 8"),
        (lambda: masks.alibi(rand(B, 4).abs()), "alibi_slopes(8)"),
        (lambda: masks.alibi(rand(B, 1).abs()), "shape (2, 1), 1 along the head axis"),  # ALiBi shares no slope
        (
            lambda: aligned_alibi(rand(B, 4, Q_LEN).abs(), torch.zeros(1, Q_LEN, dtype=torch.long)),
            "alibi_slopes: expected",
        ),
        (
            lambda: masks.bias(rand(B, 4, Q_LEN, K_LEN)),
            "bias(tensor): expected a head axis of size 8 (all the query heads)",
        ),
        (lambda: masks.allowed(coin(4, Q_LEN, K_LEN)), "allowed(tensor): expected a head axis of size 8"),
        (lambda: masks.as_mask(rand(1, 4, Q_LEN, K_LEN)), "mask: expected a head axis of size 8"),
        (lambda: masks.selected(picks(B, 3, Q_LEN, 2)), "selected(indices): expected indexer heads s dividing the 8"),
        (lambda: masks.causal() & masks.bias(rand(B, 2, Q_LEN, K_LEN)), "bias(tensor): expected"),  # in a combination
    ],
)
def test_a_mask_built_for_other_heads_is_refused_naming_it_and_the_sizes(build, fragment):
    with pytest.raises(ValueError) as info:
        build().for_heads(4, 4, 8)
    assert is_input_error(info.value, ValueError)
    message = str(info.value)
    assert fragment in message, message
    assert "8 query heads" in message and "4 .. 7" in message


def test_local_slopes_on_a_rank_say_to_pass_the_global_heads_slopes():
    with pytest.raises(ValueError, match=r"got shape \(4,\), 4 along the head axis") as info:
        masks.alibi(masks.alibi_slopes(4)).for_heads(0, 4, 8)
    assert "pass the slopes of all 8 query heads of the layer, e.g. alibi_slopes(8), on every rank" in str(info.value)


@pytest.mark.parametrize(
    "args, kind, fragment",
    [
        ((-1, 2, 8), ValueError, "start=-1, count=2, total=8"),
        ((0, 0, 8), ValueError, "start=0, count=0, total=8"),
        ((6, 4, 8), ValueError, "start=6, count=4, total=8"),
        ((0, 1, 0), ValueError, "start=0, count=1, total=0"),
        ((0.0, 2, 8), TypeError, "for_heads(start): expected an int"),
        ((0, True, 8), TypeError, "for_heads(count): expected an int"),
        ((0, 2, "8"), TypeError, "for_heads(total): expected an int"),
    ],
)
def test_bad_head_ranges_are_refused(args, kind, fragment):
    for mask in (masks.causal(), masks.alibi(masks.alibi_slopes(8))):  # a mask with no per-head part too
        with pytest.raises(kind) as info:
            mask.for_heads(*args)
        assert is_input_error(info.value, kind)
        assert fragment in str(info.value), str(info.value)
