"""A text far longer than a screen, through a model, head by head, in O(n) memory per head.

    found = multihead.lab.inspect.inspect_long(model, text)        # model: load_text_model(...), any on the kernel
    found.heads[0].bands       # the mean weight at each distance band (0, 1, 2-8, 9-64, 65-512, 513+ tokens)
    found.heads[0].role        # "sink", "heavy-hitter", "long-range", "local" or None (see LONG_ROLES)
    found.heads[0].pooled_map  # (P, P): the text's weights max-pooled over cells of pieces_per_cell pieces

Every chosen head's statistics come from :func:`multihead.attention_stats` through :func:`~multihead.capture`
(``stats=``): no n x n matrix is built. A text longer than the model's positions (``tokenizer.max_length``) is read
in windows that slide by half their length. Each window holds the text's leading special pieces ([CLS], <bos>),
a stretch of its body, and its trailing ones ([SEP]), as the model was trained to read. A body piece is measured
in the first window that holds it: for a causal model the one that gives it the most context before it (at
least half a window past the first window).

Per head, over the pieces measured: the mean weight in each distance band, the sink share (the mean weight on
the window's first piece, Gu et al. 2024's first-token share), the mean entropy and its profile along the text,
the heavy hitters (the pieces that receive the most attention from the measured queries, summed over the
windows), the pooled map of the text's weights, and the role of :data:`LONG_ROLES` its measures pass.

The pooled map splits the text into at most ``map_side`` stretches of ``pieces_per_cell`` pieces; its cell (I, J)
is the largest weight a measured query of stretch I gives a piece of stretch J ("max"), or the mean weight over
every (query, piece) pair of the two stretches ("mean"; a pair no window holds counts as 0). Each window's
statistics are pooled straight into the text's cells (a :class:`~multihead.streamed_stats.PoolGrid` of the
window's positions in the text), so the windows' maps add up to the text's along its diagonal band.
``LongInspection.reachable`` marks the cells holding a pair some window let the model see (for a causal model,
a piece at or before the query).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from multihead._errors import bad_argument, describe, positive_int
from multihead._indices import checked_indices
from multihead.capture import capture, part_sites
from multihead.lab.inspect.recording import head_numbers, is_causal_part
from multihead.lab.models.contract import evaluating, text_tokenizer
from multihead.streamed_stats import DISTANCE_BANDS, AttentionStats, PoolGrid, StatsSettings

__all__ = [
    "LONG_ROLES",
    "LongRole",
    "HeadProfile",
    "LongInspection",
    "inspect_long",
    "windows_of",
    "MAP_SIDE",
    "MAP_POOLS",
]


@dataclass(frozen=True)
class LongRole:
    """A role a head shows at long context: its measure, threshold and source."""

    name: str
    measure: str
    threshold: float
    source: str


# The one place the long-context role thresholds are set; a head takes the first whose measure reaches its
# threshold, in this order.
LONG_ROLES: tuple[LongRole, ...] = (
    LongRole("sink", "mean weight on the window's first piece", 0.3, "Gu et al. 2024"),
    LongRole("heavy-hitter", "mean weight on the 8 heaviest pieces of the window's body", 0.2, "multihead"),
    LongRole("long-range", "mean weight beyond 512 pieces back", 0.1, "multihead"),
    LongRole("local", "mean weight within 8 pieces", 0.5, "multihead"),
)
PROFILE_POINTS = 128  # the entropy profile: at most this many means along the text
HEAVY_HITTERS = 8  # the pieces that receive the most attention, kept per head
MAP_SIDE = 64  # the pooled map: at most this many stretches of the text a side
MAP_POOLS = ("max", "mean")
_WHOLE = 2**62  # a length no text reaches: the tokenizer reads it whole (the windows keep the model's positions)


@dataclass(frozen=True)
class HeadProfile:
    """One head over the text: ``bands`` (6,) the mean weight in each band of
    :data:`~multihead.streamed_stats.DISTANCE_BANDS`, ``sink`` the mean weight on the window's first piece,
    ``entropy`` the mean entropy (nats) and ``entropy_profile`` its means over consecutive stretches of the
    measured pieces (at most :data:`PROFILE_POINTS`); its ``role`` follows from them (:data:`LONG_ROLES`).
    ``heavy_hitters``: the :data:`HEAVY_HITTERS` pieces that receive the most of its attention, largest first,
    ``{"position", "piece", "share"}``: the share is the piece's column sum over the measured queries divided by
    their number (each query gives weight 1). ``heavy_share``: the mean weight a query gives the
    :data:`HEAVY_HITTERS` pieces of its window's body (special pieces left out: a leading one is the sink) that
    receive the most from the window's measured queries, Zhang et al. 2023's heavy hitters (H2O): a share of
    the window, so a longer text read in more windows does not dilute it. ``pooled_map``
    (P, P) float64: the text's weights pooled over stretches of it (see :class:`LongInspection`)."""

    layer: int
    head: int
    bands: list[float]
    sink: float
    entropy: float
    entropy_profile: list[float]
    heavy_hitters: list[dict] = field(default_factory=list)
    heavy_share: float = 0.0
    pooled_map: torch.Tensor | None = field(default=None, compare=False)

    @property
    def role(self) -> str | None:
        """The first role of :data:`LONG_ROLES` whose threshold its measure reaches, or None."""
        measures = {
            "sink": self.sink,
            "heavy-hitter": self.heavy_share,
            "long-range": self.long_range,
            "local": self.local,
        }
        return next((rule.name for rule in LONG_ROLES if measures[rule.name] >= rule.threshold), None)

    @property
    def local(self) -> float:
        """The mean weight within 8 pieces (the bands 0, 1 and 2-8)."""
        return sum(self.bands[:3])

    @property
    def long_range(self) -> float:
        """The mean weight beyond 512 pieces (the last band)."""
        return self.bands[-1]

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "head": self.head,
            "bands": self.bands,
            "sink": self.sink,
            "local": self.local,
            "long_range": self.long_range,
            "entropy": self.entropy,
            "entropy_profile": self.entropy_profile,
            "role": self.role,
            "heavy_hitters": self.heavy_hitters,
            "heavy_share": self.heavy_share,
            "map": None if self.pooled_map is None else _rounded(self.pooled_map),
        }


def _rounded(cells: torch.Tensor) -> list[list[float]]:
    """A map's cells to three significant digits: a map of 64 x 64 is tens of kilobytes of JSON, not hundreds."""
    return [[float(f"{value:.3g}") for value in row] for row in cells.tolist()]


@dataclass(frozen=True)
class LongInspection:
    """A long text through a model (see :func:`inspect_long`): ``pieces`` (the text's n pieces), ``windows``
    ((start, stop) of the body each window read, in piece positions), ``heads`` (a :class:`HeadProfile` per
    chosen head, by layer then head), the ``part`` and whether it is ``causal``. The heads' pooled maps: ``pool``
    ("max" or "mean") over cells of ``pieces_per_cell`` x ``pieces_per_cell`` pieces (the last row and column
    shorter); ``reachable`` (P, P) bool: the cells holding a (query, piece) pair some window let the model see."""

    model: str
    part: str
    causal: bool
    pieces: list[str]
    windows: list[tuple[int, int]]
    heads: list[HeadProfile]
    pool: str = "max"
    pieces_per_cell: int = 1
    reachable: torch.Tensor | None = field(default=None, compare=False)

    def to_dict(self) -> dict:
        """JSON-ready: kilobytes per head, whatever the text's length."""
        return {
            "model": self.model,
            "part": self.part,
            "causal": self.causal,
            "pieces": len(self.pieces),
            "windows": [list(window) for window in self.windows],
            "bands": [_band_name(index) for index in range(len(DISTANCE_BANDS))],
            "roles": [
                {"name": r.name, "measure": r.measure, "threshold": r.threshold, "source": r.source} for r in LONG_ROLES
            ],
            "map": {
                "pool": self.pool,
                "pieces_per_cell": self.pieces_per_cell,
                "reachable": None if self.reachable is None else self.reachable.int().tolist(),
            },
            "heads": [profile.to_dict() for profile in self.heads],
        }


def _band_name(index: int) -> str:
    low = DISTANCE_BANDS[index]
    if index + 1 == len(DISTANCE_BANDS):
        return f"{low}+"
    high = DISTANCE_BANDS[index + 1] - 1
    return str(low) if low == high else f"{low}-{high}"


def windows_of(body: int, size: int) -> list[tuple[int, int]]:
    """The (start, stop) stretches of a body of ``body`` pieces that windows of ``size`` body pieces read, sliding
    by half a window (the last one ending at the body's end), and the first piece each measures: returns
    [(start, stop), ...]; piece p is measured in the first window whose stretch holds it."""
    if body <= size:
        return [(0, body)]
    stride = max(1, size // 2)
    starts = list(range(0, body - size, stride)) + [body - size]
    return [(start, start + size) for start in dict.fromkeys(starts)]


def inspect_long(
    model: torch.nn.Module,
    text: str,
    *,
    part: str | None = None,
    layers: Sequence[int] | int | None = None,
    heads: Sequence[int] | int | None = None,
    window: int | None = None,
    map_side: int = MAP_SIDE,
    pool: str = "max",
    progress: Callable[[int, int], None] | None = None,
) -> LongInspection:
    """Measure every chosen head of ``model`` on ``text`` (see the module docstring).

    Args:
        model: a text model on the kernel with its tokenizer (:func:`multihead.integrations.load_text_model`).
        text: the text, of any length.
        part: the part of the model's attention (default its first).
        layers, heads: the layers and heads to measure (default all).
        window: pieces per window, specials included (default: the model's positions, ``tokenizer.max_length``).
        map_side: the pooled map's cells a side, at most (the text in stretches of ceil(n / map_side) pieces).
        pool: "max" (each cell's largest weight) or "mean" (its mean weight).
        progress: called as ``progress(done, total)`` after each window.

    Returns:
        :class:`LongInspection`.

    Raises:
        ValueError or TypeError naming ``text``, ``window``, ``map_side``, ``pool``, ``layers``, ``heads`` or
        ``part``.
    """
    tokenizer = text_tokenizer(model)
    if not isinstance(text, str) or not text.strip():
        raise bad_argument("text", "a non-empty text", describe(text), "pass the text to read")
    chosen_part, sites = part_sites(model, part)
    numbers, _ = head_numbers(model, sites=sites)
    chosen_layers = checked_indices("layers", layers, len(sites), "layer")
    size = checked_window(window, tokenizer.max_length)
    map_side = positive_int("map_side", map_side)
    if pool not in MAP_POOLS:
        raise bad_argument("pool", f"one of {list(MAP_POOLS)}", repr(pool), 'pass pool="max" or pool="mean"')
    batch = tokenizer.batch([text], max_length=_WHOLE)
    ids = batch.input_ids[0]
    pieces = batch.pieces[0]
    lead, trail = special_ends(pieces.word_ids)
    body = len(ids) - lead - trail
    if size <= lead + trail:
        raise bad_argument("window", f"more than the {lead + trail} special pieces", size, "pass a larger window")
    stretches = windows_of(body, size - lead - trail)
    causal = is_causal_part(model, chosen_part)
    cell = -(-len(ids) // min(map_side, len(ids)))  # pieces per stretch of the map
    side = -(-len(ids) // cell)
    # each layer's heads as capture reads `heads`: indices into the layer's own heads
    layer_heads = {layer: checked_indices("heads", heads, len(numbers[layer]), "head") for layer in chosen_layers}
    reading = _WindowReading(
        part=chosen_part, layers=chosen_layers, heads=heads, causal=causal, cell=cell, side=side, pool=pool
    )
    totals, reachable = _read_windows(model, ids, lead, trail, stretches, reading, progress)
    if pool == "mean":  # the summed weights over every (query, piece) pair of the two stretches
        per_cell = torch.bincount(torch.arange(len(ids)) // cell, minlength=side).double()
        for found in totals.values():
            assert found.map is not None
            found.map = found.map / (per_cell[:, None] * per_cell[None, :])
    profiles = [
        profile
        for layer in chosen_layers
        for profile in _head_profiles(layer, totals[layer], layer_heads[layer], numbers[layer], pieces.tokens)
    ]
    return LongInspection(
        model=getattr(model, "name", type(model).__name__),
        part=chosen_part,
        causal=causal,
        pieces=list(pieces.tokens),
        windows=stretches,
        heads=profiles,
        pool=pool,
        pieces_per_cell=cell,
        reachable=reachable,
    )


def checked_window(window: int | None, limit: int) -> int:
    """The pieces per window, specials included: ``window``, or the model's ``limit`` positions when None."""
    size = limit if window is None else window
    if not isinstance(size, int) or isinstance(size, bool) or not 2 <= size <= limit:
        raise bad_argument(
            "window", f"an int in [2, {limit}] (the model's positions)", describe(window), f"pass e.g. window={limit}"
        )
    return size


def special_ends(word_ids: Sequence[int | None]) -> tuple[int, int]:
    """(lead, trail): how many special pieces (no word) open and close the text; every window keeps them."""
    lead = next((index for index, word in enumerate(word_ids) if word is not None), len(word_ids))
    trail = next((index for index, word in enumerate(reversed(word_ids)) if word is not None), 0)
    return lead, trail


@dataclass(frozen=True)
class _WindowReading:
    """How :func:`_read_windows` reads each window: the ``part``, ``layers`` and ``heads`` captured (``heads`` as
    :func:`~multihead.capture.capture` reads it), whether the part is ``causal``, and the pooled map's ``cell``
    (pieces per stretch), ``side`` (stretches a side) and ``pool`` ("max" or "mean")."""

    part: str
    layers: list[int]
    heads: Sequence[int] | int | None
    causal: bool
    cell: int
    side: int
    pool: str


@dataclass
class _LayerTotals:
    """One layer's statistics for its h chosen heads, over the windows read so far (on the CPU, float64)."""

    bands: list[torch.Tensor] = field(default_factory=list)  # per window (h, rows, 6): each band's weight
    sink: list[torch.Tensor] = field(default_factory=list)  # per window (h, rows): the weight on its first piece
    entropy: list[torch.Tensor] = field(default_factory=list)  # per window (h, rows), nats
    received: torch.Tensor | None = None  # (h, n): the weight each piece of the text receives from the queries
    heavy: torch.Tensor | None = None  # (h,): the weight on each window's heaviest body pieces, summed
    map: torch.Tensor | None = None  # (h, side, side): the windows' cells max-ed (pool "max") or summed ("mean")

    def add(self, stats: AttentionStats, places: torch.Tensor, lead: int, trail: int, pieces: int, pool: str) -> None:
        """Add one window's statistics: ``stats`` of one text, the measured rows, (1, h, rows, ...), and the
        columns from them; ``places`` (window,) each window piece's position in the text of ``pieces``."""
        self.bands.append(stats.bands[0].double().cpu())
        self.sink.append(stats.first[0, :, :, 0].double().cpu())
        self.entropy.append(stats.entropy[0].double().cpu())
        if self.received is None:
            self.received = torch.zeros(stats.received.shape[1], pieces, dtype=torch.float64)
        self.received.index_add_(1, places, stats.received[0].double().cpu())
        window_body = stats.received[0, :, lead : len(places) - trail].double().cpu()
        heaviest = window_body.topk(min(HEAVY_HITTERS, window_body.shape[-1])).values.sum(-1)
        self.heavy = heaviest if self.heavy is None else self.heavy + heaviest
        assert stats.pooled is not None
        window_map = stats.pooled[0].double().cpu()
        if self.map is None:
            self.map = window_map
        elif pool == "max":
            torch.maximum(self.map, window_map, out=self.map)
        else:
            self.map += window_map


def _read_windows(
    model: torch.nn.Module,
    ids: torch.Tensor,
    lead: int,
    trail: int,
    stretches: list[tuple[int, int]],
    reading: _WindowReading,
    progress: Callable[[int, int], None] | None,
) -> tuple[dict[int, _LayerTotals], torch.Tensor]:
    """Every window of the text's (n,) ``ids`` through ``model``, each body ``stretches`` between the ``lead`` and
    ``trail`` specials: returns ({layer: its totals}, reachable (side, side) bool, see :class:`LongInspection`)."""
    device = next((parameter.device for parameter in model.parameters()), torch.device("cpu"))
    totals = {layer: _LayerTotals() for layer in reading.layers}
    cell, side = reading.cell, reading.side
    reachable = torch.zeros(side, side, dtype=torch.bool)
    measured_until = 0
    for index, (start, stop) in enumerate(stretches):
        window_ids = torch.cat([ids[:lead], ids[lead + start : lead + stop], ids[len(ids) - trail :]])
        # the rows this window measures: its body pieces no earlier window measured, with the text's leading
        # specials in the first window and its trailing ones in the last
        first_row = 0 if index == 0 else lead + measured_until - start
        last_row = lead + stop - start + (trail if index == len(stretches) - 1 else 0)
        rows = list(range(first_row, last_row))
        measured_until = stop
        # each of the window's pieces, as a position in the text
        places = torch.cat(
            [torch.arange(lead), lead + torch.arange(start, stop), len(ids) - trail + torch.arange(trail)]
        )
        grid = PoolGrid(rows=places // cell, keys=places // cell, shape=(side, side))
        settings = StatsSettings(first_keys=1, pooled=grid, pool="max" if reading.pool == "max" else "sum")
        reachable |= _reachable(places, places[rows], cell, side, reading.causal)
        with (
            evaluating(model),
            torch.no_grad(),
            capture(
                model,
                part=reading.part,
                layers=reading.layers,
                heads=reading.heads,
                queries=rows,
                weights=False,
                stats=settings,
            ) as rec,
        ):
            model(window_ids[None].to(device))
        for layer in reading.layers:
            totals[layer].add(rec.stats(layer), places, lead, trail, len(ids), reading.pool)
        if progress is not None:
            progress(index + 1, len(stretches))
    return totals, reachable


def _head_profiles(
    layer: int, totals: _LayerTotals, heads: list[int], numbers: Sequence[int], tokens: Sequence[str]
) -> list[HeadProfile]:
    """A :class:`HeadProfile` for each of a layer's chosen ``heads`` (indices into its own heads, whose checkpoint
    numbers ``numbers`` gives) from its ``totals`` over the text's pieces (``tokens``)."""
    bands = torch.cat(totals.bands, 1)  # (heads, measured, 6)
    sink = torch.cat(totals.sink, 1)
    entropy = torch.cat(totals.entropy, 1)
    assert totals.received is not None and totals.heavy is not None and totals.map is not None
    n = totals.received.shape[1]  # the text's pieces
    shares = totals.received / n  # each piece's share of all the attention measured (one per query)
    profiles = []
    for position, head in enumerate(heads):
        mean_bands = bands[position].mean(0).tolist()
        top = shares[position].topk(min(HEAVY_HITTERS, n))
        profiles.append(
            HeadProfile(
                layer=layer,
                head=numbers[head],
                bands=mean_bands,
                sink=float(sink[position].mean()),
                entropy=float(entropy[position].mean()),
                entropy_profile=_profile(entropy[position]),
                heavy_hitters=[
                    {"position": int(where), "piece": tokens[int(where)], "share": float(share)}
                    for share, where in zip(top.values, top.indices, strict=True)
                ],
                heavy_share=float(totals.heavy[position] / n),
                pooled_map=totals.map[position],
            )
        )
    return profiles


def _reachable(places: torch.Tensor, measured: torch.Tensor, cell: int, side: int, causal: bool) -> torch.Tensor:
    """(side, side) bool: the map's cells holding a pair of a measured query (``measured``: their positions in the
    text) and a piece of the window (``places``: its pieces' positions, in order) the model could see: any, or for a
    causal model one at or before the query."""
    beyond = int(places.max()) + 1  # past every piece of the window: a cell it has none of keeps it
    last_query = torch.full((side,), -1).scatter_reduce(0, measured // cell, measured, "amax")
    first_piece = torch.full((side,), beyond).scatter_reduce(0, places // cell, places, "amin")
    cells = (last_query >= 0)[:, None] & (first_piece < beyond)[None, :]
    return cells & (first_piece[None, :] <= last_query[:, None]) if causal else cells


def _profile(values: torch.Tensor) -> list[float]:
    """Means of ``values`` over at most :data:`PROFILE_POINTS` consecutive stretches of equal length (the last
    shorter)."""
    per_point = max(1, math.ceil(values.numel() / PROFILE_POINTS))
    return [float(chunk.mean()) for chunk in values.split(per_point)]
