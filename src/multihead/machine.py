"""How this machine is measured: what it is, how fast it multiplies and moves memory, what a step allocates.

    identity      :func:`identity`: the CPU model, its instruction-set flags (a hash of all, the notable ones by
                  name), torch's threads and version; :func:`identity_key` is what a calibration is keyed on
    calibration   :func:`calibrate`: dense matmul GFLOP/s per dtype and copy bandwidth, timed with
                  ``torch.utils.benchmark``, with the spread of its timed blocks (:func:`calibration_noise`);
                  :func:`cached_rates` reuses the cached ones when they are this machine's and recent, else
                  measures again (saying why)
    the cache     :func:`save_calibration` / :func:`read_calibration`: one JSON file (``calibration_path``),
                  stamped with the identity it was measured on and when; a noisy calibration is refused
                  (:class:`NoisyCalibration`) unless forced
    memory        :func:`measure_peak_bytes`: the CPU allocator's peak during one call, from torch.profiler

Each backend's rate for ``backend="auto"`` is timed by :mod:`multihead.backend_rates` and kept here with the rest.

What a configuration costs (FLOPs, bytes, the roofline bound from these rates) is :mod:`multihead.cost`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch.utils import benchmark

from multihead._errors import ArgumentValueError, InputError, bad_argument
from multihead._userfiles import (
    ANY_OBJECT,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    STRING,
    MapOf,
    OptionalKey,
    path_kind,
    read_json,
)
from multihead.backend_rates import calibrate_kernels
from multihead.backends.policy import STATIC, DispatchPolicy, cpu_flags
from multihead.backends.rates import DEFAULT_FRESH_GBS, DEFAULT_MASKED_GPS, DEFAULT_SCORE_MOD_GPS, KernelRates
from multihead.cost import DTYPES, MachineRates, dtype_name

__all__ = [
    "Identity",
    "identity",
    "identity_key",
    "calibrate",
    "calibrate_kernels",
    "calibration_noise",
    "calibration_spreads",
    "spread_pct",
    "NoisyCalibration",
    "NOISY_SPREAD_PCT",
    "cached_kernel_rates",
    "cached_rates",
    "measured_policy",
    "calibration_path",
    "save_calibration",
    "read_calibration",
    "age_text",
    "measure_peak_bytes",
    "MAX_AGE_S",
]

MAX_AGE_S = 30 * 24 * 3600  # an older calibration is measured again: the machine or its load may have changed
HALF_MATMUL_SIZE = 512  # half-precision matmuls are slow on CPUs without their units: a smaller square
# Repeats of one measurement (a calibration's timed blocks, `multihead bench`'s rounds) whose half interquartile
# range is above this share of their median, in %, were measured while something else used the CPU: such a
# calibration is not cached (its ceiling sits low, and `multihead cost` would print a bound too slow for the 30
# days a cache is kept), such a time is called out by `multihead bench`. One rule for both. On the project's
# shared 2-core machine the blocks of a 1024 or 2048 matmul and of the copy strayed by ±0.2-5%, those of a 512
# matmul, short enough to be cut by the other jobs, by ±31-167% (docs/cost.md).
NOISY_SPREAD_PCT = 10.0
MIN_BLOCKS = 3  # timed blocks per calibration measurement and round at least: fewer say little of their spread
CALIBRATION_ROUNDS = 3  # each measurement timed once a round: its blocks spread over the calibration's seconds
# instruction-set flags that change how fast attention runs (x86: /proc/cpuinfo "flags"; Arm: "Features")
NOTABLE_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
    "amx_int8",
    "asimd",
    "bf16",
    "i8mm",
    "sve",
    "sve2",
    "sme",
)
RECALIBRATE = "run `multihead bench --calibrate` to measure this machine"


# --------------------------------------------------------------------------- what this machine is


@dataclass(frozen=True)
class Identity:
    """What a calibration depends on: the CPU (model, flags), the threads torch uses, torch's version."""

    cpu: str
    flags_hash: str  # sha256 of the sorted flags, 16 hex digits ("" where the OS does not list them)
    notable_flags: tuple[str, ...]  # those of NOTABLE_FLAGS the CPU has
    torch_isa: str  # the instruction set torch's CPU kernels chose (torch.backends.cpu.get_cpu_capability)
    threads: int
    torch: str

    def describe(self) -> str:
        """One line: "AMD EPYC (avx avx2 fma; torch uses AVX2), 2 threads, torch 2.13.0+cpu"."""
        flags = " ".join(self.notable_flags) or "no notable flags listed"
        return f"{self.cpu} ({flags}; torch uses {self.torch_isa}), {self.threads} threads, torch {self.torch}"


def identity() -> Identity:
    """This machine and process, now (the threads are torch.get_num_threads())."""
    model, flag_set = cpu_flags()
    cpu = model or platform.processor() or platform.machine() or "unknown CPU"
    flags = sorted(flag_set)
    digest = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16] if flags else ""
    return Identity(
        cpu=cpu,
        flags_hash=digest,
        notable_flags=tuple(flag for flag in NOTABLE_FLAGS if flag in flags),
        torch_isa=torch.backends.cpu.get_cpu_capability(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
    )


def identity_key(machine: Identity | None = None) -> dict:
    """What a cached calibration must match to be used: CPU model, flags hash, threads, torch version."""
    m = machine or identity()
    return {"cpu": m.cpu, "flags": m.flags_hash, "threads": m.threads, "torch": m.torch}


# --------------------------------------------------------------------------- calibration


def _block_seconds(stmt: str, names: dict, min_run_time: float) -> list[float]:
    """Seconds per call of ``stmt`` in each of its timed blocks (torch.utils.benchmark's ``blocked_autorange`` for
    about ``min_run_time`` seconds, torch's threads, not 1), at least MIN_BLOCKS of them: a call slower than
    ``min_run_time`` gets more blocks of the same size, so that the blocks' spread can be read."""
    timer = benchmark.Timer(stmt=stmt, globals=names, num_threads=torch.get_num_threads())
    measured = timer.blocked_autorange(min_run_time=min_run_time)
    seconds = list(measured.times)
    while len(seconds) < MIN_BLOCKS:
        seconds.append(timer.timeit(measured.number_per_run).times[0])
    return seconds


def spread_pct(values: Sequence[float]) -> float:
    """Half the interquartile range of ``values`` over their median, in % (0 for fewer than 2): how far repeats of
    one measurement stray from each other, read against NOISY_SPREAD_PCT."""
    if len(values) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return 50 * (q3 - q1) / median


def calibrate(
    dtypes: Sequence[str] = ("float32",),
    *,
    matmul_sizes: Sequence[int] = (512, 1024, 2048),
    copy_mib: int = 256,
    min_run_time: float = 0.3,
    kernels: bool = False,
    refuse_noisy: bool = False,
) -> MachineRates:
    """Measure this machine now: ``torch.mm`` of two squares of each of ``matmul_sizes`` per dtype (half types:
    those up to 512, they are slow on CPUs without their units), and ``dst.copy_(src)`` of ``copy_mib`` MiB.

    Each is timed in blocks by ``torch.utils.benchmark`` for about ``min_run_time`` seconds in all, over
    CALIBRATION_ROUNDS rounds that each time every measurement once (at least MIN_BLOCKS blocks a round), so that
    its blocks spread over the whole calibration and a slow spell of the machine falls on some of them, not on one
    measurement. The rate is a ceiling for the roofline, so it is the fastest block of the fastest size (2 n^3
    FLOPs per matmul: a square that fits the caches runs faster than a large one; read plus written bytes per
    copy). The rates of the blocks each cached rate comes from are kept in ``details["block_rates"]`` and their
    spread in ``details["spread_pct"]`` (:func:`spread_pct`): a machine busy part of the time measures low and
    strays, and :func:`save_calibration` refuses to cache such a calibration (:func:`calibration_noise`); one
    busy all through measures low evenly, which shows later as a measured time under the bound (see
    multihead.lab.bench).
    With ``kernels``, each backend's rate for ``backend="auto"`` too (:func:`calibrate_kernels`, about 50 s), kept
    in ``details["kernel_rates"]``; with ``refuse_noisy`` as well, a noisy calibration raises
    :class:`NoisyCalibration` before that minute is spent.
    """
    # (dtype or "copy", size) -> the statement timed, its names and what one call does (FLOPs, or bytes moved)
    timed: dict[tuple[str, int], tuple[str, dict, float]] = {}
    for name in dtypes:
        key = dtype_name(name)
        dtype = DTYPES[key]
        half = dtype not in (torch.float32, torch.float64)
        for n in [n for n in matmul_sizes if not half or n <= HALF_MATMUL_SIZE] or [min(matmul_sizes)]:
            a, b, out = (torch.randn(n, n, dtype=dtype) for _ in range(3))
            timed[key, n] = ("torch.mm(a, b, out=out)", {"torch": torch, "a": a, "b": b, "out": out}, 2 * n**3)
    elements = copy_mib * 2**20 // 4
    src, dst = torch.randn(elements), torch.empty(elements)
    timed["copy", copy_mib] = ("dst.copy_(src)", {"src": src, "dst": dst}, 2 * elements * 4)
    blocks: dict[tuple[str, int], list[float]] = {measurement: [] for measurement in timed}  # each block's rate
    for _ in range(CALIBRATION_ROUNDS):
        for measurement, (stmt, names, work) in timed.items():
            seconds = _block_seconds(stmt, names, min_run_time / CALIBRATION_ROUNDS)
            blocks[measurement] += [work / s / 1e9 for s in seconds]
    by_size: dict[str, dict[int, float]] = {}
    for (key, n), values in blocks.items():
        if key != "copy":
            by_size.setdefault(key, {})[n] = max(values)
    rates: dict[str, float] = {}
    block_rates: dict[str, list[float]] = {}  # "float32 matmul" / "copy" -> the blocks its rate is the fastest of
    for key, sizes in by_size.items():
        fastest = max(sizes, key=sizes.__getitem__)
        rates[key], block_rates[f"{key} matmul"] = sizes[fastest], blocks[key, fastest]
    copies = block_rates["copy"] = blocks["copy", copy_mib]
    measured = MachineRates(
        rates,
        max(copies),
        torch.get_num_threads(),
        time.strftime("%Y-%m-%d %H:%M:%S"),
        {
            "matmul_gflops_by_size": by_size,
            "copy_mib": copy_mib,
            "timer": f"torch.utils.benchmark, fastest block of {CALIBRATION_ROUNDS} rounds",
            "block_rates": block_rates,
            "spread_pct": {what: spread_pct(values) for what, values in block_rates.items()},  # for people
        },
        identity_key(),
        time.time(),
    )
    if not kernels:
        return measured
    if refuse_noisy and (noise := calibration_noise(measured)) is not None:
        raise NoisyCalibration(noise)
    return replace(
        measured, details={**measured.details, "kernel_rates": asdict(calibrate_kernels(where=identity().describe()))}
    )


def calibration_spreads(rates: MachineRates) -> dict[str, float]:
    """Each measurement's :func:`spread_pct` ("float32 matmul", "copy") from ``rates``' timed blocks
    (``details["block_rates"]``); empty for rates without them (given by hand, or cached before they were kept)."""
    blocks = rates.details.get("block_rates")
    if not isinstance(blocks, dict):
        return {}
    return {
        str(what): spread_pct([float(v) for v in values])
        for what, values in blocks.items()
        if isinstance(values, list) and values and all(isinstance(v, int | float) and v > 0 for v in values)
    }


def calibration_noise(rates: MachineRates) -> str | None:
    """What strays in ``rates``' timed blocks ("float32 matmul ±23%, copy ±2%", the widest first), or None when
    every measurement's :func:`spread_pct` is at most NOISY_SPREAD_PCT (and for rates without blocks)."""
    spreads = calibration_spreads(rates)
    if max(spreads.values(), default=0.0) <= NOISY_SPREAD_PCT:
        return None
    return ", ".join(f"{what} ±{spread:.0f}%" for what, spread in sorted(spreads.items(), key=lambda kv: -kv[1]))


class NoisyCalibration(ArgumentValueError):
    """A calibration whose timed blocks stray by more than NOISY_SPREAD_PCT (:func:`calibration_noise`), refused by
    :func:`save_calibration` (and by :func:`calibrate` with ``refuse_noisy``): the machine was busy."""

    def __init__(self, noise: str):
        expected = f"timed blocks within ±{NOISY_SPREAD_PCT:.0f}% of their median (half the interquartile range)"
        fix = "rerun on a quiet machine, or --force to keep it (force=True in Python)"
        super().__init__(
            f"calibration not saved: expected {expected}, got {noise}: something else was using the CPU, and a "
            f"busy machine measures low. Fix: {fix}",
            argument="calibration",
            expected=expected,
            got=noise,
            fix=fix,
        )


# --------------------------------------------------------------------------- the cache


def calibration_path() -> Path:
    """Where the rates are cached ($MULTIHEAD_CACHE, else $XDG_CACHE_HOME/multihead, else ~/.cache/multihead)."""
    root = os.environ.get("MULTIHEAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "multihead"
    )
    return Path(root) / "calibration.json"


def save_calibration(rates: MachineRates, path: Path | None = None, *, force: bool = False) -> Path:
    """Write ``rates`` to the cache (or ``path``). Rates without a machine or a time are taken as this machine's,
    now (stamped with :func:`identity_key` and the current time). A noisy calibration (:func:`calibration_noise`)
    raises :class:`NoisyCalibration` and writes nothing, unless ``force``."""
    noise = calibration_noise(rates)
    if noise is not None and not force:
        raise NoisyCalibration(noise)
    stamped = replace(
        rates,
        machine=rates.machine or identity_key(),
        measured_unix=time.time() if rates.measured_unix is None else rates.measured_unix,
    )
    target = path or calibration_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(asdict(stamped), indent=1))
    return target


_CALIBRATION_SCHEMA = {
    "matmul_gflops": MapOf(POSITIVE_NUMBER, 1),
    "bandwidth_gbs": POSITIVE_NUMBER,
    "threads": POSITIVE_INT,
    "measured_at": OptionalKey(STRING),
    "details": OptionalKey(ANY_OBJECT),
    "machine": OptionalKey(ANY_OBJECT),
    "measured_unix": OptionalKey(POSITIVE_NUMBER),
}


def age_text(seconds: float) -> str:
    """'40 s', '12 min', '5 h', '3 days'."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(seconds, 0):.0f} s"


def _why_not_usable(rates: MachineRates, key: dict, now: float) -> str | None:
    """Why cached ``rates`` do not describe this machine now (another machine or setup, too old), or None."""
    if not rates.machine or rates.measured_unix is None:
        return "it does not say which machine it was measured on (written by an older multihead)"
    differences = [
        f"{name} {rates.machine.get(name)!r}, here {value!r}"
        for name, value in key.items()
        if rates.machine.get(name) != value
    ]
    if differences:
        return "it was measured on another machine or setup (" + "; ".join(differences) + ")"
    age = now - rates.measured_unix
    if age > MAX_AGE_S:
        return f"it is {age_text(age)} old (older than {age_text(MAX_AGE_S)})"
    if age < -3600:
        return "its time is in the future"
    return None


def read_calibration(
    path: Path | None = None, *, key: dict | None = None, now: float | None = None
) -> tuple[MachineRates | None, str | None]:
    """(the cached rates or None, a note when a cache file was there but is not used).

    The cache is ours, not the user's argument: a damaged one (not JSON, fields missing or of the wrong type,
    rates that are not positive), one measured on another machine or setup (``key``, default
    :func:`identity_key`), or one older than MAX_AGE_S counts as absent, and the note says why and how to
    measure again.
    """
    source = path or calibration_path()
    if path_kind(source) == "missing":
        return None, None
    try:
        data = read_json(
            "calibration cache",
            source,
            what="rates written by `multihead bench --calibrate`",
            schema=_CALIBRATION_SCHEMA,
            fix="run `multihead bench --calibrate` to measure them again",
        )
    except InputError as error:
        return None, f"ignored the calibration cache ({error})"
    rates = MachineRates(
        dict(data["matmul_gflops"]),
        float(data["bandwidth_gbs"]),
        int(data["threads"]),
        data.get("measured_at", ""),
        data.get("details", {}),
        data.get("machine", {}),
        data.get("measured_unix"),
    )
    why = _why_not_usable(rates, identity_key() if key is None else key, time.time() if now is None else now)
    if why is not None:
        return None, f"ignored the calibration cache {source}: {why}; {RECALIBRATE}"
    return rates, None


def cached_rates(
    dtypes: Sequence[str], *, recalibrate: bool = False, force: bool = False, say: Callable[[str], None] = print
) -> tuple[MachineRates, bool]:
    """(rates for ``dtypes``, whether they were measured just now): the cache when it is this machine's, recent
    and has every dtype (and ``recalibrate`` is False), else :func:`calibrate` (float32 always, and the cached
    dtypes again) and save. A cache that cannot be written, or a noisy calibration (not saved unless ``force``:
    :func:`save_calibration`), is said, not raised: the rates are still used, for this run."""
    cached, note = read_calibration()
    if note:
        say(note)
    if not recalibrate and cached is not None and all(dtype in cached.matmul_gflops for dtype in dtypes):
        return cached, False
    wanted = sorted(set(dtypes) | {"float32"} | (set(cached.matmul_gflops) if cached else set()))
    say(f"calibrating this machine: matmul rate ({', '.join(wanted)}) and copy bandwidth ...")
    rates = calibrate(wanted)
    try:
        say(f"calibration saved to {save_calibration(rates, force=force)}")
    except NoisyCalibration as error:  # "calibration not saved: ...", why and the fix
        say(str(error))
    except OSError as error:
        say(f"calibration not saved ({error.strerror or error}); set MULTIHEAD_CACHE to a folder you can write to")
    return rates, True


def cached_kernel_rates(path: Path | None = None) -> KernelRates | None:
    """The backends' rates of this machine's calibration (``multihead bench --calibrate``), or None when there is
    none, it is not this machine's or recent (:func:`read_calibration`), or it holds no usable kernel rates."""
    rates, _ = read_calibration(path)
    kernel = (rates.details if rates is not None else {}).get("kernel_rates")
    if not isinstance(kernel, dict):
        return None
    try:
        gflops = {
            str(backend): {str(key): float(value) for key, value in by_key.items() if float(value) > 0}
            for backend, by_key in kernel["gflops"].items()
        }
        mask_gbs = float(kernel["mask_gbs"])
        source = str(kernel.get("source", ""))
        # absent in calibrations made before they were measured: the defaults (no cost per row)
        fresh_gbs = float(kernel.get("fresh_gbs", DEFAULT_FRESH_GBS))
        masked_gps = float(kernel.get("masked_gps", DEFAULT_MASKED_GPS))
        score_mod_gps = float(kernel.get("score_mod_gps", DEFAULT_SCORE_MOD_GPS))
        row_us = {
            str(backend): {str(key): float(value) for key, value in by_key.items() if float(value) >= 0}
            for backend, by_key in kernel.get("row_us", {}).items()
        }
    except (TypeError, KeyError, ValueError, AttributeError):
        return None  # absent or damaged: auto falls back to the defaults
    if min(mask_gbs, fresh_gbs, masked_gps, score_mod_gps) <= 0:
        return None
    return KernelRates(gflops, mask_gbs, source, fresh_gbs, masked_gps, row_us, score_mod_gps)


def measured_policy(path: Path | None = None, *, base: DispatchPolicy = STATIC) -> DispatchPolicy:
    """``base`` with this machine's calibrated rates (``multihead bench --calibrate``) as its CPU kind's table: the
    opt-in to measured rates, e.g. ``multihead.backends.set_policy(measured_policy())``. Raises a
    ValueError naming the fix when there is no usable calibration of this machine."""
    rates = cached_kernel_rates(path)
    if rates is None:
        _, why = read_calibration(path)
        found = calibration_path() if path is None else path
        raise bad_argument(
            "calibration",
            "this machine's kernel rates, written by `multihead bench --calibrate`",
            why or f"none in {found}",
            "run `multihead bench --calibrate` (about a minute), then build the policy again",
        )
    return base.with_rates(rates, kind=base.kind_of(torch.device("cpu")).name, name="measured")


# --------------------------------------------------------------------------- memory


def measure_peak_bytes(step: Callable[[], object]) -> int:
    """The most bytes the CPU allocator held at once during ``step()``, above what it held before.

    Read from torch.profiler's memory events (every allocation and free the CPU allocator reports, exported as
    a chrome trace), so it counts tensors, not the process's resident memory.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as directory:
        trace = Path(directory) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = [event["args"] for event in events if event.get("name") == "[memory]"]
    if not memory:
        return 0
    # "Total Allocated" is a running tally that outlives one profiling session: start from the value
    # just before this session's first event
    baseline = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return max(event["Total Allocated"] for event in memory) - baseline
