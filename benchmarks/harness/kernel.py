"""Attention kernel benchmark: textbook vs torch SDPA vs multihead (auto, tiled), side by side in one run.

Every case runs q, k, v of shape (b, h, n, d) = (1, 16, n, 64) through one implementation:

    textbook   scores = q k^T / sqrt(d); causal: masked_fill(triu); softmax; @ v   (written inline below)
    sdpa       torch.nn.functional.scaled_dot_product_attention, called directly
    auto       multihead.attention(q, k, v, causal=causal)            (auto serves this with sdpa)
    tiled      multihead.attention(q, k, v, causal=causal, backend="tiled")

for each n, causal False/True, dtype and mode ("forward" under torch.no_grad(), or "forward+backward":
inputs require grad and the output is back-propagated with a fixed random gradient).

Per case: one warmup call, one call for peak memory, then timed calls (at least 1, up to
``max_repeats`` or about ``max_total_s`` seconds); the median is reported.

    FLOPs      4 b h n^2 d forward, x 3.5 forward+backward, halved when causal (for every implementation)
    % peak     GFLOP/s over this machine's torch.mm GFLOP/s (2048 x 2048), the faster of the case's dtype
               and float32 (half types are computed in float32 by SDPA and tiled), measured at start
    peak MiB   VmHWM after the call minus VmRSS just before it (Linux: /proc/self/clear_refs resets
               VmHWM). Needs MALLOC_MMAP_THRESHOLD_=65536 so freed buffers go back to the OS: run as a
               script (or through main()), the process re-executes itself with it set.

The allocator: glibc with MALLOC_MMAP_THRESHOLD_=65536 maps and unmaps every buffer of 64 KiB or
more, which is what the memory call needs but slows allocation-heavy code (the tiled kernel ran
about 1.5x slower that way at n = 4096). So the memory call runs with that threshold and the
warmup and timed calls with glibc's steady state under its default dynamic threshold (mallopt
M_MMAP_THRESHOLD = 32 MiB, its dynamic maximum; M_TRIM_THRESHOLD twice that), switched per call.

A case is skipped, and recorded as skipped with the reason, when its time predicted from the same
series at the previous n (scaled by n^2) exceeds ``budget_s`` for one call, or its predicted peak
memory exceeds 75% of RAM. Also measured: textbook at n = 16384 with b*h = 1 (forward+backward,
float32; its memory extrapolated linearly to b*h = 16), and the cost of returning attention weights
at b*h = 12, n = 2048. The targets at the end are evaluated from these measurements only.

Usage:
    python benchmarks/kernel.py [--quick] [--budget-s 120] [--out benchmarks/results]
                                [--sizes 256,1024,4096,16384] [--dtypes float32,bfloat16]

Writes kernel.json, kernel.md and kernel.png under --out (kernel_quick.* with --quick, so a quick run
never overwrites a full one). Importable: ``run(config, progress=None) -> dict``, ``Config`` and
``Config.quick_config(**overrides)``, ``write_reports(results, out_dir, stem) -> str`` (markdown),
``write_json``, ``plot`` (PNG), ``markdown_report`` and ``main(argv)``. The measurement, machine info
and report helpers it shares with the layer benchmark are in harness.common; the textbook code is
multihead.lab.bench's, which ``multihead bench`` times too.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import multihead
from harness import common
from harness.common import DTYPES, MIB, MODES, find, fmt, ratio
from multihead import _figures
from multihead.lab.bench import textbook_attention

WEIGHTS_SHAPE = {"batch": 1, "heads": 12, "n": 2048, "head_dim": 64, "dtype": "float32"}
BH1_SHAPE = {"n": 16384, "dtype": "float32", "mode": "forward+backward"}  # textbook at b*h = 1

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], object]


# --------------------------------------------------------------------------- the implementations


def textbook(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Textbook attention (multihead.lab.bench.textbook_attention), output only: (b, h, n, d)."""
    return textbook_attention(q, k, v, causal)[0]


def sdpa_direct(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """torch's scaled_dot_product_attention, called directly: (b, h, n, d)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def multihead_auto(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """multihead.attention with backend="auto": (b, h, n, d)."""
    return multihead.attention(q, k, v, causal=causal)


def multihead_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """multihead.attention with backend="tiled": (b, h, n, d)."""
    return multihead.attention(q, k, v, causal=causal, backend="tiled")


IMPLS: dict[str, AttentionFn] = {
    "textbook": textbook,
    "sdpa": sdpa_direct,
    "auto": multihead_auto,
    "tiled": multihead_tiled,
}
# the multihead backend name each multihead implementation asks for (textbook and sdpa are not multihead)
MULTIHEAD_BACKEND = {"auto": "auto", "tiled": "tiled"}


def weights_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """multihead.attention(return_weights=True) -> out (b, h, n, d), weights (b, h, n, n)."""
    result = multihead.attention_result(q, k, v, causal=causal, return_weights=True)
    return result.output, result.weights


def weights_one_head(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """multihead.attention(return_weights=WeightSelection(heads=[0])) -> out (b, h, n, d), weights (b, 1, n, n)."""
    result = multihead.attention_result(q, k, v, causal=causal, return_weights=multihead.WeightSelection(heads=[0]))
    return result.output, result.weights


def no_weights(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, None]:
    """Baseline without weights: multihead.attention -> out (b, h, n, d), None."""
    return multihead.attention(q, k, v, causal=causal), None


WEIGHTS_IMPLS: dict[str, AttentionFn] = {
    "textbook (out, w)": textbook_attention,
    "return_weights=True": weights_all,
    "WeightSelection(heads=[0])": weights_one_head,
    "no weights (auto)": no_weights,
}


# --------------------------------------------------------------------------- configuration


@dataclass
class Config(common.BenchConfig):
    sizes: tuple[int, ...] = (256, 1024, 4096, 16384)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    modes: tuple[str, ...] = MODES
    causal: tuple[bool, ...] = (False, True)
    impls: tuple[str, ...] = tuple(IMPLS)
    batch: int = 1
    heads: int = 16
    head_dim: int = 64
    budget_s: float = 120.0  # predicted seconds for one call above which a case is skipped
    max_repeats: int = 5
    max_total_s: float = 3.0
    weights: bool = True  # the return_weights measurements at b*h = 12, n = 2048
    bh1: bool = True  # textbook at b*h = 1 when n = 16384 is among the sizes
    quick: bool = False
    seed: int = 0
    out_dir: Path | None = None  # when set, <stem>.json is rewritten after every case

    NAME = "kernel"  # output stem: kernel, or kernel_quick so a quick run never overwrites a full one
    # --quick: n in {256, 1024}, float32, at most 3 repeats in about 0.5 s per case
    QUICK = {"sizes": (256, 1024), "dtypes": ("float32",), "max_repeats": 3, "max_total_s": 0.5}


# --------------------------------------------------------------------------- the workload and its FLOPs


@dataclass
class Workload:
    """One implementation on fixed inputs q, k, v (b, h, n, d); ``step()`` is one measured call.

    Forward: under torch.no_grad(). Forward+backward: q, k, v require grad, and the output is
    back-propagated with ``grad_out`` (b, h, n, d); gradients are cleared before each call.
    """

    fn: AttentionFn
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    grad_out: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        fn: AttentionFn,
        batch: int,
        heads: int,
        n: int,
        head_dim: int,
        dtype: torch.dtype,
        causal: bool,
        mode: str,
        seed: int,
    ) -> Workload:
        (q, k, v), grad_out = common.random_inputs(
            (batch, heads, n, head_dim), 3, dtype, seed, backward=mode == "forward+backward"
        )
        return cls(fn, q, k, v, causal, grad_out)

    def clear(self) -> None:
        for t in (self.q, self.k, self.v):
            t.grad = None

    def step(self) -> object:
        """One call; returns what the implementation returned (for forward+backward, after backward)."""
        if self.grad_out is None:
            with torch.no_grad():
                return self.fn(self.q, self.k, self.v, self.causal)
        result = self.fn(self.q, self.k, self.v, self.causal)
        output = result[0] if isinstance(result, tuple) else result
        output.backward(self.grad_out)
        return result

    def served_by(self, backend: str) -> str | None:
        """The multihead backend that serves this call with ``backend`` (multihead.explain)."""
        with torch.set_grad_enabled(self.grad_out is not None):
            return multihead.explain(self.q, self.k, self.v, causal=self.causal, backend=backend).chosen


def attention_gflop(batch: int, heads: int, n: int, head_dim: int, causal: bool, mode: str) -> float:
    """The benchmark's FLOP convention: 4 b h n^2 d forward, x 3.5 with backward, / 2 when causal."""
    flop = 4 * batch * heads * n * n * head_dim
    if mode == "forward+backward":
        flop *= common.FWD_BWD_FLOP_FACTOR
    if causal:
        flop /= 2
    return flop / 1e9


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    impl: str
    n: int
    causal: bool
    dtype: str
    mode: str
    batch: int
    heads: int
    head_dim: int

    @property
    def series(self) -> tuple:
        """Cases that differ only in n, whose costs predict one another."""
        return (self.impl, self.causal, self.dtype, self.mode, self.batch, self.heads, self.head_dim)

    def label(self) -> str:
        bh = "" if self.batch * self.heads == 16 else f" b*h={self.batch * self.heads}"
        return f"{self.impl:<9} n={self.n:<6} causal={self.causal!s:<5} {self.dtype:<8} {self.mode}{bh}"


def predict(case: Case, previous: dict | None) -> tuple[float | None, float | None]:
    """(seconds for one call, peak MiB) predicted before running; None where nothing predicts it.

    Time: the same series at the previous n (measured median, or its own prediction if it was
    skipped), scaled by n^2. Memory: that case's peak scaled by n^2 (an upper bound for the O(n)
    kernels), and for the textbook at least common.TEXTBOOK_SCORE_TENSORS (b, h, n, n) tensors.
    """
    seconds, mib = common.scaled_from_previous(case.n, previous)
    if case.impl == "textbook":
        mib = common.at_least_scores(mib, case.batch * case.heads, case.n, case.dtype, case.mode)
    return seconds, mib


def measure_case(case: Case, fn: AttentionFn, config: Config, peaks: dict) -> dict:
    """Warmup, one memory call, timed calls; the record of one case (status "ok")."""
    workload = Workload.build(
        fn, case.batch, case.heads, case.n, case.head_dim, DTYPES[case.dtype], case.causal, case.mode, config.seed
    )
    record = {"served_by": workload.served_by(MULTIHEAD_BACKEND[case.impl]) if case.impl in MULTIHEAD_BACKEND else None}
    record["warmup_s"] = common.warmup_call(workload)
    record.update(common.memory_record(workload))
    times = common.time_calls(workload.step, workload.clear, config.max_repeats, config.max_total_s)
    gflop = attention_gflop(case.batch, case.heads, case.n, case.head_dim, case.causal, case.mode)
    # the roofline is the faster of torch.mm in this dtype and in float32: kernels may compute half types in
    # float32 (on a CPU without bf16 units torch.mm in bf16 is ~600x slower than in float32)
    peak = max((p["gflops"] for p in (peaks.get(case.dtype), peaks.get("float32")) if p), default=None)
    record.update(common.timing_record(times, gflop, peak))
    return record


def run_case(case: Case, fn: AttentionFn, config: Config, peaks: dict, previous: dict | None, ram: int | None) -> dict:
    """Predict, then skip or measure one case. Never raises: failures are recorded with status "error"."""
    return common.run_case(
        dataclasses.asdict(case),
        predict(case, previous),
        lambda: measure_case(case, fn, config, peaks),
        config.budget_s,
        ram,
    )


def main_cases(config: Config, dtypes: Sequence[str]) -> list[Case]:
    """The b*h = 16 grid for ``dtypes``, ordered dtype, n, mode, causal, impl (so each series grows in n)."""
    return [
        Case(impl, n, causal, dtype, mode, config.batch, config.heads, config.head_dim)
        for dtype in dtypes
        for n in sorted(config.sizes)
        for mode in config.modes
        for causal in config.causal
        for impl in config.impls
    ]


def bh1_cases(config: Config) -> list[Case]:
    """Textbook at b*h = 1, n = 16384, forward+backward float32: its memory extrapolates to b*h = 16."""
    if (
        not config.bh1
        or BH1_SHAPE["n"] not in config.sizes
        or BH1_SHAPE["dtype"] not in config.dtypes
        or BH1_SHAPE["mode"] not in config.modes
        or "textbook" not in config.impls
    ):
        return []
    return [
        Case("textbook", BH1_SHAPE["n"], causal, BH1_SHAPE["dtype"], BH1_SHAPE["mode"], 1, 1, config.head_dim)
        for causal in config.causal
    ]


def weights_cases(config: Config) -> list[Case]:
    """return_weights costs at b*h = 12, n = 2048, float32, forward."""
    if not config.weights:
        return []
    s = WEIGHTS_SHAPE
    return [
        Case(impl, s["n"], causal, s["dtype"], "forward", s["batch"], s["heads"], s["head_dim"])
        for causal in config.causal
        for impl in WEIGHTS_IMPLS
    ]


# --------------------------------------------------------------------------- the run


def run(config: Config, progress: Callable[[str], None] | None = None) -> dict:
    """Measure everything ``config`` asks for; returns the results (see kernel.json). ``progress`` (default:
    print) is called with a line before and after each measurement.

    With ``config.out_dir`` set, <stem>.json is rewritten after every case, so a run stopped early
    keeps what it measured.
    """
    say = progress or (lambda line: print(line, flush=True))
    started = time.perf_counter()
    common.prepare_allocator(say)
    peaks = {}
    for dtype in dict.fromkeys(("float32", *config.dtypes)):  # float32 always: the roofline of half types too
        say(f"matmul peak {dtype}: torch.mm {common.PEAK_MATMUL_SIZE}x{common.PEAK_MATMUL_SIZE} ...")
        peaks[dtype] = common.matmul_peak_gflops(DTYPES[dtype], config.max_repeats, config.max_total_s)
        say(f"matmul peak {dtype}: {peaks[dtype]['gflops']:.2f} GFLOP/s ({peaks[dtype]['median_s']:.3f} s)")
    results = {
        "machine": common.machine_info(peaks),
        "config": config_json(config),
        "complete": False,
        "cases": [],
        "textbook_bh1": [],
        "weights": [],
    }
    ram = common.ram_bytes()
    # the first dtype's grid, then the cheap extra sections, then the other dtypes (slow in bfloat16 here)
    sections = [
        ("cases", main_cases(config, config.dtypes[:1]), IMPLS),
        ("textbook_bh1", bh1_cases(config), IMPLS),
        ("weights", weights_cases(config), WEIGHTS_IMPLS),
        ("cases", main_cases(config, config.dtypes[1:]), IMPLS),
    ]
    total = sum(len(cases) for _, cases, _ in sections)
    done = 0
    last_in_series: dict[tuple, dict] = {}
    for section, cases, impls in sections:
        for case in cases:
            done += 1
            record = run_case(case, impls[case.impl], config, peaks, last_in_series.get(case.series), ram)
            last_in_series[case.series] = record
            results[section].append(record)
            say(f"[{done}/{total} {time.perf_counter() - started:6.0f} s] {case.label()}: {_summary(record)}")
            if config.out_dir is not None:
                results["targets"] = evaluate_targets(results)
                write_json(results, config.out_dir, config.stem)
    results["targets"] = evaluate_targets(results)
    results["complete"] = True
    results["elapsed_s"] = time.perf_counter() - started
    return results


def config_json(config: Config) -> dict:
    """The "config" section of the results: the fields and how things are measured."""
    out = config.to_json()
    out["warmup_calls"] = 1
    out["memory"] = (
        "one separate call after the warmup: VmHWM after minus VmRSS before, MiB, "
        f"with M_MMAP_THRESHOLD={common.MEMORY_MMAP_THRESHOLD}"
    )
    out["timing"] = common.TIMING_METHOD
    out["textbook_score_tensors_predicted"] = common.TEXTBOOK_SCORE_TENSORS
    return out


def _summary(record: dict) -> str:
    return common.summary(record, ".1f", f" [{record['served_by']}]" if record.get("served_by") else "")


# --------------------------------------------------------------------------- targets


def target_auto_vs_sdpa(cases: Sequence[dict]) -> dict:
    """(1) auto/sdpa time <= 1.05 in every case where auto was served by SDPA."""
    ratios = []
    for auto in (r for r in cases if r["impl"] == "auto" and r["status"] == "ok" and r["served_by"] == "sdpa"):
        sdpa = find(cases, impl="sdpa", n=auto["n"], causal=auto["causal"], dtype=auto["dtype"], mode=auto["mode"])
        if sdpa is not None:
            ratios.append(
                {
                    "n": auto["n"],
                    "causal": auto["causal"],
                    "dtype": auto["dtype"],
                    "mode": auto["mode"],
                    "ratio": auto["median_s"] / sdpa["median_s"],
                }
            )
    return common.ratio_target("auto / sdpa time <= 1.05 where SDPA served", ratios, 1.05)


def target_tiled_memory(cases: Sequence[dict], bh1: Sequence[dict], n: int = 16384) -> dict:
    """(2) tiled forward+backward peak memory at n = 16384 <= 1/10 of the textbook's."""
    checks = []
    for tiled in (
        r
        for r in cases
        if r["impl"] == "tiled" and r["n"] == n and r["mode"] == "forward+backward" and r["status"] == "ok"
    ):
        key = {"causal": tiled["causal"], "dtype": tiled["dtype"], "mode": tiled["mode"]}
        measured = find(cases, impl="textbook", n=n, **key)
        small = find(bh1, impl="textbook", n=n, **key)
        if measured is not None:
            reference, source = measured["peak_mib"], "measured at b*h = 16"
        elif small is not None and small["peak_mib"] is not None:
            scale = tiled["batch"] * tiled["heads"] / (small["batch"] * small["heads"])
            reference = small["peak_mib"] * scale
            source = f"extrapolated linearly in b*h from b*h = 1 ({small['peak_mib']:.0f} MiB x {scale:.0f})"
        else:
            continue
        value = ratio(tiled["peak_mib"], reference)
        checks.append(
            {
                **key,
                "tiled_mib": tiled["peak_mib"],
                "textbook_mib": reference,
                "textbook_source": source,
                "ratio": value,
                "pass": value is not None and value <= 0.1,
            }
        )
    return {
        "goal": f"tiled fwd+bwd peak memory at n={n} <= textbook / 10",
        "checks": checks,
        "pass": common.all_pass(checks),
    }


def target_tiled_time(cases: Sequence[dict], n: int = 4096, dtype: str = "float32") -> dict:
    """(3) tiled time <= 2 x sdpa's at n = 4096, float32, each mode and causal variant."""
    checks = []
    for tiled in (
        r for r in cases if r["impl"] == "tiled" and r["n"] == n and r["dtype"] == dtype and r["status"] == "ok"
    ):
        sdpa = find(cases, impl="sdpa", n=n, dtype=dtype, causal=tiled["causal"], mode=tiled["mode"])
        if sdpa is not None:
            value = tiled["median_s"] / sdpa["median_s"]
            checks.append(
                {
                    "causal": tiled["causal"],
                    "mode": tiled["mode"],
                    "tiled_s": tiled["median_s"],
                    "sdpa_s": sdpa["median_s"],
                    "ratio": value,
                    "pass": value <= 2.0,
                }
            )
    return {"goal": f"tiled time <= 2 x sdpa at n={n}, {dtype}", "checks": checks, "pass": common.all_pass(checks)}


def target_weights_speed(weights: Sequence[dict]) -> dict:
    """(4) return_weights=True >= 1.5x faster than textbook, extra memory beyond the weights < 10% of them."""
    checks = []
    for causal in sorted({r["causal"] for r in weights}):
        ours = find(weights, impl="return_weights=True", causal=causal)
        book = find(weights, impl="textbook (out, w)", causal=causal)
        if ours is None or book is None:
            continue
        speedup = book["median_s"] / ours["median_s"]
        weights_mib = ours["returned_mib"]["weights"]
        extra = None if ours["peak_mib"] is None else ours["peak_mib"] - weights_mib
        checks.append(
            {
                "causal": causal,
                "speedup": speedup,
                "peak_mib": ours["peak_mib"],
                "weights_mib": weights_mib,
                "extra_mib": extra,
                "textbook_extra_mib": None if book["peak_mib"] is None else book["peak_mib"] - weights_mib,
                "pass": speedup >= 1.5 and extra is not None and extra < 0.1 * weights_mib,
            }
        )
    return {
        "goal": "return_weights=True >= 1.5x faster than textbook; peak - weights < 10% of weights",
        "checks": checks,
        "pass": common.all_pass(checks),
    }


def target_one_head(weights: Sequence[dict]) -> dict:
    """(5) the cost of one head's weights (of twelve) < 1/5 of all heads', in time and peak memory.

    A weights call also computes the output, which costs the same whichever weights are asked for,
    so the cost of the weights is the call minus the same call without weights ("marginal"). The
    ratios of whole calls are reported too.
    """
    checks = []
    for causal in sorted({r["causal"] for r in weights}):
        one = find(weights, impl="WeightSelection(heads=[0])", causal=causal)
        every = find(weights, impl="return_weights=True", causal=causal)
        none = find(weights, impl="no weights (auto)", causal=causal)
        if one is None or every is None or none is None:
            continue
        marginal = {}
        for field, label in (("median_s", "time"), ("peak_mib", "memory")):
            if None in (one[field], every[field], none[field]):
                marginal[label] = None
            else:
                marginal[label] = ratio(one[field] - none[field], every[field] - none[field])
        checks.append(
            {
                "causal": causal,
                "marginal_time_ratio": marginal["time"],
                "marginal_memory_ratio": marginal["memory"],
                "one_head_weights_cost_s": one["median_s"] - none["median_s"],
                "all_weights_cost_s": every["median_s"] - none["median_s"],
                "call_time_ratio": one["median_s"] / every["median_s"],
                "call_memory_ratio": ratio(one["peak_mib"], every["peak_mib"]),
                "pass": all(v is not None and v < 0.2 for v in marginal.values()),
            }
        )
    return {
        "goal": "one head of 12: its weights' cost (call minus the no-weights call) < 1/5 of all heads', "
        "in time and in peak memory",
        "checks": checks,
        "pass": common.all_pass(checks),
    }


def evaluate_targets(results: dict) -> dict:
    cases, weights = results["cases"], results["weights"]
    return {
        "1_auto_within_5pct_of_sdpa": target_auto_vs_sdpa(cases),
        "2_tiled_memory_16384": target_tiled_memory(cases, results["textbook_bh1"]),
        "3_tiled_time_4096": target_tiled_time(cases),
        "4_return_weights_speed_memory": target_weights_speed(weights),
        "5_one_head_weights_cost": target_one_head(weights),
    }


# --------------------------------------------------------------------------- reports


def markdown_cases(cases: Sequence[dict]) -> str:
    """One row per measured case, ratios against sdpa and textbook on the same case; then the skipped ones."""
    header = (
        "| impl | n | causal | dtype | mode | time ms | GFLOP/s | % peak | peak MiB | ratio to sdpa "
        "| ratio to textbook |\n|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|"
    )
    rows, skipped = [header], []
    for r in cases:
        if r["status"] != "ok":
            skipped.append(
                f"- {r['impl']} n={r['n']} causal={r['causal']} {r['dtype']} {r['mode']}"
                f"{'' if r['batch'] * r['heads'] == 16 else ' b*h=' + str(r['batch'] * r['heads'])}: "
                f"{r['status']} ({r['reason']})"
            )
            continue
        key = {
            "n": r["n"],
            "causal": r["causal"],
            "dtype": r["dtype"],
            "mode": r["mode"],
            "batch": r["batch"],
            "heads": r["heads"],
        }
        sdpa, book = find(cases, impl="sdpa", **key), find(cases, impl="textbook", **key)
        rows.append(
            f"| {r['impl']} | {r['n']} | {r['causal']} | {r['dtype']} | {r['mode']} "
            f"| {r['median_s'] * 1e3:.1f} | {r['gflops']:.1f} | {fmt(r['pct_peak'], '.0f')} "
            f"| {fmt(r['peak_mib'], '.1f')} "
            f"| {fmt(ratio(r['median_s'], sdpa and sdpa['median_s']), '.2f')} "
            f"| {fmt(ratio(r['median_s'], book and book['median_s']), '.2f')} |"
        )
    text = "\n".join(rows)
    if skipped:
        text += "\n\nNot run:\n" + "\n".join(skipped)
    return text


def markdown_bh1(bh1: Sequence[dict], bh: int) -> str:
    lines = []
    for r in bh1:
        if r["status"] != "ok":
            lines.append(f"- textbook n={r['n']} causal={r['causal']} b*h=1: {r['status']} ({r['reason']})")
        elif r["peak_mib"] is not None:
            lines.append(
                f"- textbook n={r['n']} causal={r['causal']} {r['dtype']} {r['mode']} at b*h = 1: "
                f"{r['median_s']:.2f} s, peak {r['peak_mib']:.0f} MiB measured; "
                f"{r['peak_mib'] * bh:.0f} MiB at b*h = {bh} (extrapolated linearly in b*h)"
            )
    return "\n".join(lines)


def markdown_weights(weights: Sequence[dict]) -> str:
    s = WEIGHTS_SHAPE
    full_mib = s["batch"] * s["heads"] * s["n"] ** 2 * DTYPES[s["dtype"]].itemsize / MIB
    rows = [
        f"b*h = {s['batch'] * s['heads']}, n = {s['n']}, d = {s['head_dim']}, {s['dtype']}, forward "
        f"(all weights: {full_mib:.0f} MiB)",
        "",
        "| impl | causal | time ms | peak MiB | returned weights MiB | peak - returned weights MiB "
        "| peak - all weights MiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in weights:
        if r["status"] != "ok":
            rows.append(f"| {r['impl']} | {r['causal']} | {r['status']}: {r['reason']} | | | | |")
            continue
        returned = (r["returned_mib"] or {}).get("weights", 0.0)
        peak = r["peak_mib"]
        rows.append(
            f"| {r['impl']} | {r['causal']} | {r['median_s'] * 1e3:.1f} | {fmt(peak, '.1f')} "
            f"| {returned:.1f} | {fmt(None if peak is None else peak - returned, '.1f')} "
            f"| {fmt(None if peak is None else peak - full_mib, '.1f')} |"
        )
    return "\n".join(rows)


def markdown_targets(targets: dict) -> str:
    lines = []
    for name, target in targets.items():
        verdict = common.VERDICTS[target["pass"]]
        lines.append(f"- {name}: {verdict} — {target['goal']}")
        if "worst" in target:
            w = target["worst"]
            lines.append(
                f"    - worst ratio {w['ratio']:.3f} (n={w['n']} causal={w['causal']} {w['dtype']} "
                f"{w['mode']}); {len(target['failing'])} of {len(target['cases'])} cases above 1.05"
            )
        for check in target.get("checks", []):
            details = ", ".join(f"{k}={fmt(v, '.3g') if isinstance(v, float) else v}" for k, v in check.items())
            lines.append(f"    - {details}")
    return "\n".join(lines)


def markdown_report(results: dict) -> str:
    parts = [
        "# Attention kernel benchmark",
        common.machine_line(results["machine"]),
        f"b*h = {results['config']['batch'] * results['config']['heads']}, d = {results['config']['head_dim']}; "
        "FLOPs 4bhn^2d forward, x3.5 fwd+bwd, /2 causal; time = median; peak MiB = VmHWM - VmRSS before the call",
        "% peak is against the faster of torch.mm in the case's dtype and in float32 (SDPA and tiled compute "
        "half types in float32; without bfloat16 units, torch.mm in bfloat16 is far slower than in float32).",
        "",
        markdown_cases(results["cases"]),
    ]
    if results["textbook_bh1"]:
        bh = results["config"]["batch"] * results["config"]["heads"]
        parts += ["", "## Textbook at b*h = 1", markdown_bh1(results["textbook_bh1"], bh)]
    if results["weights"]:
        parts += ["", "## Returning weights", markdown_weights(results["weights"])]
    parts += ["", "## Targets", markdown_targets(results["targets"])]
    return "\n".join(parts) + "\n"


def plot(results: dict, path: Path) -> bool:
    """Time vs n per implementation, log-log; one panel per (mode, dtype, causal). False without matplotlib."""
    plt = common.pyplot()
    if plt is None:
        return False
    cases = [r for r in results["cases"] if r["status"] == "ok"]
    modes = [m for m in MODES if any(r["mode"] == m for r in cases)] or list(MODES)
    columns = [(dtype, causal) for dtype in results["config"]["dtypes"] for causal in results["config"]["causal"]]
    fig, axes = plt.subplots(len(modes), len(columns), figsize=(4 * len(columns), 3.5 * len(modes)), squeeze=False)
    for row, mode in enumerate(modes):
        for col, (dtype, causal) in enumerate(columns):
            ax = axes[row][col]
            for impl in IMPLS:
                points = sorted(
                    (r["n"], r["median_s"])
                    for r in cases
                    if r["impl"] == impl and r["mode"] == mode and r["dtype"] == dtype and r["causal"] == causal
                )
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", label=impl)
            common.log_axes(ax, f"{mode}, {dtype}, {'causal' if causal else 'full'}", "n", "time (s)")
            if ax.lines:
                ax.legend(fontsize=7)
    _figures.save_figure(fig, path)
    return True


def write_json(results: dict, out_dir: Path, stem: str = "kernel") -> Path:
    """Write <stem>.json atomically (through a .tmp file)."""
    return common.write_json(results, out_dir, stem)


def write_reports(results: dict, out_dir: Path, stem: str = "kernel") -> str:
    """<stem>.json, <stem>.md and <stem>.png under out_dir; returns the markdown."""
    return common.write_reports(results, out_dir, stem, markdown_report, plot)


# --------------------------------------------------------------------------- command line


def build_parser(default_out: Path | None = None) -> argparse.ArgumentParser:
    """The options: --quick, --budget-s, --out (default ``default_out``, else benchmarks/results), --sizes, --dtypes."""
    return common.build_parser(
        __doc__, "n in {256, 1024}, float32, fewer repeats (< 1 min)", 120.0, "256,1024,4096,16384", default_out
    )


def main(argv: Sequence[str] | None = None, *, reexec: bool = True, default_out: Path | None = None) -> int:
    """Run the benchmark and write the reports. With ``reexec`` the process first re-executes itself
    with MALLOC_MMAP_THRESHOLD_ set (without it, memory numbers may miss freed allocations).
    ``default_out``: the folder when --out is not given (default: benchmarks/results, see common.default_out_dir)."""
    return common.bench_main(argv, lambda: build_parser(default_out), Config, run, write_reports, reexec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
