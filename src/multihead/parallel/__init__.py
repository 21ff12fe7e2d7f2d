"""Attention across processes: heads and sequence split over the ranks of a torch.distributed group."""

from multihead.parallel.heads import HeadParallelAttention, check_head_split, gather_head_weights, shard_heads
from multihead.parallel.sequence import (
    SequenceParallelAttention,
    ring_attention,
    ulysses_attention,
    zigzag_shard,
    zigzag_unshard,
)

__all__ = [
    "HeadParallelAttention",
    "check_head_split",
    "gather_head_weights",
    "shard_heads",
    "SequenceParallelAttention",
    "ring_attention",
    "ulysses_attention",
    "zigzag_shard",
    "zigzag_unshard",
]
