"""A Hugging Face model on multihead's kernel vs transformers' own "sdpa" and "eager" attention.

A randomly initialised 6-layer Llama (hidden 256, 8 query heads over 2 key/value heads, RoPE), batch 1,
float32, forward under torch.no_grad() at n = 512 and 2048. The three models share their weights
(deep copies of one). They are timed in one interleaved run (multihead.lab.bench.interleave: rounds of one
block each, the order rotating), and each ratio is multihead / peer per round: median, lowest, highest.

    python benchmarks/hf.py [--quick]      # writes benchmarks/results/hf.{json,md}
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch
import transformers
from harness.common import save_results

import multihead.integrations.transformers as integration
from multihead.lab.bench import interleave
from multihead.machine import identity

IMPLEMENTATIONS = (integration.IMPLEMENTATION, "sdpa", "eager")


def llama(layers: int = 6) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config).eval()


def measure(n: int, rounds: int, block_s: float) -> dict:
    base = llama()
    models = {}
    for name in IMPLEMENTATIONS:
        model = copy.deepcopy(base)
        model.set_attn_implementation(name)
        models[name] = model
    ids = torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():  # the same logits first: a benchmark of different answers would mean nothing
        reference = models["sdpa"](input_ids=ids).logits
        for name, model in models.items():
            torch.testing.assert_close(model(input_ids=ids).logits, reference, atol=2e-4, rtol=2e-4, msg=name)

    def step(model: torch.nn.Module):
        def forward() -> None:
            with torch.no_grad():
                model(input_ids=ids)

        return forward

    samples = interleave({name: step(model) for name, model in models.items()}, rounds=rounds, block_s=block_s)
    ours = samples[integration.IMPLEMENTATION]
    row: dict = {"n": n, "median_s": {name: statistics.median(times) for name, times in samples.items()}}
    for peer in IMPLEMENTATIONS[1:]:
        ratios = [a / b for a, b in zip(ours, samples[peer], strict=True)]
        row[f"multihead/{peer}"] = {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}
    return row


def markdown(results: dict) -> str:
    lines = [
        f"Machine: {results['machine']}. {results['model']}, {results['rounds']} interleaved rounds.",
        "",
        "| n | multihead (s) | sdpa (s) | eager (s) | multihead / sdpa | multihead / eager |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        times = " | ".join(f"{row['median_s'][name]:.4f}" for name in IMPLEMENTATIONS)
        ratios = " | ".join(
            "{median:.2f} ({low:.2f}–{high:.2f})".format(**row[f"multihead/{peer}"]) for peer in IMPLEMENTATIONS[1:]
        )
        lines.append(f"| {row['n']} | {times} | {ratios} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 128 and 256, 3 rounds")
    args = parser.parse_args(argv)
    sizes, rounds, block_s = ((128, 256), 3, 0.2) if args.quick else ((512, 2048), 7, 1.0)
    results = {
        "machine": identity().describe(),
        "model": "random Llama: 6 layers, hidden 256, 8 query heads over 2 key/value heads, float32, batch 1",
        "rounds": rounds,
        "rows": [measure(n, rounds, block_s) for n in sizes],
    }
    save_results("hf_quick" if args.quick else "hf", results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
