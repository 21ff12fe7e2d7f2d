"""The ParallelStyles for torch's ``parallelize_module`` (issue 48, item 1): ``HeadParallel`` over a tensor-parallel
mesh dimension, ``ContextParallel`` over a context-parallel one, each alone on 2, 3 and 4 gloo ranks and together on
a 2 x 2 mesh, applied by a dict plan to the attention of a model of residual blocks (a window, then a window and
ALiBi). Each equals the whole model in one process, in float64: outputs, input gradients and every parameter's
gradient (gathered over the head shards, summed over the sequence shards as data parallelism sums a replicated
parameter's). Then DTensor inputs and outputs, ``src_data_rank``, head surgery through the seam, and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import multihead
from distributed import rank_device, run_ranks, skip_unless_ranks_run
from multihead.parallel import gather_head_weights, zigzag_shard

BATCH, SEQ, EMBED, HEADS, HEAD_DIM = 2, 24, 16, 12, 4
KV_HEADS = {1: 6, 2: 6, 3: 3, 4: 4}  # g for a split over P ranks: P divides g, so heads and Ulysses both split
ROWWISE, COLUMN_SHARDED = ("q_proj.", "k_proj.", "v_proj.", "sinks"), "out_proj.weight"


class Block(torch.nn.Module):
    """x + attn(x), then x + tanh(W x): one attention layer of 2026's options and a replicated part around it; with
    ``alibi``, ALiBi slopes of the layer's heads too (each head shard cuts its own, the sequence split biases on
    global positions)."""

    def __init__(self, kv_heads: int, alibi: bool):
        super().__init__()
        self.alibi = alibi
        options = dict(num_kv_heads=kv_heads, head_dim=HEAD_DIM, rotary=True, qk_norm=True, sinks=True)
        self.attn = multihead.MultiHeadAttention(EMBED, HEADS, dtype=torch.float64, **options)
        self.mlp = torch.nn.Linear(EMBED, EMBED, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, n, EMBED) -> (b, n, EMBED)
        mask = multihead.masks.window(9, 0)
        if self.alibi:  # the whole layer's slopes, (HEADS,), on every rank
            mask = mask & multihead.masks.alibi(multihead.masks.alibi_slopes(HEADS).to(x))
        x = x + self.attn(x, causal=True, mask=mask)[0]
        return x + torch.tanh(self.mlp(x))


class Net(torch.nn.Module):
    def __init__(self, kv_heads: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(kv_heads, alibi=index == 1) for index in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def built(kv_heads: int, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net(kv_heads)
    with torch.no_grad():  # sinks and norm weights away from their initial values, so a dropped one shows
        for name, parameter in net.named_parameters():
            if name.endswith(("sinks", "norm.weight")):
                parameter.copy_(torch.linspace(-1.0, 1.5, parameter.numel(), dtype=torch.float64))
    return net.to(rank_device())


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, SEQ, EMBED, generator=gen, dtype=torch.float64)
    grad = torch.randn(BATCH, SEQ, EMBED, generator=gen, dtype=torch.float64)
    return x.to(rank_device()), grad.to(rank_device())


def whole_run(kv_heads: int) -> tuple[Net, torch.Tensor, torch.Tensor]:
    """The whole model on the whole sequence: (model with gradients, output, input gradient)."""
    net, (x, grad) = built(kv_heads), data()
    x = x.clone().requires_grad_()
    out = net(x)
    out.backward(grad)
    return net, out.detach(), x.grad


def whole_gradient(name: str, grad: torch.Tensor, tp, cp) -> torch.Tensor:
    """A parameter's gradient in the whole model from this rank's: head rows and W^O columns gathered over ``tp``,
    the q/k norms' shares summed over it (each rank's heads add theirs), everything summed over ``cp``."""
    if tp is not None and ".attn." in name:
        if any(part in name for part in ROWWISE):
            grad = gather_head_weights(grad, tp, dim=0)
        elif name.endswith(COLUMN_SHARDED):
            grad = gather_head_weights(grad, tp, dim=1)
        elif "norm" in name:
            grad = grad.clone()
            dist.all_reduce(grad, group=tp.get_group())
    if cp is not None:
        grad = grad.clone()
        dist.all_reduce(grad, group=cp.get_group())
    return grad


def split_errors(rank: int, world: int, tp_size: int, cp_size: int, method: str, layout: str) -> float:
    """The largest difference from the whole model of a model whose attention is split by a dict plan: heads over
    ``tp_size`` ranks, the sequence over ``cp_size`` (the mesh is (cp, tp); a size 1 leaves that style out)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from multihead.parallel import ContextParallel, HeadParallel

    kv = KV_HEADS[world]
    mesh = init_device_mesh(rank_device().type, (cp_size, tp_size), mesh_dim_names=("cp", "tp"))
    tp = mesh["tp"] if tp_size > 1 else None
    cp = mesh["cp"] if cp_size > 1 else None
    net = built(kv)
    if tp is not None:
        assert parallelize_module(net, tp, {"blocks.*.attn": HeadParallel()}) is net
    if cp is not None:
        parallelize_module(net, cp, {"blocks.*.attn": ContextParallel(method=method, layout=layout)})
    whole, ref, ref_grad = whole_run(kv)
    x, grad = data()
    cp_rank = cp.get_local_rank() if cp is not None else 0

    def mine(t: torch.Tensor) -> torch.Tensor:  # this rank's positions of a whole-sequence tensor
        if cp is None:
            return t
        return zigzag_shard(t, cp_rank, cp_size, dim=1) if layout == "zigzag" else t.chunk(cp_size, 1)[cp_rank]

    local = mine(x).clone().requires_grad_()
    out = net(local)
    out.backward(mine(grad))
    errors = [(out.detach() - mine(ref)).abs().max(), (local.grad - mine(ref_grad)).abs().max()]
    wanted = dict(whole.named_parameters())
    for name, parameter in net.named_parameters():
        errors.append((whole_gradient(name, parameter.grad, tp, cp) - wanted[name].grad).abs().max())
    return float(torch.stack(errors).max())


def world_errors(rank: int, world: int) -> dict[str, float]:
    found = {f"heads P={world}": split_errors(rank, world, world, 1, "ring", "zigzag")}
    for method in ("ring", "ulysses"):
        for layout in ("zigzag", "contiguous"):
            found[f"{method} {layout} P={world}"] = split_errors(rank, world, 1, world, method, layout)
    if world == 4:
        for method in ("ring", "ulysses"):
            found[f"heads 2 x {method} 2"] = split_errors(rank, world, 2, 2, method, "zigzag")
    return found


@pytest.mark.portable
@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_style_and_both_on_a_2d_mesh_equal_one_process(world, device):
    skip_unless_ranks_run(device, world)
    for errors in run_ranks(world_errors, world, device=device):
        assert len(errors) == (7 if world == 4 else 5) and max(errors.values()) < 1e-10, errors


def layer(seed: int = 0) -> multihead.MultiHeadAttention:
    torch.manual_seed(seed)
    return multihead.MultiHeadAttention(EMBED, 4, num_kv_heads=2, rotary=True, dtype=torch.float64).to(rank_device())


def dtensor_and_surgery_errors(rank: int, world: int) -> dict[str, float]:
    """DTensors in and out of each style, src_data_rank, and a head gate and a uniform ablation under the split."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from multihead.parallel import ContextParallel, HeadParallel

    mesh = init_device_mesh(rank_device().type, (world,))
    x, grad = data()
    found = {}

    whole = layer()
    ref, _ = whole(x, causal=True)
    # sequence-sharded plain input, all-gathered; the output reduced to this rank's slice of the sequence
    sharded = parallelize_module(layer(), mesh, HeadParallel(input_layouts=Shard(1), output_layouts=Shard(1)))
    out, _ = sharded(x.chunk(world, 1)[rank], causal=True)
    found["heads Shard(1) in and out"] = float((out.detach() - ref.chunk(world, 1)[rank]).abs().max())
    # a replicated DTensor in, a replicated DTensor out
    sharded = parallelize_module(layer(), mesh, HeadParallel(use_local_output=False))
    out, _ = sharded(distribute_tensor(x, mesh, [Replicate()]), causal=True)
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    found["heads DTensor"] = float((out.full_tensor().detach() - ref).abs().max())
    # src_data_rank: every rank built its own weights; the style shards rank 0's
    sharded = parallelize_module(layer(seed=rank), mesh, HeadParallel())
    out, _ = sharded(x, causal=True)
    found["heads src_data_rank=0"] = float((out.detach() - ref).abs().max())
    # the sequence as a Shard(1) DTensor in, a Shard(1) DTensor out (contiguous layout)
    split = parallelize_module(layer(), mesh, ContextParallel(layout="contiguous", use_local_output=False))
    out, _ = split(distribute_tensor(x, mesh, [Shard(1)]), causal=True)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    found["context DTensor"] = float((out.full_tensor().detach() - ref).abs().max())

    # head surgery acts through the seam on a split layer: a gate and a uniform ablation, forward and backward
    gate = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=torch.float64, device=rank_device())
    for name in ("gate", "uniform"):
        whole, split = layer(), parallelize_module(layer(), mesh, ContextParallel(layout="zigzag"))
        for module in (whole, split):
            if name == "gate":
                module.head_gate = gate
            else:
                module.ablate_heads([2], how="uniform")
        inputs = x.clone().requires_grad_(), zigzag_shard(x, rank, world, dim=1).clone().requires_grad_()
        ref, _ = whole(inputs[0], causal=True)
        out, _ = split(inputs[1], causal=True)
        ref.backward(grad)
        out.backward(zigzag_shard(grad, rank, world, dim=1))
        errors = [(out.detach() - zigzag_shard(ref, rank, world, dim=1)).abs().max()]
        errors.append((inputs[1].grad - zigzag_shard(inputs[0].grad, rank, world, dim=1)).abs().max())
        found[f"context {name}"] = float(torch.stack(errors).max())
    return found


@pytest.mark.portable
def test_dtensors_src_data_rank_and_head_surgery_under_the_styles(device):
    skip_unless_ranks_run(device, 2)
    for errors in run_ranks(dtensor_and_surgery_errors, 2, device=device):
        assert len(errors) == 6 and max(errors.values()) < 1e-10, errors


def refusals(rank: int, world: int) -> dict[str, str]:
    """The message of each call the styles refuse, and whether the layer still works after it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from multihead.capture import capture
    from multihead.parallel import ContextParallel, HeadParallel

    mesh = init_device_mesh(rank_device().type, (world,))
    grid = init_device_mesh(rank_device().type, (1, world), mesh_dim_names=("cp", "tp"))
    x = data()[0][:, : SEQ // world]
    messages = {}

    def refused(name: str, call) -> None:
        try:
            call()
        except (ValueError, TypeError, RuntimeError) as error:
            messages[name] = str(error)
        else:
            messages[name] = "not refused"

    split = parallelize_module(layer(), mesh, ContextParallel())
    refused("weights", lambda: split(x, need_weights=True))
    refused("cross-attention", lambda: split(x, x, x))
    refused("cache", lambda: split(x, cache=split.new_cache(BATCH, SEQ)))
    refused("positions", lambda: split(x, positions=torch.arange(x.shape[1])))
    refused("tensor mask", lambda: split(x, mask=torch.ones(x.shape[1], x.shape[1], dtype=torch.bool)))
    with capture(split):
        refused("capture", lambda: split(x, causal=True))
    refused("twice", lambda: parallelize_module(split, mesh, ContextParallel()))
    refused("dtensor zigzag", lambda: split(distribute_tensor(x, mesh, [Replicate()])))
    before = split(x, causal=True)[0]  # every refusal left the layer as it was
    messages["still works"] = "yes" if torch.isfinite(before).all() else "no"

    refused("not a layer", lambda: parallelize_module(torch.nn.Linear(4, 4), mesh, HeadParallel()))
    refused("2-d mesh", lambda: HeadParallel()._apply(layer(), grid))
    heads = parallelize_module(layer(), mesh, HeadParallel())
    refused("heads twice", lambda: parallelize_module(heads, mesh, HeadParallel()))
    refused("dtensor mask", lambda: heads(x, mask=distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])))
    refused("zigzag dtensor out", lambda: ContextParallel(use_local_output=False))
    refused("method", lambda: ContextParallel(method="tree"))
    refused("input layout", lambda: HeadParallel(input_layouts="rows"))
    return messages


@pytest.mark.portable
def test_what_the_styles_cannot_serve_is_refused_by_name(device):
    skip_unless_ranks_run(device, 2)
    expected = {
        "weights": "need_weights",
        "cross-attention": "key",
        "cache": "cache",
        "positions": "positions",
        "tensor mask": "mask",
        "capture": "hooks",
        "twice": "once per layer",
        "dtensor zigzag": "zigzag",
        "still works": "yes",
        "not a layer": "multihead.MultiHeadAttention",
        "2-d mesh": "one-dimensional DeviceMesh",
        "heads twice": "HeadParallelAttention",
        "dtensor mask": "mask",
        "zigzag dtensor out": "use_local_output",
        "method": "ulysses",
        "input layout": "input_layouts",
    }
    for messages in run_ranks(refusals, 2, device=device):
        for case, words in expected.items():
            assert words in messages[case], (case, messages[case])
