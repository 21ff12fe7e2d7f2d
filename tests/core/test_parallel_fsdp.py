"""FSDP2 (torch's ``fully_shard``) over a model of multihead's layers (issue 48, item 2): each rank holds a shard of
every parameter (q/k/v/out projections, QK-norm weights, learned sinks), trains on its share of the batch, and the
full parameters after the steps equal one process training on the whole batch; the sharded state saved with
torch's distributed checkpoint loads back into a freshly sharded model that then gives the trained model's outputs.
gloo on loopback, a ``file://`` store, a timeout on the group (tests/distributed.py); 2, 3 and 4 ranks."""

from __future__ import annotations

import pytest
import torch

import multihead
from distributed import rank_device, run_ranks, skip_unless_ranks_run

BATCH, SEQ, EMBED, HEADS, KV_HEADS = 12, 7, 24, 6, 2
STEPS = 3


class Net(torch.nn.Module):
    """Two residual attention blocks of the layer with the options 2026's models use, and a linear head."""

    def __init__(self, device: torch.device):
        super().__init__()
        options = dict(num_kv_heads=KV_HEADS, rotary=True, qk_norm=True, sinks=True, dtype=torch.float64)
        self.blocks = torch.nn.ModuleList(
            multihead.MultiHeadAttention(EMBED, HEADS, device=device, **options) for _ in range(2)
        )
        self.head = torch.nn.Linear(EMBED, 5, dtype=torch.float64, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(b, n, EMBED) -> (b, n, 5)."""
        for block in self.blocks:
            x = x + block(x, causal=True)[0]
        return self.head(x)


def built(seed: int, device: torch.device) -> Net:
    torch.manual_seed(seed)
    model = Net(device)
    with torch.no_grad():  # learned sinks start at 0: give them values of their own, as a trained model's
        for block in model.blocks:
            block.sinks.normal_()
    return model


def batch(device: torch.device) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, EMBED, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)


def trained(model: torch.nn.Module, x: torch.Tensor) -> None:
    """STEPS steps of SGD with momentum on the mean squared output (the mean over this rank's share of the batch:
    FSDP averages the ranks' gradients, so equal shares give the whole batch's gradient). SGD, not Adam: Adam
    divides by the gradient's size, so a gradient that is 0 up to rounding (the key bias's: softmax ignores it)
    takes a full step in a direction rounding chose."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def sharded(seed: int, device: torch.device, world_size: int) -> Net:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    model = built(seed, device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_errors(rank: int, world_size: int, folder: str) -> dict[str, float]:
    """This rank's largest differences from one process: the full parameters after training, and the outputs of a
    fresh sharded model loaded from the distributed checkpoint."""
    import torch.distributed.checkpoint as dcp

    device = rank_device()
    x = batch(device)
    model = sharded(0, device, world_size)
    trained(model, x.chunk(world_size)[rank])
    full = {name: value.full_tensor() for name, value in model.state_dict().items()}
    alone = built(0, device)
    trained(alone, x)
    found = {"parameters": max(float((full[name] - value).abs().max()) for name, value in alone.state_dict().items())}
    assert {name: value.shape for name, value in full.items()} == {n: v.shape for n, v in alone.state_dict().items()}

    dcp.save(model.state_dict(), checkpoint_id=folder)
    restored = sharded(7, device, world_size)  # another initialisation: the checkpoint must replace all of it
    state = restored.state_dict()
    dcp.load(state, checkpoint_id=folder)
    restored.load_state_dict(state)
    with torch.no_grad():
        found["checkpoint outputs"] = float((restored(x) - alone(x)).abs().max())
    return found


@pytest.mark.portable
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fully_shard_trains_and_checkpoints_as_one_process(world_size, tmp_path, device):
    skip_unless_ranks_run(device, world_size)
    for errors in run_ranks(fsdp_errors, world_size, args=(str(tmp_path / "checkpoint"),), device=device):
        assert errors["parameters"] < 1e-12 and errors["checkpoint outputs"] < 1e-12, errors
