"""Sequence parallelism: attention over a sequence split across the ranks of a torch.distributed group.

Each of the P ranks of ``group`` holds a shard of the sequence: queries (b, h, n/P, d), keys (b, g, n/P, d),
values (b, g, n/P, e). Two ways to attend over the whole sequence:

    ulysses_attention   all-to-all to head shards (each rank: all n positions of h/P heads), attend, all-to-all back
    ring_attention      keep the query shard; K/V shards travel round the ring, partial outputs merge by their LSE

Both keep O(n/P) memory per rank in training as in inference. Ring attention saves only the rank's own q, k, v,
output and LSE for the backward, which sends K/V round the ring again with their dK/dV accumulators and recomputes
each block. Per rank, with S the bytes of its K and V shards: forward P - 1 sends of S, backward 2P - 1 sends of S
(P - 1 K/V, P dK/dV); a key validity adds b n/P elements to each K/V send and document indices 8 b n/P bytes
each (details: :func:`ring_attention`).

Layouts (``layout=``) say which positions a rank's shard holds; every rank must use the same one and the same shapes:

    "contiguous"   rank r holds positions [r n/P, (r + 1) n/P)               (torch.chunk(x, P, dim)[r])
    "zigzag"       rank r holds chunks r and 2P - 1 - r of 2P equal chunks   (:func:`zigzag_shard`)

For P = 2, n = 8 (chunks of 2)::

    position   0 1 2 3 4 5 6 7
    contiguous 0 0 0 0 1 1 1 1
    zigzag     0 0 1 1 1 1 0 0

Under a causal mask the zigzag layout gives every rank the same work in ring attention (an early chunk and a late
one), as zhuzilin/ring-flash-attention and PyTorch's context parallel do; Ulysses attention works on whole
sequences, so either layout balances. A sequence whose length does not split is refused, never padded silently:
pad it to a multiple of P (contiguous) or 2P (zigzag), mark the padded keys with ``key_padding`` and drop the
padded queries' outputs.

Masks, forward and backward, on global positions (the query and key lengths are equal, so either alignment means
the same); what each tensor means under the split:

    causal=True, masks.causal(), masks.window(left, right), masks.softcap(cap)    as on one rank
    key_padding=valid          (b, n/P) bool, this rank's shard of the key validity (True = real), sharded like k
    masks.padding(lengths)     (b,) integer key lengths of the WHOLE sequence: global key p is real iff p < lengths[b]
    masks.padding(valid)       (b, n/P) bool shard, as key_padding; with key_padding, both apply
    masks.documents(ids)       (b, n/P) integers, this rank's shard of every position's document (q and k alike)
    masks.documents(cu_seqlens=...)  the whole packed row's boundaries (batch 1), the last one n
    masks.alibi(slopes)        (h,) or (b, h) for the call's h query heads: -slope |p_q - p_k| on global positions;
                               learned slopes get their gradient (each rank its share: sum it over ranks)

Terms combine with ``&`` as on one rank. Ring attention sends the key validity and the document indices with K/V
(the indices exactly, as int64 bytes); Ulysses all-gathers the shards into position order, and passes the global
terms (lengths, cu_seqlens, each rank's heads' slopes) to the kernel as they are. Terms whose tensors hold one
rank's (i, j) pairs or its own positions (bias, allowed, plain tensors, selected, custom, aligned ALiBi) are refused
with an error naming the term and what to do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.autograd.function import once_differentiable

from multihead import masks
from multihead._errors import bad_argument, describe
from multihead._inputs import tensor_argument
from multihead.backends.sinks import check_sinks, kept_share, per_row, sink_lse
from multihead.functional import AttentionResult, attention, attention_result
from multihead.layer import MultiHeadAttention
from multihead.masks import AlibiMask, DocumentsMask, PaddingMask, host_readable, slope_table, to_device
from multihead.parallel._group import resolve_group
from multihead.parallel.split import ulysses_kv_heads

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "LAYOUTS",
    "SequenceParallelAttention",
    "SequenceSplit",
    "ring_attention",
    "ulysses_attention",
    "zigzag_shard",
    "zigzag_unshard",
]

LAYOUTS = ("contiguous", "zigzag")


# --------------------------------------------------------------------------- layouts


def _zigzag_size(n: int, world: int, name: str) -> int:
    if n % (2 * world):
        raise bad_argument(
            name,
            f"a sequence length n divisible by 2 * P = {2 * world} (P = {world} ranks, zigzag layout)",
            f"n = {n}",
            f"pad the sequence to {math.ceil(n / (2 * world)) * 2 * world} and mark the padded keys with key_padding",
        )
    return n // (2 * world)


def _check_rank(rank: object, world: object) -> None:
    for name, value in (("world", world), ("rank", rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad_argument(name, "an int", describe(value), f"pass {name} as a whole number", kind=TypeError)
    assert isinstance(rank, int) and isinstance(world, int)
    if world < 1 or not 0 <= rank < world:
        raise bad_argument("rank", f"0 <= rank < world = {world}", rank, "pass dist.get_rank(group)")


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of the full sequence ``x``: chunks ``rank`` and ``2 world - 1 - rank``.

    ``x`` has the whole sequence of length n on ``dim`` (2 for (b, h, n, d); 1 for (b, n) padding); the result has
    n / world positions there. n must be divisible by 2 world (else a ValueError naming n and P).
    """
    _check_rank(rank, world)
    c = _zigzag_size(x.shape[dim], world, "zigzag_shard(x)")
    first = x.narrow(dim, rank * c, c)
    second = x.narrow(dim, (2 * world - 1 - rank) * c, c)
    return torch.cat((first, second), dim)


def zigzag_unshard(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's zigzag shard, ``shards[r]`` being rank r's (the inverse of zigzag_shard).

    Pair it with ``torch.distributed.all_gather`` to collect a sequence-sharded result on every rank.
    """
    world = len(shards)
    if world < 1:
        raise bad_argument("zigzag_unshard(shards)", "one shard per rank", "an empty list", "pass every rank's shard")
    m = shards[0].shape[dim]
    if m % 2:
        raise bad_argument(
            "zigzag_unshard(shards)",
            "shards of even length (two chunks each)",
            f"length {m} on dim {dim}",
            "pass shards made by zigzag_shard",
        )
    c = m // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * world)
    for r, shard in enumerate(shards):
        chunks[r] = shard.narrow(dim, 0, c)
        chunks[2 * world - 1 - r] = shard.narrow(dim, c, c)
    return torch.cat([chunk for chunk in chunks if chunk is not None], dim)


def _spans(layout: str, rank: int, world: int, m: int) -> list[tuple[int, int]]:
    """(start, length) of the global positions rank ``rank`` holds, in shard order; m = n / P."""
    if layout == "contiguous":
        return [(rank * m, m)]
    c = m // 2
    return [(rank * c, c), ((2 * world - 1 - rank) * c, c)]


def _shard_order(layout: str, world: int, m: int, device: torch.device) -> torch.Tensor | None:
    """Global position of each entry of the ranks' shards concatenated in rank order; None when that is 0..n-1."""
    if layout == "contiguous":
        return None
    positions = [torch.arange(s, s + length) for r in range(world) for s, length in _spans(layout, r, world, m)]
    return torch.cat(positions).to(device)


# --------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class _Diagonals:
    """The intersection of the causal / window terms: key position kp may serve query position qp when
    -left <= kp - qp <= right (None = unbounded), plus the soft-cap terms, which do not depend on position."""

    left: int | None
    right: int | None
    extra: tuple[masks.Mask, ...]


def _combine(terms: list[masks.Mask]) -> masks.Mask | None:
    return None if not terms else terms[0] if len(terms) == 1 else masks.Combined(tuple(terms))


@dataclass(frozen=True)
class _SplitTerms:
    """A call's typed mask sorted by how each term crosses the split, checked against this rank's sizes (b batch
    rows, h query heads, m = n/P positions): what :func:`_check_mask` returns."""

    diagonals: _Diagonals
    lengths: tuple[torch.Tensor, ...]  # padding(lengths): (b,) key lengths of the whole sequence
    valid: tuple[torch.Tensor, ...]  # padding(valid): (b, m) bool shards of the key validity, sharded like k
    ids: tuple[torch.Tensor, ...]  # documents(ids): (b, m) int64 shards of every position's document
    bounds: tuple[torch.Tensor, ...]  # documents(cu_seqlens=...): (d + 1,) boundaries of the whole packed row
    slopes: torch.Tensor | None  # the alibi terms' slopes summed, (b or 1, h, 1) (a view: learned ones keep grad)


_SERVED = "causal, window, softcap, padding, documents and alibi"


def _check_mask(mask: object, causal: bool, function: str, b: int, h: int, m: int, world: int) -> _SplitTerms:
    """Sort ``mask``'s terms (:class:`_SplitTerms`) and check their tensors against the shard's sizes; every term
    that cannot be split by the ranks' global positions is refused here, before any collective."""
    n = m * world
    left: int | None = None
    right: int | None = 0 if causal else None
    extra: list[masks.Mask] = []
    lengths: list[torch.Tensor] = []
    valid: list[torch.Tensor] = []
    ids: list[torch.Tensor] = []
    bounds: list[torch.Tensor] = []
    tables: list[torch.Tensor] = []
    if mask is not None and not isinstance(mask, masks.Mask):
        raise bad_argument(
            "mask",
            f"None or a typed mask from multihead.masks ({_SERVED}) for {function}",
            describe(mask),
            "pass masks.causal() / window / softcap / padding / documents / alibi terms on global positions: a "
            "tensor's (i, j) entries cannot be split across the ranks",
            kind=TypeError,
        )
    for term in mask.terms() if mask is not None else ():
        band = term.key_band()
        if band is not None:
            left, right = masks.band_intersection((left, right), band)
        elif term.cap is not None:
            extra.append(term)
        elif isinstance(term, PaddingMask) and term.keys.dtype == torch.bool:
            if tuple(term.keys.shape) != (b, m):
                raise bad_argument(
                    "padding(valid)",
                    f"a (b, n/P) = ({b}, {m}) bool shard of this rank's key validity, sharded like k (True = real)",
                    tuple(term.keys.shape),
                    "shard the (b, n) validity with the call's layout, as key_padding is; or give the whole "
                    "sequence's key lengths as padding(lengths)",
                )
            valid.append(term.keys)
        elif isinstance(term, PaddingMask):
            lengths.append(_checked_lengths(term.keys, b, n))
        elif isinstance(term, DocumentsMask) and term.ids is not None:
            if tuple(term.ids.shape) != (b, m):
                raise bad_argument(
                    "documents(ids)",
                    f"a (b, n/P) = ({b}, {m}) shard of every position's document index, sharded like q and k",
                    tuple(term.ids.shape),
                    "shard the (b, n) indices with the call's layout; or give one packed row's boundaries as "
                    "documents(cu_seqlens=...)",
                )
            ids.append(term.ids)
        elif isinstance(term, DocumentsMask) and term.bounds is not None:
            bounds.append(_checked_bounds(term.bounds, b, n))
        elif isinstance(term, AlibiMask):
            tables.append(slope_table("alibi(slopes)", term.slopes, b, h, "batch row", "b"))
        else:
            raise bad_argument(
                "mask",
                f"only {_SERVED} terms in {function} (the sequence is split across ranks)",
                repr(term),
                _refusal_fix(term),
            )
    slopes = None
    for table in tables:  # biases add: -s1 |d| - s2 |d| = -(s1 + s2) |d|
        slopes = table if slopes is None else slopes + table
    return _SplitTerms(
        _Diagonals(left, right, tuple(extra)), tuple(lengths), tuple(valid), tuple(ids), tuple(bounds), slopes
    )


def _refusal_fix(term: masks.Mask) -> str:
    """What to do instead of a term the split cannot serve: it holds (i, j) entries, or positions, of one rank."""
    if term.kind == "alibi":  # aligned_alibi: positions given per query row, not the split's global ones
        return "use masks.alibi(slopes): the split applies it on the global positions"
    if term.kind == "tensor":
        return (
            "a tensor's (i, j) entries cannot be split across the ranks: express it with causal, window, padding "
            "or documents terms, or run it on one rank with multihead.attention"
        )
    return f"express it with {_SERVED} terms, or run it on one rank with multihead.attention"


def _checked_lengths(lengths: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """padding(lengths) of the whole sequence: (b,) key lengths in [0, n], checked where the host can read them
    (a CUDA tensor is used as it is, never read: as on one rank, a length past n keeps every key)."""
    if tuple(lengths.shape) != (b,):
        raise bad_argument(
            "padding(lengths)",
            f"shape (b,) = ({b},): one key length of the whole sequence per batch row",
            tuple(lengths.shape),
            "give one key length per batch element",
        )
    if host_readable(lengths) and b and (int(lengths.min()) < 0 or int(lengths.max()) > n):
        raise bad_argument(
            "padding(lengths)",
            f"lengths in [0, {n}] (n, the whole sequence's length: lengths count global positions)",
            f"values from {int(lengths.min())} to {int(lengths.max())}",
            "clip the lengths to the sequence length; for this rank's keys alone pass padding(valid) or key_padding",
        )
    return lengths


def _checked_bounds(bounds: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """documents(cu_seqlens=...) of the whole packed row: batch 1, its last boundary n where the host can read it."""
    if b != 1:
        raise bad_argument(
            "documents(cu_seqlens)",
            "a call of batch 1 (one packed row)",
            f"batch {b}",
            "pack the batch into one row, or pass documents(ids) with a (b, n/P) shard of indices",
        )
    if host_readable(bounds) and int(bounds[-1]) != n:
        raise bad_argument(
            "documents(cu_seqlens)",
            f"a last boundary equal to the whole sequence's length n = {n} (boundaries are global positions)",
            int(bounds[-1]),
            "end cu_seqlens at the packed length of the whole row, not of this rank's shard",
        )
    return bounds


def _global_positions(layout: str, rank: int, world: int, m: int, device: torch.device) -> torch.Tensor:
    """(m,) int64: the global position of each entry of rank ``rank``'s shard, in shard order (built on device)."""
    spans = _spans(layout, rank, world, m)
    return torch.cat([torch.arange(start, start + length, device=device) for start, length in spans])


def _shard_validity(
    key_padding: torch.Tensor | None, terms: _SplitTerms, where: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """This rank's key validity (b, m) bool: key_padding and every padding(valid) shard, and, given ``where``
    (the shard's global positions), the padding(lengths) terms (p < lengths[b]); None when nothing masks keys."""
    found = [] if key_padding is None else [key_padding.to(device)]
    found += [to_device(part, device) for part in terms.valid]
    if where is not None:
        found += [where[None, :] < to_device(lengths, device)[:, None] for lengths in terms.lengths]
    valid = None
    for part in found:
        valid = part if valid is None else valid & part
    return valid


def _shard_documents(terms: _SplitTerms, where: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """(t, b, m) int64: each of the t documents terms' index of this rank's positions (t = 1 for one term): the
    documents(ids) shards, and, given ``where``, each cu_seqlens boundary list's document of those positions."""
    rows = [to_device(ids, device) for ids in terms.ids]
    if where is not None:
        rows += [torch.bucketize(where, to_device(bounds, device)[1:], right=True)[None, :] for bounds in terms.bounds]
    return torch.stack(rows) if rows else None


def _check_inputs(
    q: object, k: object, v: object, key_padding: object, layout: object, world: int, function: str
) -> tuple[int, int, int, int]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        t = tensor_argument(name, t)
        if t.ndim != 4:
            raise bad_argument(
                name,
                "a 4-d tensor (b, heads, n/P, dim): this rank's shard of the sequence",
                describe(t),
                "pass batched (b, heads, seq, dim) shards; add a batch axis with .unsqueeze(0)",
            )
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    b, h, m, _ = q.shape
    g = k.shape[1]
    if k.shape[2] != m or v.shape[2] != m or k.shape[0] != b or v.shape[:3] != k.shape[:3]:
        raise bad_argument(
            "k, v",
            f"shards (b, g, n/P, d) and (b, g, n/P, e) with b = {b} and n/P = {m} as q's "
            f"(sequence parallelism splits queries and keys alike)",
            f"k {tuple(k.shape)}, v {tuple(v.shape)}",
            "shard q, k and v of the same sequence the same way; for cross-attention run multihead.attention",
        )
    if h % g:
        raise bad_argument("k", f"a number of kv heads g dividing h = {h}", f"g = {g}", "use g in the divisors of h")
    check_layout(layout)
    if layout == "zigzag" and m % 2:
        raise bad_argument(
            "q",
            f"a zigzag shard of even length n/P (two chunks of n/(2P); n = {m * world}, P = {world})",
            f"n/P = {m}",
            f"pad the sequence to a multiple of 2P = {2 * world}, mark padded keys with key_padding, "
            "and shard with zigzag_shard",
        )
    if key_padding is not None:
        if not isinstance(key_padding, torch.Tensor) or key_padding.dtype != torch.bool:
            raise bad_argument(
                "key_padding",
                "None or a (b, n/P) bool tensor, True = real key",
                describe(key_padding),
                "pass a bool shard of the key validity, sharded like k",
                kind=TypeError,
            )
        if tuple(key_padding.shape) != (b, m):
            raise bad_argument(
                "key_padding",
                f"shape (b, n/P) = ({b}, {m}), sharded like k",
                tuple(key_padding.shape),
                "shard the (b, n) validity with the same layout as k",
            )
    return b, h, g, m


def _group_size(group: object, function: str) -> tuple[dist.ProcessGroup | None, int, int]:
    """(the process group, this rank, P) of a group, 1-D DeviceMesh or None (the default group)."""
    resolved = resolve_group(group, function)
    return resolved, dist.get_rank(resolved), dist.get_world_size(resolved)


# --------------------------------------------------------------------------- Ulysses


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Slice r of dim 0 to rank r; slices from every rank stacked on dim 0 (autograd: the same exchange back)."""
    group = group if group is not None else dist.group.WORLD
    assert group is not None  # _group_size checked that torch.distributed is initialized
    received = funcol.all_to_all_single_autograd(x, None, None, group)
    return funcol.wait_tensor(received)


def _seq_to_heads(x: torch.Tensor, world: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(b, H, m, d) sequence shard -> (b, H/P, P m, d) head shard, sequence in shard order (one all-to-all)."""
    b, heads, m, d = x.shape
    send = x.reshape(b, world, heads // world, m, d).transpose(0, 1).contiguous()  # (P, b, H/P, m, d) by destination
    received = _all_to_all(send, group)  # (P, b, H/P, m, d) by source
    return received.permute(1, 2, 0, 3, 4).reshape(b, heads // world, world * m, d)  # (b, H/P, n, d)


def _heads_to_seq(x: torch.Tensor, world: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(b, H/P, P m, e) head shard, sequence in shard order -> (b, H, m, e) sequence shard (one all-to-all)."""
    b, local_heads, n, e = x.shape
    m = n // world
    send = x.reshape(b, local_heads, world, m, e).permute(2, 0, 1, 3, 4).contiguous()  # (P, b, H/P, m, e)
    received = _all_to_all(send, group)  # (P, b, H/P, m, e) by source
    return received.transpose(0, 1).reshape(b, world * local_heads, m, e)  # (b, H, m, e)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    *,
    causal: bool = False,
    mask: masks.Mask | None = None,
    key_padding: torch.Tensor | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSpeed-Ulysses attention: all-to-all from sequence shards to head shards, attend, all-to-all back.

    Args:
        q: (b, h, n/P, d) this rank's queries; P = the size of ``group``, which must divide h.
        k: (b, g, n/P, d) this rank's keys. P must divide g, or g divide P: then each kv head is replicated P/g
            times before the exchange (P/g times the K/V traffic), so each rank gets the one kv head its h/P query
            heads read. Other (h, g, P) are refused with a ValueError naming them.
        v: (b, g, n/P, e) this rank's values.
        group: the process group the sequence is split over, a 1-D DeviceMesh, or None (the whole world).
        causal, mask: causal, window, softcap, padding, documents and alibi terms on global positions (the module
            docstring says what each tensor means). padding(lengths), documents(cu_seqlens=...) and the slopes go
            to the kernel as they are (each rank takes its h/P heads' slopes, so learned ones get their gradient
            there, the other heads' 0 on this rank: sum it over ranks as a replicated parameter's); padding(valid)
            shards join key_padding's all-gather, documents(ids) shards are all-gathered (one more collective).
        key_padding: None or (b, n/P) bool, True = real key, sharded like k (all-gathered: one extra collective).
        scale: multiplies q k^T; default 1/sqrt(d).
        layout: "contiguous" or "zigzag": which positions every rank's shard holds (the module docstring).
        backend: the kernel backend run on each rank's heads (see :func:`multihead.explain`).
        sinks: learned sink logits as :func:`multihead.attention` takes them: (h,), each rank attending with its
            own heads' (a slice: the other heads' gradient is 0 here), or (b, h, n/P) per row, sharded like q and
            sent to the head shards with it.

    Returns:
        (b, h, n/P, e): this rank's shard of the output, in the same layout as q.

    Communication per forward: 4 all-to-alls (q, k, v to head shards, the output back; each moves
    (P - 1)/P of its tensor), plus one all-gather of the key validity when key_padding or padding(valid) is given,
    and one of the document indices when documents(ids) is; the backward runs the transposed all-to-alls (4 more).
    Autograd flows through torch's functional ``all_to_all_single_autograd``.
    """
    group, rank, world = _group_size(group, "ulysses_attention")
    b, h, g, m = _check_inputs(q, k, v, key_padding, layout, world, "ulysses_attention")
    split = _check_mask(mask, causal, "ulysses_attention", b, h, m, world)
    diagonals = split.diagonals
    kv_heads = ulysses_kv_heads(h, g, world, q_argument="q", kv_argument="k")  # shared with `multihead cost --cp`
    if kv_heads != g:
        k = k.repeat_interleave(kv_heads // g, dim=1)  # (b, P, n/P, d): kv head j serves rank j's query heads
        v = v.repeat_interleave(kv_heads // g, dim=1)
    order = _shard_order(layout, world, m, q.device)  # global position of each shard-ordered entry
    inverse = None if order is None else torch.argsort(order)

    def natural(x: torch.Tensor) -> torch.Tensor:  # (b, H/P, n, d) in shard order -> position order
        return x if inverse is None else x.index_select(2, inverse)

    q_heads = natural(_seq_to_heads(q, world, group))  # (b, h/P, n, d)
    k_heads = natural(_seq_to_heads(k, world, group))  # (b, g/P or 1, n, d)
    v_heads = natural(_seq_to_heads(v, world, group))  # (b, g/P or 1, n, e)
    terms: list[masks.Mask] = list(diagonals.extra)
    if diagonals.left is not None or diagonals.right is not None:
        terms.append(masks.window(diagonals.left, diagonals.right))
    # every rank attends over the whole sequence in position order: terms on global positions apply as they are
    terms += [masks.padding(lengths) for lengths in split.lengths]
    terms += [masks.documents(cu_seqlens=bounds) for bounds in split.bounds]
    valid = _shard_validity(key_padding, split, None, q.device)  # key_padding & padding(valid) shards: (b, n/P)
    if valid is not None:
        terms.append(masks.padding(_natural_keys(_gathered(valid, world, group), inverse)))  # (b, n)
    ids = _shard_documents(split, None, q.device)  # documents(ids) shards: (t, b, n/P)
    if ids is not None:
        terms += [masks.documents(row) for row in _natural_keys(_gathered(ids, world, group), inverse)]  # (b, n) each
    if split.slopes is not None:  # this rank's heads' slopes, (b or 1, h/P) -> (h/P,) or (b, h/P)
        local_slopes = split.slopes[:, rank * (h // world) : (rank + 1) * (h // world), 0]
        terms.append(masks.alibi(local_slopes[0] if local_slopes.shape[0] == 1 else local_slopes))
    combined = _combine(terms)
    local_sinks = None
    if sinks is not None:
        check_sinks(sinks, q)
        if sinks.ndim == 1:  # this rank's heads: those the all-to-all sent it
            local_sinks = sinks[rank * (h // world) : (rank + 1) * (h // world)]
        else:  # (b, h, n/P) -> (b, h/P, n), as q went
            local_sinks = natural(_seq_to_heads(sinks.unsqueeze(-1), world, group)).squeeze(-1)
    out = attention(q_heads, k_heads, v_heads, mask=combined, scale=scale, backend=backend, sinks=local_sinks)
    assert isinstance(out, torch.Tensor)
    if order is not None:
        out = out.index_select(2, order)  # back to shard order
    return _heads_to_seq(out, world, group)  # (b, h, n/P, e)


def _gathered(x: torch.Tensor, world: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's (..., m) shard of ``x`` (no gradient: key validity, document indices), concatenated in rank
    order on the last dim: (..., P m), the positions in shard order (one all-gather)."""
    pieces = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def _natural_keys(x: torch.Tensor, inverse: torch.Tensor | None) -> torch.Tensor:
    """(..., n) in shard order -> position order (``inverse``: argsort of the shard order, None for contiguous)."""
    return x if inverse is None else x.index_select(-1, inverse)


# --------------------------------------------------------------------------- ring


class _Pending:
    """A ring exchange in flight: this rank's buffer going to the next rank, the previous rank's coming in."""

    def __init__(self, send: torch.Tensor, ring: _Ring, *, tag: int):
        group, rank, world = ring.group, ring.rank, ring.world
        self.next = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
        self.prev = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
        self.send, self.received = send, torch.empty_like(send)  # both kept alive until the exchange ends
        self.works = _exchange(send, self.received, to=self.next, source=self.prev, group=group, tag=tag)

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


def _exchange(
    send: torch.Tensor,
    into: torch.Tensor,
    *,
    to: int,
    source: int,
    group: dist.ProcessGroup | None,
    tag: int = 0,
) -> list[dist.Work]:
    """Start one point-to-point send of ``send`` to rank ``to`` and one receive from ``source`` into ``into``."""
    ops = [dist.P2POp(dist.isend, send, to, group, tag), dist.P2POp(dist.irecv, into, source, group, tag)]
    return list(dist.batch_isend_irecv(ops))


_KV_TAG, _GRAD_TAG = 0, 1  # K/V buffers and dK/dV accumulators may be in flight at once between the same ranks


@dataclass(frozen=True)
class _Ring:
    """Everything about one ring_attention call that is not a tensor: the group, the sizes, the masks."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    layout: str
    diagonals: _Diagonals
    scale: float | None
    backend: str
    b: int
    g: int
    m: int
    d: int
    e: int
    padded: bool = False  # a (b, m) key validity travels with K/V
    documents: int = 0  # how many (b, m) rows of document indices travel with K/V (one per documents term)

    def pack(
        self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, ids: torch.Tensor | None
    ) -> torch.Tensor:
        """K, V, the key validity (b, m) and the document indices (t, b, m) in one flat buffer of k's dtype: one
        send per ring step. The validity goes as 0/1, exact in any dtype; the indices go as their int64 bytes
        reinterpreted (never converted: bfloat16 holds integers exactly only up to 256, float16 up to 2048), so
        every index arrives exactly. 8 t b m bytes."""
        pieces = [k.reshape(-1), v.reshape(-1)]
        if valid is not None:
            pieces.append(valid.to(k.dtype).reshape(-1))
        if ids is not None:
            pieces.append(ids.contiguous().view(k.dtype).reshape(-1))  # 8 // element size entries an index
        return torch.cat(pieces)  # (b g m d + b g m e [+ b m] [+ 8 t b m / element size],)

    def unpack(
        self, held: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(k (b, g, m, d), v (b, g, m, e) in ``dtype``, valid (b, m) bool or None, ids (t, b, m) int64 or None)
        from a buffer made by :meth:`pack`."""
        b, g, m, d, e = self.b, self.g, self.m, self.d, self.e
        kv = b * g * m * (d + e)
        k = held[: b * g * m * d].view(b, g, m, d).to(dtype)
        v = held[b * g * m * d : kv].view(b, g, m, e).to(dtype)
        valid = held[kv : kv + b * m].view(b, m) > 0.5 if self.padded else None
        ids = None
        if self.documents:
            # copied out: an int64 view needs a start aligned to 8 bytes, which the buffer's tail may not have
            tail = held[kv + (b * m if self.padded else 0) :].clone()
            ids = tail.view(torch.int64).view(self.documents, b, m)
        return k, v, valid, ids

    def blocks(
        self,
        source: int,
        valid: torch.Tensor | None,
        q_ids: torch.Tensor | None,
        k_ids: torch.Tensor | None,
        slopes: torch.Tensor | None,
        device: torch.device,
    ) -> list[tuple[slice, slice, masks.Mask | None]]:
        """(query slice, key slice, mask) of every (query chunk, key chunk) pair of this rank's queries against
        rank ``source``'s keys that the causal/window bounds do not rule out (nor, where the indices are on the
        CPU, the documents); the slices index the shards. ``valid`` (b, m) the source's key validity, ``q_ids`` and
        ``k_ids`` (t, b, m) this rank's and the source's document indices, ``slopes`` (b or 1, h, 1) ALiBi's."""
        q_spans = _spans(self.layout, self.rank, self.world, self.m)
        k_spans = _spans(self.layout, source, self.world, self.m)
        found = []
        q_start = 0
        for q_span in q_spans:
            rows = slice(q_start, q_start + q_span[1])
            q_start += q_span[1]
            k_start = 0
            for k_span in k_spans:
                cols = slice(k_start, k_start + k_span[1])
                k_start += k_span[1]
                skip, block_mask = _block_mask(self.diagonals, q_span, k_span, device)
                if skip:
                    continue
                terms = list(self.diagonals.extra) + ([block_mask] if block_mask is not None else [])
                if valid is not None:
                    terms.append(masks.padding(valid[:, cols]))
                if q_ids is not None and k_ids is not None:
                    # a pair in one document under every indexing: (b, 1, rows, cols), the block's own pairs
                    same = (q_ids[:, :, rows, None] == k_ids[:, :, None, cols]).all(0).unsqueeze(1)
                    if host_readable(same) and not bool(same.any()):
                        continue  # on the CPU, where reading waits for no device: no pair shares a document
                    terms.append(masks.allowed(same))
                if slopes is not None:
                    # query row r sits at global q_span[0] + r, key column c at k_span[0] + c: the bias
                    # -slope |q_span[0] + r - k_span[0] - c| is ALiBi with row r aligned to column r + qs - ks
                    aligned = torch.arange(q_span[1], device=device)[None, :] + (q_span[0] - k_span[0])
                    terms.append(masks.aligned_alibi(slopes, aligned, name="alibi(slopes)"))
                found.append((rows, cols, _combine(terms)))
        return found


def _block_mask(
    diagonals: _Diagonals, q_span: tuple[int, int], k_span: tuple[int, int], device: torch.device
) -> tuple[bool, masks.Mask | None]:
    """(skip, mask) for queries at global positions q_span against keys at k_span, from the causal/window bounds.

    Key j may serve query i when lo <= j - i <= hi with lo = (qs - ks) - left, hi = (qs - ks) + right. A block
    no pair of which may attend is skipped; a diagonal block is a top-left window; only an off-diagonal block a
    window cuts (hi < 0 or lo > 0) needs a dense (i, j) bool mask.
    """
    (qs, cq), (ks, ck) = q_span, k_span
    delta = qs - ks
    lo = None if diagonals.left is None else delta - diagonals.left
    hi = None if diagonals.right is None else delta + diagonals.right
    if (lo is not None and lo > ck - 1) or (hi is not None and hi < -(cq - 1)):
        return True, None
    if (lo is None or lo <= -(cq - 1)) and (hi is None or hi >= ck - 1):
        return False, None
    if (lo is None or lo <= 0) and (hi is None or hi >= 0):
        return False, masks.window(None if lo is None else -lo, hi, align="top_left")
    offsets = torch.arange(ck, device=device)[None, :] - torch.arange(cq, device=device)[:, None]  # (i, j): j - i
    allowed = torch.ones(cq, ck, dtype=torch.bool, device=device)
    if lo is not None:
        allowed &= offsets >= lo
    if hi is not None:
        allowed &= offsets <= hi
    return False, masks.allowed(allowed)


def _merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, new_out: torch.Tensor, new_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint keys by their log-sum-exps (rows with no key stay 0, -inf)."""
    if out is None or lse is None:
        return new_out, new_lse
    top = torch.maximum(lse, new_lse)  # (b, h, i)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = torch.exp(lse - top) + torch.exp(new_lse - top)  # 0 where both LSEs are -inf
    seen = total > 0
    total = torch.where(seen, top + torch.log(torch.where(seen, total, torch.ones_like(total))), lse)  # -inf if unseen
    scale = torch.where(seen, total, torch.zeros_like(total))
    a, c = torch.exp(lse - scale).unsqueeze(-1), torch.exp(new_lse - scale).unsqueeze(-1)  # (b, h, i, 1)
    return out * a.to(out.dtype) + new_out * c.to(out.dtype), total


def _block_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype ring attention computes its blocks in: float32 for half types on the CPU, where the kernels compute
    in float32 anyway (or slowly in half precision) and each block's output would otherwise be rounded to half
    precision before the merge; the input's own dtype elsewhere (a GPU's half-precision kernels are the fast ones)."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return q.dtype


class _RingAttention(torch.autograd.Function):
    """Ring attention with its own backward: the forward keeps no graph, only this rank's q, k, v, key_padding,
    the merged output and LSE (O(n/P)); the backward sends K/V round the ring again and recomputes each block."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding: torch.Tensor | None,
        ids: torch.Tensor | None,
        slopes: torch.Tensor | None,
        ring: _Ring,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        b, h, m, e = q.shape[0], q.shape[1], ring.m, ring.e
        outs: list[torch.Tensor | None] = [None] * 2
        lses: list[torch.Tensor | None] = [None] * 2
        q_spans = _spans(ring.layout, ring.rank, ring.world, m)
        held = ring.pack(k, v, key_padding, ids)
        q_blocks = q.to(_block_dtype(q))
        for step in range(ring.world):
            pending = _Pending(held, ring, tag=_KV_TAG) if step < ring.world - 1 else None  # overlaps the blocks
            k_src, v_src, valid, k_ids = ring.unpack(held, q_blocks.dtype)
            source = (ring.rank - step) % ring.world
            for rows, cols, block_mask in ring.blocks(source, valid, ids, k_ids, slopes, q.device):
                result = attention_result(
                    q_blocks[:, :, rows],
                    k_src[:, :, cols],
                    v_src[:, :, cols],
                    mask=block_mask,
                    scale=ring.scale,
                    backend=ring.backend,
                    return_lse=True,
                )
                assert result.lse is not None  # asked for
                qi = 0 if rows.start == 0 else 1
                block_out = result.output.to(torch.promote_types(result.output.dtype, torch.float32))  # merge in fp32+
                outs[qi], lses[qi] = _merge(outs[qi], lses[qi], block_out, result.lse)
            if pending is not None:
                held = pending.wait()
        lse_dtype = next((part.dtype for part in lses if part is not None), q.dtype)
        out_parts, lse_parts = [], []
        for qi, (_, length) in enumerate(q_spans):
            part, part_lse = outs[qi], lses[qi]
            # a query chunk no key may serve: output 0, LSE -inf
            out_parts.append(part if part is not None else q.new_zeros(b, h, length, e))
            lse_parts.append(
                part_lse if part_lse is not None else q.new_full((b, h, length), -math.inf, dtype=lse_dtype)
            )
        out = torch.cat(out_parts, dim=2)  # (b, h, n/P, e), merged in float32 at least
        lse = torch.cat(lse_parts, dim=2)  # (b, h, n/P)
        if sinks is not None:  # at the final merge: every key's block is in, the sink joins each row's softmax
            out = out * kept_share(lse, sinks).to(out.dtype).unsqueeze(-1)
            lse = sink_lse(lse, sinks)  # the backward's weights exp(lse_block - lse) are then the sinks' own
        out = out.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, key_padding, ids, slopes, out, lse, sinks)
        return out

    @staticmethod
    @once_differentiable
    def backward(
        ctx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, torch.Tensor | None, None, torch.Tensor | None]:
        ring: _Ring = ctx.ring
        q, k, v, key_padding, ids, slopes, out, lse, sinks = ctx.saved_tensors
        # learned ALiBi slopes: one leaf every block's bias reads, so each block's recomputation gives its share
        slope_leaf = slopes.detach().requires_grad_() if ctx.needs_input_grad[5] else None
        d_slopes = None  # summed over the blocks in float32 at least
        if slope_leaf is not None:
            d_slopes = torch.zeros_like(slopes, dtype=torch.promote_types(slopes.dtype, torch.float32))
        b, g, m, d = ring.b, ring.g, ring.m, ring.d
        finite = torch.isfinite(lse)  # False on rows no key may serve: their gradient is 0
        lse_safe = torch.where(finite, lse, torch.zeros_like(lse))
        # D_i = dO_i . O_i with the merged output: the block weights' share of the softmax gradient
        delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # (b, h, n/P)
        work = torch.promote_types(k.dtype, torch.float32)  # gradients summed in float32 at least, sent in k's dtype
        dq = torch.zeros_like(q, dtype=torch.promote_types(q.dtype, torch.float32))
        held = ring.pack(k, v, key_padding, ids)
        q_blocks = q.to(_block_dtype(q))
        grads_pending: _Pending | None = None
        for step in range(ring.world):
            pending = _Pending(held, ring, tag=_KV_TAG) if step < ring.world - 1 else None  # overlaps the blocks
            k_src, v_src, valid, k_ids = ring.unpack(held, q_blocks.dtype)
            dkv = torch.zeros(b * g * m * (d + ring.e), dtype=work, device=k.device)  # this step's dK, dV
            dk_src, dv_src = dkv[: b * g * m * d].view_as(k_src), dkv[b * g * m * d :].view_as(v_src)
            source = (ring.rank - step) % ring.world
            table = slopes if slope_leaf is None else slope_leaf
            for rows, cols, block_mask in ring.blocks(source, valid, ids, k_ids, table, q.device):
                with torch.enable_grad():
                    q_blk = q_blocks[:, :, rows].detach().requires_grad_()
                    k_blk = k_src[:, :, cols].detach().requires_grad_()
                    v_blk = v_src[:, :, cols].detach().requires_grad_()
                    result = attention_result(
                        q_blk,
                        k_blk,
                        v_blk,
                        mask=block_mask,
                        scale=ring.scale,
                        backend=ring.backend,
                        return_lse=True,
                    )
                    assert result.lse is not None  # asked for
                    out_blk, lse_blk = result.output, result.lse
                    # O = sum_b w_b o_b with w_b = exp(lse_b - L): dL/do_b = w_b dO, dL/dlse_b = w_b (dO.o_b - dO.O)
                    weight = torch.where(
                        finite[:, :, rows],
                        torch.exp(lse_blk.detach() - lse_safe[:, :, rows].to(lse_blk.dtype)),
                        torch.zeros_like(lse_blk),
                    )  # (b, h, c)
                    grad_o = grad_out[:, :, rows]
                    row_dot = (grad_o.to(lse_blk.dtype) * out_blk.detach().to(lse_blk.dtype)).sum(-1)
                    grad_lse = weight * (row_dot - delta[:, :, rows].to(lse_blk.dtype))
                    grad_blk = torch.autograd.grad(
                        (out_blk, lse_blk),
                        (q_blk, k_blk, v_blk) + (() if slope_leaf is None else (slope_leaf,)),
                        (grad_o.to(out_blk.dtype) * weight.unsqueeze(-1).to(out_blk.dtype), grad_lse),
                        allow_unused=True,
                    )
                into_grads = (dq[:, :, rows], dk_src[:, :, cols], dv_src[:, :, cols])
                for into, grad in zip(into_grads, grad_blk[:3], strict=True):
                    if grad is not None:
                        into += grad
                if d_slopes is not None and grad_blk[3] is not None:
                    d_slopes += grad_blk[3]  # this block's pairs' share
            if grads_pending is not None:
                dkv += grads_pending.wait().to(work)  # the dK/dV of this block from the ranks it visited before
            if ring.world > 1:  # on to the next rank; after the last step that is the block's owner
                grads_pending = _Pending(dkv.to(k.dtype), ring, tag=_GRAD_TAG)
            if pending is not None:
                held = pending.wait()
        if grads_pending is not None:
            dkv = grads_pending.wait()  # this rank's own dK/dV, summed over every rank's queries
        dk = dkv[: b * g * m * d].view_as(k)
        dv = dkv[b * g * m * d :].view_as(v)
        d_sinks = _sinks_grad(sinks, lse, delta) if ctx.needs_input_grad[7] else None
        d_table = None if d_slopes is None else d_slopes.to(slopes.dtype)  # this rank's rows' share
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, d_table, None, d_sinks


def _sinks_grad(sinks: torch.Tensor | None, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor | None:
    """This rank's share of the sinks' gradient, -sum over its rows of p_sink * rowsum(dO * O), from the LSE over
    keys and sink (b, h, n/P) and delta = rowsum(dO * O) (b, h, n/P): (h,) summed over b and rows for per-head sinks,
    (b, h, n/P) for per-row ones. Replicated sinks sum it over the ranks as any replicated parameter does."""
    if sinks is None:
        return None
    p_sink = torch.exp(per_row(sinks, lse) - lse)  # (b, h, n/P)
    grad = -(p_sink * delta.to(p_sink.dtype))
    return (grad.sum((0, 2)) if sinks.ndim == 1 else grad).to(sinks.dtype)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    *,
    causal: bool = False,
    mask: masks.Mask | None = None,
    key_padding: torch.Tensor | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ring attention: each rank keeps its queries; K/V shards go round the ring; partials merge by their LSE.

    Args:
        q: (b, h, n/P, d) this rank's queries (any h; P = the size of ``group``).
        k: (b, g, n/P, d) this rank's keys, h % g == 0 (GQA and MQA send only the g kv heads round).
        v: (b, g, n/P, e) this rank's values.
        group: the process group the sequence is split over, a 1-D DeviceMesh, or None (the whole world).
        causal, mask: causal, window, softcap, padding, documents and alibi terms on global positions (the module
            docstring says what each tensor means). The key validity (key_padding, padding(valid) shards and
            padding(lengths) at this rank's global positions, and-ed) and each documents term's indices of this
            rank's positions travel with K/V; each block takes the documents term as a dense (b, 1, n/2P, n/2P)
            bool of its pairs (a block with no pair in one document is skipped where the indices are on the CPU,
            never read from a device), and ALiBi with the block's global offset. Learned ALiBi slopes
            (requires_grad) get their gradient, recomputed with each block in the backward: this rank's rows'
            share, summed over ranks as a replicated parameter's (as the sinks' below).
        key_padding: None or (b, n/P) bool, True = real key, sharded like k; it travels with K/V.
        scale: multiplies q k^T; default 1/sqrt(d).
        layout: "contiguous" or "zigzag" (the module docstring). With ``causal`` use "zigzag": every rank then
            computes the same number of blocks; with "contiguous" rank P - 1 does P times the work of rank 0.
        backend: the kernel backend for each block; it must return the LSE (see :func:`multihead.explain`).
        sinks: learned sink logits as :func:`multihead.attention` takes them, (h,) or (b, h, n/P) sharded like q:
            applied at the final merge, once every key's block is in (the backward's block weights are then the
            sinks' own). The gradient of (h,) sinks is this rank's rows' share, summed over ranks as any
            replicated parameter's.

    Returns:
        (b, h, n/P, e): this rank's shard of the output, in the same layout as q.

    Forward: P steps; at each of the first P - 1 the K/V (with the key validity and document indices) this rank
    holds go to rank + 1 as one packed buffer, and rank - 1's come in, point to point, while the rank attends to
    the block it holds. Each (query chunk, key chunk) pair runs ``multihead.attention_result(..., return_lse=True)``,
    skipped where the causal/window bounds rule it out, and the partial outputs merge by their log-sum-exp. No
    autograd graph is kept: only this rank's q, k, v, key validity, document indices, merged output and merged LSE
    are saved, so memory per rank is O(n/P) in training as in inference.

    Backward: the K/V buffers go round the ring again (P - 1 sends), and with each block a dK/dV accumulator:
    every rank recomputes its blocks against the K/V it holds, weights their gradient by exp(lse_block - lse),
    keeps dQ, and adds its dK/dV to the accumulator, which it sends on to rank + 1; after the last step one more
    send brings each finished dK/dV to its owner (P sends). Sends per rank, with S = b g (n/P) (d + e) x the
    element size (this rank's K and V bytes), T = b (n/P) x the element size when a key validity is given
    (key_padding, padding; else 0) and I = 8 t b (n/P) bytes for t documents terms (their int64 indices; else 0):

        forward    P - 1 sends    (P - 1)(S + T + I) bytes
        backward   2P - 1 sends   (P - 1)(S + T + I) + P S bytes     (none at P = 1)

    Partial outputs merge, and gradients sum on each rank, in float32 at least; the dK/dV accumulators travel
    in k's dtype. A window cutting a block off the diagonal is evaluated as a dense (n/2P, n/2P) bool mask for
    that block.
    """
    group, rank, world = _group_size(group, "ring_attention")
    b, h, g, m = _check_inputs(q, k, v, key_padding, layout, world, "ring_attention")
    split = _check_mask(mask, causal, "ring_attention", b, h, m, world)
    if sinks is not None:
        check_sinks(sinks, q)
    where = _global_positions(layout, rank, world, m, q.device)  # (n/P,) this rank's positions
    valid = _shard_validity(key_padding, split, where, q.device)  # (b, n/P) bool: travels with K/V
    ids = _shard_documents(split, where, q.device)  # (t, b, n/P) int64: travels with K/V, exactly
    slopes = None if split.slopes is None else to_device(split.slopes, q.device)  # (b or 1, h, 1)
    ring = _Ring(
        group,
        rank,
        world,
        layout,
        split.diagonals,
        scale,
        backend,
        b,
        g,
        m,
        k.shape[-1],
        v.shape[-1],
        padded=valid is not None,
        documents=0 if ids is None else ids.shape[0],
    )
    out = _RingAttention.apply(q, k, v, valid, ids, slopes, ring, sinks)
    assert isinstance(out, torch.Tensor)
    return out  # (b, h, n/P, e)


# --------------------------------------------------------------------------- the layer


@dataclass(frozen=True)
class SequenceSplit:
    """A layer's sequence split across the ranks of ``group``: set as ``layer.sequence_split`` (by
    :class:`multihead.parallel.ContextParallel` or, for one call, :class:`SequenceParallelAttention`), the layer takes
    this rank's shard (b, n/P, embed_dim) in ``layout``, rotates it at its global positions and attends over the whole
    sequence with ``method``, through its ``Attend`` (head gates and ablations apply to its heads as on one rank).

    Called as the kernel :func:`multihead.attention_result` would be, on the layer's local heads: q (b, h, n/P, d),
    k (b, g, n/P, d), v (b, g, n/P, e) -> an AttentionResult with the output (b, h, n/P, e) only. ``key_padding``:
    None or (b, n/P) bool, True = real key, sharded like k (for one call).
    """

    group: object
    method: str = "ring"
    layout: str = "contiguous"
    key_padding: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_method(self.method)
        check_layout(self.layout)

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """(length,) the global positions of this rank's ``length`` = n/P positions, in shard order."""
        _, rank, world = _group_size(self.group, "the sequence split")
        if self.layout == "zigzag" and length % 2:
            raise bad_argument(
                "query",
                f"a zigzag shard of even length n/P (two chunks of n/(2P); P = {world})",
                f"n/P = {length}",
                f"pad the sequence to a multiple of 2P = {2 * world}, mark padded keys as padding, "
                "and shard with zigzag_shard",
            )
        return _global_positions(self.layout, rank, world, length, device)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: masks.Mask | torch.Tensor | None = None,
        causal: bool = False,
        scale: float | None = None,
        dropout: float = 0.0,
        training: bool = False,
        backend: str = "auto",
        pages: object = None,
        sinks: torch.Tensor | None = None,
        return_weights: object = False,
        return_lse: bool = False,
    ) -> AttentionResult:
        """Ring or Ulysses attention of this rank's heads over the whole sequence; what it cannot serve, refused."""
        if training and dropout > 0:
            raise bad_argument(
                "dropout",
                "0 in training (attention dropout is not implemented across ranks)",
                dropout,
                "set layer.dropout = 0.0, or call .eval()",
            )
        if return_weights is not False or return_lse:
            raise bad_argument(
                "return_weights",
                "no weights nor log-sum-exp: a sequence split across ranks never forms them on one rank",
                f"return_weights={return_weights!r}, return_lse={return_lse!r}",
                "look at the weights of a sequence that fits one rank",
            )
        if pages is not None:
            raise bad_argument("pages", "None: a split sequence has no paged cache", describe(pages), "drop pages")
        if isinstance(mask, torch.Tensor):
            raise bad_argument(
                "mask",
                "a typed mask from multihead.masks on global positions (a tensor's (i, j) cannot be split)",
                describe(mask),
                "pass masks.causal() / masks.window(left, right) / masks.softcap(cap) / masks.padding(...)",
                kind=TypeError,
            )
        fn = ring_attention if self.method == "ring" else ulysses_attention
        out = fn(
            q,
            k,
            v,
            self.group,  # type: ignore[arg-type]  # checked by resolve_group
            causal=causal,
            mask=mask,
            key_padding=self.key_padding,
            scale=scale,
            layout=self.layout,
            backend=backend,
            sinks=sinks,
        )
        return AttentionResult(out, None, None)  # (b, h, n/P, e)


METHODS = ("ring", "ulysses")


def check_method(method: object) -> None:
    """ValueError naming ``method`` unless it is one of :data:`METHODS`."""
    if method not in METHODS:
        raise bad_argument("method", '"ring" or "ulysses"', repr(method), 'pass method="ring" or "ulysses"')


def check_layout(layout: object) -> None:
    """ValueError naming ``layout`` unless it is one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise bad_argument("layout", f"one of {LAYOUTS}", repr(layout), 'pass layout="contiguous" or "zigzag"')


class SequenceParallelAttention(nn.Module):
    """A :class:`multihead.MultiHeadAttention` run on a sequence-sharded input: projections local, attention by
    ``method`` ("ring" or "ulysses") across ``group``, W^O local.

    Every rank holds the whole layer (the same weights, as under data parallelism: average the weight gradients
    over the group, e.g. with DistributedDataParallel, to keep them equal), or its head shard
    (:func:`multihead.parallel.shard_heads` over another dimension of the mesh). Self-attention only; rotary
    positions are the global positions of the rank's shard. The attention runs through the layer's ``Attend``, so
    head gates and ablations act on its heads; weights, capture, a KV cache and attention dropout in training are
    refused (this is for training and prefill).

        x (b, n/P, embed_dim), this rank's shard in ``layout``  ->  out (b, n/P, out_dim), the same shard

    It splits the layer for its own calls only: ``layer(x)`` itself still runs on one rank. To split the layer for
    every call, in place (inside a model), use :class:`multihead.parallel.ContextParallel`.
    """

    def __init__(
        self,
        layer: MultiHeadAttention,
        group: dist.ProcessGroup | DeviceMesh | None = None,
        *,
        method: str = "ring",
        layout: str = "contiguous",
    ):
        super().__init__()
        if not isinstance(layer, MultiHeadAttention):
            raise bad_argument(
                "layer", "a multihead.MultiHeadAttention", describe(layer), "wrap a MultiHeadAttention", kind=TypeError
            )
        SequenceSplit(group, method, layout)  # checks method and layout
        self.layer, self.group, self.method, self.layout = layer, group, method, layout

    def forward(
        self,
        x: torch.Tensor,
        *,
        causal: bool = False,
        mask: masks.Mask | None = None,
        key_padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (b, n/P, embed_dim) -> (b, n/P, out_dim); ``causal``, ``mask``, ``key_padding`` as in ring_attention."""
        layer = self.layer
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != layer.embed_dim:
            raise bad_argument(
                "x",
                f"(b, n/P, embed_dim = {layer.embed_dim}): this rank's shard of the sequence",
                describe(x),
                "shard a (b, n, embed_dim) input on dim 1 with the module's layout",
            )
        outer = layer.sequence_split
        if outer is not None:
            raise bad_argument(
                "layer",
                "a layer whose sequence is not split already",
                f"a layer split by {outer.method} over its own group",  # type: ignore[attr-defined]
                "call the layer itself (ContextParallel split it), or set layer.sequence_split = None",
            )
        layer.sequence_split = SequenceSplit(self.group, self.method, self.layout, key_padding)
        try:  # the layer's own forward (a head shard's too), with this split for this call only
            out, _ = layer(x, mask=mask, causal=causal)
        finally:
            layer.sequence_split = None
        return out  # (b, n/P, out_dim)
