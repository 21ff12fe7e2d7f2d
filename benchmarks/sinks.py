"""Learned attention sinks (gpt-oss): multihead's backends that serve them against transformers' own gpt-oss eager
attention, which concatenates the sink column to the scores, softmaxes and drops it.

One gpt-oss-shaped call: 16 query heads over 2 key/value heads, d = 64, batch 1, float32, one learned sink logit per
head, for causal and causal & window(128) (gpt-oss's sliding layers), at n = 512, 1024 and 2048. Two passes:
inference (no gradient) and training (forward + backward, the sinks learning). Each way:

    eager          transformers.models.gpt_oss.modeling_gpt_oss.eager_attention_forward (the peer), with its
                   additive float mask built once outside the timed calls
    sdpa           multihead's sdpa backend: torch's fused kernel with the sink as one more key
    tiled, materialized
                   multihead's block kernels, the sinks folded in from their log-sum-exp
    auto           multihead.attention(backend="auto"), named with what it chose

Interleaved (multihead.lab.bench.interleave: rounds of one block each, the order rotating); times are medians over
rounds, ratios the median of per-round ratios with the lowest and highest. Every way's output (and, training, the
sinks' gradient) is checked against eager before it is timed.

    python benchmarks/sinks.py [--quick]       # writes benchmarks/results/sinks.{json,md}
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from harness.common import ensure_malloc_env, prepare_allocator, save_results
from hf_capture import load_average, machine, machine_line, ratio_text, ratios_of, source_state
from torch import nn
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

import multihead
from multihead import masks
from multihead.lab.bench import interleave

HEADS, KV_HEADS, DIM, WINDOW = 16, 2, 64, 128
OURS = ("sdpa", "tiled", "materialized", "auto")
MASKS = {"causal": None, f"causal & window({WINDOW})": WINDOW}


class _EagerModule(nn.Module):
    """What gpt-oss's eager function reads off its module: the sinks, the GQA grouping, training."""

    def __init__(self, sinks: torch.Tensor) -> None:
        super().__init__()
        self.sinks = sinks
        self.num_key_value_groups = HEADS // KV_HEADS
        self.training = False


def eager_mask(n: int, window: int | None) -> torch.Tensor:
    """gpt-oss's additive mask (1, 1, n, n): 0 where a query may see a key, -inf elsewhere."""
    query, key = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = key <= query
    if window is not None:
        keep &= key > query - window
    return torch.zeros(n, n).masked_fill(~keep, float("-inf"))[None, None]


def ways(n: int, window: int | None, training: bool) -> tuple[dict[str, Callable[[], torch.Tensor]], dict]:
    """Each way's call (returning the output and, training, the sinks' gradient) and what auto chose."""
    generator = torch.Generator().manual_seed(n)
    q = torch.randn(1, HEADS, n, DIM, generator=generator, requires_grad=training)
    k, v = (torch.randn(1, KV_HEADS, n, DIM, generator=generator, requires_grad=training) for _ in range(2))
    sinks = torch.randn(HEADS, generator=generator).requires_grad_(training)
    grad_out = torch.randn(1, HEADS, n, DIM, generator=generator)
    mask = masks.causal() if window is None else masks.causal() & masks.window(window - 1, 0)
    module, additive = _EagerModule(sinks), eager_mask(n, window)

    def finish(out: torch.Tensor) -> torch.Tensor:
        if not training:
            return out
        for tensor in (q, k, v, sinks):
            tensor.grad = None
        out.backward(grad_out)
        assert sinks.grad is not None
        return sinks.grad

    def eager() -> torch.Tensor:
        out, _ = eager_attention_forward(module, q, k, v, additive, DIM**-0.5)
        return finish(out.transpose(1, 2))  # eager returns (b, i, h, e)

    def ours(backend: str) -> Callable[[], torch.Tensor]:
        return lambda: finish(multihead.attention(q, k, v, mask=mask, sinks=sinks, backend=backend))

    calls = {"eager": eager, **{name: ours(name) for name in OURS}}
    chosen = multihead.explain(q, k, v, mask=mask, sinks=sinks).chosen
    return calls, {"auto_chose": chosen}


def check(calls: dict[str, Callable[[], torch.Tensor]]) -> dict[str, float]:
    """Each of ours against eager: the largest difference of the output (inference) or the sinks' gradient."""
    expected = calls["eager"]().detach().clone()
    return {name: float((call().detach() - expected).abs().max()) for name, call in calls.items() if name != "eager"}


def measure(n: int, label: str, window: int | None, training: bool, rounds: int, block_s: float) -> dict:
    calls, facts = ways(n, window, training)
    with torch.set_grad_enabled(training):
        largest = check(calls)
        load_before = load_average()
        samples = interleave(calls, rounds=rounds, block_s=block_s)
    return {
        "n": n,
        "mask": label,
        "pass": "training (forward + backward)" if training else "inference",
        "median_s": {name: statistics.median(times) for name, times in samples.items()},
        "samples_s": samples,
        "ratios": ratios_of(samples, [("eager", name) for name in OURS]),
        "largest_difference": largest,
        "facts": facts,
        "load_average_1min": {"before": load_before, "after": load_average()},
    }


def markdown(results: dict) -> str:
    lines = [
        machine_line(results["machine"]),
        f"gpt-oss-shaped attention: {HEADS} query heads over {KV_HEADS} key/value heads, d = {DIM}, batch 1, "
        f"float32, one learned sink per head. {results['rounds']} interleaved rounds of about {results['block_s']} s "
        "per way; each cell is eager's time over the way's (above 1: faster than eager), the median of per-round "
        "ratios (lowest–highest). Largest difference from eager: of the output in inference, of the sinks' "
        "gradient in training.",
        "",
        "| pass | mask | n | eager s | " + " | ".join(f"eager / {name}" for name in OURS) + " | auto chose "
        "| largest difference |",
        "|---" * (len(OURS) + 6) + "|",
    ]
    for row in results["rows"]:
        cells = " | ".join(ratio_text(row["ratios"][f"eager/{name}"]) for name in OURS)
        lines.append(
            f"| {row['pass']} | {row['mask']} | {row['n']} | {row['median_s']['eager']:.4f} | {cells} | "
            f"{row['facts']['auto_chose']} | {max(row['largest_difference'].values()):.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 256 only, 2 rounds (a smoke run)")
    args = parser.parse_args(argv)
    ensure_malloc_env()
    prepare_allocator(print)
    sizes, rounds, block_s = ((256,), 2, 0.05) if args.quick else ((512, 1024, 2048), 5, 0.5)
    rows = [
        measure(n, label, window, training, rounds, block_s)
        for training in (False, True)
        for label, window in MASKS.items()
        for n in sizes
    ]
    results = {"machine": machine(), "source": source_state(), "rounds": rounds, "block_s": block_s, "rows": rows}
    save_results("sinks_quick" if args.quick else "sinks", results, markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
