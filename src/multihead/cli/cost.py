"""`multihead cost`: what one call of an attention layer costs, exactly, and across ranks."""

from __future__ import annotations

import argparse
import sys

from multihead._console import make_console
from multihead._errors import bad_argument
from multihead._figures import skipped_note  # "wrote <path>"; one line for a figure left out
from multihead._userfiles import from_options, output_file
from multihead.cli._shared import (
    DTYPE_HELP,
    parse_dtype,
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "cost",
        help="parameters, FLOPs and bytes of an attention layer, exactly, and its roofline here",
        description="Count what one call of a multi-head attention layer costs: parameters, FLOPs by term, "
        "memory, the n x n crossover, and the roofline bound: on this machine's rates (after `multihead bench "
        "--calibrate`), or on the rates --gflops and --memory-gbs give.",
    )
    parser.add_argument("--embed-dim", type=int, required=True, help="D, the query feature size")
    parser.add_argument("--heads", type=int, required=True, help="h, the query heads")
    parser.add_argument("--seq", type=int, required=True, help="i, the query length (decode: new tokens)")
    parser.add_argument("--kv-seq", type=int, help="j, the key length for cross-attention (default: --seq)")
    parser.add_argument("--kv-heads", type=int, help="g, key/value heads (default: --heads)")
    parser.add_argument("--kdim", type=int, help="key input size (default: embed dim)")
    parser.add_argument("--vdim", type=int, help="value input size (default: embed dim)")
    parser.add_argument("--head-dim", type=int, help="d per head (default: embed dim / heads)")
    parser.add_argument("--value-head-dim", type=int, help="e per head (default: head dim)")
    parser.add_argument("--out-dim", type=int, help="output size (default: embed dim)")
    parser.add_argument("--no-bias", action="store_true", help="projections without biases")
    parser.add_argument("--batch", type=int, default=1, help="b (default 1)")
    parser.add_argument("--dtype", default="float32", help=DTYPE_HELP + " (default float32)")
    parser.add_argument("--causal", action="store_true", help="causal mask")
    parser.add_argument("--backward", action="store_true", help="a training step: forward and backward")
    parser.add_argument("--decode-cache", type=int, metavar="L", help="one decode step with L cached tokens")
    parser.add_argument("--need-weights", action="store_true", help="the (b, h, i, j) weights are returned")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--plot", metavar="FILE.png", help="draw FLOPs and memory against n")
    ranks = parser.add_argument_group("across ranks (multihead.parallel): per-rank FLOPs, memory and bytes sent")
    ranks.add_argument("--tp", type=int, default=1, metavar="P", help="split the heads over P ranks (shard_heads)")
    ranks.add_argument("--cp", type=int, default=1, metavar="P", help="split the sequence over P ranks")
    ranks.add_argument("--cp-method", choices=("ring", "ulysses"), default="ring", help="how --cp attends (ring)")
    ranks.add_argument(
        "--link-gbs", type=float, metavar="GB/S", help="bandwidth between ranks, per direction (NVLink 4: 450)"
    )
    ranks.add_argument(
        "--tp-link-gbs",
        type=float,
        metavar="GB/S",
        help="the --tp group's bandwidth when it differs (default: --link-gbs)",
    )
    rates = parser.add_argument_group(
        "the rates every time is priced at (the roofline, and the time per rank)",
    )
    rates.add_argument(
        "--gflops",
        type=float,
        metavar="GFLOP/S",
        help="the compute rate in GFLOP/s for --dtype work (default: this machine's calibration)",
    )
    rates.add_argument(
        "--memory-gbs",
        type=float,
        metavar="GB/S",
        help="the memory bandwidth in GB/s (default: this machine's calibration)",
    )
    parser.set_defaults(run=run_cost)


PLOT_SUFFIXES = (".png", ".pdf", ".svg")  # formats matplotlib writes everywhere, named by --plot's suffix


# multihead.cost's arguments as `multihead cost` spells them: its errors name the options the user typed.
COST_OPTIONS = {
    "embed_dim": "--embed-dim",
    "num_heads": "--heads",
    "num_kv_heads": "--kv-heads",
    "kdim": "--kdim",
    "vdim": "--vdim",
    "head_dim": "--head-dim",
    "value_head_dim": "--value-head-dim",
    "out_dim": "--out-dim",
    "seq": "--seq",
    "kv_seq": "--kv-seq",
    "batch": "--batch",
    "dtype": "--dtype",
    "cache_len": "--decode-cache",
    "tp": "--tp",
    "cp": "--cp",
}


def run_cost(args: argparse.Namespace) -> int:
    with from_options(COST_OPTIONS):
        return _run_cost(args)


def _run_cost(args: argparse.Namespace) -> int:
    import json

    from multihead._figures import Written, draw_figure
    from multihead.cost import LayerShape, estimate
    from multihead.cost_report import cost_json, parallel_json, plot_cost, print_cost, print_parallel

    args.dtype = parse_dtype(args.dtype)
    if args.backward and args.decode_cache is not None:
        raise bad_argument(
            "--decode-cache",
            "no --backward (a decode step is inference)",
            "both",
            "drop one of --backward and --decode-cache",
        )
    shape = LayerShape(
        args.embed_dim,
        args.heads,
        num_kv_heads=args.kv_heads,
        kdim=args.kdim,
        vdim=args.vdim,
        head_dim=args.head_dim,
        value_head_dim=args.value_head_dim,
        out_dim=args.out_dim,
        bias=not args.no_bias,
    )
    mode = "decode" if args.decode_cache is not None else "forward+backward" if args.backward else "forward"
    report = estimate(
        shape,
        seq=args.seq,
        kv_seq=args.kv_seq,
        batch=args.batch,
        causal=args.causal,
        dtype=args.dtype,
        mode=mode,
        cache_len=args.decode_cache,
        need_weights=args.need_weights,
    )
    plot_path = None
    if args.plot is not None:
        if args.kv_seq is not None or mode == "decode":
            raise bad_argument(
                "--plot",
                "a self-attention forward or training configuration",
                "cross-attention or decode",
                "drop --kv-seq / --decode-cache to plot against n",
            )
        plot_path = output_file("--plot", args.plot, suffixes=PLOT_SUFFIXES, fix="pass e.g. --plot cost.png")
    rates, source = _rates(args, report.dtype)
    split = _parallel_split(args, shape, mode, rates) if args.tp > 1 or args.cp > 1 else None
    if split is None and any(v is not None for v in (args.link_gbs, args.tp_link_gbs)):
        raise bad_argument(
            "--link-gbs",
            "--tp or --cp above 1 with --link-gbs and --tp-link-gbs (the bandwidth between ranks)",
            "one rank",
            "add e.g. --cp 8",
        )
    plotted = Written()  # the --plot figure; without matplotlib, left out and named in one line
    if plot_path is not None:
        draw_figure(
            plotted,
            "plot",
            plot_path,
            lambda path: plot_cost(
                shape,
                path,
                seq=args.seq,
                batch=args.batch,
                dtype=report.dtype,
                mode=mode,
                causal=args.causal,
                argument="--plot",
            ),
        )
    skipped = skipped_note(plotted.skipped.values())
    if args.json:
        data = cost_json(report, rates, rates_source=source)
        if split is not None:
            data["parallel"] = parallel_json(split[0], split[1])
        print(json.dumps(data, indent=1))
        if skipped is not None:
            print(skipped, file=sys.stderr)  # stdout stays the JSON
    else:
        console = make_console()
        print_cost(report, rates, console, rates_source=source)
        if split is not None:
            print_parallel(split[0], split[1], console, rates_source=source)
        if "plot" in plotted:
            console.print(f"plot: {plotted['plot'].resolve()}", soft_wrap=True)
        if skipped is not None:
            console.print(skipped, soft_wrap=True, markup=False, highlight=False)
    return 0


def _rates(args: argparse.Namespace, dtype: str):
    """(the rates every time `multihead cost` prints is priced at, where they come from), or (None, None): --gflops
    (for ``dtype`` work) and --memory-gbs where given, the rest from this machine's calibration. The one source of
    the roofline line, its JSON and the time per rank, so that all of them say the same."""
    from multihead.cost import MachineRates
    from multihead.machine import read_calibration

    for name, value in (("--gflops", args.gflops), ("--memory-gbs", args.memory_gbs)):
        if value is not None and not value > 0:
            raise bad_argument(name, "a positive rate", value, f"pass e.g. {name} 450")
    if args.gflops is not None and args.memory_gbs is not None:  # no calibration needed, none read
        return MachineRates({dtype: args.gflops}, args.memory_gbs, threads=0), "the rates given"
    calibrated, note = read_calibration()
    if note:  # a damaged cache is not the user's argument: say it was ignored, and go on without it
        print(f"multihead cost: note: {note}", file=sys.stderr)
    given, missing = ("--gflops", "--memory-gbs") if args.gflops is not None else ("--memory-gbs", "--gflops")
    if calibrated is None:
        if args.gflops is None and args.memory_gbs is None:
            return None, None
        raise bad_argument(
            missing,
            f"it beside {given} (this machine has no calibration to take it from)",
            f"{given} alone",
            f"pass {missing} too (e.g. --gflops 989000 --memory-gbs 3350 for an H100 in bfloat16), or run "
            "`multihead bench --calibrate`",
        )
    measured = f"measured {calibrated.measured_at}"
    if args.gflops is not None:
        return MachineRates({dtype: args.gflops}, calibrated.bandwidth_gbs, threads=0), f"--gflops given, {measured}"
    if args.memory_gbs is not None:
        rates = MachineRates(dict(calibrated.matmul_gflops), args.memory_gbs, threads=0)
        return rates, f"--memory-gbs given, {measured}"
    return calibrated, measured


def _parallel_split(args: argparse.Namespace, shape, mode: str, rates):
    """(ParallelCost, ParallelTime or None) for --tp/--cp; the time (with --link-gbs) is priced at ``rates``
    (:func:`_rates`: --gflops and --memory-gbs where given, else this machine's calibration)."""
    from multihead.cost_parallel import parallel_cost, parallel_time

    if args.decode_cache is not None or args.kv_seq is not None or args.need_weights:
        raise bad_argument(
            "--tp/--cp",
            "self-attention forward or training (the parallel layers serve no decode, cross-attention or weights)",
            "--decode-cache, --kv-seq or --need-weights",
            "drop those options, or --tp/--cp",
        )
    for name, value in (("--link-gbs", args.link_gbs), ("--tp-link-gbs", args.tp_link_gbs)):
        if value is not None and not value > 0:
            raise bad_argument(name, "a positive rate", value, f"pass e.g. {name} 450")
    cost = parallel_cost(
        shape,
        seq=args.seq,
        batch=args.batch,
        causal=args.causal,
        dtype=args.dtype,
        mode=mode,
        tp=args.tp,
        cp=args.cp,
        cp_method=args.cp_method,
    )
    if args.link_gbs is None:
        if args.tp_link_gbs is not None:
            raise bad_argument("--tp-link-gbs", "--link-gbs as well", "--tp-link-gbs alone", "add --link-gbs")
        return cost, None
    if rates is None:
        raise bad_argument(
            "--link-gbs",
            "a rank's compute rate and memory bandwidth: --gflops and --memory-gbs, or this machine's calibration",
            "neither",
            "pass --gflops and --memory-gbs (e.g. 989000 and 3350 for an H100 in bfloat16), or run "
            "`multihead bench --calibrate`",
        )
    return cost, parallel_time(cost, rates, args.link_gbs, tp_link_gbs=args.tp_link_gbs)
