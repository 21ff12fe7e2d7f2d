"""What ``multihead inspect --browse`` shows of a :class:`~multihead.lab.inspect.browse.CorpusBrowse`.

- browse.html, the head browser (:func:`render_browser`, template ``templates/browse.html.j2``): a layer x head grid
  whose cells link to a card per head, each card with every measure's top contexts (the pieces shaded by the
  query's weight on them, the query outlined), each measure's histogram and the head's PCA projections. Static
  first (every card on the page; it opens offline, in a notebook that strips scripts, with JavaScript off), a small
  script on top showing one card at a time and the grid of any measure. Bounded: the facts name its limits.
- the terminal and browse.png (:func:`browse_page`): a grid of each measure's mean, and every head's top context
  per measure with the query marked ``<<like this>>``;
- browse.json: the whole browse (every kept context, histogram and projection).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from rich.console import Console

from multihead._figures import Written
from multihead._userfiles import output_folder, writing
from multihead.lab._html import template_environment
from multihead.lab.inspect.browse import MEASURES, CorpusBrowse, TopContext
from multihead.lab.inspect.colours import value_scale, weight_rgb
from multihead.lab.inspect.page import Grid, Page, Table, print_page, write_report

__all__ = ["browse_page", "print_browse", "write_browse", "render_browser", "head_roles", "context_text"]

# what each measure's mean is, for a grid's title
MEANING = {
    "max-off-sink": "the largest weight on a piece that is not a special piece",
    "output-norm": "the norm of the head's output (before W^O)",
    "entropy-low": "the entropy of its weights, nats",
    "entropy-high": "the entropy of its weights, nats",
    "previous-token": "the weight on the piece before the query",
    "prefix-matching": "the weight on the pieces after an earlier occurrence of the query's piece",
}
CONTEXT_SHOWN = 4  # pieces on each side of the query in the table (the JSON keeps the browse's own context)


def context_text(context: TopContext, side: int = CONTEXT_SHOWN) -> str:
    """The context's pieces within ``side`` of the query, the query marked (a special piece has brackets of its
    own): "the bank <<was>> full of"."""
    first = max(0, context.query - side)
    pieces = context.pieces[first : context.query + side + 1]
    at = context.query - first
    return " ".join(f"<<{piece}>>" if index == at else piece for index, piece in enumerate(pieces))


def _grid_of(found: CorpusBrowse, measure: str) -> torch.Tensor:
    """(layers, heads) the measure's mean per head, NaN where a layer lacks the head."""
    layers = sorted({head.layer for head in found.heads})
    numbers = sorted({head.head for head in found.heads})
    scores = torch.full((len(layers), len(numbers)), math.nan, dtype=torch.float64)
    for head in found.heads:
        scores[layers.index(head.layer), numbers.index(head.head)] = head.mean[measure]
    return scores


def browse_page(found: CorpusBrowse) -> Page:
    """The page of a browse: a grid per measure of :data:`MEASURES` (the entropy once), then the top contexts."""
    layers = [str(layer) for layer in sorted({head.layer for head in found.heads})]
    columns = [f"H{number}" for number in sorted({head.head for head in found.heads})]
    facts = {
        "model": found.model,
        "part": found.part + (" (causal)" if found.causal else ""),
        "corpus": f"{found.documents:,} documents, {found.queries:,} queries measured",
        "kept": f"the top {found.top_k} contexts per head and measure, {found.context} pieces each side",
    }
    grids = [
        Grid(
            f"{measure}: the mean over every query of {MEANING[measure]}",
            _grid_of(found, measure),
            label="mean",
            columns=columns,
            rows=layers,
            bound=1.0 if measure not in ("output-norm", "entropy-low") else None,
        )
        for measure in MEASURES
        if measure != "entropy-high"  # the same mean as entropy-low's
    ]
    rows: list[Sequence[str | float]] = []
    for head in found.heads:
        for measure in MEASURES:
            if head.top[measure]:
                best = head.top[measure][0]
                rows.append(
                    (f"L{head.layer} H{head.head}", measure, best.score, context_text(best), str(best.document))
                )
    table = Table(
        "each head's top context per measure: its score, the pieces around the query (<<marked>>), the document",
        ("head", "measure", "score", "context", "document"),
        rows,
    )
    return Page(f"every head over a corpus: {found.model}", facts=facts, grids=grids, tables=[table])


def print_browse(console: Console, found: CorpusBrowse) -> None:
    """The page on the terminal: its grids, then the top contexts."""
    print_page(console, browse_page(found))


def write_browse(
    found: CorpusBrowse,
    folder: str | Path,
    formats: Sequence[str],
    *,
    argument: str,
    roles: Mapping[tuple[int, int], str] | None = None,
) -> Written:
    """``browse.json``, ``browse.html`` (the head browser, :func:`render_browser`, with ``roles``) and
    ``browse.png`` (the grids) (those of ``formats`` asked for) into ``folder``."""
    written = write_report(
        found.to_dict(),
        "browse",
        folder,
        [name for name in formats if name != "html"],
        browse_page(found),
        argument=argument,
    )
    if "html" in formats:
        path = output_folder(argument, folder) / "browse.html"
        with writing(argument, path):
            path.write_text(render_browser(found, roles), encoding="ascii")
        written["html"] = path
    return written


# ------------------------------------------------------------------ the head browser page

MAIN_MEASURE = "max-off-sink"  # the grid's measure with scripts off (a menu picks another with them on)
CARD_PIECES = 6  # pieces shown on each side of a context's query on a card
PLOT_SIDE = 220  # a projection's picture, in pixels a side
HISTOGRAM_WIDTH, HISTOGRAM_HEIGHT = 120, 28


def head_roles(model, layers: Sequence[int] | None = None, heads: Sequence[int] | None = None) -> dict:
    """{(layer, head number): role label} of ``model``'s heads, labelled as ``multihead inspect`` labels them from
    the bundled corpus (:func:`~multihead.lab.inspect.head_stats`, :meth:`~multihead.lab.inspect.HeadStats.roles`)."""
    from multihead.lab.inspect.inspection import bundled_corpus
    from multihead.lab.inspect.stats import head_stats

    stats = head_stats(model, bundled_corpus(), layers=layers, heads=heads)
    labels = stats.roles()
    return {
        (layer, head): labels[row][column].label
        for row, layer in enumerate(stats.layers)
        for column, head in enumerate(stats.heads)
        if labels[row][column].label != "pruned"
    }


def render_browser(found: CorpusBrowse, roles: Mapping[tuple[int, int], str] | None = None) -> str:
    """The head browser (browse.html): the facts and the limits that bound it, a layer x head grid (each cell a
    link to its head's card, shaded by the head's mean of a measure, with that measure's histogram and the head's
    role from ``roles`` ({(layer, head): label}, e.g. :func:`head_roles`; none: no roles shown)), and a card
    per head: its top contexts per measure (each piece shaded by the query's weight on it, the query outlined),
    each measure's histogram, and its PCA projections. Static: with scripts off every card is on the page and the
    grid's links go to them; a script on top shows one card at a time and lets the grid show any measure."""
    template = template_environment("multihead.lab.inspect").get_template("browse.html.j2")
    layers = sorted({head.layer for head in found.heads})
    numbers = sorted({head.head for head in found.heads})
    by_place = {(head.layer, head.head): head for head in found.heads}
    measures = [measure for measure in MEASURES if measure != "entropy-high"]  # the same mean as entropy-low's
    grids = {}
    for measure in measures:
        values = _grid_of(found, measure)
        scale = value_scale(values, 1.0 if measure not in ("output-norm", "entropy-low") else None)
        grids[measure] = [
            [
                None
                if (layer, number) not in by_place
                else {
                    "id": _card_id(layer, number),
                    "value": scale.number(float(values[row, column]), 2),
                    "style": _background(scale, float(values[row, column])),
                    "bars": _bars(by_place[(layer, number)].histograms[measure]),
                    "role": (roles or {}).get((layer, number), ""),
                }
                for column, number in enumerate(numbers)
            ]
            for row, layer in enumerate(layers)
        ]
    facts = {
        "model": found.model,
        "part": found.part + (" (causal)" if found.causal else ""),
        "corpus": f"{found.documents:,} documents, {found.queries:,} queries measured",
        "limits": f"the top {found.top_k} contexts per head and measure ({found.context} pieces each side kept, "
        f"{CARD_PIECES} shown); {len(found.samples)} sampled pieces in each projection",
    }
    cards = [_card(found, head, (roles or {}).get((head.layer, head.head), "")) for head in found.heads]
    return template.render(
        title=f"every head over a corpus: {found.model}",
        facts=facts,
        layers=layers,
        numbers=numbers,
        measures=measures,
        meaning=MEANING,
        main=MAIN_MEASURE,
        grids=grids,
        cards=cards,
        side=PLOT_SIDE,
        histogram=(HISTOGRAM_WIDTH, HISTOGRAM_HEIGHT),
    )


def _card_id(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def _css(rgb: tuple[int, int, int]) -> str:
    return f"rgb({rgb[0]},{rgb[1]},{rgb[2]})"


def _background(scale, value: float) -> str:
    style = f"background:{_css(scale.rgb(value))}"
    return style + (";color:#fff" if scale.dark(value) else "")


def _bars(histogram) -> list[dict]:
    """A histogram as bars of the small picture: x, width and height in pixels, and each bin's range and count."""
    counts = [histogram.below, *histogram.counts, histogram.above]
    tallest = max(counts) or 1
    width = HISTOGRAM_WIDTH / len(counts)
    edges = histogram.edges
    labels = [f"below {edges[0]:.3g}"]
    labels += [f"{edges[b]:.3g} to {edges[b + 1]:.3g}" for b in range(len(edges) - 1)]
    labels.append(f"{edges[-1]:.3g} and above")
    return [
        {
            "x": round(index * width, 2),
            "width": round(max(width - 1, 0.5), 2),
            "height": round(HISTOGRAM_HEIGHT * count / tallest, 2),
            "title": f"{label}: {count:,}",
        }
        for index, (count, label) in enumerate(zip(counts, labels, strict=True))
    ]


def _card(found: CorpusBrowse, head, role: str) -> dict:
    contexts = {}
    for measure in MEASURES:
        rows = []
        for context in head.top[measure]:
            first = max(0, context.query - CARD_PIECES)
            stop = context.query + CARD_PIECES + 1
            pieces = [
                {
                    "text": piece,
                    "query": index + first == context.query,
                    "style": f"background:{_css(weight_rgb(weight))}" + (";color:#fff" if weight >= 0.5 else ""),
                    "title": f"weight {weight:.3f}",
                }
                for index, (piece, weight) in enumerate(
                    zip(context.pieces[first:stop], context.weights[first:stop], strict=True)
                )
            ]
            rows.append({"score": f"{context.score:.3f}", "document": context.document, "pieces": pieces})
        contexts[measure] = rows
    return {
        "id": _card_id(head.layer, head.head),
        "title": f"layer {head.layer}, head {head.head}" + (f": {role}" if role else ""),
        "mean": {measure: f"{value:.3f}" for measure, value in head.mean.items()},
        "contexts": contexts,
        "bars": {measure: _bars(histogram) for measure, histogram in head.histograms.items()},
        "plots": {name: _points(found, name, points) for name, points in head.projections.items()},
    }


def _points(found: CorpusBrowse, name: str, points: torch.Tensor) -> list[dict]:
    """A projection's points in the picture's pixels (its own square, 8 pixels of margin), each coloured by its
    piece (a hue from the piece's text: the same piece, the same colour, on every card), a key drawn as a square."""
    if points.numel() == 0:
        return []
    low, high = points.min(0).values, points.max(0).values
    span = torch.where(high > low, high - low, torch.ones_like(high))
    scaled = (points - low) / span * (PLOT_SIDE - 16) + 8
    pieces = [piece for _, _, piece in found.samples]
    shown = []
    for index, (x, y) in enumerate(scaled.tolist()):
        is_key = name == "queries and keys" and index >= len(pieces)
        piece = pieces[index % len(pieces)]
        hue = zlib.crc32(piece.encode("utf-8")) % 360
        shown.append(
            {
                "x": round(x, 1),
                "y": round(PLOT_SIDE - y, 1),  # up is up
                "key": is_key,
                "fill": f"hsl({hue},65%,45%)",
                "title": f"{'key' if is_key else 'query' if name == 'queries and keys' else 'piece'} {piece}",
            }
        )
    return shown
