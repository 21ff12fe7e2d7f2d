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

__all__ = ["FORMATS", "check_formats", "print_patching", "write_patching", "plot_patching"]

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
    return (
        f"{METHODS[result.method]} of each {result.by}'s {what}: share of the logit difference restored "
        f"(clean {result.clean:.3f}, corrupt {result.corrupt:.3f})"
    )


def print_patching(console: Console, result: PatchingResult) -> None:
    """The scores as a table: a row per layer, a column per head (or position), the largest |score| in bold."""
    console.print(_title(result), soft_wrap=True, markup=False, highlight=False)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("layer", justify="right")
    columns = result.scores.shape[1]
    label = "H" if result.by == "head" else "pos "
    for index in range(columns):
        table.add_column(f"{label}{index}", justify="right")
    finite = result.scores[~result.scores.isnan()]
    largest = float(finite.abs().max()) if finite.numel() else 0.0
    for layer, row in enumerate(result.scores.tolist()):
        cells = []
        for value in row:
            if value != value:
                cells.append("")
            else:
                text = f"{value:+.2f}"
                cells.append(f"[bold]{text}[/bold]" if largest and abs(value) >= 0.5 * largest else text)
        table.add_row(str(layer), *cells)
    console.print(table)


def plot_patching(result: PatchingResult, path: str | Path) -> Path:
    """The scores as a heatmap (layers down, heads or positions across; red restores, blue works against)."""
    plt = pyplot("the patching heatmap")
    scores = result.scores.double().numpy()
    finite = result.scores[~result.scores.isnan()]
    bound = max(float(finite.abs().max()) if finite.numel() else 1.0, 1e-9)
    layers, columns = scores.shape
    figure, axes = plt.subplots(figsize=(max(5.0, 1.8 + 0.45 * columns), max(3.2, 1.4 + 0.45 * layers)))
    image = axes.imshow(scores, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
    axes.set_xlabel("head" if result.by == "head" else "position")
    axes.set_ylabel("layer")
    axes.set_xticks(range(columns))
    axes.set_yticks(range(layers))
    axes.set_title(
        f"{METHODS[result.method]} of {result.what} by {result.by}\n"
        f"logit difference: clean {result.clean:.3f}, corrupt {result.corrupt:.3f}",
        fontsize=9,
    )
    figure.colorbar(image, ax=axes, label="share restored")
    return save_figure(figure, Path(path))


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
    written = Written()
    if not any(name in ("json", "png") for name in formats):
        return written
    out = output_folder(argument, folder)
    if "json" in formats:
        data = result.to_dict()
        scores = data.pop("scores")
        data["heads" if result.by == "head" else "positions"] = scores
        data.update(dict(prompts or {}))
        path = out / "patching.json"
        with writing(argument, path):
            path.write_text(json.dumps(data, indent=1), encoding="utf-8")
        written["json"] = path
    if "png" in formats:
        draw_figure(written, "png", out / "patching.png", lambda target: plot_patching(result, target))
    return written
