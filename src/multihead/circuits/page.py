"""The HTML page of `multihead circuits`: one self-contained file per command (patching.html, dla.html, lens.html,
detect.html) that opens offline.

    page = Page("activation patching of each head's output z", facts={"model": "gpt2", ...}, grids=[grid])
    html = render_page(page)

A page is a header (its title, then ``facts``: the model, the prompts, the logit differences), its ``notes``, its
grids and its tables, drawn by the jinja2 template ``templates/page.html.j2`` with its stylesheet inline: no
script, no external URL, no web font, and pure ASCII (see :mod:`multihead._html`), so it reads the same in any
browser, a notebook that strips scripts, or a mail attachment.

**A grid** is a layer x head (or layer x position) heatmap as an HTML table, ``table.grid``: a ``td.cell`` per
score with ``data-row``, ``data-column`` and ``data-value`` (the score as JSON writes it; empty where the layer
has no such head or position), its text the score to two decimals, its ``title`` naming the cell in full
("layer 1, head 0: +0.532"), and its background the score's colour on the diverging scale of
:func:`multihead.inspect.colours.score_rgb` over [-bound, bound] (the PNG's scale; dark cells get light text).
The legend under it (``.legend``) gives the scale's ends and what it measures.

**A table** is rows of text and numbers (the logit lens); a number is printed signed to three decimals and
shaded on the same scale, bounded by the largest magnitude in its table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from multihead._html import template_environment
from multihead.inspect.colours import SCORE_STOPS, score_rgb

__all__ = ["Grid", "Table", "Page", "render_page", "TEMPLATE"]

TEMPLATE = "page.html.j2"
_LIGHT_TEXT_FROM = 0.6  # a cell whose |score| / bound is at least this is dark: its text is drawn light


@dataclass(frozen=True)
class Grid:
    """One heatmap: ``scores`` (rows, columns) float (NaN where there is no such cell), the rows layers and the
    columns ``across`` ("head" or "position"), labelled ``columns`` (e.g. the prompt's tokens; None: their
    numbers), coloured over [-bound, bound] (None: the largest |score|, at least 1e-9) with ``label`` saying
    what the colour measures."""

    title: str
    scores: torch.Tensor
    across: str = "head"
    label: str = "score"
    columns: Sequence[str] | None = None
    bound: float | None = None

    def colour_bound(self) -> float:
        """The end of the colour scale: ``bound``, or the largest |score| (1 when every score is NaN), at least
        1e-9."""
        if self.bound is not None:
            return max(self.bound, 1e-9)
        finite = self.scores[~self.scores.isnan()]
        return max(float(finite.abs().max()) if finite.numel() else 1.0, 1e-9)


@dataclass(frozen=True)
class Table:
    """Rows of cells under ``header``: a string is shown as it is; a float is a signed number, shaded."""

    title: str
    header: Sequence[str]
    rows: Sequence[Sequence[str | float]]


@dataclass(frozen=True)
class Page:
    """A whole page: ``title``, ``facts`` ({name: value}, shown in order under it), then ``notes`` (lines),
    ``grids`` and ``tables``."""

    title: str
    facts: Mapping[str, str] = field(default_factory=dict)
    grids: Sequence[Grid] = ()
    tables: Sequence[Table] = ()
    notes: Sequence[str] = ()


def render_page(page: Page) -> str:
    """``page`` as one self-contained HTML document (str, pure ASCII)."""
    template = template_environment("multihead.circuits").get_template(TEMPLATE)
    return template.render(
        page=page,
        grids=[_grid_view(grid) for grid in page.grids],
        tables=[_table_view(table) for table in page.tables],
        ramp=", ".join(_css(rgb) for rgb in SCORE_STOPS),
    )


def _css(rgb: tuple[int, int, int]) -> str:
    return f"rgb({rgb[0]}, {rgb[1]}, {rgb[2]})"


def _shaded(value: float, bound: float) -> dict:
    """A number's cell: its background on the score scale, light text on a dark one."""
    style = f"background: {_css(score_rgb(value, bound))}"
    if abs(value) / bound >= _LIGHT_TEXT_FROM:
        style += "; color: #fff"
    return {"style": style}


def _grid_view(grid: Grid) -> dict:
    scores = grid.scores.detach().double().cpu()
    bound = grid.colour_bound()
    prefix = "H" if grid.across == "head" else "pos "
    columns = list(grid.columns) if grid.columns is not None else [f"{prefix}{i}" for i in range(scores.shape[1])]
    rows = []
    for layer, row in enumerate(scores.tolist()):
        cells = []
        for column, value in enumerate(row):
            where = f"layer {layer}, {grid.across} {column}" + (
                f" ({columns[column]})" if grid.columns is not None else ""
            )
            if math.isnan(value):
                cells.append({"value": "", "text": "", "title": f"{where}: none", "style": ""})
                continue
            cells.append(
                {"value": repr(value), "text": f"{value:+.2f}", "title": f"{where}: {value:+.3f}"}
                | _shaded(value, bound)
            )
        rows.append(cells)
    return {"grid": grid, "columns": columns, "rows": rows, "bound": f"{bound:.3g}"}


def _table_view(table: Table) -> dict:
    numbers = [abs(cell) for row in table.rows for cell in row if isinstance(cell, float) and not math.isnan(cell)]
    bound = max(max(numbers, default=1.0), 1e-9)
    rows = [
        [
            {"text": f"{cell:+.3f}", "number": True} | _shaded(cell, bound)
            if isinstance(cell, float)
            else {"text": cell, "number": False, "style": ""}
            for cell in row
        ]
        for row in table.rows
    ]
    return {"table": table, "rows": rows}
