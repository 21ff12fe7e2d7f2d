"""What attention statistics cost at long context: multihead.attention_stats (streamed) vs the dense weights.

One head (b = 1, h = g = 1, d = 64), float32, causal, random q, k, v, at n = 1k .. 32k, and the streamed way alone
at 64k and 128k. Three ways:

    (a) forward          multihead.attention(q, k, v, causal=True): the output alone, what a model runs anyway
    (b) streamed         multihead.attention_stats(q, k, v, causal=True): the output and every statistic
                         (entropy, the largest weight and its key, the six distance bands, the weight ahead, the
                         first 4 keys, the column sums near and far), in O(n) memory
    (c) dense            multihead.attention(..., return_weights=True), then from the (n, n) weights: the entropy,
                         the largest weight and its key, the column sums and the first-token share (fewer
                         statistics than (b): the bands would need an (n, n) distance matrix as well)

(c) runs while its weights fit comfortably (n <= 16k: 1 GiB); past that the table gives what its weights alone
would take, n^2 x 4 bytes. Up to 8k the three are timed in one interleaved run (multihead.lab.bench.interleave: rounds
of one block each, the order rotating), each ratio x / y per round: median, lowest, highest. Past 8k one call of
each is timed. Peak memory is one call per way (harness.common.peak_memory: VmHWM above the RSS before the call).

    python benchmarks/long_stats.py [--quick]      # writes benchmarks/results/long_stats.{json,md}
    python benchmarks/long_stats.py --heads 4 --up-to 8192     # h = g = 4: long_stats_h4.{json,md}
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from harness.common import ensure_malloc_env, peak_memory, prepare_allocator, save_results
from hf_capture import Call, load_average, machine, machine_line, ratio_text, ratios_of, source_state

import multihead
from multihead.lab.bench import interleave

WAYS = {"forward": ("a", "forward"), "streamed": ("b", "streamed stats"), "dense": ("c", "dense weights")}
RATIOS = (("streamed", "forward"), ("streamed", "dense"))
DENSE_UP_TO = 16384
INTERLEAVED_UP_TO = 8192
MIB = 2**20


def inputs(n: int, heads: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(n)
    return tuple(torch.randn(1, heads, n, 64, generator=generator) for _ in range(3))  # type: ignore[return-value]


def dense_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """The statistics (c) computes from the whole weight matrix."""
    result = multihead.attention_result(q, k, v, causal=True, return_weights=True)
    weights = result.weights
    assert weights is not None
    entropy = -(weights * torch.where(weights > 0, weights.log(), torch.zeros((), dtype=weights.dtype))).sum(-1)
    best, where = weights.max(-1)
    return {
        "output": result.output,
        "entropy": entropy,
        "max_weight": best,
        "max_key": where,
        "received": weights.sum(-2),
        "first": weights[..., 0],
    }


def check(n: int, heads: int) -> float:
    """The streamed statistics against the dense ones at ``n``: the largest difference."""
    q, k, v = inputs(n, heads)
    streamed = multihead.attention_stats(q, k, v, causal=True)
    dense = dense_stats(q, k, v)
    differences = [
        float((getattr(streamed, name) - dense[name]).abs().max()) for name in ("entropy", "max_weight", "received")
    ]
    differences.append(float((streamed.first[..., 0] - dense["first"]).abs().max()))
    return max(differences)


def measure(n: int, heads: int, rounds: int, block_s: float) -> dict:
    q, k, v = inputs(n, heads)
    steps: dict[str, Callable[[], object]] = {
        "forward": lambda: multihead.attention(q, k, v, causal=True),
        "streamed": lambda: multihead.attention_stats(q, k, v, causal=True),
    }
    if n <= DENSE_UP_TO:
        steps["dense"] = lambda: dense_stats(q, k, v)
    for step in steps.values():  # warm each way
        step()
    load_before = load_average()
    peak_mib = {}
    for name, step in steps.items():
        peak_mib[name], _, result = peak_memory(Call(step))
        del result
    row: dict = {"n": n, "dense_weights_mib": heads * n * n * 4 / MIB, "peak_mib": peak_mib}
    if n <= INTERLEAVED_UP_TO:
        samples = interleave(steps, rounds=rounds, block_s=block_s)
        row["median_s"] = {name: statistics.median(times) for name, times in samples.items()}
        row["samples_s"] = samples
        row["ratios"] = ratios_of(samples, [pair for pair in RATIOS if pair[1] in steps])
    else:
        row["median_s"] = {}
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            row["median_s"][name] = time.perf_counter() - start
        row["ratios"] = {}
    row["load_average_1min"] = {"before": load_before, "after": load_average()}
    return row


def markdown(results: dict) -> str:
    lines = [
        machine_line(results["machine"]),
        f"{results['setup']}. Up to n = {INTERLEAVED_UP_TO}: {results['rounds']} interleaved rounds of about "
        f"{results['block_s']} s per way, times the medians over rounds, ratios the median of per-round ratios "
        f"(lowest–highest); past it, one call each. Peak memory: one call, MiB above the RSS before it. Streamed "
        f"equals dense to {results['largest_difference']:.1e} (n = {results['checked_at']}).",
        "",
        "| n | (a) forward s | (b) streamed s | (c) dense s | (a) MiB | (b) MiB | (c) MiB | dense weights alone MiB "
        "| (b) / (a) time | (b) / (c) time |",
        "|---" * 10 + "|",
    ]
    for row in results["rows"]:
        times = " | ".join(
            f"{row['median_s'][name]:.3f}" if name in row["median_s"] else "—"
            for name in ("forward", "streamed", "dense")
        )
        peaks = " | ".join(
            "—" if row["peak_mib"].get(name) is None else f"{row['peak_mib'][name]:.1f}"
            for name in ("forward", "streamed", "dense")
        )
        ratios = " | ".join(
            ratio_text(row["ratios"][f"{top}/{bottom}"]) if f"{top}/{bottom}" in row["ratios"] else "—"
            for top, bottom in RATIOS
        )
        lines.append(f"| {row['n']:,} | {times} | {peaks} | {row['dense_weights_mib']:,.0f} | {ratios} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 512 and 1024, 2 rounds (a smoke run)")
    parser.add_argument("--heads", type=int, default=1, help="heads h = g (default 1; results name them past 1)")
    parser.add_argument("--up-to", type=int, default=None, help="the longest n (default 131072)")
    args = parser.parse_args(argv)
    ensure_malloc_env()
    prepare_allocator(print)
    torch.manual_seed(0)
    if args.quick:
        sizes, rounds, block_s, checked_at = (512, 1024), 2, 0.1, 512
    else:
        sizes, rounds, block_s, checked_at = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072), 3, 1.0, 4096
    sizes = tuple(n for n in sizes if args.up_to is None or n <= args.up_to)
    heads = args.heads
    results = {
        "machine": machine(),
        "source": source_state(),
        "setup": f"{'one head' if heads == 1 else f'{heads} heads'} (b = 1, h = g = {heads}, d = 64), float32, causal, "
        "random inputs",
        "rounds": rounds,
        "block_s": block_s,
        "checked_at": checked_at,
        "largest_difference": check(checked_at, heads),
        "rows": [],
    }
    for n in sizes:
        results["rows"].append(measure(n, heads, rounds, block_s))
        print(f"n = {n}: done", flush=True)
    name = "long_stats" + ("" if heads == 1 else f"_h{heads}") + ("_quick" if args.quick else "")
    save_results(name, results, markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
