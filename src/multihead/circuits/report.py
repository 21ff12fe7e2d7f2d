"""What `multihead circuits` prints and writes: a patching sweep as a terminal table, a JSON file and a heatmap.

    print_patching(console, result)
    written = write_patching(result, out_dir, ["json", "png"], prompts={"clean": ..., ...})

``patching.json`` holds the result (:meth:`~multihead.circuits.PatchingResult.to_dict`) with its scores under
``"heads"`` (by head) or ``"positions"`` (by position) — layers x heads, or layers x positions, of the normalised
logit difference recovered, (patched - corrupt) / (clean - corrupt), at the last position; null where a layer
has no such head — and the prompts and tokens it was run with. ``patching.png`` draws the same grid (with
matplotlib; left out without it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from multihead._errors import bad_argument
from multihead._figures import Written, draw_figure, pyplot, save_figure
from multihead._userfiles import output_folder, writing
from multihead.circuits.patching import PatchingResult

__all__ = [
    "FORMATS",
    "check_formats",
    "print_patching",
    "write_patching",
    "plot_patching",
    "print_grid",
    "write_grid",
    "plot_grid",
    "print_lens",
    "write_lens",
]

FORMATS = ("terminal", "json", "png")
METHODS = {"exact": "activation patching", "attribution": "attribution patching", "path": "path patching"}


def check_formats(formats: str | Sequence[str]) -> list[str]:
    """``formats`` ("terminal,json" or a list) as a list of known formats, or a ValueError naming ``format``."""
    names = [name.strip() for name in formats.split(",")] if isinstance(formats, str) else list(formats)
    names = [name for name in names if name]
    unknown = [name for name in names if name not in FORMATS]
    if unknown or not names:
        raise bad_argument(
            "format", f"one or more of {', '.join(FORMATS)}", repr(formats), "pass e.g. --format terminal,json"
        )
    return list(dict.fromkeys(names))


def _title(result: PatchingResult) -> str:
    what = {"z": "output z", "pattern": "pattern", "q": "queries", "k": "keys", "v": "values"}[result.what]
    if result.method == "path":
        return (
            f"path patching into the receivers' {what}: each earlier head as a sender, its share of the logit "
            f"difference restored (clean {result.clean:.3f}, corrupt {result.corrupt:.3f})"
        )
    return (
        f"{METHODS[result.method]} of each {result.by}'s {what}: share of the logit difference restored "
        f"(clean {result.clean:.3f}, corrupt {result.corrupt:.3f})"
    )


def print_patching(console: Console, result: PatchingResult) -> None:
    """The scores as a table: a row per layer, a column per head (or position), the larger half in bold."""
    print_grid(console, _title(result), result.scores, column="H" if result.by == "head" else "pos ")


def _plot_title(result: PatchingResult) -> str:
    return (
        f"{METHODS[result.method]} of {result.what} by {result.by}\n"
        f"logit difference: clean {result.clean:.3f}, corrupt {result.corrupt:.3f}"
    )


def plot_patching(result: PatchingResult, path: str | Path) -> Path:
    """The scores as a heatmap (layers down, heads or positions across; red restores, blue works against)."""
    return plot_grid(result.scores, _plot_title(result), path, across=result.by, label="share restored")


def write_patching(
    result: PatchingResult,
    folder: str | Path,
    formats: Sequence[str],
    *,
    prompts: Mapping[str, str] | None = None,
    argument: str = "folder",
) -> Written:
    """Write the "json" and "png" of ``formats`` into ``folder`` (created if missing): patching.json and
    patching.png. Returns {format: path}; a PNG left out without matplotlib is in ``skipped``. A folder that
    cannot be written raises ValueError naming ``argument``."""
    data = result.to_dict()
    scores = data.pop("scores")
    data["heads" if result.by == "head" else "positions"] = scores
    data.update(dict(prompts or {}))
    return write_grid(
        data,
        "patching",
        folder,
        formats,
        grid=result.scores,
        title=_plot_title(result),
        across=result.by,
        label="share restored",
        argument=argument,
    )


def print_grid(console: Console, title: str, grid, *, column: str = "H", rows: Sequence[str] | None = None) -> None:
    """A (rows, columns) tensor of scores as a table under ``title``, the larger half by |score| in bold."""
    console.print(title, soft_wrap=True, markup=False, highlight=False)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("layer", justify="right")
    for index in range(grid.shape[1]):
        table.add_column(f"{column}{index}", justify="right")
    finite = grid[~grid.isnan()]
    largest = float(finite.abs().max()) if finite.numel() else 0.0
    for index, row in enumerate(grid.tolist()):
        cells = [
            ""
            if value != value
            else (f"[bold]{value:+.2f}[/bold]" if largest and abs(value) >= 0.5 * largest else f"{value:+.2f}")
            for value in row
        ]
        table.add_row(rows[index] if rows is not None else str(index), *cells)
    console.print(table)


def plot_grid(grid, title: str, path: str | Path, *, across: str = "head", label: str = "score") -> Path:
    """A (layers, columns) tensor as a heatmap, symmetric around 0 (red positive, blue negative)."""
    plt = pyplot("the heatmap")
    finite = grid[~grid.isnan()]
    bound = max(float(finite.abs().max()) if finite.numel() else 1.0, 1e-9)
    layers, columns = grid.shape
    figure, axes = plt.subplots(figsize=(max(5.0, 1.8 + 0.45 * columns), max(3.2, 1.4 + 0.45 * layers)))
    image = axes.imshow(grid.double().numpy(), cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
    axes.set_xlabel(across)
    axes.set_ylabel("layer")
    axes.set_xticks(range(columns))
    axes.set_yticks(range(layers))
    axes.set_title(title, fontsize=9)
    figure.colorbar(image, ax=axes, label=label)
    return save_figure(figure, Path(path))


def write_grid(
    data: Mapping[str, object],
    name: str,
    folder: str | Path,
    formats: Sequence[str],
    *,
    grid=None,
    title: str = "",
    across: str = "head",
    label: str = "score",
    argument: str = "folder",
) -> Written:
    """Write ``data`` as ``<name>.json`` and (with "png" and a ``grid``) ``grid`` as ``<name>.png`` into ``folder``
    (:func:`plot_grid` with ``title``, ``across`` and ``label``)."""
    written = Written()
    if not any(kind in ("json", "png") for kind in formats):
        return written
    out = output_folder(argument, folder)
    if "json" in formats:
        path = out / f"{name}.json"
        with writing(argument, path):
            path.write_text(json.dumps(data, indent=1), encoding="utf-8")
        written["json"] = path
    if "png" in formats and grid is not None:
        draw_figure(
            written,
            "png",
            out / f"{name}.png",
            lambda target: plot_grid(grid, title, target, across=across, label=label),
        )
    return written


def print_lens(console: Console, rows: Sequence[str], top: Sequence[Sequence[str]], differences) -> None:
    """The logit lens as a table: a row per residual read (after the embedding, after each layer), its likeliest
    tokens and, when given, the logit difference there."""
    console.print("logit lens at the last position: the likeliest tokens read after each layer", soft_wrap=True)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("after", justify="right")
    table.add_column("likeliest tokens")
    if differences is not None:
        table.add_column("answer - wrong", justify="right")
    for index, (row, tokens) in enumerate(zip(rows, top, strict=True)):
        cells = [row, " ".join(repr(token) for token in tokens)]
        if differences is not None:
            cells.append(f"{float(differences[index]):+.3f}")
        table.add_row(*cells)
    console.print(table)


def write_lens(data: Mapping[str, object], folder: str | Path, formats: Sequence[str], *, argument: str) -> Written:
    """``lens.json`` (with "json") into ``folder``."""
    return write_grid(data, "lens", folder, formats, argument=argument)
