"""A static HTML page of grids and tables: `multihead circuits` writes one per command (patching.html, dla.html,
lens.html, detect.html), `multihead inspect --long` its long.html. Each opens offline.

    page = Page("activation patching of each head's output z", facts={"model": "gpt2", ...}, grids=[grid])
    html = render_page(page)

A page is a header (its title, then ``facts``: the model, the prompts, the logit differences), its ``notes``, its
grids and its tables, drawn by the jinja2 template ``templates/page.html.j2`` with its stylesheet inline: no
script, no external URL, no web font, and pure ASCII (see :mod:`multihead.lab._html`), so it reads the same in any
browser, a notebook that strips scripts, or a mail attachment.

**A grid** is a layer x head (or layer x position) heatmap as an HTML table, ``table.grid``: a ``td.cell`` per
score with ``data-row``, ``data-column`` and ``data-value`` (the score as JSON writes it; empty where the layer
has no such head or position), its text the score to two decimals, its ``title`` naming the cell in full
("layer 1, head 0: +0.532"), and its background the score's colour on the grid's scale (dark cells get light
text). The scale is :func:`multihead.lab.inspect.colours.value_scale` of its scores, chosen once from their sign
and shared by the HTML, the PNG and the terminal: diverging over [-bound, bound] with signed numbers when a score
is negative, else sequential over [0, bound] with unsigned ones (a mean weight, an entropy). The legend under it
(``.legend``) gives the scale's ends, its ramp and what it measures.

**A mosaic** is small pictures in a grid (``table.mosaic``; the long report's pooled maps, a layer x head grid of
them): each an inline PNG (``<img src="data:image/png;base64,...">``, drawn pixel for pixel and scaled up) with
its full name as its ``title`` and ``alt``.

**A table** is rows of text and numbers (the logit lens); a number is printed to three decimals and shaded on
the scale of its table's numbers (:func:`~multihead.lab.inspect.colours.value_scale`, bounded by their largest
magnitude): signed when one is negative.

The same page goes to the terminal (:func:`print_page`: a table per grid, the larger half by magnitude in bold,
each titled above it at the console's width) and to a PNG (:func:`plot_grids`: the grids as heatmaps on the same
colour scales, then the mosaics; a page of tables alone, the logit lens, draws its tables, shaded as in the HTML);
:func:`write_report` writes ``<name>.json`` (the data), ``<name>.html`` and ``<name>.png``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.text import Text

from multihead._figures import Written, draw_figure, fitted_title, pyplot, save_figure
from multihead._titled_table import TitledTable
from multihead._userfiles import output_folder, writing
from multihead.lab._html import template_environment
from multihead.lab._png import png_data_uri
from multihead.lab.inspect.colours import ValueScale, value_scale

__all__ = ["Grid", "Table", "Mosaic", "Page", "render_page", "print_page", "plot_grids", "write_report", "TEMPLATE"]

TEMPLATE = "page.html.j2"


@dataclass(frozen=True)
class Grid:
    """One heatmap: ``scores`` (rows, columns) float (NaN where there is no such cell), the rows ``down`` (layers
    unless said) labelled ``rows`` (None: their numbers) and the columns ``across`` ("head" or "position")
    labelled ``columns`` (e.g. the prompt's tokens; None: their numbers), coloured up to ``bound`` (None: the
    largest |score|, at least 1e-9) on the scale :meth:`scale` picks from the scores' sign, with ``label`` saying
    what the colour measures. ``numbers``: print each score in its cell (False: colour alone, for a wide grid;
    the cell's title still gives it)."""

    title: str
    scores: torch.Tensor
    across: str = "head"
    label: str = "score"
    columns: Sequence[str] | None = None
    bound: float | None = None
    down: str = "layer"
    rows: Sequence[str] | None = None
    numbers: bool = True

    def scale(self) -> ValueScale:
        """The grid's colour scale, for the HTML, the PNG and the terminal alike: diverging over [-bound, bound]
        when a score is negative, else sequential over [0, bound] (``bound``, or the largest |score|: 1 when every
        score is NaN)."""
        return value_scale(self.scores, self.bound)


@dataclass(frozen=True)
class Table:
    """Rows of cells under ``header``: a string is shown as it is; a float is a number, shaded on :meth:`scale`."""

    title: str
    header: Sequence[str]
    rows: Sequence[Sequence[str | float]]

    def scale(self) -> ValueScale:
        """The scale of the table's numbers (its float cells), bounded by their largest magnitude: diverging and
        printed signed when one is negative, else sequential from 0 and unsigned."""
        return value_scale([cell for row in self.rows for cell in row if isinstance(cell, float)])


@dataclass(frozen=True)
class Mosaic:
    """Small pictures in a grid: ``tiles[r][c]`` an (h, w, 3) uint8 RGB picture (None: no such tile, e.g. a head
    not chosen) named in full by ``titles[r][c]``, the rows labelled ``rows`` and the columns ``columns``;
    ``note`` says how to read them (the colour scale)."""

    title: str
    tiles: Sequence[Sequence[torch.Tensor | None]]
    titles: Sequence[Sequence[str]]
    rows: Sequence[str]
    columns: Sequence[str]
    note: str = ""


@dataclass(frozen=True)
class Page:
    """A whole page: ``title``, ``facts`` ({name: value}, shown in order under it), then ``notes`` (lines),
    ``grids``, ``tables`` and ``mosaics``."""

    title: str
    facts: Mapping[str, str] = field(default_factory=dict)
    grids: Sequence[Grid] = ()
    tables: Sequence[Table] = ()
    notes: Sequence[str] = ()
    mosaics: Sequence[Mosaic] = ()


def render_page(page: Page) -> str:
    """``page`` as one self-contained HTML document (str, pure ASCII)."""
    template = template_environment("multihead.lab.inspect").get_template(TEMPLATE)
    return template.render(
        page=page,
        grids=[_grid_view(grid) for grid in page.grids],
        tables=[_table_view(table) for table in page.tables],
        mosaics=[_mosaic_view(mosaic) for mosaic in page.mosaics],
    )


def _css(rgb: tuple[int, int, int]) -> str:
    return f"rgb({rgb[0]}, {rgb[1]}, {rgb[2]})"


def _shaded(value: float, scale: ValueScale) -> dict:
    """A number's cell: its background on ``scale``, light text on a dark one."""
    style = f"background: {_css(scale.rgb(value))}"
    if scale.dark(value):
        style += "; color: #fff"
    return {"style": style}


def _grid_view(grid: Grid) -> dict:
    scores = grid.scores.detach().double().cpu()
    scale = grid.scale()
    prefix = "H" if grid.across == "head" else "pos "
    columns = list(grid.columns) if grid.columns is not None else [f"{prefix}{i}" for i in range(scores.shape[1])]
    row_labels = list(grid.rows) if grid.rows is not None else [str(i) for i in range(scores.shape[0])]
    rows = []
    for index, row in enumerate(scores.tolist()):
        cells = []
        down = f"{grid.down} {index}" if grid.rows is None else row_labels[index]
        for column, value in enumerate(row):
            where = f"{down}, {grid.across} {column}" + (f" ({columns[column]})" if grid.columns is not None else "")
            if math.isnan(value):
                cells.append({"value": "", "text": "", "title": f"{where}: none", "style": ""})
                continue
            text = scale.number(value, 2) if grid.numbers else ""
            title = f"{where}: {scale.number(value, 3)}"
            cells.append({"value": repr(value), "text": text, "title": title} | _shaded(value, scale))
        rows.append({"label": row_labels[index], "cells": cells})
    ends = (f"-{scale.bound:.3g}", f"+{scale.bound:.3g}") if scale.signed else ("0", f"{scale.bound:.3g}")
    ramp = ", ".join(_css(rgb) for rgb in scale.stops)
    return {"grid": grid, "columns": columns, "rows": rows, "low": ends[0], "high": ends[1], "ramp": ramp}


def _table_view(table: Table) -> dict:
    scale = table.scale()
    rows = [
        [
            {"text": scale.number(cell, 3), "number": True} | _shaded(cell, scale)
            if isinstance(cell, float)
            else {"text": cell, "number": False, "style": ""}
            for cell in row
        ]
        for row in table.rows
    ]
    return {"table": table, "rows": rows}


def _mosaic_view(mosaic: Mosaic) -> dict:
    rows = [
        {
            "label": label,
            "tiles": [
                {"source": None if tile is None else png_data_uri(tile), "title": title}
                for tile, title in zip(tiles, titles, strict=True)
            ],
        }
        for label, tiles, titles in zip(mosaic.rows, mosaic.tiles, mosaic.titles, strict=True)
    ]
    return {"mosaic": mosaic, "rows": rows}


def print_page(console: Console, page: Page) -> None:
    """The page's grids and tables as terminal tables, each titled above it at the console's width (wrapped
    between words), then its notes."""
    for grid in page.grids:
        _print_grid(console, grid)
    for table in page.tables:
        shown = TitledTable(box=box.SIMPLE_HEAD, pad_edge=False, title=Text(table.title))  # Text: never markup
        scale = table.scale()
        for name in table.header:
            shown.add_column(name, justify="left" if name == "likeliest tokens" else "right")
        for row in table.rows:  # Text: a token such as "[b]" is not rich markup
            shown.add_row(*(Text(scale.number(cell, 3) if isinstance(cell, float) else cell) for cell in row))
        console.print(shown)
    for note in page.notes:
        console.print(note, soft_wrap=True, markup=False, highlight=False)


def _print_grid(console: Console, grid: Grid) -> None:
    """A grid as a table: a row per layer, a column per head (or position), the larger half by |score| in bold."""
    table = TitledTable(box=box.SIMPLE_HEAD, pad_edge=False, title=Text(grid.title))  # Text: never markup
    table.add_column(grid.down, justify="right")
    prefix = "H" if grid.across == "head" else "pos "
    for index in range(grid.scores.shape[1]):
        table.add_column(f"{prefix}{index}", justify="right")
    finite = grid.scores[~grid.scores.isnan()]
    largest = float(finite.abs().max()) if finite.numel() else 0.0
    scale = grid.scale()
    for index, row in enumerate(grid.scores.tolist()):
        cells = [
            ""
            if value != value
            else (
                f"[bold]{scale.number(value, 2)}[/bold]"
                if largest and abs(value) >= 0.5 * largest
                else scale.number(value, 2)
            )
            for value in row
        ]
        table.add_row(grid.rows[index] if grid.rows is not None else str(index), *cells)
    console.print(table)


TABLE_FONT = 9.0  # points: a table's cells in the PNG
TABLE_ROW_INCHES = 0.26  # a table's row in the PNG (its header too)


def plot_grids(
    grids: Sequence[Grid], path: str | Path, mosaics: Sequence[Mosaic] = (), tables: Sequence[Table] = ()
) -> Path:
    """The grids as heatmaps, one above the other (layers down, heads or positions across), each on its
    :meth:`Grid.scale` (the HTML's): diverging around 0 (red positive, blue negative) when a score is negative,
    else sequential from 0; then each mosaic as one picture of its tiles, its rows and columns labelled; then each
    table as a table, its numbers shaded on :meth:`Table.scale` as the HTML shades them."""
    plt = pyplot("the heatmap")
    columns = min(max((grid.scores.shape[1] for grid in grids), default=0), 40)  # a wider grid: narrower cells
    heights = [max(2.6, 1.4 + 0.3 * grid.scores.shape[0]) for grid in grids]
    heights += [1.2 + 1.6 * len(mosaic.rows) for mosaic in mosaics]
    heights += [0.5 + TABLE_ROW_INCHES * (len(table.rows) + 1) for table in tables]  # 0.5: the title, the margins
    width = max([5.0, 1.8 + 0.45 * columns, *(1.5 + 1.6 * len(mosaic.columns) for mosaic in mosaics)])
    figure, axes_list = plt.subplots(
        len(heights), 1, figsize=(width, sum(heights)), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    pictures = len(grids) + len(mosaics)  # the axes, top down: the grids', the mosaics', then the tables'
    for mosaic, axes in zip(mosaics, axes_list[len(grids) : pictures, 0], strict=True):
        _plot_mosaic(axes, mosaic)
    needed = [_plot_table(axes, table) for table, axes in zip(tables, axes_list[pictures:, 0], strict=True)]
    for grid, axes in zip(grids, axes_list[:, 0], strict=False):
        scores = grid.scores.detach().double().cpu()
        scale = grid.scale()
        layers, count = scores.shape
        image = axes.imshow(scores.numpy(), cmap=scale.colormap(), vmin=scale.low, vmax=scale.high, aspect="auto")
        axes.set_xlabel(grid.across)
        axes.set_ylabel(grid.down)
        if count <= 40:  # a wider grid (a profile along the text) keeps matplotlib's own ticks
            axes.set_xticks(range(count))
            if grid.columns is not None:
                axes.set_xticklabels(list(grid.columns), rotation=60, ha="right", fontsize=7)
        axes.set_yticks(range(layers))
        if grid.rows is not None:
            axes.set_yticklabels(list(grid.rows), fontsize=7)
        fitted_title(axes, grid.title, fontsize=8)
        figure.colorbar(image, ax=axes, label=grid.label)
    figure.set_figwidth(max([width, *needed]))  # a table needs room for its texts
    return save_figure(figure, Path(path))


def _plot_table(axes: Any, table: Table) -> float:
    """``table`` as a matplotlib table filling ``axes`` (no axis): its header in bold, its columns as wide as
    their longest texts are to one another, a number right-aligned on its shade of :meth:`Table.scale` (light
    text on a dark one), a text left-aligned as it is (a token such as "$" is not mathtext). Returns the width in
    inches the figure needs for the table's texts to fit."""
    scale = table.scale()
    texts = [[scale.number(cell, 3) if isinstance(cell, float) else cell for cell in row] for row in table.rows]
    shades = [
        [tuple(channel / 255 for channel in scale.rgb(cell)) if isinstance(cell, float) else "white" for cell in row]
        for row in table.rows
    ]
    axes.axis("off")
    drawn = axes.table(
        cellText=texts, cellColours=shades, colLabels=list(table.header), bbox=(0, 0, 1, 1), cellLoc="left"
    )
    drawn.auto_set_font_size(False)
    drawn.set_fontsize(TABLE_FONT)
    drawn.auto_set_column_width(list(range(len(table.header))))
    for (row, column), cell in drawn.get_celld().items():
        text = cell.get_text()
        text.set_parse_math(False)
        value = table.rows[row - 1][column] if row else None  # row 0: the header
        if row == 0:
            text.set_fontweight("bold")
        elif isinstance(value, float):
            text.set_horizontalalignment("right")
            if scale.dark(value):
                text.set_color("white")
    fitted_title(axes, table.title, fontsize=8)
    renderer = axes.figure.canvas.get_renderer()
    cells = drawn.get_celld()
    widest = [
        max(cells[row, column].get_required_width(renderer) for row in range(len(texts) + 1))
        for column in range(len(table.header))
    ]
    return 1.2 * sum(widest) / axes.figure.dpi + 0.4  # a fifth more air in the cells, a margin each side


def _plot_mosaic(axes: Any, mosaic: Mosaic) -> None:
    """The mosaic's tiles side by side in one picture (white between them and where a tile is missing)."""
    shown = [tile for row in mosaic.tiles for tile in row if tile is not None]
    height = max((tile.shape[0] for tile in shown), default=1)
    width = max((tile.shape[1] for tile in shown), default=1)
    gap = max(1, width // 16)
    canvas = torch.full(
        (len(mosaic.rows) * (height + gap), len(mosaic.columns) * (width + gap), 3), 255, dtype=torch.uint8
    )
    for r, row in enumerate(mosaic.tiles):
        for c, tile in enumerate(row):
            if tile is not None:
                top, left = r * (height + gap), c * (width + gap)
                canvas[top : top + tile.shape[0], left : left + tile.shape[1]] = tile.cpu()
    axes.imshow(canvas.numpy(), interpolation="nearest")
    axes.set_xticks([c * (width + gap) + width / 2 for c in range(len(mosaic.columns))])
    axes.set_xticklabels(list(mosaic.columns), fontsize=7)
    axes.set_yticks([r * (height + gap) + height / 2 for r in range(len(mosaic.rows))])
    axes.set_yticklabels(list(mosaic.rows), fontsize=7)
    axes.tick_params(length=0)
    fitted_title(axes, f"{mosaic.title} ({mosaic.note})" if mosaic.note else mosaic.title, fontsize=8)


def write_report(
    data: Mapping[str, object],
    name: str,
    folder: str | Path,
    formats: Sequence[str],
    page: Page,
    *,
    argument: str = "folder",
) -> Written:
    """Write ``data`` as ``<name>.json``, ``page`` as ``<name>.html`` and its grids and mosaics as ``<name>.png``
    (those of ``formats`` asked for; the PNG of a page without grids or mosaics draws its tables, and an empty page
    has none) into ``folder``, created if missing. Returns {format: path}; a PNG left out without matplotlib is in
    ``skipped``. A folder that cannot be written raises ValueError naming ``argument``."""
    written = Written()
    if not any(kind in ("json", "html", "png") for kind in formats):
        return written
    out = output_folder(argument, folder)
    if "json" in formats:
        path = out / f"{name}.json"
        with writing(argument, path):
            path.write_text(json.dumps(data, indent=1), encoding="utf-8")
        written["json"] = path
    if "html" in formats:
        path = out / f"{name}.html"
        with writing(argument, path):
            path.write_text(render_page(page), encoding="ascii")
        written["html"] = path
    if "png" in formats and (page.grids or page.mosaics or page.tables):
        # the PNG shows the page's pictures; a page of tables alone (the logit lens) shows its tables instead
        tables = () if page.grids or page.mosaics else page.tables

        def draw(target: Path) -> None:
            plot_grids(page.grids, target, page.mosaics, tables)

        draw_figure(written, "png", out / f"{name}.png", draw)
    return written
