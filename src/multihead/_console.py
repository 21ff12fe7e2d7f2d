"""The console the commands print to: rich's where the lab extra installed it, else plain text.

The core's commands (``multihead cost``) print tables and lines through :func:`make_console` and :func:`table`,
which need nothing but the standard library: with rich (the lab extra) they are rich's console and
``box.SIMPLE_HEAD`` table; without it, :class:`PlainConsole` and :class:`PlainTable` print the same cells as
aligned text, and rich's ``[bold]`` markup is dropped. Either way the console is :func:`report_width` columns
wide and a reader that stops reading (a closed pipe) silences it instead of ending the command.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from multihead._stdout import discard_stdout

__all__ = ["make_console", "table", "report_width", "PlainConsole", "PlainTable", "PIPED_WIDTH", "MIN_WIDTH"]

PIPED_WIDTH = 100  # the width of output that goes to a file or a pipe, unless COLUMNS says otherwise
MIN_WIDTH = 40  # narrower consoles are drawn at this width (a table column needs some room)
_MARKUP = re.compile(r"\[/?[a-z ]+\]")  # rich's style tags, [bold] ... [/bold]


def _rich_installed() -> bool:
    return importlib.util.find_spec("rich") is not None


def _terminal_columns(stream: object) -> int | None:
    """The width of the terminal ``stream`` writes to, or None when it is not a terminal."""
    try:
        if not stream.isatty():  # type: ignore[attr-defined]
            return None
        return os.get_terminal_size(stream.fileno()).columns  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # closed, replaced by an object without a descriptor
        return None


def _columns_variable(environ: Mapping[str, str]) -> int | None:
    """COLUMNS as a positive whole number, or None when it is unset or not one."""
    value = environ.get("COLUMNS", "").strip()
    return int(value) if value.isdigit() and 0 < len(value) <= 5 and int(value) > 0 else None


def report_width(
    stdout: object | None = None, *, environ: Mapping[str, str] | None = None, others: Sequence[object] | None = None
) -> int:
    """The width reports are drawn at.

    The terminal's width when ``stdout`` (default ``sys.stdout``) is a terminal. Otherwise (a pipe or a file)
    ``COLUMNS`` when it is set, else ``PIPED_WIDTH`` (100) — but never wider than the terminal the user sits at
    when one of ``others`` (default stderr and stdin) is one (``multihead inspect | less``). At least
    ``MIN_WIDTH``.
    """
    stdout = sys.stdout if stdout is None else stdout
    environ = os.environ if environ is None else environ
    width = _terminal_columns(stdout)
    if width is None:
        width = _columns_variable(environ) or PIPED_WIDTH
        for stream in (sys.stderr, sys.stdin) if others is None else others:
            real = _terminal_columns(stream)
            if real is not None:
                width = min(width, real)
                break
    return max(width, MIN_WIDTH)


def make_console() -> Any:
    """A console for reports on stdout, :func:`report_width` columns wide, rich's where installed (else
    :class:`PlainConsole`); a closed pipe silences it (the command carries on: see :func:`discard_stdout`)."""
    if not _rich_installed():
        return PlainConsole(width=report_width())
    from rich.console import Console

    class PipeConsole(Console):
        """rich's console, but a closed pipe silences it instead of exiting the program: rich's own answer is
        ``SystemExit(1)`` mid-command, which left ``inspect | head`` without its report files."""

        def on_broken_pipe(self) -> None:
            self.quiet = True  # nothing more is drawn; the command goes on and writes its files
            discard_stdout()

    return PipeConsole(width=report_width())


def table(title: str, columns: Sequence[tuple[str, str]]) -> Any:
    """A table titled ``title`` with ``columns`` (header, "left" or "right"): rich's (``box.SIMPLE_HEAD``, the title
    on the left above it, at the console's width: a :class:`~multihead._titled_table.TitledTable`) where installed,
    else a :class:`PlainTable`. Rows go in with ``add_row(*cells, style=None)``."""
    if not _rich_installed():
        return PlainTable(title, columns)
    from rich import box

    from multihead._titled_table import TitledTable

    made = TitledTable(box=box.SIMPLE_HEAD, title=title)
    for header, justify in columns:
        made.add_column(header, justify=justify)  # type: ignore[arg-type]
    return made


class PlainTable:
    """A table as aligned text: the title, the headers, a rule, the rows; columns two spaces apart."""

    def __init__(self, title: str, columns: Sequence[tuple[str, str]]):
        self.title, self.columns = title, list(columns)
        self.rows: list[list[str]] = []

    def add_row(self, *cells: str, style: str | None = None) -> None:
        self.rows.append([str(cell) for cell in cells])

    def lines(self) -> list[str]:
        widths = [max(len(header), *(len(row[k]) for row in self.rows)) for k, (header, _) in enumerate(self.columns)]

        def line(cells: Sequence[str]) -> str:
            aligned = [
                cell.rjust(width) if justify == "right" else cell.ljust(width)
                for cell, width, (_, justify) in zip(cells, widths, self.columns, strict=True)
            ]
            return "  ".join(aligned).rstrip()

        rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
        return [self.title, line([header for header, _ in self.columns]), rule, *(line(row) for row in self.rows)]


class PlainConsole:
    """What the commands ask of rich's console, in plain text: ``print`` of a string (rich markup dropped) or a
    :class:`PlainTable`, lines folded at ``width`` between words unless ``soft_wrap``."""

    def __init__(self, width: int):
        self.width = width
        self.quiet = False

    def print(
        self, *objects: object, style: str | None = None, soft_wrap: bool = False, markup: bool = True, **_: object
    ) -> None:
        if self.quiet:
            return
        for item in objects:
            text = str(item) if not markup else _MARKUP.sub("", str(item))
            lines = item.lines() if isinstance(item, PlainTable) else [text]
            for line in lines:
                try:
                    print(
                        line
                        if soft_wrap or isinstance(item, PlainTable)
                        else textwrap.fill(line, self.width, break_long_words=False, break_on_hyphens=False)
                    )
                except BrokenPipeError:  # the reader has gone: quiet from now on, as rich's console is here
                    self.quiet = True
                    discard_stdout()
                    return
