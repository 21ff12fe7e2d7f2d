"""Groups of query rows through torch's fused CPU flash kernel, each over the span of keys its mask leaves alive.

Why. A packed batch of 16 documents leaves 6% of its tiles alive, but the block loop of :mod:`tiled` (a few small
torch ops per 256 x 256 block, ~100-150 GFLOP/s at best here) ran it level with padding every document to the
longest on SDPA, which computes every pair of its dense mask. Torch's CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``: forward with the log-sum-exp, and a backward) takes an
additive mask and is faster per pair than a matmul loop, but it computes every pair of what it is given. So this
backend gives it only what is alive: the call's query rows in groups, each group with the keys from the first to the
last tile its mask does not empty, and the mask of that span alone.

The plan (:func:`span_plan`, kept on the bound mask, so that auto's estimate and the kernel make it once). The mask's
tile states on a PLAN_ROWS x PLAN_KEYS grid (``BoundMask.block_states``, from what the host knows of the mask) give
each row tile its live key span. Consecutive row tiles join one group while the group's span (its rows times its
keys) stays within GROUP_WASTE times the sum of their own spans and the group holds at most GROUP_ROWS rows: a
group's rows cut where a document begins (its span jumps), and grow along a diagonal until the triangle above it
costs more than another kernel call. Packed documents then compute 1.35x the pairs the mask keeps, against 28x for
the whole grid (benchmarks/packed.py). A run of at least UNMASKED_KEYS keys that the mask keeps whole for every row
of a group runs as a call of its own without a mask, merged into the rest by their log-sum-exps. Before the tiles,
the rows that see a causal triangle (each row one key more than the row above, from one first key: a causal call,
each packed document under causal, the first rows of a window; read from :meth:`BoundMask.row_key_spans`) become
groups of their own, each the kernel's own causal call with no mask tensor (is_causal: it skips its key blocks past
the diagonal itself), after an unmasked call over the keys every row of it sees (a bottom-right causal call's
prefix). A whole causal call with the LSE, which the plan of tiles ran as 65 calls in 444 ms at n = 8192, h = 4, is
then one call in 244 ms; 16 packed documents are 16 calls. In float32 a causal call's forward runs on multihead's
native kernel (:mod:`multihead.backends.native`: 128-row blocks, so 64 keys a row past the diagonal where torch's
kernel computes up to 512: the 16 documents' causal calls ran 1.47x faster, the packed forward 1.31x), its backward
on torch's, given the native output and LSE; torch's kernel serves both where the native one is not available.

Each group runs the kernel on its queries with the r = h / g query heads that share a key/value head stacked along
its rows, (b, g, r * rows, d), against the span of keys and values read in place: grouped heads copy no key. A
causal call keeps the heads apart, (b, h, rows, d), which the kernel reads against (b, g, keys, d) as grouped heads. The
group's mask is built as one additive tensor (0 where a pair may attend, -inf where not, plus any bias) only when the
mask does not keep the span whole.

The contract, as every backend keeps it:

- **Fully masked rows** give output 0, LSE -inf and gradient 0. A group with no live key is not run; a row that a
  piece masks whole is found from its mask row (where the mask may empty a row, or the group runs in several
  pieces), its query zeroed first (so no overflowing score meets -inf: inf - inf = NaN) and its LSE set to -inf (the
  kernel says 0).
- **The LSE** is the kernel's, and differentiable: a gradient on it enters the kernel's backward through its row
  term D = rowsum(dO * O), which the backward takes from the output it is given. With a gradient g on the LSE, q and
  k gain a zero column, v a zero column, the output a column holding -g and dO a column of ones: the scores and dP
  are unchanged and D becomes D - g, which is dS = P (dP - D + g), the gradient through the LSE (used by learned
  sinks and by merging partial results).
- **Half precision** computes in float32 (the kernel's half backward sums dK and dV over query blocks in half and
  misses the FlashAttention tolerance rule: :data:`multihead.backends.costs.HALF_BACKWARD_INACCURATE_ON_CPU`).
- **Double backward** differentiates the dense closed-form gradients (as :mod:`tiled`), built only when asked for.
- Not served, each named by its Capabilities and so left to :mod:`tiled`: dropout (the kernel would draw torch's own
  stream, and no weights could be returned with it), logit soft-capping (no score transform), a gradient to a bias,
  and torch.func transforms (no vmap rule) or torch.compile tracing (a Python loop over groups, on a private op).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from multihead.backends import native
from multihead.backends._blocks import (
    KernelFunction,
    dense_input_grads,
    double_backward,
    finite_or_zero,
    legacy_batched,
    transforms_active,
)
from multihead.backends.call import AttentionCall
from multihead.backends.costs import (
    HALF_DTYPES,
    Estimate,
    call_kind,
    cast_bytes,
    dense_mask_seconds,
    kernel_rates,
    kernel_seconds,
    pair_flops,
)
from multihead.backends.precision import autocast_inputs, autocast_off, compute_dtype
from multihead.backends.registry import BackendOutput, Capabilities
from multihead.masks import STATE_EMPTY, STATE_FULL, BoundMask, is_fake

PLAN_ROWS = 32  # query rows per tile of the plan's grid
PLAN_KEYS = 32  # keys per tile of the plan's grid
GROUP_ROWS = 256  # the most query rows one kernel call takes
# how much more than its row tiles' own spans a group may compute: 32, 256 and 1.25 ran packed documents fastest of
# 16-64 rows per tile, 128-512 rows per group and 1.1-1.5 (69 ms against 69-83, 16 documents of 8,588 tokens, h = 8)
GROUP_WASTE = 1.25
# the fewest keys kept whole for a group's rows that run as a kernel call of their own, without a mask (beside the
# calls over the rest of its span, whose mask is built and read). Interleaved, forward, h = 4-8: causal & padding
# at n = 8192 took 317 ms at 512 against 366 never splitting (331 at 256); packed documents, whose kept runs are short
# and have a partial tile on each side, took 107 ms at 512 against 104 never splitting (125 at 128)
UNMASKED_KEYS = 512
# the fewest query rows of a causal triangle (each row one key more than the row above) run as a causal call of their
# own (the kernel's is_causal, no mask tensor): below it, the rows join the tiles' groups
CAUSAL_ROWS = 32
# the kernel's causal call computes its keys in blocks of this many: a triangle of n rows costs n (n + 1) / 2 pairs
# plus n x min(n, CAUSAL_KEY_BLOCK) / 2 (fitted: the causal call's time over the full call's, h = 8, g = 2, d = 64,
# was 1.01 at n <= 512, 0.79 at 768, 0.63 at 2048 and 0.57 at 4096, against 1.00, 0.83, 0.63 and 0.56 so counted)
CAUSAL_KEY_BLOCK = 512
# What one kernel call costs beside its pairs (torch's CPU flash kernel, float32, d = 64, 2 threads, on this project's
# AVX-512 EPYC): fitting its time against its query rows (32 to 256) at a fixed key span gave a part per key, head and
# head dim element, 0.06-0.3 ns forward and 0-1.4 ns backward (reading K and V again for every call, and in the
# backward writing their gradients: more where h x keys x d outgrows the caches: 8 heads x 2048 keys is the high end),
# and a fixed part of about 15 us
CALL_SECONDS = 15e-6
CALL_KEY_SECONDS_FORWARD = 0.2e-9
CALL_KEY_SECONDS_BACKWARD = 1.0e-9

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass(frozen=True)
class KeyPiece:
    """Keys one kernel call of a group reads, and whether the mask must be applied to them (False: the mask keeps
    every one of them for every row of the group, and the kernel runs without a mask). ``causal``: the mask keeps
    exactly the kernel's own causal triangle over them, the group's n-th row the first n + 1 keys (the kernel runs
    with is_causal and no mask, and skips its key blocks past the diagonal)."""

    keys: range
    masked: bool
    causal: bool = False

    def pairs(self, rows: int, diagonal_block: int = CAUSAL_KEY_BLOCK) -> int:
        """The (query, key) pairs the kernel computes for ``rows`` query rows: all of them, or for a causal piece
        its triangle and the blocks across its diagonal, ``diagonal_block`` keys wide: torch's kernel's
        CAUSAL_KEY_BLOCK, or the native kernel's row blocks (:func:`causal_diagonal_block`)."""
        if not self.causal:
            return rows * len(self.keys)
        return rows * (rows + 1) // 2 + rows * min(rows, diagonal_block) // 2


def causal_diagonal_block(dtype: torch.dtype) -> int:
    """How wide the blocks across a causal triangle's diagonal are, computing in ``dtype``: the native kernel's row
    blocks where it serves (float32), else torch's key blocks."""
    if dtype == torch.float32 and native.available():
        return native.CAUSAL_BLOCK_ROWS
    return CAUSAL_KEY_BLOCK


@dataclass(frozen=True)
class SpanGroup:
    """Query rows run together, and the pieces of their key span, each one kernel call (none: every key of these
    rows is masked)."""

    rows: range
    pieces: tuple[KeyPiece, ...]

    @property
    def pairs(self) -> int:
        return sum(piece.pairs(len(self.rows)) for piece in self.pieces)


def span_plan(mask: BoundMask) -> tuple[SpanGroup, ...]:
    """The call's query rows in groups, each with its live key span in pieces (see the module docstring), made once
    per bound mask and kept on it. Read from the host's view of the mask (``BoundMask.on_host``): it waits for no
    device."""
    key = ("spans", PLAN_ROWS, PLAN_KEYS, GROUP_ROWS, GROUP_WASTE, UNMASKED_KEYS, CAUSAL_ROWS)
    plan = mask.kernel_plans.get(key)
    if plan is None:
        plan = mask.kernel_plans[key] = _plan(mask)
    return plan  # type: ignore[return-value]


def _plan(mask: BoundMask) -> tuple[SpanGroup, ...]:
    q_len, k_len = mask.shape.q_len, mask.shape.k_len
    states = mask.on_host().block_states(PLAN_ROWS, PLAN_KEYS) if mask.keep_terms else None
    if states is None or is_fake(states):  # nothing skipped, or nothing known (fake tensors): groups over every key
        piece = (KeyPiece(range(k_len), masked=not mask.is_empty),)
        return tuple(
            SpanGroup(range(start, min(start + GROUP_ROWS, q_len)), piece) for start in range(0, q_len, GROUP_ROWS)
        )
    live = states != STATE_EMPTY  # (row tiles, key tiles)
    tiles = torch.arange(live.shape[1])
    first = torch.where(live, tiles, live.shape[1]).amin(1).mul_(PLAN_KEYS).tolist()  # each row tile's first key
    stop = torch.where(live, tiles, -1).amax(1).add_(1).mul_(PLAN_KEYS).clamp_(max=k_len).tolist()
    full = states == STATE_FULL
    groups: list[SpanGroup] = []
    covered = 0  # rows before this are planned
    for causal in [*_causal_groups(mask), None]:
        gap = range(covered, q_len if causal is None else causal.rows.start)
        spans = _tile_groups(gap, first, stop)
        groups.extend(SpanGroup(rows, _pieces(mask, full, rows, keys)) for rows, keys in spans)
        if causal is not None:
            groups.append(causal)
            covered = causal.rows.stop
    return tuple(groups)


def _causal_groups(mask: BoundMask) -> list[SpanGroup]:
    """The runs of at least CAUSAL_ROWS query rows that see a causal triangle (each row one key more than the row
    above, all from one first key), each a group of its own: the keys every row of the run sees (an unmasked piece,
    where there are any) and the triangle (a causal piece). Packed documents' causal blocks, a causal call, and the
    rows of a window that reach back to the first key. Found from the mask's runs of keys per row
    (:meth:`BoundMask.row_key_spans`); none where the mask has no such runs."""
    spans = mask.row_key_spans()
    if spans is None:
        return []
    lo, hi = spans
    reach = hi - torch.arange(len(hi))  # constant along a triangle, where each row sees one more key
    keyless = hi <= lo  # a row without keys runs in no triangle, and the row after it starts one
    starts = torch.ones(len(hi), dtype=torch.bool)
    starts[1:] = (lo[1:] != lo[:-1]) | (reach[1:] != reach[:-1]) | keyless[1:] | keyless[:-1]
    bounds = [*torch.nonzero(starts).flatten().tolist(), len(hi)]
    first_keys, last_reach, empty = lo.tolist(), hi.tolist(), keyless.tolist()
    groups = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end - start < CAUSAL_ROWS or empty[start]:
            continue
        diagonal = last_reach[start] - 1  # the first row's last key: where the triangle starts
        pieces = [KeyPiece(range(diagonal, diagonal + end - start), masked=False, causal=True)]
        if diagonal > first_keys[start]:  # keys every row sees, before the triangle
            pieces.insert(0, KeyPiece(range(first_keys[start], diagonal), masked=False))
        groups.append(SpanGroup(range(start, end), tuple(pieces)))
    return groups


def _tile_groups(rows: range, first: list[int], stop: list[int]) -> list[tuple[range, range]]:
    """Query rows ``rows`` in groups of consecutive rows, each with the span of keys its tiles leave alive (empty:
    no key alive), grown while the span stays within GROUP_WASTE times its tiles' own spans and GROUP_ROWS rows.
    ``first`` and ``stop``: each row tile's first live key and the end of its last live tile (stop <= first: no
    live key)."""
    spans: list[tuple[range, range]] = []  # (rows, keys) of each group
    if not rows:  # between two triangles that meet
        return spans
    open_rows: range | None = None  # the group being grown: rows, keys, and the pairs of its tiles' own spans
    open_keys, own_pairs = range(0), 0
    for tile in range(rows.start // PLAN_ROWS, -(-rows.stop // PLAN_ROWS)):
        lo, hi = first[tile], stop[tile]
        # a tile's rows within ``rows``: its span holds every key they see (a subset of its rows sees no more)
        tile_rows = range(max(tile * PLAN_ROWS, rows.start), min((tile + 1) * PLAN_ROWS, rows.stop))
        if hi <= lo:  # no live key: a group of its own, never run
            if open_rows is not None:
                spans.append((open_rows, open_keys))
                open_rows = None
            spans.append((tile_rows, range(0)))
            continue
        if open_rows is not None:
            joined_rows = range(open_rows.start, tile_rows.stop)
            joined_keys = range(min(open_keys.start, lo), max(open_keys.stop, hi))
            joined_own = own_pairs + len(tile_rows) * (hi - lo)
            if len(joined_rows) <= GROUP_ROWS and len(joined_rows) * len(joined_keys) <= GROUP_WASTE * joined_own:
                open_rows, open_keys, own_pairs = joined_rows, joined_keys, joined_own
                continue
            spans.append((open_rows, open_keys))
        open_rows, open_keys, own_pairs = tile_rows, range(lo, hi), len(tile_rows) * (hi - lo)
    if open_rows is not None:
        spans.append((open_rows, open_keys))
    return spans


def _pieces(mask: BoundMask, full: torch.Tensor, rows: range, keys: range) -> tuple[KeyPiece, ...]:
    """A group's key span as kernel calls: the longest run of key tiles that the mask keeps whole for all its rows
    (``full``: (row tiles, key tiles) bool) runs unmasked where it holds at least UNMASKED_KEYS keys, the keys on
    either side of it masked; else the whole span masked. A bias applies everywhere: one masked piece."""
    if not keys:
        return ()
    if mask.bias_terms:
        return (KeyPiece(keys, masked=True),)
    first_tile, stop_tile = keys.start // PLAN_KEYS, -(-keys.stop // PLAN_KEYS)
    whole = full[rows.start // PLAN_ROWS : -(-rows.stop // PLAN_ROWS), first_tile:stop_tile].all(0).tolist()
    best_start, best_length, run_start = 0, 0, 0
    for index, kept in enumerate([*whole, False]):
        if not kept:
            if index - run_start > best_length:
                best_start, best_length = run_start, index - run_start
            run_start = index + 1
    if best_length == len(whole):
        return (KeyPiece(keys, masked=False),)
    plain_start = max(keys.start, (first_tile + best_start) * PLAN_KEYS)
    plain_stop = min(keys.stop, (first_tile + best_start + best_length) * PLAN_KEYS)
    if plain_stop - plain_start < UNMASKED_KEYS:
        return (KeyPiece(keys, masked=True),)
    pieces = [KeyPiece(range(plain_start, plain_stop), masked=False)]  # first: the others merge into it
    for side in (range(keys.start, plain_start), range(plain_stop, keys.stop)):
        if side:
            pieces.append(KeyPiece(side, masked=True))
    return tuple(pieces)


class _Layout:
    """One call's tensors as the kernel reads them. Queries (b, g, r, i, w): a group of rows goes to the kernel as
    (b, g, r * n, w), the r = h / g query heads that share a key/value head stacked along its rows, against keys and
    values (b, g, j, w) read in place (no copy per head; and the kernel's row blocks grow with r, which it runs
    faster: 52 against 60 ms over packed documents' groups with h = 8, g = 2, against keys expanded per head). w is
    the common head width the kernel wants: q and k padded with zeros to max(d, e), which leaves the scores as they
    are, v with zeros that are dropped from the output; plus ``extra`` zero columns (the LSE's gradient).

    ``scale`` is the call's; the kernel is given ``kernel_scale`` = |scale|, and for a negative scale the queries
    negated (the same scores): its causal mode applies the scale after the triangle's -inf, which a negative scale
    turns into +inf, and its rows into NaN (torch 2.13: is_causal with scale=-0.8 gives NaN where a mask does not).
    A query's gradient is then negated back (:meth:`query_grad`)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, extra: int = 0):
        self.b, self.h, self.i, self.d = q.shape
        self.g, self.j, self.e = k.shape[1], k.shape[2], v.shape[3]
        self.r = self.h // self.g
        self.dtype = compute_dtype(q.dtype)
        self.width = max(self.d, self.e) + extra
        self.negated = scale < 0
        self.kernel_scale = abs(scale)
        queries = q.to(self.dtype)
        self.q = self.widened(self.grouped(queries.neg() if self.negated else queries))  # (b, g, r, i, w)
        self.k = self.widened(k.to(self.dtype))  # (b, g, j, w)
        self.v = self.widened(v.to(self.dtype))  # (b, g, j, w)

    def widened(self, t: torch.Tensor, column: torch.Tensor | None = None) -> torch.Tensor:
        """(.., x) -> (.., w) with zeros after x (the last of them ``column`` (.., 1) where given)."""
        if column is not None:
            t = torch.cat([F.pad(t, (0, self.width - 1 - t.shape[-1])), column], dim=-1)
        return t if t.shape[-1] == self.width else F.pad(t, (0, self.width - t.shape[-1]))

    def grouped(self, t: torch.Tensor) -> torch.Tensor:
        """(b, h, i, ..) -> (b, g, r, i, ..), a view where it can be."""
        return t.reshape(self.b, self.g, self.r, *t.shape[2:])

    def stacked(self, t: torch.Tensor, rows: range) -> torch.Tensor:
        """(b, g, r, i, ..) -> the rows' (b, g, r * n, ..), each head's n rows after the previous head's."""
        return t[:, :, :, rows.start : rows.stop].reshape(self.b, self.g, self.r * len(rows), *t.shape[4:])

    def unstacked(self, t: torch.Tensor, rows: range) -> torch.Tensor:
        """(b, g, r * n, ..) -> (b, g, r, n, ..), a view."""
        return t.unflatten(2, (self.r, len(rows)))

    def query_grad(self, dq: torch.Tensor) -> torch.Tensor:
        """The gradient of the call's queries from that of the kernel's (negated for a negative scale)."""
        return dq.neg_() if self.negated else dq

    def by_head(self, t: torch.Tensor, rows: range) -> torch.Tensor:
        """(b, g, r, i, ..) -> the rows' (b, h, n, ..), a view: a causal call's layout (stacked heads would break
        its triangle), which the kernel reads against (b, g, keys, w) as grouped heads."""
        return t[:, :, :, rows.start : rows.stop].flatten(1, 2)

    def from_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(b, h, n, ..) -> (b, g, r, n, ..), a view."""
        return t.unflatten(1, (self.g, self.r))


class _PieceMasks:
    """The additive masks of one pass's pieces (:func:`_piece_mask`), each built once per shape and offset from the
    diagonal where the mask is a band (:attr:`BoundMask.shift_invariant`): a window's groups are all alike but the
    first, and its forward built and stacked the same (r * n, keys) mask once per group (85 times at n = 8192)."""

    def __init__(self, lay: _Layout, mask: BoundMask):
        self.lay, self.mask = lay, mask
        self.made: dict[tuple[int, int, int, bool], tuple[torch.Tensor | None, torch.Tensor | None]] | None = (
            {} if mask.shift_invariant else None
        )

    @staticmethod
    def shape_of(rows: range, piece: KeyPiece) -> tuple[int, int, int]:
        """What makes a band's piece masks alike: the piece's first key less its first row, its rows, its keys."""
        return piece.keys.start - rows.start, len(rows), len(piece.keys)

    def of(self, rows: range, piece: KeyPiece, check_empty: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.made is None or not piece.masked:
            return _piece_mask(self.lay, self.mask, rows, piece, check_empty)
        key = (*self.shape_of(rows, piece), check_empty)
        if key not in self.made:
            self.made[key] = _piece_mask(self.lay, self.mask, rows, piece, check_empty)
        return self.made[key]


def _piece_mask(
    lay: _Layout, mask: BoundMask, rows: range, piece: KeyPiece, check_empty: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The piece's additive mask as the kernel reads it, (b or 1, g or 1, r * n or 1, keys or 1) in the compute
    dtype, and the rows it masks whole, (.., r * n or 1, 1) bool (None unless ``check_empty``); (None, None) for an
    unmasked piece, or where the mask keeps every pair of it."""
    if not piece.masked:
        return None, None
    row_slice, key_slice = slice(rows.start, rows.stop), slice(piece.keys.start, piece.keys.stop)
    keep, bias = mask.block(row_slice, key_slice, dtype=lay.dtype, minus_inf_as_keep=False)  # a bias's -inf stays
    if keep is None and bias is None:
        return None, None
    if bias is None:
        assert keep is not None  # one of them is set
        additive = torch.where(keep, 0.0, -math.inf).to(lay.dtype)
    else:  # out of place: the bias may be the caller's tensor
        bias = bias.to(lay.dtype)
        additive = bias if keep is None else bias.masked_fill(~keep, -math.inf)
    additive = additive.reshape((1,) * (4 - additive.dim()) + tuple(additive.shape))  # (.., n or 1, L or 1) -> 4-d
    batch, heads, own_rows, keys = additive.shape
    if heads > 1:  # (b or 1, h, n or 1, L) -> (b or 1, g, r * n, L): each head's rows, stacked as the queries are
        additive = additive.reshape(batch, lay.g, lay.r, own_rows, keys).expand(batch, lay.g, lay.r, len(rows), keys)
        additive = additive.reshape(batch, lay.g, lay.r * len(rows), keys)
    elif own_rows > 1 and lay.r > 1:  # (b or 1, 1, n, L): the same rows for every head of a group
        additive = additive.unsqueeze(2).expand(batch, 1, lay.r, own_rows, keys).reshape(batch, 1, -1, keys)
    empty = (additive == -math.inf).all(dim=-1, keepdim=True) if check_empty else None
    return additive, empty


def _guarded_queries(q_rows: torch.Tensor, empty: torch.Tensor | None) -> torch.Tensor:
    """Queries (b, g, r * n, w) with the rows a piece masks whole zeroed: their scores are then 0 before the mask's
    -inf, so no score overflowing to inf meets it (inf - inf = NaN)."""
    return q_rows if empty is None else q_rows.masked_fill(empty, 0.0)


def _forward(lay: _Layout, mask: BoundMask) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (b, h, i, e) and LSE (b, h, i), both in the compute dtype."""
    out = torch.empty(lay.b, lay.g, lay.r, lay.i, lay.e, dtype=lay.dtype, device=lay.q.device)
    lse = torch.empty(lay.b, lay.g, lay.r, lay.i, dtype=lay.dtype, device=lay.q.device)
    may_empty = mask.may_empty_rows()
    piece_masks = _PieceMasks(lay, mask)
    for group in span_plan(mask):
        rows = slice(group.rows.start, group.rows.stop)
        if not group.pieces:  # every key masked: output 0, LSE -inf
            out[:, :, :, rows] = 0.0
            lse[:, :, :, rows] = -math.inf
            continue
        q_rows = lay.stacked(lay.q, group.rows)  # (b, g, r * n, w)
        # a row may see no key of one piece and some of another: with several pieces every masked one is checked
        check_empty = may_empty or len(group.pieces) > 1
        for index, piece in enumerate(group.pieces):
            keys = slice(piece.keys.start, piece.keys.stop)
            if piece.causal:  # every row sees a key of the triangle: no row to guard
                causal_out, causal_lse = _causal_forward(
                    lay.by_head(lay.q, group.rows), lay.k[:, :, keys], lay.v[:, :, keys], lay.kernel_scale
                )
                piece_out, piece_lse = lay.from_heads(causal_out[..., : lay.e]), lay.from_heads(causal_lse)
            else:
                attn_mask, empty = piece_masks.of(group.rows, piece, check_empty)
                stacked_out, stacked_lse = _FORWARD(
                    _guarded_queries(q_rows, empty),
                    lay.k[:, :, keys],
                    lay.v[:, :, keys],
                    attn_mask=attn_mask,
                    scale=lay.kernel_scale,
                )
                if empty is not None:  # the kernel gives such a row output 0 and LSE 0: its LSE is -inf
                    stacked_lse = stacked_lse.masked_fill(empty.squeeze(-1), -math.inf)
                piece_out = lay.unstacked(stacked_out[..., : lay.e], group.rows)  # (b, g, r, n, e)
                piece_lse = lay.unstacked(stacked_lse, group.rows)
            if index == 0:
                out[:, :, :, rows], lse[:, :, :, rows] = piece_out, piece_lse
            else:
                _merge_(out[:, :, :, rows], lse[:, :, :, rows], piece_out, piece_lse)
    return out.view(lay.b, lay.h, lay.i, lay.e), lse.view(lay.b, lay.h, lay.i)


def _causal_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal triangle from the first key, q (b, h, n, w) against k, v (b, g, m, w): multihead's native kernel
    where it serves (its smaller blocks across the diagonal), else torch's flash kernel with is_causal."""
    if native.serves_causal(q, k, v):
        return native.causal_forward(q, k, v, scale)
    return _FORWARD(q, k, v, is_causal=True, scale=scale)


def _merge_(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold one piece's softmax over its keys into the rows' so far, in place: out (.., n, e) and lse (.., n) become
    those over both key sets. A row with no key in either stays output 0, LSE -inf."""
    total = torch.logaddexp(lse, part_lse)
    safe = finite_or_zero(total)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(part_out * torch.exp(part_lse - safe).unsqueeze(-1))
    lse.copy_(total)


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    mask: BoundMask,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) in the compute dtype, piece by piece: given the
    whole softmax's output and LSE, each piece's backward gives exactly its own keys' share of every gradient."""
    lay = _Layout(q, k, v, scale, extra=0 if grad_lse is None else 1)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grad_out, out = lay.grouped(grad_out.to(lay.dtype)), lay.grouped(out.to(lay.dtype))  # (b, g, r, i, e)
    if grad_lse is None:
        grad_out, out = lay.widened(grad_out), lay.widened(out)
    else:  # the LSE's gradient g through the kernel's D = rowsum(dO * O): dO gains a 1, O a -g (module docstring)
        minus_g = lay.grouped(grad_lse.to(lay.dtype)).neg().unsqueeze(-1)  # (b, g, r, i, 1)
        grad_out, out = lay.widened(grad_out, torch.ones_like(minus_g)), lay.widened(out, minus_g)
    # the kernel's backward recomputes P = exp(s - lse): an empty row's scores are -inf, so its lse is given as 0
    kernel_lse = finite_or_zero(lay.grouped(lse.to(lay.dtype))).unsqueeze(-1)  # (b, g, r, i, 1)
    dq = torch.zeros(lay.b, lay.g, lay.r, lay.i, lay.d, dtype=lay.dtype, device=lay.q.device)
    dk = torch.zeros(lay.b, lay.g, lay.j, lay.d, dtype=lay.dtype, device=lay.q.device)
    dv = torch.zeros(lay.b, lay.g, lay.j, lay.e, dtype=lay.dtype, device=lay.q.device)
    may_empty = mask.may_empty_rows()
    piece_masks = _PieceMasks(lay, mask)
    for group in span_plan(mask):
        if not group.pieces:
            continue
        q_rows, out_rows = lay.stacked(lay.q, group.rows), lay.stacked(out, group.rows)  # (b, g, r * n, w)
        grad_rows, lse_rows = lay.stacked(grad_out, group.rows), lay.stacked(kernel_lse, group.rows).squeeze(-1)
        check_empty = may_empty or len(group.pieces) > 1
        for piece in group.pieces:
            keys = slice(piece.keys.start, piece.keys.stop)
            if piece.causal:
                causal_dq, piece_dk, piece_dv = _BACKWARD(
                    lay.by_head(grad_out, group.rows),
                    lay.by_head(lay.q, group.rows),
                    lay.k[:, :, keys],
                    lay.v[:, :, keys],
                    lay.by_head(out, group.rows),
                    lay.by_head(kernel_lse, group.rows).squeeze(-1),
                    0.0,
                    True,
                    scale=lay.kernel_scale,
                )
                piece_dq = lay.from_heads(causal_dq[..., : lay.d])
            else:
                attn_mask, empty = piece_masks.of(group.rows, piece, check_empty)
                stacked_dq, piece_dk, piece_dv = _BACKWARD(
                    grad_rows,
                    _guarded_queries(q_rows, empty),
                    lay.k[:, :, keys],
                    lay.v[:, :, keys],
                    out_rows,
                    lse_rows,
                    0.0,
                    False,
                    attn_mask=attn_mask,
                    scale=lay.kernel_scale,
                )
                piece_dq = lay.unstacked(stacked_dq[..., : lay.d], group.rows)
            dq[:, :, :, group.rows.start : group.rows.stop] += piece_dq
            dk[:, :, keys] += piece_dk[..., : lay.d]
            dv[:, :, keys] += piece_dv[..., : lay.e]
    return lay.query_grad(dq.view(lay.b, lay.h, lay.i, lay.d)), dk, dv


class _SpansAttention(KernelFunction):
    """(q, k, v) -> (output, lse) in the compute dtype; backward is :class:`_SpansBackward`."""

    @staticmethod
    @autocast_off
    def forward(q, k, v, mask: BoundMask, scale: float):
        return _forward(_Layout(q, k, v, scale), mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, scale = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.mask, ctx.scale = mask, scale
        ctx.set_materialize_grads(False)  # a gradient on only one of output / lse arrives as None

    @staticmethod
    @autocast_off
    def backward(ctx, grad_out, grad_lse):
        if grad_out is None and grad_lse is None:  # reached from a double backward, which returns None for out, lse
            return None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        if legacy_batched(grad_out, grad_lse):  # is_grads_batched=True: the dense closed form, as tiled's
            dq, dk, dv = dense_input_grads(q, k, v, grad_out, None, grad_lse, mask=ctx.mask, scale=ctx.scale)
        else:  # a Function of its own, so that the gradients are differentiable (double backward)
            dq, dk, dv = _SpansBackward.call_or_run(q, k, v, out, lse, grad_out, grad_lse, ctx.mask, ctx.scale)
        return dq, dk, dv, None, None


class _SpansBackward(KernelFunction):
    """(q, k, v, out, lse, grad_out, grad_lse) -> (dq, dk, dv) in the inputs' dtypes; its own backward (double
    backward) differentiates the dense closed-form gradients, as :class:`multihead.backends.tiled._TiledBackward`."""

    @staticmethod
    @autocast_off
    def forward(q, k, v, out, lse, grad_out, grad_lse, mask: BoundMask, scale: float):
        dq, dk, dv = _backward(q, k, v, out, lse, grad_out, grad_lse, mask, scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, out, lse, grad_out, grad_lse, mask, scale = inputs
        ctx.save_for_backward(q, k, v, grad_out, grad_lse)
        ctx.mask, ctx.scale = mask, scale

    @staticmethod
    @autocast_off
    def backward(ctx, grad_dq, grad_dk, grad_dv):
        q, k, v, grad_out, grad_lse = ctx.saved_tensors
        dq, dk, dv, d_grad_out, d_grad_lse = double_backward(
            {"q": q, "k": k, "v": v, "grad_out": grad_out, "grad_lse": grad_lse},
            (grad_dq, grad_dk, grad_dv),
            mask=ctx.mask,
            scale=ctx.scale,
        )
        return dq, dk, dv, None, None, d_grad_out, d_grad_lse, None, None


def spans_attention(
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
    """q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) -> output (b, h, i, e) in q's dtype (under torch.autocast, the
    autocast dtype, float64 excepted), LSE (b, h, i) in the compute dtype (float32 for half inputs, as tiled's)."""
    del dropout, need_weights  # its Capabilities refuse dropout; the registry computes any weights asked for
    q, k, v = autocast_inputs(q, k, v)
    output, lse = _SpansAttention.call(q, k, v, mask, scale)
    return BackendOutput(output.to(q.dtype), None, lse if need_lse else None)


def _check(call: AttentionCall) -> list[str]:
    missing = []
    if transforms_active():
        missing.append("torch.func transforms (vmap, grad, jacrev: it has no vmap rule; tiled has)")
    if torch.compiler.is_compiling():
        missing.append("torch.compile tracing (a Python loop over row groups, each a private ATen op)")
    return missing


def _estimate(call: AttentionCall) -> Estimate | None:
    """Its pieces' pairs at the rates of the kernel it runs (torch's SDPA alone for the unmasked pieces, given a
    mask for the others), in the dtype it computes in; plus what each kernel call costs beside its pairs (a fixed
    part, and its keys and values read, and in the backward their gradients written, for every query head); plus
    building each masked piece's mask (forward, and again in the backward; a band's once per shape and offset, as
    :class:`_PieceMasks` builds them), and a half call's casts."""
    plan = span_plan(call.mask)
    work = compute_dtype(call.dtype)
    has_causal = any(piece.causal for group in plan for piece in group.pieces)
    # asked only where a triangle is run: the native kernel is built at its first use, not for every plan
    diagonal_block = causal_diagonal_block(work) if has_causal else CAUSAL_KEY_BLOCK
    masked = plain = keys_read = calls = built = 0
    shapes_built: set[tuple[int, int, int]] = set()
    for group in plan:
        for piece in group.pieces:
            pairs = piece.pairs(len(group.rows), diagonal_block)
            masked, plain = (masked + pairs, plain) if piece.masked else (masked, plain + pairs)
            keys_read += len(piece.keys)
            calls += 1
            shape = _PieceMasks.shape_of(group.rows, piece)
            if piece.masked and not (call.mask.shift_invariant and shape in shapes_built):
                built += pairs
                shapes_built.add(shape)
    kind = call_kind(call)
    rates = kernel_rates(kind)
    per_pair = float(pair_flops(call.qk_dim, call.v_dim)) * call.batch * call.heads
    rows = call.batch * call.heads * call.q_len
    plain_s = kernel_seconds("sdpa", work, call.requires_grad, per_pair * plain, rows, rates)
    masked_s = kernel_seconds("sdpa masked", work, call.requires_grad, per_pair * masked, 0, rates)
    if plain_s is None or masked_s is None:
        return None
    passes = 2 if call.requires_grad else 1
    key_seconds = CALL_KEY_SECONDS_FORWARD + (CALL_KEY_SECONDS_BACKWARD if call.requires_grad else 0.0)
    per_key = call.batch * call.heads * max(call.qk_dim, call.v_dim) * key_seconds  # its K and V, every query head
    seconds = plain_s + masked_s + calls * passes * CALL_SECONDS + keys_read * per_key
    if built:
        batch, heads, _ = call.mask.dense_extent()
        seconds += passes * dense_mask_seconds(call, entries=batch * heads * built)
    if call.dtype in HALF_DTYPES and kind.type == "cpu":
        sizes = (call.batch, call.heads, call.kv_heads, call.q_len, call.k_len, call.qk_dim, call.v_dim)
        seconds += cast_bytes(*sizes, call.requires_grad) / (rates.fresh_gbs * 1e9)
    computes_in = None if work == call.dtype else work
    return Estimate(
        seconds,
        (masked + plain) / (call.q_len * call.k_len),
        computes_in=computes_in,
        note=_causal_note(work) if has_causal else None,
    )


def _causal_note(work: torch.dtype) -> str:
    """Which kernel runs a plan's causal triangles, and why not the native one where it does not."""
    if work != torch.float32:
        return f"its causal triangles on torch's flash kernel (the native kernel computes float32, not {work})"
    reason = native.unavailable_reason()
    if reason is None:
        return f"its causal triangles on multihead's native kernel ({native.CAUSAL_BLOCK_ROWS}-row blocks)"
    return f"its causal triangles on torch's flash kernel (the native kernel {reason})"


CAPABILITIES = Capabilities(
    device_types=frozenset({"cpu"}),  # torch's CPU flash kernel
    lse=True,
    weights=False,
    dropout=False,
    backward=True,
    bias_grad=False,
    compiles_dynamic=False,
    python_block_loop=True,  # a loop over row groups, one fused kernel each
    softcap=False,
    sinks=True,  # its LSE is differentiable
    check=_check,
    estimate=_estimate,
)
