"""Query rows with every key masked, given transformers' eager result instead of the kernel's 0.

transformers' eager attention adds the dtype's lowest value to each masked score (``eager_mask``) and takes the
softmax. Where every key of a query row is masked (a left-padding position: causal over padding only; a window
over padding only), that value swallows each score (any score is far below its spacing), so the row's scores
are all equal and its weights uniform over the call's j keys: the keys past the causal diagonal and outside the
window too, with or without a soft-cap (Gemma 2 caps before the mask) or a position bias (T5's is added with it).
Its output is the mean of the values. Its gradient is softmax's at those uniform weights, because autograd
differentiates ``s + min`` as 1 whatever the rounding: ``g / j`` into each value v_j, and
``(g . (v_j - v̄)) / j`` into each score s_j, which reaches q and k (and a soft-cap's slope and a learned bias).

multihead's kernel gives such a row output 0, weights 0 and gradient 0 (its contract for every path of its own
API). A model run with ``attn_implementation="multihead"`` gets eager's numbers instead: :func:`eager_rows` builds
the ``finish`` step (:class:`multihead.attend.Attend`) that replaces those rows of the kernel's result, before the
head surgery and the forward hooks, so ``capture`` records eager's weights too. What eager gives elsewhere:

- with learned sinks (gpt-oss's ``s_aux``): the sink takes the whole row, output 0 and weights 0 over the keys:
  the kernel's own result, kept;
- with a float mask from the model (eager's additive mask: its lowest value is a finite bias to the kernel,
  which then computes the uniform row itself), kept; a row all ``-inf`` is NaN in eager and 0 here;
- in float64, models whose eager softmax runs in float32 (Llama, Qwen, Mistral, Gemma) cast the lowest float64
  to -inf and give NaN: we give the uniform row. In float16 the lowest value (-65504) swallows only scores under
  16 in size (its spacing is 32): a larger one moves its entry a step up, and that key takes eager's row; we give
  the uniform row;
- under dropout (training), eager drops the uniform weights at random; these rows here are its expectation, the
  mean of the values, undropped.

Everything is computed on the device, with no read on the host and no branch on a value: the rows come from the
mask (:func:`rows_without_keys`), and the result is blended in with ``torch.where``.
"""

from __future__ import annotations

import functools
import math

import torch

from multihead.attend import Finish
from multihead.functional import AttentionResult, WeightSelection
from multihead.integrations.transformers_masks import TransformersMask
from multihead.masks import AttentionShape, BoundMask, BoundTerm, Mask, bind_mask, to_device

__all__ = ["eager_rows", "rows_without_keys", "ROW_CHECK_ELEMENTS"]

ROW_CHECK_ELEMENTS = 2**24  # the most (b, h, rows, keys) entries rows_without_keys evaluates at once


def rows_without_keys(bound: BoundMask) -> torch.Tensor | None:
    """The query rows whose every key the keep terms of ``bound`` mask: (b or 1, h or 1, i) bool on its device;
    None where no row can be one (:meth:`BoundMask.may_empty_rows`, answered on the host without waiting for the
    device). Never read on the host.

    A band (causal, window) with terms that keep the same keys for every row (padding) is counted by arithmetic:
    row p sees keys lo_p ... hi_p, each moving by one with p, so the real keys among them are a difference of
    cumulative counts, O(b (i + j)). Any other mask is evaluated a block of rows at a time, at most
    :data:`ROW_CHECK_ELEMENTS` entries at once.
    """
    if not bound.may_empty_rows():
        return None
    banded = [term for term in bound.keep_terms if term.spans()[2]]  # varying with the query row
    if all(term.kind == "diagonal" for term in banded) and len(banded) <= 1:
        return _counted(bound, banded[0] if banded else None)
    return _by_blocks(bound)


def _counted(bound: BoundMask, band: BoundTerm | None) -> torch.Tensor:
    """:func:`rows_without_keys` for at most one band and terms the same for every row: (b or 1, h or 1, i)."""
    shape = bound.shape
    i, j, device = shape.q_len, shape.k_len, shape.device
    positions = torch.arange(i, device=device)
    bounds = None if band is None else band.key_bounds(0)  # row 0's keys, before clipping (a band always has them)
    lo, hi = (-math.inf, math.inf) if bounds is None else bounds
    # an unbounded side stands as a bound past every key; row p's bounds are row 0's moved by p
    first = (positions + (-j if lo == -math.inf else int(lo))).clamp(0, j)  # (i,): its first key
    last = (positions + (i + j if hi == math.inf else int(hi))).clamp(-1, j - 1)  # (i,): its last key
    flat = None  # (b or 1, h or 1, 1, j): the keys every other term keeps, the same for every row
    for term in bound.keep_terms:
        if term is not band:
            part = term.evaluate(slice(0, 1), slice(None), None)
            flat = part if flat is None else flat & part
    if flat is None:  # the band alone: a row is empty where its bounds cross
        return (last < first)[None, None, :]
    flat = flat[..., 0, :].expand(*flat.shape[:2], j)  # (b|1, h|1, j)
    counts = torch.nn.functional.pad(flat.long().cumsum(-1), (1, 0))  # (b|1, h|1, j + 1): kept before
    return counts[..., last + 1] - counts[..., first] <= 0  # (b|1, h|1, i): no kept key between first and last


def _by_blocks(bound: BoundMask) -> torch.Tensor:
    """:func:`rows_without_keys` by evaluating the mask, a block of rows at a time: (b or 1, h or 1, i)."""
    shape = bound.shape
    batch, heads, _ = bound.dense_extent()
    rows = torch.zeros((batch, heads, shape.q_len), dtype=torch.bool, device=shape.device)
    step = max(1, ROW_CHECK_ELEMENTS // (batch * heads * shape.k_len))
    for start in range(0, shape.q_len, step):
        stop = min(shape.q_len, start + step)
        keep, _ = bound.block(slice(start, stop), slice(None))
        if keep is not None:
            rows[:, :, start:stop] = ~keep.any(-1)  # (b|1, h|1, rows|1) broadcast
    return rows


def eager_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    keys: Mask | torch.Tensor | None,
    causal: bool,
    mask: Mask | torch.Tensor | None,
    scale: float | None,
    sinks: torch.Tensor | None,
) -> Finish | None:
    """The ``finish`` step that gives a call's rows with every key masked eager's result (see the module
    docstring), or None where the kernel's result is eager's already or no row can be one.

    q (b, h, i, d), k (b, g, j, d), v (b, g, j, e); ``keys``: the mask that rules keys out (a typed mask, a bool
    tensor, True = may attend, or a float tensor, eager's additive mask) and ``causal`` the kernel's flag;
    ``mask``: the call's whole mask, ``keys`` with the terms that change the scores (soft-cap, bias);
    ``scale``: the call's (None: 1/sqrt(d)); ``sinks``: the call's learned sinks.
    """
    if sinks is not None:  # eager's sink takes every such row whole: output 0, as the kernel gives
        return None
    if isinstance(keys, torch.Tensor) and keys.is_floating_point():  # eager's additive mask: see the docstring
        return None
    if keys is None and not (causal and q.shape[2] > k.shape[2]):  # only more queries than keys empties a row
        return None
    shape = AttentionShape(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    rows = _cached_rows(keys, causal, shape)
    if rows is None:
        return None
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return functools.partial(_finish, q=q, k=k, v=v, rows=rows, mask=mask, causal=causal, scale=scale)


def _rows(keys: Mask | torch.Tensor | None, causal: bool, shape: AttentionShape) -> torch.Tensor | None:
    bound = bind_mask(keys, causal, shape)
    if any(term.may_hold_minus_inf for term in bound.bias_terms):
        return None  # a float tensor inside a typed mask: a row it empties is eager's NaN, not the uniform
    return rows_without_keys(bound)


def _cached_rows(keys: Mask | torch.Tensor | None, causal: bool, shape: AttentionShape) -> torch.Tensor | None:
    """:func:`rows_without_keys` of ``keys`` (and causal), kept on a mask transformers' mask interface built
    (:attr:`TransformersMask.empty_rows`): every layer of a forward gets the same one, so it is counted once."""
    if not isinstance(keys, TransformersMask) or torch.compiler.is_compiling():  # traced: nothing kept
        return _rows(keys, causal, shape)
    # an inference tensor cannot be saved for a backward: one kept under inference_mode serves only there
    key = (causal, shape, torch.is_inference_mode_enabled())
    if key not in keys.empty_rows:
        keys.empty_rows[key] = _rows(keys, causal, shape)
    return keys.empty_rows[key]


def _finish(
    result: AttentionResult,
    return_weights: bool | WeightSelection,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    mask: Mask | torch.Tensor | None,
    causal: bool,
    scale: float,
) -> AttentionResult:
    """The kernel's ``result`` with ``rows`` (b or 1, h or 1, i) given eager's output (the mean of the values, with
    eager's gradient) and, where weights were asked for, eager's uniform weights 1 / j."""
    h, group, j = q.shape[1], q.shape[1] // k.shape[1], k.shape[2]
    work = torch.promote_types(q.dtype, torch.float32)
    mean = v.mean(dim=-2, keepdim=True, dtype=work)  # (b, g, 1, e)
    filled = mean.repeat_interleave(group, dim=1) if group > 1 else mean  # (b, h, 1, e): query head n reads n // group
    if torch.is_grad_enabled():
        shape = AttentionShape(q.shape[0], h, q.shape[2], j, q.device)
        terms = None if mask is None else bind_mask(mask, causal, shape)  # the score terms: soft-cap, bias
        if q.requires_grad or k.requires_grad or (terms is not None and terms.bias_requires_grad):
            filled = filled + _score_gradient(q, k, v, mean, terms, scale, work)
    output = torch.where(rows[..., None], filled.to(result.output.dtype), result.output)
    weights = result.weights
    if weights is not None:
        picked = _selected(rows, h, return_weights)  # (b|1, h'|1, i') for the weights' heads and rows
        uniform = torch.full((), 1.0 / j, dtype=weights.dtype, device=weights.device)
        weights = torch.where(picked[..., None], uniform, weights)
    return result._replace(output=output, weights=weights)


def _score_gradient(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mean: torch.Tensor,
    terms: BoundMask | None,
    scale: float,
    work: torch.dtype,
) -> torch.Tensor:
    """0 in value, (b, h, i, e) in ``work``, whose gradient is eager's through the scores of a uniform row.

    With y_ij = t_ij - t_ij.detach() (t the row's scores before the mask, y 0 in value and 1 in slope), the sum
    (1 / j) sum_j y_ij (v_j - v̄) has gradient (g_i . (v_j - v̄)) / j into each t_ij: softmax's backward at uniform
    weights. For plain scores t = scale q . k it is scale (q_i C - (q_i C).detach()) with C = (1 / j) sum_j k_j
    (v_j - v̄)^T (d x e per key/value head): O((i + j) d e), no i x j tensor. A soft-cap or a bias on the scores
    (Gemma 2, T5) is not bilinear: t is built whole, (b, h, i, j), as eager builds it.
    """
    group, j = q.shape[1] // k.shape[1], k.shape[2]
    centred = (v.to(work) - mean).detach()  # (b, g, j, e): the value's gradient is the mean's alone
    if terms is None or (terms.softcap is None and not terms.bias_terms):
        spread = k.to(work).transpose(-1, -2) @ centred / j  # (b, g, d, e)
        spread = spread.repeat_interleave(group, dim=1) if group > 1 else spread  # (b, h, d, e)
        moved = scale * (q.to(work) @ spread)  # (b, h, i, e)
        return moved - moved.detach()
    keys = k.repeat_interleave(group, dim=1) if group > 1 else k  # (b, h, j, d)
    scores = scale * (q.to(work) @ keys.to(work).transpose(-1, -2))  # (b, h, i, j)
    if terms.softcap is not None:
        scores = terms.softcap * torch.tanh(scores / terms.softcap)
    for term in terms.bias_terms:  # finite here: a bias that may hold -inf leaves no row to fill (_cached_rows)
        scores = scores + term.evaluate_in(slice(None), slice(None), None, work)
    values = centred.repeat_interleave(group, dim=1) if group > 1 else centred  # (b, h, j, e)
    return (scores - scores.detach()) @ values / j


def _selected(rows: torch.Tensor, heads: int, return_weights: bool | WeightSelection) -> torch.Tensor:
    """``rows`` (b|1, h|1, i) for the weights asked: all of them, or a selection's heads and query rows (indices
    sent to the device without waiting for it)."""
    if not isinstance(return_weights, WeightSelection):
        return rows
    if return_weights.heads is not None:
        rows = rows.expand(rows.shape[0], heads, rows.shape[2])
        chosen = to_device(torch.as_tensor(list(return_weights.heads), dtype=torch.long), rows.device)
        rows = rows.index_select(1, chosen)
    queries = return_weights.queries
    if isinstance(queries, slice):
        return rows[:, :, queries]
    if queries is not None:
        return rows.index_select(2, to_device(torch.as_tensor(list(queries), dtype=torch.long), rows.device))
    return rows
