"""masks.custom: masks written as functions of (b, h, q_idx, kv_idx), FlexAttention's mask_mod / score_mod model,
on every backend. Every built-in mask is one term with one mod and one block classifier; written again by hand as a
custom mask it gives the same outputs, gradients and block states on every backend. Document masking and prefix-LM,
the user functions flex's users write most, run everywhere against the reference."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import multihead
from multihead import masks
from multihead.backends import flex
from multihead.masks import STATE_EMPTY, AttentionShape, BlockState, bind_mask

pytestmark = pytest.mark.portable

B, H, D = 2, 3, 8
I, J = 37, 45  # noqa: E741 (unequal: bottom-right alignment offsets the query positions by J - I)
OFFSET = J - I
BACKWARD = ("reference", "tiled", "materialized", "sdpa")  # the backends that differentiate on every device
FORWARD = (*BACKWARD, "flex")  # flex's lowering is run unfused here (torch 2.13 has no CPU flex backward)


def inputs(device, i=I, j=J, grad=False):
    gen = torch.Generator().manual_seed(0)
    made = [torch.randn(B, H, n, D, generator=gen).to(device).requires_grad_(grad) for n in (i, j, j)]
    return made


def run(backend, q, k, v, mask):
    """The backend's output on (q, k, v) under ``mask``; flex unfused (its mods traced by vmap, not compiled)."""
    if backend == "flex":
        bound = bind_mask(mask, False, AttentionShape(B, H, q.shape[2], k.shape[2], q.device))
        out, _ = flex._run(q, k, v, mask=bound, scale=1 / math.sqrt(D), need_lse=False, compiled=False)
        return out
    return multihead.attention(q, k, v, mask=mask, backend=backend)


def summed_area(keep: torch.Tensor) -> torch.Tensor:
    """(i + 1, j + 1) counts of kept pairs above and left of each corner, over every batch row and head."""
    per_pair = keep.expand(B, H, -1, -1).sum((0, 1))
    padded = torch.nn.functional.pad(per_pair.cumsum(0).cumsum(1), (1, 0, 1, 0))
    return padded


def tensor_blocks(keep: torch.Tensor):
    """A block_mod for a keep tensor, as a user writes one: counts of kept pairs per block from a summed-area
    table (empty: none kept by any batch row or head; full: all kept by all)."""
    table, planes = summed_area(keep), B * H

    def block_mod(q_start, q_stop, kv_start, kv_stop):
        kept = table[q_stop, kv_stop] - table[q_start, kv_stop] - table[q_stop, kv_start] + table[q_start, kv_start]
        return kept == 0, kept == planes * (q_stop - q_start) * (kv_stop - kv_start)

    return block_mod


def built_in_pairs(device):
    """(name, built-in mask, the same written as a custom one)."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([J - 9, J]).to(device)
    valid = (torch.rand(B, J, generator=gen) > 0.3).to(device)
    valid[:, 0] = True
    keep = (torch.rand(B, 1, I, J, generator=gen) > 0.4).to(device)
    keep[..., 0] = True
    bias = torch.randn(B, H, I, J, generator=gen).to(device)
    bias[0, 1, 3, :20] = -math.inf
    slopes = masks.alibi_slopes(H).to(device)

    def valid_blocks(q_start, q_stop, kv_start, kv_stop):  # keys real in some / every batch row, per key block
        some = torch.nn.functional.pad(valid.any(0).long().cumsum(0), (1, 0))
        every = torch.nn.functional.pad(valid.all(0).long().cumsum(0), (1, 0))
        return some[kv_stop] == some[kv_start], every[kv_stop] - every[kv_start] == kv_stop - kv_start

    return [
        ("causal", masks.causal(), masks.custom(lambda b, h, q, kv: kv <= q + OFFSET, monotone=True)),
        ("causal top-left", masks.causal(align="top_left"), masks.custom(lambda b, h, q, kv: kv <= q, monotone=True)),
        (
            "window",  # a band: two monotone sides
            masks.window(5, 3),
            masks.custom(lambda b, h, q, kv: kv >= q + OFFSET - 5, monotone=True)
            & masks.custom(lambda b, h, q, kv: kv <= q + OFFSET + 3, monotone=True),
        ),
        ("padding lengths", masks.padding(lengths), masks.custom(lambda b, h, q, kv: kv < lengths[b], monotone=True)),
        ("padding valid", masks.padding(valid), masks.custom(lambda b, h, q, kv: valid[b, kv], block_mod=valid_blocks)),
        (
            "allowed",
            masks.allowed(keep),
            masks.custom(lambda b, h, q, kv: keep[b, 0, q, kv], block_mod=tensor_blocks(keep)),
        ),
        (
            "alibi",
            masks.alibi(slopes),
            masks.custom(score_mod=lambda b, h, q, kv: -slopes[h] * (kv - (q + OFFSET)).abs().to(torch.float32)),
        ),
        ("bias", masks.bias(bias), masks.custom(score_mod=lambda b, h, q, kv: bias[b, h, q, kv])),
        (
            "causal & alibi & padding",
            masks.causal() & masks.alibi(slopes) & masks.padding(lengths),
            masks.custom(lambda b, h, q, kv: (kv <= q + OFFSET) & (kv < lengths[b]), monotone=True)
            & masks.custom(score_mod=lambda b, h, q, kv: -slopes[h] * (kv - (q + OFFSET)).abs().to(torch.float32)),
        ),
    ]


PAIRS = [name for name, _, _ in built_in_pairs(torch.device("cpu"))]


@pytest.mark.parametrize("backend", FORWARD)
@pytest.mark.parametrize("pair", range(len(PAIRS)), ids=PAIRS)
def test_a_built_in_mask_written_as_functions_gives_the_same_output(device, pair, backend):
    name, built_in, written = built_in_pairs(device)[pair]
    q, k, v = inputs(device)
    assert torch.equal(run(backend, q, k, v, built_in), run(backend, q, k, v, written)), name


@pytest.mark.parametrize("backend", BACKWARD)
@pytest.mark.parametrize("pair", range(len(PAIRS)), ids=PAIRS)
def test_and_the_same_gradients(device, pair, backend):
    name, built_in, written = built_in_pairs(device)[pair]
    grads = []
    for mask in (built_in, written):
        q, k, v = inputs(device, grad=True)
        (multihead.attention(q, k, v, mask=mask, backend=backend) ** 2).sum().backward()
        grads.append([t.grad for t in (q, k, v)])
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("block", [(4, 4), (8, 16), (16, 8)])
@pytest.mark.parametrize("pair", range(len(PAIRS)), ids=PAIRS)
def test_and_the_same_skipped_blocks(device, pair, block):
    """The blocks the kernels skip: every tile at once (flex, auto's estimates) and tile by tile (tiled,
    materialized), on the CPU where a tile's state is read on the host."""
    name, built_in, written = built_in_pairs(device)[pair]
    shape = AttentionShape(B, H, I, J, device)
    ours, theirs = bind_mask(built_in, False, shape), bind_mask(written, False, shape)
    assert torch.equal(ours.block_states(*block), theirs.block_states(*block)), name
    if device.type == "cpu":
        rows, cols = block
        for r in range(0, I, rows):
            for c in range(0, J, cols):
                span = range(r, min(r + rows, I)), range(c, min(c + cols, J))
                assert ours.state(*span) is theirs.state(*span), (name, span)


def test_the_skipped_blocks_are_skipped_by_the_tiled_kernel(monkeypatch):
    """tiled asks each block's state and evaluates no pair of an empty one: a custom mask's mod is never called
    on those keys."""
    seen: list[tuple[int, int]] = []

    def causal(b, h, q, kv):
        seen.append((int(q.min()), int(kv.min())) if q.numel() > 2 else (-1, -1))
        return kv <= q

    q, k, v = inputs(torch.device("cpu"), i=256, j=256)
    multihead.attention(q, k, v, mask=masks.custom(causal, monotone=True), backend="tiled")
    blocks = [(row, col) for row, col in seen if row >= 0]
    assert blocks and all(col <= row for row, col in blocks)  # no block above the diagonal was evaluated


# --------------------------------------------------------------------------- what users write


def packed(device):
    """Documents of lengths 11, 20, 6 (row 0) and 30, 7 (row 1) packed into rows of 37 tokens."""
    ids = torch.tensor([[0] * 11 + [1] * 20 + [2] * 6, [0] * 30 + [1] * 7]).to(device)
    return ids


def document_mask(ids, *, causal: bool):
    """Same document (and causal within it), with a block_mod from the sorted document ids of each row."""

    def mask_mod(b, h, q, kv):
        same = ids[b, q] == ids[b, kv]
        return same & (kv <= q) if causal else same

    def block_mod(q_start, q_stop, kv_start, kv_stop):
        first_q, last_q = ids[:, q_start], ids[:, q_stop - 1]  # (b, q_blocks, 1): ids rise along a row
        first_kv, last_kv = ids[:, kv_start], ids[:, kv_stop - 1]
        apart = (last_q < first_kv) | (last_kv < first_q)
        one = (first_q == last_q) & (first_kv == last_kv) & (first_q == first_kv)
        if causal:
            one = one & (kv_stop - 1 <= q_start)
            apart = apart | (kv_start > q_stop - 1)
        return apart.all(0), one.all(0)

    return masks.custom(mask_mod, block_mod=block_mod)


def prefix_lm(prefix: torch.Tensor):
    """Bidirectional over each row's prefix, causal after it: monotone, so the corners settle every block."""
    return masks.custom(lambda b, h, q, kv: (kv <= q) | (kv < prefix[b]), monotone=True)


def dense_reference(q, k, v, keep):
    scores = (q @ k.mT) / math.sqrt(D)
    return torch.softmax(scores.masked_fill(~keep, -math.inf), -1) @ v


@pytest.mark.parametrize("backend", FORWARD)
@pytest.mark.parametrize("causal", [False, True])
def test_document_masking_on_every_backend(device, backend, causal):
    ids = packed(device)
    q, k, v = inputs(device, j=I)
    positions = torch.arange(I, device=device)
    keep = ids[:, None, :, None] == ids[:, None, None, :]
    if causal:
        keep = keep & (positions[None, :] <= positions[:, None])
    expected = dense_reference(q, k, v, keep)
    torch.testing.assert_close(run(backend, q, k, v, document_mask(ids, causal=causal)), expected)


def test_a_packed_row_equals_its_documents_run_alone(device):
    ids = packed(device)
    q, k, v = inputs(device, j=I)
    out = multihead.attention(q, k, v, mask=document_mask(ids, causal=True), backend="tiled")
    for row in range(B):
        for document in ids[row].unique().tolist():
            where = (ids[row] == document).nonzero().squeeze(1)
            alone = multihead.attention(*(t[row : row + 1, :, where] for t in (q, k, v)), causal=True)
            torch.testing.assert_close(out[row : row + 1, :, where], alone)


def test_the_document_blocks_between_documents_are_skipped(device):
    ids = packed(device)
    bound = bind_mask(document_mask(ids, causal=True), False, AttentionShape(B, H, I, I, device))
    states = bound.block_states(4).cpu()
    keep = (ids[:, None, :, None] == ids[:, None, None, :]).cpu() & torch.ones(I, I, dtype=torch.bool).tril()
    for r in range(states.shape[0]):
        for c in range(states.shape[1]):
            tile = keep[..., r * 4 : r * 4 + 4, c * 4 : c * 4 + 4]
            if states[r, c] == STATE_EMPTY:
                assert not tile.any()
    assert (states == STATE_EMPTY).float().mean() > 0.5  # above the diagonal and between documents


@pytest.mark.parametrize("backend", FORWARD)
def test_prefix_lm_on_every_backend(device, backend):
    prefix = torch.tensor([5, 17]).to(device)
    q, k, v = inputs(device, j=I)
    positions = torch.arange(I, device=device)
    keep = (positions[None, None, None, :] <= positions[None, None, :, None]) | (
        positions[None, None, None, :] < prefix[:, None, None, None]
    )
    torch.testing.assert_close(run(backend, q, k, v, prefix_lm(prefix)), dense_reference(q, k, v, keep))


@pytest.mark.parametrize("backend", BACKWARD)
def test_user_masks_differentiate_on_every_backend(device, backend):
    ids = packed(device)
    mask = document_mask(ids, causal=True) & prefix_lm(torch.tensor([5, 17]).to(device))
    grads = []
    for name in ("reference", backend):
        q, k, v = inputs(device, j=I, grad=True)
        (multihead.attention(q, k, v, mask=mask, backend=name) ** 2).sum().backward()
        grads.append([t.grad for t in (q, k, v)])
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_gradients_reach_a_table_the_score_mod_reads(device):
    """A T5-style learned relative-position bias: the score_mod indexes a (buckets, heads) table that requires
    grad; the table's gradient equals the one through the same bias built as a dense tensor."""
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(17, H, generator=gen).to(device).requires_grad_(True)

    def relative(b, h, q, kv):
        return table[(kv - q).clamp(-8, 8) + 8, h]

    grads = []
    for written in (True, False):
        table.grad = None
        q, k, v = inputs(device, j=I, grad=True)
        if written:
            mask = masks.custom(score_mod=relative)
        else:
            positions = torch.arange(I, device=device)
            buckets = (positions[None, :] - positions[:, None]).clamp(-8, 8) + 8  # (i, j)
            mask = masks.bias(table[buckets].permute(2, 0, 1)[None])  # (1, h, i, j)
        (multihead.attention(q, k, v, mask=mask) ** 2).sum().backward()
        grads.append([table.grad, q.grad, k.grad, v.grad])
    assert grads[0][0] is not None and grads[0][0].abs().sum() > 0
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_a_backend_that_cannot_differentiate_a_bias_says_so(device):
    table = torch.zeros(H, device=device, requires_grad=True)
    q, k, v = inputs(device, grad=True)
    with pytest.raises(ValueError, match="bias"):
        multihead.attention(q, k, v, mask=masks.custom(score_mod=lambda b, h, q, kv: table[h]), backend="tiled")


def test_one_compiled_flex_kernel_serves_a_closure_made_again():
    """The kernel is keyed by the function's code, not the function: a mask made again each step with new
    tensors (new document ids) reuses the compiled kernel."""
    shape = AttentionShape(B, H, I, I, torch.device("cpu"))
    first, second = (bind_mask(document_mask(packed("cpu") + n, causal=True), False, shape) for n in (0, 1))
    assert flex._structure(first) == flex._structure(second)


def test_flex_compiles_and_runs_a_user_mask():
    """Compiled, not only traced. (On the CPU, torch 2.13's inductor fails to compile a mod that reads a tensor
    by query position, as the document mask does: that call is refused with the compiler's reason, and auto then
    passes flex over; the unfused runs above check its lowering.)"""
    q, k, v = inputs(torch.device("cpu"), j=I)
    mask = prefix_lm(torch.tensor([5, 17]))
    torch.testing.assert_close(
        multihead.attention(q, k, v, mask=mask, backend="flex"), multihead.attention(q, k, v, mask=mask)
    )


# --------------------------------------------------------------------------- what is refused, and how


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: masks.custom(), TypeError, "a mask_mod, a score_mod or both"),
        (lambda: masks.custom("causal"), TypeError, "mask_mod: expected a function"),
        (lambda: masks.custom(lambda b, h, q: q), TypeError, "four arguments"),
        (lambda: masks.custom(score_mod=lambda score, b, h, q, kv: score), TypeError, "becomes"),
        (
            lambda: masks.custom(score_mod=lambda b, h, q, kv: q * 1.0, monotone=True),
            ValueError,
            "mask_mod to classify",
        ),
        (
            lambda: masks.custom(
                lambda b, h, q, kv: kv <= q, lambda *a: None, block_mod=lambda *a: None, monotone=True
            ),
            ValueError,
            "not both",
        ),
        (lambda: masks.custom(lambda b, h, q, kv: kv <= q, monotone="yes"), TypeError, "monotone"),
    ],
)
def test_a_wrong_custom_mask_is_refused_when_made(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_a_functions_arguments_are_read_once_per_code_and_defaults():
    """Closures made on every call (one code) are checked once; the same code with one default fewer, which then
    needs five arguments, is still refused, and so is a function that says another signature."""

    def made(*defaults):
        def mod(b, h, q, kv, extra):
            return kv <= q

        mod.__defaults__ = defaults or None
        return mod

    for _ in range(3):
        masks.custom(made(0))  # (b, h, q, kv) and a default
    with pytest.raises(TypeError, match="four arguments"):
        masks.custom(made())
    said = made(0)
    said.__signature__ = inspect.signature(lambda b, h, q: q)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="four arguments"):
        masks.custom(said)


@pytest.mark.parametrize(
    ("mask", "words"),
    [
        (masks.custom(lambda b, h, q, kv: (kv <= q) and (kv < 3)), "not and / or / if"),
        (masks.custom(lambda b, h, q, kv: kv - q), "a bool tensor"),
        (masks.custom(score_mod=lambda b, h, q, kv: kv < q), "a floating tensor"),
        (masks.custom(lambda b, h, q, kv: True), "a bool tensor"),
    ],
)
def test_a_wrong_function_is_named_when_the_mask_is_bound(device, mask, words):
    q, k, v = inputs(device)
    with pytest.raises(TypeError, match=words):
        multihead.attention(q, k, v, mask=mask)


def test_a_result_that_does_not_broadcast_is_named(device):
    q, k, v = inputs(device)
    mask = masks.custom(lambda b, h, q, kv: (kv <= q).reshape(-1) if q.numel() > 2 else kv <= q)
    with pytest.raises(ValueError, match="mask_mod: expected a result that broadcasts"):
        multihead.attention(q, k, v, mask=mask, backend="reference")


def test_a_block_mod_returning_something_else_is_named(device):
    q, k, v = inputs(device)
    mask = masks.custom(lambda b, h, q, kv: kv <= q, block_mod=lambda *bounds: bounds[0] < 0)
    with pytest.raises(TypeError, match="block_mod: expected a pair"):
        multihead.attention(q, k, v, mask=mask, backend="tiled")


def test_a_user_mask_is_never_read_on_a_device_tile_by_tile():
    """On a device, a tile's state would be read on the host (a sync): tiled and materialized evaluate the pairs
    instead; the vectorised states stay on the device."""
    bound = bind_mask(
        masks.custom(lambda b, h, q, kv: kv <= q, monotone=True),
        False,
        AttentionShape(B, H, I, J, torch.device("meta")),
    )
    assert bound.state(range(0, 4), range(20, 24)) is BlockState.PARTIAL
    assert bound.may_empty_rows()
