"""Attention kernels on a GPU: auto and each multihead backend against torch SDPA's flash, cuDNN and efficient
kernels and compiled FlexAttention, forward and forward+backward, in one interleaved run per case.

Usage (scripts/gpu_check.sh --part 2 runs it):
    python benchmarks/gpu_kernels.py [--device cuda] [--dtype bfloat16] [--head-dims 64,128]
                                     [--sizes 1024,4096,16384] [--masks causal,window,alibi,padding]
                                     [--modes forward,forward+backward] [--rounds 5] [--call-budget-s 1]
                                     [--max-run-s 420] [--out DIR] [--smoke]

For each case (mode x d x mask x n; b = 1, h = 16, bfloat16):

- **contestants**: ``multihead.attention(..., backend=X)`` for auto and each of multihead's backends (sdpa, tiled,
  flex, materialized) that serves the call (``multihead.explain(..., backend=X).chosen``); torch's
  ``scaled_dot_product_attention`` under ``torch.nn.attention.sdpa_kernel(SDPBackend.X)`` for FLASH_ATTENTION,
  CUDNN_ATTENTION and EFFICIENT_ATTENTION, given ``is_causal=True`` for causal and a dense mask built before the
  timed calls otherwise (bool for window and padding, a float bias with -inf above the diagonal for ALiBi); and
  ``torch.compile(flex_attention)`` with a BlockMask from ``create_block_mask`` on the device (ALiBi as a
  score_mod), compiled once per mask kind, its compile time reported apart.
- **masks**: causal; causal & window(256); causal & ALiBi; padding (70% of the keys real).
- **timing**: one warm-up call each (which compiles what compiles; a contestant that raises there is reported
  unavailable with the first line of its error, not run), then ``--rounds`` rounds in which every contestant
  runs once, the order rotated each round; each call is timed with CUDA events (perf_counter on the CPU), after
  its gradients are cleared. Reported: each contestant's median in ms with its interquartile range, auto's pick,
  and auto over the fastest torch kernel that served the case, taken round by round (median [q1, q3]).
- **agreement**: in the warm-up of a forward case, each output's largest absolute difference from torch's
  efficient kernel (from auto's output where that kernel cannot serve) is recorded.
- **bounds**: a contestant predicted (its time at the previous n, times (n / previous n)^2) to take more than
  ``--call-budget-s`` a call is skipped, and a case is not started past ``--max-run-s`` (listed as such); an
  out-of-memory error is recorded and the run goes on. The reports are rewritten after every case, so a run cut
  short by a timeout keeps what it measured.

``--smoke`` runs the same code on the CPU with tiny sizes (n = 64, 128; d = 64; 2 rounds): FlexAttention runs
uncompiled there, in float32, multihead's flex backend is left out (it would compile), and torch's CUDA kernels are
reported unavailable. Writes gpu_kernels.json and gpu_kernels.md under --out.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from harness import common

import multihead
from multihead import masks

BATCH, HEADS = 1, 16
WINDOW = 256
PADDING_REAL = 0.7
MASKS = ("causal", "window", "alibi", "padding")
MASK_LABELS = {
    "causal": "causal",
    "window": f"causal & window({WINDOW})",
    "alibi": "causal & ALiBi",
    "padding": f"padding ({PADDING_REAL:.0%} real)",
}
MODES = ("forward", "forward+backward")
OWN = ("sdpa", "tiled", "flex", "materialized")
TORCH_KERNELS = {
    "torch flash": "FLASH_ATTENTION",
    "torch cudnn": "CUDNN_ATTENTION",
    "torch efficient": "EFFICIENT_ATTENTION",
}
TORCH_FLEX = "torch flex"
AUTO = "auto"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Config:
    device: str = "cuda"
    dtype: str = "bfloat16"
    head_dims: tuple[int, ...] = (128, 64)
    sizes: tuple[int, ...] = (1024, 4096, 16384)
    masks: tuple[str, ...] = MASKS
    modes: tuple[str, ...] = MODES
    backends: tuple[str, ...] = OWN
    rounds: int = 5
    call_budget_s: float = 1.0
    max_run_s: float | None = 420.0
    compile_flex: bool = True
    smoke: bool = False
    out_dir: Path = RESULTS

    @classmethod
    def smoke_config(cls, **overrides: Any) -> Config:
        tiny = {
            "device": "cpu",
            "dtype": "float32",
            "head_dims": (64,),
            "sizes": (64, 128),
            "rounds": 2,
            "backends": ("sdpa", "tiled", "materialized"),
            "compile_flex": False,
            "max_run_s": None,
        }
        return cls(**{**tiny, "smoke": True, **overrides})


# --------------------------------------------------------------------------- shared with gpu_heads.py


def spread(values: Sequence[float]) -> dict:
    """median, quartiles (the value itself with one value), min and max."""
    values = list(values)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def ratio_spread(numerator: Sequence[float], denominator: Sequence[float]) -> dict:
    return spread([a / b for a, b in zip(numerator, denominator, strict=True)])


class Timer:
    """Seconds of one call: CUDA events on a CUDA device (the call's GPU time, its launch included), else
    perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, call: Callable[[], object]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        started = time.perf_counter()
        call()
        return time.perf_counter() - started


def interleaved(calls: dict[str, Callable[[], object]], rounds: int, timer: Timer) -> dict[str, list[float]]:
    """``rounds`` rounds of every call once, the order rotated left by one each round; seconds per call."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timer(calls[name]))
    return times


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def free_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def machine(device: torch.device) -> dict:
    """The GPU (name, capability, memory), versions (torch, CUDA, cuDNN, Triton, multihead), the CPU (lscpu)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=True).stdout
        fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}
    except (OSError, subprocess.SubprocessError):
        fields = {}
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": triton_version,
        "multihead": multihead.__version__,
        "python": platform.python_version(),
        "cpu_model": fields.get("Model name"),
        "cpus": fields.get("CPU(s)") or os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
        )
    return info


def machine_line(m: dict) -> str:
    if "gpu" in m:
        where = f"{m['gpu']} (sm {m['capability']}, {m['gpu_memory_gib']} GiB)"
    else:
        where = f"{m['cpu_model'] or 'unknown CPU'} ({m['cpus']} CPUs, {m['torch_threads']} torch threads)"
    return (
        f"{where}; torch {m['torch']}, CUDA {m['cuda']}, cuDNN {m['cudnn']}, Triton {m['triton']}, "
        f"multihead {m['multihead']}"
    )


def write_reports(results: dict, out_dir: Path, stem: str, markdown: Callable[[dict], str]) -> str:
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)
    report = markdown(results)
    (out_dir / f"{stem}.md").write_text(report)
    return report


def device_or_exit(name: str) -> torch.device:
    """torch.device(name), or exit with one line where CUDA is asked for and missing."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"error: --device {name}: CUDA is not available to torch {torch.__version__}. "
            "Fix: run on a CUDA machine, or pass --smoke (CPU, tiny sizes)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return device


def int_tuple(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def names_tuple(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part for part in text.split(",") if part)
        unknown = [name for name in names if name not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {unknown} in {text!r}; choose from {','.join(allowed)}")
        return names

    return parse


# --------------------------------------------------------------------------- the contestants


def padding_length(n: int) -> int:
    return int(PADDING_REAL * n)


def mask_arguments(kind: str, n: int, device: torch.device) -> dict:
    """multihead.attention's mask arguments for a mask kind at length n."""
    if kind == "causal":
        return {"causal": True}
    if kind == "window":
        return {"mask": masks.causal() & masks.window(WINDOW)}
    if kind == "alibi":
        return {"causal": True, "mask": masks.alibi(masks.alibi_slopes(HEADS).to(device))}
    if kind == "padding":
        return {"mask": masks.padding(torch.tensor([padding_length(n)] * BATCH, device=device))}
    raise ValueError(f"mask kind {kind!r}: choose from {MASKS}")


def dense_mask(kind: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """torch SDPA's mask: bool (n, n) for window and padding (True = may attend), a (1, h, n, n) float bias with
    -inf above the diagonal for ALiBi; None for causal (is_causal=True)."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    if kind == "window":
        return (j <= i) & (i - j <= WINDOW)
    if kind == "padding":
        return (j < padding_length(n)).expand(n, n).contiguous()
    if kind == "alibi":
        slopes = masks.alibi_slopes(HEADS).to(device=device, dtype=torch.float32)[:, None, None]  # (h, 1, 1)
        bias = (slopes * (j - i)).masked_fill(j > i, float("-inf"))  # (h, i, j)
        return bias[None].to(dtype)  # (1, h, i, j)
    return None


class FlexPeer:
    """torch.compile(flex_attention, dynamic=True), a fresh copy per mask kind (dynamo's recompile limit is per
    code object), with one set of mods per kind reused across n; uncompiled where ``compile`` is False."""

    def __init__(self, device: torch.device, compile: bool):
        from torch.nn.attention.flex_attention import flex_attention

        self.flex_attention, self.device, self.compile = flex_attention, device, compile
        self.compiled: dict[str, Callable] = {}
        slopes = masks.alibi_slopes(HEADS).to(device=device, dtype=torch.float32)
        self.length = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.mask_mods, self.score_mods = common.flex_peer_mods(slopes, self.length, WINDOW)

    def kernel(self, kind: str) -> Callable:
        if not self.compile:
            return self.flex_attention
        if kind not in self.compiled:
            self.compiled[kind] = common.fresh_compiled(self.flex_attention, f"flex_peer_{kind}")
        return self.compiled[kind]

    def call(self, kind: str, n: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        from torch.nn.attention.flex_attention import create_block_mask

        self.length.fill_(padding_length(n))
        block_mask = create_block_mask(self.mask_mods[kind], BATCH, None, n, n, device=self.device)
        kernel, score_mod = self.kernel(kind), self.score_mods.get(kind)
        return lambda q, k, v: kernel(q, k, v, score_mod=score_mod, block_mask=block_mask)


def torch_sdpa_call(backend_name: str, kind: str, mask: torch.Tensor | None) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)

    return call


def contestants(
    kind: str, n: int, q: torch.Tensor, config: Config, flex: FlexPeer
) -> tuple[dict[str, Callable], dict[str, str]]:
    """name -> fn(q, k, v) for each contestant that may serve the case, and name -> why not for the others."""
    device, dtype = q.device, q.dtype
    arguments = mask_arguments(kind, n, device)
    calls: dict[str, Callable] = {}
    unavailable: dict[str, str] = {}

    def ours(backend: str) -> Callable:
        return lambda q, k, v: multihead.attention(q, k, v, backend=backend, **arguments)

    calls[AUTO] = ours(AUTO)
    for name in OWN:
        if name not in config.backends:
            unavailable[name] = "left out of this run (--backends)"
            continue
        explanation = multihead.explain(q, q, q, backend=name, **arguments)
        if explanation.chosen is None:
            unavailable[name] = "; ".join(explanation.rejected.get(name, ["does not serve the call"]))
        else:
            calls[name] = ours(name)
    mask = dense_mask(kind, n, dtype, device)
    for name, backend_name in TORCH_KERNELS.items():
        if device.type != "cuda":
            unavailable[name] = "a CUDA kernel (not run on the CPU)"
        else:
            calls[name] = torch_sdpa_call(backend_name, kind, mask)
    calls[TORCH_FLEX] = flex.call(kind, n)
    return calls, unavailable


# --------------------------------------------------------------------------- one case


def run_case(kind: str, n: int, d: int, mode: str, config: Config, flex: FlexPeer, history: dict) -> dict:
    """Measure one case; ``history`` maps (kind, d, mode, name) -> the previous n's record, for the budget."""
    device, dtype = torch.device(config.device), DTYPES[config.dtype]
    backward = mode == "forward+backward"
    generator = torch.Generator().manual_seed(n + d)
    base = [torch.randn(BATCH, HEADS, n, d, generator=generator) for _ in range(4)]
    q, k, v = (t.to(device=device, dtype=dtype).requires_grad_(backward) for t in base[:3])
    grad = base[3].to(device=device, dtype=dtype)
    record: dict[str, Any] = {"mask": kind, "n": n, "d": d, "mode": mode, "dtype": config.dtype, "contestants": {}}
    timer = Timer(device)
    calls, unavailable = contestants(kind, n, q, config, flex)
    with torch.no_grad():
        record["auto_choice"] = multihead.explain(q, k, v, **mask_arguments(kind, n, device)).chosen
    for name, why in unavailable.items():
        record["contestants"][name] = {"status": "unavailable", "reason": why}

    def thunk(fn: Callable) -> Callable[[], object]:
        def forward() -> object:
            with torch.no_grad():
                return fn(q, k, v)

        def forward_backward() -> object:
            for t in (q, k, v):
                t.grad = None
            out = fn(q, k, v)
            out.backward(grad)
            return out

        return forward_backward if backward else forward

    runnable: dict[str, Callable[[], object]] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name, fn in calls.items():
        previous = history.get((kind, d, mode, name))
        if previous is not None and previous.get("median_s") is not None:
            predicted = previous["median_s"] * (n / previous["n"]) ** 2
            if predicted > config.call_budget_s:
                record["contestants"][name] = {
                    "status": "skipped",
                    "reason": f"predicted {predicted:.3g} s a call > budget {config.call_budget_s:g} s",
                }
                history[(kind, d, mode, name)] = {"n": n, "median_s": predicted}
                continue
        call = thunk(fn)
        started = time.perf_counter()
        try:
            out = call()
            timer.sync()
        except Exception as error:  # noqa: BLE001 -- a kernel that cannot serve the row is reported, not crashed on
            status = "out of memory" if is_out_of_memory(error) else "unavailable"
            record["contestants"][name] = {"status": status, "reason": first_line(error)}
            free_memory()
            continue
        record["contestants"][name] = {"status": "ok", "warmup_s": time.perf_counter() - started}
        if not backward and isinstance(out, torch.Tensor):
            outputs[name] = out.detach()
        runnable[name] = call
    reference = outputs.get("torch efficient", outputs.get(AUTO))
    if reference is not None:
        for name, out in outputs.items():
            record["contestants"][name]["max_abs_diff"] = (out.float() - reference.float()).abs().max().item()
    record["agreement_reference"] = "torch efficient" if "torch efficient" in outputs else AUTO
    del outputs
    try:
        times = interleaved(runnable, config.rounds, timer)
    except Exception as error:  # noqa: BLE001 -- e.g. out of memory in a timed call: the case is recorded as such
        for name in runnable:
            record["contestants"][name].update(status="error", reason=first_line(error))
        free_memory()
        return record
    for name, series in times.items():
        entry = record["contestants"][name]
        entry.update({f"{key}_ms": value * 1e3 for key, value in spread(series).items()})
        entry["times_s"] = series
        history[(kind, d, mode, name)] = {"n": n, "median_s": statistics.median(series)}
    peers = [name for name in (*TORCH_KERNELS, TORCH_FLEX) if name in times]
    if AUTO in times and peers:
        best = min(peers, key=lambda name: statistics.median(times[name]))
        record["best_peer"] = best
        record["auto_over_best_peer"] = ratio_spread(times[AUTO], times[best])
    free_memory()
    return record


# --------------------------------------------------------------------------- run and report


def grid(config: Config) -> list[tuple[int, str, str, int]]:
    """(d, mode, mask, n) in the order run: each series over n together (its compile paid once)."""
    return [
        (d, mode, kind, n)
        for d in config.head_dims
        for mode in config.modes
        for kind in config.masks
        for n in config.sizes
    ]


def run(config: Config, say: Callable[[str], None] = print) -> dict:
    started = time.perf_counter()
    device = torch.device(config.device)
    flex = FlexPeer(device, config.compile_flex)
    results: dict[str, Any] = {
        "benchmark": "gpu_kernels",
        "config": {**asdict(config), "out_dir": str(config.out_dir)},
        "machine": machine(device),
        "cases": [],
        "not_started": [],
    }
    history: dict = {}
    for d, mode, kind, n in grid(config):
        elapsed = time.perf_counter() - started
        if config.max_run_s is not None and elapsed > config.max_run_s:
            results["not_started"].append({"mask": kind, "n": n, "d": d, "mode": mode})
            continue
        try:
            record = run_case(kind, n, d, mode, config, flex, history)
        except Exception as error:  # noqa: BLE001 -- one case's failure (building its inputs or masks) is recorded
            record = {"mask": kind, "n": n, "d": d, "mode": mode, "error": first_line(error), "contestants": {}}
            free_memory()
        results["cases"].append(record)
        results["elapsed_s"] = time.perf_counter() - started
        write_reports(results, config.out_dir, "gpu_kernels", markdown)
        say(f"{mode} d={d} {kind} n={n}: {case_line(record)} ({results['elapsed_s']:.0f} s)")
    results["elapsed_s"] = time.perf_counter() - started
    return results


def case_line(record: dict) -> str:
    if "error" in record:
        return f"error: {record['error']}"
    ratio = record.get("auto_over_best_peer")
    pick = record.get("auto_choice")
    if ratio is None:
        return f"auto picked {pick}; no peer to compare"
    return f"auto ({pick}) / {record['best_peer']} = {ratio['median']:.2f} [{ratio['q1']:.2f}, {ratio['q3']:.2f}]"


COLUMNS = (AUTO, *OWN, *TORCH_KERNELS, TORCH_FLEX)
SHORT = {"out of memory": "OOM", "unavailable": "n/a", "skipped": "skip", "error": "err"}


def cell(entry: dict | None) -> str:
    if entry is None:
        return "—"
    if entry["status"] == "ok" and "median_ms" in entry:
        return f"{entry['median_ms']:.3f}"
    return SHORT.get(entry["status"], entry["status"])


def markdown(results: dict) -> str:
    c = results["config"]
    lines = [
        f"# Attention kernels on {results['machine'].get('gpu', results['machine']['device'])}"
        + (" (smoke run, CPU)" if c["smoke"] else ""),
        "",
        f"Machine: {machine_line(results['machine'])}. {c['dtype']}, b = {BATCH}, h = {HEADS}; {c['rounds']} "
        "interleaved rounds after one warm-up call each; times are medians in ms (CUDA events; perf_counter on the "
        "CPU); auto / best peer is "
        "the median of per-round ratios [interquartile range] against the fastest torch kernel of the case. "
        "n/a: the kernel cannot serve the case (reasons below); skip: predicted past the call budget; OOM: out of "
        "memory.",
        "",
        "| mode | d | mask | n | auto picked | " + " | ".join(COLUMNS) + " | best peer | auto / best peer |",
        "|---|---:|---|---:|---|" + "---:|" * len(COLUMNS) + "---|---|",
    ]
    reasons: dict[str, set[str]] = {}
    for case in results["cases"]:
        entries = case["contestants"]
        ratio = case.get("auto_over_best_peer")
        ratio_text = "—" if ratio is None else f"{ratio['median']:.2f} [{ratio['q1']:.2f}, {ratio['q3']:.2f}]"
        lines.append(
            f"| {case['mode']} | {case['d']} | {MASK_LABELS.get(case['mask'], case['mask'])} | {case['n']} | "
            f"{case.get('auto_choice') or '—'} | "
            + " | ".join(cell(entries.get(name)) for name in COLUMNS)
            + f" | {case.get('best_peer', '—')} | {ratio_text} |"
        )
        for name, entry in entries.items():
            if entry["status"] != "ok":
                reasons.setdefault(f"{name} ({entry['status']})", set()).add(entry.get("reason", ""))
        if "error" in case:
            reasons.setdefault("case error", set()).add(case["error"])
    diffs = [
        (case, name, entry["max_abs_diff"])
        for case in results["cases"]
        for name, entry in case["contestants"].items()
        if entry.get("max_abs_diff") is not None
    ]
    if diffs:
        worst = max(diffs, key=lambda item: item[2])
        lines += [
            "",
            f"Agreement (forward warm-up, against torch efficient, or auto where it cannot serve): the largest "
            f"|difference| is {worst[2]:.3g}, {worst[1]} at {worst[0]['mask']} n={worst[0]['n']} d={worst[0]['d']}.",
        ]
    if reasons:
        lines += ["", "Why a kernel did not run:", ""]
        lines += [f"- {name}: {' / '.join(sorted(why))}" for name, why in sorted(reasons.items())]
    if results["not_started"]:
        lines += ["", f"Not started (past --max-run-s {c['max_run_s']}): {len(results['not_started'])} cases."]
    lines += ["", f"Run took {results.get('elapsed_s', 0):.0f} s."]
    return "\n".join(lines) + "\n"


def gpu_parser(doc: str, sizes: str) -> argparse.ArgumentParser:
    """The flags every GPU benchmark takes (device, dtype, sizes, rounds, out, smoke); ``sizes`` is the default
    of --sizes, as its help says it."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--device", help="cuda (default), cuda:N; cpu with --smoke")
    p.add_argument("--dtype", choices=list(DTYPES), help="default bfloat16")
    p.add_argument("--sizes", type=int_tuple, help=f"comma-separated n (default {sizes})")
    p.add_argument("--rounds", type=positive_int, help="interleaved rounds (default 5)")
    p.add_argument("--out", type=Path, default=RESULTS, help="output folder (default benchmarks/results)")
    p.add_argument("--smoke", action="store_true", help="the CPU, tiny sizes: checks the script, measures nothing")
    return p


def parser() -> argparse.ArgumentParser:
    p = gpu_parser(__doc__, "1024,4096,16384")
    p.add_argument("--head-dims", type=int_tuple, help="comma-separated d (default 128,64)")
    p.add_argument("--masks", type=names_tuple(MASKS), help=f"default {','.join(MASKS)}")
    p.add_argument("--modes", type=names_tuple(MODES), help=f"default {','.join(MODES)}")
    p.add_argument("--backends", type=names_tuple(OWN), help=f"multihead's backends timed (default {','.join(OWN)})")
    p.add_argument("--call-budget-s", type=float, help="skip a contestant predicted past this a call (default 1)")
    p.add_argument("--max-run-s", type=float, help="start no case after this many seconds (default 420)")
    return p


def run_from_flags(
    args: argparse.Namespace,
    config_type: Any,
    fields: Sequence[str],
    run: Callable[[Any], dict],
    markdown: Callable[[dict], str],
    stem: str,
) -> int:
    """A GPU benchmark's main: its ``config_type`` from the flags given among ``fields`` (on the smoke sizes with
    --smoke), the device checked, the run, and its reports written as ``stem``.json and .md."""
    overrides: dict[str, Any] = {"out_dir": args.out}
    overrides.update({name: getattr(args, name) for name in fields if getattr(args, name) is not None})
    config = config_type.smoke_config(**overrides) if args.smoke else config_type(**overrides)
    device_or_exit(config.device)
    results = run(config)
    print(write_reports(results, config.out_dir, stem, markdown), flush=True)
    print(f"wrote {config.out_dir / stem}.json, .md ({results['elapsed_s']:.0f} s)", flush=True)
    return 0


FLAGS = ("device", "dtype", "rounds", "head_dims", "sizes", "masks", "modes", "backends", "call_budget_s", "max_run_s")


def main(argv: Sequence[str] | None = None) -> int:
    return run_from_flags(parser().parse_args(argv), Config, FLAGS, run, markdown, "gpu_kernels")


if __name__ == "__main__":
    sys.exit(main())
