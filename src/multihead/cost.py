"""What a multi-head attention layer costs, counted exactly: parameters, FLOPs, bytes, and a roofline.

For a layer with query heads h, key/value heads g, head sizes d (query/key) and e (value),
embed_dim D, kdim / vdim, out_dim O, batch b, query length i and key length j:

    parameters   W^Q D x hd, W^K kdim x gd, W^V vdim x ge, W^O he x O (+ biases hd, gd, ge, O)
    Q/K/V proj.  2 b (i D hd + j kdim gd + j vdim ge)          (a multiply-add is 2 FLOPs)
    Q K^T        2 b h i j d
    softmax      5 b h i j         (scale, max, subtract-and-exp, sum, divide: a convention, see below)
    weights x V  2 b h i j e
    output proj. 2 b i he O

The matmul terms are exactly what ``torch.utils.flop_counter.FlopCounterMode`` counts on the
layer (tested). Causal masking does not change them: dense kernels compute every pair; the
report gives the share of pairs a block-skipping kernel needs (``attended_fraction``).
Elementwise work (softmax, bias adds) is not counted by FlopCounterMode; we count softmax as 5
FLOPs per score forward and 4 backward (dS = P * (dP - rowsum(dP * P))), and leave bias adds out.

Backward costs twice the forward matmuls (a gradient for each operand: the projection's input
and weight; dQ, dK from dS, and dV, dP from dO), except that the first projection needs no
input gradient when the layer's input does not require one.

Bytes are the tensors the layer allocates (see :class:`Bytes`); ``peak`` models multihead's own
layer on the CPU (fused QKV projection, torch SDPA, the materialized kernel when every weight is
asked for) and is checked within 10% of the measured peak in the tests.

Example:
    >>> from multihead.cost import LayerShape, estimate
    >>> report = estimate(LayerShape(512, 8), seq=2048)
    >>> report.params.weights                       # 4 d^2
    1048576
    >>> report.dominant
    'Q K^T'
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from multihead._errors import InputError, bad_argument, describe, positive_int
from multihead._userfiles import (
    ANY_OBJECT,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    STRING,
    MapOf,
    OptionalKey,
    path_kind,
    read_json,
)

__all__ = [
    "LayerShape",
    "Params",
    "Bytes",
    "CostReport",
    "MachineRates",
    "Roofline",
    "estimate",
    "roofline",
    "crossover",
    "bound",
    "compute_rate",
    "attention_kernel_cost",
    "measure_peak_bytes",
    "calibrate",
    "load_calibration",
    "read_calibration",
    "save_calibration",
    "calibration_path",
    "DTYPES",
    "MODES",
    "SOFTMAX_FLOPS_FORWARD",
    "SOFTMAX_FLOPS_BACKWARD",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
MODES = ("forward", "forward+backward", "decode")
SOFTMAX_FLOPS_FORWARD = 5  # per score: scale, running max, subtract-and-exp, sum, divide
SOFTMAX_FLOPS_BACKWARD = 4  # per score: dP * P, row sum, subtract, times P
LSE_BYTES = 4  # torch's CPU SDPA keeps a float32 log-sum-exp per query row

TERMS = ("Q/K/V projections", "Q K^T", "softmax", "weights x V", "output projection")
QUADRATIC_TERMS = ("Q K^T", "softmax", "weights x V")  # the n x n terms; the rest scale with n


@dataclass(frozen=True)
class LayerShape:
    """The sizes of a :class:`multihead.MultiHeadAttention` (same names and defaults).

    ``head_dim`` defaults to embed_dim / num_heads, ``value_head_dim`` to head_dim, ``num_kv_heads``
    to num_heads, kdim / vdim / out_dim to embed_dim.
    """

    embed_dim: int
    num_heads: int
    num_kv_heads: int | None = None
    kdim: int | None = None
    vdim: int | None = None
    head_dim: int | None = None
    value_head_dim: int | None = None
    out_dim: int | None = None
    bias: bool = True

    def __post_init__(self):
        positive_int("embed_dim", self.embed_dim)
        positive_int("num_heads", self.num_heads)
        for name in ("num_kv_heads", "kdim", "vdim", "head_dim", "value_head_dim", "out_dim"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.head_dim is None and self.embed_dim % self.num_heads:
            raise bad_argument(
                "num_heads",
                f"a divisor of embed_dim = {self.embed_dim}",
                self.num_heads,
                "pick heads that divide embed_dim, or give head_dim",
            )
        if self.num_heads % self.g:
            divisors = [n for n in range(1, self.num_heads + 1) if self.num_heads % n == 0]
            raise bad_argument(
                "num_kv_heads", f"a divisor of num_heads = {self.num_heads}", self.g, f"use one of {divisors}"
            )
        if not isinstance(self.bias, bool):
            raise bad_argument("bias", "True or False", describe(self.bias), "pass bias=True", kind=TypeError)

    # the axis letters of multihead's docstrings
    @property
    def h(self) -> int:
        return self.num_heads

    @property
    def g(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def d(self) -> int:
        return self.head_dim or self.embed_dim // self.num_heads

    @property
    def e(self) -> int:
        return self.value_head_dim or self.d

    @property
    def kv_in(self) -> tuple[int, int]:
        return (self.kdim or self.embed_dim, self.vdim or self.embed_dim)

    @property
    def out(self) -> int:
        return self.out_dim or self.embed_dim

    @property
    def self_attention_only(self) -> bool:
        """kdim = vdim = embed_dim: the layer can fuse the three projections into one matmul."""
        return self.kv_in == (self.embed_dim, self.embed_dim)

    @classmethod
    def of(cls, layer) -> LayerShape:
        """The shape of an existing :class:`multihead.MultiHeadAttention`."""
        return cls(
            layer.embed_dim,
            layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            kdim=layer.kdim,
            vdim=layer.vdim,
            head_dim=layer.head_dim,
            value_head_dim=layer.value_head_dim,
            out_dim=layer.out_dim,
            bias=layer.q_proj.bias is not None,
        )


@dataclass(frozen=True)
class Params:
    """Parameter counts: ``weights`` (the four matrices) and ``biases``; ``per_projection`` by name."""

    weights: int
    biases: int
    per_projection: dict[str, int]

    @property
    def total(self) -> int:
        return self.weights + self.biases


@dataclass(frozen=True)
class Bytes:
    """Memory in bytes.

    weights: the parameters. activations: tensors the forward pass allocates and keeps until its
    end (projected q/k/v, per-head outputs, the output). saved_for_backward: what autograd keeps
    for the backward pass (zero in forward mode). kv_cache: the cache storage (decode mode).
    attention_weights: the (b, h, i, j) weights if materialised (asked for), else 0.
    peak: the most the layer has allocated at once on top of its inputs and parameters
    (multihead's CPU implementation; see the module docstring).
    """

    weights: int
    activations: int
    saved_for_backward: int
    kv_cache: int
    attention_weights: int
    peak: int
    traffic: int  # the least memory traffic: parameters, inputs and outputs read or written once


@dataclass(frozen=True)
class CostReport:
    """Everything :func:`estimate` counts for one configuration."""

    shape: LayerShape
    batch: int
    q_len: int
    k_len: int
    causal: bool
    dtype: str
    mode: str
    need_weights: bool
    params: Params
    flops: dict[str, int]  # forward FLOPs by term (TERMS)
    backward_flops: dict[str, int]  # zero unless mode is forward+backward
    bytes: Bytes
    shapes: dict[str, tuple[int, ...]]
    attended_fraction: float  # share of (i, j) pairs not masked by causal

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values()) + sum(self.backward_flops.values())

    @property
    def per_term(self) -> dict[str, int]:
        """FLOPs by term, forward and backward together."""
        return {term: self.flops[term] + self.backward_flops[term] for term in TERMS}

    @property
    def matmul_flops(self) -> int:
        """Forward and backward FLOPs of the matmuls only (what FlopCounterMode counts)."""
        return sum(v for term, v in self.per_term.items() if term != "softmax")

    @property
    def needed_flops(self) -> int:
        """FLOPs a kernel that skips causally masked pairs must still do: the n x n terms scaled by
        ``attended_fraction`` (the roofline's compute bound uses this)."""
        both = self.per_term
        return round(
            sum(v for term, v in both.items() if term not in QUADRATIC_TERMS)
            + self.attended_fraction * sum(both[term] for term in QUADRATIC_TERMS)
        )

    @property
    def dominant(self) -> str:
        """The term with the most FLOPs (forward and backward together)."""
        both = self.per_term
        return max(both, key=both.get)

    def as_dict(self) -> dict:
        return {
            "shape": asdict(self.shape),
            "batch": self.batch,
            "q_len": self.q_len,
            "k_len": self.k_len,
            "causal": self.causal,
            "dtype": self.dtype,
            "mode": self.mode,
            "need_weights": self.need_weights,
            "params": {
                "weights": self.params.weights,
                "biases": self.params.biases,
                "total": self.params.total,
                "per_projection": self.params.per_projection,
            },
            "flops": self.flops,
            "backward_flops": self.backward_flops,
            "total_flops": self.total_flops,
            "matmul_flops": self.matmul_flops,
            "dominant": self.dominant,
            "bytes": asdict(self.bytes),
            "shapes": {k: list(v) for k, v in self.shapes.items()},
            "attended_fraction": self.attended_fraction,
        }


def _dtype_name(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        for name, value in DTYPES.items():
            if value == dtype:
                return name
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    raise bad_argument("dtype", f"one of {', '.join(DTYPES)}", repr(dtype), "pass e.g. dtype='float32'")


def _attended_pairs(i: int, j: int, causal: bool) -> int:
    """(query, key) pairs a bottom-right causal mask keeps: query t sees keys 0 .. t + j - i."""
    if not causal:
        return i * j
    first = j - i + 1  # keys seen by query 0 (can be <= 0 when there are more queries than keys)
    start = max(0, 1 - first)  # the first query that sees any key
    rows = i - start
    return rows * (2 * first + start + i - 1) // 2 if rows > 0 else 0


def estimate(
    shape: LayerShape,
    *,
    seq: int,
    kv_seq: int | None = None,
    batch: int = 1,
    causal: bool = False,
    dtype: str | torch.dtype = "float32",
    mode: str = "forward",
    cache_len: int | None = None,
    need_weights: bool = False,
    input_requires_grad: bool = True,
) -> CostReport:
    """Count the cost of one call of a layer of ``shape``.

    Args:
        shape: the layer's sizes (:class:`LayerShape`, or ``LayerShape.of(layer)``).
        seq: query length i (in decode mode, the tokens added this step, usually 1).
        kv_seq: key length j for cross-attention (default: seq; in decode mode cache_len + seq).
        batch: b.
        causal: bottom-right causal mask (changes ``attended_fraction``, not the dense FLOPs).
        dtype: float32, bfloat16, float16 or float64 (bytes per element).
        mode: "forward", "forward+backward" (a training step) or "decode" (one step with a cache
            holding ``cache_len`` earlier tokens).
        cache_len: tokens already in the cache (decode mode only).
        need_weights: the (b, h, i, j) weights are materialised and returned.
        input_requires_grad: in forward+backward, whether the layer's inputs (query, and key and value
            for cross-attention) need a gradient.

    Returns:
        :class:`CostReport`.
    """
    if not isinstance(shape, LayerShape):
        raise bad_argument(
            "shape",
            "a multihead.cost.LayerShape",
            describe(shape),
            "build one with LayerShape(embed_dim, num_heads) or LayerShape.of(layer)",
            kind=TypeError,
        )
    positive_int("seq", seq)
    positive_int("batch", batch)
    if kv_seq is not None:
        positive_int("kv_seq", kv_seq)
    if mode not in MODES:
        raise bad_argument("mode", f"one of {', '.join(MODES)}", repr(mode), "pass e.g. mode='forward'")
    if mode == "decode":
        if cache_len is None or isinstance(cache_len, bool) or not isinstance(cache_len, int) or cache_len < 0:
            raise bad_argument(
                "cache_len",
                "the number of cached tokens (int >= 0) in decode mode",
                describe(cache_len),
                "pass e.g. cache_len=2048",
            )
        if kv_seq is not None:
            raise bad_argument(
                "kv_seq",
                "None in decode mode (keys are the cache plus the new tokens)",
                kv_seq,
                "drop kv_seq, or use mode='forward' for cross-attention",
            )
    elif cache_len is not None:
        raise bad_argument("cache_len", "None outside decode mode", cache_len, "pass mode='decode' with a cache")
    name = _dtype_name(dtype)
    size = torch.empty((), dtype=DTYPES[name]).element_size()
    s = shape
    b, i = batch, seq
    j = (cache_len + seq) if mode == "decode" else (kv_seq or seq)
    new_kv = seq if mode == "decode" else j  # keys/values projected this call
    h, g, d, e, D, O = s.h, s.g, s.d, s.e, s.embed_dim, s.out
    kdim, vdim = s.kv_in
    cross = kv_seq is not None and mode != "decode"

    per_projection = {"W^Q": D * h * d, "W^K": kdim * g * d, "W^V": vdim * g * e, "W^O": h * e * O}
    biases = (h * d + g * d + g * e + O) if s.bias else 0
    params = Params(sum(per_projection.values()), biases, per_projection)

    flops = {
        "Q/K/V projections": 2 * b * (i * D * h * d + new_kv * kdim * g * d + new_kv * vdim * g * e),
        "Q K^T": 2 * b * h * i * j * d,
        "softmax": SOFTMAX_FLOPS_FORWARD * b * h * i * j,
        "weights x V": 2 * b * h * i * j * e,
        "output projection": 2 * b * i * h * e * O,
    }
    backward = {term: 0 for term in TERMS}
    if mode == "forward+backward":
        q_input_grad = 2 * b * i * D * h * d if input_requires_grad else 0
        kv_input_grad = 2 * b * new_kv * (kdim * g * d + vdim * g * e) if input_requires_grad else 0
        backward = {
            "Q/K/V projections": flops["Q/K/V projections"] + q_input_grad + kv_input_grad,  # dW always, dX if needed
            "Q K^T": 2 * flops["Q K^T"],  # dQ = dS K, dK = dS^T Q
            "softmax": SOFTMAX_FLOPS_BACKWARD * b * h * i * j,
            "weights x V": 2 * flops["weights x V"],  # dP = dO V^T, dV = P^T dO
            "output projection": 2 * flops["output projection"],  # dW and the per-head outputs' gradient
        }

    shapes = {
        "q": (b, h, i, d),
        "k": (b, g, j, d),
        "v": (b, g, j, e),
        "scores": (b, h, i, j),
        "weights": (b, h, i, j),
        "head outputs": (b, h, i, e),
        "concatenated": (b, i, h * e),
        "output": (b, i, O),
    }
    q_bytes, kv_bytes = b * i * h * d * size, b * new_kv * g * (d + e) * size
    head_out, out = b * i * h * e * size, b * i * O * size
    weights_bytes = b * h * i * j * size if need_weights else 0
    lse = b * h * i * LSE_BYTES
    activations = q_bytes + kv_bytes + head_out + out + weights_bytes
    cache = b * g * j * (d + e) * size if mode == "decode" else 0
    # The fused QKV matmul stacks W^Q, W^K, W^V for the call; the materialized kernel writes its output
    # in (b, h, i, e) order, so concatenating the heads copies it once more.
    stacked = (
        (per_projection["W^Q"] + per_projection["W^K"] + per_projection["W^V"]) * size
        if s.self_attention_only and not cross
        else 0
    )
    concat_copy = head_out if need_weights else 0
    forward_peak = max(stacked + q_bytes + kv_bytes, activations + concat_copy + (0 if need_weights else lse))
    saved = 0
    peak = forward_peak
    if mode == "forward+backward":
        # Kept for backward: the projections' outputs, the per-head outputs, the LSE, and the stacked QKV
        # weight when the input needs a gradient (its matmul saves it for dX). Not the output: the layer
        # does not keep it (whatever consumes it decides), so it is not counted at the backward peak.
        saved = activations - out + lse + concat_copy + (stacked if input_requires_grad else 0)
        # The peak comes inside the attention's backward: d(head outputs) and dW^O from the output
        # projection's backward, then dQ, dK, dV and one key-sized buffer of SDPA's CPU backward.
        # The materialized kernel (need_weights) also keeps the weights and makes dS of their size.
        gradients = (
            head_out + b * h * i * d * size + b * g * j * (2 * d + e) * size + (weights_bytes if need_weights else 0)
        )
        output_projection_grads = per_projection["W^O"] * size + (O * size if s.bias else 0)
        peak = max(forward_peak + lse, saved + gradients + output_projection_grads)
    elif mode == "decode":
        peak = forward_peak  # the cache exists before the step; the step's own tensors are this small
    traffic = (
        params.total * size
        + b * i * D * size
        + (b * new_kv * (kdim + vdim) * size if cross else 0)
        + out
        + weights_bytes
        + (cache if mode == "decode" else 0)
    )
    return CostReport(
        s,
        b,
        i,
        j,
        causal,
        name,
        mode,
        need_weights,
        params,
        flops,
        backward,
        Bytes(params.total * size, activations, saved, cache, weights_bytes, peak, traffic),
        shapes,
        _attended_pairs(i, j, causal) / (i * j),
    )


def crossover(shape: LayerShape) -> float:
    """The self-attention length n at which the n x n terms (Q K^T, softmax, weights x V) cost as
    many forward FLOPs as the four projections.

    Per token the projections cost 2 (D hd + kdim gd + vdim ge + he O) and the n x n terms
    (2d + 5 + 2e) h n, so n* = 2 (D hd + kdim gd + vdim ge + he O) / ((2d + 5 + 2e) h). For the
    classic layer (d = e = D / h) this is about 2D: the textbook's "n = d" compares one n^2 d term
    with one n d^2 term.
    """
    kdim, vdim = shape.kv_in
    projections = 2 * (
        shape.embed_dim * shape.h * shape.d
        + kdim * shape.g * shape.d
        + vdim * shape.g * shape.e
        + shape.h * shape.e * shape.out
    )
    return projections / ((2 * shape.d + SOFTMAX_FLOPS_FORWARD + 2 * shape.e) * shape.h)


# ----------------------------------------------------------------------------- the machine


@dataclass(frozen=True)
class MachineRates:
    """Measured rates of this machine: dense matmul GFLOP/s per dtype, and memory bandwidth in GB/s."""

    matmul_gflops: dict[str, float]
    bandwidth_gbs: float
    threads: int
    measured_at: str = ""
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Roofline:
    """The least time a configuration can take here, and what bounds it."""

    compute_s: float  # all FLOPs at the measured matmul rate
    memory_s: float  # the least traffic at the measured bandwidth
    bound_s: float  # the larger of the two
    bound_by: str  # "compute" or "memory"
    arithmetic_intensity: float  # FLOPs per byte of least traffic
    ridge_point: float  # the intensity at which the machine turns compute-bound


def roofline(report: CostReport, rates: MachineRates) -> Roofline:
    """Lower-bound time of ``report``'s call on a machine with ``rates`` (the roofline model).

    Compute time counts the needed FLOPs (softmax included, masked pairs skipped) at the dense
    matmul rate, so it is a lower bound; memory time is the least traffic (:attr:`Bytes.traffic`)
    at the copy bandwidth.
    """
    return bound(report.needed_flops, report.bytes.traffic, report.dtype, rates)


def bound(flops: float, traffic: float, dtype: str, rates: MachineRates) -> Roofline:
    """The roofline bound of ``flops`` FLOPs moving ``traffic`` bytes in ``dtype`` at ``rates``."""
    if dtype not in rates.matmul_gflops:
        raise bad_argument(
            "dtype",
            f"one of the calibrated dtypes {sorted(rates.matmul_gflops)}",
            dtype,
            f"run `multihead bench --calibrate --dtype {dtype}`",
        )
    flop_rate = compute_rate(dtype, rates) * 1e9
    byte_rate = rates.bandwidth_gbs * 1e9
    compute_s, memory_s = flops / flop_rate, traffic / byte_rate
    return Roofline(
        compute_s,
        memory_s,
        max(compute_s, memory_s),
        "compute" if compute_s >= memory_s else "memory",
        flops / traffic,
        flop_rate / byte_rate,
    )


def compute_rate(dtype: str, rates: MachineRates) -> float:
    """The compute ceiling in GFLOP/s for work in ``dtype``: its calibrated matmul rate, and for a half
    type at least the float32 rate, since half-precision work can always be done in float32 (multihead's
    kernels do so on CPUs without half-precision units, where a bfloat16 matmul runs at a few GFLOP/s)."""
    rate = rates.matmul_gflops[dtype]
    if dtype in ("bfloat16", "float16") and "float32" in rates.matmul_gflops:
        rate = max(rate, rates.matmul_gflops["float32"])
    return rate


def attention_kernel_cost(
    *,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    head_dim: int,
    value_head_dim: int | None = None,
    kv_heads: int | None = None,
    causal: bool = False,
    dtype: str = "float32",
    mode: str = "forward",
) -> tuple[int, int]:
    """(needed FLOPs, least traffic in bytes) of the attention step alone, ``attention(q, k, v)``.

    FLOPs: Q K^T, softmax and weights x V (twice the matmuls and 4 per score backward), scaled by the
    causal attended fraction. Traffic: q, k, v read and the output written once; backward also reads
    the output's gradient and the LSE, and writes dq, dk, dv.
    """
    e = value_head_dim or head_dim
    g = kv_heads or heads
    size = torch.empty((), dtype=DTYPES[_dtype_name(dtype)]).element_size()
    scores = batch * heads * q_len * k_len * _attended_pairs(q_len, k_len, causal) / (q_len * k_len)
    flops = scores * (2 * head_dim + SOFTMAX_FLOPS_FORWARD + 2 * e)
    q, kv, out = batch * heads * q_len * head_dim, batch * g * k_len * (head_dim + e), batch * heads * q_len * e
    traffic = (q + kv + out) * size
    if mode == "forward+backward":
        flops += scores * (4 * head_dim + SOFTMAX_FLOPS_BACKWARD + 4 * e)
        traffic += (q + kv + 2 * out) * size + batch * heads * q_len * LSE_BYTES + (q + kv) * size
    return round(flops), traffic


def calibration_path() -> Path:
    """Where ``multihead bench --calibrate`` caches the rates ($MULTIHEAD_CACHE, else ~/.cache/multihead)."""
    root = os.environ.get("MULTIHEAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "multihead"
    )
    return Path(root) / "calibration.json"


def _best_seconds(step: Callable[[], object], repeats: int) -> float:
    step()  # warm-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate(
    dtypes: Sequence[str] = ("float32",), *, matmul_size: int = 2048, copy_mib: int = 256, repeats: int = 10
) -> MachineRates:
    """Measure this machine: a square matmul of ``matmul_size`` per dtype, and copying ``copy_mib`` MiB.

    The matmul rate is 2 n^3 / the best of ``repeats`` times; the bandwidth counts the bytes read
    plus the bytes written by ``dst.copy_(src)`` over its best time.
    """
    rates = {}
    for name in dtypes:
        dtype = DTYPES[_dtype_name(name)]
        n = matmul_size if dtype in (torch.float32, torch.float64) else min(matmul_size, 512)  # slow on CPUs
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out = torch.empty(n, n, dtype=dtype)
        rates[_dtype_name(name)] = 2 * n**3 / _best_seconds(lambda: torch.mm(a, b, out=out), repeats) / 1e9
    elements = copy_mib * 2**20 // 4
    src, dst = torch.randn(elements), torch.empty(elements)
    bandwidth = 2 * elements * 4 / _best_seconds(lambda: dst.copy_(src), repeats) / 1e9
    return MachineRates(
        rates,
        bandwidth,
        torch.get_num_threads(),
        time.strftime("%Y-%m-%d %H:%M:%S"),
        {"matmul_size": matmul_size, "copy_mib": copy_mib, "repeats": repeats, "torch": torch.__version__},
    )


def save_calibration(rates: MachineRates, path: Path | None = None) -> Path:
    target = path or calibration_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(asdict(rates), indent=1))
    return target


_CALIBRATION_SCHEMA = {
    "matmul_gflops": MapOf(POSITIVE_NUMBER, 1),
    "bandwidth_gbs": POSITIVE_NUMBER,
    "threads": POSITIVE_INT,
    "measured_at": OptionalKey(STRING),
    "details": OptionalKey(ANY_OBJECT),
}


def read_calibration(path: Path | None = None) -> tuple[MachineRates | None, str | None]:
    """(the cached rates or None, a note when a cache file was there but is unusable).

    The cache is ours, not the user's argument: a damaged one (not JSON, not UTF-8, fields missing
    or of the wrong type, rates that are not positive) counts as absent, and the note says why and
    how to measure again.
    """
    source = path or calibration_path()
    if path_kind(source) == "missing":
        return None, None
    try:
        data = read_json(
            "calibration cache",
            source,
            what="rates written by `multihead bench --calibrate`",
            schema=_CALIBRATION_SCHEMA,
            fix="run `multihead bench --calibrate` to measure them again",
        )
    except InputError as error:
        return None, f"ignored the calibration cache ({error})"
    return MachineRates(
        dict(data["matmul_gflops"]),
        float(data["bandwidth_gbs"]),
        int(data["threads"]),
        data.get("measured_at", ""),
        data.get("details", {}),
    ), None


def load_calibration(path: Path | None = None) -> MachineRates | None:
    """The cached rates, or None when this machine was not calibrated (or the cache is damaged:
    :func:`read_calibration` also says why)."""
    return read_calibration(path)[0]


def measure_peak_bytes(step: Callable[[], object]) -> int:
    """The most bytes the CPU allocator held at once during ``step()``, above what it held before.

    Read from torch.profiler's memory events (every allocation and free the CPU allocator reports),
    so it counts tensors, not the process's resident memory.
    """
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as directory:
        trace = Path(directory) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = [event["args"] for event in events if event.get("name") == "[memory]"]
    if not memory:
        return 0
    # "Total Allocated" is a running tally that outlives one profiling session: start from the value
    # just before this session's first event
    baseline = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return max(event["Total Allocated"] for event in memory) - baseline
