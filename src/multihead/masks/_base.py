"""What every mask term stands on: block grids and states, the call's shape, positions, moving small tensors to
the device without waiting for it, and :class:`BoundTerm`, a term bound to one call's sizes."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch

from multihead._errors import bad_argument

ALIGNMENTS = ("bottom_right", "top_left")


class BlockState(enum.Enum):
    """What a mask does to a block of (query, key) pairs."""

    EMPTY = "empty"  # every pair masked: the block can be skipped
    FULL = "full"  # every pair allowed: the block needs no boolean mask
    PARTIAL = "partial"  # must be evaluated element by element


# A grid of block states as one tensor (BoundMask.block_states): ordered so that combining keep terms is a minimum
STATE_EMPTY, STATE_PARTIAL, STATE_FULL = 0, 1, 2


@dataclass(frozen=True)
class BlockGrid:
    """The block_q x block_k tiles of an i x j call, on ``device``: q_blocks rows of tiles and k_blocks columns, the
    last tile of each side cut at i or j."""

    block_q: int
    block_k: int
    q_len: int
    k_len: int
    device: torch.device

    @property
    def q_blocks(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def k_blocks(self) -> int:
        return -(-self.k_len // self.block_k)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(start, stop) of each row of tiles: two (q_blocks,) tensors."""
        start = torch.arange(self.q_blocks, device=self.device) * self.block_q
        return start, (start + self.block_q).clamp(max=self.q_len)

    def cols(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(start, stop) of each column of tiles: two (k_blocks,) tensors."""
        start = torch.arange(self.k_blocks, device=self.device) * self.block_k
        return start, (start + self.block_k).clamp(max=self.k_len)

    def filled(self, state: int) -> torch.Tensor:
        return torch.full((self.q_blocks, self.k_blocks), state, dtype=torch.int8, device=self.device)


def _tiled(values: torch.Tensor, grid: BlockGrid, fill: bool, reduce: str) -> torch.Tensor:
    """``values`` (i|1, j|1) bool reduced ("any" or "all") over each tile of ``grid``: (q_blocks, k_blocks)."""
    by_cols = _per_block(values, grid.k_blocks, grid.block_k, fill, reduce)  # (i|1, k_blocks)
    return _per_block(by_cols.mT, grid.q_blocks, grid.block_q, fill, reduce).mT


def _states(empty: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """STATE_EMPTY where ``empty``, STATE_FULL where ``full``, else STATE_PARTIAL: int8, broadcast."""
    return torch.where(empty, STATE_EMPTY, torch.where(full, STATE_FULL, STATE_PARTIAL)).to(torch.int8)


def _per_block(values: torch.Tensor, blocks: int, block: int, fill: bool, reduce: str) -> torch.Tensor:
    """``values`` (..., n) bool reduced ("any" or "all") over each block of ``block`` along its last axis:
    (..., blocks); a last axis of size 1 (broadcast) gives its value to every block. ``fill`` pads the last block."""
    n = values.shape[-1]
    if n == 1:
        return values.expand(*values.shape[:-1], blocks)
    padding = blocks * block - n
    if padding:
        values = torch.cat([values, values.new_full((*values.shape[:-1], padding), fill)], dim=-1)
    tiles = values.reshape(*values.shape[:-1], blocks, block)
    return tiles.any(-1) if reduce == "any" else tiles.all(-1)


@dataclass(frozen=True)
class AttentionShape:
    """The sizes a mask is bound to: batch b, query heads h, query length i, key length j."""

    batch: int
    heads: int
    q_len: int
    k_len: int
    device: torch.device


Index = slice | torch.Tensor  # a range of positions, or a 1-D LongTensor of them


def _moved(name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A mask's small tensor (lengths, slopes) on the call's device: moved for convenience, except from the
    meta device, which has no values to move."""
    if t.device.type == "meta" and device.type != "meta":
        raise bad_argument(
            name,
            f"a tensor with values, on {device} (the device of q)",
            f"one on {t.device}",
            f"build it on {device}, or call attention on meta tensors throughout",
        )
    return to_device(t, device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t.to(device)`` without a blocking copy from the host: a CPU tensor goes to a CUDA device through pinned
    memory, non-blocking. A plain ``.to("cuda")`` of a CPU tensor waits for the device (cudaMemcpy, then a stream
    sync), and so does a non-blocking one from pageable memory; from pinned memory the copy is queued on the stream
    like any kernel, and torch's pinned-memory cache keeps the buffer until the copy has run. A tensor that needs
    its gradient takes the plain copy (pinning is not recorded by autograd on every torch)."""
    if t.device.type == "cpu" and device.type == "cuda" and not t.requires_grad and host_readable(t):
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def device_scalar(value: float, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A 0-d tensor of ``value`` on ``device``, sent there without waiting for it (:func:`to_device`): a
    ``torch.tensor(value, device="cuda")`` is a blocking copy from the host on every call."""
    return to_device(torch.tensor(value, dtype=dtype), device)


def is_fake(t: torch.Tensor) -> bool:
    """Whether t is a fake tensor (FakeTensorMode, torch.export): shapes and no values to read."""
    return _is_fake is not None and bool(_is_fake(t))


try:  # private, but the one way to tell a fake tensor from a real one
    from torch._subclasses.fake_tensor import is_fake as _is_fake
except ImportError:  # pragma: no cover - another torch
    _is_fake = None  # type: ignore[assignment]


def host_readable(t: torch.Tensor) -> bool:
    """Whether t's values can be read on the host without waiting for a device: a real CPU tensor, outside
    torch.compile's tracing. A CUDA tensor is never read (``.tolist()`` and ``bool(...)`` wait for every kernel
    queued before them: a device sync on the hot path); neither is one of the meta device or a fake tensor
    (FakeTensorMode, torch.export: shapes without values), nor any while torch.compile traces (reading a value
    would break the graph). Code that cannot read a value answers conservatively instead."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and not is_fake(t)


Span = range | slice  # consecutive positions start .. stop - 1 (a slice here has step 1 and int bounds)


def _span(index: slice, size: int) -> tuple[int, int] | None:
    """(start, stop) of a slice of consecutive positions, or None for a slice with a step.

    Read without ``slice.indices`` or ``range`` for the common slices: both force a symbolic size to a
    constant, which under torch.compile would pin every sequence length.
    """
    if index.step not in (None, 1):
        return None
    if (index.start is None or index.start >= 0) and (index.stop is None or index.stop >= 0):
        return 0 if index.start is None else index.start, size if index.stop is None else min(index.stop, size)
    start, stop, _ = index.indices(size)
    return start, stop


def _positions(index: Index, size: int, device: torch.device) -> torch.Tensor:
    if isinstance(index, slice):
        span = _span(index, size)
        return torch.arange(*(index.indices(size) if span is None else span), device=device)
    return index


def _select(t: torch.Tensor, dim: int, index: Index | None) -> torch.Tensor:
    """Index a broadcastable dim: size-1 dims stay as they are."""
    if index is None or t.shape[dim] == 1:
        return t
    if isinstance(index, slice):
        return t[(slice(None),) * dim + (index,)]
    return t.index_select(dim, index)


class BoundTerm:
    """One mask term bound to a call's sizes, said once: :meth:`mod` is what it means for every (batch row, head,
    query, key) and :meth:`block_states` how it classifies blocks of pairs. Every backend reads these two: the
    reference and SDPA densely, tiled and materialized a block at a time (:meth:`evaluate` calls the mod on the
    block's positions), flex by passing the mod through as FlexAttention's ``mask_mod`` or inside its
    ``score_mod`` (:meth:`lifted`)."""

    kind = "term"  # its name in BoundMask.kinds()
    is_bias = False
    requires_grad = False
    may_hold_minus_inf = False  # a bias term with -inf entries (pairs it masks)
    holds_data = True  # its meaning depends on tensor values, not only on sizes (padding, tensors, user functions)
    # it keeps the same pairs in a block moved along the diagonal (rows and keys shifted alike): it depends on the
    # query's position minus the key's alone (a band)
    shift_invariant = False
    # its mod reads a tensor by query position (a dense tensor; ALiBi's own position or slopes per row): torch 2.13's
    # CPU flex fails to compile it, and refuses it
    reads_pair_tensor = False

    def rule(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """The term's meaning as a function of batch rows ``b``, heads ``h``, query positions ``q`` and key
        positions ``k`` (int64 tensors that broadcast together: 0-d under FlexAttention's vmap, or shaped
        (b, 1, 1, 1), (1, h, 1, 1), (1, 1, rows, 1), (1, 1, 1, cols) for a block), giving keep (bool, True = may
        attend) or the bias added to the score (float). Queries count from 0 at the call's first query, keys from
        0. A plain function holding its values (as default arguments): flex hands it to torch.compile, whose CPU
        code generation (torch 2.13) fails on some masks read through a bound method's ``self``."""
        raise TypeError(f"{type(self).__name__} has no rule")

    def mod(self, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """:meth:`rule` applied to (b, h, q, k)."""
        return self.rule()(b, h, q, k)

    def lifted(self) -> BoundTerm:
        """This term with the numbers its mod reads (offsets, bounds) as 0-d tensors on the call's device, for a
        compiled kernel (FlexAttention) that must serve every length: a Python number would be compiled in."""
        return self

    def structure(self) -> tuple:
        """What of this term changes a compiled kernel's code: its kind and how its tensors broadcast, no value."""
        return (self.kind,)

    def signature(self) -> tuple:
        """This term's part of :meth:`BoundMask.signature`: its kind and numbers, no tensor values."""
        return (self.kind,)

    def spans(self) -> tuple[bool, bool, bool]:
        """Whether its values vary along the batch, the heads and the query rows: the (.., j) tensor it evaluates
        to has b, h, i there (1 elsewhere). A user's function is taken to vary along all three."""
        return True, True, True

    def state(self, rows: Span, cols: Span) -> BlockState:
        """What this term does to the block of query positions ``rows`` and key positions ``cols``."""
        return self.span_state(rows.start, rows.stop, cols.start, cols.stop)

    def span_state(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> BlockState:
        return BlockState.PARTIAL

    def surely_full(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> bool:
        """Whether this term keeps every pair of the block, provably: for symbolic sizes (torch.compile,
        torch.export) only what holds for every size, so that asking never pins a length."""
        return False

    def evaluate(self, rows: Index, cols: Index, heads: torch.Tensor | None) -> torch.Tensor:
        """A bool (keep) or float (bias) tensor broadcastable to (b, h_sel, rows, cols): the mod on those
        positions (``heads``: the selected query heads, None for all)."""
        return _as_4d(self.mod(*_block_indices(self.shape, rows, cols, heads)))

    def evaluate_in(
        self, rows: Index, cols: Index, heads: torch.Tensor | None, dtype: torch.dtype | None
    ) -> torch.Tensor:
        """A bias term's :meth:`evaluate` in ``dtype`` (None: its own), rounded once from its own dtype."""
        part = self.evaluate(rows, cols, heads)
        return part if dtype is None else part.to(dtype)

    def may_empty_rows(self) -> bool:
        """Whether some query row may have every key masked by this term; answered without waiting for a device."""
        return False

    def block_states(self, grid: BlockGrid) -> torch.Tensor:
        """What this keep term does to each tile of ``grid``: (q_blocks, k_blocks) int8 on the grid's device
        (STATE_EMPTY / STATE_PARTIAL / STATE_FULL), from whole-tensor operations: no loop over tiles, no host read.
        By default every tile is evaluated."""
        return grid.filled(STATE_PARTIAL)

    def host_term(self) -> BoundTerm | None:
        """This term evaluated on the CPU from values known on the host (for :meth:`BoundMask.may_empty_rows`),
        or None where its values live only on a device."""
        return None

    def merged(self, other: BoundTerm) -> BoundTerm | None:
        """One term meaning this one and ``other`` together, when this kind can say both at once (two bands of one
        alignment are one band); None otherwise. :class:`BoundMask` folds its terms with it."""
        return None

    def key_bounds(self, position: int) -> tuple[float, float] | None:
        """[lo, hi]: the keys this term lets query row ``position`` see in every batch row and head, known by
        arithmetic on the host (a band, key lengths given as ints); None where only its values would tell."""
        return None

    def row_key_spans(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where this term keeps, for every query row, one run of consecutive keys, the same in every batch row
        and head: (lo, hi), two (i,) int64 CPU tensors, row r keeping keys lo[r] .. hi[r] - 1 (none where hi[r] <=
        lo[r]), in [0, j]; known on the host without a device read. None otherwise (a dense tensor, a user's
        function, lengths that differ by batch row)."""
        return None

    def callers_tensor(self) -> torch.Tensor | None:
        """The caller's own tensor, where this term evaluates to views of it (never written in place)."""
        return None

    shape: AttentionShape
    cap: float | None = None  # a soft-cap's cap: a transform of the score, taken out of the terms by BoundMask

    @property
    def is_plain_causal(self) -> bool:
        """Whether this term is exactly SDPA's is_causal=True."""
        return False

    @property
    def is_lower_right_causal(self) -> bool:
        """Whether this term is exactly torch's ``causal_lower_right(i, j)`` with i <= j."""
        return False


def _block_indices(
    shape: AttentionShape, rows: Index, cols: Index, heads: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (b, 1, 1, 1), (1, h_sel, 1, 1), (1, 1, rows, 1) and (1, 1, 1, cols) int64 positions a mod is called
    with for a block."""
    device = shape.device
    b = torch.arange(shape.batch, device=device)
    h = torch.arange(shape.heads, device=device) if heads is None else heads
    q = _positions(rows, shape.q_len, device)
    k = _positions(cols, shape.k_len, device)
    return b[:, None, None, None], h[None, :, None, None], q[None, None, :, None], k[None, None, None, :]


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """A mod's result with leading dims of 1 added up to 4 (it broadcasts to (b, h, rows, cols))."""
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t


def _on_cpu(shape: AttentionShape) -> AttentionShape:
    return AttentionShape(shape.batch, shape.heads, shape.q_len, shape.k_len, torch.device("cpu"))
