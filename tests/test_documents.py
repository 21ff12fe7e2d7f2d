"""masks.documents: packed documents. The packed batch equals running each document alone, forward and backward, on
every backend; cu_seqlens and indices give the same mask; the blocks between documents are skipped without being
built; bad indices are named. (Every backend against the reference, documents alone and combined with causal,
padding and ALiBi: test_backends.py; its block states: test_block_states.py.)"""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch

from multihead import attention, masks
from multihead.masks import STATE_EMPTY, STATE_FULL, AttentionShape, bind_mask
from support import is_input_error, tiny_blocks

pytestmark = pytest.mark.portable

BACKENDS = ["reference", "sdpa", "tiled", "materialized", "flex"]


def random_lengths(n: int, seed: int) -> list[int]:
    """Document lengths summing to n, from 1 up (a one-token document is a corner of its own)."""
    generator = torch.Generator().manual_seed(seed)
    cuts = sorted(set((torch.randperm(n - 1, generator=generator)[: 1 + seed % 5] + 1).tolist()))
    bounds = [0, *cuts, n]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("band", ["causal", "window", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_packed_row_equals_each_document_alone_forward_and_backward(backend, band, seed, device):
    dtype = torch.float32 if backend == "flex" else torch.float64
    n, h, d = 23, 4, 8
    lengths = random_lengths(n, seed)
    generator = torch.Generator().manual_seed(100 + seed)
    q, k, v = (torch.randn(1, h, n, d, generator=generator, dtype=dtype).to(device) for _ in range(3))
    dout = torch.randn(1, h, n, d, generator=generator, dtype=dtype).to(device)
    extra = {"causal": masks.causal(), "window": masks.window(3, 2), "none": None}[band]
    packed = masks.documents(cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))
    mask = packed if extra is None else packed & extra
    backward = not (backend == "flex" and device.type == "cpu")  # FlexAttention has no CPU backward (torch 2.13)
    leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
    out = attention(*leaves, mask=mask, backend=backend)
    if backward:
        out.backward(dout)
    start = 0
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    for length in lengths:
        part = slice(start, start + length)
        alone = [t[:, :, part].detach().clone().requires_grad_(True) for t in (q, k, v)]
        expected = attention(*alone, mask=extra, backend="reference")
        expected.backward(dout[:, :, part])
        torch.testing.assert_close(out[:, :, part], expected, atol=tolerance, rtol=0)
        for leaf, single in zip(leaves if backward else [], alone, strict=False):
            torch.testing.assert_close(leaf.grad[:, :, part], single.grad, atol=tolerance, rtol=0)
        start += length


def test_boundaries_and_indices_are_the_same_mask(device):
    shape = AttentionShape(1, 2, 9, 9, device)
    by_bounds = bind_mask(masks.documents(cu_seqlens=[0, 2, 2, 7, 9]), False, shape).dense(torch.float32)[0]
    ids = torch.tensor([[0, 0, 2, 2, 2, 2, 2, 3, 3]], device=device)  # an empty document numbers past itself
    by_ids = bind_mask(masks.documents(ids), False, shape).dense(torch.float32)[0]
    assert torch.equal(by_bounds.expand(1, 2, 9, 9), by_ids.expand(1, 2, 9, 9))
    assert int(by_ids.sum()) == 4 + 25 + 4


def test_a_query_after_its_keys_reads_its_documents_at_its_aligned_position(device):
    # decoding the last 2 positions of a packed row of 6 (bottom-right): each query sees its own document's keys
    ids = torch.tensor([[0, 0, 0, 1, 1, 1]], device=device)
    keep = bind_mask(masks.documents(ids) & masks.causal(), False, AttentionShape(1, 1, 2, 6, device)).dense(
        torch.float32
    )[0]
    assert keep[0, 0].int().tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    # more queries than keys: the rows before the first key have no document, and see nothing
    shape = AttentionShape(1, 1, 4, 2, device)
    bound = bind_mask(masks.documents(torch.tensor([[5, 5]], device=device)), False, shape)
    assert bound.dense(torch.float32)[0][0, 0].int().tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]
    assert bound.may_empty_rows()


def test_the_blocks_between_documents_are_skipped_unbuilt():
    # four documents of 8 over 4 x 4 tiles: tiles inside a document are full, the others empty; the tiled kernel
    # visits only the tiles inside documents, builds a keep mask for none of them, and with causal only for the
    # tiles on the diagonal
    ids = (torch.arange(32) // 8)[None]
    states = bind_mask(masks.documents(ids), False, AttentionShape(1, 2, 32, 32, torch.device("cpu"))).block_states(4)
    inside = (torch.arange(8) // 2)[:, None] == (torch.arange(8) // 2)[None, :]
    assert torch.equal(states, torch.where(inside, STATE_FULL, STATE_EMPTY).to(torch.int8))
    visited: list[tuple[int, int, bool]] = []  # (first row, first key, whether a keep mask was built)
    block = masks.BoundMask.block

    def recording(self, rows, cols, *args, **kwargs):
        keep, bias = block(self, rows, cols, *args, **kwargs)
        visited.append((rows.start, cols.start, keep is not None))
        return keep, bias

    q = k = v = torch.randn(1, 2, 32, 8, dtype=torch.float64)
    with tiny_blocks(4, 4), patch.object(masks.BoundMask, "block", recording):
        attention(q, k, v, mask=masks.documents(ids), backend="tiled")
        assert all(r // 8 == c // 8 for r, c, _ in visited) and not any(built for *_, built in visited)
        assert len({(r, c) for r, c, _ in visited}) == 16  # 4 documents x 2 x 2 tiles
        visited.clear()
        attention(q, k, v, mask=masks.documents(ids), causal=True, backend="tiled")
        assert {(r, c) for r, c, built in visited if built} == {(r, r) for r in range(0, 32, 4)}


@pytest.mark.parametrize(
    "arguments, kind, fragment",
    [
        ({}, TypeError, "documents: expected ids or cu_seqlens, one of them, got neither"),
        ({"ids": [[0, 0]], "cu_seqlens": [0, 2]}, TypeError, "got both"),
        ({"ids": [[0.0, 1.0]]}, TypeError, "documents(ids): expected a (b, j) integer tensor"),
        ({"ids": [0, 1]}, ValueError, "documents(ids): expected a (b, j) integer tensor"),
        ({"cu_seqlens": [1, 4]}, ValueError, "non-decreasing boundaries starting at 0"),
        ({"cu_seqlens": [0, 3, 2, 4]}, ValueError, "non-decreasing boundaries starting at 0"),
        ({"cu_seqlens": [0]}, ValueError, "at least two boundaries"),
        ({"ids": [[0, 0]], "align": "left"}, ValueError, "documents(align=...)"),
    ],
)
def test_bad_documents_are_named(arguments, kind, fragment):
    with pytest.raises(kind) as raised:
        masks.documents(**arguments)
    assert is_input_error(raised.value, kind) and fragment in str(raised.value)


@pytest.mark.parametrize(
    "mask, b, fragment",
    [
        (masks.documents(cu_seqlens=[0, 3, 5]), 1, "a last boundary equal to the key length j = 6"),
        (masks.documents(cu_seqlens=[0, 3, 6]), 2, "a call of batch 1 (one packed row)"),
        (masks.documents(torch.zeros(1, 5, dtype=torch.long)), 1, "shape (b, j) = (1, 6)"),
    ],
)
def test_documents_that_do_not_fit_the_call_are_named(mask, b, fragment):
    q = k = v = torch.randn(b, 2, 6, 4)
    with pytest.raises(ValueError) as raised:
        attention(q, k, v, mask=mask)
    assert is_input_error(raised.value, ValueError) and fragment in str(raised.value)
