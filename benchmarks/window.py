"""A sliding window at 8k: multihead against torch's SDPA given the dense mask, and against warmed FlexAttention.

One call of causal & window(256) (each query sees itself and the 255 keys before it) at n = 8,192: 8 query heads over
2 key/value heads, d = 64, batch 1, float32. Ways:

    auto          multihead.attention(mask=masks.causal() & masks.window(256, 0)), named with what it chose
    tiled         multihead's online-softmax block loop (auto's choice before the spans backend, issue 49)
    torch sdpa    torch.nn.functional.scaled_dot_product_attention with the (n, n) bool mask built once outside the
                  timed calls (the peer; enable_gqa): it computes every pair of the grid
    flex          FlexAttention compiled for the window's BlockMask (multihead's flex backend, warmed before timing;
                  forward only: torch 2.13's FlexAttention has no CPU backward)

Forward, and forward + backward (the gradient of the output's sum), interleaved (multihead.lab.bench.interleave:
rounds of one block each, the order rotating); times are medians over rounds, ratios the median of per-round ratios
with the lowest and highest. Each way's output is checked against the float64 reference (tiled in float64, O(n)
memory) before it is timed.

    python benchmarks/window.py [--quick]      # writes benchmarks/results/window.{json,md}
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from harness.common import ensure_malloc_env, prepare_allocator, save_results
from hf_capture import load_average, machine, machine_line, ratio_text, ratios_of, source_state

import multihead
from multihead import masks
from multihead.backends import flex
from multihead.lab.bench import interleave

HEADS, KV_HEADS, DIM, WINDOW = 8, 2, 64, 256


def window_mask() -> masks.Mask:
    return masks.causal() & masks.window(WINDOW - 1, 0)  # the query and the WINDOW - 1 keys before it


def inputs(n: int, requires_grad: bool) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = ((1, HEADS, n, DIM), (1, KV_HEADS, n, DIM), (1, KV_HEADS, n, DIM))
    return [torch.randn(*shape, generator=generator).requires_grad_(requires_grad) for shape in shapes]


def dense_keep(n: int) -> torch.Tensor:
    """(n, n) bool: True where a query may see a key, for torch's SDPA."""
    query, key = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (key <= query) & (key > query - WINDOW)


def ways(n: int, backward: bool) -> dict:
    q, k, v = inputs(n, backward)
    keep = dense_keep(n)
    calls = {
        "auto": lambda: multihead.attention(q, k, v, mask=window_mask()),
        "tiled": lambda: multihead.attention(q, k, v, mask=window_mask(), backend="tiled"),
        "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True),
    }
    if not backward:
        calls["flex"] = lambda: multihead.attention(q, k, v, mask=window_mask(), backend="flex")

    def step(call):
        def run():
            out = call()
            if backward:
                torch.autograd.grad(out.sum(), (q, k, v))

        return run

    return {name: step(call) for name, call in calls.items()}


def check(n: int) -> dict[str, float]:
    """Each way's largest difference from the float64 reference output."""
    q, k, v = inputs(n, False)
    reference = multihead.attention(q.double(), k.double(), v.double(), mask=window_mask(), backend="tiled")
    keep = dense_keep(n)
    outputs = {
        "auto": multihead.attention(q, k, v, mask=window_mask()),
        "tiled": multihead.attention(q, k, v, mask=window_mask(), backend="tiled"),
        "torch sdpa": F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True),
        "flex": multihead.attention(q, k, v, mask=window_mask(), backend="flex"),
    }
    return {name: float((out.double() - reference).abs().max()) for name, out in outputs.items()}


def measure(n: int, backward: bool, rounds: int, block_s: float) -> dict:
    steps = ways(n, backward)
    load_before = load_average()
    samples = interleave(steps, rounds=rounds, block_s=block_s)
    others = [name for name in steps if name != "auto"]
    q, k, v = inputs(n, backward)
    return {
        "pass": "forward + backward" if backward else "forward",
        "auto_chose": multihead.explain(q, k, v, mask=window_mask()).chosen,
        "median_s": {name: statistics.median(times) for name, times in samples.items()},
        "samples_s": samples,
        "ratios": ratios_of(samples, [(name, "auto") for name in others]),
        "load_average_1min": {"before": load_before, "after": load_average()},
    }


def markdown(results: dict) -> str:
    lines = [
        machine_line(results["machine"]),
        f"causal & window({WINDOW}) at n = {results['n']:,}: {HEADS} query heads over {KV_HEADS} key/value heads, "
        f"d = {DIM}, batch 1, float32. {results['rounds']} interleaved rounds of about {results['block_s']} s per "
        f"way; times are medians over rounds, ratios the median of per-round ratios (lowest–highest). FlexAttention "
        f"compiled in {results['flex_compile_s']:.1f} s before timing (forward only: no CPU backward). Largest "
        "difference from the float64 reference: "
        + ", ".join(f"{name} {diff:.1e}" for name, diff in results["differences"].items())
        + ".",
        "",
        "| pass | auto chose | auto ms | way | its ms | its time / auto's |",
        "|---" * 6 + "|",
    ]
    for row in results["rows"]:
        for name, ratio in row["ratios"].items():
            other = name.split("/")[0]
            lines.append(
                f"| {row['pass']} | {row['auto_chose']} | {row['median_s']['auto'] * 1e3:,.1f} | {other} | "
                f"{row['median_s'][other] * 1e3:,.1f} | {ratio_text(ratio)} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 1024, 2 rounds (a smoke run)")
    args = parser.parse_args(argv)
    ensure_malloc_env()
    prepare_allocator(print)
    n, rounds, block_s = (1024, 2, 0.1) if args.quick else (8192, 5, 1.0)
    compile_s = flex.warm_up(heads=HEADS, kv_heads=KV_HEADS, qk_dim=DIM, mask=window_mask())
    results = {
        "machine": machine(),
        "source": source_state(),
        "n": n,
        "rounds": rounds,
        "block_s": block_s,
        "flex_compile_s": compile_s,
        "differences": check(n),
        "rows": [measure(n, backward, rounds, block_s) for backward in (False, True)],
    }
    save_results("window_quick" if args.quick else "window", results, markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
