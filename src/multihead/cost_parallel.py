"""What a self-attention layer split across ranks costs per rank: FLOPs, memory, bytes sent, and the time with
communication, for the three splits of :mod:`multihead.parallel`.

P = tp x cp ranks. Head parallelism over tp = t ranks (:func:`multihead.parallel.shard_heads`) gives each rank
h/t query heads and g/t key/value heads; sequence parallelism over cp = c ranks (``ring_attention``,
``ulysses_attention``) gives each rank m = n/c positions. With both, a rank holds h/t heads of n/c positions, and
the sequence ranks of one head shard form a ring (or an all-to-all group) of their own.

Bytes each rank sends per call (itemsize s, local heads h' = h/t and g' = g/t)::

    tp       forward  one all-reduce of the output (b, m, out_dim)       2 (t - 1)/t  b m out_dim s
             backward one all-reduce of the input gradient (b, m, D)      2 (t - 1)/t  b m D s
    ulysses  forward  4 all-to-alls (q, k, v to head shards, output back): (c - 1)/c  b m (h' d + G d + G e + h' e) s
             backward the same 4, transposed                              (G = g', or c when kv heads are replicated)
    ring     forward  c - 1 K/V shards round the ring                    (c - 1)  b g' m (d + e) s
             backward K/V again, with their dK/dV coming home             (2c - 1) b g' m (d + e) s

An all-reduce is counted as the ring algorithm's (a reduce-scatter, then an all-gather: 2 (t - 1)/t of the
tensor per rank); ``benchmarks/parallel.py`` measures what gloo really sends on loopback against these.

FLOPs per rank are the single-process layer's needed FLOPs (:attr:`CostReport.needed_flops`: causally masked pairs
skipped) over P: zigzag ring attention and Ulysses balance causal work evenly. Ring attention's backward recomputes
each block's forward (it keeps O(n/P) per rank, not the K/V of the whole sequence), so its backward adds the
attention's forward FLOPs once more.

Time (:func:`parallel_time`) is a bandwidth-only model (no per-message latency): the rank's roofline bound on its
own work, plus the communication that is not hidden. Head parallelism and Ulysses communicate between steps, so
all of theirs is exposed; ring attention sends the next K/V block while it attends to the one it holds, so only
what a block's send takes longer than its compute is exposed, and the last dK/dV send of the backward.

Example:
    >>> from multihead.cost import LayerShape
    >>> from multihead.cost_parallel import parallel_cost
    >>> cost = parallel_cost(LayerShape(512, 8), seq=4096, cp=4, cp_method="ring", causal=True)
    >>> cost.sent_bytes["forward"] == 3 * 1 * 8 * 1024 * (64 + 64) * 4     # (c - 1) K/V shards of 4 MiB
    True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from multihead._errors import bad_argument, describe, positive_int
from multihead.cost import (
    DTYPES,
    MODES,
    QUADRATIC_TERMS,
    CostReport,
    LayerShape,
    MachineRates,
    Roofline,
    bound,
    compute_rate,
    dtype_name,
    estimate,
)
from multihead.parallel.split import check_head_split, check_sequence_split, ulysses_kv_heads

__all__ = [
    "CP_METHODS",
    "ParallelCost",
    "ParallelTime",
    "check_head_split",
    "check_sequence_split",
    "parallel_cost",
    "parallel_time",
    "ulysses_kv_heads",
]

CP_METHODS = ("ring", "ulysses")


@dataclass(frozen=True)
class ParallelCost:
    """Per-rank cost of one call of a self-attention layer over tp x cp ranks (:func:`parallel_cost`)."""

    report: CostReport  # the single-process layer's cost, for comparison
    tp: int
    cp: int
    cp_method: str
    heads_per_rank: int  # h / tp
    kv_heads_per_rank: int  # g / tp
    positions_per_rank: int  # n / cp
    flops: int  # needed FLOPs of one rank (forward, plus backward in forward+backward mode)
    attention_flops: dict[str, int]  # one rank's needed n x n FLOPs: "forward", "backward" (ring: with recompute)
    traffic: int  # one rank's least memory traffic: its parameters, inputs and outputs once
    weight_bytes: int  # the parameters one rank holds
    peak_bytes: int  # one rank's peak allocation, modelled (the layer's on n/cp positions and h/tp heads + buffers)
    sent_bytes: dict[str, int]  # bytes each rank sends: "forward", "backward" (0 in forward mode)
    collectives: dict[str, int]  # per call and rank: "all_reduce", "all_to_all", "send" (ring point-to-point)
    kv_shard_bytes: int  # one rank's K/V block, b g' m (d + e) s: what one ring step sends
    all_reduce_bytes: int  # the part of sent_bytes (forward and backward) that head parallelism's all-reduces send

    @property
    def world_size(self) -> int:
        return self.tp * self.cp

    @property
    def total_sent_bytes(self) -> int:
        return self.sent_bytes["forward"] + self.sent_bytes["backward"]

    def as_dict(self) -> dict:
        data = asdict(self)
        data.pop("report")
        data["world_size"] = self.world_size
        return data


def _ring_all_reduce_bytes(elements: int, ranks: int, itemsize: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``elements``: 2 (P - 1)/P of the tensor."""
    return 2 * (ranks - 1) * elements * itemsize // ranks


def _check_parallel_options(shape: LayerShape, tp: int, cp: int, cp_method: str, layout: str, mode: str) -> None:
    """The arguments of :func:`parallel_cost` that ``estimate`` and the split checks do not see, in order."""
    if not isinstance(shape, LayerShape):
        raise bad_argument(
            "shape", "a multihead.cost.LayerShape", describe(shape), "build one with LayerShape(D, h)", kind=TypeError
        )
    if not shape.self_attention_only:
        raise bad_argument(
            "shape",
            "a self-attention layer (kdim = vdim = embed_dim)",
            f"kdim = {shape.kv_in[0]}, vdim = {shape.kv_in[1]}",
            "model cross-attention with multihead.cost.estimate on one process",
        )
    positive_int("tp", tp)
    positive_int("cp", cp)
    if cp_method not in CP_METHODS:
        raise bad_argument("cp_method", f"one of {CP_METHODS}", repr(cp_method), 'pass cp_method="ring"')
    if layout not in ("zigzag", "contiguous"):
        raise bad_argument("layout", '"zigzag" or "contiguous"', repr(layout), 'pass layout="zigzag"')
    if mode not in MODES or mode == "decode":
        raise bad_argument(
            "mode", '"forward" or "forward+backward"', repr(mode), "model a decode step with multihead.cost.estimate"
        )


def _rank_attention_flops(report: CostReport, world: int, recompute: bool) -> tuple[int, dict[str, int]]:
    """(needed FLOPs of one rank, its n x n FLOPs by "forward" / "backward"): the layer's split evenly over
    ``world`` ranks, the attention's forward counted once more in the backward when ``recompute`` (ring)."""
    attention_forward = round(report.attended_fraction * sum(report.flops[term] for term in QUADRATIC_TERMS))
    attention_backward = round(report.attended_fraction * sum(report.backward_flops[term] for term in QUADRATIC_TERMS))
    extra = attention_forward if recompute else 0
    flops = (report.needed_flops + extra) // world
    return flops, {"forward": attention_forward // world, "backward": (attention_backward + extra) // world}


@dataclass
class _Communication:
    """What one rank sends per call, and the buffers the sends and receives add to its peak."""

    sent: dict[str, int]  # bytes by "forward", "backward"
    collectives: dict[str, int]  # by "all_reduce", "all_to_all", "send"
    buffers: int  # bytes
    kv_shard: int  # one rank's K/V block, b g' m (d + e) s: what one ring step sends
    all_reduce_bytes: int  # the part of sent that head parallelism's all-reduces send


def _communication(
    shape: LayerShape,
    *,
    b: int,
    m: int,
    hl: int,
    gl: int,
    s: int,
    tp: int,
    cp: int,
    cp_method: str,
    backward: bool,
) -> _Communication:
    """One rank's sends for b sequences of m local positions with hl query and gl key/value heads of itemsize s
    (the formulas of the module docstring)."""
    d, e = shape.d, shape.e
    sent = {"forward": 0, "backward": 0}
    collectives = {"all_reduce": 0, "all_to_all": 0, "send": 0}
    q_shard, out_shard = b * m * hl * d * s, b * m * hl * e * s
    kv_shard = b * gl * m * (d + e) * s
    buffers = all_reduce_bytes = 0
    if tp > 1:
        sent["forward"] += _ring_all_reduce_bytes(b * m * shape.out, tp, s)
        collectives["all_reduce"] += 1
        buffers = b * m * shape.out * s  # the all-reduced output is a new tensor
        if backward:
            sent["backward"] += _ring_all_reduce_bytes(b * m * shape.embed_dim, tp, s)
            collectives["all_reduce"] += 1
        all_reduce_bytes = sent["forward"] + sent["backward"]
    if cp > 1 and cp_method == "ulysses":
        sent_kv = ulysses_kv_heads(hl, gl, cp, q_argument="cp", kv_argument="cp")
        exchanged = q_shard + out_shard + b * m * sent_kv * (d + e) * s
        sent["forward"] += (cp - 1) * exchanged // cp
        collectives["all_to_all"] += 4
        buffers += 2 * exchanged  # each exchange's contiguous send buffer and what it receives
        if backward:
            sent["backward"] += (cp - 1) * exchanged // cp
            collectives["all_to_all"] += 4
    elif cp > 1:
        sent["forward"] += (cp - 1) * kv_shard
        collectives["send"] += cp - 1
        buffers += 2 * kv_shard + 2 * out_shard  # the block held and the one arriving; the merge's partials
        if backward:
            sent["backward"] += (2 * cp - 1) * kv_shard
            collectives["send"] += 2 * cp - 1
            buffers += 2 * kv_shard  # the dK/dV travelling with the block, and the one arriving
    return _Communication(sent, collectives, buffers, kv_shard, all_reduce_bytes)


def parallel_cost(
    shape: LayerShape,
    *,
    seq: int,
    batch: int = 1,
    causal: bool = False,
    dtype: str = "float32",
    mode: str = "forward",
    tp: int = 1,
    cp: int = 1,
    cp_method: str = "ring",
    layout: str = "zigzag",
) -> ParallelCost:
    """Per-rank FLOPs, memory and communication of one self-attention call of a layer of ``shape`` on n = ``seq``
    positions over ``tp`` head-parallel x ``cp`` sequence-parallel ranks (formulas: the module docstring).

    Args:
        shape: the layer's sizes (self-attention: kdim = vdim = embed_dim).
        seq: n, the whole sequence; it must split into cp shards (2 cp with ``layout="zigzag"``).
        batch, causal, dtype, mode: as :func:`multihead.cost.estimate` ("forward" or "forward+backward").
        tp: ranks the heads are split over; it must divide h and g.
        cp: ranks the sequence is split over, with ``cp_method`` "ring" or "ulysses" (Ulysses: cp must divide h/tp,
            and divide g/tp or be a multiple of it).
        layout: "zigzag" or "contiguous", the sequence layout (only the divisibility of n depends on it).

    Returns:
        :class:`ParallelCost`.
    """
    _check_parallel_options(shape, tp, cp, cp_method, layout, mode)
    h, g, d, e = shape.h, shape.g, shape.d, shape.e
    check_head_split(h, g, tp, argument="tp")
    hl, gl = h // tp, g // tp
    m = check_sequence_split(seq, cp, parts_per_rank=2 if layout == "zigzag" and cp > 1 else 1)
    report = estimate(shape, seq=seq, batch=batch, causal=causal, dtype=dtype, mode=mode)
    s = DTYPES[dtype_name(dtype)].itemsize
    b, world = batch, tp * cp
    backward = mode == "forward+backward"

    # FLOPs: the layer's needed FLOPs split evenly; ring's backward recomputes the blocks' forward
    flops, attention_flops = _rank_attention_flops(report, world, recompute=backward and cp > 1 and cp_method == "ring")

    # Each rank's own layer: h/tp heads on n/cp positions (its parameters, activations, kernel buffers)
    local_shape = LayerShape(
        shape.embed_dim,
        hl,
        num_kv_heads=gl,
        head_dim=d,
        value_head_dim=e,
        out_dim=shape.out,
        bias=shape.bias,
    )
    local = estimate(local_shape, seq=m, batch=b, causal=causal, dtype=dtype, mode=mode)
    weight_bytes = local.bytes.weights
    traffic = weight_bytes + b * m * (shape.embed_dim + shape.out) * s

    sends = _communication(shape, b=b, m=m, hl=hl, gl=gl, s=s, tp=tp, cp=cp, cp_method=cp_method, backward=backward)
    return ParallelCost(
        report=report,
        tp=tp,
        cp=cp,
        cp_method=cp_method,
        heads_per_rank=hl,
        kv_heads_per_rank=gl,
        positions_per_rank=m,
        flops=flops,
        attention_flops=attention_flops,
        traffic=traffic,
        weight_bytes=weight_bytes,
        peak_bytes=local.bytes.peak + sends.buffers,
        sent_bytes=sends.sent,
        collectives=sends.collectives,
        kv_shard_bytes=sends.kv_shard,
        all_reduce_bytes=sends.all_reduce_bytes,
    )


@dataclass(frozen=True)
class ParallelTime:
    """The least time one rank takes for the call, communication included (:func:`parallel_time`)."""

    local: Roofline  # the rank's own work: its FLOPs at the compute rate, its traffic at the memory bandwidth
    communication_s: float  # every byte the rank sends at the link bandwidth
    exposed_s: float  # the part of it not hidden behind compute
    total_s: float  # local.bound_s + exposed_s
    hidden: bool  # ring only: each block's send takes no longer than its compute (forward and backward)
    crossover_seq: float | None  # ring only: the n from which the sends hide behind compute (this P, b, shape)

    def as_dict(self) -> dict:
        data = asdict(self)
        data["local"] = asdict(self.local)
        return data


def parallel_time(
    cost: ParallelCost, rates: MachineRates, link_gbs: float, *, tp_link_gbs: float | None = None
) -> ParallelTime:
    """One rank's time for ``cost`` on a machine with ``rates`` (per device) and ``link_gbs`` GB/s per rank and
    direction between ranks (e.g. NVLink 4: 450; InfiniBand NDR, one 400 Gb/s NIC per GPU: 50). ``tp_link_gbs``
    is the head-parallel group's link when it differs (tensor parallelism inside a node on NVLink, the sequence
    across nodes on InfiniBand); by default ``link_gbs``.

    Ring attention overlaps step by step: a forward block's send (t_s = K/V shard / link) runs while the rank
    attends to the block it holds (t_b = its attention FLOPs / c at the compute rate), so each of the c - 1 steps
    exposes max(0, t_s - t_b); in the backward each step sends K/V and dK/dV (2 t_s) against the block's backward
    (recompute included), and the last dK/dV send is exposed. Since t_b grows as n^2 and t_s as n, the sends hide
    from n* = n t_s / t_b on (``crossover_seq``, forward; the backward's is lower or equal when its compute is at
    least twice the forward's). Head parallelism's all-reduces and Ulysses' all-to-alls sit between computations:
    all of their time is exposed.
    """
    for name, value in (("link_gbs", link_gbs), ("tp_link_gbs", tp_link_gbs)):
        if value is None and name == "tp_link_gbs":
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise bad_argument(name, "a positive bandwidth in GB/s", describe(value), f"pass e.g. {name}=450")
    local = bound(cost.flops, cost.traffic, cost.report.dtype, rates)
    link = link_gbs * 1e9
    tp_link = (tp_link_gbs or link_gbs) * 1e9
    all_reduce_s = cost.all_reduce_bytes / tp_link  # between computations: never hidden
    communication = (cost.total_sent_bytes - cost.all_reduce_bytes) / link + all_reduce_s
    hidden, crossover = False, None
    if cost.cp > 1 and cost.cp_method == "ring":
        flop_rate = compute_rate(cost.report.dtype, rates) * 1e9
        c = cost.cp
        t_send = cost.kv_shard_bytes / link
        t_block = cost.attention_flops["forward"] / c / flop_rate
        exposed = (c - 1) * max(0.0, t_send - t_block)
        hidden = t_send <= t_block
        if cost.report.mode == "forward+backward":
            t_block_back = cost.attention_flops["backward"] / c / flop_rate
            exposed += (c - 1) * max(0.0, 2 * t_send - t_block_back) + t_send
            hidden = hidden and 2 * t_send <= t_block_back
        crossover = cost.report.q_len * t_send / t_block if t_block > 0 else None
        exposed += all_reduce_s
    else:
        exposed = communication
    return ParallelTime(local, communication, exposed, local.bound_s + exposed, hidden, crossover)
