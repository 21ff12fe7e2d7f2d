"""A text far longer than a screen, through a model, head by head, in O(n) memory per head.

    found = multihead.inspect.inspect_long(model, text)        # model: load_text_model(...), any on the kernel
    found.heads[0].bands       # the mean weight at each distance band (0, 1, 2-8, 9-64, 65-512, 513+ tokens)
    found.heads[0].role        # "sink", "local", "long-range" or None (see LONG_ROLES)

Every chosen head's statistics come from :func:`multihead.attention_stats` through :func:`~multihead.capture`
(``stats=``): no n x n matrix is built. A text longer than the model's positions (``tokenizer.max_length``) is read
in windows that slide by half their length. Each window holds the text's leading special pieces ([CLS], <bos>),
a stretch of its body, and its trailing ones ([SEP]), as the model was trained to read. A body piece is measured
in the first window that holds it: for a causal model the one that gives it the most context before it (at
least half a window past the first window).

Per head, over the pieces measured: the mean weight in each distance band, the sink share (the mean weight on
the window's first piece, Gu et al. 2024's first-token share), the mean entropy and its profile along the text,
the heavy hitters (the pieces that receive the most attention from the measured queries, summed over the
windows), and the role of :data:`LONG_ROLES` its measures pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from multihead._errors import bad_argument, describe
from multihead._indices import checked_indices
from multihead.capture import capture, part_sites
from multihead.inspect.recording import head_numbers, is_causal_part
from multihead.models.contract import evaluating, text_tokenizer
from multihead.streamed_stats import DISTANCE_BANDS, StatsSettings

__all__ = ["LONG_ROLES", "LongRole", "HeadProfile", "LongInspection", "inspect_long", "windows_of"]


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
    LongRole("long-range", "mean weight beyond 512 pieces back", 0.1, "multihead"),
    LongRole("local", "mean weight within 8 pieces", 0.5, "multihead"),
)
PROFILE_POINTS = 128  # the entropy profile: at most this many means along the text
HEAVY_HITTERS = 8  # the pieces that receive the most attention, kept per head
_WHOLE = 2**62  # a length no text reaches: the tokenizer reads it whole (the windows keep the model's positions)


@dataclass(frozen=True)
class HeadProfile:
    """One head over the text: ``bands`` (6,) the mean weight in each band of
    :data:`~multihead.streamed_stats.DISTANCE_BANDS`, ``sink`` the mean weight on the window's first piece,
    ``entropy`` the mean entropy (nats) and ``entropy_profile`` its means over consecutive stretches of the
    measured pieces (at most :data:`PROFILE_POINTS`); its ``role`` follows from them (:data:`LONG_ROLES`).
    ``heavy_hitters``: the :data:`HEAVY_HITTERS` pieces that receive the most of its attention, largest first,
    ``{"position", "piece", "share"}``: the share is the piece's column sum over the measured queries divided by
    their number (each query gives weight 1)."""

    layer: int
    head: int
    bands: list[float]
    sink: float
    entropy: float
    entropy_profile: list[float]
    heavy_hitters: list[dict] = field(default_factory=list)

    @property
    def role(self) -> str | None:
        """The first role of :data:`LONG_ROLES` whose threshold its measure reaches, or None."""
        measures = {"sink": self.sink, "long-range": self.long_range, "local": self.local}
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
        }


@dataclass(frozen=True)
class LongInspection:
    """A long text through a model (see :func:`inspect_long`): ``pieces`` (the text's n pieces), ``windows``
    ((start, stop) of the body each window read, in piece positions), ``heads`` (a :class:`HeadProfile` per
    chosen head, by layer then head), the ``part`` and whether it is ``causal``."""

    model: str
    part: str
    causal: bool
    pieces: list[str]
    windows: list[tuple[int, int]]
    heads: list[HeadProfile]

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
    progress: Callable[[int, int], None] | None = None,
) -> LongInspection:
    """Measure every chosen head of ``model`` on ``text`` (see the module docstring).

    Args:
        model: a text model on the kernel with its tokenizer (:func:`multihead.integrations.load_text_model`).
        text: the text, of any length.
        part: the part of the model's attention (default its first).
        layers, heads: the layers and heads to measure (default all).
        window: pieces per window, specials included (default: the model's positions, ``tokenizer.max_length``).
        progress: called as ``progress(done, total)`` after each window.

    Returns:
        :class:`LongInspection`.

    Raises:
        ValueError or TypeError naming ``text``, ``window``, ``layers``, ``heads`` or ``part``.
    """
    tokenizer = text_tokenizer(model)
    if not isinstance(text, str) or not text.strip():
        raise bad_argument("text", "a non-empty text", describe(text), "pass the text to read")
    chosen_part, sites = part_sites(model, part)
    numbers, _ = head_numbers(model, sites=sites)
    chosen_layers = checked_indices("layers", layers, len(sites), "layer")
    limit = tokenizer.max_length
    size = limit if window is None else window
    if not isinstance(size, int) or isinstance(size, bool) or not 2 <= size <= limit:
        raise bad_argument(
            "window", f"an int in [2, {limit}] (the model's positions)", describe(window), f"pass e.g. window={limit}"
        )
    batch = tokenizer.batch([text], max_length=_WHOLE)
    ids = batch.input_ids[0]
    pieces = batch.pieces[0]
    word_ids = pieces.word_ids
    lead = next((index for index, word in enumerate(word_ids) if word is not None), len(word_ids))
    trail = next((index for index, word in enumerate(reversed(word_ids)) if word is not None), 0)
    body = len(ids) - lead - trail
    if size <= lead + trail:
        raise bad_argument("window", f"more than the {lead + trail} special pieces", size, "pass a larger window")
    stretches = windows_of(body, size - lead - trail)
    device = next((parameter.device for parameter in model.parameters()), torch.device("cpu"))
    per_layer: dict[int, dict[str, list[torch.Tensor]]] = {
        layer: {"bands": [], "sink": [], "entropy": []} for layer in chosen_layers
    }
    # the weight each piece of the text receives from the queries measured, per layer: (heads, n)
    received: dict[int, torch.Tensor] = {}
    # each layer's heads as capture reads `heads`: indices into the layer's own heads
    layer_heads = {layer: checked_indices("heads", heads, len(numbers[layer]), "head") for layer in chosen_layers}
    measured_until = 0
    settings = StatsSettings(sinks=1)
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
        with (
            evaluating(model),
            torch.no_grad(),
            capture(
                model, part=chosen_part, layers=chosen_layers, heads=heads, queries=rows, weights=False, stats=settings
            ) as rec,
        ):
            model(window_ids[None].to(device))
        for layer in chosen_layers:
            stats = rec.stats(layer)  # one text, the measured rows: (1, heads, rows, ...); the columns from them
            found = per_layer[layer]
            found["bands"].append(stats.bands[0].double().cpu())
            found["sink"].append(stats.first[0, :, :, 0].double().cpu())
            found["entropy"].append(stats.entropy[0].double().cpu())
            totals = received.setdefault(layer, torch.zeros(stats.received.shape[1], len(ids), dtype=torch.float64))
            totals.index_add_(1, places, stats.received[0].double().cpu())
        if progress is not None:
            progress(index + 1, len(stretches))
    profiles = []
    for layer in chosen_layers:
        bands = torch.cat(per_layer[layer]["bands"], 1)  # (heads, measured, 6)
        sink = torch.cat(per_layer[layer]["sink"], 1)
        entropy = torch.cat(per_layer[layer]["entropy"], 1)
        shares = received[layer] / len(ids)  # each piece's share of all the attention measured (one per query)
        for position, head in enumerate(layer_heads[layer]):
            mean_bands = bands[position].mean(0).tolist()
            top = shares[position].topk(min(HEAVY_HITTERS, len(ids)))
            profiles.append(
                HeadProfile(
                    layer=layer,
                    head=numbers[layer][head],
                    bands=mean_bands,
                    sink=float(sink[position].mean()),
                    entropy=float(entropy[position].mean()),
                    entropy_profile=_profile(entropy[position]),
                    heavy_hitters=[
                        {"position": int(where), "piece": pieces.tokens[int(where)], "share": float(share)}
                        for share, where in zip(top.values, top.indices, strict=True)
                    ],
                )
            )
    return LongInspection(
        model=getattr(model, "name", type(model).__name__),
        part=chosen_part,
        causal=is_causal_part(model, chosen_part),
        pieces=list(pieces.tokens),
        windows=stretches,
        heads=profiles,
    )


def _profile(values: torch.Tensor) -> list[float]:
    """Means of ``values`` over at most :data:`PROFILE_POINTS` consecutive stretches of equal length (the last
    shorter)."""
    per_point = max(1, math.ceil(values.numel() / PROFILE_POINTS))
    return [float(chunk.mean()) for chunk in values.split(per_point)]
