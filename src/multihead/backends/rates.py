"""Each backend's speed on each kind of device: the numbers behind ``backend="auto"``'s estimates.

A table (:class:`KernelRates`) holds GFLOP/s per backend, direction and precision, and the few other rates the
estimates use (:mod:`multihead.backends.costs`). The static tables below are keyed by device kind
(:class:`multihead.backends.policy.DeviceKind`): the same call on the same kind of device is estimated with the same
numbers on every machine. Each names where its numbers come from:

- ``cpu-avx2`` and ``cpu-avx512-bf16``: measured by ``multihead.backend_rates.calibrate_kernels`` on this
  project's machines of those kinds (a CPU of another kind, AVX-512 without bf16 units among them, uses the
  avx2 table, and ``explain`` says so).
- ``cuda-sm80`` and ``cuda-sm90``: published figures (not measured by this project, which has not yet run on a
  GPU), scaled to our counting; ``scripts/gpu_check.sh`` measures the kernels on a GPU window. On CUDA the choice
  rests mostly on the policy's rules (fused kernels first) and on the work each backend does, which the relative
  speeds below only weigh.

A machine's own measured rates are opt-in (``multihead.machine.measured_policy()``, or the policy's autotune).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = [
    "KernelRates",
    "CPU_AVX2_RATES",
    "CPU_AVX512_BF16_RATES",
    "CUDA_SM80_RATES",
    "CUDA_SM90_RATES",
    "RATES_BY_KIND",
    "precision",
    "unmeasured",
]


def precision(dtype: torch.dtype) -> str:
    """A dtype's key in the tables: "float64", "half" (bfloat16, float16) or "float32"."""
    if dtype == torch.float64:
        return "float64"
    return "half" if dtype in (torch.bfloat16, torch.float16) else "float32"


# Writing a freshly allocated 64 MiB float32 tensor on this project's machine (below): 2.6 GB/s, page faults
# included (2.5-2.8 in the 3 calibrations of CPU_AVX2_RATES, 3.1 the day before), against 45 GB/s rewriting memory
# already mapped. Casts of q, k, v and the output are fresh tensors each call: at n = 1024, h = 16 the four took
# 5.2 ms beside SDPA's 26 ms kernel (torch.profiler)
DEFAULT_FRESH_GBS = 2.6
# The median of the 3 calibrations of CPU_AVX2_RATES: 0.44 (0.40-0.45); 5 runs the day before gave 0.35-0.41
# (backend_rates._measure_bias_gps("tiled"): float32, n = 1024, h = 8, ALiBi against none). In
# benchmarks/dispatch.py (h = 16) tiled's causal & window(256) forward took 47 ms against 28 for its 7 of 16 blocks
# at the unmasked rate, and causal & ALiBi 63 against 40 for its 10 biased blocks: 2.6 and 2.2 ns (0.38 and 0.45
# billion a second) for each of the 7.3 and 10.5 million scores it masked
DEFAULT_MASKED_GPS = 0.44
# FlexAttention adding an ALiBi bias in its score_mod (backend_rates._measure_bias_gps("flex"): float32, n = 1024,
# h = 8, ALiBi against none): 0.68-0.71 in 5 runs on 2026-11-24, 2 of them in full calibrations. In
# benchmarks/dispatch.py (h = 16) its causal & ALiBi forward took 12-3402 ms more than its causal one at
# n = 1024-16384, float32 and bfloat16: 0.65-0.92 billion biased scores a second (median 0.78), where its
# estimate, without this, put it at 0.62-0.88x its time
DEFAULT_SCORE_MOD_GPS = 0.70


@dataclass(frozen=True)
class KernelRates:
    """Measured speeds of each backend's n x n work.

    ``gflops[backend][key]`` with key "<forward|backward> <float32|half|float64>": GFLOP/s counting 2 (d + e)
    FLOPs per computed pair forward and 2.5 times that backward, measured at d = e = 64 (so the softmax and each
    kernel's per-block work are in them). ``mask_gbs``: how fast the dense mask handed to SDPA is built
    (``BoundMask.additive``), in GB/s of its entries counted as float32. ``fresh_gbs``: how
    fast a new tensor of tens of MiB is written, page faults included (what casting q, k, v to float32 costs).
    ``masked_gps``: how many billion scores per second a block kernel masks one block at a time (evaluating the
    mask, bias or cap for the block and applying it to each head's scores), beside its matrix products.
    ``score_mod_gps``: how many billion scores per second a kernel that fuses its score transforms (flex's
    score_mod) spends on each bias or cap term, beside its pairs.
    ``row_us[backend][key]``, keyed as ``gflops``: microseconds a call spends per query row and head beside its
    pairs (none where absent).
    """

    gflops: dict[str, dict[str, float]]
    mask_gbs: float
    source: str = ""
    fresh_gbs: float = DEFAULT_FRESH_GBS
    masked_gps: float = DEFAULT_MASKED_GPS
    row_us: dict[str, dict[str, float]] = field(default_factory=dict)
    score_mod_gps: float = DEFAULT_SCORE_MOD_GPS

    def rate(self, backend: str, direction: str, dtype: torch.dtype) -> float | None:
        by_key = self.gflops.get(backend)
        if by_key is None:
            return None
        return by_key.get(f"{direction} {precision(dtype)}")

    def row_seconds(self, backend: str, dtype: torch.dtype, requires_grad: bool) -> float:
        """Seconds per query row and head of ``backend`` in ``dtype`` beside its pairs, forward (and backward)."""
        by_key = self.row_us.get(backend, {})
        directions = ("forward", "backward") if requires_grad else ("forward",)
        return sum(by_key.get(f"{direction} {precision(dtype)}", 0.0) for direction in directions) * 1e-6


# Measured by multihead.backend_rates.calibrate_kernels (what `multihead bench --calibrate` runs) on this project's
# machine, the median of 3 calibrations on 2026-11-24 (5 interleaved rounds each; every rate within 11% of its
# median) with the machine otherwise idle: AMD EPYC, 2 cores, AVX2 (no AVX-512, no bf16/AMX
# units), torch 2.13.0 CPU, 2 threads; b = 1, h = 8, d = 64, n = 1024 and 2048 in float32 and bfloat16 ("half"),
# each kernel in its own precision ("sdpa" and "sdpa masked" are torch's kernel itself). The rates of 2026-11-23,
# at n = 1024 alone and in a slower spell of the machine, put SDPA at 110 GFLOP/s forward and tiled at 60; tiled
# ran at 0.63-0.65x their estimate and SDPA at 0.78-0.84x at n = 16384
CPU_AVX2_RATES = KernelRates(
    gflops={
        "sdpa": {
            "forward float32": 145.0,
            "backward float32": 134.9,
            "forward half": 135.5,
            "backward half": 17.9,
        },
        "sdpa masked": {
            "forward float32": 115.8,
            "backward float32": 136.0,
            "forward half": 116.5,
            "backward half": 17.7,
        },
        "tiled": {
            "forward float32": 99.1,
            "backward float32": 149.1,
            "forward half": 96.1,
            "backward half": 120.1,
        },
        "materialized": {
            "forward float32": 114.0,
            "backward float32": 89.4,
            "forward half": 61.4,
            "backward half": 89.0,
        },
        "flex": {
            "forward float32": 92.9,
            "forward half": 46.4,
        },
    },
    mask_gbs=1.69,  # BoundMask.additive since it builds ALiBi in chunks: the median of 5 runs, 1.66-1.69
    source="measured: the median of 3 calibrations on an AMD EPYC (AVX2), 2 threads, torch 2.13.0, 2026-11-24",
    fresh_gbs=DEFAULT_FRESH_GBS,
    masked_gps=DEFAULT_MASKED_GPS,
    score_mod_gps=DEFAULT_SCORE_MOD_GPS,
    row_us={
        "sdpa": {"forward float32": 0.09, "backward float32": 0.27, "forward half": 0.1, "backward half": 0.0},
        "sdpa masked": {"forward float32": 0.0, "backward float32": 0.41, "forward half": 0.0, "backward half": 0.29},
        "tiled": {"forward float32": 0.3, "backward float32": 2.1, "forward half": 0.18, "backward half": 0.33},
        "materialized": {"forward float32": 0.48, "backward float32": 1.24, "forward half": 0.0, "backward half": 3.68},
        "flex": {"forward float32": 0.63, "forward half": 0.47},
    },
)


# Measured the same way on an AMD EPYC with AVX-512 and AVX512-BF16 (lscpu: avx512f/bw/vl, avx512_bf16, avx512_vnni),
# 2 cores, torch 2.13.0 CPU running its AVX512 kernels, 2 threads: the median of 3 calibrations on 2026-11-28, the
# machine otherwise idle (every GFLOP/s within 15% of its median but materialized's float32 forward, 135-188). Its
# bf16 units change what auto should do: SDPA's bf16 backward ran at 307 GFLOP/s against 185 in float32 (18 against
# 135 on the AVX2 machine), so a half forward stays in bf16 here; a half backward runs in float32 all the same, for
# accuracy (costs.HALF_BACKWARD_INACCURATE_ON_CPU)
CPU_AVX512_BF16_RATES = KernelRates(
    gflops={
        "sdpa": {
            "forward float32": 184.2,
            "backward float32": 185.3,
            "forward half": 182.2,
            "backward half": 306.6,
        },
        "sdpa masked": {
            "forward float32": 154.7,
            "backward float32": 175.9,
            "forward half": 158.1,
            "backward half": 282.3,
        },
        "tiled": {
            "forward float32": 133.6,
            "backward float32": 160.6,
            "forward half": 139.2,
            "backward half": 160.9,
        },
        "materialized": {
            "forward float32": 142.4,
            "backward float32": 110.8,
            "forward half": 137.5,
            "backward half": 82.7,
        },
        "flex": {
            "forward float32": 185.7,
            "forward half": 113.5,
        },
    },
    mask_gbs=2.58,
    source="measured: the median of 3 calibrations on an AMD EPYC (AVX-512, AVX512-BF16), 2 threads, torch 2.13.0, "
    "2026-11-28",
    fresh_gbs=3.58,
    masked_gps=0.85,
    score_mod_gps=9.82,
    row_us={
        "sdpa": {"forward float32": 0.04, "backward float32": 0.16, "forward half": 0.08, "backward half": 0.2},
        "sdpa masked": {"forward float32": 0.0, "backward float32": 0.07, "forward half": 0.0, "backward half": 0.04},
        "tiled": {"forward float32": 0.13, "backward float32": 0.44, "forward half": 0.23, "backward half": 0.42},
        "materialized": {"forward float32": 0.07, "backward float32": 0.36, "forward half": 0.0, "backward half": 0.26},
        "flex": {"forward float32": 0.39, "forward half": 0.4},
    },
)


# ---------------------------------------------------------------------------------------------------------- CUDA
# Published figures, counted as ours (2 (d + e) FLOPs per computed pair forward, 2.5 times that backward, which is
# how FlashAttention's papers count): torch SDPA's forward on an H100 SXM at d = 128, bf16, reached 287-304 TFLOP/s
# for n = 1k-16k (pytorch/benchmark #2296, June 2024); the FlashAttention-3 paper's H100 chart puts
# FlashAttention-2's forward at 309-370 and eager "standard attention" at 74-139 TFLOP/s (d = 128). The FlexAttention
# announcement (PyTorch blog, August 2024) puts FlexAttention at about 90% of FlashAttention-2's forward and 85% of
# its backward. What no source gives is scaled from those: the backward at 0.8x the forward (FlashAttention-2's
# A100 figures), SDPA handed a dense mask (its memory-efficient kernel) at half its fused rate, float32 (no tensor
# cores without TF32) at a tenth. An A100 (sm80) is taken at 2/3 of an H100, the ratio of their dense bf16 peaks
# (312 against 989 TFLOP/s would be 1/3; attention kernels reach 60-70% of the A100's and 30-40% of the H100's).
# The tiled kernel has no rate on CUDA: its Python loop over blocks launches 15-20 small kernels per block, and the
# policy passes it over wherever a fused kernel serves (multihead.backends.policy). Device memory is written at
# about 1 TB/s (mask_gbs, fresh_gbs); a score_mod's terms are fused and nearly free.
def _cuda_rates(half_forward_tflops: float, source: str) -> KernelRates:
    forward, backward = half_forward_tflops * 1e3, 0.8 * half_forward_tflops * 1e3
    return KernelRates(
        gflops={
            "sdpa": {
                "forward half": forward,
                "backward half": backward,
                "forward float32": forward / 10,
                "backward float32": backward / 10,
            },
            "sdpa masked": {
                "forward half": forward / 2,
                "backward half": backward / 2,
                "forward float32": forward / 20,
                "backward float32": backward / 20,
            },
            "flex": {
                "forward half": 0.9 * forward,
                "backward half": 0.85 * backward,
                "forward float32": 0.9 * forward / 10,
                "backward float32": 0.85 * backward / 10,
            },
            "materialized": {
                "forward half": 0.4 * forward,
                "backward half": 0.4 * backward,
                "forward float32": forward / 20,
                "backward float32": backward / 20,
            },
        },
        mask_gbs=1000.0,
        source=source,
        fresh_gbs=1000.0,
        masked_gps=100.0,
        score_mod_gps=10_000.0,
    )


CUDA_SM90_RATES = _cuda_rates(
    300.0,
    "published figures (H100: torch SDPA's bf16 forward at 287-304 TFLOP/s, pytorch/benchmark #2296; FlexAttention "
    "at 90%/85% of FlashAttention-2, PyTorch blog 2024), not measured by this project",
)
CUDA_SM80_RATES = _cuda_rates(
    200.0,
    "published figures scaled to an A100 (2/3 of the H100 table: FlashAttention-2's A100 forward reaches about 200 "
    "TFLOP/s at d = 128), not measured by this project",
)

# The static tables, by device kind (multihead.backends.policy.DeviceKind.name)
RATES_BY_KIND: dict[str, KernelRates] = {
    "cpu-avx2": CPU_AVX2_RATES,
    "cpu-avx512-bf16": CPU_AVX512_BF16_RATES,
    "cuda-sm80": CUDA_SM80_RATES,
    "cuda-sm90": CUDA_SM90_RATES,
}


def unmeasured(kind: str) -> KernelRates:
    """A table with no rates, for a device kind none is known for: no backend estimates, and auto keeps the
    priority order."""
    return KernelRates({}, mask_gbs=1.0, source=f"no rates known for {kind}: auto keeps the backends' priority order")
