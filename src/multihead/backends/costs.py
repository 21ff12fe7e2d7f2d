"""What a call costs each backend on its kind of device, for ``backend="auto"`` to pick the cheapest that serves it.

A backend's estimate is the n x n work it really does for this call, at its rate on the call's device kind:

    seconds = computed pairs x b h x FLOPs per pair / rate  +  b h i x cost per row
              (+ building a dense mask)  (+ masking blocks apart, or a score_mod's biases)
              (+ casting a half call to float32 and back)

- **Computed pairs** depend on the mask and the kernel. SDPA computes every pair of a dense mask (and skips the
  masked blocks of its own ``is_causal``); the block kernels (tiled, flex) compute only the blocks the mask leaves
  alive (:func:`live_fraction`, from ``BoundMask.state`` on the kernel's block grid). Tiled also masks the blocks
  the mask keeps only in part, and every live block of a bias or cap, apart from its products
  (:func:`masked_fraction`, at ``masked_gps``); flex's mask_mod runs inside its kernel, and its score_mod adds
  each bias or cap term to every score it computes, at ``score_mod_gps`` a term.
- **FLOPs per pair** are 2 (d + e) forward (q k^T and weights x V), and 2.5 times that for the backward.
- **Rates** (:class:`KernelRates`) are GFLOP/s per backend, direction and precision: the current dispatch policy's
  table for the call's device kind (:mod:`multihead.backends.policy`; static tables by kind in
  :mod:`multihead.backends.rates`, a machine's own calibration only where the user opts in).
- **A cost per row**, per query row and head, is what a kernel spends beside its pairs (each block of queries'
  running statistics and output, and the like). Measured with the rate at two lengths, it keeps a short call's
  rows out of the rate, which then carries over to long calls, where the rows weigh little. Tiled's is larger
  than SDPA's: rates measured at n = 1024 alone put tiled / SDPA at 1.48 forward+backward, where it measured
  1.2-1.3 from n = 2048 on.
- **A dense mask** (SDPA with anything but its own causal) is built once a call at ``mask_gbs``
  (:func:`dense_mask_seconds`); the kernel's reading it is in the "sdpa masked" rate.
- **Precision.** SDPA, FlexAttention and tiled run a bfloat16/float16 call in float32 where that is faster here,
  casts included, on CPUs only, and are estimated so (:func:`faster_compute_dtype`): on CPUs without half-precision
  matrix units SDPA's bf16 backward ran at 18 GFLOP/s against 135 in float32 on this project's machine, compiled
  FlexAttention's bf16 forward at 46 against 93, and tiled (float32 blocks either way, but casting its saved
  inputs again in the backward) at 96/120 against 99/149. Casting q, k, v to float32 and the output back writes
  new tensors at ``fresh_gbs`` (page faults included: 2.6 GB/s here), so a short SDPA forward stays in bf16
  (n = 1024, h = 16: four casts took 5.2 ms beside a 26 ms kernel that float32 makes 7-10% faster). The materialised
  kernel writes its weights into a new tensor at ``fresh_gbs`` too, and keeps the call's dtype: its weights are
  returned in it.

``multihead.explain`` prints each serving backend's estimate; ``benchmarks/`` checks the predicted winner against
the measured one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from multihead.backends.call import AttentionCall
from multihead.backends.policy import DeviceKind, current_policy
from multihead.backends.rates import KernelRates
from multihead.masks import STATE_EMPTY, STATE_PARTIAL, BlockGrid, BoundMask

__all__ = [
    "Estimate",
    "KernelRates",
    "call_kind",
    "call_compute_dtype",
    "cast_bytes",
    "faster_compute_dtype",
    "inputs_in_faster_dtype",
    "kernel_rates",
    "live_fraction",
    "masked_fraction",
    "native_precision",
    "pair_flops",
    "score_flops",
    "mix_flops",
    "SOFTMAX_FLOPS_FORWARD",
    "SOFTMAX_FLOPS_BACKWARD",
    "BACKWARD_MATMUL_FACTOR",
]

# The counting vocabulary, said once: what one (query, key) pair of one head costs. The cost model (multihead.cost)
# counts a configuration's FLOPs with these, and the estimates below time kernels with them.
SOFTMAX_FLOPS_FORWARD = 5  # per score: scale, running max, subtract-and-exp, sum, divide
SOFTMAX_FLOPS_BACKWARD = 4  # per score: dP * P, row sum, subtract, times P
BACKWARD_MATMUL_FACTOR = 2  # the backward's matmuls over the forward's: dQ and dK from dS, dP and dV from dO


def score_flops(d: int) -> int:
    """FLOPs of one score q . k (a pair's Q K^T) over head dim d."""
    return 2 * d


def mix_flops(e: int) -> int:
    """FLOPs of one weight times its value row (a pair's weights x V) over value dim e."""
    return 2 * e


def pair_flops(d: int, e: int) -> int:
    """A pair's forward matmul FLOPs: its score and its share of the weighted sum of values."""
    return score_flops(d) + mix_flops(e)


BACKWARD_FLOP_FACTOR = 2.5  # a backward's n x n FLOPs over the forward's (recompute q k^T, then dV, dP, dQ, dK)
MAX_GRID = 32  # blocks per side looked at by live_fraction: coarser cells past this (an estimate, cheap per call)


HALF_DTYPES = (torch.bfloat16, torch.float16)


def call_kind(call: AttentionCall) -> DeviceKind:
    """The device kind ``call`` is planned for: its own, else the current policy's kind of its device."""
    return call.kind if call.kind is not None else current_policy().kind_of(call.device)


def kernel_rates(kind: DeviceKind) -> KernelRates:
    """The rates ``auto`` estimates calls on ``kind`` with: the current policy's table for it
    (:mod:`multihead.backends.policy`)."""
    return current_policy().rates_for(kind)


_native_precision = False  # set while calibrating: every kernel runs in its call's dtype

# Kernels whose half-precision backward on the CPU misses FlashAttention's tolerance rule: torch 2.13's CPU flash
# backward (sdpa, with or without a dense mask) sums dK and dV over the query blocks in the inputs' dtype. With
# 20000 queries over 16 keys (h = 12, d = 64) its bfloat16 dK and dV were 0.82 and 1.25 from float64, where the
# rule allows 0.53 and 0.41 (float16: 0.12 and 0.13 against 0.062 and 0.066); in float32 they are within it.
# Accuracy first: with gradients these kernels run a half call in float32 whatever the rates say.
HALF_BACKWARD_INACCURATE_ON_CPU = frozenset({"sdpa", "sdpa masked"})


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


CallSizes = tuple[int, int, int, int, int, int, int]  # (b, h, g, i, j, d, e)


def cast_bytes(
    batch: int, heads: int, kv_heads: int, q_len: int, k_len: int, qk_dim: int, v_dim: int, requires_grad: bool
) -> int:
    """Bytes a half-precision call computed in float32 writes into new tensors: q, k, v in float32 (4 bytes an
    element) and the output back in half (2); with gradients also the output's gradient in float32 and the gradients
    of q, k, v back in half."""
    q, out = batch * heads * q_len * qk_dim, batch * heads * q_len * v_dim
    k, v = batch * kv_heads * k_len * qk_dim, batch * kv_heads * k_len * v_dim
    written = 4 * (q + k + v) + 2 * out
    if requires_grad:
        written += 4 * out + 2 * (q + k + v)
    return written


def faster_compute_dtype(
    backend: str,
    dtype: torch.dtype,
    kind: DeviceKind,
    requires_grad: bool,
    *,
    flops: float,
    cast_bytes: int,
    rows: int = 0,
) -> torch.dtype:
    """The dtype ``backend``'s kernel runs a ``dtype`` call in on a device of ``kind``: float32 for a half-precision
    CPU call where the kind's rates say its ``flops`` (the forward's, for the pairs it computes; the backward's 2.5
    times that when gradients are needed) and ``rows`` (query rows x heads, at the cost per row) take less time in
    float32, casts included (``cast_bytes`` written at ``fresh_gbs``: they decide short calls, where SDPA's float32
    gain of 7-10% is smaller than the casts), else ``dtype``. Only CPUs: a GPU runs half precision on its tensor
    cores, and a half call there keeps its dtype (the policy's rule). A kernel whose half backward misses the
    tolerance rule (:data:`HALF_BACKWARD_INACCURATE_ON_CPU`) runs a call with gradients in float32."""
    if dtype not in HALF_DTYPES or kind.type != "cpu" or _native_precision:
        return dtype
    if requires_grad and backend in HALF_BACKWARD_INACCURATE_ON_CPU:
        return torch.float32
    rates = kernel_rates(kind)
    half = kernel_seconds(backend, dtype, requires_grad, flops, rows, rates)
    single = kernel_seconds(backend, torch.float32, requires_grad, flops, rows, rates)
    if half is None or single is None:
        return dtype
    return torch.float32 if single + cast_bytes / (rates.fresh_gbs * 1e9) < half else dtype


def call_compute_dtype(backend: str, call: AttentionCall, fraction: Callable[[], float] | None = None) -> torch.dtype:
    """:func:`faster_compute_dtype` for a call, as the backend will see it: with ``fraction`` (the share of pairs
    its kernel computes, asked only for a half call on the CPU) the casts count; without it the rates alone decide
    (a kernel that casts to float32 blocks either way, or one compiled for every length: see
    :func:`block_kernel_estimate`), as they do under torch.compile, whose sizes are symbols a size would pin."""
    return _sized_compute_dtype(backend, call.dtype, call_kind(call), call.requires_grad, _sizes(call), fraction)


def inputs_in_faster_dtype(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fraction: Callable[[], float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) in the dtype ``backend``'s kernel runs them fastest in here
    (:func:`call_compute_dtype`, ``fraction`` as there; no copy when the dtype is theirs). The kernel's output goes
    back to the inputs' dtype, and autograd casts the gradients."""
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    sizes = (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
    if q.dtype not in HALF_DTYPES:  # the hot path of every float32 call: nothing to decide
        return q, k, v
    kind = current_policy().kind_of(q.device)
    work = _sized_compute_dtype(backend, q.dtype, kind, requires_grad, sizes, fraction)
    return q.to(work), k.to(work), v.to(work)


def _sized_compute_dtype(
    backend: str,
    dtype: torch.dtype,
    kind: DeviceKind,
    requires_grad: bool,
    sizes: CallSizes,
    fraction: Callable[[], float] | None,
) -> torch.dtype:
    """The choice behind :func:`call_compute_dtype` and :func:`inputs_in_faster_dtype`, for a call of ``sizes``
    (b, h, g, i, j, d, e): nothing is computed from them unless the call is half on the CPU and ``fraction`` given."""
    if dtype not in HALF_DTYPES or kind.type != "cpu" or _native_precision:
        return dtype
    if fraction is None or torch.compiler.is_compiling():  # the rates alone: the work's size cancels out
        return faster_compute_dtype(backend, dtype, kind, requires_grad, flops=1.0, cast_bytes=0)
    b, h, g, i, j, d, e = sizes
    flops = float(pair_flops(d, e)) * b * h * fraction() * i * j
    written = cast_bytes(b, h, g, i, j, d, e, requires_grad)
    return faster_compute_dtype(backend, dtype, kind, requires_grad, flops=flops, cast_bytes=written, rows=b * h * i)


def _sizes(call: AttentionCall) -> CallSizes:
    """(b, h, g, i, j, d, e) of a call, in :func:`cast_bytes`' order."""
    return (call.batch, call.heads, call.kv_heads, call.q_len, call.k_len, call.qk_dim, call.v_dim)


def live_fraction(mask: BoundMask, q_len: int, k_len: int, block_q: int, block_k: int) -> float:
    """The share of (query, key) pairs in blocks of ``block_q`` x ``block_k`` that ``mask`` does not rule out
    entirely: what a block-skipping kernel computes. Past :data:`MAX_GRID` blocks per side, cells of several
    blocks are looked at (a cell counts whole when any of it may attend: an upper bound)."""
    return _block_fractions(mask, q_len, k_len, block_q, block_k)[0]


def masked_fraction(mask: BoundMask, q_len: int, k_len: int, block_q: int, block_k: int) -> float:
    """The share of pairs in the live blocks a block kernel masks score by score: the blocks its keep terms keep
    only in part, and every live one when the mask adds a bias or caps the scores (cells as in
    :func:`live_fraction`)."""
    return _block_fractions(mask, q_len, k_len, block_q, block_k)[1]


def _block_fractions(mask: BoundMask, q_len: int, k_len: int, block_q: int, block_k: int) -> tuple[float, float]:
    """(live, masked) fractions, kept on the mask: several estimates and the kernel of one call ask for them."""
    key = (q_len, k_len, block_q, block_k)
    if key not in mask.block_fractions:
        mask.block_fractions[key] = _count_blocks(mask, q_len, k_len, block_q, block_k)
    return mask.block_fractions[key]


def _count_blocks(mask: BoundMask, q_len: int, k_len: int, block_q: int, block_k: int) -> tuple[float, float]:
    """(live, masked) shares from the tiles' states, computed on the CPU from what the host knows of the mask
    (``BoundMask.on_host``: a term whose values live on a device counts every tile partial), so that estimating
    waits for no device and loops over no tile in Python."""
    every_live_block_masked = bool(mask.bias_terms) or mask.softcap is not None
    if not mask.keep_terms:
        return 1.0, 1.0 if every_live_block_masked else 0.0
    rows = max(block_q, math.ceil(q_len / MAX_GRID / block_q) * block_q)
    cols = max(block_k, math.ceil(k_len / MAX_GRID / block_k) * block_k)
    states = mask.on_host().block_states(rows, cols)  # (cells down, cells across) int8 on the CPU
    grid = BlockGrid(rows, cols, q_len, k_len, states.device)
    (row_start, row_stop), (col_start, col_stop) = grid.rows(), grid.cols()
    pairs = (row_stop - row_start)[:, None] * (col_stop - col_start)[None, :]  # each cell's (query, key) pairs
    alive = int((pairs * (states != STATE_EMPTY)).sum())
    masked = alive if every_live_block_masked else int((pairs * (states == STATE_PARTIAL)).sum())
    return alive / (q_len * k_len), masked / (q_len * k_len)


@dataclass(frozen=True)
class Estimate:
    """A backend's predicted time for one call, and what it rests on."""

    seconds: float
    computed_fraction: float  # share of the i x j pairs the kernel computes
    dense_mask_bytes: int = 0  # a mask it must build as an (.., i, j) tensor
    computes_in: torch.dtype | None = None  # set when it computes in another dtype than the call's
    note: str | None = None  # which kernel serves a part of the call, where that depends on the machine

    def __str__(self) -> str:
        text = f"~{_time(self.seconds)}, computes {self.computed_fraction:.0%} of the pairs"
        if self.computes_in is not None:
            text += f" in {str(self.computes_in).removeprefix('torch.')}"
        if self.dense_mask_bytes:
            text += f" and builds a {self.dense_mask_bytes / 2**20:.1f} MiB dense mask"
        if self.note:
            text += f"; {self.note}"
        return text


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.0f} us"


def kernel_seconds(
    backend: str, dtype: torch.dtype, requires_grad: bool, flops: float, rows: int, rates: KernelRates
) -> float | None:
    """Seconds of ``backend``'s kernel computing in ``dtype``: ``flops`` forward FLOPs at its forward rate (and the
    backward's 2.5 times that at its backward rate, with gradients), plus ``rows`` query rows x heads at its cost
    per row. None when a rate it needs is unmeasured (a forward-only call needs no backward rate)."""
    forward, backward = rates.rate(backend, "forward", dtype), rates.rate(backend, "backward", dtype)
    if forward is None or (requires_grad and backward is None):
        return None
    seconds = flops / (forward * 1e9)
    if requires_grad:
        assert backward is not None  # checked above
        seconds += BACKWARD_FLOP_FACTOR * flops / (backward * 1e9)
    return seconds + rows * rates.row_seconds(backend, dtype, requires_grad)


def _flops_per_pair(call: AttentionCall) -> float:
    return float(pair_flops(call.qk_dim, call.v_dim)) * call.batch * call.heads


HALF_CALL_HANDLING = ("per call", "by rates", "float32 blocks", "as given")


def block_kernel_estimate(
    call: AttentionCall,
    backend: str,
    block_q: int,
    block_k: int,
    *,
    half: str = "per call",
    masks_blocks: bool = False,
    remasks_in_backward: bool = True,
    scores_modded: bool = False,
    fresh_bytes: int = 0,
) -> Estimate | None:
    """A kernel that computes only the live blocks of ``block_q`` x ``block_k`` (tiled, flex, the materialised
    kernel's key spans), at ``backend``'s rate in the dtype it computes in, with the casts of a half call computed
    in float32 (:func:`cast_bytes` at ``fresh_gbs``).

    ``half``, how it runs a half-precision call: "per call", in float32 where that is faster, casts included
    (:func:`call_compute_dtype`); "by rates", the same but the rates alone decide (flex: one compiled kernel serves
    every length); "float32 blocks", in float32 blocks whatever the dtype (tiled: it pays the casts either way, the
    rates pick which inputs it takes); "as given", in the call's dtype (materialised: its weights are returned).
    ``masks_blocks``: it masks each block's scores apart from its matrix products (tiled, materialised; flex's mods
    are fused into its kernel), forward and, with ``remasks_in_backward``, again in the backward, at ``masked_gps``.
    ``scores_modded``: its kernel applies each bias or cap term to every score it computes (flex's score_mod), at
    ``score_mod_gps`` a term.
    ``fresh_bytes``: a new tensor it writes each call (materialised: its b h i j weights) at ``fresh_gbs``. The
    rates, measured where the weights are 32-128 MiB, miss it at 16 GiB: at n = 16384, h = 16 the materialised
    forward took 1.4-2.6x tiled's time (benchmarks/dispatch.py), where its rate alone put it below tiled's.
    """
    if half not in HALF_CALL_HANDLING:
        raise ValueError(f"half: expected one of {HALF_CALL_HANDLING}, got {half!r}")
    fraction, masked = _block_fractions(call.mask, call.q_len, call.k_len, block_q, block_k)
    if half == "as given":
        work = call.dtype
    else:
        work = call_compute_dtype(backend, call, (lambda: fraction) if half == "per call" else None)
    masking = 0.0
    pairs = call.batch * call.heads * call.q_len * call.k_len
    rates = kernel_rates(call_kind(call))
    if masks_blocks:
        passes = 2 if call.requires_grad and remasks_in_backward else 1
        masking = passes * masked * pairs / (rates.masked_gps * 1e9)
    if scores_modded:
        terms = len(call.mask.bias_terms) + (call.mask.softcap is not None)
        masking += terms * fraction * pairs / (rates.score_mod_gps * 1e9)
    writing = fresh_bytes / (rates.fresh_gbs * 1e9)
    casts = True if half == "float32 blocks" else None  # tiled casts a half call whatever dtype it takes
    return dense_kernel_estimate(
        call, backend, fraction=fraction, compute_dtype=work, casts=casts, extra_seconds=masking + writing
    )


def _dense_mask_entries(call: AttentionCall) -> int:
    """Entries of the dense mask a kernel builds for ``call.mask``: its (b or 1, h or 1, i or 1) x j
    (``BoundMask.dense_extent``)."""
    batch, heads, rows = call.mask.dense_extent()
    return batch * heads * rows * call.k_len


def dense_mask_bytes(call: AttentionCall, dtype: torch.dtype | None = None) -> int:
    """Bytes of the dense mask a kernel builds for ``call.mask``: bool unless a term adds a bias (then ``dtype``, by
    default the call's)."""
    element = (dtype or call.dtype).itemsize if call.mask.bias_terms else 1
    return _dense_mask_entries(call) * element


def dense_mask_seconds(call: AttentionCall, entries: int | None = None) -> float:
    """Building the dense mask SDPA is handed for ``call.mask`` (``BoundMask.additive``), once a call: SDPA's
    backward reads the mask its forward was given. Its time goes with its entries, whatever their dtype: a
    bfloat16 ALiBi bias is computed in float32 and rounded, and took as long as a float32 one here (0.87 against
    1.89 GB/s of the bytes kept). Measured against torch SDPA given the same mask prebuilt, our sdpa's extra time
    for causal & ALiBi was one build forward and forward+backward alike (n = 1024, 4096)."""
    entries = _dense_mask_entries(call) if entries is None else entries  # given: a mask other than call.mask's
    return entries * 4 / (kernel_rates(call_kind(call)).mask_gbs * 1e9)


def dense_kernel_estimate(
    call: AttentionCall,
    backend: str,
    *,
    fraction: float = 1.0,
    mask_bytes: int = 0,
    mask_entries: int | None = None,
    compute_dtype: torch.dtype | None = None,
    casts: bool | None = None,
    extra_seconds: float = 0.0,
) -> Estimate | None:
    """A kernel that computes ``fraction`` of the pairs (every one unless it skips some itself) at ``backend``'s
    rate in ``compute_dtype`` (default: the call's), plus its cost per query row and head, plus building the dense
    mask of ``mask_bytes`` (:func:`dense_mask_seconds` of ``mask_entries``, by default call.mask's; 0: none is
    built), plus the casts of a half CPU call to
    float32 and back (``casts``: None, where ``compute_dtype`` is not the call's; True, whatever it is; False,
    never), plus ``extra_seconds``."""
    dtype = call.dtype if compute_dtype is None else compute_dtype
    flops = _flops_per_pair(call) * (fraction * call.q_len * call.k_len)
    rows = call.batch * call.heads * call.q_len  # every block of queries is walked, whatever the mask skips
    kind = call_kind(call)
    rates = kernel_rates(kind)
    seconds = kernel_seconds(backend, dtype, call.requires_grad, flops, rows, rates)
    if seconds is None:
        return None
    seconds += extra_seconds
    if mask_bytes:
        seconds += dense_mask_seconds(call, mask_entries)
    half_on_cpu = call.dtype in HALF_DTYPES and kind.type == "cpu"
    if half_on_cpu and (dtype != call.dtype if casts is None else casts):
        seconds += cast_bytes(*_sizes(call), call.requires_grad) / (rates.fresh_gbs * 1e9)
    return Estimate(seconds, fraction, mask_bytes, computes_in=None if dtype == call.dtype else dtype)
