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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from multihead._errors import bad_argument, describe, positive_int
from multihead._inputs import matching, tensor_argument
from multihead._limits import check_fits
from multihead.backends.paged import PageTable
from multihead.cache import check_fitting, checked_layout
from multihead.masks import to_device

__all__ = ["PagedKVCache", "PagedBatch", "PagedPending"]


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

    def batch(self, handles: list[int]) -> PagedBatch:
        """A view of some sequences, one per batch row, to pass a layer as its ``cache``."""
        if not isinstance(handles, (list, tuple)) or not handles:
            raise bad_argument(
                "handles", "a non-empty list of sequence handles", describe(handles), "pass e.g. [cache.add()]"
            )
        if len(set(handles)) != len(handles):
            raise bad_argument("handles", "each sequence once", list(handles), "drop the repeated handles")
        for handle in handles:
            self._sequence("handles", handle)
        return PagedBatch(self, list(handles))

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


class PagedBatch:
    """Sequences of a :class:`PagedKVCache`, one per batch row: what a layer takes as ``cache`` for them."""

    def __init__(self, cache: PagedKVCache, handles: list[int]):
        self.cache, self.handles = cache, handles

    @property
    def window(self) -> int | None:
        return self.cache.window

    def positions(self, new: int, device: torch.device) -> torch.Tensor:
        """(S, new): the positions of each sequence's next ``new`` tokens (rotary reads them)."""
        seen = torch.tensor([self.cache._sequences[h].seen for h in self.handles], dtype=torch.long)
        return to_device(seen[:, None] + torch.arange(new), torch.device(device))

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
        device = cache.keys.device
        page_index = to_device(padded.gather(1, offsets // cache.page_size), device)  # (S, n): sent unwaited
        slot_index = to_device(offsets % cache.page_size, device)
        # keys (S, g, n, d) -> pool[page, :, slot]: one write of every new key
        cache.keys[page_index, :, slot_index] = keys.permute(0, 2, 1, 3)
        cache.values[page_index, :, slot_index] = values.permute(0, 2, 1, 3)
        held = PageTable(
            tables=to_device(padded, device),
            first_slots=to_device(torch.tensor(firsts, dtype=torch.long), device),
            key_ends=to_device(torch.tensor([s.seen + new for s in sequences], dtype=torch.long), device),
            positions=self.positions(new, device),
            width=max(s.seen + new - first for s, first in zip(sequences, firsts, strict=True)),
            window=cache.window,
        )
        return PagedPending(self, new, reserved, held, state)

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
