"""Bands around the aligned diagonal: :func:`causal` and :func:`window`, and their bound term."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from multihead._errors import bad_argument, describe
from multihead._symbolic import surely
from multihead.masks._base import (
    ALIGNMENTS,
    AttentionShape,
    BlockGrid,
    BlockState,
    BoundTerm,
    _on_cpu,
    _states,
    device_scalar,
)
from multihead.masks._mask import Mask


class _Diagonal(Mask):
    """Keys within [p - left, p + right] of the aligned query position p; None = unbounded."""

    kind = "diagonal"

    def __init__(self, left: int | None, right: int | None, align: str, name: str):
        for arg, value in (("left", left), ("right", right)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise bad_argument(
                    f"{name}({arg}=...)",
                    "a non-negative int or None",
                    describe(value),
                    f"pass a whole number of positions, e.g. {arg}=128",
                    kind=TypeError,
                )
            if value is not None and value < 0:
                raise bad_argument(
                    f"{name}({arg}=...)",
                    "a non-negative int or None",
                    value,
                    f"use {arg}=0 for no keys on that side, or None for unbounded",
                )
        if align not in ALIGNMENTS:
            raise bad_argument(
                f"{name}(align=...)",
                f"one of {ALIGNMENTS}",
                repr(align),
                'use "bottom_right" (KV-cache style) or "top_left"',
            )
        self.left, self.right, self.align, self.name = left, right, align, name

    def __repr__(self) -> str:
        if self.name == "causal":
            return f"causal(align={self.align!r})"
        return f"window(left={self.left}, right={self.right}, align={self.align!r})"

    def key_band(self) -> tuple[int | None, int | None]:
        return self.left, self.right

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        offset = shape.k_len - shape.q_len if self.align == "bottom_right" else 0
        return _BoundDiagonal(self, offset, shape)


def causal(align: str = "bottom_right") -> Mask:
    """Query i attends key j only when j <= i + offset (see the module docstring for alignment)."""
    return _Diagonal(None, 0, align, "causal")


def window(left: int | None, right: int | None = 0, *, align: str = "bottom_right") -> Mask:
    """Sliding window: the query at aligned position p attends keys p - left ... p + right.

    ``window(W - 1, 0)`` is a causal window of W keys (the query's own and W - 1 before it);
    ``window(64, 64)`` a symmetric local window; None leaves that side unbounded.
    """
    return _Diagonal(left, right, align, "window")


class _BoundDiagonal(BoundTerm):
    """Keys within [p - left, p + right] of the aligned query position p = q + offset; a side None is unbounded."""

    kind = "diagonal"
    holds_data = False
    shift_invariant = True

    def __init__(self, spec: _Diagonal, offset: int, shape: AttentionShape):
        self.spec, self.offset, self.shape = spec, offset, shape
        # what the mod reads: ints here, 0-d tensors in the lifted copy
        self.left: int | torch.Tensor | None = spec.left
        self.right: int | torch.Tensor | None = spec.right
        self.shift: int | torch.Tensor = offset

    def rule(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        def band(b, h, q, k, shift=self.shift, left=self.left, right=self.right):
            p = q + shift
            keep = torch.ones_like(k, dtype=torch.bool) if right is None else k <= p + right
            # compared against per-row bounds: the only (rows, cols) tensors built are bool
            return keep if left is None else keep & (k >= p - left)

        return band

    def lifted(self) -> BoundTerm:
        """Offset and both bounds as 0-d tensors, an unbounded side as a bound past every key (i + j): causal and
        every window then share one compiled kernel, and no length is compiled in."""
        lifted = _BoundDiagonal(self.spec, self.offset, self.shape)
        unbounded = self.shape.q_len + self.shape.k_len  # farther than any key from any aligned position
        device = self.shape.device
        lifted.shift = device_scalar(self.offset, device)
        lifted.left = device_scalar(unbounded if self.spec.left is None else self.spec.left, device)
        lifted.right = device_scalar(unbounded if self.spec.right is None else self.spec.right, device)
        return lifted

    def signature(self) -> tuple:
        return "band", self.spec.left, self.spec.right, self.offset

    def spans(self) -> tuple[bool, bool, bool]:
        return False, False, True

    @property
    def is_plain_causal(self) -> bool:
        """Equal to SDPA's is_causal=True (top-left lower triangle)."""
        return self.spec.left is None and self.spec.right == 0 and surely(self.offset == 0)

    @property
    def is_lower_right_causal(self) -> bool:
        """Equal to torch's ``causal_lower_right(i, j)`` with i <= j: the last query sees the last key."""
        i, j = self.shape.q_len, self.shape.k_len
        at_bottom = surely(self.offset == j - i) and surely(i <= j)
        return self.spec.left is None and self.spec.right == 0 and at_bottom

    def _relative_range(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> tuple[int, int]:
        """[lo, hi]: the relative positions r = j - (i + offset) of the block's pairs."""
        return col_start - (row_stop - 1 + self.offset), col_stop - 1 - (row_start + self.offset)

    def span_state(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> BlockState:
        lo, hi = self._relative_range(row_start, row_stop, col_start, col_stop)
        left = -math.inf if self.spec.left is None else -self.spec.left
        right = math.inf if self.spec.right is None else self.spec.right
        if hi < left or lo > right:
            return BlockState.EMPTY
        if lo >= left and hi <= right:
            return BlockState.FULL
        return BlockState.PARTIAL

    def surely_full(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> bool:
        lo, hi = self._relative_range(row_start, row_stop, col_start, col_stop)
        return (self.spec.left is None or surely(lo >= -self.spec.left)) and (
            self.spec.right is None or surely(hi <= self.spec.right)
        )

    def may_empty_rows(self) -> bool:
        # aligned positions run from offset to q_len - 1 + offset; keys from 0 to k_len - 1
        first, last = self.offset, self.shape.q_len - 1 + self.offset
        starts_in_time = self.spec.right is None or surely(first + self.spec.right >= 0)
        ends_in_time = self.spec.left is None or surely(last - self.spec.left <= self.shape.k_len - 1)
        return not (starts_in_time and ends_in_time)

    def host_term(self) -> BoundTerm | None:
        return _BoundDiagonal(self.spec, self.offset, _on_cpu(self.shape))

    def block_states(self, grid: BlockGrid) -> torch.Tensor:
        # the relative positions r = j - (i + offset) a tile spans, as span_state computes them for one tile
        (row_start, row_stop), (col_start, col_stop) = grid.rows(), grid.cols()
        lo = col_start[None, :] - (row_stop[:, None] - 1 + self.offset)  # (q_blocks, k_blocks)
        hi = col_stop[None, :] - 1 - (row_start[:, None] + self.offset)
        empty, full = torch.zeros_like(lo, dtype=torch.bool), torch.ones_like(lo, dtype=torch.bool)
        if self.spec.left is not None:
            empty, full = empty | (hi < -self.spec.left), full & (lo >= -self.spec.left)
        if self.spec.right is not None:
            empty, full = empty | (lo > self.spec.right), full & (hi <= self.spec.right)
        return _states(empty, full)

    def merged(self, other: BoundTerm) -> BoundTerm | None:
        """This band and another of the same alignment as one, the tighter bound on each side."""
        if not isinstance(other, _BoundDiagonal) or other.spec.align != self.spec.align:
            return None
        left, right = band_intersection((self.spec.left, self.spec.right), (other.spec.left, other.spec.right))
        name = "causal" if left is None and right == 0 else "window"
        return _BoundDiagonal(_Diagonal(left, right, self.spec.align, name), self.offset, self.shape)

    def row_key_spans(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not isinstance(self.offset, int):  # a symbolic alignment (torch.compile): no host numbers
            return None
        j = self.shape.k_len
        aligned = torch.arange(self.shape.q_len) + self.offset  # each row's aligned key position
        lo = torch.zeros_like(aligned) if self.spec.left is None else (aligned - self.spec.left).clamp(0, j)
        hi = torch.full_like(aligned, j) if self.spec.right is None else (aligned + self.spec.right + 1).clamp(0, j)
        return lo, hi

    def key_bounds(self, position: int) -> tuple[float, float]:
        """[lo, hi]: the keys this band lets query row ``position`` (0-based) see, before clipping to [0, j)."""
        p = position + self.offset  # its aligned position
        lo = -math.inf if self.spec.left is None else p - self.spec.left
        hi = math.inf if self.spec.right is None else p + self.spec.right
        return lo, hi


def band_intersection(
    a: tuple[int | None, int | None], b: tuple[int | None, int | None]
) -> tuple[int | None, int | None]:
    """The keys two bands (left, right) both allow: each side's tighter bound, None being unbounded."""
    return _tighter(a[0], b[0]), _tighter(a[1], b[1])


def _tighter(a: int | None, b: int | None) -> int | None:
    """The smaller of two bounds, None being unbounded."""
    return b if a is None else a if b is None else min(a, b)
