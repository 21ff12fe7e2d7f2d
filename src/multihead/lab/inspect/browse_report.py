"""What ``multihead inspect --browse`` shows of a :class:`~multihead.lab.inspect.browse.CorpusBrowse`: a layer x head
grid of each measure's mean over the corpus, and a table of every head's top context per measure (the query
marked among its pieces), on the terminal, in browse.html (static, offline) and browse.png; browse.json holds
the whole browse (every kept context and histogram)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console

from multihead._figures import Written
from multihead.lab.inspect.browse import MEASURES, CorpusBrowse, TopContext
from multihead.lab.inspect.page import Grid, Page, Table, print_page, write_report

__all__ = ["browse_page", "print_browse", "write_browse", "context_text"]

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


def write_browse(found: CorpusBrowse, folder: str | Path, formats: Sequence[str], *, argument: str) -> Written:
    """``browse.json``, ``browse.html`` and ``browse.png`` (those of ``formats`` asked for) into ``folder``."""
    return write_report(found.to_dict(), "browse", folder, formats, browse_page(found), argument=argument)
