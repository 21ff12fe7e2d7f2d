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
layer on the CPU (fused QKV projection from FUSED_QKV_MIN_ROWS rows, torch SDPA, the materialized
kernel when every weight is asked for; what each kernel adds is :data:`KERNEL_BUFFERS`) and is checked within 10% of the
measured peak in the tests. How this machine is measured (the rates a roofline needs, a step's
measured peak) is :mod:`multihead.machine`.

Example:
    >>> from multihead.cost import LayerShape, estimate
    >>> report = estimate(LayerShape(512, 8), seq=2048)
    >>> report.params.weights                       # 4 d^2
    1048576
    >>> report.dominant
    'Q K^T'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from multihead._errors import bad_argument, describe, positive_int
from multihead.backends.costs import (
    BACKWARD_MATMUL_FACTOR,
    SOFTMAX_FLOPS_BACKWARD,
    SOFTMAX_FLOPS_FORWARD,
    mix_flops,
    pair_flops,
    score_flops,
)
from multihead.layer import FUSED_QKV_MIN_ROWS

__all__ = [
    "LayerShape",
    "Params",
    "Bytes",
    "CostReport",
    "AttentionSizes",
    "KernelBuffers",
    "KERNEL_BUFFERS",
    "MachineRates",
    "Roofline",
    "estimate",
    "roofline",
    "crossover",
    "bound",
    "compute_rate",
    "attention_kernel_cost",
    "dtype_name",
    "DTYPES",
    "MODES",
    "SOFTMAX_FLOPS_FORWARD",
    "SOFTMAX_FLOPS_BACKWARD",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
MODES = ("forward", "forward+backward", "decode")
LSE_BYTES = 4  # torch's CPU SDPA keeps a float32 log-sum-exp per query row

TERMS = ("Q/K/V projections", "Q K^T", "softmax", "weights x V", "output projection")
QUADRATIC_TERMS = ("Q K^T", "softmax", "weights x V")  # the n x n terms; the rest scale with n


@dataclass(frozen=True)
class LayerShape:
    """The sizes of a :class:`multihead.MultiHeadAttention` (same names and defaults).

    ``head_dim`` defaults to embed_dim / num_heads, ``value_head_dim`` to head_dim, ``num_kv_heads``
    to num_heads, kdim / vdim / out_dim to embed_dim. ``output_gate`` ("headwise": 1 gate row per head,
    "elementwise": e), ``qk_norm`` (two (d,) weights) and ``sinks`` (h logits) are the layer's options: the gate's
    rows are W^Q's too, in its parameters, FLOPs and activations; the norms and sinks add their parameters.
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
    output_gate: str | None = None
    qk_norm: bool = False
    sinks: bool = False

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
        for name in ("bias", "qk_norm", "sinks"):
            if not isinstance(getattr(self, name), bool):
                raise bad_argument(
                    name, "True or False", describe(getattr(self, name)), f"pass {name}=True", kind=TypeError
                )
        if self.output_gate not in (None, "headwise", "elementwise"):
            raise bad_argument(
                "output_gate",
                'None, "headwise" or "elementwise"',
                describe(self.output_gate),
                'pass output_gate="elementwise"',
            )

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
    def q_rows(self) -> int:
        """W^Q's rows per head: d, and the output gate's rows (1 headwise, e elementwise)."""
        return self.d + {None: 0, "headwise": 1, "elementwise": self.e}[self.output_gate]

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
            output_gate=layer.output_gate,
            qk_norm=layer.q_norm is not None,
            sinks=layer.sinks is not None,
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
        return max(both, key=lambda term: both[term])

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


def dtype_name(dtype: str | torch.dtype) -> str:
    """The name in :data:`DTYPES` of ``dtype`` (a torch.dtype or one of the names); ValueError naming the choices."""
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


# ----------------------------------------------------------------------------- what each kernel allocates


@dataclass(frozen=True)
class AttentionSizes:
    """The sizes of one attention call inside the layer: q (b, h, i, d), k (b, g, j, d), v (b, g, j, e), elements of
    ``itemsize`` bytes; the properties are the bytes of the tensors the kernels' formulas name."""

    b: int
    h: int
    g: int
    i: int
    j: int
    d: int
    e: int
    itemsize: int

    @property
    def lse(self) -> int:
        """A float32 log-sum-exp per query row: (b, h, i)."""
        return self.b * self.h * self.i * LSE_BYTES

    @property
    def head_outputs(self) -> int:
        """(b, h, i, e)."""
        return self.b * self.h * self.i * self.e * self.itemsize

    @property
    def key_sized(self) -> int:
        """One buffer the size of the keys: (b, g, j, d)."""
        return self.b * self.g * self.j * self.d * self.itemsize

    @property
    def weights(self) -> int:
        """The (b, h, i, j) weights."""
        return self.b * self.h * self.i * self.j * self.itemsize


@dataclass(frozen=True)
class KernelBuffers:
    """Bytes one attention kernel allocates besides q, k, v, the head outputs, the returned weights and the
    gradients dq, dk, dv, d(head outputs): what sets the layer's peak apart from one kernel to another."""

    forward: int  # alive with the head outputs when the forward ends
    recorded: int  # alive at the forward's peak as well when autograd records the call
    saved: int  # kept for the backward besides q, k, v and the head outputs
    backward: int  # transient inside the backward


def sdpa_buffers(sizes: AttentionSizes) -> KernelBuffers:
    """torch SDPA's CPU kernels (the layer's path without weights): a float32 log-sum-exp per query row, kept for
    the backward, and one key-sized buffer inside the backward."""
    return KernelBuffers(forward=sizes.lse, recorded=sizes.lse, saved=sizes.lse, backward=sizes.key_sized)


def materialized_buffers(sizes: AttentionSizes) -> KernelBuffers:
    """multihead's materialized kernel (the path that returns every weight): it writes the head outputs in
    (b, h, i, e) order, so concatenating the heads copies them once more; it keeps an LSE for the backward,
    which also makes dS, the size of the weights, besides a key-sized buffer."""
    return KernelBuffers(
        forward=sizes.head_outputs,
        recorded=sizes.lse,
        saved=sizes.lse + sizes.head_outputs,
        backward=sizes.key_sized + sizes.weights,
    )


# the kernel behind the layer's call -> what it allocates; estimate's peak reads only these for the kernel's part
KERNEL_BUFFERS: dict[str, Callable[[AttentionSizes], KernelBuffers]] = {
    "sdpa": sdpa_buffers,
    "materialized": materialized_buffers,
}


def layer_kernel(need_weights: bool) -> str:
    """The kernel the layer runs on the CPU: the materialized one when every weight is asked for, else SDPA."""
    return "materialized" if need_weights else "sdpa"


# ----------------------------------------------------------------------------- estimate


def _check_call(
    shape: object, seq: int, kv_seq: int | None, batch: int, mode: str, cache_len: int | None
) -> LayerShape:
    """Validate estimate's arguments (each error names its argument); returns ``shape``."""
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
    return shape


def _parameters(s: LayerShape) -> Params:
    kdim, vdim = s.kv_in
    per_projection = {
        "W^Q": s.embed_dim * s.h * s.q_rows,
        "W^K": kdim * s.g * s.d,
        "W^V": vdim * s.g * s.e,
        "W^O": s.h * s.e * s.out,
    }
    if s.qk_norm:
        per_projection["q/k norms"] = 2 * s.d
    if s.sinks:
        per_projection["sinks"] = s.h
    biases = (s.h * s.q_rows + s.g * s.d + s.g * s.e + s.out) if s.bias else 0
    return Params(sum(per_projection.values()), biases, per_projection)


def _forward_flops(s: LayerShape, b: int, i: int, j: int, new_kv: int) -> dict[str, int]:
    kdim, vdim = s.kv_in
    h, g, d, e = s.h, s.g, s.d, s.e
    return {
        "Q/K/V projections": 2 * b * (i * s.embed_dim * h * s.q_rows + new_kv * kdim * g * d + new_kv * vdim * g * e),
        "Q K^T": score_flops(d) * b * h * i * j,
        "softmax": SOFTMAX_FLOPS_FORWARD * b * h * i * j,
        "weights x V": mix_flops(e) * b * h * i * j,
        "output projection": 2 * b * i * h * e * s.out,
    }


def _backward_flops(
    s: LayerShape, forward: dict[str, int], b: int, i: int, j: int, new_kv: int, input_requires_grad: bool
) -> dict[str, int]:
    kdim, vdim = s.kv_in
    q_input_grad = 2 * b * i * s.embed_dim * s.h * s.q_rows if input_requires_grad else 0
    kv_input_grad = 2 * b * new_kv * (kdim * s.g * s.d + vdim * s.g * s.e) if input_requires_grad else 0
    return {
        "Q/K/V projections": forward["Q/K/V projections"] + q_input_grad + kv_input_grad,  # dW always, dX if needed
        "Q K^T": BACKWARD_MATMUL_FACTOR * forward["Q K^T"],  # dQ = dS K, dK = dS^T Q
        "softmax": SOFTMAX_FLOPS_BACKWARD * b * s.h * i * j,
        "weights x V": BACKWARD_MATMUL_FACTOR * forward["weights x V"],  # dP = dO V^T, dV = P^T dO
        "output projection": 2 * forward["output projection"],  # dW and the per-head outputs' gradient
    }


def _layer_bytes(
    s: LayerShape,
    params: Params,
    sizes: AttentionSizes,
    *,
    mode: str,
    need_weights: bool,
    cross: bool,
    new_kv: int,
    input_requires_grad: bool,
) -> Bytes:
    """The layer's memory (see :class:`Bytes`); the attention kernel's own buffers come from :data:`KERNEL_BUFFERS`."""
    b, i, j, g, d, e, size = sizes.b, sizes.i, sizes.j, sizes.g, sizes.d, sizes.e, sizes.itemsize
    kdim, vdim = s.kv_in
    kernel = KERNEL_BUFFERS[layer_kernel(need_weights)](sizes)
    q_bytes, kv_bytes = b * i * sizes.h * s.q_rows * size, b * new_kv * g * (d + e) * size
    head_out, out = sizes.head_outputs, b * i * s.out * size
    weights_bytes = sizes.weights if need_weights else 0
    activations = q_bytes + kv_bytes + head_out + out + weights_bytes
    cache = b * g * j * (d + e) * size if mode == "decode" else 0
    # The fused QKV matmul stacks W^Q, W^K, W^V for the call (self-attention from FUSED_QKV_MIN_ROWS rows on)
    per_projection = params.per_projection
    stacked = (
        (per_projection["W^Q"] + per_projection["W^K"] + per_projection["W^V"]) * size
        if s.self_attention_only and not cross and b * i >= FUSED_QKV_MIN_ROWS
        else 0
    )
    forward_peak = max(stacked + q_bytes + kv_bytes, activations + kernel.forward)
    saved = 0
    peak = forward_peak  # decode too: the cache exists before the step; the step's own tensors are this small
    if mode == "forward+backward":
        # Kept for backward: the projections' outputs, the per-head outputs, the kernel's own, and the stacked QKV
        # weight when the input needs a gradient (its matmul saves it for dX). Not the output: the layer does not
        # keep it (whatever consumes it decides), so it is not counted at the backward peak.
        saved = activations - out + kernel.saved + (stacked if input_requires_grad else 0)
        # The peak comes inside the attention's backward: d(head outputs) and dW^O from the output projection's
        # backward, then dQ, dK, dV and the kernel's own buffers.
        gradients = head_out + b * sizes.h * i * d * size + b * g * j * (d + e) * size + kernel.backward
        output_projection_grads = per_projection["W^O"] * size + (s.out * size if s.bias else 0)
        peak = max(forward_peak + kernel.recorded, saved + gradients + output_projection_grads)
    traffic = (
        params.total * size
        + b * i * s.embed_dim * size
        + (b * new_kv * (kdim + vdim) * size if cross else 0)
        + out
        + weights_bytes
        + cache
    )
    return Bytes(params.total * size, activations, saved, cache, weights_bytes, peak, traffic)


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
    s = _check_call(shape, seq, kv_seq, batch, mode, cache_len)
    name = dtype_name(dtype)
    b, i = batch, seq
    j = (cache_len or 0) + seq if mode == "decode" else (kv_seq or seq)
    new_kv = seq if mode == "decode" else j  # keys/values projected this call
    cross = kv_seq is not None and mode != "decode"
    params = _parameters(s)
    flops = _forward_flops(s, b, i, j, new_kv)
    backward = (
        _backward_flops(s, flops, b, i, j, new_kv, input_requires_grad)
        if mode == "forward+backward"
        else {term: 0 for term in TERMS}
    )
    shapes = {
        "q": (b, s.h, i, s.d),
        "k": (b, s.g, j, s.d),
        "v": (b, s.g, j, s.e),
        "scores": (b, s.h, i, j),
        "weights": (b, s.h, i, j),
        "head outputs": (b, s.h, i, s.e),
        "concatenated": (b, i, s.h * s.e),
        "output": (b, i, s.out),
    }
    sizes = AttentionSizes(b, s.h, s.g, i, j, s.d, s.e, DTYPES[name].itemsize)
    memory = _layer_bytes(
        s,
        params,
        sizes,
        mode=mode,
        need_weights=need_weights,
        cross=cross,
        new_kv=new_kv,
        input_requires_grad=input_requires_grad,
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
        memory,
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
    return projections / ((pair_flops(shape.d, shape.e) + SOFTMAX_FLOPS_FORWARD) * shape.h)


# ----------------------------------------------------------------------------- the roofline


@dataclass(frozen=True)
class MachineRates:
    """Measured rates of a machine: dense matmul GFLOP/s per dtype, and memory bandwidth in GB/s
    (:func:`multihead.machine.calibrate` measures them; ``machine`` and ``measured_unix`` say where and when)."""

    matmul_gflops: dict[str, float]
    bandwidth_gbs: float
    threads: int
    measured_at: str = ""  # local time, for people
    details: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)  # the identity it was measured on (multihead.machine.identity_key)
    measured_unix: float | None = None  # seconds since the epoch


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
    size = DTYPES[dtype_name(dtype)].itemsize
    scores = batch * heads * q_len * k_len * _attended_pairs(q_len, k_len, causal) / (q_len * k_len)
    flops = scores * (pair_flops(head_dim, e) + SOFTMAX_FLOPS_FORWARD)
    q, kv, out = batch * heads * q_len * head_dim, batch * g * k_len * (head_dim + e), batch * heads * q_len * e
    traffic = (q + kv + out) * size
    if mode == "forward+backward":
        flops += scores * (BACKWARD_MATMUL_FACTOR * pair_flops(head_dim, e) + SOFTMAX_FLOPS_BACKWARD)
        traffic += (q + kv + 2 * out) * size + batch * heads * q_len * LSE_BYTES + (q + kv) * size
    return round(flops), traffic
