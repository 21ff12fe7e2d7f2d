"""Packed documents against the same documents padded: multihead.attention_varlen vs a padded batch.

Documents of mixed lengths (drawn once from a seeded generator, 32 to 1024 tokens, about 8k tokens in all), 8 query
heads over 2 key/value heads, d = 64, float32, causal within each document. Two ways, each on the backend ``auto``
picks for it (named in the table):

    (a) packed       multihead.attention_varlen(q, k, v, cu, cu, ...): one row of every document's tokens, the
                     documents mask skipping every block between documents
    (b) padded       multihead.attention on (documents, h, longest, d), each row padded to the longest document
                     with masks.padding(lengths) and causal
    (c) padded sdpa  the same padded call on backend="sdpa": torch's SDPA given the dense mask, which computes every
                     pair of the padded grid (what auto chose for it before the spans backend, issue 49)

Timed forward, and forward + backward (the gradient of the output's sum), interleaved (multihead.lab.bench.interleave:
rounds of one block each, the order rotating); tokens/s counts the real tokens only. The share of 128 x 128 tiles
each way skips (BoundMask.block_states: empty tiles over all tiles, the padded way over its padded grid) comes from
the masks themselves.

    python benchmarks/packed.py [--quick]      # writes benchmarks/results/packed.{json,md}
"""

from __future__ import annotations

import argparse
import statistics

import torch
from harness.common import ensure_malloc_env, prepare_allocator, save_results
from hf_capture import load_average, machine, machine_line, ratio_text, ratios_of, source_state

import multihead
from multihead import masks
from multihead.backends import native
from multihead.lab.bench import interleave
from multihead.masks import STATE_EMPTY, AttentionShape, bind_mask
from multihead.masks._documents import ragged_documents

HEADS, KV_HEADS, DIM = 8, 2, 64
TILE = 128


def documents(total: int, seed: int) -> list[int]:
    """Document lengths from 32 to 1024 tokens until about ``total`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(32, 1025, (1,), generator=generator)))
    return lengths


def ways(lengths: list[int], backward: bool) -> tuple[dict, dict]:
    """The two calls (each returning after its backward when asked) and what they run on."""
    generator = torch.Generator().manual_seed(1)
    total, longest = sum(lengths), max(lengths)
    q = torch.randn(total, HEADS, DIM, generator=generator, requires_grad=backward)
    k = torch.randn(total, KV_HEADS, DIM, generator=generator, requires_grad=backward)
    v = torch.randn(total, KV_HEADS, DIM, generator=generator, requires_grad=backward)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    padded = []
    for t, heads in ((q, HEADS), (k, KV_HEADS), (v, KV_HEADS)):
        rows = torch.zeros(len(lengths), heads, longest, DIM)
        for row, (start, length) in enumerate(zip(cu[:-1].tolist(), lengths, strict=True)):
            rows[row, :, :length] = t.detach()[start : start + length].transpose(0, 1)
        padded.append(rows.requires_grad_(backward))
    padding = masks.padding(lengths)

    def packed_call():
        out = multihead.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)
        if backward:
            out.sum().backward()

    def packed_on_torch_kernel():
        with native.use_native(False):
            packed_call()

    def padded_call(backend: str = "auto"):
        out = multihead.attention(*padded, mask=padding, causal=True, backend=backend)
        if backward:
            out.sum().backward()

    packed_shape = AttentionShape(1, HEADS, total, total, torch.device("cpu"))
    padded_shape = AttentionShape(len(lengths), HEADS, longest, longest, torch.device("cpu"))
    packed_mask = bind_mask(ragged_documents(cu, cu, (None, 0)), False, packed_shape)
    padded_mask = bind_mask(padding, True, padded_shape)
    packed_q = q.detach().transpose(0, 1)[None]
    facts = {
        "packed": {
            "skipped": float((packed_mask.block_states(TILE) == STATE_EMPTY).float().mean()),
            "backend": multihead.explain(
                packed_q,
                k.detach().transpose(0, 1)[None],
                v.detach().transpose(0, 1)[None],
                mask=ragged_documents(cu, cu, (None, 0)),
            ).chosen,
        },
        "padded": {
            "skipped": float((padded_mask.block_states(TILE) == STATE_EMPTY).float().mean()),
            "backend": multihead.explain(*(t.detach() for t in padded), mask=padding, causal=True).chosen,
        },
    }
    facts["padded sdpa"] = {"skipped": 0.0, "backend": "sdpa"}  # given a dense mask, it computes every tile
    facts["causal triangles"] = native.unavailable_reason() or "multihead's native kernel"
    steps = {"packed": packed_call, "padded": padded_call, "padded sdpa": lambda: padded_call("sdpa")}
    if native.available():  # the same packed call with its triangles on torch's kernel: the native kernel's share
        steps["packed, torch's kernel"] = packed_on_torch_kernel
    return steps, facts


def check(lengths: list[int]) -> float:
    """The packed output against the padded one, on the real tokens: the largest difference."""
    generator = torch.Generator().manual_seed(2)
    total, longest = sum(lengths), max(lengths)
    q, k, v = (torch.randn(total, heads, DIM, generator=generator) for heads in (HEADS, KV_HEADS, KV_HEADS))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = multihead.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)
    largest = 0.0
    for start, length in zip(cu[:-1].tolist(), lengths, strict=True):
        alone = multihead.attention(*(t[start : start + length].transpose(0, 1)[None] for t in (q, k, v)), causal=True)
        largest = max(largest, float((packed[start : start + length] - alone[0].transpose(0, 1)).abs().max()))
    return largest


def measure(lengths: list[int], backward: bool, rounds: int, block_s: float) -> dict:
    steps, facts = ways(lengths, backward)
    for step in steps.values():
        step()
    load_before = load_average()
    samples = interleave(steps, rounds=rounds, block_s=block_s)
    tokens = sum(lengths)
    return {
        "pass": "forward + backward" if backward else "forward",
        "median_s": {name: statistics.median(times) for name, times in samples.items()},
        "tokens_per_s": {name: tokens / statistics.median(times) for name, times in samples.items()},
        "samples_s": samples,
        "ratios": ratios_of(samples, [(name, "packed") for name in samples if name != "packed"]),
        "facts": facts,
        "load_average_1min": {"before": load_before, "after": load_average()},
    }


def markdown(results: dict) -> str:
    lengths = results["lengths"]
    lines = [
        machine_line(results["machine"]),
        f"{len(lengths)} documents, {sum(lengths):,} tokens (from {min(lengths)} to {max(lengths)}), "
        f"{HEADS} query heads over {KV_HEADS} key/value heads, d = {DIM}, float32, causal within each document. "
        f"{results['rounds']} interleaved rounds of about {results['block_s']} s per way; times are medians over "
        f"rounds, the ratio the median of per-round ratios (lowest–highest). Packed equals each document alone to "
        f"{results['largest_difference']:.1e}. Packed's causal triangles ran on: "
        f"{results['rows'][0]['facts']['causal triangles']}.",
        "",
        "| pass | packed tokens/s | padded tokens/s | padded sdpa tokens/s | padded / packed time "
        "| padded sdpa / packed time | packed on torch's kernel / packed time "
        "| packed backend, tiles skipped | padded backend, tiles skipped |",
        "|---" * 9 + "|",
    ]
    for row in results["rows"]:
        packed, padded = row["facts"]["packed"], row["facts"]["padded"]
        rates, ratios = row["tokens_per_s"], row["ratios"]
        on_torch = ratios.get("packed, torch's kernel/packed")
        lines.append(
            f"| {row['pass']} | {rates['packed']:,.0f} | {rates['padded']:,.0f} | {rates['padded sdpa']:,.0f} | "
            f"{ratio_text(ratios['padded/packed'])} | {ratio_text(ratios['padded sdpa/packed'])} | "
            f"{ratio_text(on_torch) if on_torch else '—'} | "
            f"{packed['backend']}, {packed['skipped']:.0%} | {padded['backend']}, {padded['skipped']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about 1k tokens, 2 rounds (a smoke run)")
    args = parser.parse_args(argv)
    ensure_malloc_env()
    prepare_allocator(print)
    total, rounds, block_s = (1024, 2, 0.1) if args.quick else (8192, 5, 1.0)
    lengths = documents(total, seed=0)
    results = {
        "machine": machine(),
        "source": source_state(),
        "lengths": lengths,
        "rounds": rounds,
        "block_s": block_s,
        "largest_difference": check(lengths),
        "rows": [measure(lengths, backward, rounds, block_s) for backward in (False, True)],
    }
    save_results("packed_quick" if args.quick else "packed", results, markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
