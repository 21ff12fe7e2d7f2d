"""masks.selected: sparse-index attention (each query sees only the keys, or key blocks, picked for it) on every
backend against a keep tensor built here by hand, combined with causal, with indexer heads over GQA groups, -1
slots, and the errors."""

from __future__ import annotations

import pytest
import torch

from multihead import masks
from multihead.functional import attention_result
from support import is_input_error, make_qkv, tiny_blocks

BATCH, HEADS, ROWS, KEYS = 2, 4, 5, 7


def by_hand(indices: torch.Tensor, block_size: int = 1) -> torch.Tensor:
    """(b, s|1, i, j) keep: key c is picked for (b, s, r) when c // block_size is among indices[b, s, r]."""
    indices = indices if indices.ndim == 4 else indices.unsqueeze(1)
    keep = torch.zeros(*indices.shape[:3], KEYS, dtype=torch.bool)
    for b, s, r in torch.cartesian_prod(*(torch.arange(n) for n in indices.shape[:3])).tolist():
        for c in range(KEYS):
            keep[b, s, r, c] = (c // block_size) in indices[b, s, r].tolist()
    return keep


def picks(*shape, high, seed=0) -> torch.Tensor:
    picked = torch.randint(-1, high, shape, generator=torch.Generator().manual_seed(seed))
    picked[0, ..., 0, :] = -1  # a row that picked nothing: output 0
    return picked


@pytest.mark.portable
@pytest.mark.parametrize("backend", ["reference", "tiled", "materialized", "sdpa", "auto"])
@pytest.mark.parametrize("layout", ["per-query", "per-indexer-head", "blocks"])
def test_each_query_attends_only_its_picked_keys(backend, layout, device):
    q, k, v = make_qkv(b=BATCH, h=HEADS, g=2, i=ROWS, j=KEYS, d=6, e=3, device=device)
    if layout == "per-query":
        indices, block_size, keep = picks(BATCH, ROWS, 3, high=KEYS), 1, None
    elif layout == "per-indexer-head":  # 2 indexer heads, each for 2 query heads
        indices, block_size, keep = picks(BATCH, 2, ROWS, 3, high=KEYS), 1, None
    else:
        indices, block_size, keep = picks(BATCH, ROWS, 2, high=3), 3, None
    keep = by_hand(indices, block_size)
    if keep.shape[1] > 1:
        keep = keep.repeat_interleave(HEADS // keep.shape[1], dim=1)
    causal = torch.ones(ROWS, KEYS, dtype=torch.bool).tril(KEYS - ROWS)
    mask = masks.selected(indices.to(device), block_size=block_size) & masks.causal()
    with tiny_blocks():
        got = attention_result(q, k, v, mask=mask, backend=backend, return_lse=backend in ("reference", "tiled"))
    expected = attention_result(q, k, v, mask=(keep & causal).to(device), backend="reference", return_lse=True)
    torch.testing.assert_close(got.output, expected.output, atol=1e-12, rtol=0)
    assert got.output[0, :, 0].eq(0).all()  # the row that picked nothing


@pytest.mark.parametrize(
    "call, kind, fragment",
    [
        (lambda: masks.selected(torch.zeros(BATCH, ROWS, 2)), TypeError, "indices: expected an integer tensor"),
        (lambda: masks.selected(torch.zeros(BATCH, 2, dtype=torch.long)), ValueError, "indices: expected 3 or 4 dims"),
        (lambda: masks.selected(torch.zeros(BATCH, ROWS, 2, dtype=torch.long), block_size=0), ValueError, "block_size"),
        (
            lambda: masks.selected(torch.full((BATCH, ROWS, 1), KEYS)),
            ValueError,
            r"indices: expected entries in \[0, 7\)",
        ),
        (lambda: masks.selected(torch.zeros(BATCH, ROWS + 1, 1, dtype=torch.long)), ValueError, r"\(b, i\) = \(2, 5\)"),
        (lambda: masks.selected(torch.zeros(BATCH, 3, ROWS, 1, dtype=torch.long)), ValueError, "s dividing the 4"),
    ],
    ids=["float", "2-d", "block-size", "past-the-keys", "rows", "indexer-heads"],
)
def test_bad_indices_are_named(call, kind, fragment):
    q, k, v = make_qkv(b=BATCH, h=HEADS, g=2, i=ROWS, j=KEYS, d=6, e=3)
    with pytest.raises(kind, match=fragment) as raised:
        attention_result(q, k, v, mask=call())
    assert is_input_error(raised.value, kind)
