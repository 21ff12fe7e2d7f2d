"""Every report of an inspection, written or printed: terminal, HTML, PNG and JSON.

    report(model, "The bank was full of money.", out_dir="report")   # report.html, heads.png, inspect.json
    write_reports(inspection, "report", ["terminal", "json"])           # an Inspection already made

This module calls every renderer; the renderers take the :class:`~multihead.lab.inspect.inspection.Inspection`
and know nothing of each other, and the Inspection knows none of them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console

from multihead._errors import bad_argument
from multihead._figures import Written, draw_figure
from multihead._userfiles import output_folder, writing
from multihead.lab.inspect.html import render_html
from multihead.lab.inspect.inspection import Inspection, inspect_text
from multihead.lab.inspect.plots import heatmap_grid
from multihead.lab.inspect.terminal import print_inspection
from multihead.lab.models.contract import TextEncoder

__all__ = ["FORMATS", "FILES", "check_formats", "report", "write_reports"]

FORMATS = ("terminal", "html", "png", "json")
FILES = {"html": "report.html", "png": "heads.png", "json": "inspect.json"}  # "terminal" prints


def check_formats(formats: Sequence[str] | str) -> list[str]:
    """Validated report formats (a list, or a comma-separated string).

    "png" is accepted without matplotlib installed: :func:`write_reports` then writes the other formats and
    leaves the PNG out (an optional figure never fails a report).
    """
    names = formats.split(",") if isinstance(formats, str) else list(formats)
    names = [name.strip() for name in names if name.strip()]
    unknown = [name for name in names if name not in FORMATS]
    if unknown or not names:
        raise bad_argument(
            "format",
            f"one or more of {', '.join(FORMATS)}",
            ", ".join(unknown) or "none",
            "pass e.g. --format terminal,html",
        )
    return names


def report(
    model: TextEncoder,
    text: str,
    *,
    out_dir: str | Path = "multihead-report",
    formats: Sequence[str] = ("html", "png", "json"),
    **options,
) -> Written:
    """Inspect ``text`` (options as :func:`~multihead.lab.inspect.inspect_text`) and write the reports; returns
    {format: path}.

    Files: ``report.html`` (self-contained, opens offline), ``heads.png`` (left out without matplotlib, see
    :func:`write_reports`), ``inspect.json``; "terminal" prints to the terminal.

    Example:
        >>> import tempfile
        >>> model, _ = multihead.lab.models.load_minilm()
        >>> paths = multihead.lab.inspect.report(model, "The bank was full of money.", out_dir=tempfile.mkdtemp())
        >>> sorted(paths)
        ['html', 'json', 'png']
    """
    chosen = check_formats(formats)
    inspection = inspect_text(model, text, **options)
    return write_reports(inspection, out_dir, chosen)


def write_reports(
    inspection: Inspection,
    out_dir: str | Path,
    formats: Sequence[str],
    console: Console | None = None,
    extra_columns: Mapping[str, Sequence[Sequence[float | None]]] | None = None,
    *,
    argument: str = "out_dir",
) -> Written:
    """Write (or print) ``inspection`` in each of ``formats``, the files before the terminal view; returns {format:
    path} for the files written.

    "png" without matplotlib installed is left out, the other formats written: the result's ``skipped`` holds
    {"png": path} (:func:`multihead._figures.skipped_note` is the line the CLI prints for it).

    ``console``: where "terminal" prints (default stdout at the terminal's width, 100 when piped).
    ``extra_columns``: per-head scores for the HTML page's table (see :func:`~multihead.lab.inspect.html.render_html`).
    ``out_dir`` is created when a file is to be written; a path that cannot be a writable folder raises
    ValueError naming ``argument`` (the CLI passes "--out").
    """
    chosen = check_formats(formats)
    paths = Written()
    directory = Path(out_dir)
    if any(name in FILES for name in chosen):
        directory = output_folder(argument, out_dir)
    for name in chosen:  # the files first: a reader that stops reading stdout (`| head`) cannot cost them
        if name == "terminal":
            continue
        path = directory / FILES[name]
        if name == "png":
            draw_figure(paths, name, path, lambda target: _draw_png(inspection, target, argument))
            continue
        paths[name] = path
        if name == "html":
            text = render_html(inspection, extra_columns)
        else:
            text = json.dumps(inspection.to_dict(), indent=1, allow_nan=False)
        with writing(argument, path):
            path.write_text(text, encoding="utf-8")
    if "terminal" in chosen:
        print_inspection(inspection, console)
    return paths


def _draw_png(inspection: Inspection, path: Path, argument: str) -> None:
    """heads.png at ``path``; a failed write names ``argument``."""
    with writing(argument, path):
        heatmap_grid(inspection, path)
