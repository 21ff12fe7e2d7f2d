"""The typed mask a user builds (:class:`Mask`), masks combined with ``&``, and a caller's tensor as a mask
(:func:`bias`, :func:`allowed`): what every call accepts."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from multihead._errors import bad_argument, describe
from multihead.masks._base import (
    AttentionShape,
    BlockGrid,
    BlockState,
    BoundTerm,
    Index,
    _select,
    _states,
    _tiled,
    host_readable,
)
from multihead.masks._bound_mask import BoundMask


class Mask:
    """Base of the typed masks. Combine with ``&``; bind to sizes with :meth:`bind`."""

    kind = "mask"  # what a primitive term is: "diagonal", "padding", "alibi", "tensor", "softcap", "custom"
    cap: float | None = None  # a soft-cap's cap (at most one per combined mask)

    def terms(self) -> tuple[Mask, ...]:
        return (self,)

    def __and__(self, other: Mask | torch.Tensor) -> Mask:
        return all_of(self, other)

    def __rand__(self, other: torch.Tensor) -> Mask:
        return all_of(other, self)

    def bind(self, shape: AttentionShape) -> BoundMask:
        """Validate against the call's sizes and return a mask kernels can evaluate."""
        return BoundMask([term._bind(shape) for term in self.terms()], shape)

    def for_heads(self, start: int, count: int, total: int) -> Mask:
        """This mask as query heads ``start .. start + count - 1`` of ``total`` see it, renumbered 0 .. count - 1:
        what one rank of a head-parallel layer (:func:`multihead.parallel.shard_heads`) applies to its own heads.

        Per-head parts are cut to those heads: ALiBi slopes (h,) or (b, h), a tensor's head axis of size ``total``
        (one of size 1 is shared by every head and stays), :func:`selected`'s indexer heads; a :func:`custom`
        function is called with the global head index ``h + start``. A mask with no per-head part is returned as
        it is, and so is every mask cut to all its heads (``for_heads(0, total, total)``). A head axis of any
        other size is a ValueError naming the mask: it was built for other heads (a rank's own, say), and would
        otherwise be applied to the wrong ones.

            >>> masks.alibi(masks.alibi_slopes(8)).for_heads(4, 2, 8)  # the slopes of heads 4 and 5
            alibi(heads=2)
        """
        for name, value in (("total", total), ("start", start), ("count", count)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise bad_argument(
                    f"for_heads({name})",
                    "an int",
                    describe(value),
                    "pass the first head, the number of heads and the layer's number of query heads",
                    kind=TypeError,
                )
        if total < 1 or count < 1 or start < 0 or start + count > total:
            raise bad_argument(
                "for_heads(start, count, total)",
                "heads start .. start + count - 1 of total: 0 <= start, count >= 1, start + count <= total",
                f"start={start}, count={count}, total={total}",
                "cut heads that exist, e.g. for_heads(rank * h // P, h // P, h)",
            )
        return self._for_heads(start, count, total)

    def _for_heads(self, start: int, count: int, total: int) -> Mask:
        """:meth:`for_heads` on valid arguments; overridden by every mask with a per-head part."""
        return self

    def key_band(self) -> tuple[int | None, int | None] | None:
        """(left, right) for a band around the aligned diagonal (causal, window: keys p - left ... p + right, None
        unbounded), None for any other term."""
        return None

    def _bind(self, shape: AttentionShape) -> BoundTerm:  # implemented by primitive masks
        raise TypeError(f"{type(self).__name__} is not a primitive mask")


class Combined(Mask):
    """Several masks at once: every boolean term must allow a pair, bias terms add; at most one soft-cap."""

    kind = "combined"

    def __init__(self, parts: tuple[Mask, ...]):
        caps = [p for p in parts if p.cap is not None]
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

    def _for_heads(self, start: int, count: int, total: int) -> Mask:
        parts = cut_parts(self.parts, start, count, total)
        return self if parts is None else Combined(parts)

    def __repr__(self) -> str:
        return " & ".join(repr(p) for p in self.parts)


def cut_parts(parts: tuple[Mask, ...], start: int, count: int, total: int) -> tuple[Mask, ...] | None:
    """Each of ``parts`` cut to heads start .. start + count - 1 of ``total`` (:meth:`Mask.for_heads`), or None
    where none of them changed (the mask holding them is then itself the cut)."""
    cut = tuple(part._for_heads(start, count, total) for part in parts)
    return None if all(new is old for new, old in zip(cut, parts, strict=True)) else cut


def cut_head_axis(
    name: str, tensor: torch.Tensor, axis: int, start: int, count: int, total: int, *, shared: bool, fix: str
) -> torch.Tensor:
    """``tensor`` with its head axis ``axis`` cut to heads start .. start + count - 1 of ``total``: a view
    (``narrow``), so a learned tensor keeps its gradient; ``tensor`` itself where nothing is cut (all heads, or a
    size-1 axis where ``shared``: one value broadcast to every head). Any other size is a ValueError naming
    ``name``: the tensor was built for other heads, and its entries would land on the wrong ones."""
    size = tensor.shape[axis]
    if size == 1 and shared:
        return tensor
    if size != total:
        also = " or 1 (one for every head)" if shared else ""
        raise bad_argument(
            name,
            f"a head axis of size {total} (all the query heads){also}, to cut heads {start} .. {start + count - 1} "
            "from",
            f"shape {tuple(tensor.shape)}, {size} along the head axis",
            fix,
        )
    return tensor if (start, count) == (0, total) else tensor.narrow(axis, start, count)


def whole_mask_fix(total: int) -> str:
    """The fix for a mask built for other heads than the ``total`` it is cut from."""
    return (
        f"build it for all {total} query heads of the layer (a head-parallel layer takes the whole layer's mask on "
        "every rank and cuts each rank's heads from it)"
    )


# --------------------------------------------------------------------------- a caller's tensor as a mask


class _Dense(Mask):
    """A user tensor broadcastable to (b, h, i, j): boolean (True = may attend) or additive float."""

    kind = "tensor"

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

    def _for_heads(self, start: int, count: int, total: int) -> Mask:
        if self.tensor.ndim < 3:  # (i, j), (j,), a scalar: no head axis, the same for every head
            return self
        # broadcast from the right against (b, h, i, j): the head axis is the third from the end
        cut = cut_head_axis(
            self.name, self.tensor, self.tensor.ndim - 3, start, count, total, shared=True, fix=whole_mask_fix(total)
        )
        return self if cut is self.tensor else _Dense(cut, self.name)

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

    def callers_tensor(self) -> torch.Tensor:
        return self.tensor

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
