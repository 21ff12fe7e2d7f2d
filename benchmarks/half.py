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
[min, max]; the goal is a median <= 1. auto's pick in each dtype comes from ``multihead.explain``.

A third call in the same rounds, "float32 + casts", is what a bf16 call costs computed in float32, the floor on a
CPU without bf16 matrix units (a call kept in bf16 beats it only where torch's bf16 kernel beats float32 plus the
casts): the bf16 inputs cast to float32, auto's float32 call, its output cast back to bf16 (and, with the backward,
the gradients cast both ways by autograd). bfloat16 / (float32 + casts) says how far auto's bf16 path is from that
floor. Writes half.json and half.md.
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
CAST_FLOOR = "float32 + casts"  # bf16 inputs -> float32, auto in float32, the output -> bf16
FLOOR_TOLERANCE = 1.05  # "at the floor": bfloat16 / (float32 + casts) at most this


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
    # the floor: on the bf16 leaves, through auto's float32 call
    q, k, v = (t.to(torch.bfloat16).requires_grad_(backward) for t in base)
    thunks[CAST_FLOOR] = _thunk(q, k, v, grad.to(torch.bfloat16), arguments, backward, through=torch.float32)
    picks[CAST_FLOOR] = picks["float32"]
    return thunks, picks


def _thunk(q, k, v, grad, arguments: dict, backward: bool, through: torch.dtype | None = None) -> Callable[[], object]:
    """A call of auto on q, k, v (and its backward); ``through``: cast there first, and the output back."""

    def attend() -> torch.Tensor:
        if through is None:
            return multihead.attention(q, k, v, **arguments)
        return multihead.attention(q.to(through), k.to(through), v.to(through), **arguments).to(q.dtype)

    def forward() -> object:
        with torch.no_grad():
            return attend()

    def forward_backward() -> object:
        for t in (q, k, v):
            t.grad = None
        out = attend()
        out.backward(grad)
        return out

    return forward_backward if backward else forward


def summarize(times: dict[str, list[float]]) -> dict:
    """Medians, bfloat16 / float32 per round and, when timed, bfloat16 / (float32 + casts) per round."""
    ratio = common.ratio_per_round(times["bfloat16"], times["float32"])
    summary = {
        "ms": {name: 1e3 * statistics.median(ts) for name, ts in times.items()},
        "ratio": ratio["median"],
        "ratio_min": ratio["min"],
        "ratio_max": ratio["max"],
        "rounds": ratio["rounds"],
        "times_ms": {name: [1e3 * t for t in ts] for name, ts in times.items()},
    }
    if CAST_FLOOR in times:
        floor = common.ratio_per_round(times["bfloat16"], times[CAST_FLOOR])
        summary |= {"floor_ratio": floor["median"], "floor_ratio_min": floor["min"], "floor_ratio_max": floor["max"]}
    return summary


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
                    f"ratio {record['ratio']:.2f} [{record['ratio_min']:.2f}, {record['ratio_max']:.2f}]; "
                    f"{CAST_FLOOR} {record['ms'][CAST_FLOOR]:8.1f} ms, bfloat16 / that {record['floor_ratio']:.2f}"
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
    at_floor = sum(c["floor_ratio"] <= FLOOR_TOLERANCE for c in cases)
    lines = [
        "# auto in bfloat16 against auto in float32 (benchmarks/half.py)",
        "",
        f"Machine: {results['machine']}, {results['torch_threads']} torch threads. Load at start: "
        f"`{results['load'][0]}`; at end: `{results['load'][1]}`.",
        "",
        f"b = {BATCH}, h = {HEADS}, d = {HEAD_DIM}; the same q, k, v in both dtypes, the calls in the same rounds. "
        f"bfloat16 / float32 per round, median [min, max]; the goal is <= 1. Met in {met} of {len(cases)} cases "
        f"(bold: not met). '{CAST_FLOOR}': the bf16 inputs cast to float32, auto's float32 call and the output cast "
        "back (autograd casts the gradients): a bf16 call's floor where float32 kernels are the fastest. "
        f"bfloat16 within {FLOOR_TOLERANCE - 1:.0%} of it in {at_floor} of {len(cases)} cases.",
        "",
        f"| mask | n | mode | auto bfloat16 ms | pick | auto float32 ms | pick | bfloat16 / float32 | {CAST_FLOOR} ms "
        f"| bfloat16 / ({CAST_FLOOR}) | rounds |",
        "|---|---:|---|---:|---|---:|---|---|---:|---|---:|",
    ]
    for c in cases:
        ratio = f"{c['ratio']:.2f} [{c['ratio_min']:.2f}, {c['ratio_max']:.2f}]"
        floor = f"{c['floor_ratio']:.2f} [{c['floor_ratio_min']:.2f}, {c['floor_ratio_max']:.2f}]"
        lines.append(
            f"| {MASK_LABELS[c['mask']]} | {c['n']} | {c['mode']} | {c['ms']['bfloat16']:,.1f} | "
            f"{c['picks']['bfloat16']} | {c['ms']['float32']:,.1f} | {c['picks']['float32']} | "
            f"{ratio if c['ratio'] <= 1.0 else f'**{ratio}**'} | {c['ms'][CAST_FLOOR]:,.1f} | {floor} | "
            f"{c['rounds']} |"
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
