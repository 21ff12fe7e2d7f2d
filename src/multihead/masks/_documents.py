"""Packed documents: :func:`documents` by a document index per position or by ``cu_seqlens``, and its bound term.

Training packs several documents into one row to avoid padding; attention must not cross their boundaries. The
term keeps a (query, key) pair when both lie in the same document. Its blocks are classified from the documents'
spans, so a block-skipping kernel (tiled, flex) skips every block between two documents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from multihead._errors import bad_argument, describe
from multihead.masks._base import (
    ALIGNMENTS,
    AttentionShape,
    BlockGrid,
    BlockState,
    BoundTerm,
    Index,
    _moved,
    _on_cpu,
    _select,
    _states,
    host_readable,
)
from multihead.masks._mask import Mask

# The document of a query row with no key position (bottom-right alignment with more queries than keys): below
# every index a caller passes, so it matches no key.
_NO_DOCUMENT = torch.iinfo(torch.int64).min


class _Documents(Mask):
    """``ids`` (b, j) document indices, or ``bounds`` (d + 1,) cumulative lengths for one packed row."""

    kind = "documents"

    def __init__(self, ids: torch.Tensor | None, bounds: torch.Tensor | None, align: str):
        if align not in ALIGNMENTS:
            raise bad_argument(
                "documents(align=...)", f"one of {ALIGNMENTS}", repr(align), 'use "bottom_right" or "top_left"'
            )
        self.ids, self.bounds, self.align = ids, bounds, align

    def __repr__(self) -> str:
        given = f"ids={tuple(self.ids.shape)}" if self.ids is not None else f"cu_seqlens={self.bounds}"
        return f"documents({given}, align={self.align!r})"

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        ids = self.ids if self.ids is not None else self._ids_of_bounds(shape)
        if tuple(ids.shape) != (shape.batch, shape.k_len):
            raise bad_argument(
                "documents(ids)",
                f"shape (b, j) = ({shape.batch}, {shape.k_len}) (the call's batch and keys)",
                tuple(ids.shape),
                "give one document index per key position, for each batch row",
            )
        offset = shape.k_len - shape.q_len if self.align == "bottom_right" else 0
        host = ids if host_readable(ids) else None
        return _BoundDocuments(_moved("documents(ids)", ids, shape.device), offset, shape, host_ids=host)

    def _ids_of_bounds(self, shape: AttentionShape) -> torch.Tensor:
        """(1, j): the document of each key position, from the boundaries (checked against j where the host can
        read them; a device tensor's positions past its last boundary join its last document)."""
        assert self.bounds is not None
        if shape.batch != 1:
            raise bad_argument(
                "documents(cu_seqlens)",
                "a call of batch 1 (one packed row)",
                f"batch {shape.batch}",
                "pack the batch into one row, or pass documents(ids) with a row of indices per batch row",
            )
        if host_readable(self.bounds) and int(self.bounds[-1]) != shape.k_len:
            raise bad_argument(
                "documents(cu_seqlens)",
                f"a last boundary equal to the key length j = {shape.k_len}",
                int(self.bounds[-1]),
                "end cu_seqlens at the packed length",
            )
        positions = torch.arange(shape.k_len, device=self.bounds.device)
        return torch.bucketize(positions, self.bounds[1:], right=True)[None, :]


def documents(
    ids: torch.Tensor | Sequence[Sequence[int]] | None = None,
    *,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    align: str = "bottom_right",
) -> Mask:
    """Attend only within a document: a query sees the keys of its own document.

    Args:
        ids: (b, j) integer document index of each key position (any integers: equal means the same document).
            Query row r reads the document of its aligned key position (``align`` as for :func:`causal`:
            bottom-right puts row r at key position r + j - i); a row with no key position sees nothing.
        cu_seqlens: instead of ``ids``, for one packed row (batch 1): the documents' boundaries, FlashAttention's
            varlen layout: (d + 1,) non-decreasing integers from 0, document n holding positions
            cu_seqlens[n] .. cu_seqlens[n + 1] - 1; the last must be the key length j.
        align: "bottom_right" (the default) or "top_left".

    Combine with ``causal()``, ``window(...)``, ``alibi``, ``softcap`` and ``padding`` with ``&``. Indices known on
    the host (a CPU tensor, Python ints) let block-skipping kernels skip every block between documents; a device
    tensor is never read on the host, and its blocks are then masked pair by pair.

    Example:
        >>> m = documents(cu_seqlens=[0, 3, 5])             # two documents: positions 0-2 and 3-4
        >>> m.bind(AttentionShape(1, 1, 5, 5, torch.device("cpu"))).dense(torch.float32)[0][0, 0].int()
        tensor([[1, 1, 1, 0, 0],
                [1, 1, 1, 0, 0],
                [1, 1, 1, 0, 0],
                [0, 0, 0, 1, 1],
                [0, 0, 0, 1, 1]], dtype=torch.int32)
    """
    if (ids is None) == (cu_seqlens is None):
        raise bad_argument(
            "documents",
            "ids or cu_seqlens, one of them",
            "both" if ids is not None else "neither",
            "pass documents(ids) with a (b, j) index per position, or documents(cu_seqlens=boundaries)",
            kind=TypeError,
        )
    if cu_seqlens is not None:
        return _Documents(None, _checked_boundaries(cu_seqlens), align)
    return _Documents(
        _integer_tensor("documents(ids)", ids, 2, "a (b, j) integer tensor of document indices"), None, align
    )


def _integer_tensor(name: str, values: object, ndim: int, expected: str) -> torch.Tensor:
    """``values`` as an int64 tensor of ``ndim`` dimensions (on its own device), else an error naming ``name``."""
    if not isinstance(values, torch.Tensor):
        try:
            values = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError):
            raise bad_argument(name, expected, describe(values), "pass a tensor of ints", kind=TypeError) from None
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise bad_argument(name, expected, describe(values), "convert with .long()", kind=TypeError)
    if values.ndim != ndim:
        raise bad_argument(name, expected, describe(values), f"pass {ndim} dimension{'s' if ndim > 1 else ''}")
    return values.long()


def _checked_boundaries(cu_seqlens: object) -> torch.Tensor:
    """FlashAttention's cumulative lengths as an int64 tensor, checked where the host can read them."""
    bounds = _integer_tensor(
        "documents(cu_seqlens)", cu_seqlens, 1, "a (d + 1,) integer tensor of boundaries from 0 (FlashAttention's)"
    )
    if bounds.numel() < 2:
        raise bad_argument(
            "documents(cu_seqlens)", "at least two boundaries (0 and the length)", describe(bounds), "pass [0, n]"
        )
    if host_readable(bounds):
        if int(bounds[0]) != 0 or bool((bounds[1:] < bounds[:-1]).any()):
            raise bad_argument(
                "documents(cu_seqlens)",
                "non-decreasing boundaries starting at 0",
                bounds.tolist(),
                "pass the cumulative document lengths, e.g. [0, 3, 5]",
            )
    return bounds


class _BoundDocuments(BoundTerm):
    """Query row r (aligned key position p = r + offset) keeps key c when ids[b, p] == ids[b, c]. Block states
    come from each block's range of document indices (disjoint ranges: empty; one document on both sides: full),
    on the host from ``host_ids`` (a CPU tensor) and never from a device tensor. They are exact for documents in
    order (packed rows); with indices out of order a block whose ranges overlap is PARTIAL even if no pair of it
    shares a document."""

    kind = "documents"

    def __init__(self, ids: torch.Tensor, offset: int, shape: AttentionShape, *, host_ids: torch.Tensor | None):
        self.shape, self.offset = shape, offset
        self.key_ids = ids  # (b, j) on the call's device
        self.query_ids = _query_documents(ids, offset, shape.q_len)  # (b, i)
        self.host_ids = host_ids
        self._host_query_ids = None if host_ids is None else _query_documents(host_ids, offset, shape.q_len)
        self._spans: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (low, high) per batch row

    def rule(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        def same_document(b, h, q, k, queries=self.query_ids, keys=self.key_ids):
            return queries[b, q] == keys[b, k]

        return same_document

    def evaluate(self, rows: Index, cols: Index, heads: torch.Tensor | None) -> torch.Tensor:
        # (b, 1, rows, cols) by slicing and one comparison: no gather for torch.compile to specialise
        queries = _select(self.query_ids[:, None, :, None], 2, rows)
        return queries == _select(self.key_ids[:, None, None, :], 3, cols)

    def signature(self) -> tuple:
        return "documents", tuple(self.key_ids.shape), self.offset

    def spans(self) -> tuple[bool, bool, bool]:
        return True, False, True

    def _span(self, side: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The lowest and highest document index of positions start .. stop - 1 on one side, per batch row
        (CPU tensors), kept for the next block of the same span."""
        key = (side, start, stop)
        if key not in self._spans:
            assert self.host_ids is not None and self._host_query_ids is not None
            ids = (self._host_query_ids if side == "rows" else self.host_ids)[:, start:stop]
            self._spans[key] = (ids.amin(-1), ids.amax(-1))
        return self._spans[key]

    def span_state(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> BlockState:
        if self.host_ids is None or row_stop <= row_start or col_stop <= col_start:
            return BlockState.PARTIAL
        row_low, row_high = self._span("rows", row_start, row_stop)
        col_low, col_high = self._span("cols", col_start, col_stop)
        if bool(((row_high < col_low) | (row_low > col_high)).all()):
            return BlockState.EMPTY  # no batch row shares a document across the block
        one = (row_low == row_high) & (col_low == col_high) & (row_low == col_low)
        return BlockState.FULL if bool(one.all()) else BlockState.PARTIAL

    def surely_full(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> bool:
        if self.host_ids is None:
            return False
        return self.span_state(row_start, row_stop, col_start, col_stop) is BlockState.FULL

    def may_empty_rows(self) -> bool:
        # a row with an aligned key position shares its document with that key: only rows without one are empty
        return self.offset < 0 or self.shape.q_len + self.offset > self.shape.k_len

    def host_term(self) -> BoundTerm | None:
        if self.host_ids is None:
            return None
        return _BoundDocuments(self.host_ids, self.offset, _on_cpu(self.shape), host_ids=self.host_ids)

    def block_states(self, grid: BlockGrid) -> torch.Tensor:
        row_low, row_high = _block_range(self.query_ids, grid.q_blocks, grid.block_q)  # (b, q_blocks)
        col_low, col_high = _block_range(self.key_ids, grid.k_blocks, grid.block_k)  # (b, k_blocks)
        row_low, row_high = row_low[:, :, None], row_high[:, :, None]
        col_low, col_high = col_low[:, None, :], col_high[:, None, :]
        empty = ((row_high < col_low) | (row_low > col_high)).all(0)
        full = ((row_low == row_high) & (col_low == col_high) & (row_low == col_low)).all(0)
        return _states(empty, full)


def _query_documents(ids: torch.Tensor, offset: int, q_len: int) -> torch.Tensor:
    """(b, i): the document of each query row, read at its aligned key position; :data:`_NO_DOCUMENT` where that
    position is not a key."""
    positions = torch.arange(q_len, device=ids.device) + offset
    inside = (positions >= 0) & (positions < ids.shape[1])
    read = ids[:, positions.clamp(0, max(ids.shape[1] - 1, 0))] if ids.shape[1] else ids.new_zeros(ids.shape[0], q_len)
    return torch.where(inside, read, torch.full_like(read, _NO_DOCUMENT))


def _block_range(ids: torch.Tensor, blocks: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lowest and highest index in each block of ``block`` positions of ``ids`` (b, n): two (b, blocks)
    tensors (the last block padded with its own last index, which changes neither)."""
    padding = blocks * block - ids.shape[1]
    if padding:
        ids = torch.cat([ids, ids[:, -1:].expand(ids.shape[0], padding)], dim=1)
    tiles = ids.reshape(ids.shape[0], blocks, block)
    return tiles.amin(-1), tiles.amax(-1)
