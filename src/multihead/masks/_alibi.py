"""ALiBi (Press et al., 2022): :func:`alibi`, the paper's :func:`alibi_slopes`, and its bound term.

Slopes come one per query head, (h,), or one per batch row and head, (b, h), as FlashAttention's ``alibi_slopes``
takes them. A query row's distance is measured from its aligned key position: the alignment's (bottom-right or
top-left, one offset for every row), or each row's own where the rows have their own (:func:`aligned_alibi`:
FlashAttention's documents of their own lengths in varlen, rows of their own cache lengths in a KV cache call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from multihead._errors import bad_argument, describe
from multihead._limits import check_fits
from multihead.masks._base import (
    ALIGNMENTS,
    AttentionShape,
    BoundTerm,
    Index,
    _moved,
    _positions,
    _select,
    device_scalar,
)
from multihead.masks._mask import Mask, cut_head_axis

SLOPES_LAYOUT = "a float tensor of slopes, (h,) one per query head or (b, h) one per batch row and head"


class AlibiMask(Mask):
    kind = "alibi"

    def __init__(self, slopes: torch.Tensor | Sequence[float] | Sequence[Sequence[float]], align: str):
        if not isinstance(slopes, torch.Tensor):
            try:
                slopes = torch.as_tensor(slopes, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):
                raise bad_argument(
                    "alibi(slopes)",
                    SLOPES_LAYOUT,
                    describe(slopes),
                    "use multihead.masks.alibi_slopes(num_heads)",
                    kind=TypeError,
                ) from None
        if not slopes.is_floating_point():
            raise bad_argument(
                "alibi(slopes)",
                SLOPES_LAYOUT,
                describe(slopes),
                "convert with .float(), or use multihead.masks.alibi_slopes(num_heads)",
                kind=TypeError,
            )
        if slopes.ndim not in (1, 2):
            raise bad_argument(
                "alibi(slopes)",
                SLOPES_LAYOUT,
                describe(slopes),
                "use multihead.masks.alibi_slopes(num_heads), or stack one row of it per batch row",
            )
        if align not in ALIGNMENTS:
            raise bad_argument("alibi(align=...)", f"one of {ALIGNMENTS}", repr(align), 'use "bottom_right"')
        self.slopes, self.align = slopes, align

    def __repr__(self) -> str:
        if self.slopes.ndim == 2:
            return f"alibi(batch={self.slopes.shape[0]}, heads={self.slopes.shape[1]})"
        return f"alibi(heads={self.slopes.shape[0]})"

    def _for_heads(self, start: int, count: int, total: int) -> Mask:
        # no size-1 head axis is shared here: slope_table takes one slope per head, exactly
        cut = cut_head_axis(
            "alibi(slopes)",
            self.slopes,
            self.slopes.ndim - 1,
            start,
            count,
            total,
            shared=False,
            fix=global_slopes_fix(total),
        )
        return self if cut is self.slopes else AlibiMask(cut, self.align)

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        table = slope_table("alibi(slopes)", self.slopes, shape.batch, shape.heads, "batch row", "b")
        offset = shape.k_len - shape.q_len if self.align == "bottom_right" else 0
        return _BoundAlibi(_moved("alibi(slopes)", table, shape.device), shape, offset=offset)


def global_slopes_fix(total: int) -> str:
    """The fix for slopes given for other heads than the ``total`` they are cut from (a rank's own, say)."""
    return (
        f"pass the slopes of all {total} query heads of the layer, e.g. alibi_slopes({total}), on every rank: a "
        "head-parallel layer cuts each rank's heads from them"
    )


def checked_slope_tensor(name: str, slopes: object, rows: int, heads: int, letter: str, *, fix: str) -> torch.Tensor:
    """``slopes`` as a caller of FlashAttention's layout passes them: a float tensor (TypeError naming ``name`` and
    ``fix`` otherwise) of one or two dimensions, (h,) or (``letter``, h) = (``rows``, ``heads``); its exact shape is
    :func:`slope_table`'s to check."""
    if not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point():
        raise bad_argument(
            name, f"a float tensor of slopes, (h,) or ({letter}, h)", describe(slopes), fix, kind=TypeError
        )
    if slopes.ndim not in (1, 2):
        raise bad_argument(
            name,
            f"(h,) = ({heads},) or ({letter}, h) = ({rows}, {heads})",
            tuple(slopes.shape),
            f"use multihead.masks.alibi_slopes({heads})",
        )
    return slopes


def slope_table(name: str, slopes: torch.Tensor, rows: int, heads: int, row: str, letter: str) -> torch.Tensor:
    """``slopes`` (h,) or (n, h) checked against ``heads`` query heads and ``rows`` rows of ``row`` (a batch row, a
    document; ``letter`` its axis letter), as the (n or 1, h, 1) table the bound term reads: a view, so learned
    slopes keep their gradient. No silent broadcast: (n, h) slopes need n = ``rows`` exactly."""
    expected = (
        f"(h,) = ({heads},) one slope per query head, or ({letter}, h) = ({rows}, {heads}) one per {row} and head"
    )
    if slopes.ndim == 1 and slopes.shape[0] == heads:
        return slopes.view(1, heads, 1)
    if slopes.ndim == 2 and tuple(slopes.shape) == (rows, heads):
        return slopes.view(rows, heads, 1)
    if slopes.ndim == 1:
        fix = f"use multihead.masks.alibi_slopes({heads})"
    elif slopes.shape[-1] != heads:
        fix = f"give one column per query head: {heads}"
    else:
        fix = f"give one row per {row} ({rows} of them), or (h,) slopes shared by all"
    raise bad_argument(name, expected, tuple(slopes.shape), fix)


class _AlignedAlibi(Mask):
    """ALiBi whose query rows have their own aligned key positions and their own slopes: built by
    :func:`aligned_alibi`."""

    kind = "alibi"

    def __init__(self, table: torch.Tensor, positions: torch.Tensor, name: str):
        self.table, self.positions, self.name = table, positions, name

    def __repr__(self) -> str:
        return f"alibi(heads={self.table.shape[1]}, positions={tuple(self.positions.shape)})"

    def _for_heads(self, start: int, count: int, total: int) -> Mask:
        cut = cut_head_axis(self.name, self.table, 1, start, count, total, shared=False, fix=global_slopes_fix(total))
        return self if cut is self.table else _AlignedAlibi(cut, self.positions, self.name)

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        rows, heads, per_row = self.table.shape
        if rows not in (1, shape.batch) or heads != shape.heads or per_row not in (1, shape.q_len):
            raise bad_argument(
                self.name,
                f"slopes (b or 1, h, i or 1) = ({shape.batch}, {shape.heads}, {shape.q_len}) at most",
                tuple(self.table.shape),
                "give one slope per query head, batch row and query row at most",
            )
        if self.positions.shape[0] not in (1, shape.batch) or self.positions.shape[1:] != (shape.q_len,):
            raise bad_argument(
                self.name,
                f"aligned positions (b or 1, i) = ({shape.batch}, {shape.q_len})",
                tuple(self.positions.shape),
                "give each query row its aligned key position",
            )
        table = _moved(self.name, self.table, shape.device)
        return _BoundAlibi(table, shape, positions=_moved(self.name, self.positions, shape.device))


def alibi(slopes: torch.Tensor | Sequence[float] | Sequence[Sequence[float]], *, align: str = "bottom_right") -> Mask:
    """ALiBi bias (Press et al., 2022): score(b, h, i, j) += -slope[b, h] * |p_i - j|, p_i query i's aligned key
    position (``align`` as for :func:`causal`: bottom-right puts query i at key position i + j_len - i_len, so the
    bias is FlashAttention's -slope * |i + seqlen_k - seqlen_q - j|).

    ``slopes``: (h,), one slope per query head (:func:`alibi_slopes`), or (b, h), one per batch row and head
    (FlashAttention's ``alibi_slopes`` takes both); any float dtype, learned ones get their gradient.

    Under a causal mask this is the paper's ``slope * (j - i)``; without one it is the
    symmetric variant used by bidirectional encoders.
    """
    return AlibiMask(slopes, align)


def aligned_alibi(table: torch.Tensor, positions: torch.Tensor, *, name: str = "alibi_slopes") -> Mask:
    """ALiBi with each query row's aligned key position given: -table[b, h, i] * |positions[b, i] - j|, ``table``
    (b or 1, h, i or 1) slopes (:func:`slope_table`, or gathered per query row), ``positions`` (b or 1, i) int64.
    What :func:`multihead.attention_varlen` (each document aligned bottom-right within itself) and
    :func:`multihead.paged.attention_with_kvcache` (each batch row at its own cache length) build, with the
    positions their documents term uses (``masks.ragged_rows``, ``masks.key_range_positions``)."""
    return _AlignedAlibi(table, positions, name)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The geometric head slopes of Press et al. (2022), shape (num_heads,).

    For n a power of two: 2^(-8/n), 2^(-16/n), ..., 2^(-8). Otherwise the slopes of
    the largest power of two below n, then every other slope of twice that power.
    """
    if not isinstance(num_heads, int) or isinstance(num_heads, bool):
        raise bad_argument(
            "num_heads", "a positive int", describe(num_heads), "pass the number of query heads", kind=TypeError
        )
    if num_heads < 1:
        raise bad_argument("num_heads", "a positive int", num_heads, "pass the number of query heads")
    check_fits("num_heads", (num_heads,), torch.float64, None, "pass the number of query heads", what="the slopes")

    def geometric(n: int, count: int, step: int = 1) -> torch.Tensor:  # 2^(-8 (m + 1) / n) for m = 0, step, ...
        m = torch.arange(0, count * step, step, dtype=torch.float64)
        return torch.exp2(-8.0 * (m + 1) / n)

    power = 1 << (num_heads.bit_length() - 1)  # the largest power of two <= num_heads
    slopes = geometric(power, power)
    if power < num_heads:
        slopes = torch.cat([slopes, geometric(2 * power, num_heads - power, step=2)])
    return slopes.to(torch.float32)


ALIBI_CHUNK_ELEMENTS = 2**24  # the most (batch, heads, rows, keys) entries an ALiBi bias builds before rounding them


class _BoundAlibi(BoundTerm):
    """-slopes[b, h, i] * |k - p|, ``slopes`` (b or 1, h, i or 1) and p the aligned query position: q + offset for
    every row, or ``positions[b, q]`` ((b or 1, i)) where each row has its own."""

    kind = "alibi"
    is_bias = True
    holds_data = False

    def __init__(
        self,
        slopes: torch.Tensor,
        shape: AttentionShape,
        *,
        offset: int = 0,
        positions: torch.Tensor | None = None,
    ):
        self.slopes, self.offset, self.positions, self.shape = slopes, offset, positions, shape
        self.shift: int | torch.Tensor = offset  # what the mod reads: a 0-d tensor in the lifted copy
        self.requires_grad = slopes.requires_grad
        # a row's own position or slopes are read from a tensor by query position, which torch 2.13's CPU flex
        # fails to compile in a score_mod (the flex backend refuses the call there, and auto passes it over)
        self.reads_pair_tensor = positions is not None or slopes.shape[2] > 1

    def rule(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        # the slopes read with one index per dim they vary along, from a view without the broadcast dims: inductor's
        # CPU code for flex fails to compile a read of a size-1 dim at a constant 0 (torch 2.13)
        # (and one of a 2-D float table at (b, h)): the slopes are read flat, at b * h_len * i_len + h * i_len + q
        batches, heads, rows = self.slopes.shape
        per_batch, per_row = batches > 1, rows > 1
        table = self.slopes.reshape(-1)  # (b * h * i,) over the dims it has: a view, the gradient kept
        # positions are read at (b, q) over every batch row (an expanded view): a read of a 1-D tensor at q fails there
        at = None if self.positions is None else self.positions.expand(self.shape.batch, -1)

        def linear_bias(b, h, q, k, slopes=table, shift=self.shift, at=at):
            index = h * rows + q if per_row else h
            if per_batch:
                index = index + b * (heads * rows)
            p = q + shift if at is None else at[b, q]
            return -slopes[index] * (k - p).abs().to(slopes.dtype)

        return linear_bias

    def lifted(self) -> BoundTerm:
        lifted = _BoundAlibi(self.slopes, self.shape, offset=self.offset, positions=self.positions)
        lifted.shift = device_scalar(self.offset, self.shape.device)
        return lifted

    def structure(self) -> tuple:
        per = tuple(size > 1 for size in (self.slopes.shape[0], self.slopes.shape[2]))
        return self.kind, per, None if self.positions is None else self.positions.shape[0] > 1

    def signature(self) -> tuple:
        at = None if self.positions is None else tuple(self.positions.shape)
        return "alibi", tuple(self.slopes.shape), self.offset, at, self.requires_grad

    def spans(self) -> tuple[bool, bool, bool]:
        batch = self.slopes.shape[0] > 1 or (self.positions is not None and self.positions.shape[0] > 1)
        return batch, True, True

    def _distance(self, rows: Index, cols: Index) -> torch.Tensor:
        """|j - aligned i| for the block, (b or 1, rows, cols) float32."""
        j = _positions(cols, self.shape.k_len, self.shape.device)
        if self.positions is None:
            i = _positions(rows, self.shape.q_len, self.shape.device) + self.offset
            return _distance(i[None, :, None], j[None, None, :])
        return _distance(_select(self.positions, 1, rows)[:, :, None], j[None, None, :])

    def evaluate_in(
        self, rows: Index, cols: Index, heads: torch.Tensor | None, dtype: torch.dtype | None
    ) -> torch.Tensor:
        """(b or 1, h_sel, rows, cols) in ``dtype``, equal to ``evaluate(...).to(dtype)`` but built a few heads at a
        time into the result, so the peak is the result plus at most :data:`ALIBI_CHUNK_ELEMENTS` entries in the
        slopes' dtype. Building all heads in float32 and then casting took 6 bytes an entry at the peak for a
        bfloat16 call, where the bias kept is 2 (24 GiB at i = j = 16384 with 16 heads). Learned slopes that need
        their gradient, and traced calls, take :meth:`evaluate`'s one broadcast product."""
        needs_graph = self.slopes.requires_grad and torch.is_grad_enabled()
        if needs_graph or torch.compiler.is_compiling():
            return super().evaluate_in(rows, cols, heads, dtype)
        slopes = self.slopes if heads is None else self.slopes.index_select(1, heads)
        slopes = _select(slopes, 2, rows)  # (b or 1, h_sel, rows or 1)
        distance = self._distance(rows, cols).to(slopes.dtype)  # (b or 1, rows, cols)
        batch = max(slopes.shape[0], distance.shape[0])
        out_shape = (batch, slopes.shape[1], distance.shape[1], distance.shape[2])
        out = torch.empty(out_shape, dtype=dtype or slopes.dtype, device=distance.device)
        plane = batch * distance.shape[1] * distance.shape[2]  # entries of one head
        step = max(1, ALIBI_CHUNK_ELEMENTS // max(1, plane))
        # the product in the slopes' dtype, rounded once into the result: one buffer for every chunk, since a
        # new one past glibc's mmap threshold (32 MiB) would fault in fresh pages each time
        chunk_shape = (batch, min(step, slopes.shape[1]), *distance.shape[1:])
        product = None if out.dtype == slopes.dtype else distance.new_empty(chunk_shape)
        for start in range(0, slopes.shape[1], step):
            chunk = -slopes[:, start : start + step, :, None]  # (b or 1, heads of the chunk, rows or 1, 1)
            target = out[:, start : start + step]
            if product is None:
                torch.mul(chunk, distance[:, None], out=target)
            else:
                target.copy_(torch.mul(chunk, distance[:, None], out=product[:, : chunk.shape[1]]))
        return out


def _distance(p: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """|k - p| in float32 for int64 positions, broadcast: exact below 2**24. Taken in integers first: inductor's
    CPU code for flex fails to compile the float32 difference of two converted indices (torch 2.13)."""
    return (k - p).abs().to(torch.float32)
