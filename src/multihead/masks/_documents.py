"""Packed documents: :func:`documents` by a document index per position or by ``cu_seqlens``, and its bound term.

Training packs several documents into one row to avoid padding; attention must not cross their boundaries. The
term keeps a (query, key) pair when both lie in the same document. Its blocks are classified from the documents'
spans, so a block-skipping kernel (tiled, flex) skips every block between two documents.
"""

from __future__ import annotations

import copy
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
    _positions,
    _select,
    _states,
    device_scalar,
    host_readable,
)
from multihead.masks._mask import Mask

# The document of a query row with no key position (bottom-right alignment with more queries than keys): below
# every index a caller passes, so it matches no key.
_NO_DOCUMENT = torch.iinfo(torch.int64).min


class DocumentsMask(Mask):
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
        on_device = _moved("documents(ids)", ids, shape.device)
        term = _aligned(on_device, offset, shape)
        host = _aligned(ids, offset, _on_cpu(shape)) if host_readable(ids) else None
        return _BoundDocuments(*term, shape, host=host, offset=offset)

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
        return DocumentsMask(None, _checked_boundaries(cu_seqlens), align)
    return DocumentsMask(
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


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at every document of packed rows: ``ids`` (b, n) document indices, each document one
    run of positions -> (b, n) int64, 0 at each document's first token (a new run starts wherever the index
    changes). Built by ops on ids' device, no value read: rotary or learned positions per document.

    Example:
        >>> document_positions(torch.tensor([[0, 0, 0, 1, 1, 2]]))
        tensor([[0, 1, 2, 0, 1, 0]])
    """
    ids = _integer_tensor("document_positions(ids)", ids, 2, "a (b, n) integer tensor of document indices")
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # each run's first index
    return index - first


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
    """Query row r keeps key c when both lie in one document, ``query_ids[b, r] == key_ids[b, c]``, and, with a
    ``band`` (left, right), when c lies within [p - left, p + right] of the row's aligned key position
    p = ``positions[b, r]`` (None: that side unbounded). Block states come from each block's ranges of document
    indices and positions (disjoint document ranges or the band past the block: empty; one document on both
    sides and the band over the whole block: full), on the host from ``host`` (CPU copies of the three tensors)
    and never from a device tensor. They are exact for documents in order (packed rows); with indices out of
    order a block whose ranges overlap is PARTIAL even if no pair of it shares a document."""

    kind = "documents"

    def __init__(
        self,
        key_ids: torch.Tensor,
        query_ids: torch.Tensor,
        positions: torch.Tensor,
        shape: AttentionShape,
        *,
        band: tuple[int | None, int | None] = (None, None),
        host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        offset: int | None = None,
    ):
        self.shape, self.band, self.host = shape, band, host
        self.offset = offset  # the positions are r + offset (one alignment for every row), or None
        self.key_ids, self.query_ids = key_ids, query_ids  # (b, j), (b, i) on the call's device
        self.positions = positions  # (b, i): each row's aligned key position
        self._spans: dict[tuple[str, int, int], tuple[torch.Tensor, ...]] = {}  # per batch row, kept per span

    def rule(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        left, right = self.band

        def same_document(b, h, q, k, queries=self.query_ids, keys=self.key_ids, at=self.positions):
            keep = queries[b, q] == keys[b, k]
            if right is not None:
                keep = keep & (k <= at[b, q] + right)
            return keep if left is None else keep & (k >= at[b, q] - left)

        return same_document

    def evaluate(self, rows: Index, cols: Index, heads: torch.Tensor | None) -> torch.Tensor:
        # (b, 1, rows, cols) by slicing and comparisons: no gather for torch.compile to specialise
        keep = _select(self.query_ids[:, None, :, None], 2, rows) == _select(self.key_ids[:, None, None, :], 3, cols)
        left, right = self.band
        if left is None and right is None:
            return keep
        at = _select(self.positions[:, None, :, None], 2, rows)
        keys = _positions(cols, self.shape.k_len, self.shape.device)[None, None, None, :]
        if right is not None:
            keep = keep & (keys <= at + right)
        return keep if left is None else keep & (keys >= at - left)

    def lifted(self) -> BoundTerm:
        """The band's bounds as 0-d tensors on the call's device: every band with the same unbounded sides shares
        one compiled kernel (:meth:`structure`), and no bound is compiled in."""
        lifted = copy.copy(self)
        left, right = (None if side is None else device_scalar(side, self.shape.device) for side in self.band)
        lifted.band = (left, right)  # type: ignore[assignment]  # what the mod reads: tensors in the lifted copy
        return lifted

    def structure(self) -> tuple:
        return self.kind, tuple(side is None for side in self.band)

    def signature(self) -> tuple:
        return "documents", tuple(self.key_ids.shape), tuple(self.query_ids.shape), self.band

    def spans(self) -> tuple[bool, bool, bool]:
        return True, False, True

    def _span(self, side: str, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """Per batch row, on the host: for query rows start .. stop - 1 (``side`` "rows") the lowest and highest
        document and aligned position, for keys (``side`` "cols") the lowest and highest document."""
        key = (side, start, stop)
        if key not in self._spans:
            assert self.host is not None
            key_ids, query_ids, positions = self.host
            if side == "rows":
                ids, at = query_ids[:, start:stop], positions[:, start:stop]
                self._spans[key] = (ids.amin(-1), ids.amax(-1), at.amin(-1), at.amax(-1))
            else:
                ids = key_ids[:, start:stop]
                self._spans[key] = (ids.amin(-1), ids.amax(-1))
        return self._spans[key]

    def span_state(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> BlockState:
        if self.host is None or row_stop <= row_start or col_stop <= col_start:
            return BlockState.PARTIAL
        query_low, query_high, at_low, at_high = self._span("rows", row_start, row_stop)
        key_low, key_high = self._span("cols", col_start, col_stop)
        empty, full = _classified(
            query_low, query_high, at_low, at_high, key_low, key_high, col_start, col_stop - 1, self.band
        )
        return BlockState.EMPTY if bool(empty.all()) else BlockState.FULL if bool(full.all()) else BlockState.PARTIAL

    def surely_full(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> bool:
        if self.host is None:
            return False
        return self.span_state(row_start, row_stop, col_start, col_stop) is BlockState.FULL

    def may_empty_rows(self) -> bool:
        # a row whose aligned position is a key shares its document with it: only rows without one are empty
        if self.offset is not None:  # rows offset .. i - 1 + offset: known without a value
            return self.offset < 0 or self.shape.q_len + self.offset > self.shape.k_len
        if self.host is None:
            return True
        return bool(((self.host[2] < 0) | (self.host[2] >= self.shape.k_len)).any())

    def row_key_spans(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        # documents in order (packed rows) hold consecutive keys; one run per row where every batch row is alike
        if self.host is None:
            return None
        key_ids, query_ids, positions = self.host
        if any(bool((t != t[:1]).any()) for t in self.host) or bool((key_ids[0, 1:] < key_ids[0, :-1]).any()):
            return None
        lo = torch.searchsorted(key_ids[0], query_ids[0], side="left")  # a row with no document: an empty run
        hi = torch.searchsorted(key_ids[0], query_ids[0], side="right")
        left, right = self.band
        if left is not None:
            lo = torch.maximum(lo, positions[0] - left)
        if right is not None:
            hi = torch.minimum(hi, positions[0] + right + 1)
        return lo, hi

    def host_term(self) -> BoundTerm | None:
        """This term over its host copies, on the CPU (a ragged term keeps its key spans, already there)."""
        if self.host is None:
            return None
        term = copy.copy(self)
        term.key_ids, term.query_ids, term.positions = self.host
        term.shape, term._spans = _on_cpu(self.shape), {}
        return term

    def block_states(self, grid: BlockGrid) -> torch.Tensor:
        query_low, query_high = _block_range(self.query_ids, grid.q_blocks, grid.block_q)  # (b, q_blocks)
        at_low, at_high = _block_range(self.positions, grid.q_blocks, grid.block_q)
        key_low, key_high = _block_range(self.key_ids, grid.k_blocks, grid.block_k)  # (b, k_blocks)
        first_key, last_key = grid.cols()
        empty, full = _classified(
            query_low[:, :, None],
            query_high[:, :, None],
            at_low[:, :, None],
            at_high[:, :, None],
            key_low[:, None, :],
            key_high[:, None, :],
            first_key[None, None, :],
            last_key[None, None, :] - 1,
            self.band,
        )
        return _states(empty.all(0), full.all(0))


class _BoundRaggedDocuments(_BoundDocuments):
    """Documents in order on both sides, each with its own alignment (varlen): a row is empty when its band
    leaves no key of its document's span, [first_key, last_key] per row (``key_span``, on the host)."""

    def __init__(self, *args, key_span: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.key_span = key_span  # (b, i) each row's document's first and last key, on the host

    def may_empty_rows(self) -> bool:
        if self.host is None or self.key_span is None:
            return True
        low, high = self.key_span
        left, right = self.band
        positions = self.host[2]
        if left is not None:
            low = torch.maximum(low, positions - left)
        if right is not None:
            high = torch.minimum(high, positions + right)
        return bool((low > high).any())


def _classified(
    query_low: torch.Tensor,
    query_high: torch.Tensor,
    at_low: torch.Tensor,
    at_high: torch.Tensor,
    key_low: torch.Tensor,
    key_high: torch.Tensor,
    first_key: int | torch.Tensor,
    last_key: int | torch.Tensor,
    band: tuple[int | None, int | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether a block of query rows (their documents and aligned positions from low to high) and keys
    first_key .. last_key (their documents from low to high) keeps no pair (empty) or every pair (full), per batch
    row (broadcast)."""
    left, right = band
    empty = (query_high < key_low) | (query_low > key_high)
    full = (query_low == query_high) & (key_low == key_high) & (query_low == key_low)
    if right is not None:
        empty, full = empty | (first_key > at_high + right), full & (last_key <= at_low + right)
    if left is not None:
        empty, full = empty | (last_key < at_low - left), full & (first_key >= at_high - left)
    return empty, full


def _aligned(ids: torch.Tensor, offset: int, shape: AttentionShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key_ids, query_ids, positions) of one alignment: row r at key position r + offset, and the document read
    there (:data:`_NO_DOCUMENT` where that position is not a key); each (b, i) a view or built by ops on ids'
    device."""
    positions = (torch.arange(shape.q_len, device=ids.device) + offset)[None, :].expand(ids.shape[0], shape.q_len)
    inside = (positions >= 0) & (positions < ids.shape[1])
    read = ids.gather(1, positions.clamp(0, max(ids.shape[1] - 1, 0))) if ids.shape[1] else torch.zeros_like(positions)
    return ids, torch.where(inside, read, torch.full_like(read, _NO_DOCUMENT)), positions


def _block_range(ids: torch.Tensor, blocks: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lowest and highest index in each block of ``block`` positions of ``ids`` (b, n): two (b, blocks)
    tensors (the last block padded with its own last index, which changes neither)."""
    padding = blocks * block - ids.shape[1]
    if padding:
        ids = torch.cat([ids, ids[:, -1:].expand(ids.shape[0], padding)], dim=1)
    tiles = ids.reshape(ids.shape[0], blocks, block)
    return tiles.amin(-1), tiles.amax(-1)


class _RaggedDocuments(Mask):
    """Packed documents of their own lengths on each side (FlashAttention's varlen): queries cu_q[n] .. cu_q[n+1]
    - 1 and keys cu_k[n] .. cu_k[n+1] - 1 form document n, aligned bottom-right within it (its last query at its
    last key), with a ``band`` (left, right) around each query's aligned key position: (None, 0) is causal within
    every document. Built by :func:`multihead.attention_varlen` (one packed row: batch 1)."""

    kind = "documents"

    def __init__(self, cu_q: torch.Tensor, cu_k: torch.Tensor, band: tuple[int | None, int | None]):
        self.cu_q, self.cu_k, self.band = cu_q, cu_k, band

    def __repr__(self) -> str:
        return f"ragged_documents({self.cu_q.numel() - 1} documents, band={self.band})"

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        on_device = _ragged(
            _moved("cu_seqlens_q", self.cu_q, shape.device), _moved("cu_seqlens_k", self.cu_k, shape.device), shape
        )
        host = None
        if host_readable(self.cu_q) and host_readable(self.cu_k):
            host = _ragged(self.cu_q.cpu(), self.cu_k.cpu(), _on_cpu(shape))
        return _bound_ragged(on_device, host, shape, self.band)


def _bound_ragged(
    on_device: tuple, host: tuple | None, shape: AttentionShape, band: tuple[int | None, int | None]
) -> BoundTerm:
    """The bound term of rows that each see one range of keys: ``on_device`` (key ids, query ids, positions, first
    key, last key), as built on the call's device, and ``host`` the same on the CPU where the boundaries are host
    readable (None: they are not), for the block classifier's key span."""
    key_ids, query_ids, positions = on_device[:3]
    return _BoundRaggedDocuments(
        key_ids,
        query_ids,
        positions,
        shape,
        band=band,
        host=None if host is None else (host[0], host[1], host[2]),
        key_span=None if host is None else (host[3], host[4]),
    )


def ragged_documents(cu_q: torch.Tensor, cu_k: torch.Tensor, band: tuple[int | None, int | None]) -> Mask:
    """The mask of :func:`multihead.attention_varlen`: see :class:`_RaggedDocuments` (boundaries checked by the
    caller)."""
    return _RaggedDocuments(cu_q, cu_k, band)


def ragged_rows(cu_q: torch.Tensor, cu_k: torch.Tensor, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed query row's document n and aligned key position, two (i,) int64 tensors by ops on the
    boundaries' device (both on one): row t of document n sits at key position t + cu_k[n + 1] - cu_q[n + 1], its
    document's last query at its last key (FlashAttention's bottom-right alignment within every document). What the
    varlen documents term and varlen's ALiBi (``masks.aligned_alibi``) both align by."""
    documents = cu_q.numel() - 1
    rows = torch.arange(q_len, device=cu_q.device)
    query_ids = torch.bucketize(rows, cu_q[1:], right=True).clamp(max=documents - 1)
    return query_ids, rows + cu_k[1:][query_ids] - cu_q[1:][query_ids]


def _ragged(cu_q: torch.Tensor, cu_k: torch.Tensor, shape: AttentionShape) -> tuple[torch.Tensor, ...]:
    """(key_ids (1, j), query_ids (1, i), positions (1, i), first_key (1, i), last_key (1, i)) by ops on the
    boundaries' device: query row t of document n sits at key position t + cu_k[n + 1] - cu_q[n + 1]."""
    keys = torch.arange(shape.k_len, device=cu_q.device)
    query_ids, positions = ragged_rows(cu_q, cu_k, shape.q_len)
    key_ids = torch.bucketize(keys, cu_k[1:], right=True)
    first_key, last_key = cu_k[:-1][query_ids], cu_k[1:][query_ids] - 1
    return tuple(t[None, :] for t in (key_ids, query_ids, positions, first_key, last_key))


class _KeyRanges(Mask):
    """Each batch row's own keys, ``first[b]`` .. ``end[b] - 1``, its queries aligned bottom-right at its end (query t
    at key position end[b] - i + t, :func:`key_range_positions`), with a ``band`` (left, right) around that position:
    one document per row, as varlen has one per packed span. FlashAttention's KV-cache call, whose rows hold keys
    cache_leftpad[b] .. cache_seqlens[b] + new - 1 of one cache length. Built by :func:`key_ranges`."""

    kind = "documents"

    def __init__(self, first: torch.Tensor, end: torch.Tensor, band: tuple[int | None, int | None]):
        self.first, self.end, self.band = first, end, band

    def __repr__(self) -> str:
        return f"key_ranges({self.first.numel()} rows, band={self.band})"

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        for name, t in (("key_ranges(first)", self.first), ("key_ranges(end)", self.end)):
            if tuple(t.shape) != (shape.batch,):
                raise bad_argument(name, f"shape (b,) = ({shape.batch},)", tuple(t.shape), "give one per batch row")
        moved = (
            _moved("key_ranges(first)", self.first, shape.device),
            _moved("key_ranges(end)", self.end, shape.device),
        )
        on_device = _key_ranges(*moved, shape)
        host = None
        if host_readable(self.first) and host_readable(self.end):
            host = _key_ranges(self.first.long(), self.end.long(), _on_cpu(shape))
        return _bound_ragged(on_device, host, shape, self.band)


def key_ranges(first: torch.Tensor, end: torch.Tensor, band: tuple[int | None, int | None]) -> Mask:
    """The mask of :func:`multihead.paged.attention_with_kvcache`: see :class:`_KeyRanges`; ``first`` and ``end``
    (b,) integer tensors, checked by the caller (0 <= first <= end)."""
    return _KeyRanges(first, end, band)


def key_range_positions(end: torch.Tensor, q_len: int) -> torch.Tensor:
    """(b, i) int64: the aligned key position of each batch row's queries when the row's keys end at ``end[b]``
    ((b,)): query t at end[b] - i + t, its last query at its last key; by ops on end's device."""
    return end.long()[:, None] - q_len + torch.arange(q_len, device=end.device)


def _key_ranges(first: torch.Tensor, end: torch.Tensor, shape: AttentionShape) -> tuple[torch.Tensor, ...]:
    """(key_ids (b, j): 0 for a row's own keys, -1 for the rest; query_ids (b, i): 0; positions (b, i); first_key
    and last_key (b, i): the row's own key span) by ops on the tensors' device."""
    b, i = shape.batch, shape.q_len
    first, end = first.long(), end.long()
    keys = torch.arange(shape.k_len, device=first.device)
    inside = (keys[None, :] >= first[:, None]) & (keys[None, :] < end[:, None])  # (b, j)
    key_ids = inside.long() - 1
    query_ids = torch.zeros(b, i, dtype=torch.long, device=first.device)
    positions = key_range_positions(end, i)
    return key_ids, query_ids, positions, first[:, None].expand(b, i), (end - 1)[:, None].expand(b, i)
