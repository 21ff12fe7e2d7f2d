"""The paged backend: attention of S sequences' new queries over keys held in a page pool, read in place through a
block table (vLLM's PagedAttention, FlashAttention's ``block_table``).

A paged call is ``attention(q, key_pool, value_pool, pages=PageTable(...))``: q (S, h, i, d), the pools
(P, g, page, d) and (P, g, page, e), and a :class:`PageTable` saying which pages hold each sequence's keys. Its
dense equivalent is the call over each sequence's keys gathered in order, (S, g, width, d), with the mask
:meth:`PageTable.keeps` (column c of row s is the key at position ``first_slots[s] + c``): that is how every other
backend serves a paged call, how the weights of a paged call are computed, and what the paged kernel is tested
against. The kernel gathers a sequence's whole cache only where it holds up to :data:`FUSED_READ_KEYS` keys (one
call of torch's fused kernel); past that, and for the log-sum-exp, it reads a few columns of pages at a time (about
:data:`KEYS_PER_STEP` keys of every sequence) with an online softmax. A decode step whose sequences are all at one
length (the table's rule "every key"), in float32 with no gradient wanted, reads the pages where they lie on
multihead's native kernel (:func:`multihead.backends.native.paged_forward`) instead of gathering them: an attention
call of 8 heads over 2 key/value heads (d = 64, pages of 16) took 62 us against 151 over 200 keys, and 167 against
286 over 2,000 (one sequence, 2-core AVX-512 EPYC).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.nn.functional as F

from multihead._errors import bad_argument, describe, positive_int
from multihead._inputs import tensor_argument
from multihead.backends import native
from multihead.backends.precision import compute_dtype
from multihead.backends.registry import AttentionCall, BackendOutput, Capabilities
from multihead.backends.sdpa import VERIFIED_EMPTY_ROW_DEVICES
from multihead.masks import Mask, custom, host_readable

__all__ = ["PageTable", "KEYS_PER_STEP", "FUSED_READ_KEYS", "CAPABILITIES", "paged_attention_backend"]

KEYS_PER_STEP = 256  # keys of each sequence the kernel reads per step (whole pages): few steps, bounded memory
FUSED_READ_KEYS = 2048  # a table of up to this many keys a sequence is read at once, into torch's fused kernel
DERIVED_KEPT = 16  # what a table keeps derived from it (checks, bound masks, read plans) before starting afresh

Derived = TypeVar("Derived")


class KeptValues:
    """Values made once by key and kept, at most ``limit`` of them (past it, the kept ones are dropped): what a
    page table derives, and a decode step's append plan shared by the layers of one model."""

    def __init__(self, limit: int = DERIVED_KEPT):
        self.limit = limit
        self._values: dict[object, object] = {}

    def get(self, key: object, make: Callable[[], Derived]) -> Derived:
        """The value kept for ``key``, else ``make()`` kept (nothing is kept when it raises). Read once, so a
        thread that clears the values meanwhile cannot make another's lookup fail."""
        value = self._values.get(key, _MISSING)
        if value is _MISSING:
            value = make()
            if len(self._values) >= self.limit:
                self._values.clear()
            self._values[key] = value
        return value  # type: ignore[return-value]  # kept under its key by this method only


_MISSING = object()


@dataclass(frozen=True)
class PageTable:
    """Where S sequences' keys sit in a page pool, and where their new queries sit.

    ``tables`` (S, M): pool pages of each sequence in order, -1 past its last; ``first_slots`` (S,): the position
    of the first key of table column 0 (pages dropped before it by a window); ``key_ends`` (S,): keys
    first_slots[s] .. key_ends[s] - 1 exist; ``positions`` (S, i): the queries' positions; ``width``: the most keys
    any sequence holds, max(key_ends - first_slots), known on the host (the dense equivalent's key length j);
    ``window``: a query at position p sees keys after p - window only (None: every key).
    """

    tables: torch.Tensor
    first_slots: torch.Tensor
    key_ends: torch.Tensor
    positions: torch.Tensor
    width: int
    window: int | None = None
    # what is derived from the table (its key-end check, its dense mask bound to a call, the kernel's read plan),
    # kept by what its tensors hold: every layer of a decode step attends through one table, and each would
    # otherwise redo these host-side steps (a third of a paged layer call's time)
    _derived: KeptValues = field(default_factory=KeptValues, init=False, repr=False, compare=False)

    def derived(self, what: tuple, make: Callable[[], Derived]) -> Derived:
        """``make()``, computed once for this table as its tensors now hold (``what`` names it, with what else it
        depends on): kept by the tensors' version counters, so a table changed in place is derived afresh. Under
        inference mode (no version counters), while torch.compile traces, or for a field that is no tensor (refused
        by the check ``make`` runs), computed on every call."""
        tensors = (self.tables, self.first_slots, self.key_ends, self.positions)
        kept = all(isinstance(t, torch.Tensor) and not t.is_inference() for t in tensors)
        if not kept or torch.compiler.is_compiling():
            return make()
        return self._derived.get((what, tuple(t._version for t in tensors)), make)

    def check(self, q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor) -> None:
        """Raise unless q (S, h, i, d) and the pools (P, g, page, d), (P, g, page, e) fit this table (shapes only:
        nothing is read from a device). Once passed, kept for these shapes and devices (:meth:`derived`)."""
        fits = (tuple(q.shape), q.device, tuple(key_pool.shape), tuple(value_pool.shape), key_pool.device)
        self.derived(("fits", fits), lambda: self._check_fit(q, key_pool, value_pool))

    def _check_fit(self, q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor) -> None:
        if q.ndim != 4:
            raise bad_argument(
                "q", "shape (S, h, i, d) for a paged call", f"shape {tuple(q.shape)}", "give one row per sequence"
            )
        s, h, i, d = q.shape
        for name, pool, last in (("k", key_pool, "d"), ("v", value_pool, "e")):
            if pool.ndim != 4:
                raise bad_argument(
                    name,
                    f"a page pool (P, g, page, {last}) for a paged call",
                    f"shape {tuple(pool.shape)}",
                    "pass the cache's pools (cache.keys, cache.values)",
                )
        if tuple(value_pool.shape[:3]) != tuple(key_pool.shape[:3]):
            raise bad_argument(
                "v",
                f"(P, g, page) = {tuple(key_pool.shape[:3])} (from k)",
                tuple(value_pool.shape[:3]),
                "pass the value pool of the same cache",
            )
        g, page = key_pool.shape[1], key_pool.shape[2]
        if h % g != 0:
            raise bad_argument("k", f"g key/value heads dividing h = {h}", f"g = {g}", "use a pool of fitting heads")
        if key_pool.shape[3] != d:
            raise bad_argument("k", f"head dim d = {d} (from q)", key_pool.shape[3], "use a pool of fitting dims")
        layouts = (
            ("pages.tables", self.tables, 2, s),
            ("pages.first_slots", self.first_slots, 1, s),
            ("pages.key_ends", self.key_ends, 1, s),
            ("pages.positions", self.positions, 2, s),
        )
        for name, t, ndim, rows in layouts:
            t = tensor_argument(name, t)
            if t.dtype not in (torch.int32, torch.int64) or t.ndim != ndim or t.shape[0] != rows:
                raise bad_argument(
                    name,
                    f"an integer tensor of {ndim} dims with S = {rows} rows (one per sequence of q)",
                    describe(t),
                    "build the table from a paged cache (cache.batch(handles).stage(...).pages)",
                )
            if t.device != q.device:
                raise bad_argument(
                    name, f"a tensor on {q.device} (q's device)", str(t.device), "move it with .to(q.device)"
                )
        if self.positions.shape[1] != i:
            raise bad_argument(
                "pages.positions", f"shape (S, i) = ({s}, {i})", tuple(self.positions.shape), "one per query"
            )
        columns = self.tables.shape[1] * page
        width = positive_int("pages.width", self.width)
        if width > columns:
            raise bad_argument(
                "pages.width",
                f"at most the {columns} keys the table's {self.tables.shape[1]} columns of {page} hold",
                width,
                "pass the most keys any sequence holds",
            )
        if self.window is not None:
            positive_int("pages.window", self.window)
        self._check_key_ends(page)

    def _check_key_ends(self, page: int) -> None:
        """Raise where a sequence's keys (first_slots[s] .. key_ends[s] - 1) run past what the table holds: past
        ``width``, or into a column of -1 (no page). Read only where the table's values are on the host (CPU
        tensors): a device's table is never waited for, as a padding mask's lengths are not."""
        tables, first, ends = self.tables, self.first_slots, self.key_ends
        if not all(host_readable(t) for t in (tables, first, ends)):
            return
        # as Python ints: a decode step's table is a few rows of a few pages, where a dozen tensor ops per check
        # cost 90 us of every layer's call and these loops a few
        for s, (row, start, end) in enumerate(zip(tables.tolist(), first.tolist(), ends.tolist(), strict=True)):
            held = end - start  # the keys of sequence s
            if held < 0:
                raise bad_argument(
                    "pages.key_ends",
                    "key_ends[s] >= first_slots[s] (a sequence holds no fewer than 0 keys)",
                    f"key_ends[{s}] = {end} below first_slots[{s}] = {start}",
                    "pass each sequence's end of keys (its length)",
                )
            leading = next((column for column, held_page in enumerate(row) if held_page < 0), len(row))
            room = min(leading * page, self.width)  # the keys its pages before its first -1 hold, within width
            if held > room:
                raise bad_argument(
                    "pages.key_ends",
                    f"at most the keys sequence {s}'s table holds: {room} ({leading} pages of {page} before its "
                    f"first -1, and width {self.width})",
                    f"key_ends[{s}] - first_slots[{s}] = {held}",
                    "give the table a page for every key (or a larger width), or a key end within it",
                )

    def gather(self, pool: torch.Tensor) -> torch.Tensor:
        """Each sequence's keys (or values) in order: (P, g, page, x) -> (S, g, width, x); column c holds the key at
        position first_slots[s] + c (past a sequence's own keys, whatever its padding pages hold: masked)."""
        page = pool.shape[2]
        columns = self.tables[:, : math.ceil(self.width / page)].clamp(min=0)  # (S, C): -1 reads page 0, masked
        return pages_in_order(pool, columns)[:, :, : self.width]

    def dense_rule(self, causal: bool) -> str | None:
        """What the dense equivalent's mask comes down to, where the table's values on the host say so:

        - ``"every key"``: every query sees key columns 0 .. width - 1 of its row (sequences of one length, each
          query at or past its last key, within the window: a decode step in step);
        - ``"causal"``: with ``causal``, a prefill: every sequence holds ``width`` keys from its first slot and its
          ``width`` queries sit at their positions in order, with no window that hides any (a causal square);
        - None: a mask is needed, and always for a device's table (its values are never waited for).
        """
        return self.derived(("dense rule", causal), lambda: self._dense_rule(causal))

    def _dense_rule(self, causal: bool) -> str | None:
        tensors = (self.first_slots, self.key_ends, self.positions)
        if not all(host_readable(t) for t in tensors):
            return None
        rows = list(zip(*(t.tolist() for t in tensors), strict=True))  # (first, end, [positions]) per sequence
        if any(end - first != self.width for first, end, _ in rows):  # a shorter sequence: its last columns masked
            return None
        window = self.window
        if all(
            (not causal or min(at) >= end - 1) and (window is None or max(at) - window < first)
            for first, end, at in rows
        ):
            return "every key"  # no query before its row's last key, no key out of a window
        in_order = all(at == list(range(first, end)) for first, end, at in rows)
        if causal and in_order and (window is None or self.width <= window):
            return "causal"
        return None

    def keeps(self, causal: bool) -> Mask:
        """The mask of the dense equivalent over (S, h, i, width): key column c of row s (position first_slots[s]
        + c) exists, and with ``causal`` is at or before the query's position, within the window if any."""
        first, end, at, window = self.first_slots, self.key_ends, self.positions, self.window

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            position = first[b] + kv
            keep = position < end[b]
            if causal:
                keep = keep & (position <= at[b, q])
            if window is not None:
                keep = keep & (position > at[b, q] - window)
            return keep

        # no block rule: the positions are the caller's, in any order; this mask serves the weights and the
        # backends that gather, which read every pair of the call anyway
        return custom(mask_mod)

    def dense(
        self, key_pool: torch.Tensor, value_pool: torch.Tensor, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Mask]:
        """The dense equivalent of a paged call over these pools: keys (S, g, width, d), values (S, g, width, e)
        and the mask (causal included) with which ``attention`` over them gives the paged call's output."""
        return self.gather(key_pool), self.gather(value_pool), self.keeps(causal)


def pages_in_order(pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """The keys (or values) of pool pages ``pages`` (S, C) (each >= 0), each row's in order: (P, g, page, x) ->
    (S, g, C * page, x). One index_select over the flattened pages (a quarter faster than indexing by the (S, C)
    table), then the copy that puts each head's keys together."""
    s, c = pages.shape
    _, g, page, x = pool.shape
    gathered = pool.index_select(0, pages.reshape(-1)).view(s, c, g, page, x)
    return gathered.transpose(1, 2).reshape(s, g, c * page, x)


@dataclass(frozen=True)
class BoundPages:
    """A paged call's table with the call's causal flag: what :func:`paged_attention_backend` reads."""

    table: PageTable
    causal: bool


def _paged_kernel(
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    pages: BoundPages,
    scale: float,
    need_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (S, h, i, d) over the pools through the table, a few page columns at a time: output (S, h, i, e) in q's
    dtype (0 for a query with no key) and, with ``need_lse``, the log-sum-exp (S, h, i) (-inf with no key)."""
    table = pages.table
    s, h, i, d = q.shape
    _, g, page_size, e = value_pool.shape
    group = h // g
    work = compute_dtype(q.dtype)
    step = max(1, KEYS_PER_STEP // page_size)  # table columns read at once: about KEYS_PER_STEP keys per sequence
    columns = math.ceil(table.width / page_size)  # the table columns any sequence's keys reach

    def read(plan: _ReadPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (S, g, C * page, d) and values (S, g, C * page, e) of the plan's table columns."""
        return pages_in_order(key_pool, plan.pages).to(work), pages_in_order(value_pool, plan.pages).to(work)

    grouped = q.to(work).reshape(s, g, group * i, d)  # (S, g, group * i, d): a key head's queries together
    fused = columns <= max(1, FUSED_READ_KEYS // page_size)
    if fused and not need_lse and q.device.type in VERIFIED_EMPTY_ROW_DEVICES:
        # every sequence's keys in one read (up to FUSED_READ_KEYS keys): torch's fused kernel over them, in 6 of
        # the loop's 20 ops a read (a decode step of 8 heads over 100 keys: 170 us against 230; over 281 keys, one
        # read took a decode of 4 layers from 1.60x the contiguous cache's time to 1.37x). A query with no key gets
        # output 0 there once its scores are 0 (sdpa.VERIFIED_EMPTY_ROW_DEVICES): its query is zeroed. The plan
        # is the table's, made once for all the layers that read through it
        plan = table.derived(
            ("read", pages.causal, group, page_size, columns),
            lambda: _read_plan(table, pages.causal, group, 0, columns, page_size, whole=True),
        )
        if plan.rule == "every key" and native.serves_paged(grouped, key_pool, value_pool):
            # a decode step of sequences of one length, read where the pages lie (no copy of them per layer)
            out = native.paged_forward(grouped, key_pool, value_pool, plan.pages, table.width, scale)
            return out.reshape(s, h, i, e).to(q.dtype), None
        keys, values = read(plan)
        if plan.rule is not None:  # known on the host: every key, or a causal square; no row without keys
            width = table.width  # past it, the last page's slots no key has filled yet
            keys, values = keys[:, :, :width], values[:, :, :width]
            if plan.rule == "causal":  # a prefill: each head's own causal square, its queries in (S, h, i, d)
                # torch 2.13's causal mode gives NaN rows for a negative scale (it scales after the triangle's
                # -inf): the queries are negated instead, as spans does
                queries = grouped.view(s, h, i, d)  # q in the work dtype, cast once
                queries = queries if scale >= 0 else -queries
                out = F.scaled_dot_product_attention(
                    queries, keys, values, is_causal=True, scale=abs(scale), enable_gqa=group > 1
                )
            else:
                out = F.scaled_dot_product_attention(grouped, keys, values, scale=scale).reshape(s, h, i, e)
            return out.to(q.dtype), None
        assert plan.keep is not None and plan.empty is not None  # a plan with a mask
        grouped = grouped.masked_fill(plan.empty, 0.0)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=plan.keep, scale=scale)
        return out.reshape(s, h, i, e).to(q.dtype), None
    queries = grouped * scale
    best = torch.full((s, g, group * i, 1), -math.inf, dtype=work, device=q.device)
    total = torch.zeros_like(best)
    out = torch.zeros(s, g, group * i, e, dtype=work, device=q.device)
    for column in range(0, columns, step):
        plan = _read_plan(table, pages.causal, group, column, min(column + step, columns), page_size)
        keys, values = read(plan)
        assert plan.keep is not None  # a part of the table: always masked
        scores = queries @ keys.transpose(-1, -2)  # (S, g, group * i, C * page)
        scores = scores.masked_fill(~plan.keep, -math.inf)
        new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
        safe = torch.where(new_best == -math.inf, torch.zeros_like(new_best), new_best)  # no key yet: no shift
        weights = torch.exp(scores - safe)
        rescale = torch.exp(best - safe)
        total = total * rescale + weights.sum(-1, keepdim=True)
        out = out * rescale + weights @ values
        best = new_best
    out = torch.where(total > 0, out / total.clamp_min(torch.finfo(work).tiny), torch.zeros_like(out))
    lse = None
    if need_lse:  # log sum exp(s) = best + log(total); -inf where no key was seen (total 0)
        lse = torch.where(total > 0, best + torch.log(total.clamp_min(torch.finfo(work).tiny)), best)
        lse = lse.reshape(s, h, i)
    return out.reshape(s, h, i, e).to(q.dtype), lse


@dataclass(frozen=True)
class _ReadPlan:
    """What the kernel reads for table columns start .. stop - 1: ``pages`` (S, C) (-1 read as page 0, masked),
    ``keep`` (S, 1, group * i, C * page): which keys each query sees, and ``empty`` (S, 1, group * i, 1): queries
    that see none of them; or, with a ``rule`` (:meth:`PageTable.dense_rule`, the whole table read at once),
    neither: every query sees keys 0 .. width - 1 of its row, or those up to its own (a causal square)."""

    pages: torch.Tensor
    keep: torch.Tensor | None
    empty: torch.Tensor | None
    rule: str | None = None


def _read_plan(
    table: PageTable, causal: bool, group: int, start: int, stop: int, page_size: int, whole: bool = False
) -> _ReadPlan:
    """The plan of one read; ``whole``: the read of every column at once, which needs no mask where the table's
    rule says so."""
    pages = table.tables[:, start:stop]  # (S, C): these columns' pages of every sequence
    rule = table.dense_rule(causal) if whole else None
    if rule is not None:
        return _ReadPlan(pages.clamp(min=0), None, None, rule)
    width = pages.shape[1] * page_size
    at = table.positions.repeat(1, group)[:, None, :, None]  # (S, 1, group * i, 1): each query's position
    offsets = start * page_size + torch.arange(width, device=pages.device)
    key_at = (table.first_slots[:, None] + offsets)[:, None, None, :]  # (S, 1, 1, C * page)
    real = (pages >= 0).repeat_interleave(page_size, dim=1)[:, None, None, :]
    keep = real & (key_at < table.key_ends[:, None, None, None])
    if causal:
        keep = keep & (key_at <= at)
    if table.window is not None:
        keep = keep & (key_at > at - table.window)
    keep = keep.expand(-1, -1, at.shape[2], -1)
    return _ReadPlan(pages.clamp(min=0), keep, keep.logical_not().all(dim=-1, keepdim=True))


def paged_attention_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask,
    scale: float,
    dropout: float,
    need_weights: bool,
    need_lse: bool,
    pages: BoundPages,
) -> BackendOutput:
    """The registered backend: k and v are the page pools, ``pages`` the call's table (``mask`` is its dense
    equivalent, which the kernel applies itself)."""
    out, lse = _paged_kernel(q, k, v, pages, scale, need_lse)
    return BackendOutput(out, None, lse)


def _only_paged_calls(call: AttentionCall) -> list[str]:
    if call.paged:
        return []
    return ["dense keys (it reads keys in a page pool: attention(q, key_pool, value_pool, pages=PageTable(...)))"]


CAPABILITIES = Capabilities(
    lse=True,
    backward=True,  # plain tensor ops: autograd differentiates them
    compiles_dynamic=False,  # a Python loop over page columns
    python_block_loop=True,
    paged=True,
    sinks=True,  # its LSE is differentiable
    check=_only_paged_calls,
)
