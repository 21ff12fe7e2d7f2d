"""ALiBi (Press et al., 2022): :func:`alibi`, the paper's :func:`alibi_slopes`, and its bound term."""

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
    device_scalar,
)
from multihead.masks._mask import Mask


class _Alibi(Mask):
    kind = "alibi"

    def __init__(self, slopes: torch.Tensor | Sequence[float], align: str):
        if not isinstance(slopes, torch.Tensor):
            try:
                slopes = torch.as_tensor(slopes, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):
                raise bad_argument(
                    "alibi(slopes)",
                    "a 1-D float tensor with one slope per query head",
                    describe(slopes),
                    "use multihead.masks.alibi_slopes(num_heads)",
                    kind=TypeError,
                ) from None
        if not slopes.is_floating_point():
            raise bad_argument(
                "alibi(slopes)",
                "a 1-D float tensor with one slope per query head",
                describe(slopes),
                "convert with .float(), or use multihead.masks.alibi_slopes(num_heads)",
                kind=TypeError,
            )
        if slopes.ndim != 1:
            raise bad_argument(
                "alibi(slopes)",
                "a 1-D float tensor with one slope per query head",
                describe(slopes),
                "use multihead.masks.alibi_slopes(num_heads)",
            )
        if align not in ALIGNMENTS:
            raise bad_argument("alibi(align=...)", f"one of {ALIGNMENTS}", repr(align), 'use "bottom_right"')
        self.slopes, self.align = slopes, align

    def __repr__(self) -> str:
        return f"alibi(heads={self.slopes.shape[0]})"

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        if self.slopes.shape[0] != shape.heads:
            raise bad_argument(
                "alibi(slopes)",
                f"one slope per query head ({shape.heads},)",
                tuple(self.slopes.shape),
                f"use multihead.masks.alibi_slopes({shape.heads})",
            )
        offset = shape.k_len - shape.q_len if self.align == "bottom_right" else 0
        return _BoundAlibi(_moved("alibi(slopes)", self.slopes, shape.device), offset, shape)


def alibi(slopes: torch.Tensor | Sequence[float], *, align: str = "bottom_right") -> Mask:
    """ALiBi bias (Press et al., 2022): score(i, j) += -slopes[h] * |p_i - j|, p_i the aligned position.

    Under a causal mask this is the paper's ``slope * (j - i)``; without one it is the
    symmetric variant used by bidirectional encoders.
    """
    return _Alibi(slopes, align)


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


ALIBI_CHUNK_ELEMENTS = 2**24  # the most (heads, rows, keys) entries an ALiBi bias builds before rounding them


class _BoundAlibi(BoundTerm):
    """-slopes[h] * |k - p|, p = q + offset the aligned query position."""

    kind = "alibi"
    is_bias = True
    holds_data = False

    def __init__(self, slopes: torch.Tensor, offset: int, shape: AttentionShape):
        self.slopes, self.offset, self.shape = slopes, offset, shape
        self.shift: int | torch.Tensor = offset  # what the mod reads: a 0-d tensor in the lifted copy
        self.requires_grad = slopes.requires_grad

    def rule(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        def linear_bias(b, h, q, k, slopes=self.slopes, shift=self.shift):
            return -slopes[h] * (k - (q + shift)).abs().to(slopes.dtype)

        return linear_bias

    def lifted(self) -> BoundTerm:
        lifted = _BoundAlibi(self.slopes, self.offset, self.shape)
        lifted.shift = device_scalar(self.offset, self.shape.device)
        return lifted

    def signature(self) -> tuple:
        return "alibi", tuple(self.slopes.shape), self.offset, self.requires_grad

    def spans(self) -> tuple[bool, bool, bool]:
        return False, True, True

    def _distance(self, rows: Index, cols: Index) -> torch.Tensor:
        """|j - aligned i| for the block, (rows, cols) float32."""
        i = _positions(rows, self.shape.q_len, self.shape.device) + self.offset
        j = _positions(cols, self.shape.k_len, self.shape.device)
        return _distance(i[:, None], j[None, :])

    def evaluate_in(
        self, rows: Index, cols: Index, heads: torch.Tensor | None, dtype: torch.dtype | None
    ) -> torch.Tensor:
        """(1, h_sel, rows, cols) in ``dtype``, equal to ``evaluate(...).to(dtype)`` but built a few heads at a time
        into the result, so the peak is the result plus at most :data:`ALIBI_CHUNK_ELEMENTS` entries in the slopes'
        dtype. Building all heads in float32 and then casting took 6 bytes an entry at the peak for a bfloat16
        call, where the bias kept is 2 (24 GiB at i = j = 16384 with 16 heads). Learned slopes that need their
        gradient, and traced calls, take :meth:`evaluate`'s one broadcast product."""
        needs_graph = self.slopes.requires_grad and torch.is_grad_enabled()
        if needs_graph or torch.compiler.is_compiling():
            return super().evaluate_in(rows, cols, heads, dtype)
        slopes = self.slopes if heads is None else self.slopes.index_select(0, heads)
        distance = self._distance(rows, cols).to(slopes.dtype)
        out = torch.empty((1, len(slopes), *distance.shape), dtype=dtype or slopes.dtype, device=distance.device)
        step = max(1, ALIBI_CHUNK_ELEMENTS // max(1, distance.numel()))
        # the product in the slopes' dtype, rounded once into the result: one buffer for every chunk, since a
        # new one past glibc's mmap threshold (32 MiB) would fault in fresh pages each time
        product = None if out.dtype == slopes.dtype else distance.new_empty((min(step, len(slopes)), *distance.shape))
        for start in range(0, len(slopes), step):
            chunk = -slopes[start : start + step, None, None]
            target = out[0, start : start + step]
            if product is None:
                torch.mul(chunk, distance, out=target)
            else:
                target.copy_(torch.mul(chunk, distance, out=product[: len(chunk)]))
        return out


def _distance(p: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """|k - p| in float32 for int64 positions, broadcast: exact below 2**24. Taken in integers first: inductor's
    CPU code for flex fails to compile the float32 difference of two converted indices (torch 2.13)."""
    return (k - p).abs().to(torch.float32)
