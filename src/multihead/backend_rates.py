"""Each backend's rate here, for ``backend="auto"`` to compare them (:mod:`multihead.backends.costs`).

:func:`calibrate_kernels` times every built-in kernel in each precision, how fast a dense mask is built, how fast
new memory is written (the casts of a half call computed in float32) and how fast tiled masks a block's scores;
``multihead bench --calibrate`` (:func:`multihead.machine.calibrate`) runs it and keeps the result with the rest of
this machine's calibration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch

from multihead.backends.rates import DEFAULT_SCORE_MOD_GPS, KernelRates

__all__ = ["calibrate_kernels", "KERNEL_CASES"]

# precision: (dtype, the two lengths each kernel is timed at); the same for both, so that a kernel's precisions
# compare (the sdpa backend picks the faster one). Two lengths part the cost per pair from the cost per row
KERNEL_CASES = {"float32": (torch.float32, (1024, 2048)), "half": (torch.bfloat16, (1024, 2048))}
KERNEL_HEADS, KERNEL_HEAD_DIM = 8, 64
Key = TypeVar("Key", bound=Hashable)


def _kernel_flops(n: int) -> float:
    """Forward n x n FLOPs of the calibration case: 2 (d + e) per pair and head, b = 1."""
    return 2.0 * (2 * KERNEL_HEAD_DIM) * KERNEL_HEADS * n * n


def _median_call_s(call: Callable[[], object], repeats: int = 3) -> float:
    """One call's median seconds over ``repeats`` calls after a warm-up (:func:`_interleaved_median_s` of one)."""
    return _interleaved_median_s({"call": call}, repeats)["call"]


def _interleaved_median_s(calls: dict[Key, Callable[[], object]], repeats: int) -> dict[Key, float]:
    """Each call's median seconds over ``repeats`` rounds that run every call once, the order rotated each round
    (so a slow spell of the machine, or the memory one call leaves behind, falls on each in turn), after a warm-up
    round."""
    names = list(calls)
    times: dict[Key, list[float]] = {name: [] for name in names}
    for round_index in range(repeats + 1):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            calls[name]()
            if round_index:  # round 0 warms up
                times[name].append(time.perf_counter() - start)
    return {name: sorted(seconds)[len(seconds) // 2] for name, seconds in times.items()}


def fit_rate_and_row_cost(
    flops: tuple[float, float], rows: tuple[int, int], seconds: tuple[float, float]
) -> tuple[float, float]:
    """(GFLOP/s, microseconds per row) of a kernel timed at two lengths: ``seconds[k] = flops[k] / rate +
    rows[k] x cost per row`` through both points. The cost per row is held to [0, half of either call's time per
    row]: timing noise can tilt the line past what the calls allow, and a rate is then read from the longer call."""
    (f1, f2), (r1, r2), (t1, t2) = flops, rows, seconds
    per_row = (f1 * t2 - f2 * t1) / (f1 * r2 - f2 * r1)  # Cramer's rule for the 2 x 2 system
    per_row = min(max(per_row, 0.0), t1 / (2 * r1), t2 / (2 * r2))
    return f2 / (t2 - r2 * per_row) / 1e9, per_row * 1e6


def _torch_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None, backend: str
) -> torch.Tensor:
    """torch's SDPA at the inputs' precision, as the sdpa backend calls it (``backend`` is "sdpa")."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _kernel_calls(
    attention: Callable[..., object],
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    grad: torch.Tensor,
    mask: torch.Tensor | None,
    backend: str,
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(a forward call, a forward+backward call) of ``backend`` on ``inputs``."""

    def forward() -> object:
        with torch.no_grad():
            return attention(*inputs, mask=mask, backend=backend)

    def training() -> None:
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = attention(*leaves, mask=mask, backend=backend)
        assert isinstance(out, torch.Tensor)
        out.backward(grad)

    return forward, training


def calibrate_kernels(
    precisions: Sequence[str] = ("float32", "half"), *, repeats: int = 5, flex: bool = True, where: str = "this machine"
) -> KernelRates:
    """Measure each built-in backend's n x n rate here, for ``backend="auto"`` to compare them
    (:mod:`multihead.backends.costs`): b = 1, h = 8, d = e = 64 at n = 1024 and 2048 in float32 and in bfloat16
    for "half", forward and forward+backward, the median of ``repeats`` interleaved rounds after a warm-up. Each
    kernel runs in the precision given (``costs.native_precision``): "sdpa" and "sdpa masked" are torch's kernel
    itself (the sdpa and flex backends run a half call in float32 where that rate is higher).

    Rates count 2 (d + e) FLOPs per pair forward and 2.5 times that backward (backward time: forward+backward
    minus forward), so they include each kernel's softmax and per-block work at d = 64; what a call spends per
    query row beside its pairs is ``row_us``, parted from the rate by the two lengths
    (:func:`fit_rate_and_row_cost`). "sdpa masked" is SDPA given a dense bool mask; ``mask_gbs`` is how fast the
    (1, 8, 2048, 2048) window & ALiBi mask SDPA would be handed is built (``BoundMask.additive``, float32),
    ``fresh_gbs`` how fast a new 64 MiB tensor is written (the casts of a half call computed in float32),
    ``masked_gps`` how fast tiled masks a block's scores and ``score_mod_gps`` how fast flex's score_mod adds a bias
    (:func:`_measure_bias_gps`). With ``flex``, the flex backend is compiled (seconds) and timed forward (it has no
    backward on the CPU); without it, ``score_mod_gps`` is the default.
    """
    from multihead import masks as typed_masks
    from multihead.backends.costs import native_precision
    from multihead.masks import AttentionShape, bind_mask

    gflops: dict[str, dict[str, float]] = {}
    row_us: dict[str, dict[str, float]] = {}
    with native_precision():  # each kernel in each precision as it is, not as auto would run it
        for name in precisions:
            _measure_kernels(gflops, row_us, name, repeats, flex)
    # building a dense mask as the sdpa backend does: a (1, 8, 2048, 2048) float32 ALiBi bias with the window's -inf
    shape = AttentionShape(1, 8, 2048, 2048, torch.device("cpu"))
    bound = bind_mask(typed_masks.window(256) & typed_masks.alibi(typed_masks.alibi_slopes(8)), False, shape)
    mask_s = _median_call_s(lambda: bound.additive(torch.float32), repeats)
    # writing a new tensor, as a cast does: past glibc's largest mmap threshold (32 MiB) every one is fresh pages
    fresh_s = _median_call_s(lambda: torch.empty(FRESH_ELEMENTS).fill_(1.0), repeats)
    return KernelRates(
        gflops,
        mask_gbs=8 * 2048 * 2048 * 4 / mask_s / 1e9,
        source=f"calibrated {time.strftime('%Y-%m-%d %H:%M')} on {where}",
        fresh_gbs=FRESH_ELEMENTS * 4 / fresh_s / 1e9,
        masked_gps=_measure_bias_gps("tiled", max(repeats, 3)),
        score_mod_gps=_measure_bias_gps("flex", max(repeats, 3)) if flex else DEFAULT_SCORE_MOD_GPS,
        row_us=row_us,
    )


def _measure_bias_gps(backend: str, repeats: int) -> float:
    """Billions of scores per second ``backend`` spends adding an ALiBi bias to each score (tiled: block by block,
    beside its matrix products; flex: in its score_mod): its float32 forward at n = 1024 with the bias (every
    score biased) against the same call without, in alternating calls; the median of the per-round differences.
    Flex is compiled for both (seconds) by the warm-up calls."""
    from multihead import masks as typed_masks
    from multihead.functional import attention

    n = KERNEL_CASES["float32"][1][0]
    q, k, v = (torch.randn(1, KERNEL_HEADS, n, KERNEL_HEAD_DIM) for _ in range(3))
    alibi = typed_masks.alibi(typed_masks.alibi_slopes(KERNEL_HEADS))

    def seconds(mask: typed_masks.Mask | None) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            attention(q, k, v, mask=mask, backend=backend)
        return time.perf_counter() - start

    seconds(None), seconds(alibi)  # warm-up
    differences = sorted(seconds(alibi) - seconds(None) for _ in range(repeats))
    return KERNEL_HEADS * n * n / max(differences[len(differences) // 2], 1e-6) / 1e9


FRESH_ELEMENTS = 16 * 2**20  # float32: 64 MiB


def _measure_kernels(
    gflops: dict[str, dict[str, float]], row_us: dict[str, dict[str, float]], precision: str, repeats: int, flex: bool
) -> None:
    """Add each kernel's forward (and backward) GFLOP/s in ``precision`` to ``gflops[label]`` and its cost per row to
    ``row_us[label]``, from interleaved rounds at each of the precision's two lengths (:func:`fit_rate_and_row_cost`;
    backward time: forward+backward minus forward)."""
    from multihead.backends import flex as flex_backend
    from multihead.backends.costs import BACKWARD_FLOP_FACTOR
    from multihead.functional import attention

    dtype, lengths = KERNEL_CASES[precision]
    seconds: dict[tuple[str, str], list[float]] = {}  # (label, direction) -> seconds at each length
    for n in lengths:
        q, k, v, grad = (torch.randn(1, KERNEL_HEADS, n, KERNEL_HEAD_DIM, dtype=dtype) for _ in range(4))
        keep = torch.rand(n, n) < 0.9
        keep[:, 0] = True  # no empty row
        calls: dict[tuple[str, str], Callable[[], object]] = {}
        for label, kernel, backend, mask in (
            ("sdpa", _torch_sdpa, "sdpa", None),
            ("sdpa masked", _torch_sdpa, "sdpa", keep),
            ("tiled", attention, "tiled", None),
            ("materialized", attention, "materialized", None),
        ):
            calls[label, "forward"], calls[label, "training"] = _kernel_calls(kernel, (q, k, v), grad, mask, backend)
        # flex (FlexAttention): compiled once here (seconds), then timed; forward only where it has no backward (CPU)
        if flex:
            flex_backend.warm_up(heads=KERNEL_HEADS, qk_dim=KERNEL_HEAD_DIM, dtype=dtype, length=n)
            calls["flex", "forward"] = _kernel_calls(attention, (q, k, v), grad, None, "flex")[0]
        medians = _interleaved_median_s(calls, repeats)
        for (label, direction), median in medians.items():
            if direction == "training":
                forward = medians[label, "forward"]
                seconds.setdefault((label, "backward"), []).append(max(median - forward, forward / 100))
            else:
                seconds.setdefault((label, direction), []).append(median)
    rows = (KERNEL_HEADS * lengths[0], KERNEL_HEADS * lengths[1])
    for (label, direction), (short, long) in seconds.items():
        factor = BACKWARD_FLOP_FACTOR if direction == "backward" else 1.0
        flops = (factor * _kernel_flops(lengths[0]), factor * _kernel_flops(lengths[1]))
        rate, per_row = fit_rate_and_row_cost(flops, rows, (short, long))
        gflops.setdefault(label, {})[f"{direction} {precision}"] = rate
        row_us.setdefault(label, {})[f"{direction} {precision}"] = per_row
