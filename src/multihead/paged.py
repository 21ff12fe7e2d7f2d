"""A paged KV cache: fixed-size pages in one pool per layer, a block table per sequence (vLLM's PagedAttention,
FlashAttention's ``block_table``).

    cache = layer.new_paged_cache(num_pages=64, page_size=16)
    a, b = cache.add(), cache.add()                       # two sequences, empty
    layer(prompt_a, causal=True, cache=cache.batch([a]))  # prefill a: (1, n_a, embed)
    layer(prompt_b, causal=True, cache=cache.batch([b]))
    layer(x, causal=True, cache=cache.batch([a, b]))      # decode both: (2, 1, embed), each at its own length
    cache.free(a)                                         # a's pages go back to the pool

A server decodes many sequences of different lengths at once and retires them as they finish. One contiguous
(b, g, max_len, d) tensor per layer reserves max_len for every row; the pool holds pages of ``page_size`` keys
and each sequence takes pages as it grows. A staged append's :class:`~multihead.backends.paged.PageTable` is what
the layer attends through: ``attention(q, cache.keys, cache.values, pages=table)`` runs the ``paged`` backend, which
reads a few columns of pages at a time (about 256 keys of every sequence) with an online softmax: nothing gathers a
sequence's whole cache. The layer makes that call through its ``Attend`` step, so head gates, ablations, capture
and weights act on paged calls as on contiguous ones.

Nothing is lost on failure, as with :class:`~multihead.KVCache`: :meth:`PagedBatch.stage` writes the new keys
into slots nothing counts yet (the free part of a sequence's last page, and pages it reserves but leaves in the
free list) and :meth:`PagedPending.commit` makes them count. A call that raises leaves the pool's free list, every
block table and every length as they were.

A window cache (``window=W``) keeps the keys a later query can need: after each append, pages whose keys are all
more than W - 1 positions before the next token go back to the pool.

:func:`attention_with_kvcache` is FlashAttention's ``flash_attn_with_kvcache`` over a cache the caller holds (a
contiguous one, or page pools with a block table), in FlashAttention's (batch, seq, heads, dim) layout: it writes the
new keys in place and attends in one call, on the ``paged`` backend where the table says everything the call needs,
else on the keys gathered, through :func:`multihead.attention_result`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from multihead._errors import bad_argument, checked_flag, describe, positive_int
from multihead._inputs import floating_argument, matching, tensor_argument
from multihead._limits import check_fits
from multihead.backends.paged import KeptValues, PageTable
from multihead.cache import check_fitting, checked_layout
from multihead.functional import AttentionResult, attention_result
from multihead.masks import aligned_alibi, checked_slope_tensor, key_range_positions, key_ranges, slope_table, to_device
from multihead.masks import softcap as capped_scores

__all__ = ["PagedKVCache", "PagedBatch", "PagedPending", "attention_with_kvcache"]


@dataclass
class _Sequence:
    """One sequence's pages (pool indices, in order), the pages dropped before them (a window cache) and the
    tokens appended (its next token's position)."""

    pages: list[int] = field(default_factory=list)
    dropped: int = 0
    seen: int = 0

    def first_slot(self, page_size: int) -> int:
        """The position of the first key its table holds."""
        return self.dropped * page_size


class PagedKVCache:
    """One layer's pool: keys (num_pages, g, page_size, d) and values (num_pages, g, page_size, e), with a block
    table per sequence. Add sequences with :meth:`add`, run the layer on :meth:`batch` views, retire them with
    :meth:`free` (see the module docstring).

    Example:
        >>> cache = PagedKVCache(num_pages=8, page_size=4, num_kv_heads=2, head_dim=8)
        >>> s = cache.add()
        >>> pending = cache.batch([s]).stage(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))
        >>> pending.commit()
        >>> cache.length(s), cache.pages_in_use
        (6, 2)
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        value_head_dim: int | None = None,
        *,
        window: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        self.num_pages = positive_int("num_pages", num_pages)
        self.page_size = positive_int("page_size", page_size)
        self.num_kv_heads, self.head_dim, self.value_head_dim, self.window, dtype, device = checked_layout(
            num_kv_heads, head_dim, value_head_dim, window, dtype, device
        )
        check_fits(
            "num_pages",
            (self.num_pages, self.num_kv_heads, self.page_size, self.head_dim + self.value_head_dim),
            dtype,
            device,
            "use fewer or smaller pages",
            what="the pool",
        )
        self.keys = torch.zeros(num_pages, num_kv_heads, page_size, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(num_pages, num_kv_heads, page_size, self.value_head_dim, dtype=dtype, device=device)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pages are taken from its end
        self._sequences: dict[int, _Sequence] = {}
        self._next_handle = 0

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return (
            f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, value_head_dim={self.value_head_dim}{window}, "
            f"sequences={len(self._sequences)}, pages_in_use={self.pages_in_use})"
        )

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def sequences(self) -> list[int]:
        """The handles of the sequences held, in the order they were added."""
        return list(self._sequences)

    def add(self) -> int:
        """A new, empty sequence: its handle (it takes pages only as keys are appended)."""
        handle = self._next_handle
        self._next_handle += 1
        self._sequences[handle] = _Sequence()
        return handle

    def free(self, handle: int) -> None:
        """Retire a sequence: its pages go back to the pool and its handle is no longer valid."""
        sequence = self._sequence("handle", handle)
        self._free.extend(reversed(sequence.pages))
        del self._sequences[handle]

    def length(self, handle: int) -> int:
        """Keys the sequence holds now (for a window cache, those its pages still hold)."""
        sequence = self._sequence("handle", handle)
        return sequence.seen - sequence.first_slot(self.page_size)

    def seen(self, handle: int) -> int:
        """Tokens appended to the sequence: its next token's position."""
        return self._sequence("handle", handle).seen

    def pages(self, handle: int) -> list[int]:
        """The sequence's block table: the pool pages holding its keys, in order."""
        return list(self._sequence("handle", handle).pages)

    def batch(self, handles: list[int], *, shared: KeptValues | None = None) -> PagedBatch:
        """A view of some sequences, one per batch row, to pass a layer as its ``cache``. ``shared``: where the
        views of several pools that add, append and free together (the layers of one model) keep the plans of
        their appends, made once for all of them (None: this view's own)."""
        if not isinstance(handles, (list, tuple)) or not handles:
            raise bad_argument(
                "handles", "a non-empty list of sequence handles", describe(handles), "pass e.g. [cache.add()]"
            )
        if len(set(handles)) != len(handles):
            raise bad_argument("handles", "each sequence once", list(handles), "drop the repeated handles")
        for handle in handles:
            self._sequence("handles", handle)
        return PagedBatch(self, list(handles), KeptValues() if shared is None else shared)

    def _sequence(self, name: str, handle: object) -> _Sequence:
        if not isinstance(handle, int) or isinstance(handle, bool) or handle not in self._sequences:
            raise bad_argument(
                name,
                f"a handle of a sequence this cache holds ({sorted(self._sequences)})",
                describe(handle),
                "use a handle from cache.add() that was not freed",
            )
        return self._sequences[handle]


@dataclass
class PagedPending:
    """An append staged by :meth:`PagedBatch.stage`: the page table to attend through, and what :meth:`commit`
    makes count."""

    batch: PagedBatch
    new: int  # tokens appended to every sequence
    reserved: list[list[int]]  # per sequence, the pages taken from the free list (still in it until commit)
    pages: PageTable  # every sequence's pages after the append, its key range and its new queries' positions
    state: tuple  # the cache's free list and sequences when staged (checked at commit)
    committed: bool = False

    def commit(self) -> None:
        """Make the append count: the reserved pages join the tables, the lengths grow, and with a window the
        pages no later query can need go back to the pool."""
        cache = self.batch.cache
        if self.committed:
            raise RuntimeError("this paged cache append was already committed")
        if _state(cache, self.batch.handles) != self.state:
            raise RuntimeError("the paged cache changed between stage() and commit(): stage again")
        taken = {page for pages in self.reserved for page in pages}
        cache._free = [page for page in cache._free if page not in taken]
        for handle, pages in zip(self.batch.handles, self.reserved, strict=True):
            sequence = cache._sequences[handle]
            sequence.pages.extend(pages)
            sequence.seen += self.new
            if cache.window is not None:  # keys before seen - W + 1 are needed by no later query
                keep_from = max(0, sequence.seen - cache.window + 1)
                while sequence.pages and (sequence.dropped + 1) * cache.page_size <= keep_from:
                    cache._free.append(sequence.pages.pop(0))
                    sequence.dropped += 1
        self.committed = True


def _state(cache: PagedKVCache, handles: list[int]) -> tuple:
    """What a staged append was planned on: the free list and the chosen sequences' tables and lengths."""
    sequences = [cache._sequences.get(handle) for handle in handles]
    return (
        tuple(cache._free),
        tuple(None if s is None else (tuple(s.pages), s.dropped, s.seen) for s in sequences),
    )


@dataclass(frozen=True)
class _AppendPlan:
    """An append of n tokens to each of S sequences: the pages each takes from the free list, the pool page and
    slot of each new token, (S, n) both, and the table to attend through after it."""

    reserved: list[list[int]]
    page_index: torch.Tensor
    slot_index: torch.Tensor
    pages: PageTable


class PagedBatch:
    """Sequences of a :class:`PagedKVCache`, one per batch row: what a layer takes as ``cache`` for them."""

    def __init__(self, cache: PagedKVCache, handles: list[int], plans: KeptValues):
        # plans: this append's and positions' plans by what they are made from (the chosen sequences' state), kept
        # for every layer's view of one step: pools in step hold equal tables, and each layer would build its own
        self.cache, self.handles, self.plans = cache, handles, plans

    @property
    def window(self) -> int | None:
        return self.cache.window

    def positions(self, new: int, device: torch.device) -> torch.Tensor:
        """(S, new): the positions of each sequence's next ``new`` tokens (rotary reads them)."""
        seen = [self.cache._sequences[h].seen for h in self.handles]
        device = torch.device(device)

        def make() -> torch.Tensor:
            return to_device(torch.tensor(seen, dtype=torch.long)[:, None] + torch.arange(new), device)

        return self.plans.get(("positions", tuple(seen), new, device), make)

    def shared_offset(self) -> int | None:
        """The next token's position where every sequence has seen as many tokens (one sequence, or sequences
        decoded in step), else None."""
        seen = {self.cache._sequences[h].seen for h in self.handles}
        return seen.pop() if len(seen) == 1 else None

    def check_compatible(
        self, batch_size: int, num_kv_heads: int, head_dim: int, value_head_dim: int, dtype: torch.dtype, device
    ) -> None:
        """Raise unless a call of these sizes fits: one batch row per sequence, the pool's heads and dims."""
        cache = self.cache
        check_fitting(
            "a paged cache",
            (
                ("batch size (one row per sequence)", len(self.handles), batch_size),
                ("key/value heads g", cache.num_kv_heads, num_kv_heads),
                ("head dim d", cache.head_dim, head_dim),
                ("value head dim e", cache.value_head_dim, value_head_dim),
            ),
            (cache.keys.dtype, cache.keys.device),
            (dtype, torch.device(device)),
            "pass cache.batch(handles) with one handle per batch row, from layer.new_paged_cache(...)",
            "build the cache with layer.new_paged_cache after moving or casting the layer",
        )

    def check_room(self, new: int) -> None:
        """Raise unless the free pages hold ``new`` more tokens for every sequence."""
        needed = sum(self._pages_needed(new))
        if needed > len(self.cache._free):
            raise bad_argument(
                "cache",
                f"{needed} free page(s) for {new} more token(s) in each of {len(self.handles)} sequence(s)",
                f"{len(self.cache._free)} free of {self.cache.num_pages}",
                "free finished sequences (cache.free(handle)), or build the cache with more pages",
            )

    def _pages_needed(self, new: int) -> list[int]:
        """How many more pages each sequence needs for ``new`` more tokens (past the free slots of its last)."""
        cache, counts = self.cache, []
        for handle in self.handles:
            sequence = cache._sequences[handle]
            room = len(sequence.pages) * cache.page_size - (sequence.seen - sequence.first_slot(cache.page_size))
            counts.append(max(0, math.ceil((new - room) / cache.page_size)))
        return counts

    def _reservations(self, new: int) -> list[list[int]]:
        """The pages each sequence takes for ``new`` more tokens, from the end of the free list (not taken yet:
        :meth:`check_room` has said they are there)."""
        free, reserved = self.cache._free, []
        end = len(free)
        for needed in self._pages_needed(new):
            reserved.append(free[end - needed : end][::-1])
            end -= needed
        return reserved

    def stage(self, keys: torch.Tensor, values: torch.Tensor) -> PagedPending:
        """Write keys (S, g, n, d) and values (S, g, n, e) into slots nothing counts yet and plan the append;
        nothing counts until :meth:`PagedPending.commit`."""
        cache = self.cache
        keys = self._check("keys", keys, "d", cache.head_dim)
        values = self._check("values", values, "e", cache.value_head_dim)
        if values.shape[2] != keys.shape[2]:
            raise bad_argument(
                "values", f"n = {keys.shape[2]} new tokens (from keys)", values.shape[2], "give both n tokens"
            )
        new = keys.shape[2]
        self.check_room(new)
        state = _state(cache, self.handles)
        device = cache.keys.device
        plan = self.plans.get(
            ("append", state, new, cache.page_size, cache.window, device), lambda: self._append_plan(new, device)
        )
        # keys (S, g, n, d) -> pool[page, :, slot]: one write of every new key
        cache.keys[plan.page_index, :, plan.slot_index] = keys.permute(0, 2, 1, 3)
        cache.values[plan.page_index, :, plan.slot_index] = values.permute(0, 2, 1, 3)
        return PagedPending(self, new, plan.reserved, plan.pages, state)

    def _append_plan(self, new: int, device: torch.device) -> _AppendPlan:
        """Where ``new`` more tokens of every sequence go and the table to attend through after them."""
        cache = self.cache
        reserved = self._reservations(new)
        sequences = [cache._sequences[handle] for handle in self.handles]
        tables = [sequence.pages + pages for sequence, pages in zip(sequences, reserved, strict=True)]
        padded = torch.full((len(tables), max(len(pages) for pages in tables)), -1, dtype=torch.long)  # (S, M)
        for row, pages in enumerate(tables):
            padded[row, : len(pages)] = torch.tensor(pages, dtype=torch.long)
        firsts = [sequence.first_slot(cache.page_size) for sequence in sequences]
        # the new keys' slots in each table: positions seen .. seen + new - 1, counted from its first held key
        offsets = torch.stack(
            [torch.arange(s.seen, s.seen + new) - first for s, first in zip(sequences, firsts, strict=True)]
        )  # (S, n)
        held = PageTable(
            tables=to_device(padded, device),
            first_slots=to_device(torch.tensor(firsts, dtype=torch.long), device),
            key_ends=to_device(torch.tensor([s.seen + new for s in sequences], dtype=torch.long), device),
            positions=self.positions(new, device),
            width=max(s.seen + new - first for s, first in zip(sequences, firsts, strict=True)),
            window=cache.window,
        )
        return _AppendPlan(
            reserved,
            to_device(padded.gather(1, offsets // cache.page_size), device),  # (S, n): sent unwaited
            to_device(offsets % cache.page_size, device),
            held,
        )

    def _check(self, name: str, t: object, last_axis: str, last: int) -> torch.Tensor:
        cache = self.cache
        layout = f"(S, g, n, {last_axis}) = ({len(self.handles)}, {cache.num_kv_heads}, n, {last})"
        t = tensor_argument(name, t, fix=f"pass {name} as a tensor {layout}")
        matching(name, t, cache.keys, "the paged cache", fix=f"convert with {name}.to(cache.keys)")
        if (
            t.ndim != 4
            or tuple(t.shape[:2]) != (len(self.handles), cache.num_kv_heads)
            or t.shape[3] != last
            or t.shape[2] < 1
        ):
            raise bad_argument(
                name, f"shape {layout} with n >= 1", f"shape {tuple(t.shape)}", "one row per sequence of the batch"
            )
        return t


# --------------------------------------------------------------------------- FlashAttention's KV-cache call


@dataclass(frozen=True)
class _KVCall:
    """A checked :func:`attention_with_kvcache` call: sizes, and every index it reads as host int64 tensors."""

    paged: bool
    page_size: int  # keys per page (a contiguous cache: its length)
    seqlens: torch.Tensor  # (b,) keys each row holds before the call
    leftpad: torch.Tensor  # (b,) each row's first key
    rows: torch.Tensor | None  # (b,) the cache row of each batch row (cache_batch_idx), None: row b
    table: torch.Tensor | None  # (b, M) the block table of a paged cache
    new: int  # new keys per row (0 without k and v)
    band: tuple[int | None, int | None]  # keys around each query's aligned position (causal and window_size)
    cap: float | None  # the soft-cap, None for none

    @property
    def turns_each_query(self) -> bool:
        """Whether rotary turns each query at its own position (FlashAttention: when causal or local, i.e. with a
        band); else every query of a row at the row's first new position."""
        return self.band != (None, None)

    @property
    def ends(self) -> torch.Tensor:
        """(b,) each row's key end after the call: its keys are leftpad .. ends - 1."""
        return self.seqlens + self.new

    @property
    def width(self) -> int:
        """The most keys a row reaches: the dense equivalent's key length j (at least 1)."""
        return max(1, int(self.ends.max()))


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's ``flash_attn_with_kvcache``: append new keys to a caller's cache, in place, and attend over it.

    **Layout.** The arguments are FlashAttention's, in its layout, **batch, seq, heads, dim**: q (b, s, h, d), the
    caches (b_cache, L, g, d) and (b_cache, L, g, e), or with a ``block_table`` page pools (P, page, g, d) and
    (P, page, g, e). multihead's kernels take (batch, heads, seq, dim): the call converts at this boundary (views
    of q and the caches, no copy) and returns the output as (b, s, h, e).

    Args:
        q: (b, s, h, d) queries; h % g == 0 (GQA).
        k_cache, v_cache: the caller's cache, written in place where ``k`` and ``v`` go.
        k, v: (b, s_new, g, d) and (b, s_new, g, e) new keys and values (both or neither), written at positions
            cache_seqlens[b] .. cache_seqlens[b] + s_new - 1 of each row's cache (after rotary) before attending.
        rotary_cos, rotary_sin: (seqlen_ro, r / 2) tables, r <= d: the first r dims of q and k are rotated, pairs
            (0, 1), (2, 3), ... with ``rotary_interleaved`` (GPT-J), else (m, m + r / 2) (GPT-NeoX). k at positions
            cache_seqlens[b] + t; q there too when causal or with a window, else every query at cache_seqlens[b].
            Only with k and v.
        cache_seqlens: int or (b,) ints: keys each row holds (None: the whole cache; then no k and v).
        cache_batch_idx: (b,) ints: the cache row each batch row uses (None: row b); distinct when writing.
        cache_leftpad: (b,) ints: each row's keys start there (None: 0); keys before it are not attended.
        block_table: (b, M) ints: the pool pages of each row, in order (a paged cache).
        softmax_scale: multiplies q k^T; default 1/sqrt(d).
        causal, window_size: FlashAttention's bottom-right alignment, per row: query t of row b sits at key position
            p = cache_seqlens[b] + s_new - s + t; causal keeps keys <= p, window_size (left, right) keys
            p - left .. p + right (-1 unbounded; with causal, right is 0)::

                s = 2, a row of 5 keys, causal    1 1 1 1 0
                                                  1 1 1 1 1

            A row whose band holds none of its keys gives output 0 and LSE -inf (FlashAttention 2 writes +inf).
        softcap: cap the scaled scores to cap * tanh(s / cap) (0: none).
        alibi_slopes: (h,) or (b, h): -slope * |p - j| added to the score of key j.
        num_splits: 0 only (the backend decides how it walks the keys; FlashAttention's split count is refused).
        return_softmax_lse: also return the log-sum-exp (b, h, s).
        backend: as for :func:`multihead.attention` ("auto": a paged cache read in place by the ``paged`` backend
            where the call needs only causal and a left window, else the keys gathered).

    Returns:
        out (b, s, h, e), and with ``return_softmax_lse`` (out, lse (b, h, s)).

    Everything is checked before the cache is written (the index tensors are read on the host: a device's are
    copied there once, a wait), and a call that raises after writing puts back what it overwrote: a failed call
    leaves the cache as it was. Gradients reach q and the slopes; new keys or values that need one are refused
    (their path runs through the caller's cache, written in place), as is a cache that needs one.

    Raises:
        ValueError or TypeError naming the argument: shapes, dtypes, devices, indices, and every option not served
        (a nonzero num_splits).

    Example:
        >>> k_cache, v_cache = torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8)  # (b, L, g, d)
        >>> q, k, v = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
        >>> out = attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([3, 5]), causal=True)
        >>> out.shape, bool(k_cache[1, 5].eq(k[1, 0]).all())
        (torch.Size([2, 1, 4, 8]), True)
    """
    indices = dict(cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad)
    options = dict(causal=causal, window_size=window_size, softcap=softcap, num_splits=num_splits)
    lse_flag = dict(return_softmax_lse=return_softmax_lse)
    call = _checked_kv_call(q, k_cache, v_cache, k, v, **indices, block_table=block_table, **options, **lse_flag)
    _check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, k, call)
    scale = _checked_scale(softmax_scale)
    slopes = None if alibi_slopes is None else _checked_slopes(alibi_slopes, q)
    if rotary_cos is not None and rotary_sin is not None and k is not None:
        q, k = _turned(call, q, k, rotary_cos, rotary_sin, rotary_interleaved)
    saved = None if k is None or v is None else _write(call, k_cache, v_cache, k, v)
    try:
        out, lse = _attend_over_cache(call, q, k_cache, v_cache, scale, slopes, return_softmax_lse, backend)
    except BaseException:
        if saved is not None:  # put back what the call overwrote: a failed call leaves the cache as it was
            _restore(k_cache, v_cache, saved)
        raise
    if return_softmax_lse:
        assert lse is not None  # asked for: every backend serving the call returned it
        return out, lse
    return out


def _checked_kv_call(
    q,
    k_cache,
    v_cache,
    k,
    v,
    *,
    cache_seqlens,
    cache_batch_idx,
    cache_leftpad,
    block_table,
    causal,
    window_size,
    softcap,
    num_splits,
    return_softmax_lse,
) -> _KVCall:
    """Every check of :func:`attention_with_kvcache`'s tensors and options but rotary's, before anything is written."""
    paged = block_table is not None
    _check_kv_tensors(q, k_cache, v_cache, paged)
    b = q.shape[0]
    rows_of_cache, length = k_cache.shape[0], k_cache.shape[1]  # (b_cache, L) or (P, page)
    new = _check_new_kv(k, v, q, k_cache, v_cache)
    for name, flag in (("causal", causal), ("return_softmax_lse", return_softmax_lse)):
        checked_flag(name, flag)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits != 0:
        raise bad_argument(
            "num_splits",
            "0 (the backend decides how it walks the keys)",
            describe(num_splits),
            "drop num_splits: multihead's backends choose their own blocks (a split count is not served)",
        )
    table = None
    if paged:
        if cache_batch_idx is not None:
            raise bad_argument(
                "cache_batch_idx",
                "None with a block_table (the table says which pages each row reads)",
                describe(cache_batch_idx),
                "drop cache_batch_idx, and order the block table's rows as q's",
            )
        table = _host_indices("block_table", block_table, (b, None), "(b, max_pages) page indices per row")
    capacity = length * (table.shape[1] if table is not None else 1)
    seqlens = _checked_seqlens(cache_seqlens, b, capacity, new, paged)
    rows = None
    if cache_batch_idx is not None:
        rows = _host_indices("cache_batch_idx", cache_batch_idx, (b,), "(b,) cache rows, one per batch row")
        _check_range(
            "cache_batch_idx",
            rows,
            0,
            rows_of_cache,
            f"rows of the cache (b_cache = {rows_of_cache})",
            "give the cache row each batch row reads",
        )
        if new and len(set(rows.tolist())) != b:
            raise bad_argument(
                "cache_batch_idx",
                "distinct rows when k and v are written (two batch rows would write one cache row)",
                rows.tolist(),
                "give each batch row its own cache row",
            )
    elif not paged and rows_of_cache != b:
        raise bad_argument(
            "k_cache",
            f"b_cache = {b} rows (q's batch), or cache_batch_idx to choose {b} of them",
            rows_of_cache,
            "pass cache_batch_idx with the cache row of each batch row",
        )
    leftpad = torch.zeros(b, dtype=torch.long)
    if cache_leftpad is not None:
        leftpad = _host_indices("cache_leftpad", cache_leftpad, (b,), "(b,) each row's first key")
        over = (leftpad < 0) | (leftpad > seqlens)
        if bool(over.any()):
            row = int(over.nonzero()[0])
            raise bad_argument(
                "cache_leftpad",
                f"0 <= cache_leftpad[b] <= cache_seqlens[b] (row {row} holds {int(seqlens[row])} keys)",
                f"cache_leftpad[{row}] = {int(leftpad[row])}",
                "give each row the index its keys start at",
            )
    band = _kv_band(causal, window_size)
    call = _KVCall(paged, length, seqlens, leftpad, rows, table, new, band, _checked_softcap(softcap))
    if table is not None:
        _check_table(call, rows_of_cache)
    return call


def _check_kv_tensors(q: object, k_cache: object, v_cache: object, paged: bool) -> None:
    """q (b, s, h, d) and the caches (b_cache, L, g, d), (b_cache, L, g, e), or pools (P, page, g, .) when paged."""
    q = tensor_argument("q", q, fix="pass q as a tensor (b, s, h, d)")
    if q.ndim != 4 or 0 in q.shape:
        raise bad_argument(
            "q", "shape (b, s, h, d), every size at least 1 (FlashAttention's layout)", describe(q), "add the axes"
        )
    floating_argument("q", q)
    layout = "(P, page, g, {x}) page pools" if paged else "(b_cache, L, g, {x})"
    for name, cache, last in (("k_cache", k_cache, "d"), ("v_cache", v_cache, "e")):
        cache = tensor_argument(name, cache, fix=f"pass {name} as a tensor {layout.format(x=last)}")
        matching(name, cache, q, "q", fix=f"convert with {name}.to(q): q and the cache in one dtype on one device")
        if cache.ndim != 4 or 0 in cache.shape:
            raise bad_argument(
                name, f"shape {layout.format(x=last)}, every size at least 1", describe(cache), "pass the cache"
            )
    assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise bad_argument(
            "v_cache",
            f"its first three sizes {tuple(k_cache.shape[:3])} (k_cache's)",
            tuple(v_cache.shape[:3]),
            "pass the value cache of the same cache",
        )
    h, d, g = q.shape[2], q.shape[3], k_cache.shape[2]
    if h % g != 0:
        raise bad_argument("k_cache", f"g key/value heads dividing h = {h}", f"g = {g}", "use a cache of fitting heads")
    if k_cache.shape[3] != d:
        raise bad_argument("k_cache", f"head dim d = {d} (from q)", k_cache.shape[3], "use a cache of fitting dims")


def _check_new_kv(k: object, v: object, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """k (b, s_new, g, d) and v (b, s_new, g, e), both or neither; returns s_new (0 for neither)."""
    if (k is None) != (v is None):
        raise bad_argument(
            "k" if k is None else "v", "k and v together, or neither", "one of them", "pass both new keys and values"
        )
    if k is None:
        return 0
    b, g = q.shape[0], k_cache.shape[2]
    for name, t, cache, last in (("k", k, k_cache, "d"), ("v", v, v_cache, "e")):
        layout = f"(b, s_new, g, {last}) = ({b}, s_new, {g}, {cache.shape[3]})"
        t = tensor_argument(name, t, fix=f"pass {name} as a tensor {layout}")
        matching(name, t, q, "q", fix=f"convert with {name}.to(q)")
        if t.ndim != 4 or t.shape[0] != b or t.shape[2] != g or t.shape[3] != cache.shape[3] or t.shape[1] < 1:
            raise bad_argument(name, f"shape {layout} with s_new >= 1", describe(t), "one entry per new token")
        if t.requires_grad and torch.is_grad_enabled():
            raise bad_argument(
                name,
                "new keys and values that need no gradient (they are written into the caller's cache in place)",
                f"{name}.requires_grad = True",
                f"pass {name}.detach(), or call under torch.no_grad()",
            )
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.requires_grad:
            raise bad_argument(
                name,
                "a cache that needs no gradient (k and v are written into it in place)",
                "requires_grad=True",
                f"pass {name}.detach()",
            )
    assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if v.shape[1] != k.shape[1]:
        raise bad_argument("v", f"s_new = {k.shape[1]} new tokens (from k)", v.shape[1], "give both s_new tokens")
    return k.shape[1]


def _host_indices(name: str, values: object, shape: tuple[int | None, ...], layout: str) -> torch.Tensor:
    """An integer tensor of ``shape`` (None: any size) as int64 on the host: a device's values are copied once."""
    if not isinstance(values, torch.Tensor) or values.dtype not in (torch.int32, torch.int64):
        raise bad_argument(
            name,
            f"an int32 or int64 tensor {layout}",
            describe(values),
            "pass e.g. torch.tensor([...])",
            kind=TypeError,
        )
    if values.ndim != len(shape) or any(want not in (None, got) for want, got in zip(shape, values.shape, strict=True)):
        wanted = tuple("n" if want is None else want for want in shape)
        raise bad_argument(name, f"shape {wanted}: {layout}", tuple(values.shape), "one entry per batch row")
    return values.detach().to("cpu", torch.long)


def _check_range(name: str, values: torch.Tensor, low: int, high: int, what: str, fix: str) -> None:
    """Every entry in [low, high) (``what`` they are), else the first one out, named."""
    out = (values < low) | (values >= high)
    if bool(out.any()):
        at = tuple(int(n) for n in out.nonzero()[0])
        place = ", ".join(str(n) for n in at)
        raise bad_argument(name, f"entries in [{low}, {high}): {what}", f"{name}[{place}] = {int(values[at])}", fix)


def _checked_seqlens(seqlens: object, b: int, capacity: int, new: int, paged: bool) -> torch.Tensor:
    """cache_seqlens as (b,) host int64, each row's keys before the call plus the new ones within ``capacity``."""
    if seqlens is None:
        if new:
            raise bad_argument(
                "cache_seqlens",
                "the keys each row holds, where the new keys go (with k and v)",
                None,
                "pass cache_seqlens=torch.tensor([...]) (or an int for every row)",
            )
        return torch.full((b,), capacity, dtype=torch.long)
    if isinstance(seqlens, int) and not isinstance(seqlens, bool):
        lengths = torch.full((b,), seqlens, dtype=torch.long)
    else:
        lengths = _host_indices("cache_seqlens", seqlens, (b,), "(b,) keys each row holds, or an int")
    room = "the cache length L" if not paged else "the pages of its block table times page"
    over = (lengths < 0) | (lengths + new > capacity)
    if bool(over.any()):
        row = int(over.nonzero()[0])
        raise bad_argument(
            "cache_seqlens",
            f"0 <= cache_seqlens[b] and cache_seqlens[b] + s_new <= {capacity} ({room}; s_new = {new})",
            f"cache_seqlens[{row}] = {int(lengths[row])}",
            "build the cache with room for the new keys, or pass each row's own length",
        )
    return lengths


def _check_table(call: _KVCall, pages: int) -> None:
    """The block table's pages of every key a row reaches (its own keys, and up to the call's width for the
    gathered equivalent) are pool pages, and no two new keys land in one slot."""
    assert call.table is not None
    columns = -(-call.width // call.page_size)  # the columns any row's keys reach
    reached = call.table[:, :columns]
    _check_range(
        "block_table",
        reached,
        -1,
        pages,
        f"pages of the pool (P = {pages}), or -1 for none",
        "give each row the pool pages of its keys",
    )
    own = torch.arange(columns)[None, :] * call.page_size < call.ends[:, None]  # (b, columns): pages of own keys
    missing = own & (reached < 0)
    if bool(missing.any()):
        row, column = (int(n) for n in missing.nonzero()[0])
        raise bad_argument(
            "block_table",
            f"a page for every key of each row (row {row} reaches key {int(call.ends[row]) - 1})",
            f"block_table[{row}, {column}] = -1",
            "give the table a pool page for each page of keys a row holds",
        )
    if call.new:
        pages_written, slots = _paged_slots(call)
        flat = pages_written * call.page_size + slots
        if flat.unique().numel() != flat.numel():
            raise bad_argument(
                "block_table",
                "rows whose new keys land in distinct slots of the pool",
                "two rows writing one page slot",
                "give each row its own pages for the keys it appends",
            )


def _kv_band(causal: bool, window_size: object) -> tuple[int | None, int | None]:
    """(left, right) around each query's aligned position from causal and FlashAttention's window_size (-1:
    unbounded; causal makes right 0, as FlashAttention does)."""
    if not (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(isinstance(side, int) and not isinstance(side, bool) and side >= -1 for side in window_size)
    ):
        raise bad_argument(
            "window_size",
            "(left, right): ints >= 0, or -1 for an unbounded side",
            describe(window_size),
            "pass e.g. window_size=(255, 0), or (-1, -1) for none",
        )
    left, right = (None if side == -1 else side for side in window_size)
    return left, 0 if causal else right


def _checked_softcap(softcap: object) -> float | None:
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool) or not math.isfinite(softcap) or softcap < 0:
        raise bad_argument(
            "softcap",
            "a finite number >= 0 (0: no soft-cap)",
            describe(softcap),
            "pass e.g. softcap=50.0, or 0.0 for none",
            kind=TypeError if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool) else ValueError,
        )
    cap = float(softcap)
    return cap if cap > 0 else None


def _checked_scale(scale: object) -> float | None:
    if scale is None:
        return None
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale):
        raise bad_argument(
            "softmax_scale",
            "a finite real number, or None (1/sqrt(d))",
            describe(scale),
            "pass a float",
            kind=TypeError if not isinstance(scale, numbers.Real) or isinstance(scale, bool) else ValueError,
        )
    return float(scale)


def _checked_slopes(slopes: object, q: torch.Tensor) -> torch.Tensor:
    """ALiBi's (h,) or (b, h) slopes as the (b or 1, h, 1) table, on q's device."""
    b, h = q.shape[0], q.shape[2]
    slopes = checked_slope_tensor("alibi_slopes", slopes, b, h, "b", fix="use multihead.masks.alibi_slopes(h)")
    matching("alibi_slopes", slopes, q, "q", fix="move the slopes with .to(q.device)", check_dtype=False)
    return slope_table("alibi_slopes", slopes, b, h, "batch row", "b")


def _check_rotary(cos: object, sin: object, interleaved: object, q: torch.Tensor, k: object, call: _KVCall) -> None:
    """rotary_cos and rotary_sin (seqlen_ro, r / 2), both or neither, with k and v, covering every position turned."""
    checked_flag("rotary_interleaved", interleaved)
    if cos is None and sin is None:
        return
    if cos is None or sin is None:
        raise bad_argument(
            "rotary_cos" if cos is None else "rotary_sin",
            "rotary_cos and rotary_sin together",
            "one of them",
            "pass both tables, or neither",
        )
    if k is None:
        raise bad_argument(
            "rotary_cos",
            "rotary tables only with new keys k and v (they turn q and the new k)",
            "no k",
            "pass k and v, or rotate q yourself",
        )
    d, shape = q.shape[3], None
    for name, table in (("rotary_cos", cos), ("rotary_sin", sin)):
        table = tensor_argument(name, table, fix=f"pass {name} as a tensor (seqlen_ro, r / 2)")
        floating_argument(name, table)
        matching(name, table, q, "q", fix=f"move it with {name}.to(q.device)", check_dtype=False)
        shape = shape or tuple(table.shape)  # rotary_cos's: rotary_sin must have it too
        if table.ndim != 2 or table.shape[1] < 1 or 2 * table.shape[1] > d or tuple(table.shape) != shape:
            raise bad_argument(
                name,
                f"shape (seqlen_ro, r / 2) with 2 <= r <= d = {d}, the same for rotary_cos and rotary_sin",
                describe(table),
                "pass the tables of the rotated dims",
            )
    assert isinstance(cos, torch.Tensor)
    turned = max(call.new, q.shape[1] if call.turns_each_query else 1)  # positions from each row's length on
    highest = int((call.seqlens + turned - 1).max())
    if highest >= cos.shape[0]:
        raise bad_argument(
            "rotary_cos",
            f"a row for every position turned, up to {highest} (seqlen_ro > {highest})",
            f"{cos.shape[0]} rows",
            "build the tables for the cache's length",
        )


def _rotated(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x (b, n, heads, d) with its first r dims turned by the angles of ``positions`` (b, n) (rows of the tables
    (seqlen_ro, r / 2)), computed in at least float32 and rounded once into x's dtype."""
    half = cos.shape[1]
    work = torch.promote_types(x.dtype, torch.float32)
    at = to_device(positions, cos.device)
    c, s = (t[at].to(work)[:, :, None, :] for t in (cos, sin))  # (b, n, 1, r / 2)
    turned, rest = x[..., : 2 * half].to(work), x[..., 2 * half :]
    if interleaved:  # pairs (2m, 2m + 1): GPT-J
        first, second = turned[..., 0::2], turned[..., 1::2]
        pairs = torch.stack((first * c - second * s, second * c + first * s), dim=-1)  # (b, n, heads, r / 2, 2)
        out = pairs.flatten(-2)
    else:  # pairs (m, m + r / 2): GPT-NeoX
        first, second = turned[..., :half], turned[..., half:]
        out = torch.cat((first * c - second * s, second * c + first * s), dim=-1)
    return torch.cat((out.to(x.dtype), rest), dim=-1)


def _turned(
    call: _KVCall, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, s, h, d) and the new k (b, s_new, g, d) with rotary applied, as FlashAttention turns them: k at each
    row's next positions; q there too with a band (causal or a window), else every query at the row's first."""
    at = call.seqlens[:, None] + torch.arange(q.shape[1])[None, :]  # (b, s): q's positions
    if not call.turns_each_query:
        at = call.seqlens[:, None].expand(-1, q.shape[1])
    new = call.seqlens[:, None] + torch.arange(k.shape[1])[None, :]  # (b, s_new)
    return _rotated(q, cos, sin, at, interleaved), _rotated(k, cos, sin, new, interleaved)


def _paged_slots(call: _KVCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool page and slot of each new key, (b, s_new) each, on the host."""
    assert call.table is not None
    at = call.seqlens[:, None] + torch.arange(call.new)[None, :]  # (b, s_new) positions
    return call.table.gather(1, at // call.page_size), at % call.page_size


def _write(call: _KVCall, k_cache, v_cache, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """k (b, s_new, g, d) and v into the caches at each row's next positions, in place; returns where they went
    and what they overwrote (to put back if the call fails)."""
    device = k_cache.device
    if call.paged:
        first, second = _paged_slots(call)
    else:
        rows = call.rows if call.rows is not None else torch.arange(len(call.seqlens))
        first = rows[:, None].expand(-1, call.new)  # (b, s_new) cache rows
        second = call.seqlens[:, None] + torch.arange(call.new)[None, :]  # (b, s_new) positions
    index = (to_device(first, device), to_device(second, device))
    saved = (index, k_cache[index].clone(), v_cache[index].clone())
    k_cache[index] = k  # (b, s_new, g, d) into the slots: one write of every new key
    v_cache[index] = v
    return saved


def _restore(k_cache: torch.Tensor, v_cache: torch.Tensor, saved: tuple) -> None:
    index, keys, values = saved
    k_cache[index] = keys
    v_cache[index] = values


def _attend_over_cache(
    call: _KVCall, q, k_cache, v_cache, scale, slopes, need_lse: bool, backend: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention of q (b, s, h, d) over each row's keys leftpad .. ends - 1: output (b, s, h, e) and LSE."""
    device, s = q.device, q.shape[1]
    queries = q.transpose(1, 2)  # (b, s, h, d) -> (b, h, s, d): a view
    ends = to_device(call.ends, device)
    positions = key_range_positions(ends, s)  # (b, s): each query's aligned key position
    left, right = call.band
    options = dict(scale=scale, backend=backend, return_lse=need_lse)
    in_place = call.paged and slopes is None and call.cap is None and not bool(call.leftpad.any())
    if call.table is not None:
        pools = [cache.permute(0, 2, 1, 3) for cache in (k_cache, v_cache)]  # (P, page, g, x) -> (P, g, page, x)
        table = PageTable(
            tables=to_device(call.table, device),
            first_slots=torch.zeros(len(call.seqlens), dtype=torch.long, device=device),
            key_ends=ends,
            positions=positions,
            width=call.width,
            window=None if left is None else left + 1,  # keys after p - (left + 1): p - left onwards
        )
        if in_place and right in (None, 0):  # the table says all: the paged backend reads the pages in place
            result = attention_result(queries, *pools, causal=right == 0, pages=table, **options)
            return _flash_layout(result)
        keys, values = table.gather(pools[0]), table.gather(pools[1])  # (b, g, width, x)
    else:
        rows = None if call.rows is None else to_device(call.rows, device)  # a gather copies width keys a row
        caches = [c[:, : call.width] if rows is None else c[rows, : call.width] for c in (k_cache, v_cache)]
        keys, values = (c.permute(0, 2, 1, 3) for c in caches)  # (b, width, g, x) -> (b, g, width, x)
    mask = key_ranges(call.leftpad, call.ends, call.band)
    if slopes is not None:
        mask = mask & aligned_alibi(slopes, positions)
    if call.cap is not None:
        mask = mask & capped_scores(call.cap)
    return _flash_layout(attention_result(queries, keys, values, mask=mask, **options))


def _flash_layout(result: AttentionResult) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An attention result's output (b, h, s, e) as FlashAttention's (b, s, h, e), and its LSE (b, h, s)."""
    return result.output.transpose(1, 2), result.lse
