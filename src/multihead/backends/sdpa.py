"""torch.nn.functional.scaled_dot_product_attention, used only where it gives exactly our semantics.

What differs from ours, and how this backend bridges it:
- SDPA's ``is_causal`` is top-left aligned; ours is bottom-right. is_causal is
  passed only when the two coincide (equal lengths or an explicit top-left
  causal mask); on CUDA a bottom-right causal with i < j goes as torch's
  ``causal_lower_right``, which its fused kernels compute themselves; every
  other mask is handed over as a dense tensor.
- Fully masked rows give 0 (not NaN) in torch's CPU kernels, verified by the
  tests, as long as their scores are finite: their queries are zeroed first, so
  scores that would overflow (q, k ~ 1e20) cannot turn them into inf - inf = NaN.
  On other devices (not verified here) such a call's mask goes with the dtype's
  lowest finite value in place of -inf (:func:`finite_mask`): an empty row's
  weights are then uniform and finite, and its output is set to 0.
- Dropout is passed only when it applies (training); GQA uses enable_gqa where a
  fused kernel takes it (:func:`kv_heads_for_kernel`).
- Learned sinks (backends.sinks) go in as one more key: a zero key and a zero value scored by one more mask column
  holding each row's sink logit, so each row's softmax runs over its keys and the sink, which adds nothing to the
  output (:func:`sink_key_inputs`). Where the sinks need a gradient, every head dim gains a column that makes the
  kernel return each row's sink share too, from which their gradient follows; under dropout that share would be
  dropped with the weights, so such calls go elsewhere.
- Logit soft-capping (masks.softcap) is not served: SDPA takes no score transform
  (its Capabilities leave ``softcap`` False, so auto picks another backend).
- Half-precision calls on the CPU run in float32 where this machine's rates say torch's kernel is faster there,
  the casts included (backends.costs.inputs_in_faster_dtype): without bf16/fp16 matrix units its bf16 backward ran
  at 12 GFLOP/s against 102 in float32 here, and its forward at 100 against 110 (so a short forward stays in bf16:
  the casts cost more than the 10%). The output and gradients come back in the inputs' dtype, rounded once from
  float32.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from multihead.backends.costs import (
    Estimate,
    call_compute_dtype,
    dense_kernel_estimate,
    dense_mask_bytes,
    inputs_in_faster_dtype,
    live_fraction,
)
from multihead.backends.registry import AttentionCall, BackendOutput, Capabilities
from multihead.masks import BoundMask

# Devices whose kernels are verified (by the tests) to give 0 for a row with every key masked once its query is 0;
# on others such rows are made finite and zeroed after the kernel (finite_mask)
VERIFIED_EMPTY_ROW_DEVICES = frozenset({"cpu"})


# Devices whose fused kernels compute a bottom-right causal mask themselves, given torch's causal_lower_right (the
# flash and memory-efficient kernels on CUDA); elsewhere torch would build it as a dense mask, as we do
LOWER_RIGHT_DEVICES = frozenset({"cuda"})


def sdpa_computes_mask(mask: BoundMask) -> bool:
    """Whether torch's kernel computes ``mask`` itself, with no dense tensor: none, its own is_causal (top-left),
    or on LOWER_RIGHT_DEVICES a bottom-right causal with i <= j (the KV-cache case)."""
    if mask.is_empty or mask.is_plain_causal:
        return True
    return mask.shape.device.type in LOWER_RIGHT_DEVICES and mask.is_lower_right_causal


def _is_causal_bias(attn_mask: object) -> bool:
    """True for torch's CausalBias; its module not loaded yet, no such mask exists (sdpa_mask loads it first)."""
    bias = sys.modules.get("torch.nn.attention.bias")
    return bias is not None and isinstance(attn_mask, bias.CausalBias)


def sdpa_mask(mask: BoundMask, dtype: torch.dtype) -> tuple[torch.Tensor | None, bool]:
    """Our mask as SDPA's (attn_mask, is_causal): none, its own causal (top-left, or torch's causal_lower_right
    where its kernels compute it: :func:`sdpa_computes_mask`), bool keep-mask, or float with -inf where masked."""
    if mask.is_empty:
        return None, False
    if mask.is_plain_causal:
        return None, True
    if sdpa_computes_mask(mask):
        # imported here: torch.nn.attention.bias loads dynamo (about 0.5 s), which only this mask needs
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(mask.shape.q_len, mask.shape.k_len), False
    return mask.additive(dtype), False


def rates_label(mask: BoundMask, sinks: bool = False) -> str:
    """The kernel's entry in the measured rates: SDPA alone, or reading a dense mask row by row ("sdpa masked",
    measured with an (i, j) mask). A mask with one row for every query (padding: (b, 1, 1, j)) runs at SDPA's
    unmasked speed: 0.95-1.06x its time without a mask here, where an (i, j) mask took 1.05-1.20x (medians of
    interleaved rounds, n = 1024 and 4096, h = 16, float32, forward and forward+backward). With ``sinks`` the
    kernel is always handed the mask with its sink column (:func:`sink_mask_extent`)."""
    if sdpa_computes_mask(mask) and not sinks:
        return "sdpa"
    rows = sink_mask_extent(mask)[2] if sinks else mask.dense_extent()[2]
    return "sdpa" if rows == 1 else "sdpa masked"


def sink_mask_extent(mask: BoundMask, per_row: bool = False) -> tuple[int, int, int]:
    """(b or 1, h, i or 1) of the mask with a sink column (:func:`sink_attn_mask`) for a call of ``mask``: its
    own extent with the heads, and every batch and row when the sinks are one per row (``per_row``)."""
    shape = mask.shape
    batch, _, rows = mask.dense_extent()
    if per_row:
        batch, rows = shape.batch, shape.q_len
    return batch, shape.heads, rows


def sink_attn_mask(mask: BoundMask, sinks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The call's mask as an additive ``dtype`` tensor (0 where a key may be seen, -inf where masked, plus any bias)
    with one more column holding each row's sink logit (``sinks`` (h,) or (b, h, i)):
    (:func:`sink_mask_extent`, j + 1); in half precision each row is moved by its largest entry
    (``BoundMask.additive``)."""
    column = (sinks if sinks.ndim == 3 else sinks[None, :, None]).unsqueeze(-1)  # (b or 1, h, i or 1, 1)
    attn_mask = mask.additive(dtype, extra_key=column)
    assert attn_mask is not None  # with an extra key it is always a float tensor
    return attn_mask


def sink_key_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BoundMask, sinks: torch.Tensor, learned: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) and SDPA's attn_mask for a call with learned sinks: the sink
    is key j, a zero key and a zero value scored by the mask's last column (:func:`sink_attn_mask`), so the scores
    of the keys are unchanged and the sink's weight adds nothing to the output. The mask holds the sinks as
    constants; where they need a gradient (``learned``) q, k and v are widened to one width w (the next multiple of
    8 past max(d, e), for the fused kernels): q and k with zeros (the scores unchanged), v with a 1 on the sink key
    alone in column e, so output column e is each row's sink share (:func:`with_learned_sinks`)."""
    b, g = k.shape[0], k.shape[1]
    d, e = q.shape[-1], v.shape[-1]
    attn_mask = sink_attn_mask(mask, sinks.detach() if learned else sinks, q.dtype)
    width = (max(d, e) // 8 + 1) * 8 if learned else None
    if width is None:
        k = torch.cat([k, k.new_zeros(b, g, 1, d)], dim=2)
        v = torch.cat([v, v.new_zeros(b, g, 1, e)], dim=2)
        return q, k, v, attn_mask
    q = F.pad(q, (0, width - d))
    k = F.pad(k, (0, width - d, 0, 1))  # one more zero key, the sink
    sink_value = v.new_zeros(b, g, 1, width)
    sink_value[..., e] = 1.0
    v = torch.cat([F.pad(v, (0, width - e)), sink_value], dim=2)
    return q, k, v, attn_mask


def with_learned_sinks(output: torch.Tensor, sinks: torch.Tensor, e: int) -> torch.Tensor:
    """The kernel's output of :func:`sink_key_inputs` (b, h, i, w), computed with the sinks held constant at s0,
    as (b, h, i, e) differentiable in ``sinks`` s ((h,) or (b, h, i)). Moving a sink by delta = s - s0 moves its
    share p to p e^delta / (1 - p + p e^delta) and scales every key's weight, so the output, by
    1 / (1 + p expm1(delta)): exactly 1 at s = s0 (the forward is the kernel's), with the derivative -p at every
    order of differentiation (d out / ds = -p out)."""
    share = output[..., e]  # (b, h, i): each row's weight on the sink
    offset = sinks - sinks.detach()  # 0, with gradient 1 (NaN for an infinite sink, whose gradient is 0)
    offset = (offset if sinks.ndim == 3 else offset[None, :, None]).nan_to_num(0.0).to(share.dtype)
    return output[..., :e] / (1.0 + share * torch.expm1(offset)).unsqueeze(-1)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: BoundMask,
    scale: float,
    dropout: float,
    need_weights: bool,
    need_lse: bool,
    sinks: torch.Tensor | None = None,
) -> BackendOutput:
    """q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) -> output (b, h, i, e), in q's dtype; with learned ``sinks``
    ((h,) or (b, h, i)) over the keys and the sink."""
    given, e = q.dtype, v.shape[-1]
    label = rates_label(mask, sinks is not None)
    q, k, v = inputs_in_faster_dtype(label, q, k, v, lambda: computed_fraction(mask, sinks is not None))
    learned = sinks is not None and sinks.requires_grad and torch.is_grad_enabled()
    if sinks is None:
        attn_mask, is_causal = sdpa_mask(mask, q.dtype)
    else:
        q, k, v, attn_mask = sink_key_inputs(q, k, v, mask, sinks, learned)
        is_causal = False
    empty_rows = None  # (.., i, 1): rows with every key masked, where the mask may leave some
    if attn_mask is not None and mask.may_empty_rows():
        # SDPA adds the mask to q k^T: a fully masked row whose scores overflow to +inf gets inf - inf = NaN.
        # Zero queries score 0 everywhere, so such rows give 0 (output and gradient) like every other backend.
        # Only where a row may be empty: the copy of q would cost every other call a few percent.
        masked_out = attn_mask.logical_not() if attn_mask.dtype == torch.bool else attn_mask == -math.inf
        empty_rows = masked_out.all(dim=-1, keepdim=True)  # computed on the device: nothing read
        q = q.masked_fill(empty_rows, 0.0)  # rows (.., i, 1) broadcast over d
        if q.device.type not in VERIFIED_EMPTY_ROW_DEVICES:
            attn_mask = finite_mask(attn_mask, q.dtype)
    k, v, enable_gqa = kv_heads_for_kernel(q, k, v, attn_mask)
    output = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    if empty_rows is not None and q.device.type not in VERIFIED_EMPTY_ROW_DEVICES:
        output = output.masked_fill(empty_rows, 0.0)  # their uniform weights' output: 0, as every backend gives
    if learned:
        assert sinks is not None
        output = with_learned_sinks(output, sinks, e)
    return BackendOutput(output if output.dtype == given else output.to(given))  # .to costs a call even as a no-op


def finite_mask(attn_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``attn_mask`` (a bool keep-mask or an additive one with -inf) as an additive mask in ``dtype`` whose masked
    entries are the dtype's lowest finite value: beside any real score it weighs nothing, as -inf would (its exp
    underflows to 0), and a row with every key masked gets uniform, finite weights instead of NaN (inf - inf)."""
    lowest = torch.finfo(dtype).min
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(~attn_mask, lowest)
    return attn_mask.to(dtype).clamp(min=lowest)


# Devices whose fused kernels take torch's enable_gqa only without a mask and in half precision (flash, cuDNN): with
# a mask, or in float32, enable_gqa sends the call to the math kernel, which builds the i x j scores (reported with
# CUDA in ComfyUI #15135 and #15190, sapiens2 #3, and transformers #39412's review). The memory-efficient kernel
# takes the call with k and v repeated to h heads: (h / g - 1) copies of k and v, O(j) memory, not O(i j).
GQA_NEEDS_REPEAT_DEVICES = frozenset({"cuda"})


def kv_heads_for_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k, v, enable_gqa) for torch's SDPA: k (b, g, j, d), v (b, g, j, e) as given with enable_gqa where g < h and
    a fused kernel takes it, else repeated to (b, h, j, d), (b, h, j, e) (query head n reads kv head n // (h / g))."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads == kv_heads:
        return k, v, False
    half = q.dtype in (torch.float16, torch.bfloat16)
    # torch's causal_lower_right calls its kernels without enable_gqa: it takes h heads of k and v on every device
    repeat = _is_causal_bias(attn_mask)
    if repeat or (q.device.type in GQA_NEEDS_REPEAT_DEVICES and (attn_mask is not None or not half)):
        group = heads // kv_heads
        return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
    return k, v, True


SDPA_CAUSAL_BLOCK = 128  # about the query/key blocks torch's CPU flash kernel skips under is_causal


def computed_fraction(mask: BoundMask, sinks: bool = False) -> float:
    """The share of pairs torch's kernel computes: its own causal (either corner) skips the blocks past the diagonal;
    given a dense mask (every call with sinks) it computes every pair."""
    if not mask.is_empty and sdpa_computes_mask(mask) and not sinks:
        return live_fraction(mask, mask.shape.q_len, mask.shape.k_len, SDPA_CAUSAL_BLOCK, SDPA_CAUSAL_BLOCK)
    return 1.0


def _estimate(call: AttentionCall) -> Estimate | None:
    """Its own causal skips the blocks above the diagonal; any other mask is one dense tensor and every pair. With
    sinks the mask gains the heads and a column (:func:`sink_mask_extent`, taking one sink per head), always float;
    the copies of k and v with the sink key, and the one wider head dim where the sinks learn, are left out."""
    mask = call.mask
    label, fraction = rates_label(mask, call.sinks), computed_fraction(mask, call.sinks)
    work = call_compute_dtype(label, call, lambda: fraction)
    if call.sinks:
        batch, heads, rows = sink_mask_extent(mask)
        entries = batch * heads * rows * (call.k_len + 1)
        mask_bytes = entries * work.itemsize
    else:
        entries = None
        mask_bytes = 0 if sdpa_computes_mask(mask) else dense_mask_bytes(call, work)
    return dense_kernel_estimate(
        call, label, fraction=fraction, mask_bytes=mask_bytes, mask_entries=entries, compute_dtype=work
    )


def _check(call: AttentionCall) -> list[str]:
    if call.sinks_need_grad and call.dropout > 0:
        return ["learned sinks that need a gradient under dropout (the sink share it reads back is dropped too)"]
    return []


CAPABILITIES = Capabilities(
    fused=True,
    lse=False,
    weights=False,
    dropout=True,
    backward=True,
    bias_grad=False,
    takes_sinks=True,
    check=_check,
    estimate=_estimate,
)
