"""``attention_varlen``: attention over packed documents in FlashAttention's varlen layout.

    out = multihead.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)

q (total_q, h, d), k (total_k, g, d) and v (total_k, g, e) hold every document's tokens one after another; document
n owns queries ``cu_seqlens_q[n] .. cu_seqlens_q[n+1] - 1`` and keys ``cu_seqlens_k[n] .. cu_seqlens_k[n+1] - 1``
(cumulative lengths from 0, as ``flash_attn_varlen_func`` takes them). A query attends only to keys of its own
document; ``causal`` and ``window`` apply within each document, aligned bottom-right there (its last query with its
last key), as FlashAttention aligns them since v2.1.

The call runs as one packed row on :func:`multihead.attention` with a documents mask: the tiled and flex kernels
skip every block between two documents, and every backend serves it (the output, gradients, the LSE and the weights
as :func:`~multihead.attention` gives them). :func:`attention_varlen` returns the output;
:func:`attention_varlen_result` the output with the weights and LSE asked for, as :func:`multihead.attention_result`.
"""

from __future__ import annotations

import torch

from multihead._errors import bad_argument, describe
from multihead.functional import AttentionResult, WeightSelection, attention_result
from multihead.masks import (
    Mask,
    aligned_alibi,
    band_intersection,
    checked_slope_tensor,
    host_readable,
    ragged_documents,
    ragged_rows,
    slope_table,
    softcap,
    to_device,
)

__all__ = ["attention_varlen", "attention_varlen_result"]


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap_to: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    dropout: float = 0.0,
    training: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention within each packed document (see the module docstring).

    Args:
        q: (total_q, h, d) queries of every document, one after another.
        k, v: (total_k, g, d) and (total_k, g, e); h % g == 0 (GQA).
        cu_seqlens_q, cu_seqlens_k: (documents + 1,) int cumulative lengths from 0, ending at total_q and total_k.
        max_seqlen_q, max_seqlen_k: the longest document on each side (FlashAttention's arguments; checked
            against the boundaries where the host can read them).
        causal: each query sees the keys of its document up to its aligned position.
        window: (left, right) keys around the aligned position, None on a side for unbounded (FlashAttention's
            ``window_size`` with -1 written None); with ``causal`` the tighter of both.
        scale: multiplies q k^T; default 1/sqrt(d).
        softcap_to: cap the scaled scores to cap * tanh(s / cap) (FlashAttention's ``softcap``; None: none).
        alibi_slopes: ALiBi slopes, (h,) one per query head or (documents, h) one per document and head
            (FlashAttention's (nheads,) or (batch_size, nheads)): query t and key c of a document score
            -slope * |t + seqlen_k - seqlen_q - c|, the distance to the query's aligned key position (bottom-right
            within the document, as causal; FlashAttention's bias).
        sinks: (h,) learned sink logits, one per query head, as :func:`multihead.attention` takes them (gpt-oss;
            FlashAttention's ``s_aux``).
        dropout, training, backend: as for :func:`multihead.attention`.

    Returns:
        The output (total_q, h, e); :func:`attention_varlen_result` gives the weights and LSE too.

    Raises:
        ValueError or TypeError naming the argument: shapes, boundaries, lengths, window, slopes.

    Example:
        >>> q = k = v = torch.randn(7, 4, 16)              # two documents: 3 and 4 tokens
        >>> cu = torch.tensor([0, 3, 7])
        >>> attention_varlen(q, k, v, cu, cu, 4, 4, causal=True).shape
        torch.Size([7, 4, 16])
    """
    options = dict(causal=causal, window=window, scale=scale, softcap_to=softcap_to, alibi_slopes=alibi_slopes)
    options["sinks"] = sinks
    limits = (max_seqlen_q, max_seqlen_k)
    result = _packed_call(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        *limits,
        **options,
        dropout=dropout,
        training=training,
        backend=backend,
        return_weights=False,
        return_lse=False,
    )
    return result.output


def attention_varlen_result(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap_to: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    dropout: float = 0.0,
    training: bool = False,
    backend: str = "auto",
    return_weights: bool | WeightSelection = False,
    return_lse: bool = False,
) -> AttentionResult:
    """:func:`attention_varlen` with the weights (h, total_q, total_k) and the LSE (h, total_q), FlashAttention's
    ``softmax_lse`` layout, asked for as in :func:`multihead.attention_result`: an :class:`~multihead.AttentionResult`
    whose output is (total_q, h, e)."""
    options = dict(causal=causal, window=window, scale=scale, softcap_to=softcap_to, alibi_slopes=alibi_slopes)
    options["sinks"] = sinks
    limits = (max_seqlen_q, max_seqlen_k)
    return _packed_call(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        *limits,
        **options,
        dropout=dropout,
        training=training,
        backend=backend,
        return_weights=return_weights,
        return_lse=return_lse,
    )


def _packed_call(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal,
    window,
    scale,
    softcap_to,
    alibi_slopes,
    sinks,
    dropout,
    training,
    backend,
    return_weights,
    return_lse,
) -> AttentionResult:
    """Both varlen calls: the documents checked, one packed row through :func:`multihead.attention_result`, the
    result in the varlen layout."""
    for name, tensor, layout in (("q", q, "(total_q, h, d)"), ("k", k, "(total_k, g, d)"), ("v", v, "(total_k, g, e)")):
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != 3:
            raise bad_argument(
                name,
                f"a 3-D tensor {layout}, the documents packed one after another",
                describe(tensor),
                "pack the documents into one sequence of tokens (FlashAttention's varlen layout)",
                kind=TypeError if not isinstance(tensor, torch.Tensor) else ValueError,
            )
        if 0 in tensor.shape:  # as attention refuses an empty call: nothing to attend with, or to
            raise bad_argument(
                name,
                "every size at least 1 (one packed token or more)",
                f"shape {tuple(tensor.shape)}",
                "drop the call",
            )
    cu_q = _boundaries("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
    cu_k = _boundaries("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
    if cu_q.numel() != cu_k.numel():
        raise bad_argument(
            "cu_seqlens_k",
            f"{cu_q.numel()} boundaries, as many as cu_seqlens_q (one document each side)",
            cu_k.numel(),
            "give both sides the same documents",
        )
    band = _band(causal, window)
    mask: Mask = ragged_documents(cu_q, cu_k, band)
    if softcap_to is not None:
        mask = mask & softcap(softcap_to)
    if alibi_slopes is not None:
        mask = mask & _document_alibi(alibi_slopes, cu_q, cu_k, q)
    packed = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # (1, heads, total, dim): views
    result = attention_result(
        *packed,
        mask=mask,
        scale=scale,
        sinks=sinks,
        dropout=dropout,
        training=training,
        backend=backend,
        return_weights=return_weights,
        return_lse=return_lse,
    )
    return AttentionResult(
        result.output[0].transpose(0, 1),
        None if result.weights is None else result.weights[0],
        None if result.lse is None else result.lse[0],
    )


def _document_alibi(slopes: object, cu_q: torch.Tensor, cu_k: torch.Tensor, q: torch.Tensor) -> Mask:
    """ALiBi within each document, as FlashAttention's varlen adds it: -slope * |t + seqlen_k - seqlen_q - c| for
    query t and key c of a document, i.e. the distance to the query's aligned key position, the one the documents
    term aligns causal and windows by (``masks.ragged_rows``); ``slopes`` (h,), or (documents, h): each query row
    reads its document's row. Built by ops on q's device: no boundary is read on the host."""
    documents, heads = cu_q.numel() - 1, q.shape[1]
    fix = "use multihead.masks.alibi_slopes(h), or stack one row of it per document"
    slopes = checked_slope_tensor("alibi_slopes", slopes, documents, heads, "documents", fix=fix)
    table = slope_table("alibi_slopes", slopes, documents, heads, "document", "documents")  # (n or 1, h, 1)
    document, positions = ragged_rows(to_device(cu_q, q.device), to_device(cu_k, q.device), q.shape[0])
    if table.shape[0] > 1:  # (documents, h, 1) -> (1, h, total_q): each query row its document's slopes
        table = to_device(table, q.device)[document, :, 0].transpose(0, 1)[None]
    return aligned_alibi(table, positions[None], name="alibi_slopes")


def _boundaries(name: str, values: object, total: int, longest: object, longest_name: str) -> torch.Tensor:
    """``values`` as int64 boundaries of ``total`` tokens, checked where the host can read them (a device tensor
    is never read: its values are used as given)."""
    if not isinstance(values, torch.Tensor) or values.is_floating_point() or values.dtype == torch.bool:
        raise bad_argument(
            name,
            "a 1-D integer tensor of cumulative lengths",
            describe(values),
            "pass e.g. torch.tensor([0, 3, 7])",
            kind=TypeError,
        )
    if values.ndim != 1 or values.numel() < 2:
        raise bad_argument(
            name, "a 1-D tensor of at least 2 boundaries (0 and the total)", describe(values), "pass [0, total]"
        )
    if not isinstance(longest, int) or isinstance(longest, bool) or longest < 0:
        raise bad_argument(
            longest_name,
            "an int >= 0",
            describe(longest),
            "pass the longest document's length",
            kind=TypeError if not isinstance(longest, int) else ValueError,
        )
    values = values.long()
    if host_readable(values):
        if int(values[0]) != 0 or bool((values[1:] < values[:-1]).any()) or int(values[-1]) != total:
            raise bad_argument(
                name,
                f"non-decreasing boundaries from 0 to the {total} packed tokens",
                values.tolist()
                if values.numel() <= 12
                else f"{values.numel()} boundaries from {int(values[0])} to {int(values[-1])}",
                "pass the cumulative document lengths of the packed tensor",
            )
        lengths = values[1:] - values[:-1]
        if int(lengths.max()) > longest:
            raise bad_argument(
                longest_name,
                f"at least the longest document, {int(lengths.max())}",
                longest,
                f"pass {longest_name}={int(lengths.max())}",
            )
    return values


def _band(causal: bool, window: object) -> tuple[int | None, int | None]:
    """(left, right) around each query's aligned key position: causal's (None, 0), the window's, or both's tighter
    bounds."""
    if not isinstance(causal, bool):
        raise bad_argument("causal", "True or False", describe(causal), "pass causal=True", kind=TypeError)
    band: tuple[int | None, int | None] = (None, 0) if causal else (None, None)
    if window is None:
        return band
    if not (
        isinstance(window, tuple)
        and len(window) == 2
        and all(side is None or (isinstance(side, int) and not isinstance(side, bool) and side >= 0) for side in window)
    ):
        raise bad_argument(
            "window",
            "(left, right): ints >= 0, or None for an unbounded side",
            describe(window),
            "pass e.g. window=(255, 0) for a causal window of 256 keys",
        )
    return band_intersection(band, window)
