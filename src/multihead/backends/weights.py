"""The exact attention weights outside a kernel's own pass, in the precision the kernels compute in: those of some
heads and query rows (what :class:`multihead.WeightSelection` asks for), and every block of them from a call's
log-sum-exp (what :func:`multihead.attention_stats` reduces), each masked as the kernels mask their scores."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from multihead.backends._blocks import Blocks, mask_scores_, masked_scores, softmax_rows_
from multihead.backends.precision import compute_dtype
from multihead.backends.reference import masked_softmax
from multihead.backends.sinks import heads_of, kept_share
from multihead.masks import BlockState, BoundMask

__all__ = ["selected_weights", "weight_blocks"]


def selected_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: BoundMask,
    scale: float,
    heads: torch.Tensor,
    queries: torch.Tensor | slice,
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) of the query heads ``heads`` (n_heads,) and the rows ``queries`` only, q
    (b, h, i, d) and k (b, g, j, d): (b, n_heads, n_queries, j) in q's dtype, at a cost proportional to the
    selection. With learned ``sinks`` ((h,) or (b, h, i)) each row's softmax runs over its keys and its sink, and
    the weights are over the keys (a row sums to 1 - its sink's share). Differentiable where q, k, the mask's bias
    or the sinks need a gradient."""
    group = q.shape[1] // k.shape[1]
    work = compute_dtype(q.dtype)
    q_sel = q.index_select(1, heads)  # (b, n_heads, i, d)
    q_sel = q_sel[:, :, queries] if isinstance(queries, slice) else q_sel.index_select(2, queries)
    k_sel = k.index_select(1, heads // group)  # (b, n_heads, j, d): each selected head's own key head
    scores = (q_sel.to(work) * scale) @ k_sel.to(work).transpose(-2, -1)  # (b, n_heads, n_queries, j)
    needs_grad = scores.requires_grad or mask.bias_requires_grad or (sinks is not None and sinks.requires_grad)
    if not (torch.is_grad_enabled() and needs_grad):
        # nothing to differentiate: mask and softmax in place, no i x j temporaries beyond the result
        scores = mask_scores_(scores, mask, queries, slice(None), heads)
        lse = None if sinks is None else torch.logsumexp(scores, dim=-1)  # before the softmax overwrites them
        weights = softmax_rows_(scores, rows_may_be_empty=mask.may_empty_rows())
    else:
        weights, lse = masked_softmax(masked_scores(scores, mask, queries, slice(None), heads))
    if sinks is not None:
        assert lse is not None
        selected = heads_of(sinks, heads)
        if selected.ndim == 3:  # one sink per row: the selected rows'
            selected = selected[:, :, queries] if isinstance(queries, slice) else selected.index_select(2, queries)
        weights = weights * kept_share(lse, selected).unsqueeze(-1)  # each row's share on its keys
    return weights.to(q.dtype)


def weight_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    mask: BoundMask,
    scale: float,
    heads: torch.Tensor,
    *,
    block_q: int,
    block_k: int,
) -> Iterator[tuple[range, range, torch.Tensor, torch.Tensor, bool]]:
    """The exact weights p = exp(s - lse) of the query heads ``heads`` (H,), block by block, every block the mask
    leaves empty skipped: q (b, h, i, d), k (b, g, j, d), lse (b, h, i) from the call's kernel. Yields each block's
    query rows, keys, weights (b, H, rows, keys), log-weights (-inf where masked), in the blocks' precision
    (float32 for half inputs), and whether the log-weights may hold -inf (False for a block the mask keeps whole,
    with no bias of -inf entries); the memory beyond the inputs is one block of scores."""
    i, j = q.shape[2], k.shape[2]
    work = compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    qs = q.index_select(1, heads).to(work) * scale  # (b, H, i, d)
    ks = k.index_select(1, heads // group).to(work)  # (b, H, j, d): each chosen head's own key head
    lse = lse.index_select(1, heads).to(work)
    safe_lse = lse.masked_fill(lse == -math.inf, 0.0).unsqueeze(-1)  # (b, H, i, 1): a row all masked gives p = 0
    bias_masks = any(term.may_hold_minus_inf for term in mask.bias_terms)
    for qb in Blocks(i, block_q):
        for kb in Blocks(j, block_k):
            state = mask.state(qb, kb)
            if state is BlockState.EMPTY:
                continue
            scores = qs[:, :, qb.start : qb.stop] @ ks[:, :, kb.start : kb.stop].transpose(-1, -2)
            mask_scores_(scores, mask, slice(qb.start, qb.stop), slice(kb.start, kb.stop), heads)
            log_weights = scores.sub_(safe_lse[:, :, qb.start : qb.stop])  # log p: -inf where masked
            yield qb, kb, log_weights.exp(), log_weights, bias_masks or state is not BlockState.FULL
