"""Position information for attention: rotary (RoPE), fixed sinusoidal and learned absolute positions.

    RotaryEmbedding(head_dim)        rotates q and k per head so scores depend on i - j (Su et al., 2021)
    SinusoidalPositions(dim)         adds the fixed sin/cos table of Vaswani et al. (2017) to the input
    LearnedPositions(max_len, dim)   adds a trained (max_len, dim) table (BERT, GPT-2)

Rotary works on per-head tensors, after the projections: q (b, h, i, d) and
k (b, g, j, d). The two absolute kinds work on the layer input (b, n, dim),
before the projections.

Fixed tables (rotary cos/sin, sinusoidal) are computed in float64 and cached in
float32 (float64 for float64 inputs) as non-persistent buffers: they grow on
demand, move with ``module.to(device)``, and never appear in ``state_dict()``.
A cast of the module (``.half()``) is undone on the next call, so the tables keep
their precision. A table is built whole before it replaces the old one (one attribute
assignment, under a lock), so threads sharing a module, or an allocation that fails half
way, never see a table of the wrong length; positions whose table cannot fit in memory
are refused before anything is allocated.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Callable

import torch
from torch import nn

from multihead._errors import bad_argument, describe, floating_dtype, usable_device
from multihead._inputs import floating_argument, tensor_argument
from multihead._limits import check_fits
from multihead.masks import host_readable, to_device

__all__ = ["RotaryEmbedding", "SinusoidalPositions", "LearnedPositions"]


# --------------------------------------------------------------------------- validation


def _check_int(name: str, value: object, *, minimum: int, expected: str, fix: str) -> int:
    """An int (not bool) >= minimum; TypeError for the wrong type, ValueError below the minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise bad_argument(name, expected, describe(value), fix, kind=TypeError)
    if value < minimum:
        raise bad_argument(name, expected, value, fix)
    return int(value)


def _check_even_dim(name: str, value: object) -> int:
    expected = "a positive even int (sin/cos come in pairs)"
    size = _check_int(name, value, minimum=1, expected=expected, fix=f"pass the size of the vectors, e.g. {name}=64")
    if size % 2:
        raise bad_argument(name, expected, value, f"use an even size, e.g. {name}={size + 1}")
    return size


def _check_base(value: object) -> float:
    expected = "a positive finite float"
    fix = "use the usual base=10000.0"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise bad_argument("base", expected, describe(value), fix, kind=TypeError)
    if not math.isfinite(value) or value <= 0:
        raise bad_argument("base", expected, value, fix)
    return float(value)


# angles are computed in float64, which holds every integer position exactly only below 2**53
EXACT_POSITIONS = 2**53


def _check_offset(name: str, value: object) -> int:
    offset = _check_int(
        name,
        value,
        minimum=0,
        expected="a non-negative int (the position of the first row)",
        fix=f"pass the number of positions before this chunk, e.g. {name}=cache_length",
    )
    _check_exact(name, offset)
    return offset


def _check_exact(name: str, highest: int) -> None:
    """Refuse a position float64 cannot hold exactly (its angle would be another position's)."""
    if highest >= EXACT_POSITIONS:
        raise bad_argument(
            name,
            "positions below 2**53 (float64, in which the angles are computed, holds each of them exactly)",
            highest,
            "count positions from the start of the sequence",
        )


def _check_tensor(name: str, x: object, layout: str, ranks: tuple[int, ...], size: int, size_name: str) -> None:
    """x is a floating tensor of one of ``ranks`` dims whose last dim is ``size``."""
    x = tensor_argument(name, x, fix="wrap the values with torch.as_tensor")
    floating_argument(name, x)
    if x.ndim not in ranks:
        raise bad_argument(
            name,
            f"shape {layout}",
            f"shape {tuple(x.shape)}",
            "add or remove dimensions to match; the last one is the feature size",
        )
    if x.shape[-1] != size:
        raise bad_argument(
            name,
            f"last dim {size_name} = {size}",
            f"shape {tuple(x.shape)}",
            f"construct the module with {size_name}={x.shape[-1]}, or pass a tensor laid out as {layout}",
        )


def _table_dtype(dtype: torch.dtype) -> torch.dtype:
    """Cached tables are float32, or float64 for float64 inputs (half precision tables lose positions)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _inverse_frequencies(dim: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """base^(-2m/dim) for m = 0 .. dim/2 - 1, float64 on ``device`` (the CPU by default): shape (dim/2,).

    Computed where it is used: built on the CPU and moved, it would cost every call a copy from the host,
    which waits for the device."""
    return base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)


def _grown(current: int, needed: int, same_place: bool, cap: int | None = None) -> int:
    """New cache length: at least ``needed``, doubling when growing in place (at most 2 x needed), never above
    ``cap``."""
    size = max(needed, min(2 * current, 2 * needed) if same_place else needed)
    return size if cap is None else min(size, cap)


# A cached table covers every position up to the largest asked for: worth it while the positions asked are dense
# (a prompt, decoding). Positions far apart (0 and 2**27) would build and keep a table of 2**27 rows for two of them
# (15 s and 4 GiB for a rotary head of 8 here; gigabytes more at a real head size), so past TABLE_FLOOR rows a table
# grows only to at most TABLE_ROWS_PER_POSITION rows per position a call asks for; the other calls compute their
# own positions' values (the same float64 arithmetic, so the same numbers), at a cost that goes with what they ask.
TABLE_FLOOR = 1 << 16  # rows any table may cover (a float32 rotary table of head size 128: 32 MiB)
TABLE_ROWS_PER_POSITION = 16


def worth_a_table(length: int, asked: int, current: int) -> bool:
    """Whether a table of ``length`` rows is kept for a call asking for ``asked`` positions, the table holding
    ``current`` rows (one that covers them already is always used)."""
    return length <= max(current, TABLE_FLOOR + TABLE_ROWS_PER_POSITION * asked)


# Growing a table is rare and cheap next to attention; one lock for every module keeps modules picklable.
_GROWTH_LOCK = threading.Lock()


def _table_for(
    module: nn.Module,
    buffer: str,
    length: int,
    device: torch.device,
    dtype: torch.dtype,
    build: Callable[[int], torch.Tensor],
    *,
    row_size: int,
    name: str,
    cap: int | None = None,
) -> torch.Tensor:
    """The cached table ``module.<buffer>`` (positions first) covering ``length`` positions, grown if needed.

    ``build(size)`` computes a table of ``size`` positions in float64 on the CPU. The new table is
    complete before it replaces the buffer (one assignment), so a reader in another thread sees
    the old table or the new one, never a mix, and a failure leaves the old one in place. Each
    caller works on the table it read, never re-reading the attribute.
    """
    table = getattr(module, buffer)
    if table.device == device and table.dtype == dtype and table.shape[-2] >= length:
        return table
    with _GROWTH_LOCK:
        table = getattr(module, buffer)  # another thread may have grown it meanwhile
        same_place = table.device == device and table.dtype == dtype
        if same_place and table.shape[-2] >= length:
            return table
        fix = "use smaller positions: the table of values up to the largest one must fit in memory"
        check_fits(name, (length, row_size), torch.float64, None, fix, what="the position table")
        size = _grown(table.shape[-2], length, same_place, cap)
        try:  # room to grow ahead (doubling) only where that fits too
            check_fits(name, (size, row_size), torch.float64, None, fix, what="the position table")
        except ValueError:
            size = length
        table = to_device(build(size).to(dtype), device)  # built on the CPU: queued on the device, not waited for
        setattr(module, buffer, table)
        return table


# --------------------------------------------------------------------------- rotary


def check_positions(positions: object, b: int, i: int) -> None:
    """A layer call's ``positions`` checked for its b rows of i new tokens: an integer tensor (i,) or (b, i)."""
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
        raise bad_argument(
            "positions",
            "an integer tensor (i,) or (b, i)",
            describe(positions),
            "pass torch.arange(start, start + i)",
            kind=TypeError,
        )
    if tuple(positions.shape) not in ((i,), (b, i)):
        raise bad_argument(
            "positions",
            f"shape (i,) = ({i},) or (b, i) = ({b}, {i})",
            tuple(positions.shape),
            "give one position per new token",
        )


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE; Su et al., 2021, RoFormer) in the "rotate half" layout.

    Each head vector of size d is split into halves; the pair (x[m], x[m + d/2]) is
    rotated by the angle ``pos * base^(-2m/d)``, m = 0 .. d/2 - 1::

        out[m]       = x[m] cos(a) - x[m + d/2] sin(a)
        out[m + d/2] = x[m + d/2] cos(a) + x[m] sin(a)

    This is the layout of GPT-NeoX, LLaMA and Hugging Face ``rotate_half`` (not the
    interleaved (x[2m], x[2m+1]) pairing of the paper and GPT-J): checkpoints from those
    models load as they are. Because every pair turns by an angle proportional to its
    position, ``<rotate(q, m), rotate(k, n)>`` depends only on m - n.

    Args:
        head_dim: d, the per-head size of queries and keys; a positive even int.
        base: the wavelength base (10000.0 in the paper; larger values stretch the context).

    The cos/sin tables are cached per position in float32 (float64 for float64 inputs),
    computed in float64 so that large positions keep their precision. The cache grows on
    demand (doubling) and costs ``2 * positions * d/2`` floats; it is a non-persistent buffer.

    Example:
        >>> import torch
        >>> rope = RotaryEmbedding(head_dim=8)
        >>> q, k = torch.randn(2, 6, 5, 8), torch.randn(2, 3, 5, 8)   # (b, h, i, d), (b, g, j, d)
        >>> q_rot, k_rot = rope(q, k, offset=4)                       # positions 4 .. 8
        >>> tuple(q_rot.shape), tuple(k_rot.shape)
        ((2, 6, 5, 8), (2, 3, 5, 8))
        >>> torch.allclose(rope.rotate(q, 4), rope.rotate(q, torch.arange(4, 9)))
        True
    """

    _cos_sin: torch.Tensor  # the buffer registered in __init__

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        self.head_dim = _check_even_dim("head_dim", head_dim)
        self.base = _check_base(base)
        # cos and sin of pos * base^(-2m/d), stacked: (2, positions cached, d/2); one buffer, so that it is
        # replaced in one assignment; not saved, moved by .to(device)
        self.register_buffer("_cos_sin", torch.empty(2, 0, head_dim // 2), persistent=False)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate queries and keys; keys sit at positions offset .. offset + j - 1.

        Args:
            q: (b, h, i, d), or unbatched (h, i, d).
            k: (b, g, j, d), or unbatched (g, j, d); g may differ from h (grouped heads).
            offset: the position of the first key: the number of tokens already in the
                KV cache when q and k are the new tokens.

        Returns:
            (q rotated, k rotated), the shapes and dtypes of q and k.

        Queries are aligned bottom-right with the keys, as in the causal masks: the last
        query sits at the last key's position. With i == j (prefill, or new tokens with a
        cache) both use positions offset .. offset + i - 1. For i = 2, j = 5, offset = 0::

            keys     0 1 2 3 4
            queries        3 4

        i > j is rejected; rotate each tensor with :meth:`rotate` and explicit positions.

        Example:
            >>> import torch
            >>> rope = RotaryEmbedding(4)
            >>> q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
            >>> q_rot, k_rot = rope(q, k)
            >>> torch.allclose((q_rot * k_rot).sum(-1), (q * k).sum(-1))  # same positions: scores unchanged
            True
        """
        offset = _check_offset("offset", offset)
        _check_tensor("q", q, "(b, h, i, d), or unbatched (h, i, d)", (3, 4), self.head_dim, "head_dim")
        _check_tensor("k", k, "(b, g, j, d), or unbatched (g, j, d)", (3, 4), self.head_dim, "head_dim")
        i, j = q.shape[-2], k.shape[-2]
        if i > j:
            raise bad_argument(
                "q",
                f"at most j = {j} query positions (queries are aligned bottom-right with the keys)",
                f"i = {i}",
                "rotate q and k separately with rotate(q, positions) and rotate(k, positions)",
            )
        return self._rotate_range(q, offset + j - i, "offset"), self._rotate_range(k, offset, "offset")

    def rotate(self, x: torch.Tensor, positions: int | torch.Tensor = 0, *, grow: bool = True) -> torch.Tensor:
        """Rotate x as if its rows stood at ``positions``.

        Args:
            x: (b, h, n, d), or unbatched (h, n, d).
            positions: an int offset (rows at offset .. offset + n - 1), or an integer tensor
                of non-negative positions, (n,) shared by the batch or (b, n) one row per
                batch element (e.g. left-padded batches). A CPU tensor is read on the host: a
                negative position is refused and the cached tables cover the largest, where
                that is worth it (:func:`worth_a_table`: positions far apart, such as 0 and
                2**27, are computed for the call alone, at the cost of what they ask). A tensor
                on a device (CUDA) is never read, as reading it would wait for the device: its
                angles are computed on the device for this call, without the tables, and a
                negative position there rotates by a negative angle (no check).
            grow: grow the cached tables when they are too short. With False, positions past
                them are computed for this call only (the layer grows the tables with
                :meth:`reserve` once its whole call has succeeded, so a failed call changes nothing).

        Returns:
            x rotated: shape and dtype of x.

        Example:
            >>> import torch
            >>> rope = RotaryEmbedding(6)
            >>> x = torch.randn(2, 3, 5, 6)                                  # (b, h, n, d)
            >>> per_row = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])   # (b, n)
            >>> torch.allclose(rope.rotate(x, per_row)[1], rope.rotate(x[1], 7))
            True
        """
        _check_tensor("x", x, "(b, h, n, d), or unbatched (h, n, d)", (3, 4), self.head_dim, "head_dim")
        if not isinstance(positions, torch.Tensor):
            return self._rotate_range(x, _check_offset("positions", positions), "positions", grow)
        n = x.shape[-2]
        if positions.dtype == torch.bool or positions.is_floating_point() or positions.is_complex():
            raise bad_argument(
                "positions",
                "an int or an integer tensor of positions",
                describe(positions),
                "convert with positions.long()",
                kind=TypeError,
            )
        batched_shape = f" or (b, n) = ({x.shape[0]}, {n})" if x.ndim == 4 else " (x is unbatched (h, n, d))"
        if (
            positions.ndim not in (1, 2)
            or positions.shape[-1] != n
            or (positions.ndim == 2 and (x.ndim != 4 or positions.shape[0] != x.shape[0]))
        ):
            raise bad_argument(
                "positions",
                f"shape (n,) = ({n},){batched_shape}, one per row of x",
                f"shape {tuple(positions.shape)}",
                "pass one position per row of x (x.shape[-2])",
            )
        if n == 0:
            return x.clone()
        if not host_readable(positions):
            # on a device, traced by torch.compile, or fake: no value read (a device sync, or none to read), so no
            # table to size: the angles are computed in float64 for these positions, on x's device
            cos, sin = self._cos_sin_of(positions.to(device=x.device, dtype=torch.long), x)
        else:
            lowest, highest = torch.stack((positions.min(), positions.max())).tolist()  # a CPU tensor: no sync
            if lowest < 0:
                raise bad_argument(
                    "positions",
                    "non-negative positions",
                    f"a minimum of {lowest}",
                    "count positions from 0, the first token of the sequence",
                )
            _check_exact("positions", highest)
            positions = to_device(positions.long(), x.device)
            if self._covers(highest + 1, x) or (grow and self._worth_a_table(highest + 1, positions.numel(), x)):
                cos, sin = self._tables(highest + 1, x, "positions")
                cos, sin = cos[positions], sin[positions]  # (n, d/2) or (b, n, d/2)
            else:
                cos, sin = self._cos_sin_of(positions, x)
        if positions.ndim == 2:
            cos, sin = cos[:, None], sin[:, None]  # (b, 1, n, d/2): shared by the heads of each batch row
        return self._rotate_pairs(x, cos, sin)

    def reserve(self, length: int, like: torch.Tensor, *, asked: int | None = None) -> None:
        """Grow the cached tables to cover positions 0 .. length - 1 for tensors like ``like``, where they fit
        in memory (past that, rotations compute their angles per call); with ``asked`` (the positions a call of
        scattered positions asked for), only where a table is worth it for them (:func:`worth_a_table`), as
        :meth:`rotate` grows them."""
        if torch.compiler.is_compiling():  # compiled graphs compute their angles in the graph
            return
        if asked is not None and not (self._covers(length, like) or self._worth_a_table(length, asked, like)):
            return
        try:
            self._tables(length, like, "length")
        except ValueError:  # a table that cannot fit: rotate(grow=False) keeps computing per call
            pass

    # ----------------------------------------------------------------------- internals

    def _covers(self, length: int, x: torch.Tensor) -> bool:
        table = self._cos_sin
        return table.device == x.device and table.dtype == _table_dtype(x.dtype) and table.shape[-2] >= length

    def _worth_a_table(self, length: int, asked: int, x: torch.Tensor) -> bool:
        table = self._cos_sin
        same_place = table.device == x.device and table.dtype == _table_dtype(x.dtype)
        return worth_a_table(length, asked, table.shape[-2] if same_place else 0)

    def _rotate_range(self, x: torch.Tensor, offset: int, name: str, grow: bool = True) -> torch.Tensor:
        n = x.shape[-2]
        compiling = torch.compiler.is_compiling()  # first: a graph must not branch on the length
        if compiling or not (self._covers(offset + n, x) or (grow and self._worth_a_table(offset + n, n, x))):
            # no table growth: in a compiled graph the table's length would pin the sequence length, and
            # with grow=False the call must leave the tables as they are
            return self._rotate_pairs(x, *self._cos_sin_of(torch.arange(offset, offset + n, device=x.device), x))
        cos, sin = self._tables(offset + n, x, name)
        return self._rotate_pairs(x, cos[offset : offset + n], sin[offset : offset + n])  # tables (n, d/2)

    def _cos_sin_of(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the angles of ``positions`` (any shape (...)), each (..., d/2) in x's table dtype:
        computed in float64 like the tables, without caching them (torch.compile's graphs, rotate(grow=False))."""
        inverse = _inverse_frequencies(self.head_dim, self.base, x.device)  # (d/2,)
        angles = positions.to(torch.float64)[..., None] * inverse  # (..., d/2)
        dtype = _table_dtype(x.dtype)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _tables(self, length: int, x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions 0 .. >= length - 1, each (positions, d/2), in x's table dtype and device;
        ``name`` is the argument that asked for them (named if they cannot fit)."""

        def build(size: int) -> torch.Tensor:  # (2, size, d/2) in float64
            angles = (
                torch.arange(size, dtype=torch.float64)[:, None]
                * _inverse_frequencies(self.head_dim, self.base)[None, :]
            )  # (size, d/2)
            return torch.stack((angles.cos(), angles.sin()))

        table = _table_for(
            self, "_cos_sin", length, x.device, _table_dtype(x.dtype), build, row_size=self.head_dim, name=name
        )
        return table[0], table[1]

    def _rotate_pairs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the pairs (x[m], x[m + d/2]); cos, sin broadcast against (..., n, d/2)."""
        half = self.head_dim // 2
        xt = x.to(cos.dtype)
        x1, x2 = xt[..., :half], xt[..., half:]  # (..., n, d/2) each
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (..., n, d)
        return out.to(x.dtype)


# --------------------------------------------------------------------------- absolute positions


def _check_length(name: str, n: int, offset: int, max_len: int | None, owner: str) -> None:
    if max_len is not None and offset + n > max_len:
        raise bad_argument(
            name,
            f"offset + length <= max_len = {max_len}",
            f"offset {offset} + length {n} = {offset + n}",
            f"truncate the sequence so that offset + length <= {max_len}, or construct "
            f"{owner} with max_len >= {offset + n}",
        )


def _sinusoid(positions: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """PE rows of ``positions`` (n,), in float64 on their device: (n, dim), sin and cos interleaved per pair."""
    inverse = _inverse_frequencies(dim, base, positions.device)  # (dim/2,)
    angles = positions.to(torch.float64)[:, None] * inverse[None, :]  # (n, dim/2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).reshape(len(positions), dim)


class SinusoidalPositions(nn.Module):
    """The fixed sinusoidal table of Vaswani et al. (2017), added to the input.

    Interleaved as in the paper, for m = 0 .. dim/2 - 1::

        PE[pos, 2m]     = sin(pos / base^(2m/dim))
        PE[pos, 2m + 1] = cos(pos / base^(2m/dim))

    so that PE[pos + k] is a fixed rotation of PE[pos] in every (2m, 2m + 1) pair.

    Args:
        dim: the feature size of the input; a positive even int.
        max_len: the number of positions allowed, or None (default) for no limit.
        base: the wavelength base (10000.0 in the paper).

    No parameters: the table is computed in float64 on demand and cached in float32
    (float64 for float64 inputs) as a non-persistent buffer.

    Example:
        >>> import torch
        >>> pe = SinusoidalPositions(dim=6)
        >>> x = torch.zeros(2, 5, 6)                                      # (b, n, dim)
        >>> torch.equal(pe(x, offset=3)[0], pe.table(5, offset=3))
        True
        >>> pe.table(1, offset=0).tolist()                                # pos 0: sin 0 = 0, cos 0 = 1
        [[0.0, 1.0, 0.0, 1.0, 0.0, 1.0]]
    """

    _table: torch.Tensor  # the buffer registered in __init__

    def __init__(self, dim: int, max_len: int | None = None, base: float = 10000.0):
        super().__init__()
        self.dim = _check_even_dim("dim", dim)
        if max_len is not None:
            max_len = _check_int(
                "max_len",
                max_len,
                minimum=1,
                expected="a positive int or None",
                fix="pass the longest sequence to allow, or None for no limit",
            )
        self.max_len = max_len
        self.base = _check_base(base)
        self.register_buffer("_table", torch.empty(0, dim), persistent=False)  # (positions cached, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_len={self.max_len}, base={self.base}"

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x + PE[offset : offset + n], in x's dtype.

        Args:
            x: (b, n, dim), or unbatched (n, dim).
            offset: the position of the first row (tokens already seen, for incremental decoding).

        Returns:
            the shape and dtype of x.
        """
        _check_tensor("x", x, "(b, n, dim), or unbatched (n, dim)", (2, 3), self.dim, "dim")
        offset = _check_offset("offset", offset)
        n = x.shape[-2]
        _check_length("x", n, offset, self.max_len, "SinusoidalPositions")
        # in a compiled graph a cached table would pin the length; far positions are computed for the call alone
        pe = self._rows(offset, n, x.device, _table_dtype(x.dtype), cache=not torch.compiler.is_compiling())
        return (x + pe).to(x.dtype)  # one rounding for half-precision x

    def table(
        self, n: int, offset: int = 0, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """PE[offset : offset + n] as a new (n, dim) tensor.

        Args:
            n: the number of positions.
            offset: the first position.
            dtype: a floating dtype for the result (computed in float64, cached in float32 or float64).
            device: where to put it (default: where the module's buffers are).

        Example:
            >>> pe = SinusoidalPositions(4)
            >>> pe.table(3, offset=2).shape
            torch.Size([3, 4])
        """
        n = _check_int(
            "n",
            n,
            minimum=0,
            expected="a non-negative int (number of positions)",
            fix="pass the sequence length, e.g. x.shape[-2]",
        )
        offset = _check_offset("offset", offset)
        dtype = floating_dtype("dtype", dtype, allow_none=False)
        _check_length("n", n, offset, self.max_len, "SinusoidalPositions")
        where = self._table.device if device is None else usable_device("device", device, allow_none=False)
        return self._rows(offset, n, where, _table_dtype(dtype)).to(dtype, copy=True)

    def _rows(self, offset: int, n: int, device: torch.device, dtype: torch.dtype, cache: bool = True) -> torch.Tensor:
        """PE[offset : offset + n] (n, dim) in ``dtype``: from the cached table where it covers them or is worth
        growing (:func:`worth_a_table`), else computed for these positions alone."""
        table = self._table
        current = table.shape[-2] if table.device == device and table.dtype == dtype else 0
        if cache and worth_a_table(offset + n, n, current):
            return self._cached(offset + n, device, dtype, "offset")[offset : offset + n]
        return _sinusoid(torch.arange(offset, offset + n, device=device), self.dim, self.base).to(dtype)

    def _cached(self, length: int, device: torch.device, dtype: torch.dtype, name: str) -> torch.Tensor:
        """PE for positions 0 .. >= length - 1: (positions, dim)."""

        def build(size: int) -> torch.Tensor:  # (size, dim) in float64
            return _sinusoid(torch.arange(size), self.dim, self.base)

        return _table_for(self, "_table", length, device, dtype, build, row_size=self.dim, cap=self.max_len, name=name)


class LearnedPositions(nn.Module):
    """A learned table of absolute positions (BERT, GPT-2), added to the input.

    Args:
        max_len: the number of positions, i.e. rows of the table.
        dim: the feature size of the input.
        device, dtype: for the table, as in torch.nn layers.

    Attributes:
        weight: nn.Parameter (max_len, dim), initialised N(0, 0.02^2) as in BERT and GPT-2.

    Example:
        >>> import torch
        >>> pos = LearnedPositions(max_len=16, dim=6)
        >>> x = torch.zeros(2, 5, 6)                                      # (b, n, dim)
        >>> torch.equal(pos(x, offset=3)[1], pos.weight[3:8])
        True
    """

    def __init__(
        self, max_len: int, dim: int, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.max_len = _check_int(
            "max_len",
            max_len,
            minimum=1,
            expected="a positive int",
            fix="pass the longest sequence the model should accept, e.g. max_len=512",
        )
        self.dim = _check_int(
            "dim", dim, minimum=1, expected="a positive int", fix="pass the feature size of the input, e.g. dim=768"
        )
        device, dtype = usable_device("device", device), floating_dtype("dtype", dtype)
        check_fits(
            "max_len",
            (self.max_len, self.dim),
            dtype or torch.get_default_dtype(),
            device,
            "use a smaller max_len or dim",
            what="the table",
        )
        self.weight = nn.Parameter(torch.empty(self.max_len, self.dim, device=device, dtype=dtype))  # (max_len, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, dim={self.dim}"

    def forward(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x + weight[offset : offset + n], or x + weight[positions], in x's dtype.

        Args:
            x: (b, n, dim), or unbatched (n, dim).
            offset: the position of the first row (tokens already seen, for incremental decoding).
            positions: instead of an offset, each token's own position: (b, n) or (n,) int (packed documents:
                :func:`multihead.masks.document_positions`); each below max_len (checked where the host can read
                them).

        Returns:
            the shape and dtype of x. Gradients reach only the rows of weight read.
        """
        _check_tensor("x", x, "(b, n, dim), or unbatched (n, dim)", (2, 3), self.dim, "dim")
        n = x.shape[-2]
        if positions is not None:
            if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.shape[-1] != n:
                raise bad_argument(
                    "positions",
                    f"an int tensor (b, {n}) or ({n},), a position per token",
                    describe(positions),
                    "pass masks.document_positions(ids) or torch.arange(n)",
                    kind=TypeError,
                )
            if (
                positions.device.type == "cpu"
                and positions.numel()
                and not 0 <= int(positions.min()) <= int(positions.max()) < self.max_len
            ):
                raise bad_argument(
                    "positions",
                    f"positions in [0, {self.max_len}) (the table's rows)",
                    f"[{int(positions.min())}, {int(positions.max())}]",
                    "use positions below max_len",
                )
            return (x + self.weight[positions.long()]).to(x.dtype)  # weight rows (.., n, dim)
        offset = _check_offset("offset", offset)
        _check_length("x", n, offset, self.max_len, "LearnedPositions")
        return (x + self.weight[offset : offset + n]).to(x.dtype)  # weight rows (n, dim)
