"""`multihead bench`: multihead against its peers on this machine, and the calibration auto may use."""

from __future__ import annotations

import argparse

from multihead._console import make_console
from multihead._figures import print_written  # "wrote <path>"; one line for a figure left out
from multihead._userfiles import output_folder
from multihead.cli._shared import (
    DTYPE_HELP,
    add_threads_option,
    parse_dtype,
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="time multihead against torch SDPA, torch.nn.MultiheadAttention and the textbook code, here",
        description="Time multihead (the attention function and the layer) against torch SDPA, "
        "torch.nn.MultiheadAttention and the textbook code on this machine, interleaved with "
        "torch.utils.benchmark; print each time with its spread, our time over each peer's, and the share "
        "of this machine's roofline bound reached; write bench.json (bench_quick.json with --quick; and a PNG "
        "beside it with matplotlib).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (n up to 1024) and 5 rounds: 3 minutes on a busy 2-core machine, calibration included "
        "(the full run adds n = 2048)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's matmul rate and bandwidth again (cached for `multihead cost`); alone, only that",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="cache a calibration even when its timed blocks stray by more than ±10%% (a busy machine), which is "
        "refused otherwise",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        help=DTYPE_HELP + "; default float32: the comparison's dtype and the one calibrated (repeatable)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default="multihead-bench",
        help="where bench.json and bench.png go (bench_quick.json and bench_quick.png with --quick; "
        "default %(default)s)",
    )
    add_threads_option(parser)  # the calibration is keyed on torch's threads: one per count
    parser.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from multihead._userfiles import writing
    from multihead.lab import bench
    from multihead.lab.bench_report import print_report
    from multihead.machine import calibrate, calibration_noise, calibration_path, identity, save_calibration

    console = make_console()
    dtypes = list(dict.fromkeys(parse_dtype(spec) for spec in args.dtype or ["float32"]))
    if args.calibrate and not args.quick:
        cache = calibration_path()
        fix = "set MULTIHEAD_CACHE to a folder you can write to"
        output_folder("MULTIHEAD_CACHE", cache.parent, fix=fix)
        with console.status("calibrating: matmul rate, bandwidth, and each backend's rate for auto"):
            # a noisy calibration is refused before the kernels' minute is spent (kept with --force)
            rates = calibrate(dtypes, kernels=True, refuse_noisy=not args.force)
        with writing("MULTIHEAD_CACHE", cache, fix=fix):
            path = save_calibration(rates, force=args.force)
        noise = calibration_noise(rates)
        kernel = rates.details.get("kernel_rates", {}).get("gflops", {})
        backends = ", ".join(
            f"{name} {by_key['forward float32']:.1f}" for name, by_key in kernel.items() if "forward float32" in by_key
        )
        console.print(
            f"calibrated {identity().describe()}: "
            + ", ".join(f"{k} matmul {v:.1f} GFLOP/s" for k, v in rates.matmul_gflops.items())
            + f", bandwidth {rates.bandwidth_gbs:.1f} GB/s"
            + (f" (kept with --force, though its timed blocks strayed: {noise})" if noise else "")
            + (f"; backends (float32 forward, GFLOP/s): {backends}" if backends else "")
            + f"; saved to {path}"
            + (
                "; auto uses these rates only where you opt in: "
                "multihead.backends.set_policy(multihead.machine.measured_policy())"
                if backends
                else ""
            ),
            soft_wrap=True,
        )
        return 0
    out_dir = output_folder("--out", args.out, create=False)  # before minutes of measuring, not after
    with console.status("starting") as status:
        results = bench.run(
            quick=args.quick,
            dtypes=dtypes,
            recalibrate=args.calibrate,
            force=args.force,
            say=lambda line: status.update(line),
        )
    with writing("--out", out_dir):
        written = bench.write_reports(results, out_dir)
    print_report(results, console)
    print_written(console, written)
    return 0
