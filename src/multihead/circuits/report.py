"""What `multihead circuits` prints and writes: each command's result as one :class:`~multihead.circuits.page.Page`,
shown in the terminal, written as an HTML page and a PNG, beside its data as JSON.

    page = patching_page(result, facts={"model": "gpt2", "clean": ..., ...}, columns=tokens)
    print_page(console, page)                                   # the terminal's tables
    written = write_report(data, "patching", out_dir, ["json", "html", "png"], page)

One page, four formats: the terminal prints each grid as a table (a row per layer, the larger half by magnitude in
bold) and each table; ``<name>.html`` is the page (:func:`~multihead.circuits.page.render_page`); ``<name>.png``
draws the page's grids as heatmaps on the same colour scale (with matplotlib; left out without it);
``<name>.json`` holds ``data``. ``patching.json`` holds the result
(:meth:`~multihead.circuits.PatchingResult.to_dict`) with its scores under ``"heads"`` (by head) or
``"positions"`` (by position) — layers x heads, or layers x positions, of the normalised logit difference
recovered, (patched - corrupt) / (clean - corrupt), at the last position; null where a layer has no such head —
and the prompts it was run with.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text

from multihead._errors import bad_argument
from multihead._figures import Written, draw_figure, pyplot, save_figure
from multihead._userfiles import output_folder, writing
from multihead.circuits.detectors import DETECTORS, SINK_THRESHOLD, HeadDetection
from multihead.circuits.lens import LogitAttribution
from multihead.circuits.page import Grid, Page, Table, render_page
from multihead.circuits.patching import PatchingResult
from multihead.inspect.colours import score_colormap

__all__ = [
    "FORMATS",
    "check_formats",
    "patching_page",
    "patching_data",
    "dla_page",
    "lens_page",
    "detect_page",
    "print_page",
    "plot_grids",
    "write_report",
]

FORMATS = ("terminal", "html", "json", "png")
METHODS = {"exact": "activation patching", "attribution": "attribution patching", "path": "path patching"}
WHATS = {"z": "output z", "pattern": "pattern", "q": "queries", "k": "keys", "v": "values"}
DETECTOR_TITLES = {
    "previous_token": "previous-token score (attention from each token to the one before it)",
    "duplicate_token": "duplicate-token score (attention to earlier copies of the same token)",
    "induction": "induction score (attention to the token after an earlier copy of the current one)",
    "sink": f"first-token share (a sink head above {SINK_THRESHOLD}, Gu et al. 2024)",
}


def check_formats(formats: str | Sequence[str], allowed: Sequence[str] = FORMATS) -> list[str]:
    """``formats`` ("terminal,json" or a list) as a list of ``allowed`` formats, or a ValueError naming ``format``."""
    names = [name.strip() for name in formats.split(",")] if isinstance(formats, str) else list(formats)
    names = [name for name in names if name]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise bad_argument(
            "format", f"one or more of {', '.join(allowed)}", repr(formats), "pass e.g. --format terminal,json"
        )
    return list(dict.fromkeys(names))


def patching_page(
    result: PatchingResult, facts: Mapping[str, str] | None = None, *, columns: Sequence[str] | None = None
) -> Page:
    """The page of a patching sweep: one grid (layers x heads, or layers x positions labelled ``columns``)."""
    what = WHATS[result.what]
    if result.method == "path":
        title = f"path patching into the receivers' {what}: each earlier head as a sender"
    else:
        title = f"{METHODS[result.method]} of each {result.by}'s {what}"
    title += f": share of the logit difference restored (clean {result.clean:.3f}, corrupt {result.corrupt:.3f})"
    grid = Grid(
        title,
        result.scores,
        across=result.by,
        label="share of the logit difference restored",
        columns=columns if result.by == "position" else None,
    )
    notes = [
        "(patched - corrupt) / (clean - corrupt) at the last position: 1 restores the clean answer, 0 does nothing"
    ]
    return Page(f"multihead circuits: {METHODS[result.method]}", dict(facts or {}), grids=[grid], notes=notes)


def patching_data(result: PatchingResult, facts: Mapping[str, object] | None = None) -> dict:
    """``patching.json``: the result with its scores under "heads" or "positions", and ``facts``."""
    data = result.to_dict()
    scores = data.pop("scores")
    data["heads" if result.by == "head" else "positions"] = scores
    return data | dict(facts or {})


def dla_page(found: LogitAttribution, answer: str, wrong: str, facts: Mapping[str, str] | None = None) -> Page:
    """The page of a direct logit attribution: the heads' grid and a table of the layers' totals."""
    title = (
        f"direct logit attribution at the last position: each head's share of logit({answer!r}) - "
        f"logit({wrong!r}) = {found.difference:.3f}"
    )
    layers = Table(
        "each attention layer's direct effect (its heads and its output bias)",
        ("layer", "direct effect"),
        [(f"layer {layer}", float(value)) for layer, value in enumerate(found.layers.tolist())],
    )
    notes = [
        f"the residual's parts through the final norm, linearised at the residual, sum to {found.explained:.3f}; "
        f"the model's logit difference is {found.difference:.3f}"
    ]
    grid = Grid(title, found.heads, label="direct effect on the logit difference")
    return Page("multihead circuits: direct logit attribution", dict(facts or {}), [grid], [layers], notes)


def lens_page(
    rows: Sequence[str], top: Sequence[Sequence[str]], differences, facts: Mapping[str, str] | None = None
) -> Page:
    """The page of the logit lens: a row per residual read, its likeliest tokens and (when given) the logit
    difference there."""
    header = ["after", "likeliest tokens", *(["answer - wrong"] if differences is not None else [])]
    table_rows = []
    for index, (row, tokens) in enumerate(zip(rows, top, strict=True)):
        cells: list[str | float] = [row, " ".join(repr(token) for token in tokens)]
        if differences is not None:
            cells.append(float(differences[index]))
        table_rows.append(cells)
    table = Table("logit lens at the last position: the likeliest tokens read after each layer", header, table_rows)
    return Page("multihead circuits: logit lens", dict(facts or {}), tables=[table])


def detect_page(found: HeadDetection, sequences: int, facts: Mapping[str, str] | None = None) -> Page:
    """The page of the head detectors: a grid per detector and the sink share, each on [0, 1]."""
    grids = [
        Grid(
            f"{DETECTOR_TITLES[name]}, on {sequences} repeated random sequences",
            getattr(found, name),
            bound=1.0,
            label="score" if name != "sink" else "share of attention on the first token",
        )
        for name in (*DETECTORS, "sink")
    ]
    note = f"sink heads (share above {SINK_THRESHOLD}): {found.sink_heads() or 'none'}"
    named = found.named_heads()
    roles = Table(
        "the heads the detectors name: their role in multihead inspect (a score at or above the role's threshold)",
        ("head", "role", "score"),
        [(f"L{entry['layer']} H{entry['head']}", entry["role"], entry["score"]) for entry in named],
    )
    notes = [note] + ([] if named else ["no head reaches a detector's threshold"])
    return Page("multihead circuits: head detectors", dict(facts or {}), grids, [roles] if named else [], notes)


def print_page(console: Console, page: Page) -> None:
    """The page's grids and tables as terminal tables, then its notes."""
    for grid in page.grids:
        _print_grid(console, grid)
    for table in page.tables:
        console.print(table.title, soft_wrap=True, markup=False, highlight=False)
        shown = RichTable(box=box.SIMPLE_HEAD, pad_edge=False)
        for name in table.header:
            shown.add_column(name, justify="left" if name == "likeliest tokens" else "right")
        for row in table.rows:  # Text: a token such as "[b]" is not rich markup
            shown.add_row(*(Text(f"{cell:+.3f}" if isinstance(cell, float) else cell) for cell in row))
        console.print(shown)
    for note in page.notes:
        console.print(note, soft_wrap=True, markup=False, highlight=False)


def _print_grid(console: Console, grid: Grid) -> None:
    """A grid as a table: a row per layer, a column per head (or position), the larger half by |score| in bold."""
    console.print(grid.title, soft_wrap=True, markup=False, highlight=False)
    table = RichTable(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("layer", justify="right")
    prefix = "H" if grid.across == "head" else "pos "
    for index in range(grid.scores.shape[1]):
        table.add_column(f"{prefix}{index}", justify="right")
    finite = grid.scores[~grid.scores.isnan()]
    largest = float(finite.abs().max()) if finite.numel() else 0.0
    for index, row in enumerate(grid.scores.tolist()):
        cells = [
            ""
            if value != value
            else (f"[bold]{value:+.2f}[/bold]" if largest and abs(value) >= 0.5 * largest else f"{value:+.2f}")
            for value in row
        ]
        table.add_row(str(index), *cells)
    console.print(table)


def plot_grids(grids: Sequence[Grid], path: str | Path) -> Path:
    """The grids as heatmaps, one above the other (layers down, heads or positions across), on the score scale
    of :func:`multihead.inspect.colours.score_colormap` symmetric around 0 (red positive, blue negative)."""
    plt = pyplot("the heatmap")
    columns = max(grid.scores.shape[1] for grid in grids)
    heights = [max(2.6, 1.4 + 0.45 * grid.scores.shape[0]) for grid in grids]
    figure, axes_list = plt.subplots(
        len(grids),
        1,
        figsize=(max(5.0, 1.8 + 0.45 * columns), sum(heights)),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for grid, axes in zip(grids, axes_list[:, 0], strict=True):
        scores = grid.scores.detach().double().cpu()
        bound = grid.colour_bound()
        layers, count = scores.shape
        image = axes.imshow(scores.numpy(), cmap=score_colormap(), vmin=-bound, vmax=bound, aspect="auto")
        axes.set_xlabel(grid.across)
        axes.set_ylabel("layer")
        axes.set_xticks(range(count))
        if grid.columns is not None:
            axes.set_xticklabels(list(grid.columns), rotation=60, ha="right", fontsize=7)
        axes.set_yticks(range(layers))
        axes.set_title("\n".join(textwrap.wrap(grid.title, 80)), fontsize=8)
        figure.colorbar(image, ax=axes, label=grid.label)
    return save_figure(figure, Path(path))


def write_report(
    data: Mapping[str, object],
    name: str,
    folder: str | Path,
    formats: Sequence[str],
    page: Page,
    *,
    argument: str = "folder",
) -> Written:
    """Write ``data`` as ``<name>.json``, ``page`` as ``<name>.html`` and its grids as ``<name>.png`` (those of
    ``formats`` asked for; a page without grids has no PNG) into ``folder``, created if missing. Returns
    {format: path}; a PNG left out without matplotlib is in ``skipped``. A folder that cannot be written raises
    ValueError naming ``argument``."""
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
    if "png" in formats and page.grids:
        draw_figure(written, "png", out / f"{name}.png", lambda target: plot_grids(page.grids, target))
    return written
