"""Padded keys: :func:`padding` by key lengths or a (b, j) boolean, and its bound term."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from multihead._errors import bad_argument, describe
from multihead.masks._base import (
    AttentionShape,
    BlockGrid,
    BlockState,
    BoundTerm,
    Index,
    _moved,
    _on_cpu,
    _per_block,
    _select,
    _states,
    host_readable,
)
from multihead.masks._mask import Mask


class PaddingMask(Mask):
    kind = "padding"

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
    return PaddingMask(keys)


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

    def row_key_spans(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        # one run per row only where every batch row has the same length (keys 0 .. length - 1)
        if self.lengths is None or len(set(self.lengths)) != 1:
            return None
        q_len = self.shape.q_len
        return torch.zeros(q_len, dtype=torch.long), torch.full((q_len,), self.lengths[0], dtype=torch.long)

    def key_bounds(self, position: int) -> tuple[float, float] | None:
        # the shortest batch row is the worst; every row sees the same keys
        return None if self.lengths is None else (0, min(self.lengths) - 1)

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
