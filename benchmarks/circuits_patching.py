"""What patching one head costs on a Hugging Face Llama: multihead.lab.circuits on the kernel vs the eager path.

The random 6-layer Llama of benchmarks/hf.py (its ``llama()``: hidden 256, 8 query heads over 2 key/value heads,
RoPE), batch 1, float32, at n = 1024 and 4096, loaded twice with the same weights. Patching head H of layer L's
output z from a clean prompt into a corrupted one (the last 16 tokens changed) takes three forwards: record the
clean run, run the corrupted one, run it patched. Three ways to do it, timed in one interleaved run
(multihead.lab.bench.interleave: rounds of one block each, the order rotating):

    (a) multihead            activation_patching(sites=[(L, H)]) with attn_implementation="multihead": every
                             head on the kernel, the head's output swapped at its Attend step
    (b) eager by hand        transformers' eager attention, the head's slice of o_proj's input recorded and
                             swapped by hooks: the least an eager patch needs
    (c) eager + cache        (b) after a clean run with output_attentions=True whose outputs are kept, as
                             TransformerLens' run_with_cache keeps every pattern for its patching functions

Before timing, the script checks that (a) and (b) give the same score (to 2e-3: their float32 logits differ by
about 1e-5). Each ratio is x / y per round: median, lowest, highest. Peak memory is one call per way, measured
by the harness (harness.common.peak_memory: VmHWM above the RSS before the call).

    python benchmarks/circuits_patching.py [--quick]      # writes benchmarks/results/circuits_patching.{json,md}
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable

import torch
from harness.common import ensure_malloc_env, peak_memory, prepare_allocator, save_results
from hf import llama
from hf_capture import Call, load_average, machine, machine_line, ratio_text, ratios_of, source_state

import multihead.integrations.transformers as integration
from multihead.lab.bench import interleave
from multihead.lab.circuits import activation_patching

LAYER, HEAD = 3, 5
ANSWER, WRONG = 7, 11
WAYS = {"multihead": ("a", "multihead"), "eager": ("b", "eager by hand"), "eager_cache": ("c", "eager + cache")}
RATIOS = (("multihead", "eager"), ("multihead", "eager_cache"))


def prompts(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(n)
    clean = torch.randint(3, 1000, (1, n), generator=generator)
    corrupt = clean.clone()
    corrupt[:, -17:-1] = torch.randint(3, 1000, (1, 16), generator=generator)
    return clean, corrupt


def eager_patch(model: torch.nn.Module, clean: torch.Tensor, corrupt: torch.Tensor, keep_cache: bool) -> float:
    """Patch head HEAD of layer LAYER by hand on the eager model: the score, (patched - corrupt) / (clean -
    corrupt) of logit(ANSWER) - logit(WRONG) at the last position."""
    projection = model.model.layers[LAYER].self_attn.o_proj
    width = projection.in_features // 8
    columns = slice(HEAD * width, (HEAD + 1) * width)
    stored: dict[str, torch.Tensor] = {}

    def difference(logits: torch.Tensor) -> float:
        return float(logits[0, -1, ANSWER] - logits[0, -1, WRONG])

    def record(module, args):
        stored["z"] = args[0][..., columns].clone()

    def patch(module, args):
        merged = args[0].clone()
        merged[..., columns] = stored["z"]
        return (merged,)

    with torch.no_grad():
        handle = projection.register_forward_pre_hook(record)
        try:
            out = model(input_ids=clean, output_attentions=keep_cache)
        finally:
            handle.remove()
        cache = out.attentions if keep_cache else None  # kept alive through the other two runs, as a cache is
        clean_difference = difference(out.logits)
        corrupt_difference = difference(model(input_ids=corrupt).logits)
        handle = projection.register_forward_pre_hook(patch)
        try:
            patched = difference(model(input_ids=corrupt).logits)
        finally:
            handle.remove()
    del cache
    return (patched - corrupt_difference) / (clean_difference - corrupt_difference)


def measure(n: int, rounds: int, block_s: float) -> dict:
    base = llama()
    ours, eager = copy.deepcopy(base), copy.deepcopy(base)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    eager.set_attn_implementation("eager")
    clean, corrupt = prompts(n)

    def ours_patch() -> float:
        result = activation_patching(ours, clean, corrupt, answer=ANSWER, wrong=WRONG, sites=[(LAYER, HEAD)])
        return float(result.scores[LAYER, HEAD])

    steps: dict[str, Callable[[], object]] = {
        "multihead": ours_patch,
        "eager": lambda: eager_patch(eager, clean, corrupt, keep_cache=False),
        "eager_cache": lambda: eager_patch(eager, clean, corrupt, keep_cache=True),
    }
    scores = {name: float(step()) for name, step in steps.items()}  # also warms each way
    assert abs(scores["multihead"] - scores["eager"]) < 2e-3, scores  # float32: the logits differ by ~1e-5
    assert abs(scores["eager"] - scores["eager_cache"]) < 1e-9, scores
    load_before = load_average()
    peak_mib = {}
    for name, step in steps.items():
        peak_mib[name], _, result = peak_memory(Call(step))
        del result
    samples = interleave(steps, rounds=rounds, block_s=block_s)
    row: dict = {
        "n": n,
        "scores": scores,
        "load_average_1min": {"before": load_before, "after": load_average()},
        "peak_mib": peak_mib,
        "median_s": {name: statistics.median(times) for name, times in samples.items()},
        "samples_s": samples,
    }
    row["ratios"] = ratios_of(samples, RATIOS)
    return row


def markdown(results: dict) -> str:
    lines = [
        machine_line(results["machine"]),
        f"{results['model']}. Patched: layer {LAYER}, head {HEAD}'s output z (three forwards per call). "
        f"{results['rounds']} interleaved rounds of about {results['block_s']} s per way; times are medians over "
        "rounds, ratios the median of per-round ratios (lowest–highest). Peak memory: one call, MiB above the RSS "
        "before it.",
        "",
        "| n | "
        + " | ".join(f"({letter}) {label} s" for letter, label in WAYS.values())
        + " | "
        + " | ".join(f"({letter}) MiB" for letter, _ in WAYS.values())
        + " | "
        + " | ".join(f"({WAYS[top][0]}) / ({WAYS[bottom][0]}) time" for top, bottom in RATIOS)
        + " |",
        "|---" * (1 + 2 * len(WAYS) + len(RATIOS)) + "|",
    ]
    for row in results["rows"]:
        times = " | ".join(f"{row['median_s'][name]:.3f}" for name in WAYS)
        peaks = " | ".join("—" if row["peak_mib"][name] is None else f"{row['peak_mib'][name]:.0f}" for name in WAYS)
        ratios = " | ".join(ratio_text(row["ratios"][f"{top}/{bottom}"]) for top, bottom in RATIOS)
        lines.append(f"| {row['n']} | {times} | {peaks} | {ratios} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 256 and 512, 2 rounds (a smoke run)")
    args = parser.parse_args(argv)
    ensure_malloc_env()
    prepare_allocator(print)
    sizes, rounds, block_s = ((256, 512), 2, 0.2) if args.quick else ((1024, 4096), 3, 1.0)
    results = {
        "machine": machine(),
        "source": source_state(),
        "model": "random 6-layer Llama (hidden 256, 8 query heads over 2 key/value heads, RoPE), batch 1, float32",
        "rounds": rounds,
        "block_s": block_s,
        "rows": [measure(n, rounds, block_s) for n in sizes],
    }
    save_results("circuits_patching_quick" if args.quick else "circuits_patching", results, markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
