"""Learned sinks under sequence parallelism, on gloo ranks against one process in float64: ring attention applies
them at its final merge, Ulysses gives each rank its heads' sinks (or the per-row sinks sent with q). Outputs, dq,
dk, dv and the sinks' gradient (per-head sinks are replicated: each rank's share summed, as data parallelism
sums a replicated parameter's) equal ``multihead.attention(..., sinks=)`` on the whole sequence."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import multihead
from distributed import rank_device, run_ranks, skip_unless_ranks_run
from multihead import masks
from multihead.parallel.sequence import ring_attention, ulysses_attention, zigzag_shard

B, H, N, D, E = 2, 6, 24, 3, 5


def shard(x: torch.Tensor, layout: str, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    return zigzag_shard(x, rank, world, dim) if layout == "zigzag" else torch.chunk(x, world, dim)[rank]


def errors(rank: int, world: int) -> dict[str, float]:
    found = {}
    cases = [
        ("ring", 2, "zigzag", True, None),
        ("ring", 2, "contiguous", False, masks.window(3, 2)),
        ("ulysses", H, "zigzag", True, None),
        ("ulysses", H, "contiguous", False, masks.softcap(2.0)),
    ]
    for method, g, layout, causal, mask in cases:
        for per_row in (False, True):
            gen = torch.Generator().manual_seed(3)
            q, k, v = (
                torch.randn(B, n, N, dim, generator=gen, dtype=torch.float64) for n, dim in ((H, D), (g, D), (g, E))
            )
            sinks = torch.randn(*((B, H, N) if per_row else (H,)), generator=gen, dtype=torch.float64)
            grad = torch.randn(B, H, N, E, generator=gen, dtype=torch.float64)
            q, k, v, sinks, grad = (t.to(rank_device()) for t in (q, k, v, sinks, grad))
            full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
            multihead.attention(*full[:3], causal=causal, mask=mask, sinks=full[3]).backward(grad)
            local = [shard(t, layout, rank, world).detach().requires_grad_() for t in (q, k, v)]
            local_sinks = (shard(sinks, layout, rank, world) if per_row else sinks.clone()).requires_grad_()
            fn = ring_attention if method == "ring" else ulysses_attention
            out = fn(*local, causal=causal, mask=mask, layout=layout, sinks=local_sinks)
            out.backward(shard(grad, layout, rank, world))
            sink_grad = local_sinks.grad.clone()
            if not per_row:
                dist.all_reduce(sink_grad)  # a replicated parameter's gradient: every rank's share
            expected_sinks = shard(full[3].grad, layout, rank, world) if per_row else full[3].grad
            with torch.no_grad():
                ref = multihead.attention(q, k, v, causal=causal, mask=mask, sinks=sinks)
            diffs = [(out - shard(ref, layout, rank, world)).abs().max(), (sink_grad - expected_sinks).abs().max()]
            diffs += [
                (t.grad - shard(f.grad, layout, rank, world)).abs().max() for t, f in zip(local, full, strict=False)
            ]
            found[f"{method} {layout} {'per-row' if per_row else 'per-head'}"] = float(torch.stack(diffs).max())
    return found


@pytest.mark.portable
@pytest.mark.parametrize("world", [2, 3])
def test_ring_and_ulysses_with_sinks_equal_one_process(world, device):
    skip_unless_ranks_run(device, world)
    for rank_errors in run_ranks(errors, world, device=device):
        assert rank_errors and max(rank_errors.values()) < 1e-10, rank_errors
