"""Layer benchmark: multihead.MultiHeadAttention vs a textbook module vs torch.nn.MultiheadAttention, in one run.

Every case runs one self-attention layer on x of shape (batch, n, embed_dim), batch = 1, with the
same weights in every implementation (copied with multihead.compat.to_torch and load_state_dict;
the biases are set to small random values so their mapping is exercised too):

    multihead            multihead.MultiHeadAttention: layer(x, causal=c)                       -> out
    multihead_weights    the same with need_weights=True                 -> out, weights (b, h, n, n) per head
    textbook             multihead.lab.bench.TextbookMHA: four nn.Linear, view/transpose, q k^T / sqrt(d), causal
                         masked_fill, softmax, @ v, concat, out proj -> out, weights (b, h, n, n)
    torch_mha_weights    torch.nn.MultiheadAttention(batch_first=True)(x, x, x), need_weights=True (its
                         default)                                        -> out, weights (b, n, n) averaged
    torch_mha_noweights  the same with need_weights=False                -> out

at two shapes, BERT-base (embed 768, 12 heads, full attention) and GPT-2-small (embed 768, 12 heads,
causal: causal=True for multihead; torch: is_causal=True with attn_mask =
nn.Transformer.generate_square_subsequent_mask(n), which torch requires with is_causal), for n in
{128, 512, 2048}, float32 and bfloat16, "forward" (eval mode, torch.no_grad()) and "forward+backward"
(train mode; x requires grad and the output is back-propagated with a fixed random
gradient; weights returned are not back-propagated). Before the cases of each (shape, n), all five
are run once in float32 and their outputs (and weights, per head or averaged) must agree to 1e-4.

Measurements use the helpers the kernel benchmark uses (harness.common): one warmup call (left
out when one call is predicted to take over ``warmup_skip_s``: the memory call then warms up), one call
for the peak memory (VmHWM after minus VmRSS before, with every buffer >= 64 KiB mmapped, see
kernel.py), then timed calls (at least 1, up to ``max_repeats`` or about ``max_total_s`` s); the
median is reported. A case is skipped, and recorded with its predicted time, when one call is
predicted to take over ``budget_s`` (from the same series at the previous n, scaled by this
benchmark's FLOP count) or to need over 75% of RAM.

    FLOPs  8 n E^2 (projections) + 4 h n^2 d (attention, / 2 causal); backward: projections x 3,
           attention x 3.5 (kernel.py's convention), the same count for every implementation

Decode (GPT-2-small-shaped multihead layer, float32, batch 1): prompt P in {128, 512, 2048}, then
new tokens one at a time, (a) with the KV cache (layer.new_cache(1, P + T); prefill, then
layer(x_t, causal=True, cache=cache) per token) and (b) without (the full causal forward over the
prefix each step, keeping the last position). Both see the same inputs and must agree to 1e-4.
K/V bytes read per step = 2 * layers (1) * g * L * d * itemsize, L the keys attended.

Usage:
    python benchmarks/layer.py [--quick] [--budget-s 60] [--out benchmarks/results]
                               [--sizes 128,512,2048] [--dtypes float32,bfloat16]

Writes layer.json, layer.md and layer.png under --out (layer_quick.* with --quick). Importable (for
harness.suite): ``run(config, progress=None) -> dict``, ``Config`` and
``Config.quick_config(**overrides)``, ``write_reports(results, out_dir, stem) -> str`` (markdown),
``write_json``, ``plot`` (PNG), ``markdown_report`` and ``main(argv)``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import multihead
from harness import common
from harness.common import DTYPES, MIB, MODES, find, fmt, ratio
from multihead import _figures
from multihead.lab.bench import TextbookMHA, attention_layers

SHAPES = {
    "bert-base": {"embed_dim": 768, "heads": 12, "causal": False},
    "gpt2-small": {"embed_dim": 768, "heads": 12, "causal": True},
}
DECODE_SHAPE = "gpt2-small"
IMPLS = ("multihead", "multihead_weights", "textbook", "torch_mha_weights", "torch_mha_noweights")
PROJ_BWD_FACTOR = 3.0  # forward+backward FLOPs over forward FLOPs for the projections (dX and dW)
ATTN_BWD_FACTOR = common.FWD_BWD_FLOP_FACTOR  # 3.5, kernel.py's convention for attention
SANITY_TOL = 1e-4
# target (3): the per-token time with the cache may grow from the shortest prompt to the longest by at most
# DECODE_BANDWIDTH_SLACK x the time to stream the extra K/V bytes at the measured read bandwidth
DECODE_BANDWIDTH_SLACK = 2.0
WEIGHTS_SPEEDUP_MIN = 1.4  # target (2)
BF16_PEAK_SIZE = 512  # torch.mm bfloat16 at 2048^2 takes about a minute here; measured at 512^2 instead


# --------------------------------------------------------------------------- the models, sharing weights


@dataclass
class Models:
    """The three modules of one shape and dtype, with the same weights."""

    ours: multihead.MultiHeadAttention
    textbook: TextbookMHA
    torch_mha: nn.MultiheadAttention

    def module(self, impl: str) -> nn.Module:
        if impl.startswith("multihead"):
            return self.ours
        return self.textbook if impl == "textbook" else self.torch_mha

    def to(self, dtype: torch.dtype) -> Models:
        return Models(*(copy.deepcopy(m).to(dtype) for m in (self.ours, self.textbook, self.torch_mha)))


def build_models(embed_dim: int, heads: int, seed: int) -> Models:
    """float32 modules (multihead.lab.bench.attention_layers): ours (Xavier weights, small random biases), then its
    weights copied into the textbook module and torch's."""
    ours, torch_mha, textbook = attention_layers(embed_dim, heads, torch.float32, seed)
    return Models(ours, textbook, torch_mha)


def torch_causal_mask(n: int, dtype: torch.dtype) -> torch.Tensor:
    """torch's documented causal attn_mask (float, -inf above the diagonal), required with is_causal=True.

    A float mask also keeps torch off its fast path, where is_causal is ignored and the dense mask
    applied (slower than the SDPA is_causal path it takes here)."""
    return nn.Transformer.generate_square_subsequent_mask(n, dtype=dtype)


ImplFn = Callable[[Models, torch.Tensor, bool, "torch.Tensor | None"], tuple]


def _multihead(m: Models, x: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> tuple:
    return m.ours(x, causal=causal)


def _multihead_weights(m: Models, x: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> tuple:
    return m.ours(x, causal=causal, need_weights=True)


def _textbook(m: Models, x: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> tuple:
    return m.textbook(x, causal=causal)


def _torch_weights(m: Models, x: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> tuple:
    return m.torch_mha(x, x, x, need_weights=True, attn_mask=mask, is_causal=causal)


def _torch_noweights(m: Models, x: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> tuple:
    return m.torch_mha(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)


IMPL_FNS: dict[str, ImplFn] = {
    "multihead": _multihead,
    "multihead_weights": _multihead_weights,
    "textbook": _textbook,
    "torch_mha_weights": _torch_weights,
    "torch_mha_noweights": _torch_noweights,
}


# --------------------------------------------------------------------------- configuration


@dataclass
class Config(common.BenchConfig):
    shapes: tuple[str, ...] = tuple(SHAPES)
    sizes: tuple[int, ...] = (128, 512, 2048)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    modes: tuple[str, ...] = MODES
    impls: tuple[str, ...] = IMPLS
    batch: int = 1
    budget_s: float = 60.0  # predicted seconds for one call above which a case is skipped
    warmup_skip_s: float = 5.0  # no separate warmup call when one call is predicted to take longer
    max_repeats: int = 15  # many cheap calls: the median resists a burst of another process's work
    max_total_s: float = 2.0
    decode_prompts: tuple[int, ...] = (128, 512, 2048)
    decode_new_tokens: int = 32
    decode_repeats: int = 3  # generations with the cache (after one warmup generation); 1 without
    decode_dtype: str = "float32"
    quick: bool = False
    seed: int = 0
    strict_sanity: bool = True  # raise AssertionError when the implementations disagree
    busy_retries: int = 1  # measure a case again when other processes used > BUSY_WARNING of the CPUs
    busy_wait_s: float = 60.0  # how long to wait for a quiet machine before measuring again
    out_dir: Path | None = None  # when set, <stem>.json is rewritten after every case

    NAME = "layer"  # output stem: layer, or layer_quick
    # --quick: n in {128, 512}, float32, decode with prompts 128/512 and 8 new tokens, fewer repeats
    QUICK = {
        "sizes": (128, 512),
        "dtypes": ("float32",),
        "max_repeats": 5,
        "max_total_s": 0.4,
        "decode_prompts": (128, 512),
        "decode_new_tokens": 8,
        "decode_repeats": 2,
    }


# --------------------------------------------------------------------------- interference and bandwidth


class CpuProbe:
    """CPU time the rest of the machine used while this process measured: busy time in /proc/stat
    (user, nice, system, irq, softirq, steal) minus this process's own CPU time (os.times). Another
    benchmark or test run on the same few cores shows up here; the timings then are not clean."""

    def __init__(self) -> None:
        self.busy0, self.own0, self.wall0 = self._busy_s(), self._own_s(), time.perf_counter()

    @staticmethod
    def _busy_s() -> float | None:
        try:
            with open("/proc/stat") as stat:
                fields = [int(v) for v in stat.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        t = os.times()
        return t.user + t.system

    def other_fraction(self) -> float | None:
        """Other processes' CPU time over (wall time x CPUs), clipped at 0; None off Linux."""
        busy = self._busy_s()
        if busy is None or self.busy0 is None:
            return None
        wall = time.perf_counter() - self.wall0
        other = (busy - self.busy0) - (self._own_s() - self.own0)
        return max(other, 0.0) / max(wall * (os.cpu_count() or 1), 1e-9)


BUSY_WARNING = 0.1  # a case whose timed calls saw other processes use > 10% of the CPUs is flagged
QUIET = 0.05  # the machine counts as quiet again when other processes use < 5% of the CPUs for a second


def wait_for_quiet(max_s: float) -> bool:
    """Sleep in one-second probes until other processes use < QUIET of the CPUs, at most ``max_s`` s."""
    deadline = time.perf_counter() + max_s
    while time.perf_counter() < deadline:
        probe = CpuProbe()
        time.sleep(1.0)
        fraction = probe.other_fraction()
        if fraction is None or fraction < QUIET:
            return True
    return False


def _busy(record: dict) -> float:
    """The largest share of the CPUs other processes used during a record's timed parts."""
    parts = [record, record.get("cache") or {}, record.get("no_cache") or {}]
    return max((part.get("other_cpu_frac") or 0.0) for part in parts)


def measure_quietly(measure: Callable[[], dict], config: Config, say: Callable[[str], None]) -> dict:
    """``measure()``, repeated up to ``config.busy_retries`` times (after waiting for a quiet machine)
    while other processes used more than BUSY_WARNING of the CPUs; keeps the least disturbed attempt
    and lists the others under "discarded_attempts"."""
    record = measure()
    discarded = []
    for _ in range(config.busy_retries):
        if _busy(record) <= BUSY_WARNING:
            break
        quiet = wait_for_quiet(config.busy_wait_s)
        say(
            f"    other processes used {_busy(record):.0%} of the CPUs: measuring again"
            f"{'' if quiet else ' (the machine did not become quiet)'}"
        )
        again = measure()
        keep, drop = (again, record) if _busy(again) < _busy(record) else (record, again)
        discarded.append(
            {
                key: drop.get(key)
                for key in ("median_s", "times_s", "other_cpu_frac", "cache", "no_cache")
                if key in drop
            }
        )
        record = keep
    if discarded:
        record["discarded_attempts"] = discarded
    return record


def read_bandwidth_gb_s(mib: int = 256, repeats: int = 5) -> dict:
    """Memory read bandwidth: torch.sum over a float32 tensor of ``mib`` MiB (far beyond the caches)."""
    big = torch.ones(mib * MIB // 4)
    big.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return {"mib": mib, "median_s": median, "gb_per_s": mib * MIB / median / 1e9, "how": "torch.sum, float32"}


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    impl: str
    shape: str
    n: int
    dtype: str
    mode: str
    batch: int

    @property
    def causal(self) -> bool:
        return SHAPES[self.shape]["causal"]

    @property
    def series(self) -> tuple:
        """Cases that differ only in n, whose costs predict one another."""
        return (self.impl, self.shape, self.dtype, self.mode, self.batch)

    def label(self) -> str:
        return f"{self.impl:<19} {self.shape:<10} n={self.n:<5} {self.dtype:<8} {self.mode}"


def layer_gflop(batch: int, n: int, embed_dim: int, heads: int, causal: bool, mode: str) -> float:
    """8 b n E^2 projections + 4 b h n^2 d attention (/ 2 causal); backward x 3 and x 3.5 respectively."""
    d = embed_dim // heads
    proj = 8 * batch * n * embed_dim**2
    attn = 4 * batch * heads * n * n * d / (2 if causal else 1)
    if mode == "forward+backward":
        proj, attn = proj * PROJ_BWD_FACTOR, attn * ATTN_BWD_FACTOR
    return (proj + attn) / 1e9


def predict(case: Case, previous: dict | None) -> tuple[float | None, float | None]:
    """(seconds for one call, peak MiB) predicted before running; None where nothing predicts it.

    Time: the same series at the previous n (its median, or its own prediction if skipped), scaled by
    the FLOP count without the causal halving (conservative). Memory: that case's peak scaled by n^2
    (an upper bound), and at least the (b, h, n, n) tensors the materialising ones keep (kernel.py's
    textbook counts).
    """
    s = SHAPES[case.shape]

    def growth(previous_n: int) -> float:
        return layer_gflop(case.batch, case.n, s["embed_dim"], s["heads"], False, case.mode) / layer_gflop(
            case.batch, previous_n, s["embed_dim"], s["heads"], False, case.mode
        )

    seconds, mib = common.scaled_from_previous(case.n, previous, growth)
    if case.impl in ("textbook", "torch_mha_weights", "multihead_weights"):
        mib = common.at_least_scores(mib, case.batch * s["heads"], case.n, case.dtype, case.mode)
    return seconds, mib


@dataclass
class LayerWorkload:
    """One implementation on a fixed input x (b, n, E): ``step()`` is one measured call, ``clear()``
    drops the gradients (a common.Workload, for common.peak_memory and common.time_calls)."""

    fn: ImplFn
    models: Models
    module: nn.Module
    x: torch.Tensor
    causal: bool
    mask: torch.Tensor | None
    grad_out: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        impl: str,
        models: Models,
        batch: int,
        n: int,
        embed_dim: int,
        dtype: torch.dtype,
        causal: bool,
        mode: str,
        seed: int,
    ) -> LayerWorkload:
        backward = mode == "forward+backward"
        (x,), grad_out = common.random_inputs((batch, n, embed_dim), 1, dtype, seed, backward)
        mask = torch_causal_mask(n, dtype) if causal and impl.startswith("torch") else None
        module = models.module(impl)
        module.train(backward)  # train mode (dropout 0) for forward+backward, eval for forward
        return cls(IMPL_FNS[impl], models, module, x, causal, mask, grad_out)

    def clear(self) -> None:
        self.x.grad = None
        self.module.zero_grad(set_to_none=True)

    def step(self) -> tuple:
        if self.grad_out is None:
            with torch.no_grad():
                return self.fn(self.models, self.x, self.causal, self.mask)
        out, weights = self.fn(self.models, self.x, self.causal, self.mask)
        out.backward(self.grad_out)
        return out.detach(), None if weights is None else weights.detach()


def measure_case(case: Case, models: Models, config: Config, peaks: dict, predicted_s: float | None) -> dict:
    """Warmup (unless one call is predicted to be long), one memory call, timed calls."""
    s = SHAPES[case.shape]
    workload = LayerWorkload.build(
        case.impl, models, case.batch, case.n, s["embed_dim"], DTYPES[case.dtype], case.causal, case.mode, config.seed
    )
    record: dict = {}
    # without a separate warmup call when one call is predicted to be long: the memory call then warms up
    warm = predicted_s is None or predicted_s <= config.warmup_skip_s
    record["warmup_s"] = common.warmup_call(workload) if warm else None
    record.update(common.memory_record(workload, timed=True))
    probe = CpuProbe()
    times = common.time_calls(workload.step, workload.clear, config.max_repeats, config.max_total_s)
    record["other_cpu_frac"] = probe.other_fraction()
    gflop = layer_gflop(case.batch, case.n, s["embed_dim"], s["heads"], case.causal, case.mode)
    peak = peaks.get(case.dtype, {}).get("gflops") if case.dtype == "float32" else None
    record.update(common.timing_record(times, gflop, peak))
    return record


def run_case(case: Case, models: Models, config: Config, peaks: dict, previous: dict | None, ram: int | None) -> dict:
    """Predict, then skip or measure one case. Failures are recorded with status "error"."""
    record = {
        **dataclasses.asdict(case),
        "causal": case.causal,
        "embed_dim": SHAPES[case.shape]["embed_dim"],
        "heads": SHAPES[case.shape]["heads"],
    }
    return common.run_case(
        record,
        predict(case, previous),
        lambda: measure_case(case, models, config, peaks, record["predicted_s"]),
        config.budget_s,
        ram,
    )


# --------------------------------------------------------------------------- sanity check


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def sanity_check(models: Models, shape: str, n: int, batch: int, seed: int) -> dict:
    """All five once in float32, forward: outputs vs multihead's, and the weights (per head vs the
    textbook's; torch's averaged vs multihead's averaged over heads). Max abs differences <= 1e-4."""
    s = SHAPES[shape]
    x = torch.randn(batch, n, s["embed_dim"], generator=torch.Generator().manual_seed(seed + 1))
    mask = torch_causal_mask(n, torch.float32) if s["causal"] else None
    for m in (models.ours, models.textbook, models.torch_mha):
        m.eval()
    with torch.no_grad():
        results = {impl: IMPL_FNS[impl](models, x, s["causal"], mask) for impl in IMPLS}
    ref = results["multihead"][0]
    diffs = {f"output {impl}": _max_diff(out, ref) for impl, (out, _) in results.items() if impl != "multihead"}
    ours_w, book_w, torch_w = (results[i][1] for i in ("multihead_weights", "textbook", "torch_mha_weights"))
    diffs["weights multihead vs textbook (per head)"] = _max_diff(ours_w, book_w)
    diffs["weights multihead mean over heads vs torch (averaged)"] = _max_diff(ours_w.mean(dim=1), torch_w)
    shapes_ok = (
        tuple(ours_w.shape) == (batch, s["heads"], n, n)
        and tuple(torch_w.shape) == (batch, n, n)
        and results["multihead"][1] is None
        and results["torch_mha_noweights"][1] is None
    )
    worst = max(diffs.values())
    return {
        "shape": shape,
        "n": n,
        "dtype": "float32",
        "tolerance": SANITY_TOL,
        "max_abs_diff": diffs,
        "worst": worst,
        "weight_shapes_ok": shapes_ok,
        "pass": worst <= SANITY_TOL and shapes_ok,
    }


# --------------------------------------------------------------------------- decode


def kv_bytes(layers: int, kv_heads: int, keys: int, head_dim: int, itemsize: int) -> int:
    """Bytes of K and V one step reads: 2 * layers * g * L * d * itemsize."""
    return 2 * layers * kv_heads * keys * head_dim * itemsize


def decode_case(
    models: Models, prompt: int, new_tokens: int, repeats: int, config: Config, predicted_step_s: float | None
) -> dict:
    """Generate ``new_tokens`` after a ``prompt``, with and without the KV cache (see the module docstring)."""
    layer = models.ours.eval()
    e, g, d = layer.embed_dim, layer.num_kv_heads, layer.head_dim
    dtype = layer.q_proj.weight.dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = prompt + new_tokens
    x = torch.randn(1, total, e, generator=torch.Generator().manual_seed(config.seed + prompt), dtype=dtype)
    record: dict = {
        "prompt": prompt,
        "new_tokens": new_tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": DECODE_SHAPE,
        "batch": 1,
    }
    cache = layer.new_cache(1, total)
    record["cache_mib"] = (cache.keys.numel() + cache.values.numel()) * itemsize / MIB
    cached_out: list[torch.Tensor] = []
    generations = []
    probe = CpuProbe()
    with torch.no_grad():
        for rep in range(repeats + 1):  # the first generation warms up
            cache.reset()
            t0 = time.perf_counter()
            layer(x[:, :prompt], causal=True, cache=cache)
            prefill_s = time.perf_counter() - t0
            steps, outs = [], []
            for t in range(new_tokens):
                x_t = x[:, prompt + t : prompt + t + 1]
                t0 = time.perf_counter()
                out, _ = layer(x_t, causal=True, cache=cache)
                steps.append(time.perf_counter() - t0)
                outs.append(out)
            if rep > 0:
                generations.append({"prefill_s": prefill_s, "steps_s": steps, "total_s": sum(steps)})
            cached_out = outs
    by_total = sorted(generations, key=lambda gen: gen["total_s"])
    median_gen = by_total[len(by_total) // 2]
    all_steps = [s for gen in generations for s in gen["steps_s"]]
    per_token = statistics.median(all_steps)
    mean_keys = prompt + (new_tokens + 1) / 2  # keys attended, averaged over the steps
    kv = kv_bytes(1, g, round(mean_keys), d, itemsize)
    weight_bytes = sum(p.numel() for p in layer.parameters()) * itemsize
    record["cache"] = {
        "other_cpu_frac": probe.other_fraction(),
        "generations": generations,
        "prefill_s": statistics.median(gen["prefill_s"] for gen in generations),
        "per_token_s_median": per_token,
        "per_token_s_min": min(all_steps),
        "tokens_per_s": new_tokens / median_gen["total_s"],
        "kv_bytes_per_step": kv,
        "kv_bytes_first_step": kv_bytes(1, g, prompt + 1, d, itemsize),
        "kv_bytes_last_step": kv_bytes(1, g, total, d, itemsize),
        "weight_bytes_per_step": weight_bytes,
        "implied_kv_gb_per_s": kv / per_token / 1e9,
        "implied_kv_plus_weights_gb_per_s": (kv + weight_bytes) / per_token / 1e9,
    }
    # without a cache: the whole causal forward over the prefix per token, keep the last position
    predicted_total = None if predicted_step_s is None else predicted_step_s * new_tokens
    record["no_cache"] = {"predicted_total_s": predicted_total}
    if predicted_total is not None and predicted_total > config.budget_s:
        record["no_cache"].update(
            status="skipped", reason=f"predicted {predicted_total:.3g} s > budget {config.budget_s:.3g} s"
        )
        return record
    with torch.no_grad():
        layer(x[:, :prompt], causal=True)  # warmup
        probe = CpuProbe()
        steps, outs = [], []
        for t in range(new_tokens):
            t0 = time.perf_counter()
            out, _ = layer(x[:, : prompt + t + 1], causal=True)
            last = out[:, -1:].clone()
            steps.append(time.perf_counter() - t0)
            outs.append(last)
    record["no_cache"].update(
        status="ok",
        other_cpu_frac=probe.other_fraction(),
        steps_s=steps,
        per_token_s_median=statistics.median(steps),
        tokens_per_s=new_tokens / sum(steps),
        total_s=sum(steps),
    )
    diff = max(_max_diff(a, b) for a, b in zip(cached_out, outs, strict=True))
    record["sanity"] = {"max_abs_diff_cache_vs_no_cache": diff, "tolerance": SANITY_TOL, "pass": diff <= SANITY_TOL}
    record["speedup_cache_vs_no_cache"] = record["no_cache"]["per_token_s_median"] / per_token
    return record


# --------------------------------------------------------------------------- the run


class LayerRun:
    """One run of the layer benchmark: its results so far and what the next case needs (the models of each
    (shape, dtype), the last record of each series, the matmul peaks). ``run`` drives it."""

    def __init__(self, config: Config, say: Callable[[str], None]) -> None:
        self.config, self.say = config, say
        self.started = time.perf_counter()
        load_start = os.getloadavg()
        common.prepare_allocator(say)
        self.peaks = self._matmul_peaks()
        bandwidth = read_bandwidth_gb_s()
        say(f"memory read bandwidth: {bandwidth['gb_per_s']:.1f} GB/s (torch.sum over {bandwidth['mib']} MiB)")
        self.results: dict = {
            "benchmark": "layer",
            "git_commit": _git_commit(),
            "machine": {**common.machine_info(self.peaks), "read_bandwidth": bandwidth},
            "config": config_json(config),
            "loadavg_start": load_start,
            "complete": False,
            "sanity": [],
            "cases": [],
            "decode": [],
        }
        self.ram = common.ram_bytes()
        self.base = {
            shape: build_models(SHAPES[shape]["embed_dim"], SHAPES[shape]["heads"], config.seed)
            for shape in config.shapes
        }
        self.models = {
            (shape, dtype): self.base[shape] if dtype == "float32" else self.base[shape].to(DTYPES[dtype])
            for shape in config.shapes
            for dtype in config.dtypes
        }
        self.last_in_series: dict[tuple, dict] = {}
        self.cases_total = len(config.shapes) * len(config.sizes) * len(config.modes) * len(config.impls)
        self.cases_total *= len(config.dtypes)
        self.cases_done = 0

    def _matmul_peaks(self) -> dict:
        peaks = {}
        for dtype in self.config.dtypes:
            size = common.PEAK_MATMUL_SIZE if dtype == "float32" else BF16_PEAK_SIZE
            peaks[dtype] = common.matmul_peak_gflops(
                DTYPES[dtype], self.config.max_repeats, self.config.max_total_s, size=size
            )
            self.say(f"matmul peak {dtype}: {peaks[dtype]['gflops']:.2f} GFLOP/s (torch.mm {size}x{size})")
        return peaks

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def save(self) -> None:
        """Ratios and targets from what is measured so far; <stem>.json rewritten when config.out_dir is set."""
        add_ratios(self.results["cases"])
        self.results["targets"] = evaluate_targets(self.results)
        if self.config.out_dir is not None:
            write_json(self.results, self.config.out_dir, self.config.stem)

    def sanity(self, shape: str, n: int) -> None:
        """All five agree in float32 at (shape, n); AssertionError (after saving) when not and strict_sanity."""
        check = sanity_check(self.base[shape], shape, n, self.config.batch, self.config.seed)
        self.results["sanity"].append(check)
        self.say(
            f"sanity {shape} n={n} float32: worst max abs diff {check['worst']:.2e} "
            f"({'ok' if check['pass'] else 'FAIL'})"
        )
        if not check["pass"] and self.config.strict_sanity:
            self.save()
            raise AssertionError(f"implementations disagree at {shape} n={n}: {check['max_abs_diff']}")

    def measure(self, case: Case) -> None:
        """Predict, then skip or measure one case (again when the machine was busy), record it and save."""
        self.cases_done += 1
        record = measure_quietly(
            lambda: run_case(
                case,
                self.models[case.shape, case.dtype],
                self.config,
                self.peaks,
                self.last_in_series.get(case.series),
                self.ram,
            ),
            self.config,
            self.say,
        )
        self.last_in_series[case.series] = record
        self.results["cases"].append(record)
        self.say(f"[{self.cases_done}/{self.cases_total} {self.elapsed():6.0f} s] {case.label()}: {_summary(record)}")
        self.save()

    def grid(self, dtype: str) -> None:
        """Every (shape, n, mode, impl) in ``dtype``; in float32 each (shape, n) is sanity-checked first."""
        config = self.config
        for shape in config.shapes:
            for n in sorted(config.sizes):
                if dtype == "float32":
                    self.sanity(shape, n)
                for mode in config.modes:
                    for impl in config.impls:
                        self.measure(Case(impl, shape, n, dtype, mode, config.batch))

    def decode(self) -> None:
        """Decode with and without the cache at each prompt length (read bandwidth measured again first)."""
        config = self.config
        bandwidth = read_bandwidth_gb_s()  # measured again, next to the decode timings
        self.results["decode_read_bandwidth"] = bandwidth
        self.say(f"memory read bandwidth before decode: {bandwidth['gb_per_s']:.1f} GB/s")
        models = (
            self.models.get((DECODE_SHAPE, config.decode_dtype))
            or self.base.get(DECODE_SHAPE)
            or build_models(SHAPES[DECODE_SHAPE]["embed_dim"], SHAPES[DECODE_SHAPE]["heads"], config.seed)
        )
        for prompt in sorted(config.decode_prompts):
            forward = find(
                self.results["cases"],
                impl="multihead",
                shape=DECODE_SHAPE,
                n=prompt,
                dtype=config.decode_dtype,
                mode="forward",
            )
            predicted_step_s = None if forward is None else forward["median_s"]
            record = measure_quietly(
                lambda prompt=prompt, predicted_step_s=predicted_step_s: decode_case(
                    models, prompt, config.decode_new_tokens, config.decode_repeats, config, predicted_step_s
                ),
                config,
                self.say,
            )
            self.results["decode"].append(record)
            self.say(f"[decode {self.elapsed():6.0f} s] {_decode_summary(record)}")
            if record.get("sanity", {}).get("pass") is False and config.strict_sanity:
                self.save()
                raise AssertionError(f"decode with and without the cache disagree: {record['sanity']}")
            self.save()

    def finish(self) -> dict:
        add_ratios(self.results["cases"])
        self.results["targets"] = evaluate_targets(self.results)
        self.results["complete"] = True
        self.results["elapsed_s"] = self.elapsed()
        self.results["loadavg_end"] = os.getloadavg()
        return self.results


def run(config: Config, progress: Callable[[str], None] | None = None) -> dict:
    """Measure everything ``config`` asks for; returns the results (see layer.json). ``progress`` (default:
    print) is called with a line before each sanity check and decode measurement and after each case.

    With ``config.out_dir`` set, <stem>.json is rewritten after every case, so a run stopped early
    keeps what it measured. Raises AssertionError (after writing) when a sanity check fails and
    ``config.strict_sanity``.
    """
    state = LayerRun(config, progress or (lambda line: print(line, flush=True)))
    # float32 first, then the decode benchmark, then the other dtypes (slow in bfloat16 here)
    first, rest = config.dtypes[:1], config.dtypes[1:]
    for dtype in first:
        state.grid(dtype)
    if config.decode_prompts and DECODE_SHAPE in SHAPES:
        state.decode()
    for dtype in rest:
        state.grid(dtype)
    return state.finish()


def _git_commit() -> str | None:
    """The checked-out commit of this package's source (with "+dirty" when tracked files differ), or None
    outside a git checkout."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def add_ratios(cases: Sequence[dict]) -> None:
    """Each measured case's time over every peer's on the same (shape, n, dtype, mode)."""
    for r in cases:
        if r["status"] != "ok":
            continue
        key = {"shape": r["shape"], "n": r["n"], "dtype": r["dtype"], "mode": r["mode"], "batch": r["batch"]}
        r["ratios"] = {
            peer: ratio(r["median_s"], other["median_s"])
            for peer in IMPLS
            if peer != r["impl"]
            for other in [find(cases, impl=peer, **key)]
            if other is not None
        }


def config_json(config: Config) -> dict:
    """The "config" section of the results: the fields and how things are measured."""
    out = config.to_json()
    out["shapes_detail"] = {name: SHAPES[name] for name in config.shapes}
    out["torch_causal_mask"] = "nn.Transformer.generate_square_subsequent_mask(n) with is_causal=True"
    out["warmup_calls"] = f"1, or 0 when one call is predicted to take over {config.warmup_skip_s} s"
    out["memory"] = (
        "one separate call: VmHWM after minus VmRSS before, MiB, with "
        f"M_MMAP_THRESHOLD={common.MEMORY_MMAP_THRESHOLD} (common.peak_memory)"
    )
    out["timing"] = common.TIMING_METHOD
    out["flops"] = (
        "8 b n E^2 + 4 b h n^2 d (/2 causal); forward+backward: projections x "
        f"{PROJ_BWD_FACTOR}, attention x {ATTN_BWD_FACTOR}"
    )
    out["bf16_matmul_peak_size"] = BF16_PEAK_SIZE
    return out


def _summary(record: dict) -> str:
    return common.summary(record, ".2f", _busy_note(record.get("other_cpu_frac")))


def _busy_note(fraction: float | None) -> str:
    return "" if fraction is None or fraction <= BUSY_WARNING else f" [BUSY: other processes {fraction:.0%} CPU]"


def _decode_summary(r: dict) -> str:
    c, nc = r["cache"], r["no_cache"]
    text = (
        f"prompt {r['prompt']} + {r['new_tokens']} tokens: cache {c['per_token_s_median'] * 1e3:.3f} ms/token "
        f"({c['tokens_per_s']:.0f} tok/s, prefill {c['prefill_s'] * 1e3:.1f} ms){_busy_note(c['other_cpu_frac'])}"
    )
    if nc.get("status") == "ok":
        text += (
            f"; no cache {nc['per_token_s_median'] * 1e3:.2f} ms/token ({nc['tokens_per_s']:.1f} tok/s); "
            f"max diff {r['sanity']['max_abs_diff_cache_vs_no_cache']:.1e}{_busy_note(nc['other_cpu_frac'])}"
        )
    else:
        text += f"; no cache {nc.get('status')}: {nc.get('reason')}"
    return text


# --------------------------------------------------------------------------- targets


def target_vs_torch_noweights(cases: Sequence[dict]) -> dict:
    """(1) multihead / torch_mha_noweights time <= 1.0 in every case measured for both."""
    goal = "multihead (no weights) time / torch.nn.MultiheadAttention(need_weights=False) time <= 1.0"
    ratios = []
    for ours in (r for r in cases if r["impl"] == "multihead" and r["status"] == "ok"):
        torch_nw = find(
            cases,
            impl="torch_mha_noweights",
            shape=ours["shape"],
            n=ours["n"],
            dtype=ours["dtype"],
            mode=ours["mode"],
            batch=ours["batch"],
        )
        if torch_nw is not None:
            ratios.append(
                {
                    "shape": ours["shape"],
                    "n": ours["n"],
                    "dtype": ours["dtype"],
                    "mode": ours["mode"],
                    "multihead_s": ours["median_s"],
                    "torch_noweights_s": torch_nw["median_s"],
                    "ratio": ours["median_s"] / torch_nw["median_s"],
                }
            )
    return common.ratio_target(goal, ratios, 1.0)


def target_weights_speedup(cases: Sequence[dict], n: int = 2048) -> dict:
    """(2) at n (2048), torch need_weights=True (averaged) time / multihead need_weights=True (per head) >= 1.4."""
    sizes = sorted({r["n"] for r in cases})
    used = n if n in sizes or not sizes else sizes[-1]
    goal = (
        f"at n={used}{'' if used == n else f' (n={n} not measured)'}: torch need_weights=True (averaged) "
        f"time / multihead need_weights=True (per head) time >= {WEIGHTS_SPEEDUP_MIN}"
    )
    checks = []
    for ours in (r for r in cases if r["impl"] == "multihead_weights" and r["n"] == used and r["status"] == "ok"):
        theirs = find(
            cases,
            impl="torch_mha_weights",
            shape=ours["shape"],
            n=used,
            dtype=ours["dtype"],
            mode=ours["mode"],
            batch=ours["batch"],
        )
        if theirs is not None:
            speedup = theirs["median_s"] / ours["median_s"]
            checks.append(
                {
                    "shape": ours["shape"],
                    "dtype": ours["dtype"],
                    "mode": ours["mode"],
                    "multihead_weights_s": ours["median_s"],
                    "torch_weights_s": theirs["median_s"],
                    "speedup": speedup,
                    "pass": speedup >= WEIGHTS_SPEEDUP_MIN,
                }
            )
    skipped = [
        f"{r['impl']} {r['shape']} {r['dtype']} {r['mode']}: {r['reason']}"
        for r in cases
        if r["n"] == used and r["impl"] in ("multihead_weights", "torch_mha_weights") and r["status"] != "ok"
    ]
    return {
        "goal": goal,
        "n": used,
        "checks": checks,
        "not_measured": skipped,
        "worst_speedup": min((c["speedup"] for c in checks), default=None),
        "pass": common.all_pass(checks),
    }


def target_decode_flat(decode: Sequence[dict], bandwidth_gb_s: float | None = None) -> dict:
    """(3) per-token time with the cache flat in prompt length up to memory bandwidth: from the shortest
    prompt to the longest it grows by at most DECODE_BANDWIDTH_SLACK x (extra K/V bytes / read bandwidth)."""
    per_token = {r["prompt"]: r["cache"]["per_token_s_median"] for r in decode}
    goal = (
        f"decode per-token time with the KV cache flat in prompt length up to memory bandwidth: its growth from "
        f"the shortest prompt to the longest <= {DECODE_BANDWIDTH_SLACK} x the time to read the extra K/V at the "
        "measured read bandwidth (this benchmark's reading of 'roughly flat'); the ratio longest/shortest "
        "is reported too"
    )
    if len(per_token) < 2 or not bandwidth_gb_s:
        return {"goal": goal, "pass": None, "per_token_s": per_token}
    short, long = min(per_token), max(per_token)
    growth = per_token[long] / per_token[short]
    no_cache = {r["prompt"]: r["no_cache"].get("per_token_s_median") for r in decode}
    nc_ratio = ratio(no_cache.get(long), no_cache.get(short))
    by_prompt = {r["prompt"]: r for r in decode}
    extra_bytes = by_prompt[long]["cache"]["kv_bytes_per_step"] - by_prompt[short]["cache"]["kv_bytes_per_step"]
    extra_s = per_token[long] - per_token[short]
    # what streaming the extra K/V at the measured read bandwidth alone would add to the shortest prompt's time
    bandwidth_ratio = (
        None if not bandwidth_gb_s else (per_token[short] + extra_bytes / (bandwidth_gb_s * 1e9)) / per_token[short]
    )
    return {
        "goal": goal,
        "per_token_s": per_token,
        "prompts": [short, long],
        "ratio": growth,
        "no_cache_per_token_s": no_cache,
        "no_cache_ratio": nc_ratio,
        "extra_kv_bytes_per_step": extra_bytes,
        "extra_s_per_step": extra_s,
        "incremental_gb_per_s": extra_bytes / extra_s / 1e9 if extra_s > 0 else None,
        "read_bandwidth_gb_s": bandwidth_gb_s,
        "ratio_if_bandwidth_bound": bandwidth_ratio,
        "extra_s_if_bandwidth_bound": extra_bytes / (bandwidth_gb_s * 1e9),
        "extra_over_bandwidth_bound": extra_s / (extra_bytes / (bandwidth_gb_s * 1e9)),
        "pass": extra_s <= DECODE_BANDWIDTH_SLACK * extra_bytes / (bandwidth_gb_s * 1e9),
    }


def evaluate_targets(results: dict) -> dict:
    cases = results["cases"]
    bandwidth = results.get("decode_read_bandwidth") or results["machine"].get("read_bandwidth") or {}
    return {
        "1_multihead_vs_torch_noweights": target_vs_torch_noweights(cases),
        "2_weights_speedup_n2048": target_weights_speedup(cases),
        "3_decode_flat": target_decode_flat(results["decode"], bandwidth.get("gb_per_s")),
        "sanity": {
            "goal": f"all implementations agree to {SANITY_TOL} (float32), decode with/without cache too",
            "pass": all(c["pass"] for c in results["sanity"])
            and all(r.get("sanity", {}).get("pass", True) for r in results["decode"]),
        },
    }


# --------------------------------------------------------------------------- reports

SHORT = {
    "multihead": "mh",
    "multihead_weights": "mh_w",
    "textbook": "book",
    "torch_mha_weights": "torch_w",
    "torch_mha_noweights": "torch_nw",
}


def markdown_cases(cases: Sequence[dict], dtype: str, mode: str) -> str:
    """One table per (dtype, mode): a row per case, its time over each peer's."""
    peers = " | ".join(f"/ {SHORT[p]}" for p in IMPLS)
    rows = [
        f"| shape | n | impl | time ms | GFLOP/s | peak MiB | {peers} |",
        "|---|---:|---|---:|---:|---:|" + "---:|" * len(IMPLS),
    ]
    skipped = []
    for r in cases:
        if r["dtype"] != dtype or r["mode"] != mode:
            continue
        if r["status"] != "ok":
            skipped.append(f"- {r['impl']} {r['shape']} n={r['n']} {dtype} {mode}: {r['status']} ({r['reason']})")
            continue
        ratios = r.get("ratios", {})
        cells = " | ".join("1" if p == r["impl"] else fmt(ratios.get(p), ".2f") for p in IMPLS)
        busy = "" if (r.get("other_cpu_frac") or 0.0) <= BUSY_WARNING else " *"
        rows.append(
            f"| {r['shape']} | {r['n']} | {r['impl']} | {r['median_s'] * 1e3:.2f}{busy} | {r['gflops']:.1f} "
            f"| {fmt(r['peak_mib'], '.1f')} | {cells} |"
        )
    text = "\n".join(rows)
    if skipped:
        text += "\n\nNot run:\n" + "\n".join(skipped)
    return text


def markdown_decode(decode: Sequence[dict]) -> str:
    rows = [
        (
            "| prompt | new tokens | cache ms/token | cache tok/s | prefill ms | no-cache ms/token | no-cache tok/s "
            "| speedup | K/V MB read/step | implied K/V GB/s | implied K/V+weights GB/s | max diff |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in decode:
        c, nc = r["cache"], r["no_cache"]
        ok = nc.get("status") == "ok"
        rows.append(
            f"| {r['prompt']} | {r['new_tokens']} | {c['per_token_s_median'] * 1e3:.3f} "
            f"| {c['tokens_per_s']:.0f} | {c['prefill_s'] * 1e3:.1f} "
            f"| {fmt(nc.get('per_token_s_median') and nc['per_token_s_median'] * 1e3, '.2f')} "
            f"| {fmt(nc.get('tokens_per_s'), '.1f')} | {fmt(r.get('speedup_cache_vs_no_cache'), '.1f')} "
            f"| {c['kv_bytes_per_step'] / 1e6:.2f} | {c['implied_kv_gb_per_s']:.1f} "
            f"| {c['implied_kv_plus_weights_gb_per_s']:.1f} "
            f"| {fmt(r['sanity']['max_abs_diff_cache_vs_no_cache'] if ok else None, '.1e')} |"
        )
    return "\n".join(rows)


def markdown_targets(targets: dict) -> str:
    verdicts = common.VERDICTS
    lines = []
    t1 = targets["1_multihead_vs_torch_noweights"]
    lines.append(f"- (1) {verdicts[t1['pass']]} — {t1['goal']}")
    if "worst" in t1:
        w = t1["worst"]
        lines.append(
            f"    - worst ratio {w['ratio']:.3f} ({w['shape']} n={w['n']} {w['dtype']} {w['mode']}); "
            f"{len(t1['failing'])} of {len(t1['cases'])} cases above 1.0"
        )
        for c in t1["cases"]:
            lines.append(
                f"    - {c['shape']} n={c['n']} {c['dtype']} {c['mode']}: {c['ratio']:.3f} "
                f"({c['multihead_s'] * 1e3:.2f} ms vs {c['torch_noweights_s'] * 1e3:.2f} ms)"
            )
    t2 = targets["2_weights_speedup_n2048"]
    lines.append(f"- (2) {verdicts[t2['pass']]} — {t2['goal']}")
    for c in t2["checks"]:
        lines.append(
            f"    - {c['shape']} {c['dtype']} {c['mode']}: speedup {c['speedup']:.2f} "
            f"({c['torch_weights_s'] * 1e3:.1f} ms vs {c['multihead_weights_s'] * 1e3:.1f} ms)"
        )
    for s in t2["not_measured"]:
        lines.append(f"    - not measured: {s}")
    t3 = targets["3_decode_flat"]
    lines.append(f"- (3) {verdicts[t3['pass']]} — {t3['goal']}")
    if "ratio" in t3:
        per = ", ".join(f"{p}: {s * 1e3:.3f} ms" for p, s in sorted(t3["per_token_s"].items()))
        lines.append(
            f"    - per-token time with the cache: {per}; ratio {t3['prompts'][1]}/{t3['prompts'][0]} = "
            f"{t3['ratio']:.2f} (without the cache: {fmt(t3['no_cache_ratio'], '.2f')})"
        )
        lines.append(
            f"    - extra K/V read per step {t3['extra_kv_bytes_per_step'] / 1e6:.1f} MB for "
            f"{t3['extra_s_per_step'] * 1e3:.3f} ms extra per token: "
            f"{fmt(t3['incremental_gb_per_s'], '.1f')} GB/s incremental (read bandwidth measured: "
            f"{fmt(t3['read_bandwidth_gb_s'], '.1f')} GB/s; streaming the extra K/V at that rate alone "
            f"would give a ratio of {fmt(t3['ratio_if_bandwidth_bound'], '.2f')}); the measured growth is "
            f"{t3['extra_over_bandwidth_bound']:.2f} x that bandwidth bound"
        )
    ts = targets["sanity"]
    lines.append(f"- sanity {verdicts[ts['pass']]} — {ts['goal']}")
    return "\n".join(lines)


def markdown_report(results: dict) -> str:
    m, cfg = results["machine"], results["config"]
    measured = sum(1 for r in results["cases"] if r["status"] == "ok")
    busy = sum(1 for r in results["cases"] if (r.get("other_cpu_frac") or 0.0) > BUSY_WARNING)
    load = f"load average at start {results['loadavg_start'][0]:.2f}" + (
        f", at end {results['loadavg_end'][0]:.2f}" if results.get("loadavg_end") else ""
    )
    parts = [
        "# Attention layer benchmark",
        f"commit {results.get('git_commit') or 'unknown'}",
        f"{common.machine_line(m, multihead_version=True)}; {load} (1 min)",
        f"Self-attention, batch {cfg['batch']}: "
        + "; ".join(
            f"{name} = embed {s['embed_dim']}, {s['heads']} heads, {'causal' if s['causal'] else 'full'}"
            for name, s in cfg["shapes_detail"].items()
        )
        + ". torch causal: "
        + cfg["torch_causal_mask"]
        + ".",
        "time = median; peak MiB = VmHWM - VmRSS before the call; GFLOP/s by " + cfg["flops"] + ". "
        "Columns `/ x`: this row's time over x's (below 1 = faster than x). mh = multihead, mh_w = multihead "
        "need_weights=True (per head), book = textbook, torch_w / torch_nw = torch.nn.MultiheadAttention with "
        "need_weights=True (averaged) / False. A time marked * was measured while other processes used more than "
        f"{BUSY_WARNING:.0%} of the CPUs (/proc/stat) even after {cfg['busy_retries']} more attempt(s) once the "
        f"machine was quiet (the least disturbed attempt is kept); {busy} of {measured} cases were.",
    ]
    for dtype in cfg["dtypes"]:
        for mode in cfg["modes"]:
            if any(r["dtype"] == dtype and r["mode"] == mode for r in results["cases"]):
                parts += ["", f"## {dtype}, {mode}", markdown_cases(results["cases"], dtype, mode)]
    if results["decode"]:
        parts += [
            "",
            f"## Decode ({DECODE_SHAPE}, {cfg['decode_dtype']}, batch 1, one token per step)",
            (
                "K/V MB read/step = 2 x 1 layer x g x L x d x itemsize at the mean L over the steps; implied GB/s = "
                "those bytes (plus the layer's weights) over the median per-token time."
            ),
            "",
            markdown_decode(results["decode"]),
        ]
    if results["sanity"]:
        worst = max(results["sanity"], key=lambda c: c["worst"])
        parts += [
            "",
            (
                f"Sanity (float32, forward): worst max abs difference {worst['worst']:.2e} "
                f"({worst['shape']} n={worst['n']}), tolerance {SANITY_TOL}."
            ),
        ]
    parts += ["", "## Targets", markdown_targets(results["targets"])]
    return "\n".join(parts) + "\n"


def plot(results: dict, path: Path) -> bool:
    """Time vs n per implementation (float32 solid, other dtypes dashed), one panel per (shape, mode);
    decode per-token time vs prompt length. False without matplotlib."""
    plt = common.pyplot()
    if plt is None:
        return False
    from matplotlib.lines import Line2D

    cases = [r for r in results["cases"] if r["status"] == "ok"]
    cfg = results["config"]
    panels = [(shape, mode) for shape in cfg["shapes"] for mode in cfg["modes"]]
    columns = len(cfg["modes"]) + (1 if results["decode"] else 0)
    rows = max(1, len(cfg["shapes"]))
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.8 * rows), squeeze=False)
    colors = dict(zip(IMPLS, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))  # more colors
    for index, (shape, mode) in enumerate(panels):
        ax = axes[index // len(cfg["modes"])][index % len(cfg["modes"])]
        for dtype in cfg["dtypes"]:
            for impl in IMPLS:
                points = sorted(
                    (r["n"], r["median_s"])
                    for r in cases
                    if r["impl"] == impl and r["shape"] == shape and r["mode"] == mode and r["dtype"] == dtype
                )
                if points:
                    ax.plot(
                        *zip(*points, strict=True),
                        marker="o",
                        color=colors[impl],
                        linestyle="-" if dtype == "float32" else "--",
                        label=f"{impl} ({dtype})",
                    )
        common.log_axes(ax, f"{shape}, {mode}", "n", "time (s)")
    handles = [Line2D([], [], color=colors[impl], marker="o", label=impl) for impl in IMPLS]
    handles += [
        Line2D([], [], color="gray", linestyle="-" if dtype == "float32" else "--", label=dtype)
        for dtype in cfg["dtypes"]
    ]
    axes[0][0].legend(handles=handles, fontsize=6)
    if results["decode"]:
        decode = sorted(results["decode"], key=lambda r: r["prompt"])
        prompts = [r["prompt"] for r in decode]
        for extra in range(1, rows):
            axes[extra][columns - 1].axis("off")
        # per-token time, then (with a second row) tokens per second, each with and without the cache
        panels_decode = [
            (
                "per_token_s_median",
                1e3,
                "no cache (full prefix)",
                f"decode {DECODE_SHAPE}: time per new token",
                "ms / token",
            )
        ]
        if rows > 1:
            panels_decode.append(("tokens_per_s", 1.0, "no cache", "decode: tokens / s", None))
        for row, (field, scale, no_cache_label, title, ylabel) in enumerate(panels_decode):
            ax = axes[row][columns - 1]
            ax.axis("on")
            ax.plot(prompts, [r["cache"][field] * scale for r in decode], marker="o", label="KV cache")
            no_cache = [
                (r["prompt"], r["no_cache"][field] * scale) for r in decode if r["no_cache"].get("status") == "ok"
            ]
            if no_cache:
                ax.plot(*zip(*no_cache, strict=True), marker="s", label=no_cache_label)
            common.log_axes(ax, title, "prompt length", ylabel)
            ax.legend(fontsize=7)
    _figures.save_figure(fig, path)
    return True


def write_json(results: dict, out_dir: Path, stem: str = "layer") -> Path:
    """Write <stem>.json atomically (through a .tmp file)."""
    return common.write_json(results, out_dir, stem)


def write_reports(results: dict, out_dir: Path, stem: str = "layer") -> str:
    """<stem>.json, <stem>.md and <stem>.png under out_dir; returns the markdown."""
    return common.write_reports(results, out_dir, stem, markdown_report, plot)


# --------------------------------------------------------------------------- command line


def build_parser(default_out: Path | None = None) -> argparse.ArgumentParser:
    """The options: --quick, --budget-s, --out (default ``default_out``, else benchmarks/results), --sizes, --dtypes."""
    return common.build_parser(
        __doc__,
        "n in {128, 512}, float32, decode prompts 128/512 with 8 new tokens (< 1 min)",
        60.0,
        "128,512,2048",
        default_out,
    )


def main(argv: Sequence[str] | None = None, *, reexec: bool = True, default_out: Path | None = None) -> int:
    """Run the benchmark and write the reports (targets are reported, not turned into the exit status).
    With ``reexec`` the process first re-executes itself with MALLOC_MMAP_THRESHOLD_ set
    (common.ensure_malloc_env). ``default_out``: the folder when --out is not given (default:
    benchmarks/results, see common.default_out_dir)."""
    return common.bench_main(argv, lambda: build_parser(default_out), Config, run, write_reports, reexec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
