"""Heads across ranks (multihead.parallel.heads) on gloo ranks against the single-process layer, in float64.

Each rank builds the layer from one seed, shards it with ``shard_heads`` and compares the output, the input
gradients and every weight gradient (the shards gathered back along their head rows / columns) with the whole
layer's. One ``run_ranks`` call per world size runs every check and returns the largest errors, the collective
counts and the refusals for the parent to assert (each call costs seconds of process start-up; world size 1 runs
in the test process). Collectives are counted on the ranks by a small dispatch mode (:class:`CountCollectives`,
every c10d op); torch's CommDebugMode, which also sees the functional all-reduce on gloo forward and backward,
cross-checks the count in the test process only: importing it (torch.distributed.tensor, inductor) would cost every
spawned rank about two more seconds of start-up.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import multihead
from distributed import RankFailed, group_backend, rank_device, run_ranks, set_rank_device, skip_unless_ranks_run
from multihead.cost import LayerShape
from multihead.cost_parallel import parallel_cost
from multihead.lab.inspect import capture
from multihead.parallel import HeadParallelAttention, check_head_split, gather_head_weights, shard_heads
from support import is_input_error

B, N, M = 2, 9, 7  # batch, odd query length, odd key length (cross-attention)
EMBED, KDIM, VDIM, D, E, OUT = 10, 3, 13, 6, 5, 11  # pairwise distinct sizes
TOL = 1e-10

# name -> (num_heads, num_kv_heads, cross-attention, causal, rotary, bias)
CONFIGS = {
    "MHA": (4, 4, False, False, False, True),
    "GQA causal rotary": (8, 4, False, True, True, True),
    "GQA cross no bias": (8, 4, True, False, False, False),
    "MQA causal": (4, 1, False, True, True, True),
}


def build(h: int, g: int, cross: bool, rotary: bool, bias: bool) -> multihead.MultiHeadAttention:
    torch.manual_seed(h * 100 + g)
    kdims = {"kdim": KDIM, "vdim": VDIM} if cross else {}
    return multihead.MultiHeadAttention(
        EMBED,
        h,
        num_kv_heads=g,
        head_dim=D,
        value_head_dim=E,
        out_dim=OUT,
        rotary=rotary,
        bias=bias,
        dtype=torch.float64,
        device="cpu",
        **kdims,
    ).to(rank_device())  # initialised on the CPU, so every device holds the same weights


def inputs(cross: bool, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, EMBED, generator=gen, dtype=torch.float64, device="cpu")
    key = torch.randn(B, M, KDIM, generator=gen, dtype=torch.float64, device="cpu") if cross else None
    value = torch.randn(B, M, VDIM, generator=gen, dtype=torch.float64, device="cpu") if cross else None
    grad = torch.randn(B, N, OUT, generator=gen, dtype=torch.float64, device="cpu")
    return tuple(None if t is None else t.to(rank_device()) for t in (x, key, value, grad))


def gradient_errors(name: str, world: int) -> dict[str, float]:
    """Output, input gradients and every weight gradient of the sharded layer vs the whole layer."""
    h, g, cross, causal, rotary, bias = CONFIGS[name]
    full = build(h, g, cross, rotary, bias)
    before = {k: t.clone() for k, t in full.state_dict().items()}
    sharded = shard_heads(full)
    errors: dict[str, float] = {}
    errors["layer unchanged"] = max(float((full.state_dict()[k] - t).abs().max()) for k, t in before.items())
    x, key, value, grad = inputs(cross, seed=7)
    tensors = [t for t in (x, key, value) if t is not None]
    ours = [t.clone().requires_grad_() for t in tensors]
    theirs = [t.clone().requires_grad_() for t in tensors]
    out, _ = sharded(*ours, causal=causal)
    ref, _ = full(*theirs, causal=causal)
    out.backward(grad)
    ref.backward(grad)
    errors["output"] = float((out - ref).detach().abs().max())
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.grad is not None and b.grad is not None
        errors[f"input {index} grad"] = float((a.grad - b.grad).abs().max())
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        mine, whole = getattr(sharded, proj), getattr(full, proj)
        dim = 1 if proj == "out_proj" else 0  # W^O: input columns; W^Q/K/V: head rows
        gathered = gather_head_weights(mine.weight.grad, dim=dim)
        errors[f"{proj}.weight grad"] = float((gathered - whole.weight.grad).abs().max())
        if bias:
            b_grad = mine.bias.grad if proj == "out_proj" else gather_head_weights(mine.bias.grad, dim=0)
            errors[f"{proj}.bias grad"] = float((b_grad - whole.bias.grad).abs().max())
    return errors


def cache_errors(world: int) -> dict[str, float]:
    """Prefill 5 tokens then decode 3 one by one, causal with rotary: each call's output vs the whole layer's."""
    h, g, cross, _, rotary, bias = CONFIGS["GQA causal rotary"]
    full = build(h, g, cross, rotary, bias)
    sharded = shard_heads(full)
    ours, theirs = sharded.new_cache(B, 11), full.new_cache(B, 11)
    assert ours.keys.shape == (B, g // world, 11, D) and ours.values.shape == (B, g // world, 11, E)
    x = inputs(False, seed=3)[0][:, :8]  # (b, 8, embed)
    errors = {}
    with torch.no_grad():
        for step, (start, stop) in enumerate([(0, 5), (5, 6), (6, 7), (7, 8)]):
            out, _ = sharded(x[:, start:stop], causal=True, cache=ours)
            ref, _ = full(x[:, start:stop], causal=True, cache=theirs)
            errors[f"cache step {step}"] = float((out - ref).abs().max())
    return errors


def weight_errors(world: int) -> dict[str, float]:
    """Rank-local weights (need_weights and capture) gathered, and averaged weights, vs the whole layer's."""
    h, g, cross, causal, rotary, bias = CONFIGS["GQA causal rotary"]
    full = build(h, g, cross, rotary, bias)
    sharded = shard_heads(full)
    x = inputs(False, seed=5)[0]
    with torch.no_grad():
        _, ref = full(x, causal=True, need_weights=True)  # (b, h, i, j)
        _, local = sharded(x, causal=True, need_weights=True)  # (b, h/P, i, j)
        _, mean = sharded(x, causal=True, need_weights=True, average_weights=True)  # (b, i, j)
        with capture(sharded) as rec:
            sharded(x, causal=True)
    assert ref is not None and local is not None and mean is not None
    assert local.shape == (B, h // world, N, N)
    recorded = torch.stack([rec.weights(0, m) for m in range(h // world)], dim=1)  # (b, h/P, i, j)
    offset = sharded.head_offset
    return {
        "need_weights local": float((local - ref[:, offset : offset + h // world]).abs().max()),
        "need_weights gathered": float((gather_head_weights(local) - ref).abs().max()),
        "capture gathered": float((gather_head_weights(recorded) - ref).abs().max()),
        "average_weights": float((mean - ref.mean(dim=1)).abs().max()),
    }


NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


class CountCollectives(TorchDispatchMode):
    """Counts every collective op dispatched while active (functional or in-place c10d), by name; the functional
    collectives' bookkeeping ops (wait_tensor, _wrap_tensor_autograd) are not collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.bytes = 0  # of the tensors the collectives were given

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        namespace, _, op = name.partition("::")
        if namespace in ("c10d", "_c10d_functional", "c10d_functional") and op not in NOT_COLLECTIVES:
            self.counts[name] = self.counts.get(name, 0) + 1
            self.bytes += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


def count_collectives(world: int, mode=CountCollectives) -> dict[str, dict[str, int]]:
    """Collectives of one self-attention forward and of its backward, by op name."""
    sharded = shard_heads(build(8, 4, False, True, True))
    x = inputs(False, seed=1)[0].requires_grad_()
    with mode() as forward:
        out, _ = sharded(x, causal=True)
    with mode() as backward:
        out.sum().backward()
    if isinstance(forward, CountCollectives) and isinstance(backward, CountCollectives):
        return {
            "forward": forward.counts,
            "backward": backward.counts,
            "bytes": {"forward": forward.bytes, "backward": backward.bytes},
        }
    return {  # CommDebugMode
        "forward": {str(op): n for op, n in forward.get_comm_counts().items()},
        "backward": {str(op): n for op, n in backward.get_comm_counts().items()},
    }


def refusals(world: int) -> dict[str, str]:
    """shard_heads on layers whose heads do not split over this group: the messages, and the layer unchanged."""
    found = {}
    for name, (h, g) in {"MQA": (4, 1), "h=6 g=3": (6, 3), "h=6 g=6": (6, 6)}.items():
        if h % world == 0 and g % world == 0:
            continue
        layer = build(h, g, False, False, True)
        before = {k: t.clone() for k, t in layer.state_dict().items()}
        try:
            shard_heads(layer)
        except ValueError as error:
            assert is_input_error(error, ValueError)
            assert all(torch.equal(layer.state_dict()[k], t) for k, t in before.items())
            assert layer.num_heads == h and layer.num_kv_heads == g
            found[name] = str(error)
        else:
            raise AssertionError(f"{name} sharded over {world} ranks")
    return found


def example_errors(rank: int, world: int) -> dict[str, float]:
    """README's torchrun example (examples/parallel_attention.py), its checks on a shorter sequence."""
    path = Path(__file__).resolve().parents[2] / "examples" / "parallel_attention.py"
    spec = importlib.util.spec_from_file_location("parallel_attention_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.SEQ, example.EMBED = 16, 32
    return {f"example {name}": error for name, error in example.errors(rank, world).items()}


def check_rank(rank: int, world: int) -> dict:
    """Every check one world size runs, returned for the parent to assert."""
    counts = count_collectives(world)
    report: dict = {"errors": {}, "bytes": counts.pop("bytes"), "counts": counts, "refusals": refusals(world)}
    if world == 2 and rank_device().type == "cpu":  # the example runs gloo on the CPU
        report["errors"].update(example_errors(rank, world))
    for name, (h, g, *_) in CONFIGS.items():
        if h % world == 0 and g % world == 0:
            report["errors"].update({f"{name}: {k}": v for k, v in gradient_errors(name, world).items()})
    report["errors"].update(cache_errors(world))
    report["errors"].update(weight_errors(world))
    sharded = shard_heads(build(8, 4, False, False, True))
    report["local heads"] = (sharded.num_heads, sharded.num_kv_heads, sharded.head_offset, sharded.kv_head_offset)
    report["is layer"] = isinstance(sharded, multihead.MultiHeadAttention) and isinstance(
        sharded, HeadParallelAttention
    )
    return report


def in_this_process(tmp_path_factory, device: torch.device) -> list[dict]:
    """World size 1 on a one-rank group in the test process: spares a process start-up (seconds)."""
    store = tmp_path_factory.mktemp("heads-store") / "store"
    set_rank_device(device)
    dist.init_process_group(group_backend(device), init_method=f"file://{store}", rank=0, world_size=1)
    try:
        from torch.distributed.tensor.debug import CommDebugMode  # slow to import: only here

        report = check_rank(0, 1)
        report["CommDebugMode counts"] = count_collectives(1, CommDebugMode)
        return [report]
    finally:
        dist.destroy_process_group()
        set_rank_device(torch.device("cpu"))


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda p: f"P={p}")
def reports(request, tmp_path_factory, device) -> tuple[int, list[dict]]:
    """Every rank's report for P ranks: gloo on the CPU; on --device cuda, NCCL with a GPU a rank (else skipped)."""
    skip_unless_ranks_run(device, request.param)
    if request.param == 1 and not dist.is_initialized():
        return 1, in_this_process(tmp_path_factory, device)
    return request.param, run_ranks(check_rank, request.param, device=device)


@pytest.mark.portable
def test_matches_single_process_layer(reports):
    world, results = reports
    for rank, report in enumerate(results):
        bad = {name: err for name, err in report["errors"].items() if not err <= TOL}
        assert not bad, f"rank {rank} of {world}: {bad}"
        expected = 4 if world == 1 else 3  # MQA only without splitting
        assert sum(name.endswith(": output") for name in report["errors"]) == expected


@pytest.mark.portable
def test_each_rank_holds_its_heads(reports):
    world, results = reports
    for rank, report in enumerate(results):
        assert report["is layer"]
        assert report["local heads"] == (8 // world, 4 // world, rank * 8 // world, rank * 4 // world)


@pytest.mark.portable
def test_one_all_reduce_forward_and_backward(reports):
    _, results = reports
    for report in results:
        assert report["counts"] == {
            "forward": {"_c10d_functional::all_reduce": 1},
            "backward": {"_c10d_functional::all_reduce": 1},
        }
        if "CommDebugMode counts" in report:  # world size 1, in the test process
            assert report["CommDebugMode counts"] == {
                "forward": {"c10d_functional.all_reduce": 1},
                "backward": {"c10d_functional.all_reduce": 1},
            }


@pytest.mark.portable
def test_all_reduced_bytes_are_the_cost_models(reports):
    """The tensors all-reduced are the (b, n, out_dim) output and the (b, n, embed_dim) input gradient, whose ring
    all-reduce `multihead cost --tp` counts; and the README example ran at P = 2."""
    world, results = reports
    shape = LayerShape.of(build(8, 4, False, True, True))
    model = parallel_cost(shape, seq=N, batch=B, causal=True, dtype="float64", mode="forward+backward", tp=world)
    for report in results:
        assert report["bytes"] == {"forward": B * N * OUT * 8, "backward": B * N * EMBED * 8}
        for step in ("forward", "backward"):
            assert model.sent_bytes[step] == 2 * (world - 1) * report["bytes"][step] // world
        assert any(name.startswith("example") for name in report["errors"]) == (world == 2)


@pytest.mark.portable
def test_ranks_refuse_uneven_heads(reports):
    world, results = reports
    expected = {1: set(), 2: {"MQA", "h=6 g=3"}, 4: {"MQA", "h=6 g=3", "h=6 g=6"}}[world]
    for report in results:
        assert set(report["refusals"]) == expected
        for message in report["refusals"].values():
            assert f"P = {world}" in message and "group" in message


@pytest.mark.parametrize(
    ("h", "g", "world", "valid"),
    [(4, 1, 2, "[1]"), (6, 3, 2, "[1, 3]"), (8, 4, 3, "[1, 2, 4]"), (6, 6, 4, "[1, 2, 3, 6]")],
)
def test_check_head_split_names_both_numbers_and_the_valid_sizes(h, g, world, valid):
    with pytest.raises(ValueError) as caught:
        check_head_split(h, g, world)
    message = str(caught.value)
    assert is_input_error(caught.value, ValueError)
    assert f"num_heads = {h}" in message and f"num_kv_heads = {g}" in message
    assert f"P = {world}" in message and valid in message


def test_check_head_split_accepts_even_splits():
    for h, g, world in [(8, 4, 4), (8, 4, 2), (4, 1, 1), (6, 6, 3)]:
        check_head_split(h, g, world)


def test_shard_heads_refusals_without_a_group():
    layer = build(4, 4, False, False, True)
    with pytest.raises(TypeError, match="layer: expected a multihead.MultiHeadAttention"):
        shard_heads(torch.nn.Linear(3, 5))  # type: ignore[arg-type]
    layer.ablate_heads([1])
    with pytest.raises(ValueError, match="restore_heads"):
        shard_heads(layer)
    layer.restore_heads()
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="group: expected an initialised torch.distributed process group"):
            shard_heads(layer)


def test_shard_heads_takes_a_one_dimensional_device_mesh(tmp_path):
    """A 1-D DeviceMesh is its group; a 2-D mesh or another object is refused, naming the group argument."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layer = build(8, 4, False, True, True)
        x = inputs(False, seed=2)[0]
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        sharded = shard_heads(layer, mesh)
        assert torch.equal(sharded(x, causal=True)[0], layer(x, causal=True)[0])
        weights = sharded(x, causal=True, need_weights=True)[1]
        assert weights is not None and torch.equal(gather_head_weights(weights, mesh), weights)
        with pytest.raises(ValueError, match=r"group: expected a one-dimensional DeviceMesh .*mesh\["):
            shard_heads(layer, init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp")))
        with pytest.raises(TypeError, match="group: expected a torch.distributed ProcessGroup, a 1-D DeviceMesh"):
            shard_heads(layer, [0, 1])  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()


def fail_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        shard_heads(build(4, 1, False, False, True))  # MQA over 2 ranks: ValueError
    dist.all_reduce(torch.ones(3, device=rank_device()))  # rank 0 waits in a collective for the rank that failed


def test_failing_rank_raises_rank_failed_promptly():
    start = time.perf_counter()
    with pytest.raises(RankFailed, match="rank 1 of 2 failed first") as caught:
        run_ranks(fail_on_rank_one, 2, timeout_s=300)
    assert "num_kv_heads = 1" in str(caught.value)
    # rank 0 waits in an all-reduce: it must be stopped when rank 1 fails, not by the 300 s group timeout
    # (the bound leaves room for the start-up of two processes on a loaded machine)
    assert time.perf_counter() - start < 120
