"""``multihead bench``: multihead beside its peers on this machine, timed fairly, with the roofline share.

Two groups, each case timed in one interleaved run of its peers (ours first):

    attention   multihead.attention (backend "auto") | torch SDPA | the textbook code
                q, k, v of (1, 16, n, 64), full and causal
    layer       multihead.MultiHeadAttention | torch.nn.MultiheadAttention (need_weights=False) | a textbook module
                x of (1, n, 768), 12 heads, the same weights in all three, full attention

each "forward" (under torch.no_grad()) and "forward+backward" (the output back-propagated with a fixed gradient).

How it is timed. Every peer is a ``torch.utils.benchmark.Timer`` with torch's threads (not the
Timer's default of one). The peers take turns: every round, each peer times one block of calls with
``Timer.timeit`` (which first makes two warm-up calls, so each block starts warm even after another
peer ran; a block is enough calls for about ``block_s`` seconds), and the order rotates from round to
round (A B C, B C A, C A B, ...), so a burst of another process's work, or the machine warming up,
falls on all of them alike. A peer's time is the median over the rounds, its spread the interquartile range;
ours / peer is the median of the per-round ratios, shown with the lowest and the highest.

Roofline share = the lower bound of :mod:`multihead.cost` (the needed FLOPs at the calibrated matmul
rate, or the least traffic at the calibrated copy bandwidth, whichever is larger) / the median time. A
share above 1 would mean a call beat the machine's limit, so the calibration is wrong (typically measured
while the machine was busy): it is measured again once, and a share still above 1 is withheld with a note.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import benchmark

import multihead
from multihead._figures import Written, draw_figure, fitted_title, pyplot, save_figure
from multihead.cost import DTYPES, LayerShape, MachineRates, Roofline, attention_kernel_cost, bound, estimate, roofline

# a time whose half-IQR exceeds NOISY_SPREAD_PCT of its median is called out in a note: the rule by which a
# calibration is too noisy to cache
from multihead.machine import NOISY_SPREAD_PCT, age_text, cached_rates, calibration_spreads, identity

__all__ = ["Case", "cases", "TextbookMHA", "textbook_attention", "interleave", "run", "tables", "write_reports"]

ATTENTION = {"batch": 1, "heads": 16, "head_dim": 64}
LAYER = {"batch": 1, "embed_dim": 768, "heads": 12}
PEERS = {"attention": ("multihead", "torch SDPA", "textbook"), "layer": ("multihead", "torch MHA", "textbook")}
SIZES: dict[bool, dict[str, tuple[int, ...]]] = {
    True: {"attention": (256, 1024), "layer": (128, 512)},
    False: {"attention": (256, 1024, 2048), "layer": (128, 512, 2048)},
}
ROUNDS = {True: 5, False: 7}  # quick, full
BLOCK_S = {True: 0.05, False: 0.1}
WARMUP_CALLS = 2  # what torch.utils.benchmark's Timer.timeit calls before every timed block (at least)
MAX_CALLS_PER_BLOCK = 10_000
MODES = ("forward", "forward+backward")

Step = Callable[[], object]


# --------------------------------------------------------------------------- the textbook peers


def textbook_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v, materialised. q, k, v (b, h, n, d) -> out (b, h, n, d), weights (b, h, n, n)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (b, h, n, n)
    if causal:
        future = torch.triu(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights


class TextbookMHA(nn.Module):
    """The classic multi-head attention module, batch first: x (b, n, E) -> out (b, n, E), weights (b, h, n, n).

    Its parameters have multihead.MultiHeadAttention's names (q_proj, k_proj, v_proj, out_proj), so one
    ``load_state_dict`` gives both the same weights.
    """

    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))

    def forward(self, x: torch.Tensor, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        h, d = self.num_heads, self.embed_dim // self.num_heads
        q, k, v = (proj(x).view(b, n, h, d).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out, weights = textbook_attention(q, k, v, causal)  # (b, h, n, d), (b, h, n, n)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, self.embed_dim)), weights  # heads concatenated


# --------------------------------------------------------------------------- cases and their peers


@dataclass(frozen=True)
class Case:
    """One comparison: a group ("attention" or "layer"), the sequence length n, causal or not, mode and dtype."""

    group: str
    n: int
    causal: bool
    mode: str
    dtype: str

    @property
    def label(self) -> str:
        return f"n={self.n}{' causal' if self.causal else ''}"

    def bound(self, rates: MachineRates) -> Roofline:
        """The roofline bound of this case's work on a machine with ``rates``."""
        if self.group == "attention":
            a = ATTENTION
            flops, traffic = attention_kernel_cost(
                batch=a["batch"],
                heads=a["heads"],
                q_len=self.n,
                k_len=self.n,
                head_dim=a["head_dim"],
                causal=self.causal,
                dtype=self.dtype,
                mode=self.mode,
            )
            return bound(flops, traffic, self.dtype, rates)
        shape = LayerShape(LAYER["embed_dim"], LAYER["heads"])
        report = estimate(shape, seq=self.n, batch=LAYER["batch"], causal=self.causal, dtype=self.dtype, mode=self.mode)
        return roofline(report, rates)


def cases(quick: bool, dtypes: Sequence[str] = ("float32",)) -> list[Case]:
    """Every case of a quick or full run: attention full and causal, the layer full; both modes; each dtype."""
    sizes = SIZES[quick]
    return [
        Case(group, n, causal, mode, dtype)
        for dtype in dtypes
        for group in ("attention", "layer")
        for n in sizes[group]
        for causal in ((False, True) if group == "attention" else (False,))
        for mode in MODES
    ]


def _training_step(call: Callable[[], torch.Tensor], leaves: Sequence[torch.Tensor], grad: torch.Tensor) -> Step:
    """A forward+backward step: clear the leaves' gradients, call, back-propagate ``grad``."""

    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        call().backward(grad)

    return step


def _inference_step(call: Callable[[], object]) -> Step:
    def step() -> None:
        with torch.no_grad():
            call()

    return step


def _step(case: Case, call: Callable[[], torch.Tensor], leaves: Sequence[torch.Tensor], grad: torch.Tensor) -> Step:
    return _training_step(call, leaves, grad) if case.mode == "forward+backward" else _inference_step(call)


def attention_steps(case: Case, seed: int = 0) -> tuple[dict[str, Step], str | None]:
    """The peers' steps on shared q, k, v (b, h, n, d), and the backend multihead's auto chose for them."""
    a, dtype = ATTENTION, DTYPES[case.dtype]
    generator = torch.Generator().manual_seed(seed)
    q, k, v, grad = (
        torch.randn(a["batch"], a["heads"], case.n, a["head_dim"], generator=generator, dtype=dtype) for _ in range(4)
    )
    training = case.mode == "forward+backward"
    for t in (q, k, v):
        t.requires_grad_(training)
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "multihead": lambda: multihead.attention(q, k, v, causal=case.causal),
        "torch SDPA": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal),
        "textbook": lambda: textbook_attention(q, k, v, case.causal)[0],
    }
    with torch.set_grad_enabled(training):
        served_by = multihead.explain(q, k, v, causal=case.causal).chosen
    return {name: _step(case, call, (q, k, v), grad) for name, call in calls.items()}, served_by


def attention_layers(
    embed_dim: int, heads: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[multihead.MultiHeadAttention, nn.MultiheadAttention, TextbookMHA]:
    """(multihead layer, torch.nn.MultiheadAttention, textbook module) with the same weights: ours initialised
    from ``seed`` with small random biases (so a wrong bias mapping would show), copied into the others."""
    torch.manual_seed(seed)
    ours = multihead.MultiHeadAttention(embed_dim, heads)
    with torch.no_grad():
        for proj in (ours.q_proj, ours.k_proj, ours.v_proj, ours.out_proj):
            proj.bias.normal_(0.0, 0.02)
    book = TextbookMHA(embed_dim, heads)
    book.load_state_dict(ours.state_dict(), strict=True)  # the same names: q_proj, k_proj, v_proj, out_proj
    theirs = ours.to_torch()
    return ours.to(dtype), theirs.to(dtype), book.to(dtype)


def layer_steps(case: Case, seed: int = 0) -> tuple[dict[str, Step], str | None]:
    """The peers' steps on one x (b, n, E), each module in train mode for forward+backward, eval for forward."""
    dtype, training = DTYPES[case.dtype], case.mode == "forward+backward"
    ours, theirs, book = attention_layers(LAYER["embed_dim"], LAYER["heads"], dtype, seed)
    generator = torch.Generator().manual_seed(seed)
    x, grad = (torch.randn(LAYER["batch"], case.n, LAYER["embed_dim"], generator=generator, dtype=dtype) for _ in "xg")
    x.requires_grad_(training)
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "multihead": lambda: ours(x)[0],
        "torch MHA": lambda: theirs(x, x, x, need_weights=False)[0],
        "textbook": lambda: book(x)[0],
    }
    steps = {}
    for name, module in zip(calls, (ours, theirs, book), strict=True):
        module.train(training)
        steps[name] = _step(case, calls[name], (x, *module.parameters()), grad)
    return steps, None


# --------------------------------------------------------------------------- timing


def interleave(steps: dict[str, Step], *, rounds: int, block_s: float) -> dict[str, list[float]]:
    """Seconds per call of each step in each round. One timed call each sizes its blocks (about ``block_s``
    seconds); then ``rounds`` rounds in which every step times one block, the order rotating by one each round.
    Every block (``Timer.timeit``) starts with WARMUP_CALLS or more untimed calls."""
    timers = {
        name: benchmark.Timer("step()", globals={"step": step}, num_threads=torch.get_num_threads(), description=name)
        for name, step in steps.items()
    }
    calls = {}
    for name, timer in timers.items():
        once = timer.timeit(1).times[0]
        calls[name] = max(1, min(MAX_CALLS_PER_BLOCK, round(block_s / once)))
    names = list(timers)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(timers[name].timeit(calls[name]).times[0])
    return samples


def _quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); a single value is all three."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def measure(case: Case, *, rounds: int, block_s: float, seed: int = 0) -> dict:
    """One case's record: each peer's per-round times, median and IQR, and ours / peer per round."""
    steps, served_by = (attention_steps if case.group == "attention" else layer_steps)(case, seed)
    samples = interleave(steps, rounds=rounds, block_s=block_s)
    ours = PEERS[case.group][0]
    peers = {}
    for name, times in samples.items():
        q1, median, q3 = _quartiles(times)
        peers[name] = {"median_s": median, "iqr_s": q3 - q1, "samples_s": times}
    ratios = {}
    for name, times in samples.items():
        if name != ours:
            paired = [a / b for a, b in zip(samples[ours], times, strict=True)]
            ratios[name] = {"median": statistics.median(paired), "low": min(paired), "high": max(paired)}
    return {**asdict(case), "label": case.label, "served_by": served_by, "peers": peers, "ours_over": ratios}


# --------------------------------------------------------------------------- the roofline, honestly


def score(records: list[dict], rates: MachineRates) -> int:
    """Set each record's bound and each peer's roofline share (bound / median); returns how many shares are
    above 1 (impossible with a right calibration)."""
    above = 0
    for record in records:
        case = Case(record["group"], record["n"], record["causal"], record["mode"], record["dtype"])
        limit = case.bound(rates)
        record["bound_s"], record["bound_by"] = limit.bound_s, limit.bound_by
        for peer in record["peers"].values():
            peer["roofline_share"] = limit.bound_s / peer["median_s"]
            above += peer["roofline_share"] > 1
    return above


def withhold_impossible_shares(records: list[dict], rates: MachineRates) -> str | None:
    """Replace every share above 1 by None; a note naming them and the calibration, or None when there is none."""
    withheld = []
    for record in records:
        for name, peer in record["peers"].items():
            if peer["roofline_share"] > 1:
                withheld.append(f"{name} {record['group']} {record['label']} {record['mode']}")
                peer["roofline_share"], peer["share_withheld"] = None, True
    if not withheld:
        return None
    rate = ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in rates.matmul_gflops.items())
    return (
        f"roofline share withheld for {len(withheld)} timing(s) ({'; '.join(withheld[:3])}"
        f"{', ...' if len(withheld) > 3 else ''}): they ran faster than the bound from this calibration ({rate}, "
        f"{rates.bandwidth_gbs:.1f} GB/s), so it underestimates this machine. Run `multihead bench --calibrate` "
        "when the machine is quiet."
    )


def run(
    *,
    quick: bool,
    dtypes: Sequence[str] = ("float32",),
    recalibrate: bool = False,
    force: bool = False,
    rounds: int | None = None,
    block_s: float | None = None,
    only: Sequence[Case] | None = None,
    say: Callable[[str], None] = print,
) -> dict:
    """Calibrate (or reuse the cache), time every case, score it against the roofline; the results (bench.json).
    A calibration measured here that is too noisy to cache (:func:`multihead.machine.calibration_noise`) serves this
    run only, with a note, unless ``force``."""
    started = time.perf_counter()
    notes: list[str] = []

    def calibration_say(line: str) -> None:  # what the calibration says is progress, except why a cache was not used
        say(line)
        if line.startswith(("ignored the calibration cache", "calibration not saved")):
            notes.append(line)

    rates, measured_now = cached_rates(dtypes, recalibrate=recalibrate, force=force, say=calibration_say)
    rounds, block_s = rounds or ROUNDS[quick], BLOCK_S[quick] if block_s is None else block_s
    records = []
    todo = cases(quick, dtypes) if only is None else list(only)
    for index, case in enumerate(todo, 1):
        say(f"[{index}/{len(todo)}] {case.group} {case.label} {case.mode} {case.dtype}")
        records.append(measure(case, rounds=rounds, block_s=block_s))
    if score(records, rates) and not measured_now:
        notes.append(
            f"a measured time was below the roofline bound of the calibration from {rates.measured_at}: "
            "the calibration was measured again"
        )
        say(notes[-1])
        rates, measured_now = cached_rates(dtypes, recalibrate=True, force=force, say=calibration_say)
        score(records, rates)
    note = withhold_impossible_shares(records, rates)
    if note:
        notes.append(note)
    spreads = [50 * p["iqr_s"] / p["median_s"] for r in records for p in r["peers"].values()]
    noisy = sum(spread > NOISY_SPREAD_PCT for spread in spreads)
    if noisy:
        notes.append(
            f"{noisy} of {len(spreads)} times vary by more than ±{NOISY_SPREAD_PCT:.0f}% between rounds: something "
            "else was probably using the CPU. The ratios, taken round by round, suffer least; run again on a "
            "quiet machine for firmer numbers."
        )
    me = identity()
    return {
        "benchmark": "multihead bench",
        "quick": quick,
        "machine": {
            **asdict(me),
            "description": me.describe(),
            "multihead": multihead.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "calibration": {
            "matmul_gflops": rates.matmul_gflops,
            "bandwidth_gbs": rates.bandwidth_gbs,
            "threads": rates.threads,
            "measured_at": rates.measured_at,
            "age_s": None if rates.measured_unix is None else time.time() - rates.measured_unix,
            "measured_in_this_run": measured_now,
            "spread_pct": calibration_spreads(rates),  # of its timed blocks ({}: rates without them)
        },
        "method": {
            "timer": "torch.utils.benchmark.Timer.timeit, torch's threads",
            "warmup_calls": WARMUP_CALLS,
            "rounds": rounds,
            "block_s": block_s,
            "order": "interleaved, rotating by one peer each round",
            "time": "median over rounds of seconds per call; spread = interquartile range",
            "ratio": "ours / peer: median of the per-round ratios, with the lowest and highest",
            "roofline_share": "multihead.cost lower bound / median time; never above 1 (withheld with a note)",
        },
        "cases": records,
        "notes": notes,
        "elapsed_s": time.perf_counter() - started,
    }


# --------------------------------------------------------------------------- reports


def _milliseconds(seconds: float) -> str:
    """Three significant digits, without an exponent: 0.123, 12.3, 123, 1234."""
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def tables(results: dict) -> list[tuple[str, list[list[str]]]]:
    """(title, rows) of one table per group and dtype measured; a row: case, mode, peer, time ms, its spread
    (half the IQR, in %), ours / peer, the range of the per-round ratios, roofline share."""
    out = []
    for group, dtype in dict.fromkeys((r["group"], r["dtype"]) for r in results["cases"]):
        rows = []
        for record in (r for r in results["cases"] if r["group"] == group and r["dtype"] == dtype):
            for name, peer in record["peers"].items():
                ratio = record["ours_over"].get(name)
                ours = name == PEERS[group][0] and record["served_by"]
                share = peer["roofline_share"]
                rows.append(
                    [
                        record["label"],
                        "fwd" if record["mode"] == "forward" else "fwd+bwd",
                        f"{name} ({record['served_by']})" if ours else name,
                        _milliseconds(peer["median_s"]),
                        f"{50 * peer['iqr_s'] / peer['median_s']:.0f}%",
                        "—" if ratio is None else f"{ratio['median']:.2f}",
                        "" if ratio is None else f"{ratio['low']:.2f}–{ratio['high']:.2f}",
                        "withheld" if peer.get("share_withheld") else f"{share:.2f}",
                    ]
                )
        out.append((f"{group}, {dtype}: {SHAPES[group]}", rows))
    return out


HEADERS = ("case", "mode", "peer", "ms", "±", "ours/peer", "range", "roofline")
SHAPES = {"attention": "q, k, v of (1, 16, n, 64)", "layer": "x of (1, n, 768), 12 heads, full attention"}


def header_lines(results: dict) -> list[str]:
    """The machine, the calibration (with its age) and how the numbers were measured."""
    c, m = results["calibration"], results["method"]
    age = "measured in this run" if c["measured_in_this_run"] else f"{age_text(c['age_s'] or 0)} old (cached)"
    rates = ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in c["matmul_gflops"].items())
    return [
        f"machine: {results['machine']['description']}",
        f"calibration: matmul {rates}, copy {c['bandwidth_gbs']:.1f} GB/s; {age}",
        f"timing: torch.utils.benchmark, {m['rounds']} interleaved rounds (order rotating), each block after "
        f"{m['warmup_calls']} warm-up calls. ms: the median; ±: half the interquartile range; ours/peer: the "
        "median of the per-round ratios (below 1: multihead is faster), in brackets their lowest and highest; "
        "roofline: the cost model's lower bound / the median (1 = this machine's limit)",
    ]


def plot(results: dict, path: Path) -> Path:
    """ours / peer per case (dots) with the range of the per-round ratios (bars), a panel per group and dtype."""
    plt = pyplot("bench's PNG chart")
    panels = list(dict.fromkeys((r["group"], r["dtype"]) for r in results["cases"]))
    figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.4), squeeze=False)
    for axis, (group, dtype) in zip(axes[0], panels, strict=True):
        records = [r for r in results["cases"] if r["group"] == group and r["dtype"] == dtype]
        for offset, peer in enumerate(PEERS[group][1:]):
            ratios = [r["ours_over"][peer] for r in records]
            median = [q["median"] for q in ratios]
            below = [m - q["low"] for m, q in zip(median, ratios, strict=True)]
            above = [q["high"] - m for m, q in zip(median, ratios, strict=True)]
            x = [i + 0.15 * (2 * offset - 1) for i in range(len(records))]
            axis.errorbar(x, median, yerr=[below, above], fmt="o", capsize=3, label=f"vs {peer}")
        axis.axhline(1.0, color="k", linewidth=0.8)
        labels = [f"n={r['n']}{' causal' if r['causal'] else ''}\n{r['mode']}" for r in records]
        axis.set_xticks(range(len(records)), [label.replace("forward+backward", "fwd+bwd") for label in labels])
        axis.tick_params(axis="x", labelsize=7, labelrotation=30)
        axis.set(ylabel="multihead time / peer time")
        fitted_title(axis, f"{group}, {dtype} (below 1: multihead is faster)")
        axis.set_ylim(bottom=0)
        axis.legend(fontsize=8)
    fitted_title(figure, f"multihead bench: {results['machine']['description']}", fontsize=9)
    return save_figure(figure, path)


def write_reports(results: dict, out_dir: Path) -> Written:
    """bench.json (bench_quick.json for --quick) and the PNG beside it; {"json": path, "png": path}. Without
    matplotlib the PNG is left out, in the result's ``skipped`` (:func:`multihead._figures.print_written` says
    so)."""
    stem = "bench_quick" if results["quick"] else "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = Written(json=out_dir / f"{stem}.json")
    written["json"].write_text(json.dumps(results, indent=1))
    if results["cases"]:
        draw_figure(written, "png", out_dir / f"{stem}.png", lambda path: plot(results, path))
    return written
