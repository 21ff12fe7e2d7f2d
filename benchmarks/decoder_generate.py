"""Tokens per second of ``Decoder.generate`` with and without the KV cache.

Usage:
    python benchmarks/decoder_generate.py [--rounds 7] [--prompt 32] [--new 96] [--batch 1] [--threads 1]

A small randomly initialised decoder (4 layers, 8 heads, width 256, MLP 1024, rotary) generates greedily
from a fixed prompt. The two modes run interleaved, round by round (cached, uncached, cached, ...), so a
machine that slows down or speeds up during the run affects both alike; each round generates the same
tokens. Prints the CPU (lscpu's model name), the median tokens/s of each mode with its spread (min..max
over the rounds), and the median of the per-round ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from multihead.lab.models import Decoder, DecoderConfig


def cpu_name() -> str:
    """lscpu's "Model name" (or "unknown CPU" where lscpu cannot run)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            return value.strip()
    return "unknown CPU"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompt", type=int, default=32, help="prompt length")
    parser.add_argument("--new", type=int, default=96, help="tokens generated per round")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steadiest on a shared machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=512, max_positions=1024, hidden=256, layers=4, heads=8, mlp=1024)
    model = Decoder(config).eval()
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt))
    model.generate(prompt, 4, use_cache=True)  # warm-up: allocator, rotary tables, kernels
    model.generate(prompt, 4, use_cache=False)
    rates: dict[bool, list[float]] = {True: [], False: []}
    outputs = {}
    for _ in range(args.rounds):
        for use_cache in (True, False):
            start = time.perf_counter()
            outputs[use_cache] = model.generate(prompt, args.new, use_cache=use_cache)
            rates[use_cache].append(args.batch * args.new / (time.perf_counter() - start))
    same = torch.equal(outputs[True], outputs[False])
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"model: {config.layers} layers x {config.heads} heads, hidden {config.hidden}, mlp {config.mlp}, "
        f"vocab {config.vocab_size}; batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, "
        f"{args.rounds} interleaved rounds; cached == uncached tokens: {same}"
    )
    for use_cache in (True, False):
        values = rates[use_cache]
        label = "with cache   " if use_cache else "without cache"
        print(
            f"{label}: median {statistics.median(values):8.1f} tokens/s  "
            f"(min {min(values):.1f} .. max {max(values):.1f})"
        )
    ratios = [cached / uncached for cached, uncached in zip(rates[True], rates[False], strict=True)]
    print(
        f"speed-up of the cache: median {statistics.median(ratios):.2f}x "
        f"(min {min(ratios):.2f} .. max {max(ratios):.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
