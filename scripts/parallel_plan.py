"""The planning table of docs/parallel.md: a 128k-token training step of one attention layer over 8 and 64 H100s,
on NVLink and on InfiniBand, from :mod:`multihead.cost_parallel` (the same model as ``multihead cost --tp/--cp``).

    .venv/bin/python scripts/parallel_plan.py        # prints the markdown table docs/parallel.md carries

tests/core/test_cost_parallel.py checks that the table in docs/parallel.md is this script's output.
"""

from __future__ import annotations

from multihead.cost import LayerShape, MachineRates
from multihead.cost_parallel import parallel_cost, parallel_time

# A Llama-3-8B attention layer: D = 4096, 32 query heads, 8 key/value heads, d = 128
SHAPE = LayerShape(4096, 32, num_kv_heads=8)
SEQ = 131072
# H100 SXM datasheet: 989 TFLOP/s dense bfloat16, 3.35 TB/s HBM3
H100 = MachineRates({"bfloat16": 989_000.0}, bandwidth_gbs=3350.0, threads=0, measured_at="datasheet")
LINKS = {"NVLink": 450.0, "IB": 50.0}  # GB/s per GPU and direction: NVLink 4 (900 GB/s both ways), NDR 400 Gb/s

# (GPUs, split, tp, cp, cp_method, link of the cp group, link of the tp group)
ROWS = [
    (8, "ring", 1, 8, "ring", "NVLink", None),
    (8, "ring", 1, 8, "ring", "IB", None),
    (8, "Ulysses", 1, 8, "ulysses", "NVLink", None),
    (8, "Ulysses", 1, 8, "ulysses", "IB", None),
    (8, "heads (TP)", 8, 1, "ring", "NVLink", None),
    (64, "ring", 1, 64, "ring", "NVLink", None),
    (64, "ring", 1, 64, "ring", "IB", None),
    (64, "TP 8 x ring 8", 8, 8, "ring", "IB", "NVLink"),
]

HEADER = (
    "| GPUs | split | link | FLOPs / GPU | peak / GPU | sent / GPU | own work | communication | exposed | step "
    "| ring hides from n = |\n|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def table() -> str:
    lines = [HEADER]
    for gpus, name, tp, cp, method, link, tp_link in ROWS:
        cost = parallel_cost(
            SHAPE, seq=SEQ, causal=True, dtype="bfloat16", mode="forward+backward", tp=tp, cp=cp, cp_method=method
        )
        timing = parallel_time(cost, H100, LINKS[link], tp_link_gbs=LINKS[tp_link] if tp_link else None)
        links = f"TP {tp_link}, ring {link}" if tp_link else link
        crossover = f"{timing.crossover_seq:,.0f}" if timing.crossover_seq is not None else "-"
        lines.append(
            f"| {gpus} | {name} | {links} | {cost.flops / 1e12:.1f} T | {cost.peak_bytes / 2**30:.2f} GiB "
            f"| {cost.total_sent_bytes / 2**20:,.0f} MiB | {timing.local.bound_s * 1e3:.1f} ms "
            f"| {timing.communication_s * 1e3:.1f} ms | {timing.exposed_s * 1e3:.1f} ms "
            f"| {timing.total_s * 1e3:.1f} ms | {crossover} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
