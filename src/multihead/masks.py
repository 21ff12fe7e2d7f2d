"""Typed attention masks.

A mask says which keys each query may attend to, and optionally adds a bias to
the scores. Typed masks remove the polarity question and never build an
``i x j`` tensor unless a backend asks for one: a kernel evaluates them one
block at a time, and skips blocks they rule out entirely.

    causal()                 j <= i (+ offset for unequal lengths, see below)
    window(left, right)      sliding window around the (aligned) diagonal
    padding(lengths)         key j is real for batch row b when j < lengths[b]
    padding(valid)           ... or from a (b, j) boolean of real tokens
    alibi(slopes)            additive -slope_h * |i - j| (Press et al., 2022)
    bias(tensor)             any additive float tensor broadcastable to (b, h, i, j)
    allowed(tensor)          any boolean tensor broadcastable to (b, h, i, j), True = may attend
    softcap(cap)             logit soft-capping: score -> cap * tanh(score / cap), before the bias
    custom(mask_mod, score_mod, block_mod)
                             your own, as functions of (b, h, q_idx, kv_idx): FlexAttention's model, on every backend

Masks combine with ``&``: keys must be allowed by every boolean term, and the
bias terms add up. A plain tensor is accepted wherever a mask is: boolean means
True = may attend, floating means additive. Per (query, key) pair the kernels compute

    s = (q . k) * scale;  s = cap * tanh(s / cap) (with a soft-cap);  s = s + bias;  masked -> -inf

Alignment when the query length i differs from the key length j
----------------------------------------------------------------
``"bottom_right"`` (the default) aligns the last query with the last key, which
is what a KV cache needs: query ``i`` sits at key position ``i + (j - i_len)``.
``"top_left"`` aligns the first query with the first key. For i = 3, j = 5
(``x`` = may attend)::

    bottom_right          top_left
    x x x . .             x . . . .
    x x x x .             x x . . .
    x x x x x             x x x . .

With i > j, bottom-right alignment leaves the first ``i - j`` rows with no key
at all; such fully masked rows give output 0 on every backend.
"""

from __future__ import annotations

import enum
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from multihead._errors import bad_argument, checked_flag, describe
from multihead._limits import check_fits
from multihead._symbolic import surely

__all__ = [
    "Mask",
    "all_of",
    "BoundMask",
    "BlockState",
    "causal",
    "window",
    "padding",
    "alibi",
    "alibi_slopes",
    "bias",
    "allowed",
    "softcap",
    "as_mask",
    "custom",
]

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


class Mask:
    """Base of the typed masks. Combine with ``&``; bind to sizes with :meth:`bind`."""

    def terms(self) -> tuple[Mask, ...]:
        return (self,)

    def __and__(self, other: Mask | torch.Tensor) -> Mask:
        return all_of(self, other)

    def __rand__(self, other: torch.Tensor) -> Mask:
        return all_of(other, self)

    def bind(self, shape: AttentionShape) -> BoundMask:
        """Validate against the call's sizes and return a mask kernels can evaluate."""
        return BoundMask([term._bind(shape) for term in self.terms()], shape)

    def _bind(self, shape: AttentionShape) -> BoundTerm:  # implemented by primitive masks
        raise TypeError(f"{type(self).__name__} is not a primitive mask")


class Combined(Mask):
    """Several masks at once: every boolean term must allow a pair, bias terms add; at most one soft-cap."""

    def __init__(self, parts: tuple[Mask, ...]):
        caps = [p for p in parts if isinstance(p, _Softcap)]
        if len(caps) > 1:
            raise bad_argument(
                "mask",
                "at most one softcap(...) term in a combined mask",
                " and ".join(repr(c) for c in caps),
                "keep one soft-cap: scores are capped once, with one cap",
            )
        self.parts = parts

    def terms(self) -> tuple[Mask, ...]:
        return self.parts

    def __repr__(self) -> str:
        return " & ".join(repr(p) for p in self.parts)


# --------------------------------------------------------------------------- primitives


class _Diagonal(Mask):
    """Keys within [p - left, p + right] of the aligned query position p; None = unbounded."""

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


class _Padding(Mask):
    def __init__(self, keys: torch.Tensor | Sequence[int]):
        given = None  # the Python values, when keys is not a tensor
        if not isinstance(keys, torch.Tensor):
            given = keys
            try:
                keys = torch.as_tensor(keys)
            except (TypeError, ValueError, RuntimeError):
                raise bad_argument(
                    "padding(keys)",
                    "a (b,) tensor of key lengths or a (b, j) bool tensor",
                    describe(keys),
                    "pass torch.tensor(lengths) or a boolean (b, j) tensor",
                    kind=TypeError,
                ) from None
        if keys.dtype == torch.bool:
            if keys.ndim != 2:
                raise bad_argument(
                    "padding(keys)",
                    "a (b, j) bool tensor of real keys",
                    describe(keys),
                    "pass one row per batch element, True where the key is a real token",
                )
        elif not keys.is_floating_point() and not keys.is_complex():
            if keys.ndim != 1:
                raise bad_argument(
                    "padding(keys)",
                    "a (b,) integer tensor of key lengths",
                    describe(keys),
                    "pass one length per batch element",
                )
        else:
            raise bad_argument(
                "padding(keys)",
                "integer lengths (b,) or a bool (b, j) tensor",
                describe(keys),
                "convert with .long() for lengths or .bool() for a validity mask",
                kind=TypeError,
            )
        self.keys = keys
        # lengths given as Python ints stay known on the host: bound masks answer from them, never from a tensor
        self.lengths = tuple(int(n) for n in given) if given is not None and keys.dtype != torch.bool else None

    def __repr__(self) -> str:
        return f"padding({'valid' if self.keys.dtype == torch.bool else 'lengths'}={tuple(self.keys.shape)})"

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        if self.keys.dtype == torch.bool:
            if tuple(self.keys.shape) != (shape.batch, shape.k_len):
                raise bad_argument(
                    "padding(valid)",
                    f"shape (b, j) = ({shape.batch}, {shape.k_len})",
                    tuple(self.keys.shape),
                    "give one row per batch element and one column per key",
                )
            host = self.keys if host_readable(self.keys) else None
            return _BoundPadding(_moved("padding(keys)", self.keys, shape.device), shape, host_valid=host)
        if self.keys.shape[0] != shape.batch:
            raise bad_argument(
                "padding(lengths)",
                f"shape (b,) = ({shape.batch},)",
                tuple(self.keys.shape),
                "give one key length per batch element",
            )
        lengths = self.lengths
        if lengths is None and host_readable(self.keys):
            lengths = tuple(self.keys.tolist())  # a CPU tensor: read without waiting on any device
        if lengths and (min(lengths) < 0 or max(lengths) > shape.k_len):
            raise bad_argument(
                "padding(lengths)",
                f"lengths in [0, {shape.k_len}] (the key length j)",
                f"values from {min(lengths)} to {max(lengths)}",
                "clip the lengths to the number of keys",
            )
        keys = _moved("padding(keys)", self.keys, shape.device)
        valid = torch.arange(shape.k_len, device=shape.device) < keys[:, None]  # (b, j), built on the device
        # not under torch.compile: block states from Python ints would make the graph depend on each batch's lengths
        return _BoundPadding(valid, shape, lengths=None if torch.compiler.is_compiling() else lengths or None)


def padding(keys: torch.Tensor | Sequence[int]) -> Mask:
    """Mask padded keys: ``keys`` is a (b,) tensor of key lengths, or a (b, j) bool tensor, True = real.

    Lengths given as Python ints or in a CPU tensor are known on the host: out of [0, j] they are
    refused when the mask is bound, and kernels skip the blocks of keys they rule out. Lengths in a
    device tensor (CUDA) are never read on the host, since reading one waits for the device: they are
    used as they are (a length above j keeps every key, one below 0 masks the whole row), and blocks
    are masked key by key. The same holds for a (b, j) bool tensor, and wherever values cannot be read
    at all (meta or fake tensors, torch.compile's tracing).
    """
    return _Padding(keys)


class _Alibi(Mask):
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


class _Dense(Mask):
    """A user tensor broadcastable to (b, h, i, j): boolean (True = may attend) or additive float."""

    def __init__(self, tensor: torch.Tensor, name: str):
        if not isinstance(tensor, torch.Tensor):
            raise bad_argument(
                name, "a torch.Tensor", describe(tensor), "wrap the values with torch.as_tensor", kind=TypeError
            )
        if tensor.dtype != torch.bool and not tensor.is_floating_point():
            raise bad_argument(
                name,
                "a bool tensor (True = may attend) or a floating tensor (added to scores)",
                describe(tensor),
                "convert with .bool() for a keep-mask or .float() for a bias",
                kind=TypeError,
            )
        if tensor.ndim > 4:
            raise bad_argument(
                name, "at most 4 dims, broadcastable to (b, h, i, j)", describe(tensor), "drop the extra dimensions"
            )
        self.tensor, self.name = tensor, name

    @property
    def is_bias(self) -> bool:
        return self.tensor.is_floating_point()

    def __repr__(self) -> str:
        return f"{'bias' if self.is_bias else 'allowed'}(shape={tuple(self.tensor.shape)})"

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        target = (shape.batch, shape.heads, shape.q_len, shape.k_len)
        t = self.tensor.reshape((1,) * (4 - self.tensor.ndim) + tuple(self.tensor.shape))
        if any(size not in (1, want) for size, want in zip(t.shape, target, strict=True)):
            raise bad_argument(
                self.name,
                f"a shape broadcastable to (b, h, i, j) = {target} (each dim 1 or equal)",
                tuple(self.tensor.shape),
                "reshape the mask so each dimension is 1 or matches, e.g. (b, 1, 1, j) for keys",
            )
        if t.device != shape.device:
            raise bad_argument(
                self.name,
                f"a tensor on {shape.device} (the device of q)",
                f"one on {t.device}",
                f"move it with .to({str(shape.device)!r})",
            )
        return _BoundDense(t, shape)


def bias(tensor: torch.Tensor) -> Mask:
    """An additive float bias broadcastable to (b, h, i, j); -inf entries mask pairs out."""
    mask = _Dense(tensor, "bias(tensor)")
    if not mask.is_bias:
        raise bad_argument(
            "bias(tensor)",
            "a floating tensor",
            describe(tensor),
            "use multihead.masks.allowed for a boolean mask",
            kind=TypeError,
        )
    return mask


def allowed(tensor: torch.Tensor) -> Mask:
    """A boolean mask broadcastable to (b, h, i, j): True = may attend."""
    mask = _Dense(tensor, "allowed(tensor)")
    if mask.is_bias:
        raise bad_argument(
            "allowed(tensor)",
            "a bool tensor (True = may attend)",
            describe(tensor),
            "use multihead.masks.bias for an additive float mask",
            kind=TypeError,
        )
    return mask


class _Softcap(Mask):
    def __init__(self, cap: float):
        if not isinstance(cap, numbers.Real) or isinstance(cap, bool):
            raise bad_argument(
                "softcap(cap=...)",
                "a finite real number > 0",
                describe(cap),
                "pass the cap as a float, e.g. softcap(50.0)",
                kind=TypeError,
            )
        try:
            value = float(cap)
        except OverflowError:  # an int beyond float's range
            value = math.inf
        if not (math.isfinite(value) and value > 0):  # NaN fails both tests
            raise bad_argument(
                "softcap(cap=...)",
                "a finite real number > 0",
                cap if math.isfinite(value) or not isinstance(cap, int) else describe(cap),  # a huge int: shortened
                "pass a positive cap, e.g. softcap(50.0) (Gemma 2 uses 50.0); leave the term out for no cap",
            )
        self.cap: float = value

    def __repr__(self) -> str:
        return f"softcap(cap={self.cap!r})"

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        return _BoundSoftcap(self.cap)


def softcap(cap: float) -> Mask:
    """Logit soft-capping: each scaled score s becomes ``cap * tanh(s / cap)``, smoothly bounded to (-cap, cap).

    Per (query, key) pair, the order is::

        s = (q . k) * scale
        s = cap * tanh(s / cap)      # this term
        s = s + bias                 # alibi(...), bias(...), float tensors: added after the cap
        s = -inf where masked        # causal, window, padding, allowed, -inf biases
        weights = softmax(s)

    The cap applies to the scaled score before any bias is added, as in Gemma 2 (Gemma Team, "Gemma 2:
    Improving Open Language Models at a Practical Size", 2024: attention logits capped at 50.0) and in
    FlashAttention's and FlexAttention's ``softcap`` option. Combine with ``&``
    (``causal() & softcap(50.0)``); a mask holds at most one soft-cap. ``cap`` must be a finite real > 0.
    Backends that apply no transform to the scores (torch's SDPA) do not serve it; ``auto`` picks another.
    """
    return _Softcap(cap)


# --------------------------------------------------------------------------- masks written as functions

ModFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _checked_function(name: str, function: object, fix: str) -> None:
    """Refuse what is not a function of four positional arguments (b, h, q_idx, kv_idx)."""
    if not callable(function):
        raise bad_argument(name, "a function of (b, h, q_idx, kv_idx)", describe(function), fix, kind=TypeError)
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: its first call says
        return
    kinds = [p.kind for p in parameters]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    takes = sum(kind in positional for kind in kinds)
    required = sum(kind in positional and p.default is p.empty for kind, p in zip(kinds, parameters, strict=True))
    if inspect.Parameter.VAR_POSITIONAL not in kinds and takes < 4 or required > 4:
        raise bad_argument(
            name, "a function of four arguments (b, h, q_idx, kv_idx)", _arity(takes, required), fix, kind=TypeError
        )


def _arity(takes: int, required: int) -> str:
    return (
        f"one of {required} argument{'s' * (required != 1)}"
        if takes == required
        else (f"one of {required} to {takes} arguments")
    )


SCORE_MOD_FIX = (
    "write the bias alone: score_mod(b, h, q_idx, kv_idx) returns what is added to the score, so FlexAttention's "
    "`lambda score, b, h, q, kv: score + bias[h, q - kv]` becomes `lambda b, h, q, kv: bias[h, q - kv]`"
)


def custom(
    mask_mod: ModFunction | None = None,
    score_mod: ModFunction | None = None,
    block_mod: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    | None = None,
    *,
    monotone: bool = False,
) -> Mask:
    """A mask written as functions of positions, FlexAttention's ``mask_mod`` / ``score_mod`` model, run by every
    backend, forward and backward: combine it with ``&`` like any mask.

    - ``mask_mod(b, h, q_idx, kv_idx) -> bool``: True where the query may attend the key.
    - ``score_mod(b, h, q_idx, kv_idx) -> float``: a bias added to the scaled (and soft-capped) score, where
      FlexAttention's own ``score_mod(score, ...)`` returns ``score + bias``. Gradients reach the tensors it
      reads that require grad (a learned relative-position table, T5-style); auto then picks a backend that
      differentiates a bias (the reference). ``-inf`` masks the pair.
    - ``block_mod(q_start, q_stop, kv_start, kv_stop) -> (empty, full)``: optional, what ``mask_mod`` does to
      blocks of pairs, so kernels skip the empty ones and run full ones without the mask. The arguments are int64
      block bounds, half-open ([start, stop)), shaped (q_blocks, 1) and (1, kv_blocks); ``empty`` (bool,
      broadcast to (q_blocks, kv_blocks)) where ``mask_mod`` is False for every pair, batch row and head of the
      block, ``full`` where it is True for all of them.
    - ``monotone=True`` instead of a ``block_mod`` says that along every row and every column of each (batch
      row, head) the mask changes at most once, the same way for all (causal, prefix-LM, padding): the four
      corners of a block then settle it, and are all that is evaluated. With neither, every block is evaluated
      pair by pair (correct, without skipping).

    The functions are vectorised: they get int64 tensors that broadcast together, shaped (b, 1, 1, 1),
    (1, h, 1, 1), (1, 1, rows, 1) and (1, 1, 1, cols) for a block, or 0-d under FlexAttention's vmap. So write
    them with tensor operations (``&``, ``|``, ``torch.where``, indexing a tensor by them), not ``and`` / ``if``.
    ``q_idx`` counts the call's queries from 0 and ``kv_idx`` its keys: with a KV cache, a query's position in
    the sequence is ``q_idx + (kv_len - q_len)``.

        >>> documents = torch.tensor([[0, 0, 0, 1, 1, 2]])  # (b, n): the document of each position
        >>> same_document = custom(lambda b, h, q, kv: documents[b, q] == documents[b, kv])
        >>> prefix_lm = custom(lambda b, h, q, kv: (kv <= q) | (kv < 3), monotone=True)
    """
    for name, function in (("mask_mod", mask_mod), ("score_mod", score_mod), ("block_mod", block_mod)):
        if function is not None:
            fix = SCORE_MOD_FIX if name == "score_mod" else f"pass {name}=lambda b, h, q_idx, kv_idx: ..."
            if name == "block_mod":
                fix = "pass block_mod=lambda q_start, q_stop, kv_start, kv_stop: (empty, full)"
            _checked_function(name, function, fix)
    monotone = checked_flag("monotone", monotone)
    if mask_mod is None and score_mod is None:
        raise bad_argument(
            "custom",
            "a mask_mod, a score_mod or both",
            "neither",
            "pass mask_mod=... and/or score_mod=...",
            kind=TypeError,
        )
    if mask_mod is None and (block_mod is not None or monotone):
        raise bad_argument(
            "block_mod" if block_mod is not None else "monotone",
            "a mask_mod to classify blocks of",
            "a score_mod alone",
            "pass the mask_mod too, or leave block_mod and monotone out (a bias skips no block)",
        )
    if block_mod is not None and monotone:
        raise bad_argument(
            "monotone",
            "False when a block_mod is given (the block_mod classifies blocks)",
            True,
            "give a block_mod or monotone=True, not both",
        )
    parts: list[Mask] = []
    if mask_mod is not None:
        parts.append(_CustomMask(mask_mod, block_mod, monotone))
    if score_mod is not None:
        parts.append(_CustomScores(score_mod))
    return parts[0] if len(parts) == 1 else Combined(tuple(parts))


def _name(function: Callable) -> str:
    return getattr(function, "__qualname__", type(function).__name__)


def _probed(name: str, function: ModFunction, shape: AttentionShape, floating: bool) -> torch.Tensor:
    """``function`` called once on a 2 x 2 block of position 0, on the call's device, and its result checked (a
    bool or a float tensor), so that a wrong function is named when the mask is bound, not deep in a kernel: two
    rows and two columns make ``and`` / ``if`` on the positions fail here. The result's shape is checked on each
    block it is evaluated for (:func:`_user_evaluate`)."""
    zero = torch.zeros((), dtype=torch.long, device=shape.device)
    rows, cols = zero.expand(1, 1, 2, 1), zero.expand(1, 1, 1, 2)
    expected = "a floating tensor (the bias)" if floating else "a bool tensor (True = may attend)"
    try:
        value = function(zero.expand(1, 1, 1, 1), zero.expand(1, 1, 1, 1), rows, cols)
    except Exception as error:
        raise bad_argument(
            name,
            "a function of (b, h, q_idx, kv_idx) int64 tensors made of tensor operations",
            f"{_name(function)}, which raised {type(error).__name__}: {error}",
            "use &, |, torch.where and tensor indexing on the positions, not and / or / if",
            kind=TypeError,
        ) from error
    good = isinstance(value, torch.Tensor) and (value.is_floating_point() if floating else value.dtype == torch.bool)
    if not good:
        fix = "return the bias as a float tensor" if floating else "return a comparison, e.g. kv_idx <= q_idx"
        got = describe(value) if isinstance(value, torch.Tensor) else type(value).__name__
        raise bad_argument(name, expected, f"{_name(function)} returning {got}", fix, kind=TypeError)
    return value


class _CustomMask(Mask):
    def __init__(self, mask_mod: ModFunction, block_mod: Callable | None, monotone: bool):
        self.mask_mod, self.block_mod, self.monotone = mask_mod, block_mod, monotone

    def __repr__(self) -> str:
        blocks = f", block_mod={_name(self.block_mod)}" if self.block_mod else ", monotone=True" * self.monotone
        return f"custom(mask_mod={_name(self.mask_mod)}{blocks})"

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        _probed("mask_mod", self.mask_mod, shape, floating=False)
        return _BoundCustomMask(self, shape)


class _CustomScores(Mask):
    def __init__(self, score_mod: ModFunction):
        self.score_mod = score_mod

    def __repr__(self) -> str:
        return f"custom(score_mod={_name(self.score_mod)})"

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        probe = _probed("score_mod", self.score_mod, shape, floating=True)
        return _BoundCustomScores(self, shape, requires_grad=probe.requires_grad)


def _code(function: Callable) -> object:
    """What a compiled kernel's code depends on in a user's function: its code object (a closure made again with
    new tensors shares it), or the object itself."""
    return getattr(function, "__code__", function)


def all_of(*parts: Mask | torch.Tensor) -> Mask:
    """Every one of ``parts`` at once (typed masks, or tensors as :func:`as_mask` reads them): what
    ``a & b & ...`` builds, as a call. Code that torch.compile traces with ``fullgraph=True`` needs the call
    when a part is a tensor: dynamo takes ``mask & tensor`` for a tensor operation and refuses it.

        >>> all_of(causal(), softcap(50.0), torch.ones(1, 1, 4, 4, dtype=torch.bool))
        causal(align='bottom_right') & softcap(cap=50.0) & allowed(shape=(1, 1, 4, 4))
    """
    return Combined(tuple(term for part in parts for term in as_mask(part, name="mask").terms()))


def as_mask(value: Mask | torch.Tensor, *, name: str = "mask") -> Mask:
    """Accept a typed mask or a plain tensor (bool: True = may attend; float: additive)."""
    if isinstance(value, Mask):
        return value
    if isinstance(value, torch.Tensor):
        return _Dense(value, name)
    raise bad_argument(
        name,
        "a multihead.masks mask, a bool tensor or a float tensor",
        describe(value),
        "build one with multihead.masks.causal(), padding(...), window(...) or pass a tensor",
        kind=TypeError,
    )


# --------------------------------------------------------------------------- bound terms


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
    reads_pair_tensor = False  # its mod reads a tensor at (query, key) positions (torch 2.13's CPU flex refuses it)

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

    shape: AttentionShape


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


class _BoundDiagonal(BoundTerm):
    """Keys within [p - left, p + right] of the aligned query position p = q + offset; a side None is unbounded."""

    kind = "diagonal"
    holds_data = False

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

    def key_bounds(self, position: int) -> tuple[float, float]:
        """[lo, hi]: the keys this band lets query row ``position`` (0-based) see, before clipping to [0, j)."""
        p = position + self.offset  # its aligned position
        lo = -math.inf if self.spec.left is None else p - self.spec.left
        hi = math.inf if self.spec.right is None else p + self.spec.right
        return lo, hi


class _BoundPadding(BoundTerm):
    """Keys j < lengths[b] (or valid[b, j]) for batch row b. Block states and empty rows are answered from
    values known on the host (``lengths``: Python ints; ``host_valid``: a CPU (b, j) bool) and never from a
    device tensor: with neither, every block is PARTIAL and any row may be empty (conservative, sync-free)."""

    kind = "padding"

    def __init__(
        self,
        valid: torch.Tensor,
        shape: AttentionShape,
        *,
        lengths: tuple[int, ...] | None = None,
        host_valid: torch.Tensor | None = None,
    ):
        self.keys = valid  # (b, j) on the call's device, True = a real key
        self.valid = valid[:, None, None, :]  # (b, 1, 1, j)
        self.shape = shape
        self.lengths = lengths  # key lengths known on the host, or None
        self.host_valid = host_valid  # (b, j) bool on the CPU, or None
        self._key_counts: tuple[torch.Tensor, torch.Tensor] | None = None  # built on the first block query

    def _cumulative_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per key column, whether some / every batch row has it real, cumulated: two (j + 1,) CPU tensors from
        ``host_valid``, built on the first block state asked for, so a block's state is two lookups."""
        if self._key_counts is None:
            assert self.host_valid is not None
            zero = torch.zeros(1, dtype=torch.long, device="cpu")
            self._key_counts = (
                torch.cat([zero, self.host_valid.any(0).long().cumsum(0)]),
                torch.cat([zero, self.host_valid.all(0).long().cumsum(0)]),
            )
        return self._key_counts

    def span_state(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> BlockState:
        if self.lengths is not None:  # keys below the shortest length are real in every row, from the longest none
            if col_start >= max(self.lengths):
                return BlockState.EMPTY
            return BlockState.FULL if col_stop <= min(self.lengths) else BlockState.PARTIAL
        if self.host_valid is None:
            return BlockState.PARTIAL  # the values are on the device: not read
        any_cum, all_cum = self._cumulative_counts()
        if any_cum[col_stop] == any_cum[col_start]:
            return BlockState.EMPTY
        if all_cum[col_stop] - all_cum[col_start] == col_stop - col_start:
            return BlockState.FULL
        return BlockState.PARTIAL

    def surely_full(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> bool:
        if self.lengths is None and self.host_valid is None:
            return False
        return self.span_state(row_start, row_stop, col_start, col_stop) is BlockState.FULL

    def rule(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        def real_key(b, h, q, k, keys=self.keys):
            return keys[b, k]

        return real_key

    def evaluate(self, rows: Index, cols: Index, heads: torch.Tensor | None) -> torch.Tensor:
        # the mod's values for every batch row, by slicing: a view, and no gather for torch.compile to specialise
        return _select(self.valid, 3, cols)

    def signature(self) -> tuple:
        return "padding", tuple(self.valid.shape)

    def spans(self) -> tuple[bool, bool, bool]:
        return True, False, False

    def may_empty_rows(self) -> bool:
        if self.lengths is not None:
            return min(self.lengths) <= 0
        if self.host_valid is None:
            return True  # nothing read on the host: assume the worst (kernels then guard every row)
        return bool((~self.host_valid.any(-1)).any())  # a CPU tensor: no device waited for

    def host_term(self) -> BoundTerm | None:
        if self.host_valid is not None:
            return _BoundPadding(self.host_valid, _on_cpu(self.shape), host_valid=self.host_valid)
        if self.lengths is None:
            return None
        lengths = torch.tensor(self.lengths, dtype=torch.long, device="cpu")
        valid = torch.arange(self.shape.k_len, device="cpu") < lengths[:, None]  # (b, j)
        return _BoundPadding(valid, _on_cpu(self.shape), lengths=self.lengths)

    def block_states(self, grid: BlockGrid) -> torch.Tensor:
        valid = self.valid[:, 0, 0, :]  # (b, j) on the device: reduced there, never read
        some = _per_block(valid, grid.k_blocks, grid.block_k, False, "any").any(0)  # (k_blocks,): a row has a key
        every = _per_block(valid, grid.k_blocks, grid.block_k, True, "all").all(0)  # every row has every key
        return _states(~some, every)[None, :].expand(grid.q_blocks, grid.k_blocks)


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


class _BoundSoftcap(BoundTerm):
    """Not a mask of pairs: :class:`BoundMask` takes its cap out of the terms (``BoundMask.softcap``)."""

    def __init__(self, cap: float):
        self.cap: float = cap


class _BoundDense(BoundTerm):
    """A caller's tensor, 4-D with each dim 1 or full size: bool (keep) or float (bias)."""

    reads_pair_tensor = True

    def __init__(self, tensor: torch.Tensor, shape: AttentionShape):
        self.tensor, self.shape = tensor, shape
        self.is_bias = self.may_hold_minus_inf = tensor.is_floating_point()
        self.kind = "bias" if self.is_bias else "allowed"
        self.requires_grad = tensor.requires_grad

    def rule(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        def entry(b, h, q, k, t=self.tensor):  # a broadcast dim is read at 0
            sizes = t.shape
            return t[
                b if sizes[0] > 1 else 0, h if sizes[1] > 1 else 0, q if sizes[2] > 1 else 0, k if sizes[3] > 1 else 0
            ]

        return entry

    def evaluate(self, rows: Index, cols: Index, heads: torch.Tensor | None) -> torch.Tensor:
        # the mod's values, by slicing: a view of the caller's tensor rather than a gathered copy of it
        return _select(_select(_select(self.tensor, 1, heads), 2, rows), 3, cols)

    def span_state(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> BlockState:
        """A keep tensor's block read on the host where it can be (a CPU tensor); PARTIAL otherwise."""
        if self.is_bias or not host_readable(self.tensor):
            return BlockState.PARTIAL
        tile = _select(_select(self.tensor, 2, slice(row_start, row_stop)), 3, slice(col_start, col_stop))
        if not bool(tile.any()):
            return BlockState.EMPTY
        return BlockState.FULL if bool(tile.all()) else BlockState.PARTIAL

    def structure(self) -> tuple:
        return self.kind, tuple(size > 1 for size in self.tensor.shape)

    def signature(self) -> tuple:
        return "dense", tuple(self.tensor.shape), self.tensor.dtype, self.requires_grad

    def spans(self) -> tuple[bool, bool, bool]:
        batch, heads, rows, _ = self.tensor.shape
        return batch != 1, heads != 1, rows != 1

    def may_empty_rows(self) -> bool:
        if not host_readable(self.tensor):
            return True  # a device tensor is not read (a sync), nor a fake one: assume the worst
        keep = self.tensor > -math.inf if self.is_bias else self.tensor
        return bool((~keep.any(-1)).any())  # a CPU tensor: no device waited for

    def host_term(self) -> BoundTerm | None:
        return self if host_readable(self.tensor) else None

    def block_states(self, grid: BlockGrid) -> torch.Tensor:
        # a keep tensor (b|1, h|1, i|1, j|1): a tile is empty where no batch row or head keeps a pair of it, full
        # where all keep all; reduced over batch and heads first, then over each tile's rows and columns
        some, every = self.tensor.any(0).any(0), self.tensor.all(0).all(0)  # (i|1, j|1)
        return _states(~_tiled(some, grid, False, "any"), _tiled(every, grid, True, "all"))


def _user_evaluate(
    term: BoundTerm, name: str, function: ModFunction, rows: Index, cols: Index, heads: torch.Tensor | None
) -> torch.Tensor:
    """A user's mod on a block's positions, checked to broadcast to (b, h_sel, rows, cols)."""
    indices = _block_indices(term.shape, rows, cols, heads)
    value = _as_4d(function(*indices))
    target = tuple(len(index.reshape(-1)) for index in indices)
    try:
        fits = torch.broadcast_shapes(value.shape, target) == target
    except RuntimeError:
        fits = False
    if not fits:
        raise bad_argument(
            name,
            f"a result that broadcasts to (b, h, rows, cols) = {target} from positions shaped like it",
            f"{_name(function)} returning shape {tuple(value.shape)}",
            "combine the positions elementwise (no sums or reshapes over them)",
        )
    return value


def _called(function: ModFunction) -> ModFunction:
    """A user's function called from one of ours: handed a function that reads a tensor from its closure directly,
    torch 2.13's inductor writes a CPU FlexAttention kernel that fails to compile (an undeclared split size in its
    C++), and compiles this one. (Our own rules take their values as default arguments, which it compiles.)"""

    def rule(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, function=function) -> torch.Tensor:
        return function(b, h, q, k)

    return rule


def _user_host_term(term: BoundTerm) -> BoundTerm | None:
    """A user's term itself on the CPU, where its function reads host tensors; None on a device (reading its
    values there would wait for the device) and while torch.compile traces."""
    return term if term.shape.device.type == "cpu" and not torch.compiler.is_compiling() else None


class _BoundCustomMask(BoundTerm):
    """A user's mask_mod, with its blocks classified by the user's block_mod, by the four corners of each block
    (monotone), or not at all."""

    kind = "mask_mod"

    def __init__(self, spec: _CustomMask, shape: AttentionShape):
        self.spec, self.shape = spec, shape
        self._span_states: dict[tuple[int, int, int, int], BlockState] = {}

    def rule(self) -> ModFunction:
        return _called(self.spec.mask_mod)

    def evaluate(self, rows: Index, cols: Index, heads: torch.Tensor | None) -> torch.Tensor:
        return _user_evaluate(self, "mask_mod", self.spec.mask_mod, rows, cols, heads)

    def structure(self) -> tuple:
        return self.kind, _code(self.spec.mask_mod)

    def signature(self) -> tuple:
        return self.kind, _code(self.spec.mask_mod), self.spec.block_mod is not None, self.spec.monotone

    def may_empty_rows(self) -> bool:
        """On the CPU, exact where blocks are classified (a row block with a full key block is settled without
        evaluating a pair); elsewhere, or with no classifier, True: kernels guard every row."""
        if self.host_term() is None or (self.spec.block_mod is None and not self.spec.monotone):
            return True
        return BoundMask([self], self.shape)._some_row_empty()

    def host_term(self) -> BoundTerm | None:
        return _user_host_term(self)

    def block_states(self, grid: BlockGrid) -> torch.Tensor:
        (row_start, row_stop), (col_start, col_stop) = grid.rows(), grid.cols()
        return self._classify(row_start, row_stop, col_start, col_stop)

    def span_state(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> BlockState:
        """One block's state, on the CPU only: on a device, reading it would wait for the device (the block is
        then evaluated pair by pair; the vectorised :meth:`block_states` serves flex there)."""
        if self.spec.block_mod is None and not self.spec.monotone:
            return BlockState.PARTIAL
        if self.shape.device.type != "cpu" or torch.compiler.is_compiling():
            return BlockState.PARTIAL
        key = (row_start, row_stop, col_start, col_stop)
        state = self._span_states.get(key)
        if state is None:
            bounds = [torch.tensor([value]) for value in key]
            code = int(self._classify(*bounds)[0, 0])
            state = self._span_states[key] = (BlockState.EMPTY, BlockState.PARTIAL, BlockState.FULL)[code]
        return state

    def surely_full(self, row_start: int, row_stop: int, col_start: int, col_stop: int) -> bool:
        return self.span_state(row_start, row_stop, col_start, col_stop) is BlockState.FULL

    def _classify(
        self, row_start: torch.Tensor, row_stop: torch.Tensor, col_start: torch.Tensor, col_stop: torch.Tensor
    ) -> torch.Tensor:
        """The (q_blocks, k_blocks) int8 states of the blocks [row_start, row_stop) x [col_start, col_stop) (1-D
        bounds, one per block row and column)."""
        size = (len(row_start), len(col_start))
        if self.spec.block_mod is not None:
            result = self.spec.block_mod(row_start[:, None], row_stop[:, None], col_start[None, :], col_stop[None, :])
            if not (
                isinstance(result, tuple)
                and len(result) == 2
                and all(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in result)
            ):
                raise bad_argument(
                    "block_mod",
                    "a pair (empty, full) of bool tensors",
                    f"{_name(self.spec.block_mod)} returning {describe(result)}",
                    "return (empty, full): bool tensors broadcast to (q_blocks, kv_blocks)",
                    kind=TypeError,
                )
            empty, full = result
            return _states(empty, full).expand(size)
        if not self.spec.monotone:
            return torch.full(size, STATE_PARTIAL, dtype=torch.int8, device=self.shape.device)
        # monotone along rows and columns: a block's extremes are at its four corners, for each batch row and head
        corner_rows = torch.stack([row_start, row_stop - 1], -1).reshape(-1)  # (2 q_blocks,)
        corner_cols = torch.stack([col_start, col_stop - 1], -1).reshape(-1)
        keep = _user_evaluate(self, "mask_mod", self.spec.mask_mod, corner_rows, corner_cols, None)
        keep = keep.expand(-1, -1, len(corner_rows), len(corner_cols))
        some = keep.any(0).any(0).reshape(size[0], 2, size[1], 2).any(3).any(1)
        every = keep.all(0).all(0).reshape(size[0], 2, size[1], 2).all(3).all(1)
        return _states(~some, every)


class _BoundCustomScores(BoundTerm):
    """A user's score_mod: the bias it returns is added to the score, -inf masking the pair."""

    kind = "score_mod"
    is_bias = True
    may_hold_minus_inf = True  # a user's bias may mask pairs with -inf: kernels take those as masked

    def __init__(self, spec: _CustomScores, shape: AttentionShape, *, requires_grad: bool):
        self.spec, self.shape, self.requires_grad = spec, shape, requires_grad

    def rule(self) -> ModFunction:
        return _called(self.spec.score_mod)

    def evaluate(self, rows: Index, cols: Index, heads: torch.Tensor | None) -> torch.Tensor:
        return _user_evaluate(self, "score_mod", self.spec.score_mod, rows, cols, heads)

    def host_term(self) -> BoundTerm | None:
        return _user_host_term(self)

    def structure(self) -> tuple:
        return self.kind, _code(self.spec.score_mod)

    def signature(self) -> tuple:
        return self.kind, _code(self.spec.score_mod), self.requires_grad


# --------------------------------------------------------------------------- the bound mask


def _merge_diagonals(terms: list[BoundTerm]) -> list[BoundTerm]:
    """Diagonal terms of one alignment as one band, the tighter bound on each side (causal & window(256) is
    window(256, 0)): kernels then check one band per block instead of several, and a single band settles
    may_empty_rows without looking at any pair. The band takes the place of the first of them."""
    first: dict[str, int] = {}  # alignment -> index of its band in merged
    merged: list[BoundTerm] = []
    for term in terms:
        if not isinstance(term, _BoundDiagonal):
            merged.append(term)
            continue
        align = term.spec.align
        if align not in first:
            first[align] = len(merged)
            merged.append(term)
            continue
        band = merged[first[align]]
        assert isinstance(band, _BoundDiagonal)
        left, right = _tighter(band.spec.left, term.spec.left), _tighter(band.spec.right, term.spec.right)
        name = "causal" if left is None and right == 0 else "window"
        merged[first[align]] = _BoundDiagonal(_Diagonal(left, right, align, name), band.offset, band.shape)
    return merged


def _tighter(a: int | None, b: int | None) -> int | None:
    """The smaller of two bounds, None being unbounded."""
    return b if a is None else a if b is None else min(a, b)


ALIBI_CHUNK_ELEMENTS = 2**24  # the most (heads, rows, keys) entries an ALiBi bias builds before rounding them

EMPTY_ROW_BLOCK = 256  # rows and keys per block BoundMask.may_empty_rows looks at
EMPTY_ROW_CHECK_ELEMENTS = 2**24  # the most (b, h, rows, keys) entries it builds at once


class BoundMask:
    """A mask validated against one call's sizes; what kernels use.

    ``block(rows, cols)`` returns ``(keep, bias)``: a bool tensor (True = may attend)
    and a float tensor, each broadcastable to (b, h, rows, cols), or None when the
    block needs none. ``state(rows, cols)`` says whether the block can be skipped.
    ``softcap`` is the cap applied to the scaled scores before the bias (None: no cap);
    kernels apply all three through ``backends._blocks`` (``mask_scores_``, ``masked_scores``).
    """

    def __init__(self, terms: list[BoundTerm], shape: AttentionShape):
        caps = [t.cap for t in terms if isinstance(t, _BoundSoftcap)]
        if len(caps) > 1:  # Combined refuses this already; a BoundMask built by hand is checked too
            raise bad_argument(
                "mask",
                "at most one softcap(...) term",
                " and ".join(f"softcap(cap={c!r})" for c in caps),
                "keep one soft-cap: scores are capped once, with one cap",
            )
        self.softcap: float | None = caps[0] if caps else None
        # a boolean term that keeps every pair (causal with one decoding query, full-length padding)
        # changes nothing; dropping it spares kernels a dense mask
        terms = [
            t
            for t in terms
            if not isinstance(t, _BoundSoftcap) and (t.is_bias or not t.surely_full(0, shape.q_len, 0, shape.k_len))
        ]
        self.terms = terms = _merge_diagonals(terms)
        self.shape = shape
        self.keep_terms = [t for t in terms if not t.is_bias]
        self.bias_terms = [t for t in terms if t.is_bias]
        # (i, j, block_q, block_k) -> the shares of pairs in live blocks and in blocks masked score by score:
        # backends.costs keeps them here, as the estimates and the kernel of the one call this mask is bound to
        # ask for them alike
        self.block_fractions: dict[tuple[int, int, int, int], tuple[float, float]] = {}

    @classmethod
    def none(cls, shape: AttentionShape) -> BoundMask:
        return cls([], shape)

    @property
    def is_empty(self) -> bool:
        """Whether the mask changes nothing: no term and no soft-cap."""
        return not self.terms and self.softcap is None

    @property
    def has_bias(self) -> bool:
        return bool(self.bias_terms)

    def signature(self) -> tuple:
        """The mask's structure without its data, hashable: each term's kind and numbers (a band's sides and
        alignment offset, a tensor's shape and dtype) and the soft-cap. What auto's measured choices are kept for
        (``multihead.backends.policy.autotune``)."""
        return tuple(term.signature() for term in self.terms), self.softcap

    @property
    def bias_requires_grad(self) -> bool:
        return any(t.requires_grad for t in self.bias_terms)

    @property
    def is_plain_causal(self) -> bool:
        """Exactly a top-left-aligned causal mask, nothing else (SDPA's is_causal=True)."""
        return (
            self.softcap is None
            and len(self.terms) == 1
            and isinstance(self.terms[0], _BoundDiagonal)
            and self.terms[0].is_plain_causal
        )

    @property
    def is_lower_right_causal(self) -> bool:
        """Exactly a bottom-right-aligned causal mask with i <= j, nothing else (torch's ``causal_lower_right``)."""
        only = self.terms[0] if len(self.terms) == 1 else None
        return self.softcap is None and isinstance(only, _BoundDiagonal) and only.is_lower_right_causal

    def may_empty_rows(self) -> bool:
        """Whether some query row may have every key masked, answered on the host without waiting for a device.

        Exact wherever the values are known on the host (sizes, bands, lengths given as ints, CPU tensors), and
        without an i x j tensor (see :meth:`_some_row_empty`); True (assume the worst) where a term's values
        live only on a device, or cannot be read at all (meta or fake tensors, torch.compile's tracing).
        """
        if any(t.may_empty_rows() for t in self.terms):
            return True
        # a finite bias (ALiBi, a bias without -inf) masks no pair: only the other terms can empty a row, together
        masking = [t for t in self.terms if not t.is_bias or t.may_hold_minus_inf]
        if len(masking) < 2:
            return False
        if torch.compiler.is_compiling():
            return True  # symbolic sizes: comparing them would pin the lengths (kernels then guard every row)
        if all(isinstance(t, _BoundDiagonal) or (isinstance(t, _BoundPadding) and t.lengths) for t in masking):
            return self._bands_empty_a_row(masking)  # the common case, settled by arithmetic on ints
        # the rest is looked at on the CPU, from values known there: a CUDA tensor's are not read (a device sync)
        host = [t.host_term() for t in masking]
        if any(t is None for t in host):
            return True  # no values to look at: assume the worst (kernels then guard every row)
        return BoundMask([t for t in host if t is not None], _on_cpu(self.shape))._some_row_empty()

    def _bands_empty_a_row(self, terms: list[BoundTerm]) -> bool:
        """Whether diagonal bands and key lengths known on the host leave some query row no key, without a tensor.

        Row p may see keys max(lower bounds) ... min(upper bounds), the bounds being each band's p + offset - left
        and p + offset + right, 0, and j - 1 and min(lengths) - 1 (the shortest row is the worst). A maximum of
        lines is convex in p and a minimum of lines concave, so their difference is largest at the first or the
        last row: the row is empty where lo > hi, and checking those two rows settles every row.
        """
        shortest = min((min(t.lengths) for t in terms if isinstance(t, _BoundPadding) and t.lengths), default=None)
        top = self.shape.k_len - 1 if shortest is None else min(self.shape.k_len, shortest) - 1
        bands = [t for t in terms if isinstance(t, _BoundDiagonal)]
        for row in {0, self.shape.q_len - 1}:
            bounds = [band.key_bounds(row) for band in bands]
            lo = max([0, *(b[0] for b in bounds)])
            hi = min([top, *(b[1] for b in bounds)])
            if lo > hi:
                return True
        return False

    def _some_row_empty(self) -> bool:
        """Whether terms that each leave every row a key jointly leave some row none, a block of rows at a time.

        A row block with a key block its keep terms keep whole (FULL) is settled by block states alone, unless a
        bias's -inf entries may mask inside it; otherwise only the span of its non-EMPTY key blocks is evaluated
        (keys outside it are masked for every row of the block). At most :data:`EMPTY_ROW_CHECK_ELEMENTS`
        entries are built at once: a kernel asks this on every call, and a dense (b, h, i, j) check at
        i = j = 16384 with 16 ALiBi heads took 17 GiB.
        """
        q_len, k_len = self.shape.q_len, self.shape.k_len
        full_settles = not any(t.may_hold_minus_inf for t in self.bias_terms)
        batch, heads, _ = self.dense_extent()  # a block holds batch x heads (rows, keys) planes
        rows_at_once = max(1, min(EMPTY_ROW_BLOCK, EMPTY_ROW_CHECK_ELEMENTS // (batch * heads * k_len)))
        for row_start in range(0, q_len, rows_at_once):
            rows = range(row_start, min(row_start + rows_at_once, q_len))
            live: list[range] = []
            for col_start in range(0, k_len, EMPTY_ROW_BLOCK):
                cols = range(col_start, min(col_start + EMPTY_ROW_BLOCK, k_len))
                state = self.state(rows, cols)
                if state is BlockState.FULL and full_settles:
                    break
                if state is not BlockState.EMPTY:
                    live.append(cols)
            else:  # no key block kept whole: look at the pairs
                if not live:
                    return True
                keep, _ = self.block(slice(rows.start, rows.stop), slice(live[0].start, live[-1].stop))
                if keep is not None and bool((~keep.any(-1)).any()):
                    return True
        return False

    def dense_extent(self) -> tuple[int, int, int]:
        """(b or 1, h or 1, i or 1) of the (.., j) tensor this mask's terms broadcast to, densely or a block at a
        time: a batch dim for padding, a head dim for ALiBi, a row dim for anything but padding, and a tensor
        term's own (b or 1, h or 1, i or 1)."""
        spans = [term.spans() for term in self.terms]
        batch, heads, rows = (any(spanned[axis] for spanned in spans) for axis in range(3))
        return self.shape.batch if batch else 1, self.shape.heads if heads else 1, self.shape.q_len if rows else 1

    def block_states(self, block_q: int, block_k: int | None = None) -> torch.Tensor:
        """Every block_q x block_k tile's state at once (block_k: block_q by default): (ceil(i / block_q),
        ceil(j / block_k)) int8 on the mask's device, STATE_EMPTY / STATE_PARTIAL / STATE_FULL as :meth:`state`
        would say tile by tile (for a dense keep tensor exact where :meth:`state` says partial), from whole-tensor
        operations on the device: no host loop over tiles and no read of a device tensor. The keep terms combine
        by their minimum (any empty: empty; all full: full); bias terms do not enter (their -inf entries are the
        caller's to account for)."""
        grid = BlockGrid(block_q, block_k or block_q, self.shape.q_len, self.shape.k_len, self.shape.device)
        states = grid.filled(STATE_FULL)
        for term in self.keep_terms:
            states = torch.minimum(states, term.block_states(grid))
        return states

    def on_host(self) -> BoundMask:
        """This mask's keep terms on the CPU, from the values known on the host (:meth:`BoundTerm.host_term`); a
        term whose values live only on a device stands as one that keeps every tile partial. Its
        :meth:`block_states` can be read without waiting for any device (auto's estimates)."""
        unknown = BoundTerm()  # every tile partial
        return BoundMask([t.host_term() or unknown for t in self.keep_terms], _on_cpu(self.shape))

    def state(self, rows: Span, cols: Span) -> BlockState:
        states = [t.state(rows, cols) for t in self.keep_terms]
        if BlockState.EMPTY in states:
            return BlockState.EMPTY
        if all(s is BlockState.FULL for s in states):
            return BlockState.FULL
        return BlockState.PARTIAL

    def block(
        self,
        rows: Index,
        cols: Index,
        heads: torch.Tensor | None = None,
        *,
        dtype: torch.dtype | None = None,
        minus_inf_as_keep: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Evaluate for query positions ``rows`` and key positions ``cols`` (slices or index tensors).

        ``minus_inf_as_keep``: a dense bias's -inf entries come back as keep=False with bias 0, so that
        kernels masking with masked_fill mask those pairs even where a score overflowed to +inf. A
        consumer that puts -inf back into one additive mask anyway (SDPA) passes False.
        """
        row_span = _span(rows, self.shape.q_len) if isinstance(rows, slice) else None
        col_span = _span(cols, self.shape.k_len) if isinstance(cols, slice) else None
        keep = None
        for term in self.keep_terms:
            if row_span is not None and col_span is not None and term.surely_full(*row_span, *col_span):
                continue
            part = term.evaluate(rows, cols, heads)
            keep = part if keep is None else keep & part
        total = None
        for term in self.bias_terms:
            part = term.evaluate_in(rows, cols, heads, dtype)
            if term.may_hold_minus_inf and minus_inf_as_keep:
                # -inf in a bias means "masked": as a keep term it masks the pair even where the score
                # overflowed to +inf (inf + -inf would be NaN, and a fully masked row NaN, not 0)
                masked = part == -math.inf
                keep = masked.logical_not() if keep is None else keep & masked.logical_not()
                part = part.masked_fill(masked, 0.0)
            total = part if total is None else total + part
        return keep, total

    def dense(
        self, dtype: torch.dtype, *, minus_inf_as_keep: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.block(slice(None), slice(None), dtype=dtype, minus_inf_as_keep=minus_inf_as_keep)

    def additive(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The whole mask as one tensor for a kernel that adds it to the scores (SDPA's ``attn_mask``), shaped
        (b or 1, h or 1, i or 1, j): the bool keep-mask (True = may attend) where no term adds a bias, else the
        bias in ``dtype`` with -inf wherever a keep term masks. The -inf is written in place into a bias built
        for this call (ALiBi, a sum of terms), so the peak is one bias rather than two (a causal & ALiBi bias
        at i = j = 16384 with 16 heads is 8 GiB in bfloat16); a caller's bias tensor is copied, never written."""
        keep, bias = self.dense(dtype, minus_inf_as_keep=False)  # -inf stays in the one additive mask
        if bias is None or keep is None:
            return keep if bias is None else bias
        only = self.bias_terms[0]
        callers = len(self.bias_terms) == 1 and isinstance(only, _BoundDense) and bias.dtype == only.tensor.dtype
        if callers or torch.broadcast_shapes(bias.shape, keep.shape) != bias.shape:
            return bias.masked_fill(keep.logical_not(), -math.inf)
        return bias.masked_fill_(keep.logical_not(), -math.inf)

    def kinds(self) -> list[str]:
        """The kinds of its terms, e.g. ``["diagonal", "alibi", "softcap"]`` (a soft-cap last)."""
        kinds = [t.kind for t in self.terms]
        return kinds + (["softcap"] if self.softcap is not None else [])

    def __repr__(self) -> str:
        cap = "" if self.softcap is None else f", softcap={self.softcap!r}"
        return f"BoundMask(kinds={self.kinds()}{cap})"


# (causal, b, h, i, j, device) -> the bound mask of a call with no mask (causal or not): it holds no data, so one
# serves every call of those sizes, and a decode step does not build it again (about 2 us of a 25 us step)
_PLAIN_BOUND: dict[tuple, BoundMask] = {}
PLAIN_BOUND_LIMIT = 256  # sizes kept; past it the cache starts again (a long run over many lengths)


def bind_mask(mask: Mask | torch.Tensor | None, causal_flag: bool, shape: AttentionShape) -> BoundMask:
    """Combine ``mask`` with ``causal=True`` (bottom-right) and bind to the call's sizes."""
    if mask is None and not torch.compiler.is_compiling():  # traced sizes are symbols: never a cache key
        key = (causal_flag, shape.batch, shape.heads, shape.q_len, shape.k_len, shape.device)
        bound = _PLAIN_BOUND.get(key)
        if bound is None:
            if len(_PLAIN_BOUND) >= PLAIN_BOUND_LIMIT:
                _PLAIN_BOUND.clear()
            bound = _PLAIN_BOUND[key] = _bind(None, causal_flag, shape)
        return bound
    return _bind(mask, causal_flag, shape)


def _bind(mask: Mask | torch.Tensor | None, causal_flag: bool, shape: AttentionShape) -> BoundMask:
    parts: list[Mask] = []
    if mask is not None:
        parts.extend(as_mask(mask).terms())
    if causal_flag:
        parts.append(causal())
    return Combined(tuple(parts)).bind(shape) if parts else BoundMask.none(shape)
