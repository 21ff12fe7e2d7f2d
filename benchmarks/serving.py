"""Batched generation and its cache: Decoder.generate_batch (continuous batching, a paged cache) against generating
the prompts one by one, and the paged cache's peak memory against contiguous caches.

A randomly initialised decoder (4 layers, 8 query heads over 2 key/value heads, width 256, MLP 1024, rotary,
float32) continues 16 prompts of mixed lengths (16 to 256 tokens, drawn once from a seeded generator) by 32 greedy
tokens each. Ways, interleaved (multihead.lab.bench.interleave: rounds of one block each, the order rotating):

    one by one     Decoder.generate(prompt, 32) for each prompt in turn (its contiguous KV cache)
    batch of B     Decoder.generate_batch(prompts, 32, max_batch=B, page_size=16), B = 1, 4 and 16
    batch of 1, torch's kernels   the same with multihead's native kernel turned off (use_native(False)): its
                   decode steps copy every page into torch's kernel's layout, as before the native page read

Every way gives the same tokens (checked). Throughput counts the new tokens. Memory: the peak number of pages the
paged cache holds at once (its pages in use, sampled after every call of the model) times the page's bytes, against
what contiguous caches hold for the same work: one (B, g, longest, d + e) cache per layer for a batch decoded
together as generate does (B = 16), and one per prompt for one by one (the largest, at a time).

    python benchmarks/serving.py [--quick] [--rounds N]      # writes benchmarks/results/serving.{json,md}
"""

from __future__ import annotations

import argparse
import statistics

import torch
from harness.common import ensure_malloc_env, prepare_allocator, save_results
from hf_capture import load_average, machine, machine_line, ratio_text, ratios_of, source_state

from multihead.backends import native
from multihead.lab.bench import interleave
from multihead.lab.models.decoder import Decoder, DecoderConfig

NEW_TOKENS = 32
MIB = 2**20


def build() -> Decoder:
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=512, max_positions=512, hidden=256, layers=4, heads=8, kv_heads=2, mlp=1024)
    return Decoder(config).eval()


def prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 257, (count,), generator=generator).tolist()
    return [torch.randint(0, 512, (n,), generator=generator).tolist() for n in lengths]


def peak_pages(decoder: Decoder, batch: list[list[int]], max_batch: int) -> int:
    """The most pages the paged cache of generate_batch holds at once (all layers), sampled after each model call."""
    peak = [0]
    build_cache = Decoder.new_paged_cache

    def watched(self, *args, **kwargs):
        cache = build_cache(self, *args, **kwargs)
        forward = self.forward

        def step(*a, **k):
            out = forward(*a, **k)
            peak[0] = max(peak[0], cache.pages_in_use)
            return out

        self.forward = step  # the instance's own: generate_batch calls self(...)
        return cache

    Decoder.new_paged_cache = watched  # type: ignore[method-assign]
    try:
        decoder.generate_batch(batch, NEW_TOKENS, max_batch=max_batch, page_size=16)
    finally:
        Decoder.new_paged_cache = build_cache  # type: ignore[method-assign]
        if "forward" in decoder.__dict__:
            del decoder.forward
    return peak[0]


def on_torch_kernels(step):
    def run():
        with native.use_native(False):
            return step()

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 prompts, batches of 1 and 4, 2 rounds")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of about 1 s per way (default 3)")
    args = parser.parse_args(argv)
    ensure_malloc_env()
    prepare_allocator(print)
    count, batches, rounds, block_s = (4, (1, 4), 2, 0.1) if args.quick else (16, (1, 4, 16), args.rounds, 1.0)
    decoder = build()
    batch = prompts(count, seed=1)
    with torch.no_grad():
        one_by_one = [decoder.generate(p, NEW_TOKENS)[0].tolist() for p in batch]
        for size in batches:
            got = [t.tolist() for t in decoder.generate_batch(batch, NEW_TOKENS, max_batch=size, page_size=16)]
            assert got == one_by_one, f"a batch of {size} gave other tokens"
    steps = {"one by one": lambda: [decoder.generate(p, NEW_TOKENS) for p in batch]}
    for size in batches:
        steps[f"batch of {size}"] = lambda size=size: decoder.generate_batch(batch, NEW_TOKENS, max_batch=size)
    if native.available():  # a batch of one without the native kernel's page reads: their share of its time
        steps["batch of 1, torch's kernels"] = on_torch_kernels(
            lambda: decoder.generate_batch(batch, NEW_TOKENS, max_batch=1)
        )
    load_before = load_average()
    samples = interleave(steps, rounds=rounds, block_s=block_s)
    new_tokens = count * NEW_TOKENS
    config = decoder.config
    head = config.hidden // config.heads
    slot_bytes = config.layers * config.num_kv_heads * 2 * head * 4  # keys and values of one token, every layer
    longest = max(len(p) for p in batch) + NEW_TOKENS
    memory = {
        f"paged, batch of {size}": peak_pages(decoder, batch, size) / config.layers * 16 * slot_bytes / MIB
        for size in batches
    }
    memory[f"contiguous, batch of {count}"] = count * longest * slot_bytes / MIB
    memory["contiguous, one by one (largest)"] = longest * slot_bytes / MIB
    results = {
        "machine": machine(),
        "source": source_state(),
        "prompt_lengths": [len(p) for p in batch],
        "rounds": rounds,
        "block_s": block_s,
        "median_s": {name: statistics.median(times) for name, times in samples.items()},
        "tokens_per_s": {name: new_tokens / statistics.median(times) for name, times in samples.items()},
        "samples_s": samples,
        "ratios": ratios_of(samples, [("one by one", name) for name in steps if name != "one by one"]),
        "native": native.unavailable_reason() or "multihead's native kernel",
        "cache_mib": memory,
        "load_average_1min": {"before": load_before, "after": load_average()},
    }
    save_results("serving_quick" if args.quick else "serving", results, markdown(results))
    return 0


def markdown(results: dict) -> str:
    lengths = results["prompt_lengths"]
    lines = [
        machine_line(results["machine"]),
        f"A decoder of 4 layers, 8 query heads over 2 key/value heads, width 256, rotary, float32; {len(lengths)} "
        f"prompts of {min(lengths)} to {max(lengths)} tokens, {NEW_TOKENS} greedy tokens each (every way gives the "
        f"same tokens). {results['rounds']} interleaved rounds of about {results['block_s']} s per way; tokens/s "
        "from the medians, speedups the median of per-round ratios (lowest–highest). A decode step of sequences of "
        f"one length read its pages on: {results['native']}.",
        "",
        "| way | new tokens/s | speedup over one by one |",
        "|---|---|---|",
    ]
    for name, rate in results["tokens_per_s"].items():
        ratio = results["ratios"].get(f"one by one/{name}")
        lines.append(f"| {name} | {rate:,.0f} | {'—' if ratio is None else ratio_text(ratio)} |")
    lines += ["", "| cache | peak MiB |", "|---|---|"]
    lines += [f"| {name} | {mib:.2f} |" for name, mib in results["cache_mib"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
