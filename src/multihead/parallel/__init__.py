"""Attention across processes: heads and sequence split over the ranks of a torch.distributed group.

The ``ParallelStyle``s for torch's ``parallelize_module`` (:class:`HeadParallel`, :class:`ContextParallel`, in
:mod:`multihead.parallel.styles`) load on first use: they import ``torch.distributed.tensor`` (half a second)."""

from __future__ import annotations

from typing import Any

from multihead.parallel.heads import HeadParallelAttention, check_head_split, gather_head_weights, shard_heads
from multihead.parallel.sequence import (
    SequenceParallelAttention,
    SequenceSplit,
    ring_attention,
    ulysses_attention,
    zigzag_shard,
    zigzag_unshard,
)

__all__ = [
    "ContextParallel",
    "HeadParallel",
    "HeadParallelAttention",
    "check_head_split",
    "gather_head_weights",
    "shard_heads",
    "SequenceParallelAttention",
    "SequenceSplit",
    "ring_attention",
    "ulysses_attention",
    "zigzag_shard",
    "zigzag_unshard",
]

_STYLES = ("ContextParallel", "HeadParallel")


def __getattr__(name: str) -> Any:
    if name in _STYLES:
        from multihead.parallel import styles

        return getattr(styles, name)
    from multihead._modules import submodule_on_first_use

    return submodule_on_first_use(__name__, name)
