"""What do exact per-head weights cost? One head's, then all heads' weights of a Llama-shaped layer, against the
plain forward of that layer and against eager attention that writes every weight.

Usage (scripts/gpu_check.sh --part 3 runs it):
    python benchmarks/gpu_heads.py [--device cuda] [--dtype bfloat16] [--sizes 1024,2048,4096,8192] [--rounds 5]
                                   [--out DIR] [--smoke]

The layer: Llama-shaped attention (h = 32 query heads, g = 8 key/value heads, d = 128, embed 4096, b = 1, causal,
no rotary), its projections as ``torch.nn.Linear`` without bias, under no_grad. Each contestant is the whole layer
(q, k, v projections, attention, output projection); they differ only in the attention call:

- **plain**: ``multihead.attention(q, k, v, causal=True)`` (auto), no weights: the baseline;
- **one head**: ``return_weights=multihead.WeightSelection(heads=[0])``;
- **all heads, selected**: ``return_weights=multihead.WeightSelection(heads=range(32))``;
- **all weights (materialized)**: ``backend="materialized", return_weights=True``;
- **eager**: softmax(q k^T / sqrt(d) + causal mask) v written out as transformers' eager attention does when
  ``output_attentions`` is set (keys and values repeated to h heads, softmax in float32, weights kept).

Timing as in gpu_kernels.py: one warm-up call each, then ``--rounds`` interleaved rounds, CUDA events (perf_counter
on the CPU). Reported per n: each contestant's median ms, its ratio to plain taken round by round (median
[interquartile range]), and on CUDA the peak memory of one call above what was allocated before it. Writes
gpu_heads.json and gpu_heads.md under --out. ``--smoke``: the CPU, float32, n = 64 and 128, 2 rounds.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from gpu_kernels import (
    DTYPES,
    RESULTS,
    Timer,
    first_line,
    free_memory,
    gpu_parser,
    interleaved,
    is_out_of_memory,
    machine,
    machine_line,
    ratio_spread,
    run_from_flags,
    spread,
    write_reports,
)

import multihead

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
EMBED = HEADS * HEAD_DIM
PLAIN, ONE, SELECTED, MATERIALIZED, EAGER = (
    "plain",
    "one head",
    "all heads, selected",
    "all weights (materialized)",
    "eager",
)


@dataclass
class Config:
    device: str = "cuda"
    dtype: str = "bfloat16"
    sizes: tuple[int, ...] = (1024, 2048, 4096, 8192)
    rounds: int = 5
    smoke: bool = False
    out_dir: Path = RESULTS

    @classmethod
    def smoke_config(cls, **overrides: Any) -> Config:
        tiny = {"device": "cpu", "dtype": "float32", "sizes": (64, 128), "rounds": 2}
        return cls(**{**tiny, "smoke": True, **overrides})


class Layer(torch.nn.Module):
    """Llama-shaped attention with a swappable attention call: attend(q, k, v) -> (output, weights or None)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        super().__init__()
        factory = {"device": device, "dtype": dtype, "bias": False}
        self.q_proj = torch.nn.Linear(EMBED, HEADS * HEAD_DIM, **factory)  # type: ignore[arg-type]
        self.k_proj = torch.nn.Linear(EMBED, KV_HEADS * HEAD_DIM, **factory)  # type: ignore[arg-type]
        self.v_proj = torch.nn.Linear(EMBED, KV_HEADS * HEAD_DIM, **factory)  # type: ignore[arg-type]
        self.o_proj = torch.nn.Linear(HEADS * HEAD_DIM, EMBED, **factory)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor, attend: Callable) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, HEADS, HEAD_DIM).transpose(1, 2)  # (b, h, n, d)
        k = self.k_proj(x).view(b, n, KV_HEADS, HEAD_DIM).transpose(1, 2)  # (b, g, n, d)
        v = self.v_proj(x).view(b, n, KV_HEADS, HEAD_DIM).transpose(1, 2)  # (b, g, n, d)
        out, weights = attend(q, k, v)  # (b, h, n, d), weights (b, h', n, n) or None
        return self.o_proj(out.transpose(1, 2).reshape(b, n, EMBED)), weights  # (b, n, embed)


def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention with output_attentions: keys/values repeated to h heads, a float causal
    mask added, softmax in float32 cast back, every weight returned."""
    n = q.shape[-2]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)  # (b, h, n, d)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)  # (b, h, n, d)
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(HEAD_DIM)  # (b, h, n, n)
    causal = torch.full((n, n), torch.finfo(q.dtype).min, device=q.device, dtype=q.dtype).triu(1)  # (n, n)
    weights = torch.softmax(scores + causal, dim=-1, dtype=torch.float32).to(q.dtype)  # (b, h, n, n)
    return torch.matmul(weights, v), weights


def attends() -> dict[str, Callable]:
    """name -> attend(q, k, v) -> (output, weights or None)."""

    def plain(q, k, v):
        return multihead.attention(q, k, v, causal=True), None

    def selected(heads: Sequence[int]) -> Callable:
        selection = multihead.WeightSelection(heads=list(heads))

        def attend(q, k, v):
            result = multihead.attention_result(q, k, v, causal=True, return_weights=selection)
            return result.output, result.weights

        return attend

    def materialized(q, k, v):
        result = multihead.attention_result(q, k, v, causal=True, backend="materialized", return_weights=True)
        return result.output, result.weights

    return {
        PLAIN: plain,
        ONE: selected([0]),
        SELECTED: selected(range(HEADS)),
        MATERIALIZED: materialized,
        EAGER: eager,
    }


def peak_mib(call: Callable[[], object], device: torch.device) -> float | None:
    """CUDA: the peak allocated during one call, MiB above what was allocated before it; None elsewhere."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def run_size(n: int, layer: Layer, config: Config) -> dict:
    device, dtype = torch.device(config.device), DTYPES[config.dtype]
    timer = Timer(device)
    x = torch.randn(1, n, EMBED, generator=torch.Generator().manual_seed(n)).to(device=device, dtype=dtype)
    record: dict[str, Any] = {"n": n, "contestants": {}}
    runnable: dict[str, Callable[[], object]] = {}
    reference: torch.Tensor | None = None
    for name, attend in attends().items():

        def call(attend: Callable = attend) -> object:
            return layer(x, attend)

        started = time.perf_counter()
        try:
            out, weights = call()  # type: ignore[misc]
            timer.sync()
            warmup_s = time.perf_counter() - started
            entry: dict[str, Any] = {"status": "ok", "warmup_s": warmup_s}
            entry["weights_shape"] = None if weights is None else list(weights.shape)
            if reference is None:
                reference = out
            entry["max_abs_diff_to_plain"] = (out.float() - reference.float()).abs().max().item()
            del out, weights
            entry["peak_mib"] = peak_mib(call, device)
        except Exception as error:  # noqa: BLE001 -- a contestant that cannot run (out of memory) is reported
            status = "out of memory" if is_out_of_memory(error) else "error"
            record["contestants"][name] = {"status": status, "reason": first_line(error)}
            free_memory()
            continue
        record["contestants"][name] = entry
        runnable[name] = call
    times = interleaved(runnable, config.rounds, timer)
    for name, series in times.items():
        entry = record["contestants"][name]
        entry.update({f"{key}_ms": value * 1e3 for key, value in spread(series).items()})
        entry["times_s"] = series
        if PLAIN in times:
            entry["ratio_to_plain"] = ratio_spread(series, times[PLAIN])
    free_memory()
    return record


def run(config: Config, say: Callable[[str], None] = print) -> dict:
    started = time.perf_counter()
    device, dtype = torch.device(config.device), DTYPES[config.dtype]
    torch.manual_seed(0)
    layer = Layer(device, dtype).eval()
    results: dict[str, Any] = {
        "benchmark": "gpu_heads",
        "config": {**asdict(config), "out_dir": str(config.out_dir)},
        "machine": machine(device),
        "layer": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "embed": EMBED, "batch": 1},
        "rows": [],
    }
    with torch.no_grad():
        for n in config.sizes:
            try:
                record = run_size(n, layer, config)
            except Exception as error:  # noqa: BLE001 -- one size's failure is recorded; the next runs
                record = {"n": n, "error": first_line(error), "contestants": {}}
                free_memory()
            results["rows"].append(record)
            results["elapsed_s"] = time.perf_counter() - started
            write_reports(results, config.out_dir, "gpu_heads", markdown)
            ratios = {
                name: e["ratio_to_plain"]["median"]
                for name, e in record["contestants"].items()
                if "ratio_to_plain" in e
            }
            say(f"n={n}: " + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items()))
    results["elapsed_s"] = time.perf_counter() - started
    return results


def markdown(results: dict) -> str:
    c, names = results["config"], list(attends())
    lines = [
        f"# Exact per-head weights on {results['machine'].get('gpu', results['machine']['device'])}"
        + (" (smoke run, CPU)" if c["smoke"] else ""),
        "",
        f"Machine: {machine_line(results['machine'])}. Llama-shaped layer: h = {HEADS}, g = {KV_HEADS}, "
        f"d = {HEAD_DIM}, embed {EMBED}, b = 1, causal, {c['dtype']}, no grad; each contestant is the whole layer "
        f"(projections included). {c['rounds']} interleaved rounds; a cell is the median ms and the ratio to plain "
        "taken round by round, median [interquartile range]; peak MiB (CUDA) is one call's peak above what was "
        "allocated before it.",
        "",
        "| n | " + " | ".join(names) + " |",
        "|---:|" + "---|" * len(names),
    ]
    for row in results["rows"]:
        cells = []
        for name in names:
            entry = row["contestants"].get(name)
            if entry is None or "median_ms" not in entry:
                cells.append("—" if entry is None else entry["status"])
                continue
            ratio = entry.get("ratio_to_plain")
            ratio_text = "" if ratio is None else f", {ratio['median']:.2f}x [{ratio['q1']:.2f}, {ratio['q3']:.2f}]"
            cells.append(f"{entry['median_ms']:.3f} ms{ratio_text}")
        lines.append(f"| {row['n']} | " + " | ".join(cells) + " |")
    lines += ["", "| n | " + " | ".join(f"{name} peak MiB" for name in names) + " |", "|---:|" + "---:|" * len(names)]
    for row in results["rows"]:
        peaks = [row["contestants"].get(name, {}).get("peak_mib") for name in names]
        lines.append(f"| {row['n']} | " + " | ".join("—" if p is None else f"{p:,.0f}" for p in peaks) + " |")
    problems = [
        f"n={row['n']} {name}: {entry['status']}: {entry.get('reason', '')}"
        for row in results["rows"]
        for name, entry in row["contestants"].items()
        if entry["status"] != "ok"
    ] + [f"n={row['n']}: {row['error']}" for row in results["rows"] if "error" in row]
    diffs = [
        entry["max_abs_diff_to_plain"]
        for row in results["rows"]
        for entry in row["contestants"].values()
        if entry.get("max_abs_diff_to_plain") is not None
    ]
    if diffs:
        lines += ["", f"Largest |output - plain output| over every contestant and n: {max(diffs):.3g}."]
    if problems:
        lines += ["", "Did not run:", "", *[f"- {problem}" for problem in problems]]
    lines += ["", f"Run took {results.get('elapsed_s', 0):.0f} s."]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    return gpu_parser(__doc__, "1024,2048,4096,8192")


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_from_flags(args, Config, ("device", "dtype", "sizes", "rounds"), run, markdown, "gpu_heads")


if __name__ == "__main__":
    sys.exit(main())
