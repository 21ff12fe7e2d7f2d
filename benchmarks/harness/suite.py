"""The full kernel and layer benchmarks in one run, then every case scored against this machine's roofline.

Runs :mod:`harness.kernel` (our kernels against the textbook code and torch SDPA) and :mod:`harness.layer`
(our layer against the textbook module and torch.nn.MultiheadAttention) as they are, writes their own
reports, then one summary (``bench.json``, ``bench.md``, ``bench.png``; ``bench_quick.*`` for ``--quick``)
with, for every case, the ratio of our time to each peer's and the share of this machine's roofline
bound our implementation reached:

    roofline share = lower-bound time / measured time     (1.0 would be the machine's limit)

The bound comes from :mod:`multihead.cost` (needed FLOPs at the calibrated matmul rate, or the least
traffic at the calibrated bandwidth, whichever is larger); the rates are :mod:`multihead.machine`'s
cached calibration (measured when missing, another machine's or old). A share above 1 means the
calibration underestimates the machine: it is measured again once, and a share still above 1 is
withheld, as ``multihead bench`` does.

    python benchmarks/suite.py [--quick] [--only kernel|layer] [--out DIR]
    python benchmarks/suite.py --rescore [--quick] [--only kernel|layer] [--out DIR]   # score results on disk
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from harness import common
from multihead._errors import InputError, bad_argument
from multihead._userfiles import (
    ANY_OBJECT,
    BOOLEAN,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    STRING,
    ListOf,
    OptionalKey,
    existing_folder,
    nullable,
    one_of,
    output_folder,
    path_kind,
    read_json,
    writing,
)
from multihead.cost import DTYPES, LayerShape, MachineRates, Roofline, attention_kernel_cost, bound, estimate
from multihead.machine import cached_rates

KERNEL_OURS = ("auto", "tiled")
KERNEL_PEERS = ("textbook", "sdpa")
LAYER_OURS = ("multihead", "multihead_weights")
LAYER_PEERS = {
    "multihead": ("textbook", "torch_mha_noweights", "torch_mha_weights"),
    "multihead_weights": ("textbook", "torch_mha_weights"),
}
PEER_COLUMNS = {"kernel": KERNEL_PEERS, "layer": LAYER_PEERS["multihead"]}
NAMES = ("kernel", "layer")

# What kernel_rows / layer_rows / summarize read from a benchmark's <name>.json (other fields are ignored).
_CASE = {
    "impl": STRING,
    "n": POSITIVE_INT,
    "dtype": one_of(*DTYPES),
    "mode": one_of("forward", "forward+backward"),
    "status": STRING,
    "median_s": OptionalKey(nullable(POSITIVE_NUMBER)),
}
RESULT_SCHEMAS = {
    "kernel": {
        "machine": ANY_OBJECT,
        "cases": ListOf({**_CASE, "causal": BOOLEAN}),
        "config": {"batch": POSITIVE_INT, "heads": POSITIVE_INT, "head_dim": POSITIVE_INT},
    },
    "layer": {
        "machine": ANY_OBJECT,
        "cases": ListOf(
            {
                **_CASE,
                "shape": STRING,
                "batch": POSITIVE_INT,
                "causal": BOOLEAN,
                "embed_dim": POSITIVE_INT,
                "heads": POSITIVE_INT,
            }
        ),
    },
}


def read_results(
    name: str, path: Path, *, argument: str = "path", fix: str = "run benchmarks/suite.py again to write it"
) -> dict:
    """A benchmark's results file (``name`` "kernel" or "layer"), checked to have what the summary reads."""
    return read_json(
        argument, path, what=f"{name} benchmark results written by the harness", schema=RESULT_SCHEMAS[name], fix=fix
    )


# --------------------------------------------------------------------------- rows


def _times(records: Sequence[dict], key_fields: Sequence[str]) -> dict[tuple, dict[str, float]]:
    """{case key: {impl: median seconds}} over the records measured ("ok")."""
    table: dict[tuple, dict[str, float]] = {}
    for record in records:
        if record.get("status") == "ok" and record.get("median_s"):
            key = tuple(record[field] for field in key_fields)
            table.setdefault(key, {})[record["impl"]] = record["median_s"]
    return table


def _row(
    benchmark: str,
    case: str,
    dtype: str,
    mode: str,
    ours: str,
    times: dict[str, float],
    peers: Sequence[str],
    limit: Roofline | None,
) -> dict:
    """One summary row: our time, its ratio to each peer measured, the bound and the roofline share."""
    return {
        "benchmark": benchmark,
        "case": case,
        "dtype": dtype,
        "mode": mode,
        "impl": ours,
        "seconds": times[ours],
        "ratios": {peer: times[ours] / times[peer] for peer in peers if peer in times},
        "bound_s": limit.bound_s if limit else None,
        "bound_by": limit.bound_by if limit else None,
        "roofline_fraction": limit.bound_s / times[ours] if limit else None,
    }


def kernel_rows(results: dict, rates: MachineRates) -> list[dict]:
    """One row per kernel case: our implementations' times, ratios to each peer, roofline share."""
    config = results["config"]
    rows = []
    for (n, causal, dtype, mode), times in _times(results["cases"], ("n", "causal", "dtype", "mode")).items():
        flops, traffic = attention_kernel_cost(
            batch=config["batch"],
            heads=config["heads"],
            q_len=n,
            k_len=n,
            head_dim=config["head_dim"],
            causal=causal,
            dtype=dtype,
            mode=mode,
        )
        limit = bound(flops, traffic, dtype, rates) if dtype in rates.matmul_gflops else None
        case = f"b{config['batch']} h{config['heads']} d{config['head_dim']} n{n}{' causal' if causal else ''}"
        rows += [
            _row("kernel", case, dtype, mode, ours, times, KERNEL_PEERS, limit) for ours in KERNEL_OURS if ours in times
        ]
    return rows


def layer_rows(results: dict, rates: MachineRates) -> list[dict]:
    """One row per layer case and our implementation: times, ratios to each peer, roofline share."""
    rows = []
    for (shape_name, n, dtype, mode), times in _times(results["cases"], ("shape", "n", "dtype", "mode")).items():
        sample = next(r for r in results["cases"] if r["shape"] == shape_name and r["n"] == n)
        shape = LayerShape(sample["embed_dim"], sample["heads"])
        for ours in (ours for ours in LAYER_OURS if ours in times):
            report = estimate(
                shape,
                seq=n,
                batch=sample["batch"],
                causal=sample["causal"],
                dtype=dtype,
                mode=mode,
                need_weights=ours == "multihead_weights",
            )
            limit = (
                bound(report.needed_flops, report.bytes.traffic, dtype, rates) if dtype in rates.matmul_gflops else None
            )
            rows.append(_row("layer", f"{shape_name} n{n}", dtype, mode, ours, times, LAYER_PEERS[ours], limit))
    return rows


def score(results: dict[str, dict], rates: MachineRates, argument: str | None = None) -> list[dict]:
    """The rows of every benchmark's results. ``argument``: the option the results were read from; a case whose
    sizes multihead.cost refuses is then an error naming it (results we measured ourselves: a bug, raised)."""
    rows = []
    for name, result in results.items():
        try:
            rows += (kernel_rows if name == "kernel" else layer_rows)(result, rates)
        except InputError as error:
            if argument is None:
                raise
            raise bad_argument(
                argument,
                f"{name} benchmark results multihead can score",
                f"a case it cannot ({error})",
                "run benchmarks/suite.py again to rewrite them",
            ) from None
    return rows


def withhold_impossible(rows: list[dict]) -> int:
    """Set every roofline share above 1 to None (marking it "fraction_withheld"); how many were."""
    withheld = 0
    for row in rows:
        if row["roofline_fraction"] is not None and row["roofline_fraction"] > 1:
            row["roofline_fraction"], row["fraction_withheld"] = None, True
            withheld += 1
    return withheld


# --------------------------------------------------------------------------- the summary

PEER_NAMES = {
    "textbook": "textbook",
    "sdpa": "torch SDPA",
    "torch_mha_noweights": "torch MHA (no weights)",
    "torch_mha_weights": "torch MHA (weights)",
}


def markdown_summary(summary: dict) -> str:
    """The summary tables: our time, its ratio to every peer (below 1 = we are faster), roofline share."""
    rates = summary["rates"]
    lines = [
        f"# multihead benchmark suite{' (quick)' if summary['quick'] else ''}",
        "",
        f"Machine: {summary['machine'].get('processor') or 'CPU'}, {rates['threads']} threads; calibrated "
        f"matmul {', '.join(f'{k} {v:.1f} GFLOP/s' for k, v in rates['matmul_gflops'].items())}, "
        f"bandwidth {rates['bandwidth_gbs']:.1f} GB/s ({rates['measured_at']}).",
        "Ratios are our time / the peer's time (below 1: we are faster). Roofline share is the lower "
        "bound from multihead.cost over our measured time (1.0 is the machine's limit; a share above 1 would "
        "mean the calibration is wrong and is withheld).",
        *summary["notes"],
        "",
    ]
    for benchmark, peers in PEER_COLUMNS.items():
        rows = [row for row in summary["rows"] if row["benchmark"] == benchmark]
        if not rows:
            continue
        lines += [
            f"## {benchmark}",
            "",
            "| case | dtype | mode | ours | time (ms) | "
            + " | ".join(f"vs {PEER_NAMES[p]}" for p in peers)
            + " | bound (ms) | bound by | roofline share |",
            "|---|---|---|---|---:|" + "---:|" * len(peers) + "---:|---|---:|",
        ]
        for row in rows:
            ratios = [f"{row['ratios'][p]:.2f}" if p in row["ratios"] else "" for p in peers]
            bound_ms = f"{row['bound_s'] * 1e3:.3f}" if row["bound_s"] is not None else ""
            fraction = common.fmt(row["roofline_fraction"], ".2f") if row["bound_s"] is not None else ""
            fraction = "withheld" if row.get("fraction_withheld") else fraction
            lines.append(
                f"| {row['case']} | {row['dtype']} | {row['mode']} | {row['impl']} | "
                f"{row['seconds'] * 1e3:.3f} | "
                + " | ".join(ratios)
                + f" | {bound_ms} | {row['bound_by'] or ''} | {fraction} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot_summary(summary: dict, path: Path) -> Path:
    """Roofline share of every case (bars), kernel and layer side by side."""
    from multihead._figures import pyplot, save_figure

    plt = pyplot("the suite's PNG")
    figure, axes = plt.subplots(1, 2, figsize=(13, 5))
    for axis, benchmark in zip(axes, NAMES, strict=True):
        rows = [row for row in summary["rows"] if row["benchmark"] == benchmark and row["roofline_fraction"]]
        labels = [f"{r['case']} {r['mode'].replace('forward+backward', 'fwd+bwd')} {r['impl']}" for r in rows]
        axis.barh(
            range(len(rows)),
            [r["roofline_fraction"] for r in rows],
            color=["tab:blue" if r["mode"] == "forward" else "tab:orange" for r in rows],
        )
        axis.set_yticks(range(len(rows)), labels, fontsize=6)
        axis.invert_yaxis()
        axis.axvline(1.0, color="k", linewidth=0.8)
        axis.set(xlabel="share of the roofline bound reached (1 = machine limit)", title=benchmark)
    figure.suptitle(
        "multihead benchmarks: how close each case gets to this machine's roofline "
        "(blue: forward, orange: forward+backward)",
        fontsize=10,
    )
    return save_figure(figure, path)


def summarize(
    results: dict[str, dict],
    dtypes: Sequence[str],
    *,
    out_dir: Path,
    quick: bool,
    elapsed_s: float | None = None,
    reports: dict[str, str] | None = None,
    argument: str | None = None,
    say: Callable[[str], None] = print,
) -> dict:
    """Score benchmark results ({"kernel": ..., "layer": ...}) against the calibration (measured again once when a
    share comes out above 1); write bench[_quick].json/md/png. ``argument``: see :func:`score`."""
    rates, measured_now = cached_rates(dtypes, say=say)
    rows = score(results, rates, argument)
    notes = []
    if not measured_now and any((row["roofline_fraction"] or 0) > 1 for row in rows):
        notes.append(f"A measured time was below the bound of the calibration of {rates.measured_at}: measured again.")
        say(notes[-1])
        rates, _ = cached_rates(dtypes, recalibrate=True, say=say)
        rows = score(results, rates, argument)
    withheld = withhold_impossible(rows)
    if withheld:
        notes.append(
            f"{withheld} roofline share(s) withheld: faster than the calibration's bound, which therefore "
            "underestimates this machine (run `multihead bench --calibrate` when it is quiet)."
        )
    summary = {
        "quick": quick,
        "elapsed_s": elapsed_s,
        "rates": {
            "matmul_gflops": rates.matmul_gflops,
            "bandwidth_gbs": rates.bandwidth_gbs,
            "threads": rates.threads,
            "measured_at": rates.measured_at,
        },
        "machine": next(iter(results.values()))["machine"],
        "rows": rows,
        "notes": notes,
        "reports": reports or {},
    }
    stem = "bench_quick" if quick else "bench"
    with writing(argument or "out_dir", out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{stem}.json").write_text(json.dumps(summary, indent=1))
        (out_dir / f"{stem}.md").write_text(markdown_summary(summary))
        plot_summary(summary, out_dir / f"{stem}.png")
    summary["files"] = [str(out_dir / f"{stem}.{ext}") for ext in ("json", "md", "png")]
    return summary


# --------------------------------------------------------------------------- running, rescoring


def run_suite(
    *,
    quick: bool,
    out_dir: Path,
    benchmarks: Sequence[str] = NAMES,
    progress: Callable[[str], None] = print,
    configs: dict | None = None,
) -> dict:
    """Run the chosen benchmarks, write their reports and the summary into ``out_dir``; return the summary.

    ``configs``: {"kernel": kernel.Config, "layer": layer.Config} to run instead of the full (or, with
    ``quick``, the quick) configurations.
    """
    from harness import kernel, layer

    modules = {"kernel": kernel, "layer": layer}
    configs = configs or {
        name: (modules[name].Config.quick_config(out_dir=out_dir) if quick else modules[name].Config(out_dir=out_dir))
        for name in benchmarks
    }
    dtypes = sorted({dtype for config in configs.values() for dtype in config.dtypes})
    cached_rates(dtypes, say=progress)  # before the benchmarks: a calibration measured now is of a quiet machine
    started = time.time()
    results = {}
    for name, config in configs.items():
        progress(f"{name} benchmark")
        results[name] = modules[name].run(config, progress=progress)
        modules[name].write_reports(results[name], out_dir, stem=config.stem)
    return summarize(
        results,
        dtypes,
        out_dir=out_dir,
        quick=quick,
        elapsed_s=time.time() - started,
        reports={name: f"{configs[name].stem}.md" for name in configs},
        say=progress,
    )


def rescore(out_dir: Path, *, quick: bool, names: Sequence[str], say: Callable[[str], None] = print) -> dict:
    """The summary of results already in ``out_dir`` (kernel[_quick].json, layer[_quick].json), against the
    calibration; InputError naming --out when they are missing or not what the harness writes."""
    stem = "_quick" if quick else ""
    rerun = f"run benchmarks/suite.py{' --quick' if quick else ''} first, or point --out at the results"
    out_dir = existing_folder("--out", out_dir, what="a folder of benchmark results", fix=rerun)
    results = {}
    for name in names:
        path = out_dir / f"{name}{stem}.json"
        if path_kind(path) != "file":
            raise bad_argument("--out", f"a folder with {name}{stem}.json", f"{str(out_dir)!r} without it", rerun)
        results[name] = read_results(name, path, argument="--out", fix=rerun)
    output_folder("--out", out_dir, create=False)  # the summary is written beside the results
    dtypes = sorted({r["dtype"] for result in results.values() for r in result["cases"]})
    reports = {name: f"{name}{stem}.md" for name in names}
    return summarize(results, dtypes, out_dir=out_dir, quick=quick, reports=reports, argument="--out", say=say)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="suite.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the quick configurations (about 3 min on 2 cores)")
    parser.add_argument("--only", choices=NAMES, help="one of the two benchmarks")
    parser.add_argument("--rescore", action="store_true", help="run nothing: score the results already in --out")
    parser.add_argument("--out", type=Path, default=common.RESULTS, help="output folder (default benchmarks/results)")
    return parser


def main(argv: Sequence[str] | None = None, *, reexec: bool = True) -> int:
    """Run (or with --rescore, score) the benchmarks; print the summary. A mistake in the options is one line."""
    args = build_parser().parse_args(argv)
    names = [args.only] if args.only else list(NAMES)
    try:
        if args.rescore:
            summary = rescore(args.out, quick=args.quick, names=names)
        else:
            output_folder("--out", args.out, create=False)  # before minutes of measuring, not after
            if reexec:
                common.ensure_malloc_env()
            summary = run_suite(quick=args.quick, out_dir=args.out, benchmarks=names)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(markdown_summary(summary), flush=True)
    print("wrote " + ", ".join(summary["files"]), flush=True)
    return 0
