"""``attention(q, k, v, ...)``: the one entry to every kernel.

    out = softmax(q k^T * scale + mask) v

Shapes (axis letters as everywhere in multihead):

    q    (b, h, i, d)    b batch, h query heads, i query positions, d query/key head dim
    k    (b, g, j, d)    g key/value heads (h % g == 0: grouped / multi-query attention), j key positions
    v    (b, g, j, e)    e value head dim (may differ from d)
    out  (b, h, i, e)

Unbatched inputs (h, i, d), (g, j, d), (g, j, e) give (h, i, e). Query head n
reads key/value head n // (h / g), as torch's ``enable_gqa`` and
``repeat_interleave`` do.
"""

from __future__ import annotations

import math
import numbers
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from multihead._errors import bad_argument, checked_flag, checked_probability, describe
from multihead._indices import checked_indices
from multihead._inputs import floating_argument, matching, tensor_argument
from multihead._limits import check_fits, device_memory
from multihead.backends import policy, registry
from multihead.backends.paged import BoundPages, PageTable
from multihead.backends.precision import autocast_device, autocast_inputs
from multihead.backends.sinks import check_sinks, kept_share, sink_lse
from multihead.backends.weights import selected_weights
from multihead.masks import AttentionShape, BoundMask, Mask, bind_mask, to_device

__all__ = ["attention", "attention_result", "explain", "AttentionResult", "WeightSelection"]


class AttentionResult(NamedTuple):
    """What :func:`attention` returns when more than the output is asked for."""

    output: torch.Tensor  # (b, h, i, e)
    weights: torch.Tensor | None  # (b, h, i, j), or (b, len(heads), len(queries), j) for a selection
    # (b, h, i), float32 for half inputs; -inf on rows with every key masked; with sinks, over the keys and the sink
    lse: torch.Tensor | None


@dataclass(frozen=True)
class WeightSelection:
    """Ask for the weights of some heads and query rows only, at a cost proportional to them.

    ``heads``: query head indices (None = all); ``queries``: query positions, a slice
    or indices (None = all). The weights come back as (b, len(heads), len(queries), j).
    """

    heads: Sequence[int] | None = None
    queries: Sequence[int] | slice | None = None


@dataclass
class _Prepared:
    q: torch.Tensor  # (b, h, i, d)
    k: torch.Tensor  # (b, g, j, d)
    v: torch.Tensor  # (b, g, j, e)
    mask: BoundMask
    scale: float
    dropout: float  # as applied: 0.0 outside training
    selection: WeightSelection | None
    unbatched: bool
    call: registry.AttentionCall
    pages: BoundPages | None = None  # a paged call: k and v are page pools
    sinks: torch.Tensor | None = None  # (h,) learned sink logits (backends.sinks)

    def dense(self) -> _Prepared:
        """This call over dense keys: a paged call's own equivalent, each sequence's keys (S, g, width, d) and
        values (S, g, width, e) gathered from the pools (its mask already is the table's); any other call itself."""
        if self.pages is None:
            return self
        table = self.pages.table
        return replace(self, k=table.gather(self.k), v=table.gather(self.v), pages=None)


def _check_tensors(q_arg: object, k_arg: object, v_arg: object) -> None:
    q, k, v = tensor_argument("q", q_arg), tensor_argument("k", k_arg), tensor_argument("v", v_arg)
    if q.ndim not in (3, 4):
        raise bad_argument(
            "q",
            "shape (b, h, i, d), or unbatched (h, i, d)",
            f"shape {tuple(q.shape)}",
            "add or remove axes so q has 4 dims (or 3 unbatched)",
        )
    layouts = {"k": "(b, g, j, d)", "v": "(b, g, j, e)"}
    for name, t in (("k", k), ("v", v)):
        if t.ndim != q.ndim:
            raise bad_argument(
                name,
                f"{q.ndim} dims like q, {layouts[name]}",
                f"shape {tuple(t.shape)}",
                "give q, k and v the same number of dims",
            )
    floating_argument("q", q)
    for name, t in (("k", k), ("v", v)):
        matching(name, t, q, "q", fix=f"convert with {name}.to(q): q, k and v in one dtype on one device")


def _check_sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    (b, h, _, d), (bk, g, j, dk), (bv, gv, jv, _) = q.shape, k.shape, v.shape  # e is free
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() == 0:
            raise bad_argument(
                name,
                "every size at least 1",
                f"shape {tuple(t.shape)}",
                "drop empty batches or sequences before calling attention",
            )
    if bk != b:
        raise bad_argument("k", f"batch size b = {b} (from q)", bk, "give q, k and v the same batch size")
    if bv != b:
        raise bad_argument("v", f"batch size b = {b} (from q)", bv, "give q, k and v the same batch size")
    if gv != g:
        raise bad_argument("v", f"g = {g} key/value heads (from k)", gv, "give k and v the same number of heads")
    if h % g != 0:
        divisors = [n for n in range(1, h + 1) if h % n == 0]
        raise bad_argument(
            "k",
            f"a number of key/value heads g that divides the query heads h = {h}",
            f"g = {g}",
            f"use g in {divisors}",
        )
    if dk != d:
        raise bad_argument("k", f"head dim d = {d} (from q)", dk, "project queries and keys to one head dim")
    if jv != j:
        raise bad_argument("v", f"key length j = {j} (from k)", jv, "give k and v the same sequence length")


def _check_options(
    scale: object,
    dropout: object,
    training: object,
    causal: object,
    backend: object,
    return_weights: object,
    return_lse: object,
) -> None:
    if scale is not None:
        if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
            raise bad_argument(
                "scale", "a real number or None (1/sqrt(d))", describe(scale), "pass a float", kind=TypeError
            )
        if not math.isfinite(scale):
            raise bad_argument("scale", "a finite number", scale, "pass e.g. 1/sqrt(d), or None")
    checked_probability("dropout", dropout)
    for name, value in (("training", training), ("causal", causal), ("return_lse", return_lse)):
        checked_flag(name, value)
    if not isinstance(backend, str):
        raise bad_argument(
            "backend", "a backend name (str)", describe(backend), "pass e.g. backend='auto'", kind=TypeError
        )
    if not isinstance(return_weights, (bool, WeightSelection)):
        raise bad_argument(
            "return_weights",
            "True, False or a multihead.WeightSelection",
            describe(return_weights),
            "pass return_weights=True, or WeightSelection(heads=[...], queries=[...])",
            kind=TypeError,
        )


def _check_selection(selection: WeightSelection, heads: int, q_len: int) -> WeightSelection:
    """``selection`` checked against the call's h query heads and i queries, its index lists as indices into
    them (a negative one counts from the end, as everywhere: :func:`multihead._indices.checked_indices`)."""
    chosen: dict[str, list[int]] = {}
    for name, values, limit, what in (
        ("heads", selection.heads, heads, "head"),
        ("queries", selection.queries, q_len, "query"),
    ):
        if values is None:
            continue
        if isinstance(values, slice) and name == "queries":
            parts = (values.start, values.stop, values.step)
            if not all(part is None or (isinstance(part, int) and not isinstance(part, bool)) for part in parts):
                raise bad_argument(
                    "WeightSelection.queries",
                    "a slice of ints (or None)",
                    values,
                    "use whole numbers, e.g. slice(0, 8)",
                    kind=TypeError,
                )
            if values.step is not None and values.step < 1:
                raise bad_argument(
                    "WeightSelection.queries",
                    "a slice with a positive step",
                    values,
                    "use a step of 1 or more, e.g. slice(0, 8, 2)",
                )
            if not range(*values.indices(limit)):
                raise bad_argument(
                    "WeightSelection.queries",
                    f"a slice selecting some of the {limit} queries",
                    values,
                    f"pick rows within [0, {limit})",
                )
            continue
        if isinstance(values, int):  # one index is a list of one elsewhere; here the field wants a sequence
            raise bad_argument(
                f"WeightSelection.{name}",
                "a sequence of ints (or None for all)",
                describe(values),
                f"pass e.g. {name}=[0, 3]",
                kind=TypeError,
            )
        chosen[name] = checked_indices(f"WeightSelection.{name}", values, limit, what)
    if all(chosen.get(name) == getattr(selection, name) for name in chosen):
        return selection  # already plain indices: the caller's own object goes on
    return replace(selection, **chosen)


def _check_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, j: int, return_weights: object) -> None:
    """Refuse, before any kernel allocates, inputs and results that cannot exist in the device's memory.

    Inputs count at their full logical size: an expanded view (k.expand(...) over 2**40 keys) costs
    nothing to build, but kernels copy or traverse every key. One comparison on the hot path; the
    per-tensor messages are built only when something is too big.
    """
    if torch.compiler.is_compiling():  # symbolic sizes: the check is for eager calls
        return
    limit = device_memory(q.device)
    if limit is None:
        return
    (b, h, i, _), e, itemsize = q.shape, v.shape[3], q.element_size()
    weights = b * h * i * j * itemsize if return_weights is True else 0
    if (
        max(q.numel() * itemsize, k.numel() * itemsize, v.numel() * itemsize, b * h * i * e * itemsize, weights)
        <= limit
    ):
        return
    fix = "split the batch or the sequence into chunks that fit"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_fits(name, tuple(t.shape), t.dtype, t.device, fix)
    check_fits("q", (b, h, i, e), q.dtype, q.device, fix, what="the output")
    check_fits(
        "return_weights",
        (b, h, i, j),
        q.dtype,
        q.device,
        "ask for some heads and rows with WeightSelection(heads=[...], queries=[...])",
        what="the weights",
    )


class _Checked(NamedTuple):
    """A call's inputs after every check of :func:`_check_call`: batched ((h, i, d) -> (1, h, i, d)), its key
    length j (a paged call's: its table's width) and its page table bound to the causal flag."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    unbatched: bool
    j: int
    pages: BoundPages | None
    sinks: torch.Tensor | None


# torch's context_parallel patches this name while it is active (its _distribute_function records the patch here)
_TORCH_CP_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"


def _refuse_torch_context_parallel() -> None:
    """Refuse a call inside torch's ``context_parallel``: it shards the sequence and replaces only
    ``torch.nn.functional.scaled_dot_product_attention`` with its ring, so any other kernel of ours would attend
    over this rank's shard alone, a silently wrong answer (and on the CPU, torch 2.13's ring has no rule for SDPA's
    CPU kernel at all). multihead's own sequence split takes the same mesh."""
    if torch.compiler.is_compiling():
        return
    cp = sys.modules.get(_TORCH_CP_MODULE)
    replaced = getattr(cp, "_replaced_functions", None) if cp is not None else None
    if replaced and torch.nn.functional.scaled_dot_product_attention in replaced:
        raise bad_argument(
            "attention",
            "a call outside torch's context_parallel (it replaces only torch's scaled_dot_product_attention, so "
            "multihead's kernels would attend over this rank's shard of the sequence alone)",
            "a call inside it",
            "split the sequence with multihead.parallel instead: SequenceParallelAttention(layer, mesh['cp']), "
            "ring_attention or ulysses_attention take the same DeviceMesh (docs/parallel.md)",
        )


def _check_call(
    q, k, v, *, mask, causal, scale, dropout, training, backend, return_weights, return_lse, pages, sinks
) -> _Checked:
    """Every check of a call's arguments, run on every call (a kept plan skips binding and dispatch, never these):
    raises the argument's error, else the checked inputs."""
    _refuse_torch_context_parallel()
    _check_tensors(q, k, v)
    _check_options(scale, dropout, training, causal, backend, return_weights, return_lse)
    unbatched = q.ndim == 3 and pages is None
    if unbatched:  # (h, i, d) -> (1, h, i, d)
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if mask is not None and not isinstance(mask, (Mask, torch.Tensor)):
        raise bad_argument(
            "mask",
            "a multihead.masks mask, a bool tensor or a float tensor",
            describe(mask),
            "build one with multihead.masks.causal(), padding(...), or pass a tensor",
            kind=TypeError,
        )
    bound_pages = None
    if pages is None:
        _check_sizes(q, k, v)
        j = k.shape[2]
    else:
        bound_pages = _check_pages(pages, q, k, v, mask, causal)
        j = pages.width
    if sinks is not None:
        if unbatched and isinstance(sinks, torch.Tensor) and sinks.ndim == 2:  # per-row (h, i) -> (1, h, i)
            sinks = sinks.unsqueeze(0)
        check_sinks(sinks, q)
    _check_fits(q, k, v, j, return_weights)
    return _Checked(q, k, v, unbatched, j, bound_pages, sinks)


def _prepare(
    q, k, v, *, mask, causal, scale, dropout, training, backend, return_weights, return_lse, pages=None, sinks=None
) -> _Prepared:
    """The call checked (:func:`_check_call`), its mask bound and described for the registry."""
    options = dict(scale=scale, dropout=dropout, training=training, backend=backend, pages=pages, sinks=sinks)
    checked = _check_call(
        q, k, v, mask=mask, causal=causal, **options, return_weights=return_weights, return_lse=return_lse
    )
    return _bind(checked, mask, causal, scale, dropout, training, return_weights, return_lse)


def _bind(checked: _Checked, mask, causal, scale, dropout, training, return_weights, return_lse) -> _Prepared:
    q, k, v, unbatched, j, bound_pages, sinks = checked
    b, h, i, d = q.shape
    g, e = k.shape[1], v.shape[3]
    shape = AttentionShape(b, h, i, j, q.device)
    # a paged call's mask is its table's (causal included): the dense equivalent every backend but the paged reads
    if bound_pages is None:
        bound = bind_mask(mask, causal, shape)
    else:
        table = bound_pages.table  # bound once for all the layers that attend through it

        def bound_table() -> BoundMask:
            rule = table.dense_rule(causal)  # unmasked, or causal alone, where the table's values say so
            return bind_mask(None if rule is not None else table.keeps(causal), rule == "causal", shape)

        bound = table.derived(("bound", causal, shape), bound_table)
    selection = None
    if isinstance(return_weights, WeightSelection):
        selection = _check_selection(return_weights, h, i)
    weights = "none" if return_weights is False else ("subset" if selection is not None else "all")
    applied_dropout = float(dropout) if training else 0.0
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    call = registry.AttentionCall(
        batch=b,
        heads=h,
        kv_heads=g,
        q_len=i,
        k_len=j,
        qk_dim=d,
        v_dim=e,
        dtype=q.dtype,
        device=q.device,
        mask=bound,
        dropout=applied_dropout,
        weights=weights,
        need_lse=return_lse,
        requires_grad=requires_grad or (sinks_need_grad(sinks) or bound.bias_requires_grad) and torch.is_grad_enabled(),
        paged=bound_pages is not None,
        sinks=sinks is not None,
        sinks_need_grad=sinks_need_grad(sinks) and torch.is_grad_enabled(),
        kind=policy.current_policy().kind_of(q.device),
    )
    return _Prepared(
        q,
        k,
        v,
        bound,
        1.0 / math.sqrt(d) if scale is None else float(scale),
        applied_dropout,
        selection,
        unbatched,
        call,
        bound_pages,
        sinks,
    )


def sinks_need_grad(sinks: torch.Tensor | None) -> bool:
    return sinks is not None and sinks.requires_grad


def _check_pages(
    pages: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object, causal: bool
) -> BoundPages:
    """A paged call's table checked against q (S, h, i, d) and the pools, bound to the call's causal flag."""
    if not isinstance(pages, PageTable):
        raise bad_argument(
            "pages",
            "a multihead.backends.paged.PageTable, or None",
            describe(pages),
            "pass a paged cache's table (cache.batch(handles).stage(keys, values).pages)",
            kind=TypeError,
        )
    if mask is not None:
        raise bad_argument(
            "mask",
            "None in a paged call (the table says which keys each query sees: causal and its window)",
            describe(mask),
            "drop the mask, or attend over contiguous keys",
        )
    pages.check(q, k, v)
    return BoundPages(pages, causal)


def _index_tensor(selected: Sequence[int], device: torch.device) -> torch.Tensor:
    """The selected indices on ``device``, copied there without waiting for it (``masks.to_device``)."""
    return to_device(torch.as_tensor(list(selected), dtype=torch.long), device)


def _index(selected: Sequence[int] | slice | None, device: torch.device) -> torch.Tensor | slice:
    if selected is None:
        return slice(None)
    if isinstance(selected, slice):
        return selected
    return _index_tensor(selected, device)


def _select_weights(weights: torch.Tensor, selection: WeightSelection) -> torch.Tensor:
    heads = _index(selection.heads, weights.device)
    queries = _index(selection.queries, weights.device)
    weights = weights[:, heads] if isinstance(heads, slice) else weights.index_select(1, heads)
    return weights[:, :, queries] if isinstance(queries, slice) else weights.index_select(2, queries)


def bound_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None,
    causal: bool,
    scale,
    sinks: torch.Tensor | None = None,
) -> _Prepared:
    """A forward call checked and its mask bound as :func:`attention` does (the same errors), for a kernel that
    reads the weights itself (:func:`multihead.attention_stats`): q, k, v batched ((h, i, d) -> (1, h, i, d),
    ``unbatched`` says so), the :class:`~multihead.masks.BoundMask` and the scale."""
    return _prepare(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=scale,
        dropout=0.0,
        training=False,
        backend="auto",
        return_weights=False,
        return_lse=True,
        sinks=sinks,
    )


def _weights_for(p: _Prepared, selection: WeightSelection) -> torch.Tensor:
    """Exact weights for the selected heads and rows only of a call over dense keys (:meth:`_Prepared.dense`):
    (b, n_heads, n_queries, j) in q's dtype."""
    h = p.q.shape[1]
    heads = (
        torch.arange(h, device=p.q.device) if selection.heads is None else _index_tensor(selection.heads, p.q.device)
    )
    queries = _index(selection.queries, p.q.device)
    return selected_weights(p.q, p.k, p.mask, p.scale, heads, queries, sinks=p.sinks)


def autocast_on(device: torch.device) -> bool:
    """Whether torch.autocast is on for this device (devices without autocast, such as meta: never)."""
    return autocast_device(device) is not None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    training: bool = False,
    backend: str = "auto",
    pages: PageTable | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention: softmax(q k^T * scale + mask) v.

    With a logit soft-cap in the mask (``masks.softcap(cap)``) the scaled scores are capped first:
    softmax(cap * tanh(q k^T * scale / cap) + mask) v.

    Args:
        q: (b, h, i, d) queries, or unbatched (h, i, d).
        k: (b, g, j, d) keys; h % g == 0 (g < h: grouped-query, g == 1: multi-query attention).
        v: (b, g, j, e) values.
        mask: a typed mask from :mod:`multihead.masks` (combine with ``&``; ``masks.softcap`` caps the
            scores before any bias), or a tensor broadcastable to (b, h, i, j): bool with True = may
            attend, or float added to the scores.
        causal: add ``masks.causal()``, aligned bottom-right when i != j (i = 2, j = 4)::

                x x x .
                x x x x

        scale: multiplies q k^T; default 1/sqrt(d).
        dropout: probability of dropping a weight; applied only when ``training`` is True.
        backend: "auto" (fastest that serves the call; see :func:`explain`) or a registered name.
        pages: a :class:`~multihead.backends.paged.PageTable` for a paged call: q (S, h, i, d) is one row per
            sequence, k and v are page pools (P, g, page, d) and (P, g, page, e), and the table says where each
            sequence's keys are and where its queries sit (causal and a window count positions; no mask).
        sinks: learned sink logits, (h,) one per query head (gpt-oss) or (b, h, i) one per query row: each
            row's softmax runs over its keys and a sink column of that logit and value 0, which is then dropped,
            so a row's weights sum to 1 - its sink share, and a row with every key masked gives 0.
            Differentiable (a Parameter learns).

    Under ``torch.autocast``, q, k and v are cast to the autocast dtype first (float64 excepted), as
    torch's scaled_dot_product_attention is, and the kernel runs with autocast off: its blocks keep
    their own precision (float32 for half types).

    Returns:
        The output (b, h, i, e). Rows whose keys are all masked give output 0 and gradient 0. For the
        weights or the log-sum-exp as well, call :func:`attention_result`.

    Example:
        >>> q = torch.randn(2, 8, 5, 16); k = v = torch.randn(2, 2, 7, 16)
        >>> attention(q, k, v, causal=True).shape
        torch.Size([2, 8, 5, 16])
    """
    options = dict(mask=mask, causal=causal, scale=scale, dropout=dropout, training=training, backend=backend)
    return _run(q, k, v, **options, pages=pages, sinks=sinks, return_weights=False, return_lse=False).output


def attention_result(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    training: bool = False,
    backend: str = "auto",
    pages: PageTable | None = None,
    sinks: torch.Tensor | None = None,
    return_weights: bool | WeightSelection = False,
    return_lse: bool = False,
) -> AttentionResult:
    """:func:`attention` with its weights and log-sum-exp: an :class:`AttentionResult` (output, weights, lse).

    Args (past :func:`attention`'s):
        return_weights: True for all weights (b, h, i, j), or a :class:`WeightSelection` for some heads
            and query rows; False for none (``weights`` is None). Asking never changes the output. Under
            dropout (training) the weights returned are those applied, after dropout, as
            torch.nn.MultiheadAttention returns them, and auto keeps the backend it would run without them
            where that backend returns the weights it applies (tiled, reference). A call auto gives SDPA,
            which returns none, runs on the cheapest backend that does: where that is the reference, on the
            CPU, both draw one Bernoulli mask over the (b, h, i, j) weights and the same weights are dropped
            at the same RNG state; tiled draws its blocks' own stream, and on CUDA SDPA's fused kernels draw
            theirs, so the output there is another sample of the same dropout. In a paged call, weight
            column c of row s is the key at position ``pages.first_slots[s] + c`` (0 past the sequence's own keys).
        return_lse: the log-sum-exp of the masked scaled (and soft-capped) scores, (b, h, i); else None. With
            ``sinks``, over the keys and the sink: logaddexp(lse, sinks[h]), so exp(score - lse) is each weight.

    Rows whose keys are all masked give output 0, weights 0, gradient 0 and LSE -inf (with sinks: the sink's
    logit, its whole weight on the sink).

    Example:
        >>> q = torch.randn(2, 8, 5, 16); k = v = torch.randn(2, 2, 7, 16)
        >>> result = attention_result(q, k, v, causal=True, return_weights=True, return_lse=True)
        >>> result.weights.shape, result.lse.shape
        (torch.Size([2, 8, 5, 7]), torch.Size([2, 8, 5]))
    """
    options = dict(mask=mask, causal=causal, scale=scale, dropout=dropout, training=training, backend=backend)
    return _run(q, k, v, **options, pages=pages, sinks=sinks, return_weights=return_weights, return_lse=return_lse)


def _run(q, k, v, *, mask, causal, scale, dropout, training, backend, pages, sinks, return_weights, return_lse):
    """The one path of :func:`attention` and :func:`attention_result`: check and bind the call (or take its kept
    plan), choose the backend, run it, and select the weights asked for."""
    if all(isinstance(t, torch.Tensor) for t in (q, k, v)) and autocast_on(q.device):
        q, k, v = autocast_inputs(q, k, v)  # as torch's SDPA casts its inputs under autocast
        with torch.autocast(q.device.type, enabled=False):  # the kernels pick their own block precision
            return _run(
                q,
                k,
                v,
                mask=mask,
                causal=causal,
                scale=scale,
                dropout=dropout,
                training=training,
                backend=backend,
                pages=pages,
                sinks=sinks,
                return_weights=return_weights,
                return_lse=return_lse,
            )
    p, chosen = _prepared_and_chosen(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=scale,
        dropout=dropout,
        training=training,
        backend=backend,
        pages=pages,
        sinks=sinks,
        return_weights=return_weights,
        return_lse=return_lse,
    )
    native_weights = _returns_weights(chosen, p.call)
    if not chosen.capabilities.paged:
        p = p.dense()  # gathered once, for the kernel and the weights alike
    result = _call_backend(chosen, p, p.q, p.k, p.v, dropout=p.dropout, need_weights=native_weights)
    output, weights, lse = result.output, None, result.lse
    if native_weights:
        # a backend with capabilities.weights returns them when need_weights is True (the registry contract)
        assert result.weights is not None, f"backend {chosen.name!r} was asked for weights and returned none"
        weights = result.weights if p.selection is None else _select_weights(result.weights, p.selection)
    if p.sinks is not None and not chosen.capabilities.takes_sinks:
        assert lse is not None  # asked for: every backend that serves sinks returns its LSE (the registry contract)
        output, weights, lse = _with_sinks(output, weights, lse, p.sinks, p.selection)
    if p.call.weights != "none" and not native_weights:
        weights = _weights_for(p.dense(), p.selection or WeightSelection())  # over the keys and any sink
    if p.unbatched:
        output = output.squeeze(0)
        weights = None if weights is None else weights.squeeze(0)
        lse = None if lse is None else lse.squeeze(0)
    return AttentionResult(output, weights, lse if return_lse else None)


def _returns_weights(backend: registry.Backend, call: registry.AttentionCall) -> bool:
    """Whether ``backend`` returns the call's weights itself: always where it materialises them, and under dropout
    where it returns those it applied (Capabilities.dropout_weights); else the call computes them."""
    if call.weights == "none":
        return False
    return backend.capabilities.weights or (call.dropout > 0 and backend.capabilities.dropout_weights)


def _call_backend(
    backend: registry.Backend,
    p: _Prepared,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dropout: float,
    need_weights: bool,
) -> registry.BackendOutput:
    """``backend`` run on q, k, v (p's, or copies of them) as the registry's contract says: a paged backend reads
    the pools through p's table; a backend that takes learned sinks is handed them, and one that serves them from
    its log-sum-exp is asked for it (the call folds them in: :func:`_with_sinks`)."""
    extra: dict[str, object] = {} if p.pages is None else {"pages": p.pages}
    folds_sinks = p.sinks is not None and not backend.capabilities.takes_sinks
    if p.sinks is not None and backend.capabilities.takes_sinks:
        extra["sinks"] = p.sinks
    return backend.fn(
        q,
        k,
        v,
        mask=p.mask,
        scale=p.scale,
        dropout=dropout,
        need_weights=need_weights,
        need_lse=p.call.need_lse or folds_sinks,
        **extra,
    )


def _with_sinks(
    output: torch.Tensor,
    weights: torch.Tensor | None,
    lse: torch.Tensor,
    sinks: torch.Tensor,
    selection: WeightSelection | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A sink-free result (output (b, h, i, e), weights (b, h, i, j) or those selected, lse (b, h, i)) made the
    sinks' (h,): output and weights scaled by each row's share kept on its keys, the LSE over keys and sink."""
    share = kept_share(lse, sinks)  # (b, h, i)
    # scaled in the share's precision and rounded once (float32 for half outputs)
    output = (output.to(share.dtype) * share.unsqueeze(-1)).to(output.dtype)
    if weights is not None:
        rows = share.unsqueeze(-1) if selection is None else _select_weights(share.unsqueeze(-1), selection)
        weights = (weights.to(share.dtype) * rows).to(weights.dtype)
    return output, weights, sink_lse(lse, sinks)


def _prepared_and_chosen(
    q, k, v, *, mask, causal, scale, dropout, training, backend, pages, sinks, return_weights, return_lse
) -> tuple[_Prepared, registry.Backend]:
    """The checked call and its backend. Every call runs every check (:func:`_check_call`); a call with no mask then
    takes the binding and the backend kept for its signature, when there is one (a decode step runs the same call
    each token), else they are made now and kept: by the module for dense keys, by the page table for a paged call
    (the layers of a decode step attend through one table)."""
    flags = dict(causal=causal, scale=scale, dropout=dropout, training=training, backend=backend)
    wants = dict(return_weights=return_weights, return_lse=return_lse)
    checked = _check_call(q, k, v, mask=mask, **flags, **wants, pages=pages, sinks=sinks)
    current = policy.current_policy()
    key = None
    if mask is None and not current.autotune:
        key = _plan_key(q, k, v, **flags, **wants, sinks=sinks)

    def bound_and_chosen() -> tuple[_Prepared, registry.Backend]:
        p = _bind(checked, mask, causal, scale, dropout, training, return_weights, return_lse)
        return p, registry.choose(p.call, backend)

    plan: _Plan | None = None
    if key is not None and checked.pages is not None:
        # a paged call's plan is kept by its table: the layers of a decode step attend through one table, and
        # each would bind its mask and dispatch again (a call's plan key alone cannot tell two tables apart)
        def planned() -> _Plan:
            p, chosen = bound_and_chosen()
            return _Plan(p.mask, p.scale, p.dropout, p.call, chosen, current)

        plan = checked.pages.table.derived(("plan", key, id(current)), planned)
    elif key is not None:
        plan = _PLANS.get(key)
    if plan is not None and plan.policy is current:
        return plan.prepared(checked), plan.chosen
    p, chosen = bound_and_chosen()
    if backend == "auto" and current.autotune:
        chosen = _autotuned(p, chosen)
    elif key is not None and checked.pages is None:
        _keep_plan(key, _Plan(p.mask, p.scale, p.dropout, p.call, chosen, current))
    return p, chosen


@dataclass(frozen=True)
class _Plan:
    """What :func:`attention` worked out for a call with no mask, kept per call signature (:func:`_plan_key`): the
    bound mask (causal or none: no data), the call's description, the backend, and the policy it was chosen under.
    A call with a plan is checked as every call is, then skips binding and dispatch."""

    mask: BoundMask
    scale: float
    dropout: float
    call: registry.AttentionCall
    chosen: registry.Backend
    policy: policy.DispatchPolicy

    def prepared(self, checked: _Checked) -> _Prepared:
        q, k, v = checked.q, checked.k, checked.v
        unbatched, sinks = checked.unbatched, checked.sinks
        pages = checked.pages  # a paged call's plan is its table's own (its mask is the table's)
        return _Prepared(q, k, v, self.mask, self.scale, self.dropout, None, unbatched, self.call, pages, sinks)


_PLANS: dict[tuple, _Plan] = {}
PLAN_LIMIT = 512  # signatures kept; past it the plans start again (a run over many lengths)


def _plan_key(
    q: object,
    k: object,
    v: object,
    *,
    causal: object,
    scale: object,
    dropout: object,
    training: object,
    backend: object,
    return_weights: object,
    return_lse: object,
    sinks: torch.Tensor | None,
) -> tuple | None:
    """The signature a call's plan is kept under: everything validation and dispatch read (shapes, dtypes, devices,
    options, whether gradients are needed, the registry's epoch), or None where no plan is kept: tensors of a
    subclass (fake, functorch's), options of any type but their plain one (a bool equals an int as a key), and
    tracing (sizes are symbols)."""
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
        return None
    plain = type(causal) is bool and type(training) is bool and type(return_lse) is bool
    if not plain or type(return_weights) is not bool or type(backend) is not str or type(dropout) is not float:
        return None
    if (scale is not None and type(scale) is not float) or torch.compiler.is_compiling():
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or sinks_need_grad(sinks))
    shapes = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device)
    options = (causal, scale, dropout, training, backend, return_weights, return_lse, sinks is not None)
    sinks_grad = torch.is_grad_enabled() and sinks_need_grad(sinks)
    return (*shapes, *options, grad, sinks_grad, registry.epoch())


def _keep_plan(key: tuple, plan: _Plan) -> None:
    if len(_PLANS) >= PLAN_LIMIT:
        _PLANS.clear()
    _PLANS[key] = plan


def _autotuned(p: _Prepared, estimated: registry.Backend) -> registry.Backend:
    """Under :func:`multihead.backends.policy.autotune`: the serving backend measured fastest for this call's
    signature on this device (timed once, on copies of the call's inputs), else ``estimated``. Calls with dropout
    (timing would draw random numbers), paged calls (only the paged backend reads the pools in place), traced calls,
    and calls only one backend serves keep ``estimated``."""
    if p.dropout > 0 or p.pages is not None or torch.compiler.is_compiling():
        return estimated
    serving = registry.serving_for_auto(p.call)
    if len(serving) < 2:
        return estimated
    key = (policy.device_identity(p.q.device), _signature(p.call))
    timers = {backend.name: _timer(p, backend) for backend in serving}
    return registry.get_backend(policy.tune(key, timers))


def _signature(call: registry.AttentionCall) -> tuple:
    """What a measured winner is kept for: everything of the call but the data (the mask by its structure)."""
    return (
        call.kind,
        call.dtype,
        (call.batch, call.heads, call.kv_heads, call.q_len, call.k_len, call.qk_dim, call.v_dim),
        call.weights,
        call.need_lse,
        call.requires_grad,
        call.mask.signature(),
    )


def _timer(p: _Prepared, backend: registry.Backend) -> Callable[[], float]:
    """A call that runs ``backend`` on detached copies of the call's inputs (forward, and backward when the call
    needs gradients, as attention would run it) and returns its seconds (device work included)."""
    native_weights = _returns_weights(backend, p.call)

    def seconds() -> float:
        leaves = [t.detach().requires_grad_(p.call.requires_grad) for t in (p.q, p.k, p.v)]
        _synchronize(p.q.device)
        start = time.perf_counter()
        with torch.set_grad_enabled(p.call.requires_grad):
            result = _call_backend(backend, p, *leaves, dropout=0.0, need_weights=native_weights)
            if p.call.weights != "none" and not native_weights:
                copies = replace(p, q=leaves[0], k=leaves[1], v=leaves[2])
                _weights_for(copies, p.selection or WeightSelection())
            if p.call.requires_grad:
                result.output.backward(torch.ones_like(result.output))
        _synchronize(p.q.device)
        return time.perf_counter() - start

    return seconds


def _synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (timing an asynchronous device needs it; only autotune times)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    training: bool = False,
    backend: str = "auto",
    pages: PageTable | None = None,
    sinks: torch.Tensor | None = None,
    return_weights: bool | WeightSelection = False,
    return_lse: bool = False,
) -> registry.Explanation:
    """Which backend :func:`attention` (or :func:`attention_result`, with ``return_weights`` and ``return_lse``)
    with these arguments would run, and why each other was not chosen."""
    if all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        q, k, v = autocast_inputs(q, k, v)
    p = _prepare(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=scale,
        dropout=dropout,
        training=training,
        backend=backend,
        return_weights=return_weights,
        return_lse=return_lse,
        pages=pages,
        sinks=sinks,
    )
    return registry.explain_call(p.call, backend)
