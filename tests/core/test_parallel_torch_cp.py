"""torch's ``context_parallel`` (issue 48, item 3): inside it, multihead's kernel refuses in one error naming it
and what to use instead, because torch replaces only ``scaled_dot_product_attention`` with its ring and every other
kernel would attend over the rank's shard of the sequence alone; outside it (after it), calls run as before.
On 2 gloo ranks (tests/distributed.py)."""

from __future__ import annotations

import pytest
import torch

import multihead
from distributed import rank_device, run_ranks, skip_unless_ranks_run
from support import is_input_error


def inside_and_after(rank: int, world_size: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    device = rank_device()
    mesh = init_device_mesh(device.type, (world_size,))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8 * world_size, 4, device=device) for _ in range(3))
    whole = multihead.attention(q, k, v, causal=True)
    layer = multihead.MultiHeadAttention(8, 2, device=device)
    x = torch.randn(1, 8 * world_size, 8, device=device)
    found: dict[str, object] = {}
    with context_parallel(mesh, buffers=[q, k, v, x], buffer_seq_dims=[2, 2, 2, 1]):
        found["shard"] = tuple(q.shape)
        for name, call in {
            "attention": lambda: multihead.attention(q, k, v, causal=True),
            "attention tiled": lambda: multihead.attention(q, k, v, causal=True, backend="tiled"),
            "layer": lambda: layer(x, causal=True),
        }.items():
            try:
                call()
                found[name] = "served"
            except ValueError as error:
                found[name] = (is_input_error(error, ValueError), str(error))
    found["after"] = float((multihead.attention(q, k, v, causal=True) - whole).abs().max())
    return found


@pytest.mark.portable
def test_multihead_refuses_inside_torchs_context_parallel_and_runs_after_it(device):
    skip_unless_ranks_run(device, 2)
    for found in run_ranks(inside_and_after, 2, device=device):
        assert found["shard"] == (1, 2, 8, 4)  # torch sharded the sequence: the refused calls would see half of it
        for name in ("attention", "attention tiled", "layer"):
            typed, message = found[name]
            assert typed, message
            assert message.startswith("attention: expected a call outside torch's context_parallel"), message
            assert "Fix: split the sequence with multihead.parallel instead: SequenceParallelAttention" in message
        assert found["after"] == 0.0  # the buffers restored and the kernel served again
