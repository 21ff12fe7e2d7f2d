"""``attention_stats(q, k, v, ...)``: exact statistics of the attention weights in O(n) memory, never an n x n matrix.

    stats = multihead.attention_stats(q, k, v, causal=True, top_k=4)
    stats.entropy       # (b, h, i) nats
    stats.received      # (b, h, j): the column sums of the weights, where the sinks and heavy hitters are
    stats.bands         # (b, h, i, 6): the weight at 0, 1, 2-8, 9-64, 65-512 and 513+ tokens away

Two passes. The first is :func:`multihead.attention` with ``return_lse=True``: the output and the log-sum-exp of
every row, on the fastest kernel that serves the call. The second walks the same blocks the tiled kernel does
(``block_q`` query rows by ``block_k`` keys, every block the mask leaves empty skipped) and turns each block's
scores into the exact weights, p = exp(s - lse), which it reduces at once: per query row, per key column, or into a
pooled map. The memory beyond the inputs is one block of scores and the statistics themselves.

Positions: query row r sits at position r + (j - i), aligned bottom-right as :func:`~multihead.masks.causal`
aligns a query block with its keys (i == j for self-attention: row r is position r). The distance of key c from
query row r is that position minus c: positive for a key before the query ("tokens back"), negative for one
after it (an encoder's heads see those; their weight is ``ahead``).

Every statistic is of the weights :func:`~multihead.attention` applies: the same typed masks (padding, window,
ALiBi, soft-cap, documents, a caller's bias), GQA, and rows with every key masked give weights 0 (entropy 0,
``max_key`` -1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from multihead._errors import bad_argument, describe
from multihead._indices import checked_indices
from multihead.backends.precision import compute_dtype
from multihead.backends.sinks import heads_of, per_row
from multihead.backends.weights import weight_blocks
from multihead.functional import attention_result, bound_call
from multihead.masks import Mask, to_device

__all__ = ["AttentionStats", "StatsSettings", "PoolGrid", "attention_stats", "DISTANCE_BANDS", "POOLS"]

# The lower ends of the distance bands, in tokens: 0 (the token itself), 1, 2-8, 9-64, 65-512, 513 and more.
DISTANCE_BANDS = (0, 1, 2, 9, 65, 513)
POOLS = ("max", "mean", "sum")  # a cell's largest weight, its mean, or its total
_LOG_FLOOR = -1e30  # below any log-weight of a kept pair; keeps 0 x log 0 at 0, not NaN
# query rows per block of the second pass: i / 16, from BLOCK_Q_FEWEST to BLOCK_Q_MOST. Taller blocks spend less on
# each block's dozen small ops, but across a causal diagonal they compute more pairs the mask drops. Interleaved, h = 4,
# causal: at n = 8192, 663 ms at 512 rows, 717 at 256, 766 at 1024, 805 at 128; at n = 1024 512 rows cost 7.7x the
# forward against 5.1x at 128
BLOCK_Q_FEWEST, BLOCK_Q_MOST = 128, 512
BLOCK_K = 256


def block_rows(i: int) -> int:
    """The query rows per block of the statistics' pass for i query rows (see BLOCK_Q_FEWEST)."""
    return min(BLOCK_Q_MOST, max(BLOCK_Q_FEWEST, i // 16))


@dataclass(frozen=True)
class PoolGrid:
    """The cell of the pooled map each query row and each key falls in, for a map that is not an even split of
    the call's own rows and keys: e.g. a window of a longer text, binned by the text's positions so that the
    windows' maps add up to the text's. ``rows`` (i,) and ``keys`` (j,): int cell indices in [0, P) and
    [0, Q); ``shape``: (P, Q). The indices stay on the host (each block reads its span of cells there, with no
    device sync); :func:`attention_stats` checks them against the call."""

    rows: torch.Tensor
    keys: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def even(cls, i: int, j: int, side: int) -> PoolGrid:
        """``pooled=side``: i rows and j keys in cells of ceil(i / side) x ceil(j / side) positions, at most side
        x side cells."""
        row_cell, key_cell = -(-i // min(side, i)), -(-j // min(side, j))  # positions per cell
        rows, keys = torch.arange(i) // row_cell, torch.arange(j) // key_cell
        return cls(rows, keys, (-(-i // row_cell), -(-j // key_cell)))


@dataclass(frozen=True)
class StatsSettings:
    """The options of :func:`attention_stats` beyond the call itself, for a recorder that runs it on every layer
    (:func:`multihead.capture`'s ``stats``): ``first_keys``, ``far``, ``top_k``, ``pooled`` and ``pool``,
    checked when a layer runs."""

    first_keys: int = 4
    far: int = 512
    top_k: int = 0
    pooled: int | PoolGrid | None = None
    pool: str = "max"

    def options(self) -> dict:
        return {
            "first_keys": self.first_keys,
            "far": self.far,
            "top_k": self.top_k,
            "pooled": self.pooled,
            "pool": self.pool,
        }


@dataclass(frozen=True)
class AttentionStats:
    """Exact statistics of one call's attention weights (see :func:`attention_stats`), in the compute dtype
    (float32 for half inputs, float64 for float64). Rows are the query rows asked for (``rows``), heads the heads
    asked for (``heads``), in their order.

    Per query row (b, heads, rows): ``entropy`` (nats), ``max_weight`` and ``max_key`` (the key holding it, -1
    for a row with every key masked), ``ahead`` (the weight on keys after the query). ``bands`` (b, heads, rows,
    6): the weight at each distance band of :data:`DISTANCE_BANDS` (absolute distance). ``first`` (b, heads,
    rows, first_keys): the weight on each of the first ``first_keys`` keys. ``sink_share`` (b, heads, rows): the
    weight on the call's learned sink (``sinks``; 0 without one), which the keys' weights leave. ``top_weights``,
    ``top_keys`` (b, heads, rows, top_k): the ``top_k`` largest weights and their keys, largest first (None
    without ``top_k``).

    Per key (b, heads, j): ``received``, the weight the key gets summed over the query rows ``rows`` (every row
    unless chosen); ``received_far``, the same from those of them at least ``far`` tokens after it.

    ``pooled`` (b, heads, P, Q): the (i, j) weights of the rows ``rows`` (the others count as 0) pooled over
    cells of ``ceil(i / pooled)`` x ``ceil(j / pooled)`` positions (at most ``pooled`` x ``pooled`` cells), or
    over a :class:`PoolGrid`'s cells: each cell's largest weight ("max"), its mean over the cell's (row, key)
    pairs ("mean") or its total ("sum"); None unless asked for. ``output``: (b, h, i, e), the attention output,
    computed on the way (all heads and rows).
    """

    output: torch.Tensor
    entropy: torch.Tensor
    max_weight: torch.Tensor
    max_key: torch.Tensor
    ahead: torch.Tensor
    bands: torch.Tensor
    first: torch.Tensor
    sink_share: torch.Tensor
    received: torch.Tensor
    received_far: torch.Tensor
    top_weights: torch.Tensor | None
    top_keys: torch.Tensor | None
    pooled: torch.Tensor | None
    heads: list[int]
    rows: list[int]
    far: int


@torch.no_grad()  # statistics, not a graph: the blocks keep no saved tensors for a backward
def attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    heads: Sequence[int] | int | None = None,
    rows: Sequence[int] | int | None = None,
    sinks: torch.Tensor | None = None,
    first_keys: int = 4,
    far: int = 512,
    top_k: int = 0,
    pooled: int | PoolGrid | None = None,
    pool: str = "max",
) -> AttentionStats:
    """Exact statistics of the attention weights softmax(q k^T * scale + mask), streamed block by block.

    Args:
        q, k, v, mask, causal, scale: as for :func:`multihead.attention` (shapes (b, h, i, d), (b, g, j, d),
            (b, g, j, e), or unbatched without b).
        heads: the query heads to measure (None: all; negative indices count from the end).
        rows: the query rows measured (None: all): their per-row statistics come back, and only they add to the
            column sums and the pooled map.
        sinks: (h,) or (b, h, i) learned sink logits, as :func:`multihead.attention` takes them: the weights are
            those it applies (each row's sum to 1 - ``sink_share``); the entropy counts the sink as one outcome.
        first_keys: how many leading keys ``first`` covers (Gu et al. 2024 measure the first one).
        far: the distance at or past which a query counts toward ``received_far``.
        top_k: the largest weights kept per row (0: none).
        pooled: the side of the pooled map, or a :class:`PoolGrid` placing each row and key in its cells (None:
            no map); ``pool``: "max", "mean" or "sum" over each cell.

    Returns:
        :class:`AttentionStats`. Its tensors lose the b axis for unbatched inputs.

    Raises:
        What :func:`multihead.attention` raises for its arguments, and ValueError or TypeError naming ``heads``,
        ``rows``, ``first_keys``, ``far``, ``top_k``, ``pooled`` or ``pool``.

    Example:
        >>> q = torch.randn(1, 2, 6, 8); k = v = torch.randn(1, 2, 6, 8)
        >>> stats = attention_stats(q, k, v, causal=True)
        >>> torch.allclose(stats.received.sum(-1), torch.tensor(6.0))  # each row's weights sum to 1: 6 rows
        True
    """
    call = bound_call(q, k, v, mask=mask, causal=causal, scale=scale, sinks=sinks)
    h, i, j = call.q.shape[1], call.q.shape[2], call.k.shape[2]
    chosen_heads = checked_indices("heads", heads, h, "head")
    chosen_rows = checked_indices("rows", rows, i, "query")
    first_keys = _count("first_keys", first_keys, 0, j, "e.g. first_keys=4")
    far = _count("far", far, 0, None, "e.g. far=512")
    top_k = _count("top_k", top_k, 0, j, "e.g. top_k=8, or 0 for none")
    grid = None if pooled is None else _pool_grid(pooled, i, j)
    if pool not in POOLS:
        raise bad_argument("pool", f"one of {list(POOLS)}", repr(pool), 'pass pool="max", "mean" or "sum"')

    b = call.q.shape[0]
    # with sinks, the LSE over keys and sink: the blocks' exp(s - lse) are then the weights applied
    result = attention_result(q, k, v, mask=mask, causal=causal, scale=scale, sinks=sinks, return_lse=True)
    assert result.lse is not None
    output, lse = result.output, result.lse
    if call.unbatched:
        output, lse = output.unsqueeze(0), lse.unsqueeze(0)
    work = compute_dtype(call.q.dtype)
    head_index = torch.tensor(chosen_heads, device=call.q.device)
    acc = _Accumulators(b, len(chosen_heads), i, j, work, call.q.device, first_keys, far, top_k, grid, pool)
    if rows is not None:  # only the chosen rows add to the column sums and the map
        acc.row_weight = torch.zeros(i, dtype=work, device=call.q.device)
        acc.row_weight[torch.tensor(chosen_rows, device=call.q.device)] = 1.0
    blocks = weight_blocks(
        call.q, call.k, lse, call.mask, call.scale, head_index, block_q=block_rows(i), block_k=BLOCK_K
    )
    for qb, kb, weights, log_weights, may_mask in blocks:  # (b, H, n, m): the exact weights, 0 where masked
        acc.add(qb, kb, weights, log_weights, j - i, may_mask)
    if sinks is not None:
        acc.add_sinks(lse.index_select(1, head_index).to(work), heads_of(sinks, head_index))
    return acc.result(output, chosen_heads, chosen_rows, far, call.unbatched)


def _pool_grid(pooled: object, i: int, j: int) -> PoolGrid:
    """``pooled`` as the grid of the map's cells: an int side (an even split), or a :class:`PoolGrid` checked
    against the call's i rows and j keys (its indices on the host)."""
    if not isinstance(pooled, PoolGrid):
        return PoolGrid.even(i, j, _count("pooled", pooled, 1, None, "e.g. pooled=512, a PoolGrid, or None"))
    shape = pooled.shape
    if not (
        isinstance(shape, tuple)
        and len(shape) == 2
        and all(isinstance(side, int) and not isinstance(side, bool) and side >= 1 for side in shape)
    ):
        raise bad_argument("pooled", "a PoolGrid whose shape is two ints >= 1", repr(shape), "pass shape=(P, Q)")
    for axis, cells, length, side in (("rows", pooled.rows, i, shape[0]), ("keys", pooled.keys, j, shape[1])):
        if not isinstance(cells, torch.Tensor) or cells.shape != (length,) or cells.is_floating_point():
            raise bad_argument(
                "pooled",
                f"a PoolGrid whose {axis} is an int tensor of shape ({length},), a cell per {axis[:-1]}",
                describe(cells),
                f"pass {axis}= a cell index for each of the call's {length} {axis}",
            )
        if length and not 0 <= int(cells.min()) <= int(cells.max()) < side:
            raise bad_argument(
                "pooled",
                f"{axis} cell indices in [0, {side})",
                f"[{int(cells.min())}, {int(cells.max())}]",
                f"pass indices below the shape's {side}",
            )
    return PoolGrid(pooled.rows.detach().cpu().long(), pooled.keys.detach().cpu().long(), shape)


def _count(name: str, value: object, low: int, high: int | None, fix: str) -> int:
    """``value`` as an int in [low, high] (high None: unbounded), else an error naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_argument(name, "an int", describe(value), f"pass {fix}", kind=TypeError)
    if value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise bad_argument(name, f"an int {bounds}", value, f"pass {fix}")
    return value


class _Accumulators:
    """The running statistics of one call, filled block by block (:meth:`add`), all rows and the chosen heads."""

    def __init__(self, b, heads, i, j, dtype, device, first_keys, far, top_k, grid, pool):
        zeros = {"dtype": dtype, "device": device}
        self.far, self.top_k, self.pool, self.first_keys = far, top_k, pool, first_keys
        self.row_weight: torch.Tensor | None = None  # (i,) 1 on the rows that add to the columns; None: every row
        self.neg_plogp = torch.zeros(b, heads, i, **zeros)  # the entropy: sum over keys of -p log p
        self.max_weight = torch.zeros(b, heads, i, **zeros)
        self.max_key = torch.full((b, heads, i), -1, dtype=torch.long, device=device)
        self.ahead = torch.zeros(b, heads, i, **zeros)
        self.bands = torch.zeros(b, heads, i, len(DISTANCE_BANDS), **zeros)
        self.first = torch.zeros(b, heads, i, first_keys, **zeros)
        self.sink_share = torch.zeros(b, heads, i, **zeros)
        self.received = torch.zeros(b, heads, j, **zeros)
        self.received_far = torch.zeros(b, heads, j, **zeros)
        self.edges = torch.tensor(DISTANCE_BANDS[1:], device=device)
        self._countdowns: dict[int, torch.Tensor] = {}  # m -> (m, m - 1, .., 1): _first_key_of's
        self._indicators: dict[tuple, torch.Tensor] = {}  # a block geometry's pairs per band, ahead and far
        # the running top-k: weights start below any weight, so the first block's fill them
        self.top_weights = torch.full((b, heads, i, top_k), -1.0, **zeros)
        self.top_keys = torch.full((b, heads, i, top_k), -1, dtype=torch.long, device=device)
        self.grid: PoolGrid | None = grid
        self.pooled: torch.Tensor | None = None
        if grid is not None:
            self.pooled = torch.zeros(b, heads, *grid.shape, **zeros)
            # sent without waiting for the device (a CPU tensor through pinned memory)
            self.row_cells, self.key_cells = to_device(grid.rows, device), to_device(grid.keys, device)
            self.spans: dict[tuple[str, int, int], tuple[int, int]] = {}  # a block's first and last cell, per axis

    def add(self, qb: range, kb: range, p: torch.Tensor, log_p: torch.Tensor, offset: int, may_mask: bool) -> None:
        """Fold in one block: ``p`` (b, H, n, m) the exact weights of query rows ``qb`` on keys ``kb`` (0 where
        masked) and ``log_p`` their logs (-inf where masked, if ``may_mask``; floored in place); query row r sits at
        position r + ``offset``.

        Every pass over the block is a float op or a plain reduction: here a comparison yielding bools, or a
        reduction with indices (max, argmax), cost 5-15x a float op or a sum on a 4 x 128 x 256 block."""
        rows, cols = slice(qb.start, qb.stop), slice(kb.start, kb.stop)
        # the entropy's terms, -p log p, from log p at hand (0 where masked: a finite floor times p = 0)
        self.neg_plogp[:, :, rows] -= (p * (log_p.clamp_min_(_LOG_FLOOR) if may_mask else log_p)).sum(-1)
        best = p.amax(-1)  # (b, H, n)
        better = best > self.max_weight[:, :, rows]  # a row's first key of the largest weight keeps it
        self.max_weight[:, :, rows] = torch.where(better, best, self.max_weight[:, :, rows])
        self.max_key[:, :, rows] = torch.where(better, self._first_key_of(p, best) + kb.start, self.max_key[:, :, rows])
        # Distances run over a block from `nearest` to `farthest`: a block far from the diagonal lies in one band
        # and on one side of `far`, and takes row or column sums; only blocks across a boundary go pair by pair,
        # with the block's (n, m) indicators of each band, of keys ahead and of far pairs, made once per geometry.
        nearest, farthest = qb.start + offset - (kb.stop - 1), qb.stop - 1 + offset - kb.start
        row_sums = p.sum(-1)
        if farthest < 0:  # every key ahead of the query
            self.ahead[:, :, rows] += row_sums
        elif nearest < 0:
            self.ahead[:, :, rows] += (p * self._pairs_where(qb, kb, offset, "ahead")).sum(-1)
        bands = self._bands_across(nearest, farthest)
        if len(bands) == 1:
            self.bands[:, :, rows, bands[0]] += row_sums
        else:
            for band in bands:
                self.bands[:, :, rows, band] += (p * self._pairs_where(qb, kb, offset, band)).sum(-1)
        counted = p if self.row_weight is None else p * self.row_weight[rows, None]  # the rows the columns add
        column_sums = counted.sum(-2)
        self.received[:, :, cols] += column_sums
        if nearest >= self.far:
            self.received_far[:, :, cols] += column_sums
        elif farthest >= self.far:
            self.received_far[:, :, cols] += (counted * self._pairs_where(qb, kb, offset, "far")).sum(-2)
        if kb.start < self.first_keys:
            count = min(self.first_keys, kb.stop) - kb.start
            self.first[:, :, rows, kb.start : kb.start + count] += p[..., :count]
        if self.top_k:
            block = p.topk(min(self.top_k, p.shape[-1]), dim=-1)
            weights = torch.cat([self.top_weights[:, :, rows], block.values], -1)
            keys = torch.cat([self.top_keys[:, :, rows], block.indices + kb.start], -1)
            kept = weights.topk(self.top_k, dim=-1)
            self.top_weights[:, :, rows] = kept.values
            self.top_keys[:, :, rows] = keys.gather(-1, kept.indices)
        if self.pooled is not None:
            self._pool(qb, kb, counted)

    def _first_key_of(self, p: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
        """(b, H, n) long: each row's first key in the block holding its largest weight ``best`` (b, H, n), by float
        ops alone: sign(p - best) is 0 there and -1 elsewhere, so (1 + sign) x (m, m - 1, .., 1) peaks at the first
        such key (p.max(-1)'s indices cost 14x p.amax(-1) here)."""
        m = p.shape[-1]
        countdown = self._countdowns.get(m)
        if countdown is None:
            countdown = self._countdowns[m] = torch.arange(m, 0, -1, dtype=p.dtype, device=p.device)
        at_best = torch.sign(p - best.unsqueeze(-1))
        return (m - torch.addcmul(countdown, at_best, countdown).amax(-1)).long()

    def _pairs_where(self, qb: range, kb: range, offset: int, which: int | str) -> torch.Tensor:
        """(n, m) 1.0 where the block's pair lies in distance band ``which`` (an int), or ahead of the query
        ("ahead"), or at least ``far`` tokens back ("far"); 0.0 elsewhere. Kept per the block's geometry (its first
        pair's distance and its size), which the blocks along a diagonal share."""
        key = (qb.start + offset - kb.start, len(qb), len(kb), which)
        indicator = self._indicators.get(key)
        if indicator is None:
            distance = self._distance(qb, kb, offset, self.edges.device)  # (n, m)
            if isinstance(which, int):
                kept = torch.bucketize(distance.abs(), self.edges, right=True) == which
            else:
                kept = distance < 0 if which == "ahead" else distance >= self.far
            indicator = self._indicators[key] = kept.to(self.bands.dtype)
        return indicator

    def _bands_across(self, nearest: int, farthest: int) -> range:
        """The distance bands of a block whose pairs' distances run from ``nearest`` to ``farthest``: those from its
        smallest absolute distance to its largest (one band: the block takes its row sums whole)."""
        low = 0 if nearest <= 0 <= farthest else min(abs(nearest), abs(farthest))
        return range(self._band(low), self._band(max(abs(nearest), abs(farthest))) + 1)

    def add_sinks(self, lse: torch.Tensor, sinks: torch.Tensor) -> None:
        """Fold in the learned sinks ((heads,) or (b, heads, i)), from the LSE over keys and sink (b, heads, i):
        each row's share on its sink, p = exp(s - lse), and its term of the entropy."""
        log_share = per_row(sinks, lse) - lse  # (b, heads, i): log p_sink <= 0
        self.sink_share = log_share.exp()
        self.neg_plogp -= self.sink_share * log_share

    @staticmethod
    def _distance(qb: range, kb: range, offset: int, device: torch.device) -> torch.Tensor:
        """(n, m): each query's position minus each key's."""
        positions = torch.arange(qb.start, qb.stop, device=device) + offset
        return positions[:, None] - torch.arange(kb.start, kb.stop, device=device)[None, :]

    @staticmethod
    def _band(distance: int) -> int:
        """The band of :data:`DISTANCE_BANDS` an absolute distance falls in."""
        return sum(distance >= low for low in DISTANCE_BANDS[1:])

    def _span(self, axis: str, block: range) -> tuple[int, int]:
        """The first and last cell the block's rows (or keys) fall in, read once per block on the host."""
        key = (axis, block.start, block.stop)
        if key not in self.spans:
            assert self.grid is not None
            cells = getattr(self.grid, axis)[block.start : block.stop]
            self.spans[key] = (int(cells.min()), int(cells.max()))
        return self.spans[key]

    def _pool(self, qb: range, kb: range, p: torch.Tensor) -> None:
        """Fold the block into the pooled map: its columns into their cells, then its rows."""
        assert self.pooled is not None
        reduce = "amax" if self.pool == "max" else "sum"
        first_col, last_col = self._span("keys", kb)
        first_row, last_row = self._span("rows", qb)
        col_bins = self.key_cells[kb.start : kb.stop]
        row_bins = self.row_cells[qb.start : qb.stop]
        by_cols = p.new_zeros(*p.shape[:-1], last_col - first_col + 1)  # weights are >= 0: 0 is amax's identity
        by_cols.scatter_reduce_(-1, (col_bins - first_col).expand_as(p), p, reduce=reduce)
        by_both = p.new_zeros(*p.shape[:2], last_row - first_row + 1, by_cols.shape[-1])
        index = (row_bins - first_row)[:, None].expand(by_cols.shape[-2], by_cols.shape[-1]).expand_as(by_cols)
        by_both.scatter_reduce_(-2, index, by_cols, reduce=reduce)
        target = self.pooled[:, :, first_row : last_row + 1, first_col : last_col + 1]
        if reduce == "amax":
            torch.maximum(target, by_both, out=target)
        else:
            target += by_both

    def result(
        self, output: torch.Tensor, heads: list[int], rows: list[int], far: int, unbatched: bool
    ) -> AttentionStats:
        """The statistics of the chosen rows (per-row fields) and of every key (the column sums)."""
        chosen = torch.tensor(rows, device=self.max_key.device)
        per_row = {
            "entropy": self.neg_plogp,
            "max_weight": self.max_weight,
            "max_key": self.max_key,
            "ahead": self.ahead,
            "bands": self.bands,
            "first": self.first,
            "sink_share": self.sink_share,
        }
        fields: dict[str, torch.Tensor | None] = {name: t.index_select(2, chosen) for name, t in per_row.items()}
        fields["received"], fields["received_far"] = self.received, self.received_far
        fields["top_weights"] = fields["top_keys"] = None
        if self.top_k:
            top_weights = self.top_weights.index_select(2, chosen).clamp_min(0.0)  # a masked key's place: 0, key -1
            top_keys = self.top_keys.index_select(2, chosen).masked_fill(top_weights == 0, -1)
            fields["top_weights"], fields["top_keys"] = top_weights, top_keys
        fields["pooled"] = self.pooled
        if self.pooled is not None and self.pool == "mean":
            rows_per_cell = self.row_cells.bincount(minlength=self.pooled.shape[-2])
            keys_per_cell = self.key_cells.bincount(minlength=self.pooled.shape[-1])
            pairs = (rows_per_cell[:, None] * keys_per_cell[None, :]).clamp_min(1)  # an empty cell stays 0
            fields["pooled"] = self.pooled / pairs.to(self.pooled)
        fields["output"] = output
        if unbatched:
            fields = {name: None if t is None else t.squeeze(0) for name, t in fields.items()}
        return AttentionStats(**fields, heads=heads, rows=rows, far=far)  # type: ignore[arg-type]
