"""Is ``backend="auto"`` in bfloat16 at least as fast as in float32? Both in the same rounds.

Usage:
    python benchmarks/half.py [--sizes 1024,4096] [--masks causal,window,alibi,padding,none] [--rounds 7]
                              [--out benchmarks/results]
    make bench-half

For each mask kind x n x mode (forward under no_grad; forward+backward) of benchmarks/dispatch.py's grid (b = 1,
h = 16, d = 64): ``multihead.attention(..., backend="auto")`` on the same q, k, v in float32 and in bfloat16. One
warm-up call each, after compiling the flex kernel the call could use in both dtypes (so auto may pick it, as in
dispatch.py); then ``--rounds`` rounds of the two calls, their order alternating
(harness.common.interleaved_rounds). The ratio bfloat16 / float32 is taken per round and reported as median
[min, max]; the goal is a median <= 1. auto's pick in each dtype comes from ``multihead.explain``. Writes half.json
and half.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from dispatch import BATCH, HEAD_DIM, HEADS, MASK_LABELS, MASKS, lscpu_line, mask_arguments, option_names, uptime
from harness import common

import multihead

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODES = ("forward", "forward+backward")


def calls(kind: str, n: int, backward: bool) -> tuple[dict[str, Callable[[], object]], dict[str, str | None]]:
    """dtype name -> a thunk running auto once (and its backward), and auto's pick per dtype."""
    arguments = mask_arguments(kind, n)
    generator = torch.Generator().manual_seed(n)
    base = [torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=generator) for _ in range(3)]
    grad = torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=generator)
    thunks, picks = {}, {}
    for name, dtype in DTYPES.items():
        q, k, v = (t.to(dtype).requires_grad_(backward) for t in base)
        if not backward:  # let auto see a warm flex kernel, as dispatch.py does
            try:
                with torch.no_grad():
                    multihead.attention(q, k, v, backend="flex", **arguments)
            except ValueError:
                pass  # flex does not serve this call (or its compiler failed): auto passes it over
        picks[name] = multihead.explain(q, k, v, **arguments).chosen
        thunks[name] = _thunk(q, k, v, grad.to(dtype), arguments, backward)
    return thunks, picks


def _thunk(q, k, v, grad, arguments: dict, backward: bool) -> Callable[[], object]:
    def forward() -> object:
        with torch.no_grad():
            return multihead.attention(q, k, v, **arguments)

    def forward_backward() -> object:
        for t in (q, k, v):
            t.grad = None
        out = multihead.attention(q, k, v, **arguments)
        out.backward(grad)
        return out

    return forward_backward if backward else forward


def summarize(times: dict[str, list[float]]) -> dict:
    ratio = common.ratio_per_round(times["bfloat16"], times["float32"])
    return {
        "ms": {name: 1e3 * statistics.median(ts) for name, ts in times.items()},
        "ratio": ratio["median"],
        "ratio_min": ratio["min"],
        "ratio_max": ratio["max"],
        "rounds": ratio["rounds"],
        "times_ms": {name: [1e3 * t for t in ts] for name, ts in times.items()},
    }


def run(sizes: Sequence[int], masks: Sequence[str], rounds: int, say: Callable[[str], None]) -> dict:
    start = uptime()
    cases = []
    for n in sizes:
        for kind in masks:
            for mode in MODES:
                thunks, picks = calls(kind, n, mode == "forward+backward")
                times = common.interleaved_rounds(thunks, rounds)
                record = {"mask": kind, "n": n, "mode": mode, "picks": picks, **summarize(times)}
                say(
                    f"{MASK_LABELS[kind]:22s} n={n:5d} {mode:16s} bfloat16 {record['ms']['bfloat16']:8.1f} ms "
                    f"({picks['bfloat16']})  float32 {record['ms']['float32']:8.1f} ms ({picks['float32']})  "
                    f"ratio {record['ratio']:.2f} [{record['ratio_min']:.2f}, {record['ratio_max']:.2f}]"
                )
                cases.append(record)
    return {
        "machine": lscpu_line(),
        "torch_threads": torch.get_num_threads(),
        "load": [start, uptime()],
        "cases": cases,
    }


def markdown(results: dict) -> str:
    cases = results["cases"]
    met = sum(c["ratio"] <= 1.0 for c in cases)
    lines = [
        "# auto in bfloat16 against auto in float32 (benchmarks/half.py)",
        "",
        f"Machine: {results['machine']}, {results['torch_threads']} torch threads. Load at start: "
        f"`{results['load'][0]}`; at end: `{results['load'][1]}`.",
        "",
        f"b = {BATCH}, h = {HEADS}, d = {HEAD_DIM}; the same q, k, v in both dtypes, the two calls in the same rounds. "
        f"bfloat16 / float32 per round, median [min, max]; the goal is <= 1. Met in {met} of {len(cases)} cases "
        "(bold: not met).",
        "",
        "| mask | n | mode | auto bfloat16 ms | pick | auto float32 ms | pick | bfloat16 / float32 | rounds |",
        "|---|---:|---|---:|---|---:|---|---|---:|",
    ]
    for c in cases:
        ratio = f"{c['ratio']:.2f} [{c['ratio_min']:.2f}, {c['ratio_max']:.2f}]"
        lines.append(
            f"| {MASK_LABELS[c['mask']]} | {c['n']} | {c['mode']} | {c['ms']['bfloat16']:,.1f} | "
            f"{c['picks']['bfloat16']} | {c['ms']['float32']:,.1f} | {c['picks']['float32']} | "
            f"{ratio if c['ratio'] <= 1.0 else f'**{ratio}**'} | {c['rounds']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=common.int_list, default=(1024, 4096))
    parser.add_argument("--masks", default=",".join(MASKS), help=f"comma-separated, from {','.join(MASKS)}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=common.default_out_dir())
    args = parser.parse_args(argv)
    try:
        masks = option_names("--masks", args.masks, MASKS)
    except ValueError as error:
        parser.error(str(error))
    if args.rounds < 1:
        parser.error(f"--rounds: expected >= 1, got {args.rounds}")
    results = run(args.sizes, masks, args.rounds, print)
    common.write_json_and_markdown(results, args.out, "half", markdown)
    print(f"wrote {args.out / 'half.json'} and half.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
