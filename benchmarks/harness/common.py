"""What the kernel and layer benchmarks of this repository share: the allocator setting, measurement,
machine info, records, targets, reports and the command line. (The harness is not installed with
multihead; ``multihead bench`` is the short comparison users run, see multihead.lab.bench.)

Measurement (see kernel.py's docstring for the reasons):

    time       ``time_calls``: at least one call, then more while fewer than ``max_repeats`` and the next
               fits ``max_total_s``; the median is reported (``timing_record``)
    peak MiB   ``peak_memory``: one call with every buffer >= 64 KiB mmapped (so freed buffers go back to
               the OS); VmHWM after it minus VmRSS just before it (Linux: /proc/self/clear_refs resets VmHWM)
    allocator  glibc with MALLOC_MMAP_THRESHOLD_=65536 in the environment (``ensure_malloc_env`` re-executes
               the process with it), switched per call with mallopt: 64 KiB for the memory call, 32 MiB
               (glibc's dynamic maximum) for the warmup and timed calls (``set_mmap_threshold``)

A case is skipped when one call is predicted (``scaled_from_previous``: the same series at the previous n)
to take over the budget or to need over 75% of RAM (``skip_reason``); ``run_case`` records it either way.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

import multihead
from multihead import _figures

MALLOC_ENV = "MALLOC_MMAP_THRESHOLD_"
MALLOC_VALUE = "65536"
MIB = 2**20
GIB = 2**30
MEMORY_MMAP_THRESHOLD = int(MALLOC_VALUE)  # for the memory call: every buffer >= 64 KiB is mmapped
TIMING_MMAP_THRESHOLD = 32 * MIB  # for timed calls: glibc's dynamic threshold at its maximum
FWD_BWD_FLOP_FACTOR = 3.5  # attention forward+backward FLOPs over forward FLOPs (backward = 2.5 x forward)
PEAK_MATMUL_SIZE = 2048
RAM_FRACTION = 0.75  # skip cases predicted to need more than this fraction of RAM
# (b, h, n, n) tensors alive at the textbook's peak, for predicting its memory before running it.
# Measured at n = 2048: about 2 forward, about 3.1 forward+backward; these keep a margin.
TEXTBOOK_SCORE_TENSORS = {"forward": 3, "forward+backward": 5}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
MODES = ("forward", "forward+backward")


# --------------------------------------------------------------------------- the allocator


def ensure_malloc_env() -> None:
    """Re-execute this process with MALLOC_MMAP_THRESHOLD_=65536 unless it is already set.

    Re-executes ``sys.executable`` with ``sys.orig_argv[1:]``, so the same command runs again, whether
    it was ``python benchmarks/kernel.py ...``, ``python benchmarks/suite.py ...`` or another script.
    """
    if os.environ.get(MALLOC_ENV) is not None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, MALLOC_ENV: MALLOC_VALUE}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 -- glibc only
        return libc
    except (OSError, AttributeError):
        return None


LIBC = _glibc()  # None off glibc: the allocator cannot be switched per call
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def set_mmap_threshold(threshold: int) -> bool:
    """glibc: mmap buffers of ``threshold`` bytes or more (unmapped, so returned to the OS, when freed),
    trim the heap above twice that, and release free heap pages now. False off glibc."""
    if LIBC is None:
        return False
    ok = LIBC.mallopt(_M_MMAP_THRESHOLD, threshold) == 1 and LIBC.mallopt(_M_TRIM_THRESHOLD, 2 * threshold) == 1
    LIBC.malloc_trim(0)
    return ok


def prepare_allocator(say: Callable[[str], None]) -> None:
    """At the start of a run: warn when memory numbers may be wrong, and set the timing threshold."""
    if os.environ.get(MALLOC_ENV) is None and LIBC is None:
        say(f"warning: {MALLOC_ENV} is not set; freed memory may stay in the heap and hide allocations")
    set_mmap_threshold(TIMING_MMAP_THRESHOLD)


# --------------------------------------------------------------------------- memory and time


def _proc_line(path: str, prefix: str) -> str | None:
    """The first line of the file at ``path`` starting with ``prefix``; None without one (or off Linux)."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(prefix):
                    return line
    except OSError:
        return None
    return None


def _proc_kib(path: str, field: str) -> int | None:
    """A ``field: N kB`` line of a /proc file, in bytes."""
    line = _proc_line(path, field + ":")
    return None if line is None else int(line.split()[1]) * 1024


def proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) in bytes, or None off Linux."""
    return _proc_kib("/proc/self/status", field)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def ram_bytes() -> int | None:
    """MemTotal from /proc/meminfo."""
    return _proc_kib("/proc/meminfo", "MemTotal")


class Workload(Protocol):
    """What ``peak_memory`` and ``time_calls`` measure: ``step()`` is one call, ``clear()`` drops gradients."""

    def step(self) -> object: ...

    def clear(self) -> None: ...


def random_inputs(
    shape: Sequence[int], count: int, dtype: torch.dtype, seed: int, backward: bool
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """``count`` standard normal tensors of ``shape`` (requiring grad when ``backward``), then the gradient
    of the output (same shape) for backward, or None; all from one generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(*shape, generator=generator, dtype=dtype, requires_grad=backward) for _ in range(count)]
    grad_out = torch.randn(*shape, generator=generator, dtype=dtype) if backward else None
    return inputs, grad_out


def peak_memory(workload: Workload) -> tuple[float | None, float | None, object]:
    """One call with every buffer >= 64 KiB mmapped; returns (peak MiB above the RSS just before it,
    that RSS in MiB, the call's result). Leaves the allocator in its timing setting."""
    workload.clear()
    gc.collect()
    set_mmap_threshold(MEMORY_MMAP_THRESHOLD)
    can_reset = reset_peak_rss()
    before = proc_status_bytes("VmRSS")
    try:
        result = workload.step()
        peak = proc_status_bytes("VmHWM")
    finally:
        set_mmap_threshold(TIMING_MMAP_THRESHOLD)
    if not can_reset or before is None or peak is None:
        return None, None, result
    return (peak - before) / MIB, before / MIB, result


def returned_mib(result: object) -> dict[str, float] | None:
    """Sizes of what a call returned: output and (for the weights cases) weights, in MiB."""
    parts = result if isinstance(result, tuple) else (result,)
    names = ("output", "weights")
    sizes = {
        name: t.numel() * t.element_size() / MIB
        for name, t in zip(names, parts, strict=False)  # an output alone, or an output and weights
        if isinstance(t, torch.Tensor)
    }
    return sizes or None


def warmup_call(workload: Workload) -> float:
    """One call whose result is dropped; its seconds."""
    workload.clear()
    t0 = time.perf_counter()
    workload.step()
    return time.perf_counter() - t0


def memory_record(workload: Workload, *, timed: bool = False) -> dict:
    """The memory call (``peak_memory``) as record fields: peak_mib, baseline_rss_mib, (memory_call_s when
    ``timed``), returned_mib."""
    t0 = time.perf_counter()
    peak, baseline, result = peak_memory(workload)
    record: dict = {"peak_mib": peak, "baseline_rss_mib": baseline}
    if timed:
        record["memory_call_s"] = time.perf_counter() - t0
    record["returned_mib"] = returned_mib(result)
    return record


TIMING_METHOD = f"median of the timed calls, with M_MMAP_THRESHOLD={TIMING_MMAP_THRESHOLD}"


def time_calls(
    step: Callable[[], object], clear: Callable[[], None], max_repeats: int, max_total_s: float
) -> list[float]:
    """Seconds per call: at least one, then more while fewer than max_repeats and the next fits max_total_s."""
    times: list[float] = []
    started = time.perf_counter()
    while not times or (
        len(times) < max_repeats and time.perf_counter() - started + statistics.median(times) <= max_total_s
    ):
        clear()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def interleaved_rounds(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """One warm-up call each, then ``rounds`` rounds of every call once, the order rotated left by one each round
    (so a burst of other work hits all alike); seconds per call, per round."""
    names = list(calls)
    for name in names:
        calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return times


def ratio_per_round(numerator: Sequence[float], denominator: Sequence[float]) -> dict:
    """numerator / denominator round by round: median, min, max and the number of rounds."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": len(ratios)}


def timing_record(times: Sequence[float], gflop: float, peak_gflops: float | None) -> dict:
    """The record fields of a measured case from its timed calls (status "ok", median, GFLOP/s, % peak)."""
    median = statistics.median(times)
    return {
        "status": "ok",
        "times_s": times,
        "repeats": len(times),
        "median_s": median,
        "gflop": gflop,
        "gflops": gflop / median,
        "pct_peak": None if not peak_gflops else 100 * gflop / median / peak_gflops,
    }


def matmul_peak_gflops(dtype: torch.dtype, max_repeats: int, max_total_s: float, size: int = PEAK_MATMUL_SIZE) -> dict:
    """GFLOP/s of torch.mm on (size, size) matrices, 2 size^3 FLOPs; warmed up on a 256 x 256 product."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator, dtype=dtype) for _ in range(2))
    torch.mm(a[:256, :256], b[:256, :256])  # warmup: loads the kernels without paying for a full product
    times = time_calls(lambda: torch.mm(a, b), lambda: None, max_repeats, max_total_s)
    median = statistics.median(times)
    return {"size": size, "median_s": median, "repeats": len(times), "gflops": 2 * size**3 / median / 1e9}


# --------------------------------------------------------------------------- predicting, skipping, recording


def scaled_from_previous(
    n: int, previous: dict | None, time_growth: Callable[[int], float] | None = None
) -> tuple[float | None, float | None]:
    """(seconds, peak MiB) of a case at ``n`` predicted from the same series at the previous n: its median
    (or its own prediction if it was skipped) times ``time_growth(previous n)`` (default (n / previous n)^2),
    and its peak (or predicted peak) times (n / previous n)^2. (None, None) without a previous case."""
    if previous is None:
        return None, None
    memory_growth = (n / previous["n"]) ** 2
    growth = memory_growth if time_growth is None else time_growth(previous["n"])
    last_s = previous.get("median_s") or previous.get("predicted_s")
    seconds = None if last_s is None else last_s * growth
    last_mib = previous.get("peak_mib") or previous.get("predicted_mib")
    mib = None if last_mib is None else max(last_mib, 0.0) * memory_growth
    return seconds, mib


def at_least_scores(mib: float | None, batch_heads: int, n: int, dtype: str, mode: str) -> float:
    """``mib``, raised to the TEXTBOOK_SCORE_TENSORS (b, h, n, n) tensors a materialising implementation keeps."""
    score_bytes = batch_heads * n**2 * DTYPES[dtype].itemsize
    analytic = TEXTBOOK_SCORE_TENSORS[mode] * score_bytes / MIB
    return analytic if mib is None else max(mib, analytic)


def skip_reason(predicted_s: float | None, predicted_mib: float | None, budget_s: float, ram: int | None) -> str | None:
    """Why a case with these predictions is not run (every reason that applies), or None."""
    reasons = []
    if predicted_s is not None and predicted_s > budget_s:
        reasons.append(f"predicted {predicted_s:.3g} s > budget {budget_s:.3g} s")
    if ram is not None and predicted_mib is not None and predicted_mib * MIB > RAM_FRACTION * ram:
        reasons.append(f"needs ~{predicted_mib * MIB / GIB:.0f} GiB > {RAM_FRACTION:.0%} of {ram / GIB:.0f} GiB RAM")
    return "; ".join(reasons) or None


def run_case(
    record: dict,
    predicted: tuple[float | None, float | None],
    measure: Callable[[], dict],
    budget_s: float,
    ram: int | None,
) -> dict:
    """Add the predictions to ``record``, then skip the case or add ``measure()``'s fields. Never raises for
    a failed measurement: RuntimeError, MemoryError and ValueError are recorded with status "error"."""
    record["predicted_s"], record["predicted_mib"] = predicted
    reason = skip_reason(record["predicted_s"], record["predicted_mib"], budget_s, ram)
    if reason is not None:
        record.update(status="skipped", reason=reason)
        return record
    try:
        record.update(measure())
    except (RuntimeError, MemoryError, ValueError) as error:
        record.update(status="error", reason=f"{type(error).__name__}: {error}")
    gc.collect()
    return record


def summary(record: dict, time_spec: str = ".1f", suffix: str = "") -> str:
    """One progress line for a record: its time, repeats, GFLOP/s, % peak and peak MiB, then ``suffix``."""
    if record["status"] != "ok":
        return f"{record['status']}: {record['reason']}"
    pct = "" if record["pct_peak"] is None else f", {record['pct_peak']:.0f}% peak"
    mem = "" if record["peak_mib"] is None else f", {record['peak_mib']:.1f} MiB"
    return (
        f"{format(record['median_s'] * 1e3, time_spec)} ms ({record['repeats']} reps), "
        f"{record['gflops']:.1f} GFLOP/s{pct}{mem}{suffix}"
    )


def find(records: Sequence[dict], **key: Any) -> dict | None:
    """The measured record matching ``key``, or None (missing, skipped or failed)."""
    for record in records:
        if record["status"] == "ok" and all(record[name] == value for name, value in key.items()):
            return record
    return None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    return None if a is None or b is None or b == 0 else a / b


def ratio_target(goal: str, ratios: list[dict], limit: float) -> dict:
    """A target met when every ``ratios[i]["ratio"]`` is at most ``limit``: the worst, the failing ones."""
    if not ratios:
        return {"goal": goal, "pass": None, "cases": []}
    worst = max(ratios, key=lambda r: r["ratio"])
    failing = [r for r in ratios if r["ratio"] > limit]
    return {"goal": goal, "worst": worst, "failing": failing, "cases": ratios, "pass": worst["ratio"] <= limit}


def all_pass(checks: Sequence[dict]) -> bool | None:
    """Whether every check passed; None when there is no check."""
    return all(c["pass"] for c in checks) if checks else None


# --------------------------------------------------------------------------- the machine


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo), else platform.processor(), else None."""
    line = _proc_line("/proc/cpuinfo", "model name")
    return line.split(":", 1)[1].strip() if line is not None else platform.processor() or None


def machine_info(peaks: dict) -> dict:
    """Versions, CPU, RAM, the allocator settings and the matmul peaks (``matmul_peak_gflops`` per dtype)."""
    ram = ram_bytes()
    return {
        "torch": torch.__version__,
        "multihead": multihead.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": None if ram is None else ram / GIB,
        MALLOC_ENV: os.environ.get(MALLOC_ENV),
        "malloc": {
            "memory_call_mmap_threshold": MEMORY_MMAP_THRESHOLD,
            "timed_calls_mmap_threshold": TIMING_MMAP_THRESHOLD,
            "switched_with_mallopt": LIBC is not None,
        },
        "memory_valid": (os.environ.get(MALLOC_ENV) is not None or LIBC is not None) and reset_peak_rss(),
        "matmul_peak": peaks,
    }


def machine_line(m: dict, *, multihead_version: bool = False) -> str:
    """The report's machine line from ``machine_info``'s dict."""
    peaks = ", ".join(f"{dtype} {p['gflops']:.2f} GFLOP/s ({p['size']}^2)" for dtype, p in m["matmul_peak"].items())
    version = f", multihead {m['multihead']}" if multihead_version else ""
    return (
        f"torch {m['torch']}{version}, {m['processor']}, {m['cpu_count']} CPUs, {m['torch_threads']} torch "
        f"threads, {fmt(m['ram_gib'], '.0f')} GiB RAM; matmul peak (torch.mm): {peaks}; "
        f"{MALLOC_ENV}={m[MALLOC_ENV]}"
    )


# --------------------------------------------------------------------------- configuration


class BenchConfig:
    """What the benchmarks' Config dataclasses share: the output stem, the quick configuration and the
    JSON form. A subclass is a dataclass with ``quick``, ``out_dir`` and the fields QUICK overrides."""

    NAME: ClassVar[str] = "bench"
    QUICK: ClassVar[dict] = {}  # the fields --quick changes (and quick=True)
    quick: bool
    out_dir: Path | None

    @property
    def stem(self) -> str:
        """Output file name stem: the benchmark's name, with _quick so a quick run never overwrites a full one."""
        return f"{self.NAME}_quick" if self.quick else self.NAME

    @classmethod
    def quick_config(cls, **overrides: Any) -> Any:
        """The quick configuration (``QUICK``), with ``overrides``."""
        return cls(**{**cls.QUICK, "quick": True, **overrides})

    def to_json(self) -> dict:
        """The fields, out_dir as a string."""
        out = dataclasses.asdict(self)  # type: ignore[call-overload]
        out["out_dir"] = None if self.out_dir is None else str(self.out_dir)
        return out


# --------------------------------------------------------------------------- reports


def fmt(value: float | None, spec: str) -> str:
    """``format(value, spec)``, or an em dash for None."""
    return "—" if value is None else format(value, spec)


VERDICTS = {True: "PASS", False: "FAIL", None: "not evaluated"}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None without matplotlib (the reports then have no PNG)."""
    return _figures.pyplot("the benchmark's PNG") if _figures.has_matplotlib() else None


def log_axes(ax: Any, title: str, xlabel: str, ylabel: str | None = None, fontsize: int = 9) -> None:
    """Log-log axes (x in base 2) with a title, labels and a light grid."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(title, fontsize=fontsize)
    ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def write_json(results: dict, out_dir: Path, stem: str) -> Path:
    """Write <stem>.json atomically (through a .tmp file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)
    return path


def write_reports(
    results: dict, out_dir: Path, stem: str, markdown_report: Callable[[dict], str], plot: Callable[[dict, Path], bool]
) -> str:
    """<stem>.json, <stem>.md (``markdown_report``) and <stem>.png (``plot``) under out_dir; returns the markdown."""
    report = write_json_and_markdown(results, out_dir, stem, markdown_report)
    plot(results, out_dir / f"{stem}.png")
    return report


def write_json_and_markdown(results: dict, out_dir: Path, stem: str, markdown_report: Callable[[dict], str]) -> str:
    """<stem>.json and <stem>.md (``markdown_report``) under out_dir; returns the markdown."""
    write_json(results, out_dir, stem)
    report = markdown_report(results)
    (out_dir / f"{stem}.md").write_text(report)
    return report


# --------------------------------------------------------------------------- command line


def int_list(text: str) -> tuple[int, ...]:
    """ "256,1024" -> (256, 1024)."""
    return tuple(int(part) for part in text.split(",") if part)


def dtype_list(text: str) -> tuple[str, ...]:
    """ "float32,bfloat16" -> ("float32", "bfloat16"); an unknown name is an argparse error."""
    names = tuple(part for part in text.split(",") if part)
    unknown = [name for name in names if name not in DTYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown dtype {unknown}; choose from {list(DTYPES)}")
    return names


RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results, beside the scripts


def default_out_dir() -> Path:
    """benchmarks/results of this checkout."""
    return RESULTS


def save_results(name: str, results: dict, markdown: str) -> None:
    """Write ``results`` as benchmarks/results/<name>.json and ``markdown`` as <name>.md, and print the markdown."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=1))
    (RESULTS / f"{name}.md").write_text(markdown)
    print(markdown)


def build_parser(
    doc: str, quick_help: str, budget_s: float, sizes: str, out: Path | None = None, prog: str | None = None
) -> argparse.ArgumentParser:
    """The benchmarks' options: --quick, --budget-s, --out, --sizes, --dtypes (``doc``'s first paragraph
    is the description; ``sizes`` the default n as text)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=budget_s,
        help=f"skip a case whose predicted time for one call exceeds this (default {budget_s:g})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out_dir() if out is None else out,
        help="output folder (default benchmarks/results)",
    )
    parser.add_argument("--sizes", type=int_list, help=f"comma-separated n (default {sizes})")
    parser.add_argument("--dtypes", type=dtype_list, help="comma-separated dtypes (default float32,bfloat16)")
    return parser


def config_from_args(config_cls: type, args: argparse.Namespace) -> Any:
    """``config_cls`` (or its quick configuration with --quick) with the options given."""
    overrides: dict = {"budget_s": args.budget_s, "out_dir": args.out}
    if args.sizes:
        overrides["sizes"] = args.sizes
    if args.dtypes:
        overrides["dtypes"] = args.dtypes
    return config_cls.quick_config(**overrides) if args.quick else config_cls(**overrides)


def bench_main(
    argv: Sequence[str] | None,
    parser: Callable[[], argparse.ArgumentParser],
    config_cls: type,
    run: Callable[[Any], dict],
    write_reports: Callable[[dict, Path, str], str],
    reexec: bool,
) -> int:
    """A benchmark's main: re-execute with MALLOC_MMAP_THRESHOLD_ set (with ``reexec``), parse ``argv``, run,
    write the reports under --out, print the markdown. The parser is built after the re-exec."""
    from multihead._errors import InputError
    from multihead._userfiles import output_folder

    if reexec:
        ensure_malloc_env()
    config = config_from_args(config_cls, parser().parse_args(argv))
    try:
        output_folder("--out", config.out_dir, create=False)  # before minutes of measuring, not after
    except InputError as error:  # the user's mistake: one line, as `multihead` prints it
        print(f"error: {error}", file=sys.stderr)
        return 2
    results = run(config)
    report = write_reports(results, config.out_dir, config.stem)
    print(report, flush=True)
    print(f"wrote {config.out_dir / config.stem}.json, .md, .png ({results['elapsed_s']:.0f} s)", flush=True)
    return 0


# ------------------------------------------------------------------------------------ the FlexAttention peer
def flex_peer_mods(
    slopes: torch.Tensor, length: torch.Tensor, window: int
) -> tuple[dict[str, Callable | None], dict[str, Callable]]:
    """(mask_mods, score_mods) by mask kind, as a FlexAttention user writes them by hand: causal, causal & a
    ``window`` of keys back, padding of each batch row to ``length[b]`` keys (a tensor the caller updates in place),
    and causal ALiBi with ``slopes`` (h,); "none" has no mask_mod."""

    def causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return q >= kv

    def windowed(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (q >= kv) & (q - kv <= window)

    def padding(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return kv < length[b]

    def alibi(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return score + slopes[h] * (kv - q)

    mask_mods = {"causal": causal, "window": windowed, "alibi": causal, "padding": padding, "none": None}
    return mask_mods, {"alibi": alibi}


def fresh_compiled(function: Callable, name: str) -> Callable:
    """torch.compile(dynamic=True) of a fresh copy of ``function`` named ``name``: dynamo's recompile limit (8) is
    per code object, and past it dynamo silently runs flex_attention unfused (eager, dense scores)."""
    import types

    fresh = types.FunctionType(function.__code__.replace(), function.__globals__, name, function.__defaults__)
    fresh.__kwdefaults__ = function.__kwdefaults__
    return torch.compile(fresh, dynamic=True)
