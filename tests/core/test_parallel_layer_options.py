"""The layer's options of 2025-26 models (qk_norm, output_gate, rotary_dim, sinks) under head and sequence
parallelism, on gloo ranks against the whole layer in float64: outputs, input gradients and the gradients of the
options' own parameters (gathered over the head shards; summed over the sequence shards, as data parallelism sums a
replicated parameter's)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import multihead
from distributed import rank_device, run_ranks, skip_unless_ranks_run
from multihead.parallel.heads import gather_head_weights, shard_heads
from multihead.parallel.sequence import SequenceParallelAttention

B, N, EMBED, D, E = 2, 8, 12, 6, 4
OPTIONS = {
    "qk_norm": dict(qk_norm=True),
    "elementwise gate": dict(output_gate="elementwise"),
    "headwise gate": dict(output_gate="headwise"),
    "partial rotary": dict(rotary=True, rotary_dim=4),
    "sinks": dict(sinks=True),
    "all": dict(qk_norm=True, output_gate="elementwise", rotary=True, rotary_dim=2, sinks=True),
}


def build(options: dict) -> multihead.MultiHeadAttention:
    torch.manual_seed(5)
    layer = multihead.MultiHeadAttention(
        EMBED, 4, num_kv_heads=2, head_dim=D, value_head_dim=E, dtype=torch.float64, **options
    )
    with torch.no_grad():  # parameters away from their initial values, so a dropped one shows
        for name, parameter in layer.named_parameters():
            if name in ("sinks", "q_norm.weight", "k_norm.weight"):
                parameter.copy_(torch.linspace(-1.0, 2.0, parameter.numel(), dtype=torch.float64))
    return layer.to(rank_device())


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, N, EMBED, generator=gen, dtype=torch.float64)
    grad = torch.randn(B, N, EMBED, generator=gen, dtype=torch.float64)
    return x.to(rank_device()), grad.to(rank_device())


def head_errors(rank: int, world: int) -> dict[str, float]:
    found = {}
    for name, options in OPTIONS.items():
        full, (x, grad) = build(options), data()
        sharded = shard_heads(full)
        mine, whole = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, _ = sharded(mine, causal=True)
        ref, _ = full(whole, causal=True)
        out.backward(grad)
        ref.backward(grad)
        errors = [(out - ref).abs().max(), (mine.grad - whole.grad).abs().max()]
        errors.append((gather_head_weights(sharded.q_proj.weight.grad, dim=0) - full.q_proj.weight.grad).abs().max())
        if full.sinks is not None:
            errors.append((gather_head_weights(sharded.sinks.grad, dim=0) - full.sinks.grad).abs().max())
        if full.q_norm is not None:  # replicated over the head shards: each rank's share, summed
            norm_grad = sharded.q_norm.weight.grad.clone()
            dist.all_reduce(norm_grad)
            errors.append((norm_grad - full.q_norm.weight.grad).abs().max())
        found[f"heads {name}"] = float(torch.stack(errors).max())
    return found


def sequence_errors(rank: int, world: int) -> dict[str, float]:
    found = {}
    for method in ("ring", "ulysses"):
        for name, options in OPTIONS.items():
            full, (x, grad) = build(options), data()
            local = torch.chunk(x, world, dim=1)[rank].clone().requires_grad_()
            whole = x.clone().requires_grad_()
            out = SequenceParallelAttention(full, method=method)(local, causal=True)
            out.backward(torch.chunk(grad, world, dim=1)[rank])
            ref_layer = build(options)
            ref, _ = ref_layer(whole, causal=True)
            ref.backward(grad)
            errors = [(out - torch.chunk(ref, world, dim=1)[rank]).abs().max()]
            errors.append((local.grad - torch.chunk(whole.grad, world, dim=1)[rank]).abs().max())
            for parameter_name, parameter in full.named_parameters():
                summed = parameter.grad.clone()
                dist.all_reduce(summed)  # every rank holds the whole layer: its gradient is the ranks' sum
                errors.append((summed - dict(ref_layer.named_parameters())[parameter_name].grad).abs().max())
            found[f"{method} {name}"] = float(torch.stack(errors).max())
    return found


@pytest.mark.portable
@pytest.mark.parametrize("check", [head_errors, sequence_errors], ids=["heads", "sequence"])
def test_each_option_sharded_equals_the_whole_layer(check, device):
    skip_unless_ranks_run(device, 2)
    for rank_errors in run_ranks(check, 2, device=device):
        assert rank_errors and max(rank_errors.values()) < 1e-10, rank_errors
