"""``multihead bench``: the kernel and layer benchmarks in one run, side by side with the peers and the roofline.

Runs :mod:`multihead.bench.kernel` (our kernels against the textbook code and torch SDPA) and
:mod:`multihead.bench.layer` (our layer against the textbook module and torch.nn.MultiheadAttention)
as they are, writes their own reports, then one summary (``bench.json``, ``bench.md``,
``bench.png``; ``bench_quick.*`` for ``--quick``) with, for every case, the ratio of our time to each
peer's and the fraction of this machine's roofline bound our implementation reached:

    roofline fraction = lower-bound time / measured time     (1.0 would be the machine's limit)

The bound comes from :mod:`multihead.cost` (needed FLOPs at the calibrated matmul rate, or the
least traffic at the calibrated bandwidth, whichever is larger); the rates are measured by
``multihead bench --calibrate`` and cached (see :func:`multihead.cost.calibration_path`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from multihead._errors import InputError, bad_argument
from multihead._userfiles import (
    ANY_OBJECT,
    BOOLEAN,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    STRING,
    ListOf,
    OptionalKey,
    nullable,
    one_of,
    read_json,
    writing,
)
from multihead.cost import (
    DTYPES,
    LayerShape,
    MachineRates,
    attention_kernel_cost,
    bound,
    calibrate,
    estimate,
    read_calibration,
    save_calibration,
)

__all__ = [
    "run_suite",
    "summarize",
    "kernel_rows",
    "layer_rows",
    "markdown_summary",
    "plot_summary",
    "ensure_rates",
    "read_results",
]

KERNEL_OURS = ("auto", "tiled")
KERNEL_PEERS = ("textbook", "sdpa")
LAYER_OURS = ("multihead", "multihead_weights")
LAYER_PEERS = {
    "multihead": ("textbook", "torch_mha_noweights", "torch_mha_weights"),
    "multihead_weights": ("textbook", "torch_mha_weights"),
}
PEER_COLUMNS = {"kernel": KERNEL_PEERS, "layer": LAYER_PEERS["multihead"]}


def ensure_rates(
    dtypes: Sequence[str], *, recalibrate: bool = False, say: Callable[[str], None] = print
) -> MachineRates:
    """The cached machine rates, measured (and cached) first when missing, stale for a dtype, or asked for."""
    rates, note = (None, None) if recalibrate else read_calibration()
    if note:  # a damaged cache is measured again, not trusted
        say(note)
    if rates is None or any(dtype not in rates.matmul_gflops for dtype in dtypes):
        wanted = sorted(set(dtypes) | {"float32"} | (set(rates.matmul_gflops) if rates else set()))
        say(f"calibrating: matmul rate ({', '.join(wanted)}) and memory bandwidth ...")
        rates = calibrate(wanted)
        path = save_calibration(rates)
        say(f"calibration saved to {path}")
    return rates


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
    name: str, path: Path, *, argument: str = "path", fix: str = "run `multihead bench` again to write it"
) -> dict:
    """A benchmark's results file (``name`` "kernel" or "layer"), checked to have what the summary reads."""
    return read_json(
        argument,
        path,
        what=f"{name} benchmark results written by `multihead bench`",
        schema=RESULT_SCHEMAS[name],
        fix=fix,
    )


def _times(records: Sequence[dict], key_fields: Sequence[str]) -> dict[tuple, dict[str, float]]:
    """{case key: {impl: median seconds}} over the records measured ("ok")."""
    table: dict[tuple, dict[str, float]] = {}
    for record in records:
        if record.get("status") == "ok" and record.get("median_s"):
            key = tuple(record[field] for field in key_fields)
            table.setdefault(key, {})[record["impl"]] = record["median_s"]
    return table


def kernel_rows(results: dict, rates: MachineRates) -> list[dict]:
    """One row per kernel case: our implementations' times, ratios to each peer, roofline fraction."""
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
        for ours in KERNEL_OURS:
            if ours not in times:
                continue
            rows.append(
                {
                    "benchmark": "kernel",
                    "case": f"b{config['batch']} h{config['heads']} d{config['head_dim']} n{n}"
                    f"{' causal' if causal else ''}",
                    "dtype": dtype,
                    "mode": mode,
                    "impl": ours,
                    "seconds": times[ours],
                    "ratios": {peer: times[ours] / times[peer] for peer in KERNEL_PEERS if peer in times},
                    "bound_s": limit.bound_s if limit else None,
                    "bound_by": limit.bound_by if limit else None,
                    "roofline_fraction": limit.bound_s / times[ours] if limit else None,
                }
            )
    return rows


def layer_rows(results: dict, rates: MachineRates) -> list[dict]:
    """One row per layer case and our implementation: times, ratios to each peer, roofline fraction."""
    rows = []
    for (shape_name, n, dtype, mode), times in _times(results["cases"], ("shape", "n", "dtype", "mode")).items():
        sample = next(r for r in results["cases"] if r["shape"] == shape_name and r["n"] == n)
        shape = LayerShape(sample["embed_dim"], sample["heads"])
        for ours in LAYER_OURS:
            if ours not in times:
                continue
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
            rows.append(
                {
                    "benchmark": "layer",
                    "case": f"{shape_name} n{n}",
                    "dtype": dtype,
                    "mode": mode,
                    "impl": ours,
                    "seconds": times[ours],
                    "ratios": {peer: times[ours] / times[peer] for peer in LAYER_PEERS[ours] if peer in times},
                    "bound_s": limit.bound_s if limit else None,
                    "bound_by": limit.bound_by if limit else None,
                    "roofline_fraction": limit.bound_s / times[ours] if limit else None,
                }
            )
    return rows


PEER_NAMES = {
    "textbook": "textbook",
    "sdpa": "torch SDPA",
    "torch_mha_noweights": "torch MHA (no weights)",
    "torch_mha_weights": "torch MHA (weights)",
}


def markdown_summary(summary: dict) -> str:
    """The summary tables: our time, its ratio to every peer (below 1 = we are faster), roofline fraction."""
    rates = summary["rates"]
    lines = [
        f"# multihead bench{' (quick)' if summary['quick'] else ''}",
        "",
        f"Machine: {summary['machine'].get('processor') or 'CPU'}, {rates['threads']} threads; calibrated "
        f"matmul {', '.join(f'{k} {v:.1f} GFLOP/s' for k, v in rates['matmul_gflops'].items())}, "
        f"bandwidth {rates['bandwidth_gbs']:.1f} GB/s ({rates['measured_at']}).",
        "Ratios are our time / the peer's time (below 1: we are faster). Roofline fraction is the lower "
        "bound from multihead.cost over our measured time (1.0 is the machine's limit).",
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
            + " | bound (ms) | bound by | roofline fraction |",
            "|---|---|---|---|---:|" + "---:|" * len(peers) + "---:|---|---:|",
        ]
        for row in rows:
            ratios = [f"{row['ratios'][p]:.2f}" if p in row["ratios"] else "" for p in peers]
            bound_ms = f"{row['bound_s'] * 1e3:.3f}" if row["bound_s"] is not None else ""
            fraction = f"{row['roofline_fraction']:.2f}" if row["roofline_fraction"] is not None else ""
            lines.append(
                f"| {row['case']} | {row['dtype']} | {row['mode']} | {row['impl']} | "
                f"{row['seconds'] * 1e3:.3f} | "
                + " | ".join(ratios)
                + f" | {bound_ms} | {row['bound_by'] or ''} | {fraction} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot_summary(summary: dict, path: Path) -> Path:
    """Roofline fraction of every case (bars), kernel and layer side by side."""
    from multihead.bench.common import pyplot

    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(13, 5))
    for axis, benchmark in zip(axes, ("kernel", "layer")):
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
        axis.set(xlabel="fraction of the roofline bound reached (1 = machine limit)", title=benchmark)
    figure.suptitle(
        "multihead bench: how close each case gets to this machine's roofline "
        "(blue: forward, orange: forward+backward)",
        fontsize=10,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def run_suite(
    *,
    quick: bool,
    out_dir: Path,
    benchmarks: Sequence[str] = ("kernel", "layer"),
    recalibrate: bool = False,
    progress: Callable[[str], None] = print,
    configs: dict | None = None,
) -> dict:
    """Run the chosen benchmarks, write their reports and the summary into ``out_dir``; return the summary.

    ``configs``: {"kernel": kernel.Config, "layer": layer.Config} to run instead of the full (or, with
    ``quick``, the quick) configurations.
    """
    from multihead.bench import kernel, layer

    modules = {"kernel": kernel, "layer": layer}
    configs = configs or {
        name: (modules[name].Config.quick_config(out_dir=out_dir) if quick else modules[name].Config(out_dir=out_dir))
        for name in benchmarks
    }
    benchmarks = list(configs)
    dtypes = sorted({dtype for config in configs.values() for dtype in config.dtypes})
    rates = ensure_rates(dtypes, recalibrate=recalibrate, say=progress)
    started = time.time()
    results = {}
    for name in benchmarks:
        progress(f"{name} benchmark")
        results[name] = modules[name].run(configs[name], progress=progress)
        modules[name].write_reports(results[name], out_dir, stem=configs[name].stem)
    return summarize(
        results,
        rates,
        out_dir=out_dir,
        quick=quick,
        elapsed_s=time.time() - started,
        reports={name: f"{configs[name].stem}.md" for name in benchmarks},
    )


def summarize(
    results: dict[str, dict],
    rates: MachineRates,
    *,
    out_dir: Path,
    quick: bool,
    elapsed_s: float | None = None,
    reports: dict[str, str] | None = None,
    argument: str | None = None,
) -> dict:
    """Score benchmark results ({"kernel": ..., "layer": ...}) against ``rates``; write bench[_quick].json/md/png.

    ``argument``: the option the results were read from (``--out`` for ``bench --rescore``): a case
    whose sizes multihead.cost refuses, or a failed write, is then an error naming it.
    """
    rows = []
    for name, result in results.items():
        try:
            rows += (kernel_rows if name == "kernel" else layer_rows)(result, rates)
        except InputError as error:
            if argument is None:  # results we measured ourselves: a refusal is our bug
                raise
            raise bad_argument(
                argument,
                f"{name} benchmark results multihead can score",
                f"a case it cannot ({error})",
                "run `multihead bench` again to rewrite them",
            ) from None
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
