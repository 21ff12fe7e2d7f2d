"""Masks written by the user as functions of (b, h, q_idx, kv_idx): :func:`custom`, FlexAttention's
``mask_mod`` / ``score_mod`` model, on every backend."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable

import torch

from multihead._errors import bad_argument, checked_flag, describe
from multihead.masks._base import (
    STATE_PARTIAL,
    AttentionShape,
    BlockGrid,
    BlockState,
    BoundTerm,
    Index,
    _as_4d,
    _block_indices,
    _states,
    device_scalar,
)
from multihead.masks._bound_mask import BoundMask
from multihead.masks._mask import Combined, Mask

ModFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# the code objects (and their counts of defaults) of plain functions found to take (b, h, q_idx, kv_idx): a mask
# built on every call from a closure (a paged table's, each decode step) has its arity read once, not by
# inspect.signature each time (42 us of a 0.3 ms attention call)
_FOUR_ARGUMENT_CODES: set[tuple[types.CodeType, int]] = set()
_CODES_KEPT = 4096  # past this many, the set starts again: generated functions cannot grow it without bound


def _checked_function(name: str, function: object, fix: str) -> None:
    """Refuse what is not a function of four positional arguments (b, h, q_idx, kv_idx)."""
    if not callable(function):
        raise bad_argument(name, "a function of (b, h, q_idx, kv_idx)", describe(function), fix, kind=TypeError)
    # a plain function's positional arguments are its code's, less those with defaults (when nothing wraps it or
    # overrides its signature)
    code = None
    if isinstance(function, types.FunctionType) and not {"__wrapped__", "__signature__"} & function.__dict__.keys():
        code = (function.__code__, len(function.__defaults__ or ()))
    if code is not None and code in _FOUR_ARGUMENT_CODES:
        return
    _check_arity(name, function, fix)
    if code is not None:
        if len(_FOUR_ARGUMENT_CODES) >= _CODES_KEPT:
            _FOUR_ARGUMENT_CODES.clear()
        _FOUR_ARGUMENT_CODES.add(code)


def _check_arity(name: str, function: Callable, fix: str) -> None:
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


def _probed(name: str, function: ModFunction, shape: AttentionShape, floating: bool, head_offset: int) -> torch.Tensor:
    """``function`` called once on a 2 x 2 block of position 0 (head ``head_offset``, the first head the call
    has: it may index a table by it), on the call's device, and its result checked (a bool or a float tensor), so
    that a wrong function is named when the mask is bound, not deep in a kernel: two rows and two columns make
    ``and`` / ``if`` on the positions fail here. The result's shape is checked on each block it is evaluated for
    (:func:`_user_evaluate`)."""
    zero = torch.zeros((), dtype=torch.long, device=shape.device)
    rows, cols = zero.expand(1, 1, 2, 1), zero.expand(1, 1, 1, 2)
    head = torch.full((1, 1, 1, 1), head_offset, dtype=torch.long, device=shape.device)
    expected = "a floating tensor (the bias)" if floating else "a bool tensor (True = may attend)"
    try:
        value = function(zero.expand(1, 1, 1, 1), head, rows, cols)
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


def _offset_repr(head_offset: int) -> str:
    return f", heads from {head_offset}" if head_offset else ""


class _CustomMask(Mask):
    """A user's mask_mod; ``head_offset``: the global number of the call's head 0 (:meth:`Mask.for_heads`), added
    to every head index the function is given, so it always sees the heads of the whole layer."""

    kind = "custom"

    def __init__(self, mask_mod: ModFunction, block_mod: Callable | None, monotone: bool, head_offset: int = 0):
        self.mask_mod, self.block_mod, self.monotone = mask_mod, block_mod, monotone
        self.head_offset = head_offset

    def __repr__(self) -> str:
        blocks = f", block_mod={_name(self.block_mod)}" if self.block_mod else ", monotone=True" * self.monotone
        return f"custom(mask_mod={_name(self.mask_mod)}{blocks}{_offset_repr(self.head_offset)})"

    def _for_heads(self, start: int, count: int, total: int) -> Mask:
        # block_mod is not shifted: it classifies blocks for every head at once, and reads no head
        if start == 0:
            return self
        return _CustomMask(self.mask_mod, self.block_mod, self.monotone, self.head_offset + start)

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        _probed("mask_mod", self.mask_mod, shape, floating=False, head_offset=self.head_offset)
        return _BoundCustomMask(self, shape)


class _CustomScores(Mask):
    """A user's score_mod; ``head_offset`` as for :class:`_CustomMask`."""

    kind = "custom"

    def __init__(self, score_mod: ModFunction, head_offset: int = 0):
        self.score_mod, self.head_offset = score_mod, head_offset

    def __repr__(self) -> str:
        return f"custom(score_mod={_name(self.score_mod)}{_offset_repr(self.head_offset)})"

    def _for_heads(self, start: int, count: int, total: int) -> Mask:
        return self if start == 0 else _CustomScores(self.score_mod, self.head_offset + start)

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        probe = _probed("score_mod", self.score_mod, shape, floating=True, head_offset=self.head_offset)
        return _BoundCustomScores(self, shape, requires_grad=probe.requires_grad)


def _code(function: Callable) -> object:
    """What a compiled kernel's code depends on in a user's function: its code object (a closure made again with
    new tensors shares it), or the object itself."""
    return getattr(function, "__code__", function)


def _user_evaluate(
    term: BoundTerm,
    name: str,
    function: ModFunction,
    rows: Index,
    cols: Index,
    heads: torch.Tensor | None,
    head_offset: int,
) -> torch.Tensor:
    """A user's mod on a block's positions (its heads numbered from ``head_offset``), checked to broadcast to
    (b, h_sel, rows, cols)."""
    indices = _block_indices(term.shape, rows, cols, heads)
    b, h, q, k = indices
    value = _as_4d(function(b, h + head_offset if head_offset else h, q, k))
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


def _called(function: ModFunction, head_offset: int | torch.Tensor) -> ModFunction:
    """A user's function called from one of ours: handed a function that reads a tensor from its closure directly,
    torch 2.13's inductor writes a CPU FlexAttention kernel that fails to compile (an undeclared split size in its
    C++), and compiles this one. (Our own rules take their values as default arguments, which it compiles.) Its
    head index is the global one: the call's heads counted from ``head_offset`` (a 0-d tensor in a lifted term,
    so that every offset shares one compiled kernel)."""
    if isinstance(head_offset, int) and head_offset == 0:

        def rule(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, function=function) -> torch.Tensor:
            return function(b, h, q, k)

        return rule

    def shifted(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, function=function, offset=head_offset
    ) -> torch.Tensor:
        return function(b, h + offset, q, k)

    return shifted


def _lifted_offset(head_offset: int, device: torch.device) -> int | torch.Tensor:
    """A head offset as a compiled kernel reads it: a 0-d tensor (a Python number would be compiled in), 0 as it is
    (no shift at all)."""
    return device_scalar(head_offset, device) if head_offset else 0


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
        self.head_offset: int | torch.Tensor = spec.head_offset  # what the rule reads: a 0-d tensor once lifted
        self._span_states: dict[tuple[int, int, int, int], BlockState] = {}

    def rule(self) -> ModFunction:
        return _called(self.spec.mask_mod, self.head_offset)

    def lifted(self) -> BoundTerm:
        if not self.spec.head_offset:
            return self
        lifted = _BoundCustomMask(self.spec, self.shape)
        lifted.head_offset = _lifted_offset(self.spec.head_offset, self.shape.device)
        return lifted

    def evaluate(self, rows: Index, cols: Index, heads: torch.Tensor | None) -> torch.Tensor:
        return _user_evaluate(self, "mask_mod", self.spec.mask_mod, rows, cols, heads, self.spec.head_offset)

    def structure(self) -> tuple:
        return self.kind, _code(self.spec.mask_mod), bool(self.spec.head_offset)

    def signature(self) -> tuple:
        spec = self.spec
        return self.kind, _code(spec.mask_mod), spec.block_mod is not None, spec.monotone, spec.head_offset

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
        keep = _user_evaluate(
            self, "mask_mod", self.spec.mask_mod, corner_rows, corner_cols, None, self.spec.head_offset
        )
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
        self.head_offset: int | torch.Tensor = spec.head_offset  # what the rule reads: a 0-d tensor once lifted

    def rule(self) -> ModFunction:
        return _called(self.spec.score_mod, self.head_offset)

    def lifted(self) -> BoundTerm:
        if not self.spec.head_offset:
            return self
        lifted = _BoundCustomScores(self.spec, self.shape, requires_grad=self.requires_grad)
        lifted.head_offset = _lifted_offset(self.spec.head_offset, self.shape.device)
        return lifted

    def evaluate(self, rows: Index, cols: Index, heads: torch.Tensor | None) -> torch.Tensor:
        return _user_evaluate(self, "score_mod", self.spec.score_mod, rows, cols, heads, self.spec.head_offset)

    def host_term(self) -> BoundTerm | None:
        return _user_host_term(self)

    def structure(self) -> tuple:
        return self.kind, _code(self.spec.score_mod), bool(self.spec.head_offset)

    def signature(self) -> tuple:
        return self.kind, _code(self.spec.score_mod), self.requires_grad, self.spec.head_offset
