"""Tables and plots of :mod:`multihead.cost` reports (what ``multihead cost`` prints and draws)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from multihead._console import table
from multihead._figures import fitted_title, pyplot, save_figure
from multihead._userfiles import output_folder, writing
from multihead.cost import (
    QUADRATIC_TERMS,
    TERMS,
    CostReport,
    LayerShape,
    MachineRates,
    compute_rate,
    crossover,
    estimate,
    roofline,
)
from multihead.cost_parallel import ParallelCost, ParallelTime

__all__ = ["human_flops", "human_bytes", "print_cost", "print_parallel", "parallel_json", "plot_cost", "cost_json"]


def human_flops(flops: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.2f} {unit}"
    return f"{flops:.0f} FLOP"


def human_bytes(count: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count:.0f} B"


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3f} ms" if value < 1 else f"{value:.2f} s"


def describe_config(report: CostReport) -> str:
    s = report.shape
    kv = f", kv heads {s.g}" if s.g != s.h else ""
    sizes = f"d={s.d}" + (f", e={s.e}" if s.e != s.d else "")
    lengths = f"i={report.q_len}" + (f", j={report.k_len}" if report.k_len != report.q_len else "")
    extra = (
        [report.mode, report.dtype]
        + (["causal"] if report.causal else [])
        + (["weights returned"] if report.need_weights else [])
    )
    return f"embed_dim {s.embed_dim}, heads {s.h}{kv} ({sizes}), batch {report.batch}, {lengths}: " + ", ".join(extra)


def print_cost(
    report: CostReport, rates: MachineRates | None, console: Any, *, rates_source: str | None = None
) -> None:
    """The breakdown tables: parameters, FLOPs by term, memory, crossover and roofline, on ``console``
    (:func:`multihead._console.make_console`'s: rich's, or plain text without the lab extra). The roofline is
    priced at ``rates``, labelled ``rates_source`` ("the rates given"; default: "measured <when>", a calibration's)."""
    console.print(describe_config(report), style="bold", soft_wrap=True, markup=False)
    params = report.params
    console.print(
        f"parameters: {params.total:,} ({params.weights:,} weights + {params.biases:,} biases; "
        + ", ".join(f"{name} {count:,}" for name, count in params.per_projection.items())
        + ")",
        soft_wrap=True,
    )

    backward = report.mode == "forward+backward"
    flops = table(
        "FLOPs (a multiply-add is 2)",
        [("term", "left"), ("forward", "right"), *([("backward", "right")] if backward else []), ("share", "right")],
    )
    total = report.total_flops
    for term in TERMS:
        forward_value, backward_value = report.flops[term], report.backward_flops[term]
        row = [term, human_flops(forward_value)] + ([human_flops(backward_value)] if backward else [])
        flops.add_row(*row, f"{(forward_value + backward_value) / total:.1%}")
    flops.add_row(
        "total",
        human_flops(sum(report.flops.values())),
        *([human_flops(sum(report.backward_flops.values()))] if backward else []),
        "100%",
        style="bold",
    )
    console.print(flops)
    console.print(f"dominant term: [bold]{report.dominant}[/bold]")
    n_star = crossover(report.shape)
    quadratic = sum(report.per_term[term] for term in QUADRATIC_TERMS)
    console.print(
        f"crossover: the n x n terms (Q K^T, softmax, weights x V) cost as much as the projections "
        f"at n = {n_star:.0f} (about 2 x embed_dim for the classic layer); at j = {report.k_len} they "
        f"take {quadratic / total:.0%} of the FLOPs and the projections {1 - quadratic / total:.0%}",
        soft_wrap=True,
    )
    if report.causal:
        console.print(
            f"causal: a block-skipping kernel needs {report.attended_fraction:.1%} of the Q K^T and "
            f"weights x V FLOPs (dense kernels compute them all)",
            soft_wrap=True,
        )

    memory = table("Memory", [("what", "left"), ("bytes", "right")])
    allocated = "activations (q, k, v, head outputs, output" + (", weights)" if report.need_weights else ")")
    rows = [("parameters", report.bytes.weights), (allocated, report.bytes.activations)]
    if report.mode == "forward+backward":
        rows.append(("saved for backward", report.bytes.saved_for_backward))
    if report.mode == "decode":
        rows.append((f"KV cache ({report.k_len} tokens)", report.bytes.kv_cache))
    if report.need_weights:
        rows.append(("attention weights (b, h, i, j)", report.bytes.attention_weights))
    rows += [
        ("peak allocated by the layer (multihead on CPU)", report.bytes.peak),
        ("least memory traffic", report.bytes.traffic),
    ]
    for name, value in rows:
        memory.add_row(name, human_bytes(value))
    console.print(memory)

    if rates is None:
        console.print("roofline: not calibrated on this machine; run `multihead bench --calibrate`", style="dim")
    elif report.dtype not in rates.matmul_gflops:
        console.print(
            f"roofline: {report.dtype} not calibrated; run `multihead bench --calibrate --dtype {report.dtype}`",
            style="dim",
        )
    else:
        bound = roofline(report, rates)
        console.print(
            f"roofline ({compute_rate(report.dtype, rates):.1f} GFLOP/s for {report.dtype} work, "
            f"{rates.bandwidth_gbs:.1f} GB/s, {rates_source or f'measured {rates.measured_at}'}): at least "
            f"{_seconds(bound.bound_s)}, {bound.bound_by}-bound (compute {_seconds(bound.compute_s)}, "
            f"memory {_seconds(bound.memory_s)}; {bound.arithmetic_intensity:.1f} FLOP/byte vs ridge "
            f"{bound.ridge_point:.1f})",
            soft_wrap=True,
        )


def _split(cost: ParallelCost) -> str:
    parts = ([f"heads over tp = {cost.tp}"] if cost.tp > 1 else []) + (
        [f"sequence over cp = {cost.cp} ({cost.cp_method})"] if cost.cp > 1 else []
    )
    return " x ".join(parts) or "one rank"


def print_parallel(
    cost: ParallelCost, timing: ParallelTime | None, console: Any, *, rates_source: str | None = None
) -> None:
    """The per-rank table of ``multihead cost --tp/--cp``: FLOPs, memory, bytes sent and collectives against the
    single-process layer; with a link bandwidth, the time with communication and the ring's crossover."""
    report = cost.report
    ranks = table(
        f"Across {cost.world_size} ranks: {_split(cost)}, per rank",
        [("what", "left"), ("one process", "right"), ("per rank", "right")],
    )
    ranks.add_row(
        "query heads / kv heads",
        f"{report.shape.h} / {report.shape.g}",
        f"{cost.heads_per_rank} / {cost.kv_heads_per_rank}",
    )
    ranks.add_row("positions", f"{report.q_len}", f"{cost.positions_per_rank}")
    ranks.add_row("needed FLOPs", human_flops(report.needed_flops), human_flops(cost.flops))
    ranks.add_row("parameters", human_bytes(report.bytes.weights), human_bytes(cost.weight_bytes))
    ranks.add_row("peak allocated (model)", human_bytes(report.bytes.peak), human_bytes(cost.peak_bytes))
    ranks.add_row("sent, forward", "-", human_bytes(cost.sent_bytes["forward"]))
    if report.mode == "forward+backward":
        ranks.add_row("sent, backward", "-", human_bytes(cost.sent_bytes["backward"]))
    calls = ", ".join(f"{count} {name.replace('_', '-')}" for name, count in cost.collectives.items() if count)
    ranks.add_row("collectives per call", "-", calls or "none")
    console.print(ranks)
    if timing is None:
        console.print("time: give --link-gbs (the bandwidth between ranks, GB/s per direction)", style="dim")
        return
    where = f" ({rates_source})" if rates_source else ""
    console.print(
        f"time per rank{where}: at least {_seconds(timing.total_s)} = own work {_seconds(timing.local.bound_s)} "
        f"({timing.local.bound_by}-bound) + exposed communication {_seconds(timing.exposed_s)} "
        f"(of {_seconds(timing.communication_s)} sent at the link rate)",
        soft_wrap=True,
    )
    if timing.crossover_seq is not None:
        state = "hidden behind compute" if timing.hidden else "NOT hidden: the link is the bottleneck"
        console.print(
            f"ring: each block's send is {state}; the sends hide from n = {timing.crossover_seq:,.0f} on "
            f"({timing.crossover_seq / cost.cp:,.0f} positions per rank)",
            soft_wrap=True,
        )


def parallel_json(cost: ParallelCost, timing: ParallelTime | None) -> dict:
    data = cost.as_dict()
    if timing is not None:
        data["time"] = timing.as_dict()
    return data


def cost_json(report: CostReport, rates: MachineRates | None, *, rates_source: str | None = None) -> dict:
    """``report`` as JSON, with the crossover and, where ``rates`` has its dtype, the roofline priced at them
    (``roofline.rates.source``: ``rates_source``, default "measured <when>" as :func:`print_cost` says)."""
    data = report.as_dict()
    data["crossover_n"] = crossover(report.shape)
    if rates is not None and report.dtype in rates.matmul_gflops:
        bound = roofline(report, rates)
        data["roofline"] = {
            "compute_s": bound.compute_s,
            "memory_s": bound.memory_s,
            "bound_s": bound.bound_s,
            "bound_by": bound.bound_by,
            "arithmetic_intensity": bound.arithmetic_intensity,
            "ridge_point": bound.ridge_point,
            "rates": {
                "matmul_gflops": rates.matmul_gflops,
                "bandwidth_gbs": rates.bandwidth_gbs,
                "source": rates_source or f"measured {rates.measured_at}",
            },
        }
    return data


def plot_cost(
    shape: LayerShape,
    path: Path,
    *,
    seq: int,
    batch: int,
    dtype: str,
    mode: str,
    causal: bool = False,
    argument: str = "path",
) -> Path:
    """FLOPs by term and peak memory against the sequence length n (self-attention), log-log.

    ``path``'s folder is created; a path that cannot be written raises ValueError naming ``argument``
    (the CLI passes "--plot"). Without matplotlib: MissingExtraError naming the extra to install.
    """
    plt = pyplot("multihead cost --plot")
    output_folder(argument, path.parent)
    n_star = crossover(shape)
    top = max(4 * seq, int(8 * n_star), 256)  # a tiny layer's crossover is below 16: still draw a range
    lengths = sorted({int(16 * 2 ** (k / 4)) for k in range(200) if 16 * 2 ** (k / 4) <= top})
    reports = [estimate(shape, seq=n, batch=batch, dtype=dtype, mode=mode, causal=causal) for n in lengths]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups = {
        "projections (Q/K/V + output)": ("Q/K/V projections", "output projection"),
        "Q K^T + weights x V": ("Q K^T", "weights x V"),
        "softmax": ("softmax",),
    }
    for label, terms in groups.items():
        left.plot(lengths, [sum(r.per_term[t] for t in terms) for r in reports], label=label)
    left.plot(lengths, [r.total_flops for r in reports], "k--", label="total", linewidth=1)
    left.axvline(n_star, color="grey", linestyle=":", label=f"crossover n = {n_star:.0f}")
    left.axvline(seq, color="red", linestyle="-", alpha=0.4, label=f"your n = {seq}")
    left.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel="FLOPs")
    fitted_title(left, f"FLOPs ({mode})")
    left.legend(fontsize=8)
    right.plot(lengths, [r.bytes.peak / 2**20 for r in reports], label="peak allocated")
    right.plot(lengths, [r.bytes.weights / 2**20 for r in reports], label="parameters")
    right.plot(
        lengths,
        [
            estimate(shape, seq=n, batch=batch, dtype=dtype, need_weights=True).bytes.attention_weights / 2**20
            for n in lengths
        ],
        label="(b, h, n, n) weights if returned",
    )
    right.axvline(seq, color="red", linestyle="-", alpha=0.4)
    right.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel="MiB")
    fitted_title(right, f"memory ({dtype})")
    right.legend(fontsize=8)
    s = shape
    fitted_title(
        figure,
        f"multihead cost: embed_dim {s.embed_dim}, {s.h} heads"
        + (f" ({s.g} kv heads)" if s.g != s.h else "")
        + f", batch {batch}",
        fontsize=10,
    )
    with writing(argument, path):
        return save_figure(figure, path)
