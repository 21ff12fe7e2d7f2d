"""Head- and sequence-parallel attention across processes: bytes each rank sends, per-rank peak memory and time.

One :class:`multihead.MultiHeadAttention` layer (512 wide, 8 heads, float32; and a grouped-query case with 2
key/value heads), causal self-attention, forward and forward+backward, split over P = 1, 2, 4 gloo ranks on this
machine by the library's ParallelStyles for torch's ``parallelize_module`` (:mod:`multihead.parallel.styles`, the
configuration users run), applied in place to the layer on a DeviceMesh built once per launch:

    tp        HeadParallel() on a 1-D mesh of the P ranks: every rank holds the whole input (b, n, D) and h/P heads
    ulysses   ContextParallel(method="ulysses", layout="contiguous") on that mesh: rank r holds positions
              [r n/P, (r + 1) n/P)
    ring      ContextParallel(method="ring", layout="zigzag") on that mesh: rank r holds zigzag_shard(x, r, P)

and, at P = 4 only, on a 2-D mesh init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp")): HeadParallel() over
mesh["tp"], then ContextParallel over mesh["cp"] (each rank h/2 heads of n/2 positions):

    tp2 x ring2      the ring's ContextParallel (zigzag) over cp = 2
    tp2 x ulysses2   Ulysses' ContextParallel (contiguous) over cp = 2

(The method names are those of the earlier results, which ran shard_heads and SequenceParallelAttention: the same
splits and the same bytes.)

What is measured, per call (each rank runs the same steps; rank 0 reads the machine-wide counters):

    bytes     the loopback interface's TX byte counter (/proc/net/dev, line "lo:") read on rank 0 before the
              call (between two barriers, so no rank sends before it is read) and after it (after a barrier):
              every rank is on this machine, so it counts every rank's sends (TCP/IP headers included). The
              same window around no call at all (barriers only) is measured too; its median is subtracted and
              the rest divided by P: bytes sent per rank. Every process's own write count (/proc/self/io
              wchar, which counts gloo's writev on its sockets) is kept beside it as a per-rank cross-check
              that no other process on the machine can disturb.
    memory    the harness's peak: one call with every buffer >= 64 KiB mmapped, VmHWM after it minus VmRSS just
              before it (/proc/self/clear_refs resets VmHWM), on every rank; the table gives the largest.
    time      seconds of the call on each rank between barriers; per step the slowest rank; the median over
              steps with the fastest and slowest step.
    predicted multihead.cost_parallel.parallel_cost: the bytes each rank sends (forward, backward) and the
              per-rank peak the cost model expects.

Then the longest sequence per memory budget: ring, Ulysses and tp at n = P x n0 for P = 1, 2, 4, the per-rank
peak and the input each rank holds, forward and forward+backward (if their total stays flat, a per-rank budget
holds a P times longer sequence), beside the plain layer measured on one process at the same n.

At P = 2 it also records (does not time) whether torch's own context parallel
(``torch.distributed.tensor.experimental.context_parallel``) runs torch's causal SDPA on the CPU: one call on a 1-D
mesh of the 2 ranks, its exception's type and first line kept in the results (``torch_context_parallel``).

The driver (this script run without torchrun's environment) launches
``python -m torch.distributed.run --standalone --nproc-per-node P benchmarks/parallel.py --plan ...`` for each P,
collects every rank's JSON and writes benchmarks/results/parallel.{json,md,png}:

    python benchmarks/parallel.py [--quick] [--out DIR]      # or: make bench-parallel
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from harness import common
from harness.common import (
    MALLOC_ENV,
    MALLOC_VALUE,
    MIB,
    TIMING_MMAP_THRESHOLD,
    cpu_model,
    peak_memory,
    pyplot,
    ram_bytes,
    set_mmap_threshold,
)

import multihead

RESULTS = Path(__file__).resolve().parent / "results"
SCRIPT = Path(__file__).resolve()
METHODS = ("tp", "ulysses", "ring")  # one mesh dimension of all P ranks
GRID_WORLD = 4  # the 2-D cases run at this P only
GRID_METHODS = {"tp2 x ring2": (2, 2, "ring"), "tp2 x ulysses2": (2, 2, "ulysses")}  # name: (tp, cp, cp method)
CP_LAYOUTS = {"ring": "zigzag", "ulysses": "contiguous"}  # the sequence layout each ContextParallel method runs in
TORCH_CP_WORLD = 2  # the launch that tries torch's own context_parallel
MODES = ("forward", "forward+backward")
WORLDS = (1, 2, 4)
CORES = 2  # this machine's cores: ranks beyond this share them
GROUP_TIMEOUT_S = 300  # a collective waiting longer on a dead peer raises instead of hanging
LAUNCH_TIMEOUT_S = 1200
IDLE_S = 1.0  # one window of this many seconds with no step: the loopback's background traffic


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Shape:
    """The layer: embed_dim, heads, key/value heads."""

    name: str
    embed_dim: int
    num_heads: int
    num_kv_heads: int


@dataclass(frozen=True)
class Config:
    quick: bool
    batch: int
    seq: int  # n of the main cases
    shapes: tuple[Shape, ...]
    repeats: int  # timed steps per case (each one also a byte count)
    noop_repeats: int
    scale_n0: int  # n per rank in the longest-sequence experiment
    scale_methods: tuple[str, ...] = ("ring", "ulysses", "tp")  # ring first: the issue's claim
    single_process: bool = True  # also the plain layer on one process at n = P x n0 (in the P = 1 launch)
    worlds: tuple[int, ...] = WORLDS

    @property
    def stem(self) -> str:
        return "parallel_quick" if self.quick else "parallel"


MHA = Shape("MHA 512/8", 512, 8, 8)
GQA = Shape("GQA 512/8/2", 512, 8, 2)
FULL = Config(quick=False, batch=1, seq=2048, shapes=(MHA, GQA), repeats=5, noop_repeats=9, scale_n0=4096)
QUICK = Config(
    quick=True,
    batch=1,
    seq=256,
    shapes=(MHA,),
    repeats=3,
    noop_repeats=5,
    scale_n0=256,
    scale_methods=("ring",),
    single_process=False,
)


def threads_per_rank(world: int, cores: int = CORES) -> int:
    """Torch threads of each of ``world`` ranks sharing ``cores`` cores (at least 1)."""
    return max(1, cores // world)


def split_of(method: str, world: int) -> tuple[int, int, str | None]:
    """(tp, cp, cp method) of ``method`` on ``world`` ranks: heads over tp ranks, the sequence over cp ranks by the
    cp method (None without a sequence split). ValueError for an unknown method, or a 2-D method on a ``world``
    that is not its tp x cp."""
    if method in ("tp", "layer"):
        return world, 1, None
    if method in ("ulysses", "ring"):
        return 1, world, method
    if method in GRID_METHODS:
        tp, cp, cp_method = GRID_METHODS[method]
        if tp * cp != world:
            raise ValueError(f"world: {method!r} runs on tp x cp = {tp * cp} ranks, got world = {world}")
        return tp, cp, cp_method
    raise ValueError(f"method: unknown method {method!r}; one of {METHODS + tuple(GRID_METHODS)} or 'layer'")


def methods_at(world: int) -> tuple[str, ...]:
    """The methods a launch of ``world`` ranks measures: the 1-D ones, and the 2-D ones at P = GRID_WORLD."""
    return METHODS + (tuple(GRID_METHODS) if world == GRID_WORLD else ())


def feasible(method: str, shape: Shape, world: int) -> str | None:
    """Why ``method`` cannot split ``shape`` over ``world`` ranks, or None (the library's own rules: tp must divide
    h and g; Ulysses over cp needs cp | h/tp and (cp | g/tp or g/tp | cp))."""
    h, g = shape.num_heads, shape.num_kv_heads
    tp, cp, cp_method = split_of(method, world)
    if method == "tp" and (h % world or g % world):
        return f"P = {world} must divide h = {h} and g = {g} (HeadParallel keeps each kv head on one rank)"
    if method == "ulysses" and (h % world or (g % world and world % g)):
        return f"Ulysses needs P | h and (P | g or g | P); h = {h}, g = {g}, P = {world}"
    if method in GRID_METHODS:
        if h % tp or g % tp:
            return f"tp = {tp} must divide h = {h} and g = {g}"
        hl, gl = h // tp, g // tp
        if cp_method == "ulysses" and (hl % cp or (gl % cp and cp % gl)):
            return f"Ulysses over cp = {cp} needs cp | h/tp and (cp | g/tp or g/tp | cp); h/tp = {hl}, g/tp = {gl}"
    return None


def not_run(config: Config) -> list[str]:
    """The (shape, method, P) the library refuses, with the reason: they are left out of the plan."""
    out = []
    for shape in config.shapes:
        for method in METHODS + tuple(GRID_METHODS):
            for world in config.worlds:
                if method not in methods_at(world):
                    continue
                reason = feasible(method, shape, world)
                if reason is not None:
                    out.append(f"{shape.name} {method} at P = {world}: {reason}")
    return out


def plan_cases(config: Config, world: int) -> list[dict]:
    """The cases one launch of ``world`` ranks runs: every (shape, method, mode) that fits (the 2-D methods at
    P = GRID_WORLD only), then the longest-sequence cases (ring at n = world x n0, forward and forward+backward)."""
    cases = []
    for shape in config.shapes:
        for method in methods_at(world):
            if feasible(method, shape, world) is not None:
                continue
            for mode in MODES:
                cases.append(
                    {
                        "kind": "main",
                        "shape": asdict(shape),
                        "method": method,
                        "mode": mode,
                        "seq": config.seq,
                        "batch": config.batch,
                        "causal": True,
                        "repeats": config.repeats,
                    }
                )
    for method in config.scale_methods:
        for mode in MODES:
            cases.append(
                {
                    "kind": "scaling",
                    "shape": asdict(MHA),
                    "method": method,
                    "mode": mode,
                    "seq": world * config.scale_n0,
                    "batch": config.batch,
                    "causal": True,
                    "repeats": 0,  # one call: the memory call, timed
                }
            )
    if world == 1 and config.single_process:
        for times in config.worlds:
            for mode in MODES:
                cases.append(
                    {
                        "kind": "single",
                        "shape": asdict(MHA),
                        "method": "layer",
                        "mode": mode,
                        "seq": times * config.scale_n0,
                        "batch": config.batch,
                        "causal": True,
                        "repeats": 0,
                    }
                )
    return cases


# --------------------------------------------------------------------------- counters (pure parts)


def parse_net_dev(text: str, interface: str = "lo") -> tuple[int, int]:
    """(RX bytes, TX bytes) of ``interface`` from the text of /proc/net/dev; KeyError when it is absent."""
    for line in text.splitlines():
        name, sep, fields = line.partition(":")
        if sep and name.strip() == interface:
            values = fields.split()
            return int(values[0]), int(values[8])
    raise KeyError(f"no interface {interface!r} in /proc/net/dev")


def parse_proc_io(text: str, field: str = "wchar") -> int:
    """A field of /proc/<pid>/io (``wchar``: bytes passed to write/writev, sockets included)."""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == field:
            return int(value)
    raise KeyError(f"no field {field!r} in /proc/self/io")


def lo_tx_bytes() -> int:
    with open("/proc/net/dev") as f:
        return parse_net_dev(f.read())[1]


def wchar_bytes() -> int:
    with open("/proc/self/io") as f:
        return parse_proc_io(f.read())


# --------------------------------------------------------------------------- the prediction


def formula_sent_bytes(
    method: str, shape: Shape, *, seq: int, batch: int, world: int, itemsize: int = 4
) -> dict[str, int]:
    """Bytes each rank sends per call by the issue's formulas (forward, backward), without the cost model. With
    heads over t ranks and the sequence over c (:func:`split_of`), h' = h/t, g' = g/t, m = n/c:

    tp       forward one ring all-reduce of the (b, m, out) output over the t ranks, backward one of the (b, m, D)
             input gradient: 2 (t - 1) / t x size each
    ulysses  4 all-to-alls each way (q, k, v to heads and the output back; their gradients backward): (c - 1) / c
             of each rank's (b, m, .) shard of h' query and G key/value heads, G = g' or c when g' < c (replicated)
    ring     forward c - 1 sends of the rank's K/V shard (b, g', m, d + e); backward (2c - 1) x that shard

    A 2-D method (tp2 x ring2, tp2 x ulysses2) sends its tp all-reduces plus its cp method's bytes.
    """
    tp, cp, cp_method = split_of(method, world)
    b = batch
    h, g, d = shape.num_heads, shape.num_kv_heads, shape.embed_dim // shape.num_heads
    hl, gl, m = h // tp, g // tp, seq // cp
    forward = backward = 0
    if tp > 1:
        size = b * m * shape.embed_dim * itemsize
        forward += 2 * (tp - 1) * size // tp
        backward += 2 * (tp - 1) * size // tp
    if cp > 1 and cp_method == "ulysses":
        kv = gl if gl % cp == 0 else cp
        size = b * m * (2 * hl * d + 2 * kv * d) * itemsize  # q and out (h' heads), k and v (kv heads)
        forward += (cp - 1) * size // cp
        backward += (cp - 1) * size // cp
    elif cp > 1:
        shard = b * gl * m * 2 * d * itemsize
        forward += (cp - 1) * shard
        backward += (2 * cp - 1) * shard
    return {"forward": forward, "backward": backward}


def predicted(case: dict, world: int) -> dict:
    """The cost model's bytes per rank (forward, backward) and per-rank peak for ``case`` on ``world`` ranks, and
    the issue's formula beside it; {"source": ...} says which model answered (None fields when it is missing)."""
    shape = Shape(**case["shape"])
    formula = formula_sent_bytes(case["method"], shape, seq=case["seq"], batch=case["batch"], world=world)
    if case["mode"] == "forward":
        formula = {**formula, "backward": 0}
    out: dict[str, Any] = {
        "formula_sent": formula,
        "sent": None,
        "peak_bytes": None,
        "single_peak_bytes": None,
        "source": None,
    }
    try:
        from multihead.cost import LayerShape
        from multihead.cost_parallel import parallel_cost
    except ImportError as error:
        out["source"] = f"formula only (cost model missing: {error})"
        return out
    layer_shape = LayerShape(shape.embed_dim, shape.num_heads, num_kv_heads=shape.num_kv_heads)
    tp, cp, cp_method = split_of(case["method"], world)
    split: dict[str, Any] = {"tp": tp, "cp": cp}
    if cp_method is not None:
        split.update(cp_method=cp_method, layout=CP_LAYOUTS[cp_method])
    try:
        cost = parallel_cost(
            layer_shape,
            seq=case["seq"],
            batch=case["batch"],
            causal=case["causal"],
            dtype="float32",
            mode=case["mode"],
            **split,
        )
    except (TypeError, ValueError) as error:
        out["source"] = f"formula only (parallel_cost refused: {type(error).__name__}: {error})"
        return out
    sent = dict(cost.sent_bytes)
    if case["mode"] == "forward":
        sent["backward"] = 0
    one = parallel_cost(layer_shape, seq=case["seq"], batch=case["batch"], causal=case["causal"], mode=case["mode"])
    out.update(
        sent=sent,
        peak_bytes=int(cost.peak_bytes),
        single_peak_bytes=int(one.peak_bytes),  # the whole sequence on one process
        source="multihead.cost_parallel.parallel_cost",
    )
    return out


def all_reduce_evidence(per_rank: Sequence[float], size: int) -> dict:
    """What the bytes each rank wrote for one all-reduce of ``size`` bytes say about gloo's algorithm.

    Three candidates, by what each rank sends: ring or halving-doubling, 2 (P - 1)/P x size on every rank;
    direct, (P - 1) x size on every rank; reduce to one rank then broadcast, (P - 1) x size on the root and
    1 x size on the others (the same total as ring, so only the per-rank split tells it apart). Returns each
    rank's bytes over the ring volume and the direct volume, and the verdict: the candidate every rank is within
    10% of, or "none"."""
    p = len(per_rank)
    if p < 2 or size <= 0:
        return {"ring_ratios": [], "direct_ratios": [], "verdict": "no communication (P = 1)"}
    ring_volume, direct = 2 * (p - 1) * size / p, (p - 1) * size
    ring_ratios = [b / ring_volume for b in per_rank]
    direct_ratios = [b / direct for b in per_rank]
    ordered = sorted(per_rank)

    def near(value: float, target: float) -> bool:
        return abs(value / target - 1) <= 0.1

    if all(near(b, ring_volume) for b in per_rank):
        verdict = "ring volume on every rank (ring or halving-doubling)"
        if p == 2:
            verdict += "; at P = 2 it equals the direct exchange"
    elif all(near(b, direct) for b in per_rank):
        verdict = "direct: every rank sends its whole tensor to every other"
    elif near(ordered[-1], direct) and all(near(b, size) for b in ordered[:-1]):
        verdict = "reduce to one rank + broadcast (one rank sends (P - 1) x, the others 1 x)"
    else:
        verdict = "none of ring, direct, reduce + broadcast"
    return {"ring_ratios": ring_ratios, "direct_ratios": direct_ratios, "verdict": verdict}


def ratio(measured: float | None, expected: float | None) -> float | None:
    """measured / expected; None when either is missing or the expectation is 0."""
    if measured is None or expected is None or expected == 0:
        return None
    return measured / expected


# --------------------------------------------------------------------------- one rank (under torchrun)


def build_meshes(world: int, grid: bool) -> dict[str, Any]:
    """The DeviceMeshes of one launch, built once on every rank in the same order (a 2-D mesh creates subgroups,
    a collective): "all", 1-D over the default group's ``world`` ranks; with ``grid``, "grid", the (cp, tp) mesh of
    GRID_METHODS."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes: dict[str, Any] = {"all": init_device_mesh("cpu", (world,))}
    if grid:
        tp, cp = next(iter(GRID_METHODS.values()))[:2]
        meshes["grid"] = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))
    return meshes


def _step_factory(
    case: dict, rank: int, world: int, meshes: dict[str, Any]
) -> tuple[Callable[[], object], Callable[[], None], int]:
    """(step, clear, input bytes) of one case on this rank: the layer parallelized in place by the styles, this
    rank's input and output gradient; the bytes of the input (and, for backward, the output gradient) this rank
    holds before the call."""
    from torch.distributed.tensor.parallel import parallelize_module

    from multihead.parallel import ContextParallel, HeadParallel, zigzag_shard

    shape = Shape(**case["shape"])
    b, n, mode = case["batch"], case["seq"], case["mode"]
    torch.manual_seed(0)
    layer = multihead.MultiHeadAttention(shape.embed_dim, shape.num_heads, num_kv_heads=shape.num_kv_heads)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(b, n, shape.embed_dim, generator=generator)
    grad = torch.randn(b, n, shape.embed_dim, generator=generator)
    method = case["method"]
    if method != "layer":  # "layer": the plain layer, one process
        tp, cp, cp_method = split_of(method, world)
        if method in GRID_METHODS:
            tp_mesh, cp_mesh = meshes["grid"]["tp"], meshes["grid"]["cp"]
        else:
            tp_mesh = cp_mesh = meshes["all"]
        if method == "tp" or tp > 1:
            parallelize_module(layer, tp_mesh, HeadParallel())
        if cp_method is not None:
            layout = CP_LAYOUTS[cp_method]
            parallelize_module(layer, cp_mesh, ContextParallel(method=cp_method, layout=layout))
            position = cp_mesh.get_local_rank()
            if layout == "zigzag":
                x, grad = (zigzag_shard(t, position, cp, dim=1).clone() for t in (x, grad))
            else:
                x, grad = (t.chunk(cp, dim=1)[position].clone() for t in (x, grad))
    module: torch.nn.Module = layer

    def call(inp: torch.Tensor) -> torch.Tensor:
        return module(inp, causal=case["causal"])[0]  # (out, weights); (out, None) after ContextParallel

    del layer
    backward = mode == "forward+backward"
    x.requires_grad_(backward)  # tp's backward all-reduce is the input's gradient

    def step() -> object:
        if not backward:
            with torch.no_grad():
                call(x)
            return None
        call(x).backward(grad)
        return None

    def clear() -> None:
        x.grad = None
        module.zero_grad(set_to_none=True)

    held_bytes = x.numel() * x.element_size() + (grad.numel() * grad.element_size() if backward else 0)
    return step, clear, held_bytes


def _window(step: Callable[[], object], rank: int) -> dict:
    """One step between barriers: its seconds on this rank, this process's written bytes and (rank 0) lo's TX.

    The counters are read between two barriers before the step: with one, a rank could leave it and send (in a
    subgroup without rank 0, as the 2-D cases' first collective is) before rank 0 has read lo's start. The
    barrier-only windows go through the same two barriers, so their bytes are subtracted with the baseline."""
    import torch.distributed as dist

    dist.barrier()
    tx0 = lo_tx_bytes() if rank == 0 else 0
    w0 = wchar_bytes()
    dist.barrier()  # no rank sends before rank 0 has read lo's start
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    dist.barrier()
    w1 = wchar_bytes()
    tx1 = lo_tx_bytes() if rank == 0 else 0
    return {"s": seconds, "wchar": w1 - w0, "lo_tx": tx1 - tx0 if rank == 0 else None}


class _Workload:
    def __init__(self, step: Callable[[], object], clear: Callable[[], None]):
        self.step, self.clear = step, clear


def measure_case(case: dict, rank: int, world: int, meshes: dict[str, Any]) -> dict:
    """On every rank: warm-up, the memory call, then ``repeats`` timed and counted steps."""
    step, clear, held_bytes = _step_factory(case, rank, world, meshes)
    record: dict[str, Any] = {"case": case, "input_mib": held_bytes / MIB}
    if case["repeats"]:
        clear()
        step()  # warm-up
    clear()
    held: dict[str, Any] = {}

    def memory_call() -> None:
        held["peak"] = peak_memory(_Workload(step, clear))

    window = _window(memory_call, rank)  # its bytes are counted too: the longest-sequence cases have no steps
    peak_mib, before_mib, _ = held["peak"]
    record.update(peak_mib=peak_mib, rss_before_mib=before_mib, memory_call_s=window["s"], memory_window=window)
    steps = []
    for _ in range(case["repeats"]):
        clear()
        steps.append(_window(step, rank))
    record["steps"] = steps
    clear()
    gc.collect()
    set_mmap_threshold(TIMING_MMAP_THRESHOLD)  # also trims the heap
    return record


def probe_torch_context_parallel(mesh: Any) -> dict:
    """Whether torch's own context parallel runs torch's SDPA here: one causal call inside
    ``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2])``.
    Recorded, not timed: {"ran", "error_type", "error" (its first line), "shard"} on this rank."""
    import torch.distributed as dist

    found: dict[str, Any] = {"ran": False, "error_type": None, "error": None, "shard": None}
    try:
        from torch.distributed.tensor.experimental import context_parallel

        generator = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(1, 2, 16 * mesh.size(), 8, generator=generator) for _ in range(3))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            found["shard"] = list(q.shape)
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        found["ran"] = True
    except Exception as error:  # what torch raises is the result
        found["error_type"] = f"{type(error).__module__}.{type(error).__qualname__}".removeprefix("builtins.")
        found["error"] = (str(error).strip().splitlines() or [""])[0]
    dist.barrier()
    return found


def summarise_torch_cp(ranks: list[dict]) -> dict | None:
    """The ranks' torch context_parallel outcomes as one: rank 0's, with "world" and whether every rank saw the
    same ("agree"); None when the launch did not try it."""
    outcomes = [r.get("torch_context_parallel") for r in ranks]
    if outcomes[0] is None:
        return None
    first = outcomes[0]
    same = all(o is not None and (o["ran"], o["error_type"], o["error"]) == (first["ran"], first["error_type"],
               first["error"]) for o in outcomes)  # fmt: skip
    return {**first, "world": len(ranks), "agree": same}


def torch_cp_text(outcome: dict | None) -> str:
    """The report's line on torch's own context_parallel."""
    if outcome is None:
        return "- torch's own context_parallel was not tried in this run."
    head = (
        f"- torch's own context parallel (`torch.distributed.tensor.experimental.context_parallel`, a 1-D mesh of "
        f"P = {outcome['world']} gloo ranks, one causal `scaled_dot_product_attention` call on the CPU"
        + (f", q/k/v sharded to {tuple(outcome['shard'])}" if outcome.get("shard") else "")
        + "): "
    )
    agree = "" if outcome.get("agree", True) else " (the ranks did not all see the same)"
    if outcome["ran"]:
        return head + f"ran{agree}. It is not measured here: only multihead's styles are."
    return (
        head + f"raised {outcome['error_type']}: {outcome['error']}{agree} So torch's context parallel is not "
        "measured here: on the CPU it cannot run torch's own SDPA."
    )


def worker(plan_path: Path) -> int:
    """One rank of a torchrun launch: run the plan's cases, write rank<r>.json beside the plan."""
    import torch.distributed as dist

    plan = json.loads(plan_path.read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(plan["threads"])
    set_mmap_threshold(TIMING_MMAP_THRESHOLD)
    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    meshes = build_meshes(world, grid=any(case["method"] in GRID_METHODS for case in plan["cases"]))
    gc.freeze()  # the imported modules out of every later gc.collect(): the harness collects around each call
    out: dict[str, Any] = {"rank": rank, "world": world, "threads": torch.get_num_threads(), "pid": os.getpid()}
    noop = [_window(lambda: None, rank) for _ in range(plan["noop_repeats"])]
    idle = _window(lambda: time.sleep(IDLE_S), rank)  # background traffic: torchrun's store, other processes
    records = []
    for case in plan["cases"]:
        started = time.perf_counter()
        records.append(measure_case(case, rank, world, meshes))
        if rank == 0:
            print(
                f"P={world} {case['kind']} {case['shape']['name']} {case['method']} {case['mode']} n={case['seq']}: "
                f"{time.perf_counter() - started:.1f} s",
                flush=True,
            )
    noop_end = [_window(lambda: None, rank) for _ in range(plan["noop_repeats"])]
    out.update(noop=noop, noop_end=noop_end, idle=idle, records=records)
    if plan.get("torch_cp_probe"):  # last: nothing measured after it
        out["torch_context_parallel"] = probe_torch_context_parallel(meshes["all"])
    dist.barrier()
    dist.destroy_process_group()
    Path(plan_path.parent, f"rank{rank}.json").write_text(json.dumps(out))
    return 0


# --------------------------------------------------------------------------- the driver


def launch(config: Config, world: int, folder: Path) -> list[dict]:
    """Run one torchrun launch of ``world`` ranks on this config's cases; every rank's JSON, by rank."""
    folder.mkdir(parents=True, exist_ok=True)
    plan = {
        "threads": threads_per_rank(world),
        "noop_repeats": config.noop_repeats,
        "cases": plan_cases(config, world),
        "torch_cp_probe": world == TORCH_CP_WORLD,
    }
    plan_path = folder / "plan.json"
    plan_path.write_text(json.dumps(plan))
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        MALLOC_ENV: MALLOC_VALUE,
        "OMP_NUM_THREADS": str(plan["threads"]),
        "PYTHONUNBUFFERED": "1",
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        str(SCRIPT),
        "--plan",
        str(plan_path),
    ]
    subprocess.run(command, env=env, check=True, timeout=LAUNCH_TIMEOUT_S)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world)]


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise_noop(ranks: list[dict], key: str = "noop") -> dict:
    """The barrier-only windows of rank 0: median and max of lo's TX bytes, and each rank's written bytes."""
    tx = [w["lo_tx"] for w in ranks[0][key]]
    wchar = [statistics.median(w["wchar"] for w in r[key]) for r in ranks]
    return {"lo_tx": tx, "lo_tx_median": _median(tx), "lo_tx_max": max(tx) if tx else None, "wchar_median": wchar}


def summarise_case(ranks: list[dict], index: int, noop_tx: float, noop_wchar: list[float]) -> dict:
    """One case over the ranks: bytes per rank (lo, noop subtracted, / P; and each rank's written bytes), peak
    (max over ranks), time (per step the slowest rank; median, min, max), the prediction and the ratios."""
    world = len(ranks)
    records = [r["records"][index] for r in ranks]
    case = records[0]["case"]
    steps = len(records[0]["steps"])
    per_step_s = [max(rec["steps"][i]["s"] for rec in records) for i in range(steps)]
    lo = [rec["lo_tx"] for rec in records[0]["steps"]]
    lo_median = _median(lo)
    lo_per_rank = None if lo_median is None else (lo_median - noop_tx) / world
    memory_lo = records[0]["memory_window"]["lo_tx"]
    memory_call_bytes = None if memory_lo is None else (memory_lo - noop_tx) / world
    memory_wchar = max(rec["memory_window"]["wchar"] - noop_wchar[r] for r, rec in enumerate(records))
    wchar = [
        statistics.median(s["wchar"] for s in rec["steps"]) - noop_wchar[r] if rec["steps"] else None
        for r, rec in enumerate(records)
    ]
    wchar_known = [w for w in wchar if w is not None]
    peaks = [rec["peak_mib"] for rec in records]
    known = [p for p in peaks if p is not None]
    model = predicted(case, world)
    expect = model["sent"] or model["formula_sent"]
    expected_sent = expect["forward"] + expect["backward"]
    formula_sent = model["formula_sent"]["forward"] + model["formula_sent"]["backward"]
    peak = max(known) if known else None
    evidence = None
    if case["method"] == "tp" and case["mode"] == "forward" and world > 1 and len(wchar_known) == world:
        size = case["batch"] * case["seq"] * case["shape"]["embed_dim"] * 4  # the (b, n, out) float32 output
        evidence = all_reduce_evidence(wchar_known, size)
    predicted_mib = None if model["peak_bytes"] is None else model["peak_bytes"] / MIB
    return {
        "kind": case["kind"],
        "shape": case["shape"]["name"],
        "method": case["method"],
        "mode": case["mode"],
        "seq": case["seq"],
        "batch": case["batch"],
        "world": world,
        "lo_tx_per_step": lo,
        "bytes_per_rank": lo_per_rank,
        "memory_call_bytes_per_rank": memory_call_bytes,
        "memory_call_wchar_max": memory_wchar,
        "wchar_per_rank": wchar,
        "wchar_max": max(wchar_known) if wchar_known else None,
        "predicted_sent": model["sent"],
        "formula_sent": model["formula_sent"],
        "predicted_bytes": expected_sent,
        "prediction_source": model["source"],
        "bytes_ratio": ratio(lo_per_rank, expected_sent) if world > 1 else None,
        "formula_ratio": ratio(lo_per_rank, formula_sent) if world > 1 else None,
        "peak_mib_per_rank": peaks,
        "input_mib": max(rec.get("input_mib") or 0.0 for rec in records),
        "peak_mib": peak,
        "predicted_peak_mib": predicted_mib,
        "single_process_peak_mib": None if model["single_peak_bytes"] is None else model["single_peak_bytes"] / MIB,
        "peak_ratio": ratio(peak, predicted_mib),
        "times_s": per_step_s,
        "median_s": _median(per_step_s),
        "min_s": min(per_step_s) if per_step_s else None,
        "max_s": max(per_step_s) if per_step_s else None,
        "memory_call_s": max(rec["memory_call_s"] for rec in records),
        "all_reduce": evidence,
    }


def lscpu_info() -> dict:
    """CPU model, flags (lscpu, else /proc/cpuinfo), cores, RAM: what the harness's machine_info reports."""
    model, flags = cpu_model(), None
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                model = value.strip()
            if key.strip() == "Flags":
                flags = value.split()
    except (OSError, subprocess.CalledProcessError):
        pass
    simd = [f for f in (flags or []) if f in ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")]
    ram = ram_bytes()
    return {
        "processor": model,
        "simd_flags": simd,
        "cpu_count": os.cpu_count(),
        "ram_gib": None if ram is None else ram / 2**30,
        "torch": torch.__version__,
        "multihead": multihead.__version__,
        "python": sys.version.split()[0],
    }


def git_state() -> dict:
    """The commit this checkout is at and the files under src/ that differ from it (what the run measured)."""
    root = SCRIPT.parents[1]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"], cwd=root, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "modified": []}
    return {"commit": commit, "modified": [line[3:] for line in status.splitlines() if line.strip()]}


QUIET_LOAD = 0.5  # a 1-minute load average at most this before the run: nothing else was running


def load_verdict(load: Sequence[float] | None) -> str:
    """ "quiet" or "loaded" from the load averages (1, 5, 15 min) taken before the run; "unknown" without them."""
    if load is None:
        return "unknown"
    return "quiet" if load[0] <= QUIET_LOAD else "loaded"


def load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def run(config: Config, say: Callable[[str], None] = print) -> dict:
    """Launch P = 1, 2, 4; summarise every case; the results dict the reports are written from."""
    started = time.perf_counter()
    load_before = load_average()
    launches = []
    rows = []
    torch_cp = None
    with tempfile.TemporaryDirectory(prefix="multihead-parallel-") as tmp:
        for world in config.worlds:
            say(f"launching {world} rank(s), {threads_per_rank(world)} thread(s) each")
            t0 = time.perf_counter()
            ranks = launch(config, world, Path(tmp, f"p{world}"))
            noop = summarise_noop(ranks)
            noop_end = summarise_noop(ranks, "noop_end")
            noop_tx = noop["lo_tx_median"] or 0
            torch_cp = summarise_torch_cp(ranks) or torch_cp
            for index in range(len(ranks[0]["records"])):
                rows.append(summarise_case(ranks, index, noop_tx, noop["wchar_median"]))
            launches.append(
                {
                    "world": world,
                    "threads_per_rank": ranks[0]["threads"],
                    "noop": noop,
                    "noop_end": noop_end,
                    "idle_lo_tx_per_s": ranks[0]["idle"]["lo_tx"] / IDLE_S,
                    "seconds": time.perf_counter() - t0,
                }
            )
    return {
        "config": asdict(config),
        "machine": lscpu_info(),
        "git": git_state(),
        "load_before": load_before,
        "load_after": load_average(),
        "launches": launches,
        "not_run": not_run(config),
        "rows": rows,
        "torch_context_parallel": torch_cp,
        "elapsed_s": time.perf_counter() - started,
    }


# --------------------------------------------------------------------------- reports


def fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def fmt_bytes(value: float | None) -> str:
    """Bytes as MiB with 3 significant digits ("—" for None); 0 as "0"."""
    if value is None:
        return "—"
    if value == 0:
        return "0"
    return f"{value / MIB:.3g} MiB" if abs(value) >= 0.01 * MIB else f"{value:.0f} B"


def bytes_table(rows: list[dict]) -> list[str]:
    lines = [
        "| layer | method | mode | P | measured per rank (lo) | written per rank (wchar, max) | predicted | "
        "measured / predicted |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["kind"] != "main" or r["world"] == 1:
            continue
        lines.append(
            f"| {r['shape']} | {r['method']} | {r['mode']} | {r['world']} | {fmt_bytes(r['bytes_per_rank'])} | "
            f"{fmt_bytes(r['wchar_max'])} | {fmt_bytes(r['predicted_bytes'])} | {fmt(r['bytes_ratio'], '.3f')} |"
        )
    return lines


def memory_time_table(rows: list[dict]) -> list[str]:
    lines = [
        "| layer | method | mode | P | peak per rank MiB (max; all ranks) | predicted MiB | measured / predicted | "
        "time ms (median) | min–max ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["kind"] != "main":
            continue
        ranks = ", ".join(fmt(p, ".0f") for p in r["peak_mib_per_rank"])
        lines.append(
            f"| {r['shape']} | {r['method']} | {r['mode']} | {r['world']} | {fmt(r['peak_mib'], '.1f')} ({ranks}) | "
            f"{fmt(r['predicted_peak_mib'], '.1f')} | {fmt(r['peak_ratio'], '.2f')} | "
            f"{fmt(None if r['median_s'] is None else r['median_s'] * 1e3, '.1f')} | "
            f"{fmt(None if r['min_s'] is None else r['min_s'] * 1e3, '.1f')}–"
            f"{fmt(None if r['max_s'] is None else r['max_s'] * 1e3, '.1f')} |"
        )
    return lines


def scaling_table(rows: list[dict]) -> list[str]:
    lines = [
        "| method | mode | P | n = P x n0 | call's peak per rank MiB (max) | + input held MiB | total / P = 1 | "
        "predicted MiB | peak / predicted | the layer on one process at this n: peak MiB (predicted) | one call s | "
        "sent per rank: lo / wchar / predicted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    scaling = [r for r in rows if r["kind"] == "scaling"]
    single = {(r["mode"], r["seq"]): r for r in rows if r["kind"] == "single"}
    methods = list(dict.fromkeys(r["method"] for r in scaling))
    for method in methods:
        for mode in MODES:
            sel = [r for r in scaling if r["method"] == method and r["mode"] == mode]
            base = next((total_mib(r) for r in sel if r["world"] == 1), None)
            for r in sel:
                one = single.get((mode, r["seq"]))
                one_text = (
                    f"{fmt(one['peak_mib'], '.0f')} ({fmt(one['predicted_peak_mib'], '.0f')})"
                    if one is not None
                    else f"— ({fmt(r.get('single_process_peak_mib'), '.0f')})"
                )
                lines.append(
                    f"| {method} | {mode} | {r['world']} | {r['seq']} | {fmt(r['peak_mib'], '.1f')} | "
                    f"{fmt(r.get('input_mib'), '.1f')} | {fmt(ratio(total_mib(r), base), '.2f')} | "
                    f"{fmt(r['predicted_peak_mib'], '.1f')} | {fmt(r['peak_ratio'], '.2f')} | {one_text} | "
                    f"{fmt(r['memory_call_s'], '.1f')} | {fmt_bytes(r.get('memory_call_bytes_per_rank'))} / "
                    f"{fmt_bytes(r.get('memory_call_wchar_max'))} / {fmt_bytes(r['predicted_bytes'])} |"
                )
    return lines


def total_mib(row: dict) -> float | None:
    """A row's per-rank peak plus the input (and output gradient) the rank holds: what a memory budget must fit."""
    return None if row["peak_mib"] is None else row["peak_mib"] + (row.get("input_mib") or 0.0)


def noop_table(launches: list[dict]) -> list[str]:
    lines = [
        "| P | torch threads per rank | lo TX of a barrier-only window, bytes (median; max) at start | at end | "
        f"lo TX in {IDLE_S:g} s idle between barriers, bytes | launch s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for launch_ in launches:
        a, b = launch_["noop"], launch_["noop_end"]
        lines.append(
            f"| {launch_['world']} | {launch_['threads_per_rank']} | {fmt(a['lo_tx_median'], '.0f')} "
            f"({fmt(a['lo_tx_max'], '.0f')}) | {fmt(b['lo_tx_median'], '.0f')} ({fmt(b['lo_tx_max'], '.0f')}) | "
            f"{launch_['idle_lo_tx_per_s'] * IDLE_S:.0f} | {launch_['seconds']:.0f} |"
        )
    return lines


def notes(results: dict) -> list[str]:
    """Bullet lines: the two byte counts against each other, the cost model against the issue's formula, what
    gloo's all-reduce sends, and the cases the library refuses."""
    rows = [r for r in results["rows"] if r["world"] > 1 and r["kind"] == "main"]
    lines = []
    pairs = [(r, q) for r in rows if (q := ratio(r["bytes_per_rank"], r["wchar_max"])) is not None]
    if pairs:
        worst_row, worst = max(pairs, key=lambda pair: abs(pair[1] - 1))
        lines.append(
            f"- lo's TX per rank against the largest rank's own writes: within {abs(worst - 1):.1%} on every case "
            f"(worst: {worst_row['shape']} {worst_row['method']} {worst_row['mode']} P = {worst_row['world']}). "
            "The loopback counter includes TCP/IP headers and ACKs; wchar counts the payload gloo hands the kernel."
        )
    modelled = [r for r in rows if r["predicted_sent"] is not None]
    differ = [r for r in modelled if r["predicted_sent"] != r["formula_sent"]]
    if modelled:
        lines.append(
            "- The cost model's bytes equal the issue's formulas (tp 2 (P - 1)/P x all-reduced tensor each way; "
            "Ulysses (P - 1)/P of 4 shards each way; ring P - 1 K/V shards forward, 2P - 1 backward; a 2-D case "
            "its tp all-reduces of (b, n/cp, D) over tp = 2 plus its cp method's bytes with h/2, g/2 heads on n/cp "
            f"positions) on {len(modelled) - len(differ)} of {len(modelled)} cases"
            + (
                "."
                if not differ
                else ": differ on "
                + ", ".join(f"{r['shape']} {r['method']} {r['mode']} P = {r['world']}" for r in differ)
                + "."
            )
        )
    for r in rows:
        if r.get("all_reduce"):
            per_rank = ", ".join(f"{q:.3f}" for q in r["all_reduce"]["ring_ratios"])
            lines.append(
                f"- gloo's all-reduce ({r['shape']}, tp forward, P = {r['world']}): each rank wrote "
                f"{per_rank} x the ring volume 2 (P - 1)/P x size: {r['all_reduce']['verdict']}."
            )
    grid = [r for r in rows if r["method"] in GRID_METHODS and r["bytes_ratio"] is not None]
    if grid:
        lines.append(
            "- 2-D cases (P = 4 on a (cp 2, tp 2) mesh): measured / predicted bytes "
            + ", ".join(f"{r['shape']} {r['method']} {r['mode']} {r['bytes_ratio']:.3f}" for r in grid)
            + ". lo counts every rank's sends, so total / P is the mean per rank whichever subgroup sent them."
        )
    lines.append(torch_cp_text(results.get("torch_context_parallel")))
    for line in results.get("not_run", []):
        lines.append(f"- Not run: {line}.")
    return lines


def machine_text(results: dict) -> str:
    m = results["machine"]
    load, after = results.get("load_before"), results.get("load_after")
    load_text = "unknown" if load is None else ", ".join(f"{x:.2f}" for x in load)
    after_text = "unknown" if after is None else ", ".join(f"{x:.2f}" for x in after)
    git = results.get("git") or {}
    modified = git.get("modified") or []
    tree = f" (working tree: {', '.join(modified)} modified)" if modified else ""
    return (
        f"{m['processor']} ({' '.join(m['simd_flags'])}), {m['cpu_count']} cores, {fmt(m['ram_gib'], '.0f')} GiB; "
        f"torch {m['torch']}, multihead {m['multihead']} at {git.get('commit') or 'unknown commit'}{tree}, "
        f"Python {m['python']}; gloo over loopback. Load average (1, 5, 15 min) before the run {load_text}, "
        f"after it {after_text}: a {load_verdict(load)} machine (quiet: 1-minute load <= {QUIET_LOAD:g} before the "
        "run; load changes the times, not the bytes or the memory)."
    )


def markdown(results: dict) -> str:
    """The report: machine, how it was measured, the noop baseline, bytes, memory and time, longest sequence."""
    config = results["config"]
    rows = results["rows"]
    sources = sorted({r["prediction_source"] for r in rows if r["prediction_source"]})
    lines = [
        f"# Head- and sequence-parallel attention across processes ({'quick' if config['quick'] else 'full'} run)",
        "",
        f"Machine: {machine_text(results)}",
        "",
        f"P ranks are P processes on this {CORES}-core machine (torchrun --standalone, gloo over the loopback "
        "interface): 4 ranks share 2 cores, so time cannot fall past 2 ranks, and a send is a memory copy through "
        "the kernel, not a network. Each rank runs max(1, 2 // P) torch threads.",
        "",
        "Splits, through multihead's ParallelStyles for torch's `parallelize_module`, applied in place to the layer: "
        'tp = `HeadParallel()` on a 1-D mesh of the P ranks; ring = `ContextParallel(method="ring", '
        'layout="zigzag")`; ulysses = `ContextParallel(method="ulysses", layout="contiguous")`; at P = 4 '
        'also tp2 x ring2 and tp2 x ulysses2: a (cp 2, tp 2) mesh, `HeadParallel()` over mesh["tp"], then the '
        'ContextParallel over mesh["cp"] (each rank h/2 heads of n/2 positions).',
        "",
        f"One layer, causal self-attention, batch {config['batch']}, float32, n = {config['seq']} in the main "
        f"tables; {config['repeats']} timed steps per case after a warm-up and the memory call. Bytes: lo's TX "
        "counter on rank 0 around each step (read between two barriers before it, after one barrier after it), "
        "minus the median of barrier-only windows, divided by P; median over the steps. 'written' is each rank's "
        "own /proc/self/io wchar over the same window (barrier-only subtracted), the largest rank. Predicted: "
        + ("; ".join(sources) or "none")
        + ".",
        "",
        "Reproduce: `make bench-parallel` (`python benchmarks/parallel.py`; `--quick` for the short run).",
        "",
        *notes(results),
        "",
        "## Barrier-only windows (the baseline subtracted from every byte count)",
        "",
        *noop_table(results["launches"]),
        "",
        "## Bytes each rank sends per call",
        "",
        *bytes_table(rows),
        "",
        "## Peak memory per rank and time",
        "",
        *memory_time_table(rows),
        "",
        f"## The longest sequence per memory budget: n = P x {config['scale_n0']}",
        "",
        f"{MHA.name}, causal, n grows with P. One call per case (the memory call, whose time is shown); the peak is "
        "the largest rank's, above what the rank held before the call. The input x (and, with backward, the output "
        "gradient) is held before the call, so it is listed beside the peak: tp holds the whole (b, n, D) on every "
        "rank, Ulysses and ring n/P of it. If a method's total per rank stays flat, a per-rank memory budget holds a "
        "P times longer sequence. The plain layer on one process at the same n is measured beside it (in the P = 1 "
        "launch, 2 threads), with the cost model's peak in brackets. At P = 1 nothing is sent: what lo counts "
        "there over a call of seconds is other processes' loopback traffic (torchrun's store keep-alive, other "
        "jobs), which the per-process wchar column does not see.",
        "",
        *scaling_table(rows),
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    """Two panels: bytes per rank measured and predicted against P; ring's per-rank peak at n = P n0."""
    plt = pyplot()
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    shapes = results["config"]["shapes"]
    first = shapes[0]["name"] if shapes else None
    rows = [r for r in results["rows"] if r["kind"] == "main" and r["shape"] == first]
    for method, color in zip(METHODS + tuple(GRID_METHODS), ("C0", "C1", "C2", "C3", "C4"), strict=True):
        for mode, marker in zip(MODES, ("o", "s"), strict=True):
            sel = [r for r in rows if r["method"] == method and r["mode"] == mode and r["world"] > 1]
            if not sel:
                continue
            ps = [r["world"] for r in sel]
            left.plot(
                ps,
                [(r["bytes_per_rank"] or 0) / MIB for r in sel],
                marker=marker,
                color=color,
                label=f"{method} {mode}",
            )
            left.plot(ps, [r["predicted_bytes"] / MIB for r in sel], linestyle=":", color=color)
    left.set_xticks(list(results["config"]["worlds"]))
    left.set_xlabel("P ranks")
    left.set_ylabel("MiB sent per rank per call")
    left.set_title(f"{first}, n = {results['config']['seq']} (dotted: predicted)", fontsize=9)
    if left.get_legend_handles_labels()[0]:
        left.legend(fontsize=7)
    scaling = [r for r in results["rows"] if r["kind"] == "scaling"]
    for method, color in zip(METHODS, ("C0", "C1", "C2"), strict=True):
        for mode, marker, style in zip(MODES, ("o", "s"), ("--", "-"), strict=True):
            sel = [r for r in scaling if r["mode"] == mode and r["method"] == method]
            if sel:
                right.plot(
                    [r["world"] for r in sel],
                    [total_mib(r) or 0 for r in sel],
                    marker=marker,
                    linestyle=style,
                    color=color,
                    label=f"{method} {mode}",
                )
    right.set_xticks(list(results["config"]["worlds"]))
    right.set_xlabel("P ranks (n = P x n0)")
    right.set_ylabel("peak + input held, MiB per rank")
    right.set_ylim(bottom=0)
    right.set_title(f"{MHA.name}, n = P x {results['config']['scale_n0']}", fontsize=9)
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_reports(results: dict, out_dir: Path, stem: str) -> str:
    """<stem>.json, .md and .png under out_dir; returns the markdown."""
    return common.write_reports(results, out_dir, stem, markdown, plot)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="n = 256, one shape, 3 steps per case (under a minute)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder (default benchmarks/results)")
    parser.add_argument("--report", type=Path, help="rewrite the .md and .png from this results JSON; run nothing")
    parser.add_argument("--plan", type=Path, help=argparse.SUPPRESS)  # one rank under torchrun
    args = parser.parse_args(argv)
    if args.plan is not None:
        return worker(args.plan)
    if args.report is not None:
        results = json.loads(args.report.read_text())
        print(write_reports(results, args.report.parent, args.report.stem))
        return 0
    config = QUICK if args.quick else FULL
    results = run(config)
    text = write_reports(results, args.out, config.stem)
    print(text)
    print(f"wrote {args.out / config.stem}.json, .md, .png ({results['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
