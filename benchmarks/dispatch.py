"""Does ``backend="auto"`` pick the fastest kernel? Every backend that serves a call, auto, torch SDPA and
FlexAttention side by side, with auto's estimates next to the measured times.

Usage:
    python benchmarks/dispatch.py [--quick] [--budget-s 20] [--case-budget-s 60] [--max-run-s S]
                                  [--sizes 1024,4096,16384] [--dtypes float32,bfloat16] [--out DIR]
                                  [--masks causal,window,...] [--modes forward,...] [--backends sdpa,tiled,...]
    make bench-dispatch

For each case (mask kind x n x dtype x mode; b = 1, h = 16, d = 64):

- **contestants**: each of multihead's backends that serves the call (named with ``backend=...``; the
  oracle ``reference`` only with ``--reference``; ``--backends`` times fewer, and the report says which were
  left out), ``auto``, and two peers: torch SDPA given the same mask
  as a dense tensor built before the timed calls (``is_causal=True`` for plain causal) and FlexAttention
  (``torch.compile(flex_attention, dynamic=True)``, compiled once per mask kind and dtype outside the timed
  region, its compile time reported apart; a ``create_block_mask`` BlockMask built per case outside the
  timed region; forward only: FlexAttention has no CPU backward).
- **timing**: one warm-up call each (compiles the flex kernels, ours and the peer's), then ``k`` rounds in
  which every contestant runs once, the order rotating each round (so load changes hit all alike); each
  time is the median of its k calls, with min and max. ``k`` is ``--repeats`` (5), fewer when a round is
  predicted to take more than ``--case-budget-s``.
- **what is reported**: auto's choice (``multihead.explain`` after the warm-up, so flex is warm), auto's
  time over the best of multihead's backends (auto / best), the measured winner among multihead's
  backends, the predicted winner (lowest estimate in ``explain(...).estimates``) and whether they agree,
  and each backend's measured / estimated time.
- **skips**: a contestant predicted (from the same series at the previous n scaled by n^2, else from its
  estimate) to take more than ``--budget-s`` for one call, or whose dense mask (torch SDPA's, prebuilt; our
  backends' that build one, by their estimates) would need more than half of RAM at its peak, is not run and
  is listed with the reason; a case whose auto call is predicted past the budget is skipped whole.
  ``--max-run-s`` stops starting cases after that many seconds (the rest listed as skipped).

Writes dispatch.json and dispatch.md (dispatch_quick.* with --quick) under benchmarks/results.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from harness import common

WINDOW = 256
HEADS = 16
HEAD_DIM = 64
BATCH = 1
PADDING_REAL = 0.7  # share of real keys in the padding case
MASKS = ("causal", "window", "alibi", "padding", "none")
MASK_LABELS = {
    "causal": "causal",
    "window": f"causal & window({WINDOW})",
    "alibi": "causal & alibi",
    "padding": f"padding ({PADDING_REAL:.0%} real)",
    "none": "none",
}
OWN = ("sdpa", "tiled", "flex", "materialized", "reference")  # multihead's backends, in the table's order
SDPA_PEER, FLEX_PEER = "torch sdpa", "torch flex"
PEERS = (SDPA_PEER, FLEX_PEER)
AUTO = "auto"
AUTO_SLACK = 1.10  # the issue's goal: auto within 10% of the best backend
DENSE_RAM_FRACTION = 0.5  # a dense mask bigger than this share of RAM is not built


@dataclass
class Config(common.BenchConfig):
    NAME = "dispatch"
    QUICK = {"sizes": (512, 1024), "dtypes": ("float32",), "repeats": 5, "case_budget_s": 8.0}

    quick: bool = False
    out_dir: Path | None = None
    sizes: tuple[int, ...] = (1024, 4096, 16384)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    modes: tuple[str, ...] = common.MODES
    masks: tuple[str, ...] = MASKS
    repeats: int = 5
    budget_s: float = 20.0
    case_budget_s: float = 60.0
    max_run_s: float | None = None
    reference: bool = False
    threads: int | None = None  # torch threads (None: torch's default)
    backends: tuple[str, ...] = field(default=OWN)
    # CPU kinds whose static tables also run auto in each case ("auto as <kind>": attention under a policy that
    # plans the CPU as that kind), timed in the same interleaved rounds, so one run compares the tables
    compare_kinds: tuple[str, ...] = ()


# --------------------------------------------------------------------------- pure parts (tested)


def series_key(record: dict, name: str) -> tuple:
    """The series a contestant's time belongs to across n."""
    return (record["mask"], record["dtype"], record["mode"], name)


def predict_seconds(n: int, previous: dict | None, estimate_s: float | None) -> tuple[float | None, str]:
    """One call's predicted seconds at ``n`` and where it came from: the same series' median at the previous
    n (``previous`` = {"n", "median_s"}) scaled by n^2, else auto's estimate, else unknown (None)."""
    if previous is not None and previous.get("median_s") is not None:
        return previous["median_s"] * (n / previous["n"]) ** 2, f"n={previous['n']} x (n/{previous['n']})^2"
    if previous is not None and previous.get("predicted_s") is not None:
        return previous["predicted_s"] * (n / previous["n"]) ** 2, f"n={previous['n']} prediction x n^2"
    if estimate_s is not None:
        return estimate_s, "estimate"
    return None, "unknown"


def skip_reason(predicted_s: float | None, dense_bytes: int, budget_s: float, ram: int | None) -> str | None:
    """Why a contestant is not run (each reason that applies), or None."""
    reasons = []
    if predicted_s is not None and predicted_s > budget_s:
        reasons.append(f"predicted {predicted_s:.3g} s > budget {budget_s:.3g} s")
    if ram is not None and dense_bytes > DENSE_RAM_FRACTION * ram:
        reasons.append(
            f"dense mask {dense_bytes / common.GIB:.1f} GiB > {DENSE_RAM_FRACTION:.0%} of {ram / common.GIB:.0f} GiB"
        )
    return "; ".join(reasons) or None


def repeats_for(round_s: float | None, case_budget_s: float, max_repeats: int) -> int:
    """Rounds to time: ``max_repeats``, fewer (at least 1) when a round of ``round_s`` would pass the case
    budget."""
    if round_s is None or round_s <= 0:
        return max_repeats
    return max(1, min(max_repeats, math.floor(case_budget_s / round_s)))


def rotation(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` rotated left by ``round_index``: each contestant runs first in turn."""
    if not names:
        return []
    shift = round_index % len(names)
    return list(names[shift:]) + list(names[:shift])


def spread(times: Sequence[float]) -> dict:
    """Median, min and max of the timed calls."""
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "repeats": len(times)}


def summarize(record: dict) -> dict:
    """Add what the report reads to a measured case: medians with spread, the measured winner among
    multihead's backends, auto / best, the predicted winner and whether it was right, and each backend's
    measured / estimated ratio. ``record`` holds "times" (name -> seconds per round), "chosen" and
    "estimates" (backend -> seconds)."""
    stats = {name: spread(times) for name, times in record["times"].items() if times}
    own = {name: s["median_s"] for name, s in stats.items() if name in OWN}
    everyone = {name: s["median_s"] for name, s in stats.items() if not name.startswith(AUTO)}
    winner = min(own, key=own.__getitem__) if own else None
    best_all = min(everyone, key=everyone.__getitem__) if everyone else None
    estimates = record.get("estimates") or {}
    predicted = min(estimates, key=estimates.__getitem__) if estimates else None
    auto_s = stats.get(AUTO, {}).get("median_s")
    ratios = {
        name: stats[name]["median_s"] / seconds
        for name, seconds in estimates.items()
        if name in stats and seconds and seconds > 0
    }
    tables = {name: s["median_s"] for name, s in stats.items() if name.startswith(AUTO)}  # auto, auto as <kind>
    record.update(
        tables_over_best={
            name: common.ratio(seconds, own.get(winner)) if winner else None for name, seconds in tables.items()
        },
        stats=stats,
        winner=winner,
        best_with_peers=best_all,
        auto_over_best=common.ratio(auto_s, own.get(winner)) if winner else None,
        auto_over_best_with_peers=common.ratio(auto_s, everyone.get(best_all)) if best_all else None,
        auto_picked_winner=None if winner is None else record.get("chosen") == winner,
        predicted=predicted,
        prediction_right=None if predicted is None or winner is None else predicted == winner,
        measured_over_estimated=ratios,
    )
    return record


def overall(records: Sequence[dict]) -> dict:
    """The run's verdicts: cases where auto picked / predicted the measured winner, the worst auto / best,
    whether auto stayed within 10% everywhere, and each backend's measured / estimated ratios."""
    measured = [r for r in records if r.get("status") == "ok" and r.get("winner") is not None]
    ratios = [r["auto_over_best"] for r in measured if r.get("auto_over_best") is not None]
    worst = max(measured, key=lambda r: r["auto_over_best"] or 0.0) if ratios else None
    per_backend: dict[str, list[float]] = {}
    for r in measured:
        for name, value in r["measured_over_estimated"].items():
            per_backend.setdefault(name, []).append(value)
    predicted = [r for r in measured if r.get("prediction_right") is not None]
    by_table: dict[str, list[float]] = {}
    for r in measured:
        for label, value in (r.get("tables_over_best") or {}).items():
            if value is not None:
                by_table.setdefault(label, []).append(value)
    return {
        "tables_over_best": {
            label: {
                "cases": len(values),
                "median": statistics.median(values),
                "worst": max(values),
                "within_10pct": sum(value <= AUTO_SLACK for value in values),
            }
            for label, values in by_table.items()
        },
        "cases": len(measured),
        "auto_picked_winner": sum(bool(r["auto_picked_winner"]) for r in measured),
        "predicted": len(predicted),
        "prediction_right": sum(bool(r["prediction_right"]) for r in predicted),
        "worst_auto_over_best": None if worst is None else worst["auto_over_best"],
        "worst_case": None if worst is None else case_label(worst),
        "within_10pct": None if not ratios else sum(value <= AUTO_SLACK for value in ratios),
        "goal_met": None if not ratios else all(value <= AUTO_SLACK for value in ratios),
        "measured_over_estimated": {
            name: {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "cases": len(values),
            }
            for name, values in sorted(per_backend.items())
        },
    }


HALF_SLACK = 1.0  # the issue's goal: auto in bfloat16 at least as fast as auto in float32 on the same case


def half_against_float32(records: Sequence[dict]) -> list[dict]:
    """For each mask x n x mode measured in both bfloat16 and float32: auto's median in each, auto's pick in
    each, and bfloat16 / float32 (the goal: <= 1). The two are separate cases, each interleaved with its own
    contestants, not with each other."""
    by_key = {
        (r["mask"], r["n"], r["mode"], r["dtype"]): r
        for r in records
        if r.get("status") == "ok" and AUTO in (r.get("stats") or {})
    }
    rows = []
    for (mask, n, mode, dtype), half in sorted(by_key.items(), key=lambda item: str(item[0])):
        single = by_key.get((mask, n, mode, "float32"))
        if dtype != "bfloat16" or single is None:
            continue
        half_s, single_s = half["stats"][AUTO]["median_s"], single["stats"][AUTO]["median_s"]
        rows.append(
            {
                "mask": mask,
                "n": n,
                "mode": mode,
                "bfloat16_ms": half_s * 1e3,
                "float32_ms": single_s * 1e3,
                "bfloat16_pick": half.get("chosen"),
                "float32_pick": single.get("chosen"),
                "ratio": half_s / single_s,
            }
        )
    return rows


def half_table(rows: Sequence[dict]) -> list[str]:
    lines = [
        "| mask | n | mode | auto bfloat16 ms | pick | auto float32 ms | pick | bfloat16 / float32 |",
        "|---|---:|---|---:|---|---:|---|---:|",
    ]
    for row in rows:
        ratio = f"{row['ratio']:.2f}" if row["ratio"] <= HALF_SLACK else f"**{row['ratio']:.2f}**"
        lines.append(
            f"| {MASK_LABELS.get(row['mask'], row['mask'])} | {row['n']} | {row['mode']} | {row['bfloat16_ms']:,.0f} "
            f"| {row['bfloat16_pick']} | {row['float32_ms']:,.0f} | {row['float32_pick']} | {ratio} |"
        )
    return lines


def case_label(record: dict) -> str:
    return f"{MASK_LABELS.get(record['mask'], record['mask'])}, n={record['n']}, {record['dtype']}, {record['mode']}"


def _ms(stats: dict | None) -> str:
    if stats is None:
        return "—"
    if stats["repeats"] == 1:
        return f"{stats['median_s'] * 1e3:,.0f} (k=1)"
    return f"{stats['median_s'] * 1e3:,.0f} ({stats['min_s'] * 1e3:,.0f}–{stats['max_s'] * 1e3:,.0f})"


def _yes_no(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "**no**")


def table_columns(records: Sequence[dict]) -> list[str]:
    """Contestant columns present in ``records``: multihead's backends in OWN order, then the peers."""
    seen = {name for r in records for name in (r.get("stats") or {})} | {
        name for r in records for name in (r.get("skipped") or {})
    }
    return [name for name in (*OWN, *PEERS) if name in seen]


def case_table(records: Sequence[dict]) -> list[str]:
    """Markdown rows for one dtype x mode: rows mask x n; each backend's and peer's median ms (min–max),
    auto's, auto's pick, auto / best, the predicted winner and whether it was the measured one."""
    columns = table_columns(records)
    header = ["mask", "n", *columns, "auto", "auto's pick", "measured winner", "auto / best", "predicted", "pred. ok"]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i < 1 else "---:" for i in range(len(header))) + "|",
    ]
    for r in records:
        label = MASK_LABELS.get(r["mask"], r["mask"])
        if r.get("status") != "ok":
            status = f"{r.get('status')}: {r.get('reason', '')}"
            cells = [label, str(r["n"]), *(["—"] * len(columns)), status, "", "", "", "", ""]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        stats, skipped = r["stats"], r.get("skipped") or {}
        cells = [label, str(r["n"])]
        for name in columns:
            if name in stats:
                cells.append(_ms(stats[name]))
            elif name in skipped:
                cells.append("skipped")
            else:
                cells.append("—")
        ratio = r.get("auto_over_best")
        ratio_text = common.fmt(ratio, ".2f")
        if ratio is not None and ratio > AUTO_SLACK:
            ratio_text = f"**{ratio_text}**"
        cells += [
            _ms(stats.get(AUTO)),
            str(r.get("chosen")),
            str(r.get("winner")),
            ratio_text,
            str(r.get("predicted")),
            _yes_no(r.get("prediction_right")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def estimate_table(records: Sequence[dict]) -> list[str]:
    """Per case, each estimated backend's measured / estimated time."""
    names = [name for name in OWN if any(name in (r.get("estimates") or {}) for r in records)]
    lines = ["| case | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in records:
        if r.get("status") != "ok":
            continue
        cells = []
        for name in names:
            est = (r.get("estimates") or {}).get(name)
            got = (r.get("stats") or {}).get(name)
            if est is None or got is None:
                cells.append("—")
            else:
                cells.append(f"{got['median_s'] * 1e3:,.0f} / {est * 1e3:,.0f} = {got['median_s'] / est:.2f}")
        lines.append(f"| {case_label(r)} | " + " | ".join(cells) + " |")
    return lines


def markdown_report(results: dict) -> str:
    config, records = results["config"], results["records"]
    verdict = results["overall"]
    lines = [
        f"# Does auto pick the fastest kernel? ({'quick' if config['quick'] else 'full'} run, benchmarks/dispatch.py)",
        "",
        f"Machine: {results['machine_line']}",
        "",
        f"Load (uptime) at start: `{results['load']['start']}`; at end: `{results['load']['end']}`. "
        f"Run time {results['elapsed_s']:.0f} s.",
        "",
        f"b = {BATCH}, h = {HEADS}, d = {HEAD_DIM}. Times in ms: median of k interleaved rounds (min–max); "
        "'auto / best' is auto's median over the fastest of multihead's backends (bold past 1.10); 'predicted' "
        "is the backend with the lowest estimate in `multihead.explain` (after the warm-up, so a compiled flex "
        "kernel is estimated too). `torch sdpa` is given the mask as a dense tensor built before the timed "
        "calls; `torch flex` is compiled FlexAttention with a BlockMask built before the timed calls.",
        "",
    ]
    left_out = [name for name in OWN[:-1] if name not in config.get("backends", OWN)]
    if left_out:  # --backends: 'best' is over the backends timed
        lines += [f"Not timed (`--backends`): {', '.join(left_out)}; 'best' is over the backends timed.", ""]
    for dtype in config["dtypes"]:
        for mode in config["modes"]:
            chunk = sorted(
                (r for r in records if r["dtype"] == dtype and r["mode"] == mode),
                key=lambda r: (MASKS.index(r["mask"]) if r["mask"] in MASKS else len(MASKS), r["n"]),
            )
            if not chunk:
                continue
            lines += [f"## {dtype}, {mode}", "", *case_table(chunk), ""]
    lines += [
        "## Verdict",
        "",
        f"- auto picked the measured winner in {verdict['auto_picked_winner']} of {verdict['cases']} measured cases.",
        f"- the predicted winner (lowest estimate) was the measured winner in {verdict['prediction_right']} of "
        f"{verdict['predicted']} cases.",
        f"- auto within 10% of the best backend: {verdict['within_10pct']} of {verdict['cases']} cases; worst "
        f"auto / best {common.fmt(verdict['worst_auto_over_best'], '.2f')} ({verdict['worst_case']}). Goal "
        f"(every row within 10%): **{common.VERDICTS[verdict['goal_met']]}**.",
        "",
        "Measured / estimated time per backend (median over cases, min–max):",
        "",
        "| backend | cases | median | min | max |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in verdict["measured_over_estimated"].items():
        lines.append(f"| {name} | {r['cases']} | {r['median']:.2f} | {r['min']:.2f} | {r['max']:.2f} |")
    if len(verdict.get("tables_over_best") or {}) > 1:
        lines += [
            "",
            "auto under each rate table against the fastest of multihead's backends, all timed in the same "
            "interleaved rounds ('auto' plans this machine as its own kind; 'auto as <kind>' as that kind, "
            "choosing both the backend and the precision it computes in by that kind's table):",
            "",
            "| auto | cases | median / best | worst | within 10% |",
            "|---|---:|---:|---:|---:|",
        ]
        for label, r in verdict["tables_over_best"].items():
            within = f"{r['within_10pct']} of {r['cases']}"
            lines.append(f"| {label} | {r['cases']} | {r['median']:.3f} | {r['worst']:.2f} | {within} |")
    half_rows = half_against_float32(records)
    if half_rows:
        at_least_as_fast = sum(row["ratio"] <= HALF_SLACK for row in half_rows)
        lines += [
            "",
            "## auto in bfloat16 against auto in float32 (goal: bfloat16 / float32 <= 1)",
            "",
            f"bfloat16 at least as fast in {at_least_as_fast} of {len(half_rows)} cases (bold: slower). The two "
            "medians come from separate cases, each interleaved with its own contestants.",
            "",
            *half_table(half_rows),
        ]
    lines += ["", "## Measured / estimated per case (ms / ms = ratio)", "", *estimate_table(records), ""]
    compiles = results.get("compile_s") or {}
    if compiles:
        lines += ["## Compile times (first call, outside the timed calls)", "", "| kernel | seconds |", "|---|---:|"]
        lines += [f"| {name} | {seconds:.1f} |" for name, seconds in compiles.items()]
        lines.append("")
    skipped = [(r, name, why) for r in records for name, why in (r.get("skipped") or {}).items()]
    skipped += [(r, "whole case", r.get("reason")) for r in records if r.get("status") in ("skipped", "error")]
    if skipped:
        lines += ["## Not run", "", "| case | contestant | reason |", "|---|---|---|"]
        lines += [f"| {case_label(r)} | {name} | {why} |" for r, name, why in skipped]
        lines.append("")
    diffs = [
        (r, name, d)
        for r in records
        for name, d in (r.get("max_abs_diff") or {}).items()
        if d is not None and d > (1e-3 if r["dtype"] == "float32" else 6e-2)
    ]
    if diffs:
        lines += ["## Outputs that differ from auto's (max |diff|)", ""]
        lines += [f"- {case_label(r)}: {name} {d:.3g}" for r, name, d in diffs]
        lines.append("")
    lines.append(
        "Reproduce: `make bench-dispatch` (`python benchmarks/dispatch.py`; `--quick` for n = 512, 1024, float32)."
    )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the calls


def mask_arguments(kind: str, n: int) -> dict:
    """multihead.attention's mask arguments for a mask kind at length n."""
    from multihead import masks

    if kind == "causal":
        return {"causal": True}
    if kind == "window":
        return {"mask": masks.causal() & masks.window(WINDOW)}
    if kind == "alibi":
        return {"causal": True, "mask": masks.alibi(masks.alibi_slopes(HEADS))}
    if kind == "padding":
        return {"mask": masks.padding(torch.tensor([padding_length(n)] * BATCH))}
    if kind == "none":
        return {}
    raise ValueError(f"mask kind {kind!r}: choose from {MASKS}")


def padding_length(n: int) -> int:
    return int(PADDING_REAL * n)


def dense_mask(kind: str, n: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask torch SDPA is given: bool (n, n) for window and padding, a (1, h, n, n) float bias with -inf
    above the diagonal for ALiBi; None for causal (is_causal=True) and none."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    if kind == "window":
        return (j <= i) & (i - j <= WINDOW)
    if kind == "padding":
        return (j < padding_length(n)).expand(n, n).contiguous()
    if kind == "alibi":
        from multihead import masks

        slopes = masks.alibi_slopes(HEADS).to(torch.float32)[:, None, None]  # (h, 1, 1)
        bias = (slopes * (j - i)).masked_fill(j > i, float("-inf"))  # (h, i, j)
        return bias[None].to(dtype)  # (1, h, i, j)
    return None


def dense_mask_bytes(kind: str, n: int) -> int:
    """The peak bytes of building :func:`dense_mask` for torch SDPA: an ALiBi bias is the float32 product and
    its copy with -inf above the diagonal (8 bytes an entry, whatever dtype it is then cast to)."""
    if kind in ("window", "padding"):
        return n * n
    if kind == "alibi":
        return HEADS * n * n * 8
    return 0


class FlexPeer:
    """torch.compile(flex_attention, dynamic=True) with one set of mods per mask kind, reused across n (so one
    compile per mask kind and dtype); the padding length is a tensor updated in place."""

    def __init__(self) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        from multihead import masks

        self.flex_attention = flex_attention
        self.compiled: dict[tuple[str, torch.dtype], Callable] = {}
        self.slopes = masks.alibi_slopes(HEADS).to(torch.float32)
        self.length = torch.tensor([0] * BATCH)
        self.mask_mods, self.score_mods = common.flex_peer_mods(self.slopes, self.length, WINDOW)

    def kernel(self, kind: str, dtype: torch.dtype) -> Callable:
        """torch.compile of a fresh copy of flex_attention per mask kind and dtype: dynamo's recompile limit (8)
        is per code object, and past it dynamo silently runs flex_attention unfused (eager, dense scores)."""
        key = (kind, dtype)
        if key not in self.compiled:
            self.compiled[key] = common.fresh_compiled(self.flex_attention, f"flex_peer_{len(self.compiled)}")
        return self.compiled[key]

    def prepare(self, kind: str, n: int, dtype: torch.dtype) -> tuple[Callable, float]:
        """The call for ``kind`` at ``n`` and the seconds its BlockMask took to build."""
        from torch.nn.attention.flex_attention import create_block_mask

        self.length.fill_(padding_length(n))
        mask_mod, score_mod = self.mask_mods[kind], self.score_mods.get(kind)
        t0 = time.perf_counter()
        block_mask = None if mask_mod is None else create_block_mask(mask_mod, BATCH, None, n, n, device="cpu")
        built = time.perf_counter() - t0

        kernel = self.kernel(kind, dtype)

        def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return kernel(q, k, v, score_mod=score_mod, block_mask=block_mask)

        return call, built


# --------------------------------------------------------------------------- measuring


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def lscpu_line() -> str:
    """The CPU as lscpu names it, with its vector/matrix flags."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return common.cpu_model() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    model = fields.get("Model name", "").strip() or "unknown CPU"
    flags = fields.get("Flags", "").split()
    wanted = [f for f in flags if f in ("avx", "avx2", "fma") or f.startswith(("avx512", "amx"))]
    cpus = fields.get("CPU(s)", "").strip()
    return f"{model} ({cpus} CPUs; {' '.join(wanted) or 'no AVX'})"


def machine_line() -> str:
    return (
        f"{lscpu_line()}, torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"{common.fmt((common.ram_bytes() or 0) / common.GIB, '.0f')} GiB RAM"
    )


def _inputs(n: int, dtype: torch.dtype, backward: bool) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    return common.random_inputs((BATCH, HEADS, n, HEAD_DIM), 3, dtype, seed=n, backward=backward)


def _probes(n: int, dtype: torch.dtype, backward: bool) -> list[torch.Tensor]:
    """Uninitialised q, k, v for explain (nothing is computed on them)."""
    return [torch.empty(BATCH, HEADS, n, HEAD_DIM, dtype=dtype).requires_grad_(backward) for _ in range(3)]


def contestants(
    kind: str,
    n: int,
    dtype: torch.dtype,
    backward: bool,
    names: Sequence[str],
    flex_peer: FlexPeer | None,
    compare_kinds: Sequence[str] = (),
) -> dict[str, Callable]:
    """name -> fn(q, k, v) -> output, for each contestant that serves the call (peers included), and auto planning
    the CPU as each of ``compare_kinds`` ("auto as <kind>")."""
    import multihead

    arguments = mask_arguments(kind, n)
    probe_q, probe_k, probe_v = _probes(n, dtype, backward)
    out: dict[str, Callable] = {}
    for name in names:
        if multihead.explain(probe_q, probe_k, probe_v, backend=name, **arguments).chosen is not None:
            out[name] = _bound_call(name, arguments)
    out[AUTO] = _bound_call(AUTO, arguments)
    for cpu_kind in compare_kinds:
        out[f"{AUTO} as {cpu_kind}"] = _bound_call(AUTO, arguments, cpu_kind)
    return out


def _bound_call(name: str, arguments: dict, cpu_kind: str | None = None) -> Callable:
    """attention with ``backend=name``; with ``cpu_kind``, under a policy that plans the CPU as that kind."""
    import multihead
    from multihead.backends import policy

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if cpu_kind is None:
            return multihead.attention(q, k, v, backend=name, **arguments)
        with policy.use_policy(policy.current_policy().assuming(policy.DeviceKind("cpu", cpu_kind))):
            return multihead.attention(q, k, v, backend=name, **arguments)

    return call


def sdpa_peer(kind: str, n: int, dtype: torch.dtype) -> Callable:
    mask = dense_mask(kind, n, dtype)
    causal = kind == "causal"

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    return call


def explain(
    kind: str, n: int, dtype: torch.dtype, backward: bool
) -> tuple[str | None, dict[str, float], dict[str, int]]:
    """auto's choice, each estimated backend's seconds and the bytes of the dense mask it would build (the sdpa
    backend builds ALiBi's (1, h, n, n) bias itself), for this case (meta tensors: nothing computed)."""
    import multihead

    q, k, v = _probes(n, dtype, backward)
    e = multihead.explain(q, k, v, **mask_arguments(kind, n))
    seconds = {name: est.seconds for name, est in e.estimates.items()}
    return e.chosen, seconds, {name: est.dense_mask_bytes for name, est in e.estimates.items()}


def run_case(
    config: Config, kind: str, n: int, dtype_name: str, mode: str, history: dict, flex_peer: FlexPeer | None, results
) -> dict:
    dtype, backward = common.DTYPES[dtype_name], mode == "forward+backward"
    record: dict = {"mask": kind, "n": n, "dtype": dtype_name, "mode": mode, "load_start": os.getloadavg()[0]}
    names = [name for name in config.backends if name != "reference" or config.reference]
    calls = contestants(kind, n, dtype, backward, names, flex_peer, config.compare_kinds)
    chosen_before, estimates_before, own_dense = explain(kind, n, dtype, backward)
    ram = common.ram_bytes()
    own_dense[AUTO] = own_dense.get(chosen_before or "", 0)
    predictions, skipped = {}, {}
    for name in [*calls, SDPA_PEER, *([FLEX_PEER] if not backward and flex_peer is not None else [])]:
        estimate = estimates_before.get(name)
        if name == AUTO:
            estimate = estimates_before.get(chosen_before or "")
        elif name == SDPA_PEER:
            estimate = estimates_before.get("sdpa")
        elif name == FLEX_PEER:
            estimate = estimates_before.get("flex")
        seconds, source = predict_seconds(n, history.get(series_key(record, name)), estimate)
        predictions[name] = {"seconds": seconds, "from": source}
        # ours build their dense mask at the size they keep (BoundMask.additive), which their estimates count
        dense = dense_mask_bytes(kind, n) if name == SDPA_PEER else own_dense.get(name, 0)
        reason = skip_reason(seconds, dense, config.budget_s, ram)
        failed = results["failed"].get((kind, dtype_name, mode, name))
        if failed is not None:
            reason = f"failed at a smaller n: {failed}"
        if reason is not None:
            skipped[name] = reason
    record.update(predictions=predictions, chosen_before_warmup=chosen_before, estimates_before=estimates_before)
    if AUTO in skipped:
        record.update(status="skipped", reason=f"auto ({chosen_before}) {skipped[AUTO]}", skipped=skipped)
        for name, p in predictions.items():
            history[series_key(record, name)] = {"n": n, "median_s": None, "predicted_s": p["seconds"]}
        return record
    if SDPA_PEER not in skipped:
        calls[SDPA_PEER] = sdpa_peer(kind, n, dtype)
    if not backward and flex_peer is not None and FLEX_PEER not in skipped:
        peer_call, built = flex_peer.prepare(kind, n, dtype)
        calls[FLEX_PEER] = peer_call
        record["flex_block_mask_s"] = built
    calls = {name: fn for name, fn in calls.items() if name not in skipped}
    (q, k, v), grad_out = _inputs(n, dtype, backward)

    def step(fn: Callable) -> torch.Tensor:
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v)
        if backward:
            out.backward(grad_out)
        return out.detach()

    # warm-up: one call each (compiles flex kernels: ours per cache key, the peer's per mask kind and dtype)
    warm, outputs = {}, {}
    for name, fn in calls.items():
        t0 = time.perf_counter()
        try:
            outputs[name] = step(fn)
        except (RuntimeError, ValueError, NotImplementedError, MemoryError) as error:
            skipped[name] = error_text(error)
            results["failed"][(kind, dtype_name, mode, name)] = skipped[name]
            continue
        warm[name] = time.perf_counter() - t0
        compile_key = {
            "flex": f"multihead flex ({kind}, {dtype_name})",
            FLEX_PEER: f"torch flex ({kind}, {dtype_name})",
        }
        if name in compile_key and compile_key[name] not in results["compile_s"]:
            results["compile_s"][compile_key[name]] = warm[name]
            warm[name] = None
    calls = {name: fn for name, fn in calls.items() if name in warm}
    if AUTO not in warm:
        record.update(status="error", reason=f"auto failed: {skipped.get(AUTO)}", skipped=skipped)
        return record
    reference_out = outputs.get(AUTO)
    record["max_abs_diff"] = {
        name: None if reference_out is None else (out.float() - reference_out.float()).abs().max().item()
        for name, out in outputs.items()
        if name != AUTO
    }
    outputs.clear()
    chosen, estimates, _ = explain(kind, n, dtype, backward)
    record.update(chosen=chosen, estimates=estimates)
    round_s = sum(s if s is not None else (predictions.get(name, {}).get("seconds") or 0.0) for name, s in warm.items())
    rounds = repeats_for(round_s, config.case_budget_s, config.repeats)
    order = list(calls)
    times: dict[str, list[float]] = {name: [] for name in order}
    for index in range(rounds):
        for name in rotation(order, index):
            t0 = time.perf_counter()
            step(calls[name])
            times[name].append(time.perf_counter() - t0)
    gc.collect()
    record.update(status="ok", times=times, skipped=skipped, rounds=rounds, load_end=os.getloadavg()[0])
    summarize(record)
    for name in predictions:
        s = record["stats"].get(name)
        history[series_key(record, name)] = {
            "n": n,
            "median_s": None if s is None else s["median_s"],
            "predicted_s": predictions[name]["seconds"],
        }
    return record


def error_text(error: BaseException) -> str:
    """A failure as one short table-safe line: its type and the first line of its message."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"error: {type(error).__name__}: {first[:120]}".replace("|", "/")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(config: Config) -> dict:
    common.prepare_allocator(say)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    started = time.perf_counter()
    results: dict = {
        "config": config.to_json(),
        "machine": common.machine_info({}),
        "machine_line": machine_line(),
        "load": {"start": uptime()},
        "compile_s": {},
        "failed": {},
        "records": [],
    }
    say(f"{results['machine_line']}\n{results['load']['start']}")
    flex_peer = FlexPeer()
    history: dict = {}
    for n in config.sizes:  # n outermost: each series' previous n is measured first; --max-run-s cuts the largest
        for dtype_name in config.dtypes:
            for mode in config.modes:
                for kind in config.masks:
                    record: dict
                    if config.max_run_s is not None and time.perf_counter() - started > config.max_run_s:
                        record = {"mask": kind, "n": n, "dtype": dtype_name, "mode": mode, "status": "skipped"}
                        record["reason"] = f"run time past --max-run-s {config.max_run_s:g}"
                    else:
                        record = run_case(config, kind, n, dtype_name, mode, history, flex_peer, results)
                    results["records"].append(record)
                    say(progress(record))
    results["load"]["end"] = uptime()
    results["elapsed_s"] = time.perf_counter() - started
    results["overall"] = overall(results["records"])
    results["failed"] = {" / ".join(key): why for key, why in results["failed"].items()}
    return results


def progress(record: dict) -> str:
    head = case_label(record)
    if record.get("status") != "ok":
        return f"{head}: skipped ({record.get('reason')})"
    times = ", ".join(f"{name} {s['median_s'] * 1e3:.0f}" for name, s in record["stats"].items())
    return (
        f"{head}: {times} ms (k={record['rounds']}); auto={record['chosen']} winner={record['winner']} "
        f"auto/best={common.fmt(record['auto_over_best'], '.2f')} predicted={record['predicted']}"
        f"; load {record['load_start']:.1f}->{record['load_end']:.1f}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = common.build_parser(
        __doc__,
        "n = 512, 1024, float32 only, forward and forward+backward (under ~3 minutes)",
        Config.budget_s,
        "1024,4096,16384",
    )
    parser.add_argument("--case-budget-s", type=float, help="fewer rounds when one would pass this (default 60)")
    parser.add_argument("--max-run-s", type=float, help="start no case after this many seconds")
    parser.add_argument("--repeats", type=int, help="rounds per case (default 5)")
    parser.add_argument("--masks", help=f"comma-separated mask kinds (default {','.join(MASKS)})")
    parser.add_argument("--modes", help="comma-separated: forward,forward+backward")
    parser.add_argument(
        "--backends",
        help=f"comma-separated multihead backends to time, from {','.join(OWN[:-1])} (default all; auto and the "
        "peers always run)",
    )
    parser.add_argument("--reference", action="store_true", help="also time the reference (oracle) backend")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument(
        "--compare-kinds",
        help="comma-separated CPU kinds (e.g. cpu-avx2): auto also runs planning the CPU as each ('auto as <kind>'), "
        "timed in the same rounds",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from multihead._errors import InputError
    from multihead._userfiles import output_folder

    args = build_parser().parse_args(argv)
    config = common.config_from_args(Config, args)
    for name in ("case_budget_s", "max_run_s", "repeats"):
        if getattr(args, name) is not None:
            setattr(config, name, getattr(args, name))
    try:  # checked before the re-execution below, which would only repeat a refusal
        if args.masks:
            config.masks = option_names("--masks", args.masks, MASKS)
        if args.modes:
            config.modes = option_names("--modes", args.modes, common.MODES)
        if args.backends:  # the oracle stays behind --reference
            config.backends = (*option_names("--backends", args.backends, OWN[:-1]), "reference")
        output_folder("--out", config.out_dir, create=False)
    except (InputError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    config.reference = args.reference
    config.threads = args.threads
    config.compare_kinds = tuple(name for name in (args.compare_kinds or "").split(",") if name)
    common.ensure_malloc_env()
    results = run(config)
    report = common.write_json_and_markdown(results, config.out_dir, config.stem, markdown_report)
    print(report, flush=True)
    print(f"wrote {config.out_dir / config.stem}.json, .md ({results['elapsed_s']:.0f} s)", flush=True)
    return 0


def option_names(option: str, text: str, allowed: Sequence[str]) -> tuple[str, ...]:
    """The names of a comma-separated option, each one of ``allowed``; a ValueError naming the option else."""
    names = tuple(name for name in text.split(",") if name)
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        what = f"unknown {unknown}" if unknown else "no name"
        raise ValueError(f"{option}: {what} in {text!r}; choose from {','.join(allowed)}")
    return names


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
