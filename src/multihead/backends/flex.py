"""torch's FlexAttention (``torch.nn.attention.flex_attention``): typed masks lowered to mask_mod/score_mod.

Each bound mask becomes, from its terms' own mods (``BoundTerm.mod``: the one definition every backend reads)

- a ``mask_mod(b, h, q_idx, kv_idx) -> bool``: the keep terms' mods (causal in either alignment, window,
  padding, allowed tensors, a user's mask_mod) and a bias's -inf entries, and-ed together;
- a ``score_mod(score, b, h, q_idx, kv_idx) -> score`` on the scaled score: the soft-cap first, then
  the bias terms' mods (ALiBi, bias tensors, a user's score_mod) added, the order
  :mod:`multihead.backends._blocks` uses;
- a ``BlockMask`` of 128 x 128 blocks built from our own :meth:`BoundMask.block_states` (no i x j tensor):
  empty blocks are skipped, full blocks skip the mask_mod.

Sizes and offsets enter the mods as tensors, never as Python numbers, so one compiled kernel serves
every sequence length: kernels are compiled with ``torch.compile(dynamic=True)`` once per cache key,
which holds what changes the generated code (the mask's structure, dtype, device, heads and head dims,
GQA, LSE, backward, decoding with one query or key), and never a length. Duck sizing (torch treating
two sizes that happen to be equal as one symbol) is off while compiling, so a batch of 2 and 2 key
blocks do not pin a kernel to each other.

What it serves here (torch 2.13):

- CPU (x86 with AVX2): forward only. FlexAttention has no CPU backward, and its compiled CPU kernel
  returns no log-sum-exp (so no learned sinks either: they are folded in from it) and fails to compile a
  mod that reads a tensor by query position (bias or allowed tensors, ALiBi aligned row by row as varlen's and
  the KV-cache call's): those calls are refused with the reason. float32, bfloat16, float16.
- CUDA: forward and backward, LSE, sinks, every mask kind (not run in this project's tests: no GPU).

The first call of each cache key compiles for about :data:`TYPICAL_COMPILE_S` seconds, so ``auto``
passes flex over until a kernel for the call exists (:func:`flex_is_warm`); :func:`warm_up` compiles one
ahead of time, and naming ``backend="flex"`` compiles on the spot. Fully masked rows give output 0 and
LSE -inf, as on every backend.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx.experimental._config as fx_config
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention, noop_mask

from multihead._errors import bad_argument, describe
from multihead.backends.costs import block_kernel_estimate, call_compute_dtype, inputs_in_faster_dtype
from multihead.backends.precision import autocast_inputs
from multihead.backends.registry import AttentionCall, BackendOutput, Capabilities, changed
from multihead.masks import (
    STATE_EMPTY,
    STATE_FULL,
    STATE_PARTIAL,
    AttentionShape,
    BoundMask,
    Mask,
    bind_mask,
    device_scalar,
)

__all__ = ["CAPABILITIES", "flex_attention_backend", "flex_is_warm", "warm_up", "compile_seconds"]

BLOCK = 128  # BlockMask block size (queries x keys), FlexAttention's default
# Measured on a shared 2-core AVX2 EPYC (torch 2.13, float32, cold on-disk inductor cache): 15-16 s for the first
# kernel in a process (inductor's start-up included), 7 s for each further one, 2-3x that while the machine is busy;
# 1-5 s when inductor's on-disk cache holds the kernel already. Used in auto's message until a compile was timed.
TYPICAL_COMPILE_S = 15.0
SERVED_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

# cache key -> the compiled kernel; cache key -> seconds its first call took (compile included)
_KERNELS: dict[tuple, Callable] = {}
_WARM: set[tuple] = set()
_COMPILE_SECONDS: dict[tuple, float] = {}
_FAILED: dict[tuple, str] = {}  # cache key -> the first line of the compiler's error: refused from then on
_LOCK = threading.Lock()
# BlockMasks of masks whose keep terms hold no data (bands: causal, windows), by the mask's structure, its lengths
# and device: a training or decode loop calls with the same ones every step, and builds its table once
_BLOCK_MASKS: dict[tuple, BlockMask] = {}
BLOCK_MASK_LIMIT = 64  # kept; past it the cache starts again


# --------------------------------------------------------------------------- lowering


@dataclass
class _Lowered:
    structure: tuple  # what of the mask changes the generated code (kinds, broadcast patterns), no values
    mask_mod: Callable | None  # (b, h, q_idx, kv_idx) -> bool, None: every pair allowed
    score_mod: Callable  # (score, b, h, q_idx, kv_idx) -> score


def _unsupported_terms(mask: BoundMask, device: torch.device) -> list[str]:
    """Mask terms this backend cannot lower on ``device`` (empty: it can lower all of them)."""
    if device.type != "cpu":
        return []
    return [
        f"{'an' if term.kind[0] in 'aeiou' else 'a'} {term.kind} term whose mod reads a tensor by query position, on "
        "CPU (torch 2.13's CPU FlexAttention kernel does not compile one with dynamic shapes)"
        for term in mask.terms
        if term.reads_pair_tensor
    ]


def _finite(mod: Callable) -> Callable:
    """A bias mod's keep part: the pairs where it is not -inf."""

    def keep(b, h, q, k):
        return mod(b, h, q, k) > -math.inf

    return keep


def _zero_minus_inf(mod: Callable) -> Callable:
    """A bias mod with its -inf entries as 0: the keep part (:func:`_finite`) masks those pairs."""

    def bias(b, h, q, k):
        value = mod(b, h, q, k)
        return torch.where(value == -math.inf, torch.zeros_like(value), value)

    return bias


def _structure(mask: BoundMask) -> tuple:
    """What of the mask changes the compiled code (each term's kind and broadcast pattern, the soft-cap), no
    value: the structure part of the cache key."""
    return tuple(term.structure() for term in mask.terms) + ((("softcap",),) if mask.softcap is not None else ())


def _lower(mask: BoundMask, work: torch.dtype, ratio: float = 1.0) -> _Lowered:
    """The mask as FlexAttention mods: each term's own mod passed through (``BoundTerm.mod``, lifted so its
    numbers are tensors and no length is compiled in), keep terms and-ed into the mask_mod, bias terms added
    in the score_mod; a bias that may hold -inf gives both (its -inf entries masked, its finite part added).
    ``work`` is the dtype of score_mod's scores (float32).

    ``ratio``: the call's scale over the kernel's (1 / sqrt(d)), applied first in the score_mod as a tensor:
    torch.compile specialises FlexAttention's float scale, and a scale compiled in would make a custom scale
    compile a kernel of its own (which auto, not knowing the scale, could not foresee).
    """
    device = mask.shape.device
    keeps: list[Callable] = []
    biases: list[Callable] = []
    for term in mask.terms:
        mod = term.lifted().rule()
        if not term.is_bias:
            keeps.append(mod)
        elif term.may_hold_minus_inf:
            keeps.append(_finite(mod))
            biases.append(_zero_minus_inf(mod))
        else:
            biases.append(mod)
    cap = None if mask.softcap is None else device_scalar(mask.softcap, device, work)

    rescale = device_scalar(ratio, device, work)
    mask_mod = None
    if keeps:
        keep_mods = tuple(keeps)

        def mask_mod(b, h, q, k):
            keep = keep_mods[0](b, h, q, k)
            for mod in keep_mods[1:]:
                keep = keep & mod(b, h, q, k)
            return keep

    bias_mods = tuple(biases)

    def score_mod(score, b, h, q, k):
        score = score * rescale  # (q . k) / sqrt(d) -> (q . k) * scale
        if cap is not None:  # soft-cap the scaled score, then add the biases (masks.softcap's order)
            score = torch.tanh(score / cap) * cap
        for mod in bias_mods:
            score = score + mod(b, h, q, k).to(score.dtype)
        return score

    return _Lowered(_structure(mask), mask_mod, score_mod)


def _block_mask(mask: BoundMask, mask_mod: Callable | None) -> BlockMask:
    """A BlockMask of BLOCK x BLOCK blocks from the mask's own block states: no i x j tensor is built, and the
    states come from whole-tensor operations on the call's device (``BoundMask.block_states``): no host loop over
    blocks, no read of a device tensor.

    One (q_blocks, k_blocks) table for every batch row and head (a block is empty or full only where it is
    for all of them); the mask_mod decides pairs inside partial blocks.
    """
    key = _block_mask_key(mask, mask_mod)
    cached = None if key is None else _BLOCK_MASKS.get(key)
    if cached is not None:
        return cached
    i, j = mask.shape.q_len, mask.shape.k_len
    states = mask.block_states(BLOCK)  # (q_blocks, k_blocks) int8: 0 empty, 1 partial, 2 full
    # a bias's -inf entries are masked by the mask_mod, which full blocks skip: no block is full then
    full_allowed = mask_mod is not None and not any(t.may_hold_minus_inf for t in mask.bias_terms)
    if mask_mod is None:  # nothing to evaluate: every live block is full
        states = torch.where(states > STATE_EMPTY, STATE_FULL, STATE_EMPTY).to(torch.int8)
    elif not full_allowed:
        states = torch.where(states == STATE_FULL, STATE_PARTIAL, states).to(torch.int8)

    def table(kind: int) -> tuple[torch.Tensor, torch.Tensor]:
        hit = states == kind  # (q_blocks, k_blocks)
        counts = hit.sum(-1, dtype=torch.int32)  # (q_blocks,)
        # the live block indices first, in order: a stable sort of "not hit"
        order = torch.sort((~hit).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return counts[None, None], order[None, None].contiguous()  # (1, 1, q_blocks[, k_blocks])

    kv_num, kv_idx = table(1)
    full_num, full_idx = table(2)
    block_mask = BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=BLOCK,
        mask_mod=noop_mask if mask_mod is None else mask_mod,
        seq_lengths=(i, j),
    )
    if key is not None:
        if len(_BLOCK_MASKS) >= BLOCK_MASK_LIMIT:
            _BLOCK_MASKS.clear()
        _BLOCK_MASKS[key] = block_mask
    return block_mask


def _block_mask_key(mask: BoundMask, mask_mod: Callable | None) -> tuple | None:
    """What a BlockMask is kept under: the mask's structure (a band's sides and offset), whether a mask_mod
    decides partial blocks, the lengths and the device; None where a keep term holds data whose values may change
    from call to call (padding, a keep tensor, a bias's -inf), and while tracing (sizes are symbols)."""
    if torch.compiler.is_compiling() or any(t.may_hold_minus_inf for t in mask.bias_terms):
        return None
    if any(t.holds_data for t in mask.keep_terms):
        return None
    return mask.signature(), mask_mod is None, mask.shape.q_len, mask.shape.k_len, mask.shape.device


# --------------------------------------------------------------------------- compiled kernels


def _call_flex(q, k, v, block_mask, score_mod, scale, enable_gqa, return_lse):
    """FlexAttention; with ``return_lse`` (output, lse), lse in natural-log units (torch converts from base 2)."""
    request = AuxRequest(lse=True) if return_lse else None
    result = flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_aux=request
    )
    if not return_lse:
        return result
    out, aux = result
    return out, aux.lse


def _cache_key(call: AttentionCall, structure: tuple) -> tuple:
    """What changes the compiled code: never a length (one query or key is a case of its own: torch
    specialises size 1), nor the scale (a tensor in the score_mod). FlexAttention marks the head counts
    static, so they are in the key. The dtype is the one the kernel runs in (a half call runs in float32
    where that was measured faster: :func:`_run`)."""
    return (
        structure,
        call_compute_dtype("flex", call),  # the rates alone, as in _run
        call.device.type,
        call.device.index,
        call.heads,
        call.kv_heads,
        call.qk_dim,
        call.v_dim,
        call.need_lse,
        call.requires_grad,
        call.q_len == 1,
        call.k_len == 1,
    )


def _kernel(key: tuple) -> Callable:
    with _LOCK:
        kernel = _KERNELS.get(key)
        if kernel is None:
            # a code object of its own per key: torch.compile's cache (and its recompile limit) is per code object
            fresh = types.FunctionType(
                _call_flex.__code__.replace(), _call_flex.__globals__, f"flex_kernel_{len(_KERNELS)}"
            )
            kernel = torch.compile(fresh, dynamic=True, fullgraph=True)
            _KERNELS[key] = kernel
        return kernel


def flex_is_warm(call: AttentionCall) -> bool:
    """Whether a compiled FlexAttention kernel for ``call`` exists already (its next call compiles nothing).

    For cost-aware dispatch: a cold call costs about :func:`compile_seconds` more than a warm one.
    """
    return _cache_key(call, _structure(call.mask)) in _WARM


def compile_seconds() -> float:
    """Seconds the last kernel compiled here took (its first call), or :data:`TYPICAL_COMPILE_S` before any."""
    return list(_COMPILE_SECONDS.values())[-1] if _COMPILE_SECONDS else TYPICAL_COMPILE_S


# --------------------------------------------------------------------------- the backend


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: BoundMask,
    scale: float,
    need_lse: bool,
    compiled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Output (b, h, i, e) in q's dtype and, with ``need_lse``, the natural-log LSE (b, h, i) in float32.

    A half-precision call runs in float32 where this machine's rates say the compiled kernel is faster there
    (on this project's AVX2 CPU: bf16 forward 30 GFLOP/s, float32 45). ``compiled=False`` runs FlexAttention
    unfused (dense i x j scores): for tests of the lowering only.
    """
    given = q.dtype
    # the rates alone pick the dtype, never the casts (which would make it depend on the length): a second compiled
    # kernel for short calls would cost seconds to save fractions of a millisecond
    q, k, v = inputs_in_faster_dtype("flex", q, k, v)
    b, h, i, _ = q.shape
    g, j = k.shape[1], k.shape[2]
    kernel_scale = 1.0 / math.sqrt(q.shape[3])  # the scale compiled in; the call's enters the score_mod
    lowered = _lower(mask, torch.float32, ratio=scale / kernel_scale)
    block_mask = _block_mask(mask, lowered.mask_mod)
    args = (q, k, v, block_mask, lowered.score_mod, kernel_scale, h != g, need_lse)
    if not compiled or torch.compiler.is_compiling():
        result = _call_flex(*args)
    else:
        call = AttentionCall(
            batch=b,
            heads=h,
            kv_heads=g,
            q_len=i,
            k_len=j,
            qk_dim=q.shape[3],
            v_dim=v.shape[3],
            dtype=q.dtype,
            device=q.device,
            mask=mask,
            dropout=0.0,
            weights="none",
            need_lse=need_lse,
            requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        )
        key = _cache_key(call, lowered.structure)
        kernel = _kernel(key)
        # one grad mode per key (torch.compile guards on it): grad off unless something requires grad
        with contextlib.nullcontext() if call.requires_grad else torch.no_grad():
            if key in _WARM:
                result = kernel(*args)
            else:
                start = time.perf_counter()
                # no duck sizing while tracing: sizes that happen to be equal (a batch of 2, 2 key blocks) must
                # not become one symbol, nor a size of 1 a constant, or the kernel would recompile when they
                # differ (global settings: changed under the lock)
                with _LOCK, fx_config.patch(use_duck_shape=False, backed_size_oblivious=True):  # type: ignore[attr-defined]
                    try:
                        result = kernel(*args)
                    except Exception as error:  # torch's compiler failed (e.g. inductor's C++ for some structures)
                        _FAILED[key] = _first_line(error)
                        changed()  # auto now passes flex over for this kind of call
                        raise bad_argument(
                            "backend",
                            "a mask FlexAttention's compiler handles here",
                            f"{lowered.structure}: {_FAILED[key]}",
                            "use backend='auto' or 'tiled' (auto now passes flex over for this kind of call)",
                        ) from None
                    _COMPILE_SECONDS[key] = time.perf_counter() - start
                    _WARM.add(key)
                    changed()  # auto may now choose flex for this kind of call
    out, lse = result if need_lse else (result, None)
    if lse is not None:
        dead = (lse == -math.inf) | lse.isnan()  # rows with every key masked: output 0, lse -inf
        lse = lse.masked_fill(dead, -math.inf)
        out = out.masked_fill(dead[..., None], 0.0)
    elif mask.may_empty_rows():
        out = torch.nan_to_num(out, nan=0.0)  # belt and braces: the kernel gives 0 there (pinned by the tests)
    return out.to(given), lse


def flex_attention_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: BoundMask,
    scale: float,
    dropout: float,
    need_weights: bool,
    need_lse: bool,
) -> BackendOutput:
    """q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) -> output (b, h, i, e) [, lse (b, h, i), natural log].

    The output in q's dtype; under torch.autocast, in the autocast dtype (float64 excepted), as the other backends.
    The LSE in float32 (float64 for float64 inputs).
    """
    q, k, v = autocast_inputs(q, k, v)
    out, lse = _run(q, k, v, mask=mask, scale=scale, need_lse=need_lse)
    # the LSE in float32 at least (float64 for float64 inputs), as every backend returns it, never rounded to half
    return BackendOutput(out, None, None if lse is None else lse.to(torch.promote_types(q.dtype, torch.float32)))


def warm_up(
    *,
    heads: int,
    qk_dim: int,
    kv_heads: int | None = None,
    v_dim: int | None = None,
    mask: Mask | None = None,
    causal: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    return_lse: bool = False,
    batch: int = 1,
    length: int = 256,
    requires_grad: bool = False,
) -> float:
    """Compile the FlexAttention kernel for calls of this kind ahead of time; returns the seconds it took.

    One call on q (batch, heads, length, qk_dim), k (batch, kv_heads, length, qk_dim),
    v (batch, kv_heads, length, v_dim) with ``mask`` (a typed mask bound to that call: a padding mask
    needs ``batch`` lengths) and ``causal``. Afterwards calls with the same heads, head dims, dtype,
    device, mask kinds and LSE use the compiled kernel at any length (one query or key aside), and
    ``backend="auto"`` may choose flex for them. With ``requires_grad`` the kernel of calls whose inputs
    require grad is compiled, forward and backward (CUDA: FlexAttention has no CPU backward). 0.0 when the
    kernel was compiled already.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    v_dim = qk_dim if v_dim is None else v_dim
    device = torch.device(device)
    if heads % kv_heads:
        raise bad_argument(
            "kv_heads", f"a divisor of heads={heads}", kv_heads, "use kv_heads that divides the query heads (GQA)"
        )
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, length, qk_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(batch, kv_heads, length, qk_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(batch, kv_heads, length, v_dim, device=device, dtype=dtype, generator=gen)
    bound = bind_mask(mask, causal, AttentionShape(batch, heads, length, length, device))
    if not isinstance(requires_grad, bool):
        raise bad_argument(
            "requires_grad", "True or False", describe(requires_grad), "pass requires_grad=True", kind=TypeError
        )
    call = AttentionCall(
        batch,
        heads,
        kv_heads,
        length,
        length,
        qk_dim,
        v_dim,
        dtype,
        device,
        bound,
        0.0,
        "none",
        return_lse,
        requires_grad,
    )
    missing = CAPABILITIES.reasons(call)
    if missing:
        raise bad_argument(
            "warm_up", "a call the flex backend serves", "one it lacks " + "; ".join(missing), "warm up another call"
        )
    if flex_is_warm(call):
        return 0.0
    start = time.perf_counter()
    with torch.set_grad_enabled(requires_grad):
        leaves = [t.requires_grad_(requires_grad) for t in (q, k, v)]
        out, _ = _run(*leaves, mask=bound, scale=1.0 / math.sqrt(qk_dim), need_lse=return_lse)
        if requires_grad:
            out.sum().backward()  # compiles the backward kernel too
    return time.perf_counter() - start


# --------------------------------------------------------------------------- capabilities


# read once: the probe is a function torch.compile will not trace (a graph break in every traced call)
_CPU_SUPPORTED = bool(torch.cpu._is_avx2_supported()) and os.environ.get("ATEN_CPU_CAPABILITY") != "default"


def _cpu_supported() -> bool:
    """Whether this CPU runs FlexAttention's compiled CPU kernel (x86 with AVX2, as torch checks)."""
    return _CPU_SUPPORTED


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:200]


def _flex_limits(call: AttentionCall) -> list[str]:
    missing = []
    failed = _FAILED.get(_cache_key(call, _structure(call.mask)))
    if failed is not None:
        missing.append(f"a kernel for this kind of call (torch's compiler failed for it here: {failed})")
    if call.device.type == "cpu":
        if not _cpu_supported():
            missing.append("a CPU with AVX2 (FlexAttention's compiled CPU kernel needs it)")
        if call.requires_grad:
            missing.append("backward on CPU (FlexAttention has no CPU backward in torch 2.13)")
        if call.need_lse:
            missing.append("return_lse on CPU (torch 2.13's compiled CPU FlexAttention returns no log-sum-exp)")
        if call.sinks:
            missing.append(
                "learned sinks on CPU (they are folded in from the log-sum-exp, which torch 2.13's compiled CPU "
                "FlexAttention does not return)"
            )
    missing.extend(_unsupported_terms(call.mask, call.device))
    return missing


def _cold(call: AttentionCall) -> list[str]:
    if torch.compiler.is_compiling() or flex_is_warm(call):
        return []
    return [
        f"not compiled yet for this call (the first call compiles for about {compile_seconds():.0f} s); warm it up "
        "with multihead.backends.flex.warm_up(...) or name backend='flex'"
    ]


CAPABILITIES = Capabilities(
    dtypes=SERVED_DTYPES,
    device_types=frozenset({"cpu", "cuda"}),
    lse=True,
    weights=False,
    dropout=False,
    backward=True,  # on CUDA; the CPU refusal is in check, with its reason
    bias_grad=False,
    compiles_dynamic=False,  # its BlockMask is built by a Python loop over blocks, which would pin a length
    fused=True,  # once compiled (auto skips it until then)
    check=_flex_limits,
    auto_skip=_cold,
    softcap=True,
    sinks=True,  # its LSE is differentiable
    # the live blocks of its BlockMask, in the dtype it computes in
    estimate=lambda call: block_kernel_estimate(call, "flex", BLOCK, BLOCK, half="by rates", scores_modded=True),
)
