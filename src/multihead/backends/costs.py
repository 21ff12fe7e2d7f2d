"""What a call costs each backend here, for ``backend="auto"`` to pick the cheapest that serves it.

A backend's estimate is the n x n work it really does for this call, at this machine's measured rate for it:

    seconds = computed pairs x b h x FLOPs per pair / rate  (+ building a dense mask)  (+ per-block overhead)

- **Computed pairs** depend on the mask and the kernel. SDPA computes every pair of a dense mask (and skips the
  masked blocks of its own ``is_causal``); the block kernels (tiled, flex) compute only the blocks the mask leaves
  alive (:func:`live_fraction`, from ``BoundMask.state`` on the kernel's block grid).
- **FLOPs per pair** are 2 (d + e) forward (q k^T and weights x V), and 2.5 times that for the backward.
- **Rates** (:class:`KernelRates`) are GFLOP/s per backend, direction and precision, measured on this machine by
  ``multihead bench --calibrate`` (``multihead.machine.calibrate_kernels``) and installed with
  :func:`set_kernel_rates`; until then :data:`DEFAULT_RATES`, measured on this project's machine (named there).
- **A dense mask** (SDPA with anything but its own causal) is built and read at ``mask_gbs``.
- **Precision.** SDPA, FlexAttention and tiled run a bfloat16/float16 call in float32 where they were measured
  faster in float32 here, and are estimated so (:func:`faster_compute_dtype`): on CPUs without half-precision
  matrix units SDPA's bf16 backward ran at 12 GFLOP/s against 102 in float32 on this project's machine, compiled
  FlexAttention's bf16 forward at 30 against 45, and tiled (float32 blocks either way, but casting its saved
  inputs again in the backward) at 51/67 against 60/76. The materialised kernel keeps the call's dtype: its
  weights are returned in it.

``multihead.explain`` prints each serving backend's estimate; ``benchmarks/`` checks the predicted winner against
the measured one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from multihead.masks import BlockState, BoundMask, _BoundAlibi, _BoundDense, _BoundPadding

if TYPE_CHECKING:
    from multihead.backends.registry import AttentionCall

__all__ = [
    "DEFAULT_RATES",
    "Estimate",
    "KernelRates",
    "kernel_rates",
    "call_compute_dtype",
    "dense_mask_extent",
    "faster_compute_dtype",
    "inputs_in_faster_dtype",
    "live_fraction",
    "native_precision",
    "set_kernel_rates",
    "set_rates_loader",
]

BACKWARD_FLOP_FACTOR = 2.5  # a backward's n x n FLOPs over the forward's (recompute q k^T, then dV, dP, dQ, dK)
MAX_GRID = 32  # blocks per side looked at by live_fraction: coarser cells past this (an estimate, cheap per call)


@dataclass(frozen=True)
class KernelRates:
    """Measured speeds of each backend's n x n work.

    ``gflops[backend][key]`` with key "<forward|backward> <float32|half|float64>": GFLOP/s counting 2 (d + e)
    FLOPs per computed pair forward and 2.5 times that backward, measured at d = e = 64 (so the softmax and each
    kernel's per-block work are in them). ``mask_gbs``: how fast a dense mask is built and read.
    """

    gflops: dict[str, dict[str, float]]
    mask_gbs: float
    source: str = ""

    def rate(self, backend: str, direction: str, dtype: torch.dtype) -> float | None:
        by_key = self.gflops.get(backend)
        if by_key is None:
            return None
        return by_key.get(f"{direction} {precision(dtype)}")


# Measured by multihead.machine.calibrate_kernels (what `multihead bench --calibrate` runs) on this project's
# machine, the median of 6 calibrations on 2026-11-23 (3 at 20:35, 3 at 21:21; single runs differed by up to 30%)
# with the machine otherwise idle: AMD EPYC, 2 cores, AVX2 (no AVX-512, no bf16/AMX units), torch 2.13.0 CPU,
# 2 threads; b = 1, h = 8, d = 64, n = 1024 in float32 and bfloat16 ("half"), each kernel in its own precision
# ("sdpa" and "sdpa masked" are torch's kernel itself)
DEFAULT_RATES = KernelRates(
    gflops={
        "sdpa": {
            "forward float32": 110.3,
            "backward float32": 102.1,
            "forward half": 99.7,
            "backward half": 12.0,
        },
        "sdpa masked": {
            "forward float32": 90.2,
            "backward float32": 92.6,
            "forward half": 88.9,
            "backward half": 12.3,
        },
        "tiled": {
            "forward float32": 59.5,
            "backward float32": 75.9,
            "forward half": 50.6,
            "backward half": 67.1,
        },
        "materialized": {
            "forward float32": 59.3,
            "backward float32": 57.7,
            "forward half": 73.8,
            "backward half": 39.5,
        },
        "flex": {
            "forward float32": 44.9,
            "forward half": 29.8,
        },
    },
    mask_gbs=1.21,
    source="defaults: the median of 6 calibrations on an AMD EPYC (AVX2), 2 threads, torch 2.13.0",
)

_installed: KernelRates | None = None
_loader: Callable[[], KernelRates | None] | None = None  # reads this machine's calibration (set by the package)
_loaded = False


def set_kernel_rates(rates: KernelRates | None) -> None:
    """Use ``rates`` for ``auto``'s estimates from now on; None: this machine's calibration if there is one (read
    again on next use), else :data:`DEFAULT_RATES`."""
    global _installed, _loaded
    _installed, _loaded = rates, rates is not None


def set_rates_loader(loader: Callable[[], KernelRates | None] | None) -> None:
    """``loader()`` gives this machine's calibrated rates or None; it runs once, when auto first estimates.
    (``multihead`` installs :func:`multihead.machine.cached_kernel_rates`: the backends cannot import it.)"""
    global _loader, _loaded
    _loader = loader
    if _installed is None:
        _loaded = False


def kernel_rates() -> KernelRates:
    """The rates ``auto`` estimates with: installed ones, else this machine's calibration (``multihead bench
    --calibrate``), else :data:`DEFAULT_RATES`."""
    global _installed, _loaded
    if not _loaded:
        _loaded = True
        if _loader is not None:
            _installed = _loader()
    return _installed if _installed is not None else DEFAULT_RATES


def precision(dtype: torch.dtype) -> str:
    if dtype == torch.float64:
        return "float64"
    return "half" if dtype in (torch.bfloat16, torch.float16) else "float32"


HALF_DTYPES = (torch.bfloat16, torch.float16)


_native_precision = False  # set while calibrating: every kernel runs in its call's dtype


@contextlib.contextmanager
def native_precision() -> Iterator[None]:
    """Within: every kernel runs a call in the call's own dtype (no float32 for half calls). For calibration,
    which measures each kernel's rate in each precision."""
    global _native_precision
    before, _native_precision = _native_precision, True
    try:
        yield
    finally:
        _native_precision = before


def faster_compute_dtype(backend: str, dtype: torch.dtype, device: torch.device, requires_grad: bool) -> torch.dtype:
    """The dtype ``backend``'s kernel runs a ``dtype`` call in: float32 for a half-precision CPU call where this
    machine's rates for it say float32 is faster (forward, plus its backward when gradients are needed; casting
    q, k, v and the output costs O(n), against the kernel's O(n^2)), else ``dtype``. The rates are the CPU's, so
    other devices keep their dtype."""
    if dtype not in HALF_DTYPES or device.type != "cpu" or _native_precision:
        return dtype
    rates = kernel_rates()

    def seconds_per_flop(precision_dtype: torch.dtype) -> float | None:
        forward = rates.rate(backend, "forward", precision_dtype)
        backward = rates.rate(backend, "backward", precision_dtype)
        if forward is None or (requires_grad and backward is None):
            return None
        return 1 / forward + (BACKWARD_FLOP_FACTOR / backward if requires_grad and backward else 0.0)

    half, single = seconds_per_flop(dtype), seconds_per_flop(torch.float32)
    return torch.float32 if half is not None and single is not None and single < half else dtype


def call_compute_dtype(backend: str, call: AttentionCall) -> torch.dtype:
    """:func:`faster_compute_dtype` for a call, as the backend will see it."""
    return faster_compute_dtype(backend, call.dtype, call.device, call.requires_grad)


def inputs_in_faster_dtype(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in the dtype ``backend``'s kernel runs them fastest in here (:func:`faster_compute_dtype`; no copy
    when that is theirs). The kernel's output goes back to the inputs' dtype, and autograd casts the gradients."""
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    work = faster_compute_dtype(backend, q.dtype, q.device, requires_grad)
    return q.to(work), k.to(work), v.to(work)


def live_fraction(mask: BoundMask, q_len: int, k_len: int, block_q: int, block_k: int) -> float:
    """The share of (query, key) pairs in blocks of ``block_q`` x ``block_k`` that ``mask`` does not rule out
    entirely: what a block-skipping kernel computes. Past :data:`MAX_GRID` blocks per side, cells of several
    blocks are looked at (a cell counts whole when any of it may attend: an upper bound)."""
    if not mask.keep_terms:
        return 1.0
    rows = max(block_q, math.ceil(q_len / MAX_GRID / block_q) * block_q)
    cols = max(block_k, math.ceil(k_len / MAX_GRID / block_k) * block_k)
    alive = 0
    for row_start in range(0, q_len, rows):
        row_span = range(row_start, min(row_start + rows, q_len))
        for col_start in range(0, k_len, cols):
            col_span = range(col_start, min(col_start + cols, k_len))
            if mask.state(row_span, col_span) is not BlockState.EMPTY:
                alive += len(row_span) * len(col_span)
    return alive / (q_len * k_len)


@dataclass(frozen=True)
class Estimate:
    """A backend's predicted time for one call, and what it rests on."""

    seconds: float
    computed_fraction: float  # share of the i x j pairs the kernel computes
    dense_mask_bytes: int = 0  # a mask it must build as an (.., i, j) tensor
    computes_in: torch.dtype | None = None  # set when it computes in another dtype than the call's

    def __str__(self) -> str:
        text = f"~{_time(self.seconds)}, computes {self.computed_fraction:.0%} of the pairs"
        if self.computes_in is not None:
            text += f" in {str(self.computes_in).removeprefix('torch.')}"
        if self.dense_mask_bytes:
            text += f" and builds a {self.dense_mask_bytes / 2**20:.1f} MiB dense mask"
        return text


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.0f} us"


def work_seconds(
    call_flops_per_pair: float, pairs: float, requires_grad: bool, rate_forward: float, rate_backward: float
) -> float:
    """Seconds for ``pairs`` pairs at the forward rate, plus the backward's 2.5 x FLOPs at its rate if needed."""
    flops = call_flops_per_pair * pairs
    seconds = flops / (rate_forward * 1e9)
    if requires_grad:
        seconds += BACKWARD_FLOP_FACTOR * flops / (rate_backward * 1e9)
    return seconds


def _rates(backend: str, call: AttentionCall, dtype: torch.dtype) -> tuple[float, float] | None:
    """(forward, backward) GFLOP/s of ``backend`` computing in ``dtype``; None when one it needs is unmeasured
    (a forward-only call needs no backward rate)."""
    rates = kernel_rates()
    forward, backward = rates.rate(backend, "forward", dtype), rates.rate(backend, "backward", dtype)
    if forward is None or (backward is None and call.requires_grad):
        return None
    return forward, backward if backward is not None else forward


def _flops_per_pair(call: AttentionCall) -> float:
    return 2.0 * (call.qk_dim + call.v_dim) * call.batch * call.heads


def block_kernel_estimate(
    call: AttentionCall, backend: str, block_q: int, block_k: int, *, compute_dtype: torch.dtype | None = None
) -> Estimate | None:
    """A kernel that computes only the live blocks of ``block_q`` x ``block_k`` (tiled, flex), at ``backend``'s
    rate in ``compute_dtype`` (default: the call's)."""
    fraction = live_fraction(call.mask, call.q_len, call.k_len, block_q, block_k)
    return dense_kernel_estimate(call, backend, fraction=fraction, compute_dtype=compute_dtype)


def dense_mask_extent(mask: BoundMask) -> tuple[int, int, int]:
    """(b or 1, h or 1, i or 1) of the one (.., j) tensor a kernel taking a dense mask builds for ``mask``: the
    broadcast of its terms' shapes: a batch dim for padding, a head dim for ALiBi, a row dim for anything but
    padding."""
    batch = heads = rows = 1
    for term in mask.terms:
        if isinstance(term, _BoundDense):  # its own (b or 1, h or 1, i or 1, j or 1)
            shape = term.tensor.shape
            batch, heads, rows = max(batch, shape[0]), max(heads, shape[1]), max(rows, shape[2])
        elif isinstance(term, _BoundPadding):
            batch = mask.shape.batch
        else:  # causal / window diagonals; ALiBi, which is per head too
            rows = mask.shape.q_len
            if isinstance(term, _BoundAlibi):
                heads = mask.shape.heads
    return batch, heads, rows


def dense_mask_bytes(call: AttentionCall, dtype: torch.dtype | None = None) -> int:
    """Bytes of the dense mask (:func:`dense_mask_extent`) a kernel builds for ``call.mask``: bool unless a term
    adds a bias (then ``dtype``, by default the call's)."""
    batch, heads, rows = dense_mask_extent(call.mask)
    element = (dtype or call.dtype).itemsize if call.mask.bias_terms else 1
    return batch * heads * rows * call.k_len * element


MASK_PASSES = 3  # a dense mask is written, combined into one tensor, and read by the kernel


def dense_kernel_estimate(
    call: AttentionCall,
    backend: str,
    *,
    fraction: float = 1.0,
    mask_bytes: int = 0,
    compute_dtype: torch.dtype | None = None,
) -> Estimate | None:
    """A kernel that computes ``fraction`` of the pairs (every one unless it skips some itself) at ``backend``'s
    rate in ``compute_dtype`` (default: the call's), plus building and reading a ``mask_bytes`` dense mask (again
    in the backward)."""
    dtype = call.dtype if compute_dtype is None else compute_dtype
    rates = _rates(backend, call, dtype)
    if rates is None:
        return None
    seconds = work_seconds(_flops_per_pair(call), fraction * call.q_len * call.k_len, call.requires_grad, *rates)
    seconds += mask_bytes * MASK_PASSES * (2 if call.requires_grad else 1) / (kernel_rates().mask_gbs * 1e9)
    return Estimate(seconds, fraction, mask_bytes, computes_in=None if dtype == call.dtype else dtype)
