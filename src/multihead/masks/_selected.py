"""Sparse-index attention (DeepSeek-V3.2's DSA, MiniMax-M3's block selection): each query attends only the keys, or
the blocks of keys, an indexer picked for it. :func:`selected` turns the indices into a keep term; the kernels
skip every block of the call in which no query picked a key."""

from __future__ import annotations

import torch

from multihead._errors import bad_argument, describe
from multihead.masks._base import AttentionShape, BoundTerm, host_readable
from multihead.masks._mask import Mask, _BoundDense, whole_mask_fix


class _Selected(Mask):
    kind = "selected"

    def __init__(self, indices: torch.Tensor, block_size: int):
        self.indices, self.block_size = indices, block_size

    def __repr__(self) -> str:
        return f"selected(shape={tuple(self.indices.shape)}, block_size={self.block_size})"

    def _for_heads(self, start: int, count: int, total: int) -> Mask:
        if self.indices.ndim == 3 or self.indices.shape[1] == 1:  # one indexer for every head
            return self
        selectors = self.indices.shape[1]
        if total % selectors != 0:
            raise bad_argument(
                "selected(indices)",
                f"indexer heads s dividing the {total} query heads, to cut heads {start} .. {start + count - 1} from",
                f"shape {tuple(self.indices.shape)}, s = {selectors}",
                whole_mask_fix(total),
            )
        if (start, count) == (0, total):
            return self
        group = total // selectors  # query head n reads indexer head n // group
        if start % group == 0 and count % group == 0:  # whole groups: their indexer heads, in the same grouping
            return _Selected(self.indices.narrow(1, start // group, count // group), self.block_size)
        # part of a group: one indexer head per query head (a copy of the picks alone, (b, count, i, k), never j)
        per_head = self.indices.narrow(1, start // group, (start + count - 1) // group - start // group + 1)
        per_head = per_head.repeat_interleave(group, dim=1).narrow(1, start % group, count)
        return _Selected(per_head, self.block_size)

    def _bind(self, shape: AttentionShape) -> BoundTerm:
        return _BoundDense(self.keep(shape), shape)

    def keep(self, shape: AttentionShape) -> torch.Tensor:
        """The keep tensor (b, h or 1, i, j): True where the query picked the key (or its block)."""
        indices = self.indices if self.indices.ndim == 4 else self.indices.unsqueeze(1)  # (b, s, i, k)
        b, selectors, i, _ = indices.shape
        blocks = -(-shape.k_len // self.block_size)  # ceil: a last, shorter block
        want = (shape.batch, shape.q_len)
        if (b, i) != want or shape.heads % selectors != 0:
            raise bad_argument(
                "indices",
                f"shape (b, i, k) or (b, s, i, k) with (b, i) = {want} and s dividing the {shape.heads} query heads",
                f"shape {tuple(self.indices.shape)}",
                "pass one row of picked keys per query",
            )
        if indices.device != shape.device:
            raise bad_argument(
                "indices",
                f"a tensor on {shape.device} (the device of q)",
                f"one on {indices.device}",
                f"move it with .to({str(shape.device)!r})",
            )
        indices = indices.long()
        out_of_range = (indices >= blocks) | (indices < -1)
        if host_readable(indices) and bool(out_of_range.any()):
            raise bad_argument(
                "indices",
                f"entries in [0, {blocks}) ({'keys' if self.block_size == 1 else 'key blocks'}), or -1 for none",
                f"{int(indices.min())} .. {int(indices.max())}",
                "pick keys of this call only",
            )
        # -1 (and, on a device whose values are not read, anything out of range) lands in a column dropped after
        indices = indices.masked_fill((indices < 0) | out_of_range, blocks)
        picked = torch.zeros(b, selectors, i, blocks + 1, dtype=torch.bool, device=indices.device)
        picked = picked.scatter(-1, indices, True)[..., :blocks]  # (b, s, i, blocks)
        if self.block_size > 1:
            picked = picked.repeat_interleave(self.block_size, dim=-1)[..., : shape.k_len]
        if selectors > 1:  # query head n reads selector n // (h / s), as GQA groups read their key head
            picked = picked.repeat_interleave(shape.heads // selectors, dim=1)
        return picked


def selected(indices: torch.Tensor, *, block_size: int = 1) -> Mask:
    """Each query attends only the keys its indexer picked: ``indices`` (b, i, k) or (b, s, i, k) integer key
    positions (with ``block_size`` > 1: key blocks of that many keys, the last one shorter), -1 for an empty
    slot; s indexer heads each serve h / s query heads (GQA's grouping). Picking a key twice is picking it once.
    Combine with ``&`` (causal, padding): a pair must be picked and allowed by the rest. Binding builds one
    (b, s or 1, i, j) boolean from the indices, in which the kernels skip every block nobody picked.

        >>> picked = torch.tensor([[[0], [0], [1]]])          # b = 1, i = 3, one key each
        >>> selected(picked)
        selected(shape=(1, 3, 1), block_size=1)
    """
    if not isinstance(indices, torch.Tensor) or indices.is_floating_point() or indices.dtype == torch.bool:
        raise bad_argument(
            "indices",
            "an integer tensor (b, i, k) or (b, s, i, k)",
            describe(indices),
            "pass the indexer's top-k positions, e.g. scores.topk(k).indices",
            kind=TypeError,
        )
    if indices.ndim not in (3, 4):
        raise bad_argument(
            "indices",
            "3 or 4 dims: (b, i, k) or (b, s, i, k)",
            f"shape {tuple(indices.shape)}",
            "pass one row of picked keys per query",
        )
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise bad_argument(
            "block_size",
            "an int >= 1",
            describe(block_size),
            "pass e.g. block_size=64",
            kind=TypeError if not isinstance(block_size, int) else ValueError,
        )
    return _Selected(indices, block_size)
