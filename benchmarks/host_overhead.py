"""What does ``backend="auto"`` cost on small calls? auto, multihead's SDPA backend and torch's SDPA, side by side.

Usage:
    python benchmarks/host_overhead.py [--rounds 200] [--block-ms 1] [--device cpu|cuda] [--dtype float32]
                                       [--threads N] [--out benchmarks/results] [--smoke]
    make bench-overhead

Kernel cases (b = 1, h = 8, d = 64, under no_grad):

- **decode**: 1 query over 128, 1024 and 4096 keys, no mask (the last query sees every key);
- **prefill**: causal self-attention, n = 64 and 256.

Contestants: ``multihead.attention(..., backend="auto")``, ``multihead.attention(..., backend="sdpa")`` and
``torch.nn.functional.scaled_dot_product_attention`` called directly (``is_causal=True`` for prefill). The
difference auto - torch SDPA is the host time auto adds (validation, mask binding, dispatch); auto - sdpa is the
share of it that the choice itself costs.

Layer case (embed 512, 8 heads, one decode step after a 1024-token prefix, under no_grad):

- **ours, cached**: ``multihead.MultiHeadAttention`` on one new token with a ``multihead.KVCache`` holding the
  prefix (before each timed call the cache is reset and the prefix appended again, untimed, so every call
  attends over 1025 keys);
- **torch SDPA step**: the same step written by hand with torch alone (fused QKV ``F.linear``, the new key and
  value written into preallocated buffers, ``F.scaled_dot_product_attention``, the output projection);
- **ours, no cache** and **torch MHA, no cache**: our layer and ``torch.nn.MultiheadAttention`` on the full
  1025-token sequence with a causal mask, which is what a decoder without a cache computes each step (torch has
  no cache).

Timing: one warm-up call each (two on CUDA), then ``--rounds`` rounds in which every contestant runs once, the
order rotated left by one each round (as harness.common.interleaved_rounds). A contestant's time in a round is a
block of ``inner`` calls divided by ``inner``; ``inner`` is chosen per case so the slowest contestant's block lasts
about ``--block-ms`` (1 for the layer case, whose cached calls append to the cache). On CUDA each block starts and
ends with a synchronize. Reported per case: each contestant's median with its interquartile range over rounds,
and per comparison the difference of the medians in µs and the ratio taken round by round: median, interquartile
range, min and max. The machine line names the CPU (lscpu's model and vector flags), torch's threads and version.

Writes host_overhead.json and host_overhead.md (host_overhead_smoke.* with --smoke) under --out.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import multihead

HEADS = 8
HEAD_DIM = 64
EMBED = 512
PREFIX = 1024
AUTO, OURS_SDPA, TORCH_SDPA = "auto", "sdpa", "torch sdpa"
CACHED, TORCH_STEP, UNCACHED, TORCH_MHA = "ours, cached", "torch SDPA step", "ours, no cache", "torch MHA, no cache"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Config:
    rounds: int = 200
    block_ms: float = 1.0
    decode_keys: tuple[int, ...] = (128, 1024, 4096)
    prefill: tuple[int, ...] = (64, 256)
    prefix: int = PREFIX
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    smoke: bool = False
    out_dir: Path = field(default=RESULTS)

    @property
    def stem(self) -> str:
        return "host_overhead_smoke" if self.smoke else "host_overhead"

    @classmethod
    def smoke_config(cls, **overrides) -> Config:
        """Tiny repeats and sizes: checks the script runs and writes its reports, measures nothing."""
        sizes = {"rounds": 3, "block_ms": 0.05, "decode_keys": (64, 128), "prefill": (64,), "prefix": 128}
        return cls(**{**sizes, "smoke": True, **overrides})


@dataclass
class Contestant:
    """``call()`` is timed; ``setup()`` runs before each timed block, untimed."""

    call: Callable[[], object]
    setup: Callable[[], object] = lambda: None


@dataclass
class Case:
    name: str
    kind: str  # "kernel" or "layer"
    shape: str
    contestants: dict[str, Contestant]
    comparisons: list[tuple[str, str]]  # (subject, baseline): subject - baseline, subject / baseline
    inner: int | None = None  # calls per timed block (None: chosen from --block-ms)
    auto_choice: str | None = None
    outputs_agree: bool | None = None


# --------------------------------------------------------------------------- statistics (pure, tested)


def spread(values: Sequence[float]) -> dict:
    """median, quartiles (q1, q3; inclusive method, so within [min, max]), min, max, n."""
    values = list(values)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return {
        "median": statistics.median(values),
        "q1": q1,
        "q3": q3,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def compare(subject: Sequence[float], baseline: Sequence[float]) -> dict:
    """subject against baseline, both per round (seconds): the difference of the medians in µs and the per-round
    ratio's spread."""
    return {
        "difference_us": (statistics.median(subject) - statistics.median(baseline)) * 1e6,
        "ratio": spread([a / b for a, b in zip(subject, baseline, strict=True)]),
    }


def rotations(names: Sequence[str], rounds: int) -> list[list[str]]:
    """Each round's order: ``names`` rotated left by one more each round."""
    names = list(names)
    return [names[r % len(names) :] + names[: r % len(names)] for r in range(rounds)]


# --------------------------------------------------------------------------- timing


def synchronizer(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def time_block(contestant: Contestant, inner: int, sync: Callable[[], None]) -> float:
    """Seconds per call over a block of ``inner`` calls (setup untimed)."""
    contestant.setup()
    sync()
    start = time.perf_counter()
    for _ in range(inner):
        contestant.call()
    sync()
    return (time.perf_counter() - start) / inner


def choose_inner(case: Case, block_s: float, sync: Callable[[], None]) -> int:
    """Calls per block so the slowest contestant's block lasts about ``block_s`` (at least 1, at most 10000)."""
    if case.inner is not None:
        return case.inner
    slowest = max(min(time_block(c, 1, sync) for _ in range(3)) for c in case.contestants.values())
    return max(1, min(10_000, math.ceil(block_s / max(slowest, 1e-9))))


def measure(case: Case, config: Config, sync: Callable[[], None]) -> dict:
    """Warm up, choose inner, run the interleaved rounds; the case's record."""
    warmups = 2 if config.device.startswith("cuda") else 1
    for contestant in case.contestants.values():
        for _ in range(warmups):
            time_block(contestant, 1, sync)
    inner = choose_inner(case, config.block_ms / 1e3, sync)
    times: dict[str, list[float]] = {name: [] for name in case.contestants}
    for order in rotations(list(case.contestants), config.rounds):
        for name in order:
            times[name].append(time_block(case.contestants[name], inner, sync))
    return {
        "name": case.name,
        "kind": case.kind,
        "shape": case.shape,
        "inner": inner,
        "rounds": config.rounds,
        "auto_choice": case.auto_choice,
        "outputs_agree": case.outputs_agree,
        "contestants": {name: {k: v * 1e6 for k, v in spread(ts).items() if k != "n"} for name, ts in times.items()},
        "comparisons": [
            {"subject": subject, "baseline": baseline, **compare(times[subject], times[baseline])}
            for subject, baseline in case.comparisons
        ],
        "times_s": times,
    }


# --------------------------------------------------------------------------- the cases


def _randn(*shape: int, generator: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)


def _agree(outputs: Sequence[torch.Tensor], dtype: torch.dtype) -> bool:
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    first = outputs[0].float()
    return all(torch.allclose(first, o.float(), atol=tol, rtol=tol) for o in outputs[1:])


def kernel_case(name: str, shape: str, q, k, v, causal: bool) -> Case:
    """auto, multihead's sdpa and torch's SDPA on the same q, k, v (under no_grad)."""

    def ours(backend: str) -> Callable[[], object]:
        return lambda: multihead.attention(q, k, v, causal=causal, backend=backend)

    def torch_sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    contestants = {
        AUTO: Contestant(ours(AUTO)),
        OURS_SDPA: Contestant(ours(OURS_SDPA)),
        TORCH_SDPA: Contestant(torch_sdpa),
    }
    outputs = [c.call() for c in contestants.values()]
    return Case(
        name=name,
        kind="kernel",
        shape=shape,
        contestants=contestants,
        comparisons=[(AUTO, TORCH_SDPA), (AUTO, OURS_SDPA), (OURS_SDPA, TORCH_SDPA)],
        auto_choice=multihead.explain(q, k, v, causal=causal).chosen,
        outputs_agree=_agree(outputs, q.dtype),  # type: ignore[arg-type]
    )


def kernel_cases(config: Config, device: torch.device, dtype: torch.dtype) -> list[Case]:
    generator = torch.Generator().manual_seed(0)
    cases = []
    for keys in config.decode_keys:
        q = _randn(1, HEADS, 1, HEAD_DIM, generator=generator, device=device, dtype=dtype)
        k, v = (_randn(1, HEADS, keys, HEAD_DIM, generator=generator, device=device, dtype=dtype) for _ in range(2))
        shape = f"q (1, {HEADS}, 1, {HEAD_DIM}), k v (1, {HEADS}, {keys}, {HEAD_DIM})"
        cases.append(kernel_case(f"decode 1 x {keys}", shape, q, k, v, causal=False))
    for n in config.prefill:
        q, k, v = (_randn(1, HEADS, n, HEAD_DIM, generator=generator, device=device, dtype=dtype) for _ in range(3))
        cases.append(kernel_case(f"prefill causal n={n}", f"q k v (1, {HEADS}, {n}, {HEAD_DIM})", q, k, v, causal=True))
    return cases


def layer_case(config: Config, device: torch.device, dtype: torch.dtype) -> Case:
    """One decode step after ``config.prefix`` tokens: our cached layer, a hand-written torch step, and the
    full causal sequence through our layer and torch.nn.MultiheadAttention."""
    torch.manual_seed(0)
    prefix, total = config.prefix, config.prefix + 1
    factory = {"device": device, "dtype": dtype}
    ours = multihead.MultiHeadAttention(EMBED, HEADS, **factory).eval()
    mha = torch.nn.MultiheadAttention(EMBED, HEADS, batch_first=True, **factory).eval()
    generator = torch.Generator().manual_seed(1)
    sequence = _randn(1, total, EMBED, generator=generator, device=device, dtype=dtype)  # (b, n, embed)
    token = sequence[:, -1:]  # (b, 1, embed): the new token

    # the cache holding the prefix: its keys/values from one prefill call, kept to refill the cache before each block
    cache = ours.new_cache(1, total)
    ours(sequence[:, :prefix], causal=True, cache=cache)
    prefix_k, prefix_v = cache.keys[:, :, :prefix].clone(), cache.values[:, :, :prefix].clone()  # (b, g, prefix, d)

    def refill() -> None:
        cache.reset()
        cache.append(prefix_k, prefix_v)

    # the hand-written step: fused QKV weights and preallocated key/value buffers (b, h, total, d)
    w_qkv = _randn(3 * EMBED, EMBED, generator=generator, device=device, dtype=dtype) / EMBED**0.5
    w_out = _randn(EMBED, EMBED, generator=generator, device=device, dtype=dtype) / EMBED**0.5
    k_buffer = _randn(1, HEADS, total, HEAD_DIM, generator=generator, device=device, dtype=dtype)
    v_buffer = _randn(1, HEADS, total, HEAD_DIM, generator=generator, device=device, dtype=dtype)

    def torch_step() -> torch.Tensor:
        qkv = F.linear(token, w_qkv)  # (b, 1, 3 * embed)
        q, k, v = qkv.view(1, 1, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)  # each (b, h, 1, d)
        k_buffer[:, :, prefix:total] = k
        v_buffer[:, :, prefix:total] = v
        o = F.scaled_dot_product_attention(q, k_buffer, v_buffer)  # (b, h, 1, d)
        return F.linear(o.transpose(1, 2).reshape(1, 1, EMBED), w_out)  # (b, 1, embed)

    causal_mask = torch.ones(total, total, dtype=torch.bool, device=device).triu(1)  # torch MHA: True = masked

    def torch_mha() -> object:
        return mha(sequence, sequence, sequence, attn_mask=causal_mask, is_causal=True, need_weights=False)

    contestants = {
        CACHED: Contestant(lambda: ours(token, causal=True, cache=cache), setup=refill),
        TORCH_STEP: Contestant(torch_step),
        UNCACHED: Contestant(lambda: ours(sequence, causal=True)),
        TORCH_MHA: Contestant(torch_mha),
    }
    refill()
    cached_out = contestants[CACHED].call()[0]  # type: ignore[index]
    full_out = contestants[UNCACHED].call()[0]  # type: ignore[index]
    return Case(
        name=f"layer decode step, {prefix}-token prefix",
        kind="layer",
        shape=f"embed {EMBED}, {HEADS} heads, b = 1; no cache: the full {total}-token causal sequence",
        contestants=contestants,
        comparisons=[(CACHED, TORCH_STEP), (CACHED, TORCH_MHA), (UNCACHED, TORCH_MHA), (CACHED, UNCACHED)],
        inner=1,
        outputs_agree=_agree([cached_out, full_out[:, -1:]], dtype),
    )


# --------------------------------------------------------------------------- machine, run, reports


def lscpu() -> dict:
    """lscpu's model name, CPU count and the vector/matrix flags ({} where lscpu cannot run)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}
    flags = fields.get("Flags", "").split()
    wanted = [f for f in flags if f in ("avx", "avx2", "fma", "f16c") or f.startswith(("avx512", "amx"))]
    return {"model": fields.get("Model name"), "cpus": fields.get("CPU(s)"), "flags": wanted}


def machine(device: torch.device) -> dict:
    cpu = lscpu()
    info = {
        "cpu_model": cpu.get("model"),
        "cpus": cpu.get("cpus") or os.cpu_count(),
        "cpu_flags": cpu.get("flags", []),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "multihead": multihead.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def machine_line(m: dict) -> str:
    gpu = f"; {m['gpu']} (CUDA {m['cuda']})" if "gpu" in m else ""
    flags = " ".join(m["cpu_flags"]) or "no AVX listed"
    return (
        f"{m['cpu_model'] or 'unknown CPU'} ({m['cpus']} CPUs; lscpu flags: {flags}), torch {m['torch']} "
        f"with {m['torch_threads']} threads{gpu}; device {m['device']}"
    )


def run(config: Config, say: Callable[[str], None] = print) -> dict:
    started = time.perf_counter()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    device = torch.device(config.device)
    dtype = DTYPES[config.dtype]
    sync = synchronizer(device)
    records = []
    with torch.no_grad():
        cases = [*kernel_cases(config, device, dtype), layer_case(config, device, dtype)]
        for case in cases:
            record = measure(case, config, sync)
            records.append(record)
            first = record["comparisons"][0]
            say(
                f"{case.name}: {first['subject']} - {first['baseline']} = {first['difference_us']:+.1f} µs, "
                f"ratio {first['ratio']['median']:.3f}"
            )
    config_json = {**asdict(config), "out_dir": str(config.out_dir)}
    return {
        "benchmark": "host_overhead",
        "config": config_json,
        "machine": machine(device),
        "cases": records,
        "elapsed_s": time.perf_counter() - started,
    }


def _us(value: float) -> str:
    return f"{value:,.1f}"


def _ratio(r: dict) -> str:
    return f"{r['median']:.3f} [{r['q1']:.3f}, {r['q3']:.3f}] ({r['min']:.2f}–{r['max']:.2f})"


def markdown(results: dict) -> str:
    c = results["config"]
    lines = [
        f"# Host overhead of auto on small calls ({'smoke run' if c['smoke'] else 'full run'})",
        "",
        f"Machine: {machine_line(results['machine'])}. {c['dtype']}, no grad; {c['rounds']} interleaved rounds, "
        "a block of `inner` calls per contestant per round. Times are medians over rounds [interquartile range] "
        "in µs per call; a ratio is the median of per-round ratios [interquartile range] (min–max).",
        "",
        "| case | auto picked | inner | subject | baseline | subject µs | baseline µs | difference µs | ratio |",
        "|---|---|---:|---|---|---:|---:|---:|---|",
    ]
    for case in results["cases"]:
        times = case["contestants"]
        for comp in case["comparisons"]:
            subject, baseline = times[comp["subject"]], times[comp["baseline"]]
            lines.append(
                f"| {case['name']} | {case['auto_choice'] or '—'} | {case['inner']} | {comp['subject']} | "
                f"{comp['baseline']} | {_us(subject['median'])} | {_us(baseline['median'])} | "
                f"{comp['difference_us']:+,.1f} | {_ratio(comp['ratio'])} |"
            )
    lines += ["", "| case | contestant | median µs [q1, q3] | min µs |", "|---|---|---|---:|"]
    for case in results["cases"]:
        for name, t in case["contestants"].items():
            lines.append(
                f"| {case['name']} | {name} | {_us(t['median'])} [{_us(t['q1'])}, {_us(t['q3'])}] | {_us(t['min'])} |"
            )
    disagree = [case["name"] for case in results["cases"] if case["outputs_agree"] is False]
    lines += [
        "",
        "Shapes: " + "; ".join(f"{case['name']}: {case['shape']}" for case in results["cases"]) + ".",
        "Outputs agree across contestants in every case."
        if not disagree
        else f"**Outputs differ** in: {', '.join(disagree)}.",
        f"Run took {results['elapsed_s']:.0f} s; load average at the end: {results['machine']['load_average']}.",
    ]
    return "\n".join(lines) + "\n"


def write_reports(results: dict, out_dir: Path, stem: str) -> str:
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    report = markdown(results)
    (out_dir / f"{stem}.md").write_text(report)
    return report


def _positive(kind: type, name: str) -> Callable[[str], object]:
    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: expected a positive number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{name}: expected a positive number, got {text!r}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=_positive(int, "--rounds"), help="interleaved rounds (default 200; smoke 3)")
    p.add_argument("--block-ms", type=_positive(float, "--block-ms"), help="target block length (default 1 ms)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--threads", type=_positive(int, "--threads"), help="torch intra-op threads (default torch's)")
    p.add_argument("--out", type=Path, default=RESULTS, help="output folder (default benchmarks/results)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and 3 rounds: checks the script, measures nothing")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {args.device}: CUDA is not available to torch {torch.__version__}", file=sys.stderr)
        return 2
    overrides = {"device": args.device, "dtype": args.dtype, "threads": args.threads, "out_dir": args.out}
    overrides.update({k: v for k, v in (("rounds", args.rounds), ("block_ms", args.block_ms)) if v is not None})
    config = Config.smoke_config(**overrides) if args.smoke else Config(**overrides)
    results = run(config)
    report = write_reports(results, config.out_dir, config.stem)
    print(report, flush=True)
    print(f"wrote {config.out_dir / config.stem}.json, .md ({results['elapsed_s']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
