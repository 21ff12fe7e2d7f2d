"""One attention layer split across processes three ways, each checked against the same layer in one process.

    torchrun --standalone --nproc-per-node 2 examples/parallel_attention.py

Every rank builds the same layer and input from one seed, runs

    heads    shard_heads(layer): h/P query heads and g/P key/value heads per rank, one all-reduce
    ring     SequenceParallelAttention(method="ring", layout="zigzag"): n/P positions per rank, K/V round the ring
    ulysses  SequenceParallelAttention(method="ulysses"): n/P positions per rank, all-to-all to head shards

on a causal self-attention forward and backward, and compares its part of the output and of the input's gradient
with the single-process layer's. Rank 0 prints the largest error over all ranks. gloo on the CPU: P must divide
the 8 heads and 4 kv heads (P = 1, 2 or 4).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from multihead import MultiHeadAttention
from multihead.parallel import SequenceParallelAttention, shard_heads, zigzag_shard

BATCH, SEQ, EMBED, HEADS, KV_HEADS = 2, 512, 256, 8, 4


def errors(rank: int, world: int) -> dict[str, float]:
    """The largest |difference| from one process's layer, output and input gradient, for each split (this rank)."""
    torch.manual_seed(0)  # the same layer, input and output gradient on every rank
    layer = MultiHeadAttention(EMBED, HEADS, num_kv_heads=KV_HEADS, rotary=True, dtype=torch.float64)
    x = torch.randn(BATCH, SEQ, EMBED, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(BATCH, SEQ, EMBED, dtype=torch.float64)
    reference, _ = layer(x, causal=True)
    reference.backward(grad)
    assert x.grad is not None
    ref_out, ref_dx = reference.detach(), x.grad

    found = {}
    x_all = x.detach().clone().requires_grad_()
    out, _ = shard_heads(layer)(x_all, causal=True)  # (b, n, embed) on every rank
    out.backward(grad)
    assert x_all.grad is not None
    found["heads"] = max((out - ref_out).abs().max().item(), (x_all.grad - ref_dx).abs().max().item())

    for method, layout in (("ring", "zigzag"), ("ulysses", "contiguous")):

        def shard(t: torch.Tensor, layout: str = layout) -> torch.Tensor:  # this rank's positions, (b, n/P, ...)
            return zigzag_shard(t, rank, world, dim=1) if layout == "zigzag" else torch.chunk(t, world, dim=1)[rank]

        x_local = shard(x.detach()).clone().requires_grad_()
        out = SequenceParallelAttention(layer, method=method, layout=layout)(x_local, causal=True)
        out.backward(shard(grad))
        assert x_local.grad is not None
        found[method] = max(
            (out - shard(ref_out)).abs().max().item(), (x_local.grad - shard(ref_dx)).abs().max().item()
        )
    return found


def main() -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # torchrun --standalone: every rank on this machine
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    found = errors(rank, world)
    worst = torch.tensor(list(found.values()), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(
            f"{world} ranks, causal self-attention, b={BATCH} n={SEQ} embed={EMBED} heads={HEADS}/{KV_HEADS}, float64"
        )
        for name, error in zip(found, worst.tolist(), strict=True):
            print(f"  {name:8s} largest difference from one process (output, input gradient): {error:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
