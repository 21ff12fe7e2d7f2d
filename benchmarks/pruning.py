"""Is a pruned layer faster in proportion to what was removed? MultiHeadAttention with heads pruned.

A BERT-base-sized layer (768 wide, 12 heads) at batch 4, n = 512, float32, forward and
forward+backward, keeping 12, 9, 6 and 3 heads. Each time is the median of up to 9 calls after one
warm-up (harness.common.time_calls). Next to each: the time the cost model predicts in
proportion (needed FLOPs of the pruned shape over the unpruned one's, times the unpruned time), and
zero-ablating the same heads on the unpruned layer (same outputs, no saving) as the peer.

    python benchmarks/pruning.py [--quick]      # writes benchmarks/results/pruning.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from harness.common import machine_info, time_calls

from multihead import MultiHeadAttention
from multihead.cost import LayerShape, estimate

RESULTS = Path(__file__).resolve().parent / "results"


def measure(layer: MultiHeadAttention, x: torch.Tensor, mode: str, repeats: int) -> float:
    def step():
        if mode == "forward":
            with torch.no_grad():
                layer(x)
        else:
            layer(x)[0].sum().backward()

    step()  # warm-up
    return statistics.median(time_calls(step, lambda: layer.zero_grad(set_to_none=True), repeats, 10.0))


def run(quick: bool) -> dict:
    torch.manual_seed(0)
    batch, n = (2, 256) if quick else (4, 512)
    repeats = 3 if quick else 9
    x = torch.randn(batch, n, 768)
    rows = []
    for mode in ("forward", "forward+backward"):
        full = MultiHeadAttention(768, 12)
        full_s = measure(full, x, mode, repeats)
        full_flops = estimate(LayerShape(768, 12), seq=n, batch=batch, mode=mode).needed_flops
        for kept in (12, 9, 6, 3):
            removed = list(range(kept, 12))
            pruned = MultiHeadAttention(768, 12)
            pruned.load_state_dict(full.state_dict())
            if removed:
                pruned.prune_heads(removed)
            pruned_s = measure(pruned, x, mode, repeats)
            if removed:
                full.ablate_heads(removed)
            ablated_s = measure(full, x, mode, repeats)
            full.restore_heads()
            flops = estimate(LayerShape.of(pruned), seq=n, batch=batch, mode=mode).needed_flops
            rows.append(
                {
                    "mode": mode,
                    "heads_kept": kept,
                    "pruned_s": pruned_s,
                    "zero_ablated_s": ablated_s,
                    "unpruned_s": full_s,
                    "flops_fraction": flops / full_flops,
                    "time_fraction": pruned_s / full_s,
                    "proportional_s": full_s * flops / full_flops,
                }
            )
    return {"machine": machine_info({}), "batch": batch, "n": n, "quick": quick, "rows": rows}


def markdown(results: dict) -> str:
    lines = [
        f"# Pruned layer speed (768 wide, 12 heads, batch {results['batch']}, n = {results['n']}, float32)",
        "",
        "| mode | heads kept | pruned (ms) | zero-ablated (ms) | time / unpruned | FLOPs / unpruned | "
        "pruned / proportional |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['mode']} | {r['heads_kept']} | {r['pruned_s'] * 1e3:.1f} | {r['zero_ablated_s'] * 1e3:.1f}"
            f" | {r['time_fraction']:.2f} | {r['flops_fraction']:.2f} | "
            f"{r['pruned_s'] / r['proportional_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 2, n = 256, 3 repeats")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = run(args.quick)
    stem = "pruning_quick" if args.quick else "pruning"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
