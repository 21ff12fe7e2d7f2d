"""What ``multihead bench`` prints on the terminal: the results of :func:`multihead.lab.bench.run` as rich tables that
fit 80 columns, with the machine, calibration and method lines and the notes (bench.json and the PNG are
written by :func:`multihead.lab.bench.write_reports`)."""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from multihead.lab.bench import HEADERS, header_lines, tables

__all__ = ["rich_tables", "print_report"]


def rich_tables(results: dict) -> list[tuple[str, Table]]:
    """:func:`~multihead.lab.bench.tables` as rich tables for the terminal: (title, table) per group and dtype.

    A case and its mode are written once, on their first peer's row; ours/peer comes with its range in brackets,
    "0.96 (0.89–1.17)". A quick or full run's table takes 79 columns; on a narrower console the case and the
    peer wrap at their spaces ("n=1024" over "causal") and the numbers never wrap.
    """
    out = []
    for title, rows in tables(results):
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
        for index, name in enumerate(HEADERS[:3]):  # wrap at spaces only: at least their longest word wide
            words = max((len(word) for row in rows for word in row[index].split()), default=0)
            table.add_column(name, min_width=max(words, len(name)), no_wrap=name == "mode", overflow="fold")
        for name in ("ms", "±", "ours/peer", "roofline"):
            table.add_column(name, no_wrap=True, justify="right")
        previous: tuple[str, str] | None = None
        for case, mode, peer, ms, spread, ratio, spread_of_ratio, share in rows:
            shown = ("", "") if (case, mode) == previous else (case, mode)
            ours_over = ratio if not spread_of_ratio else f"{ratio} ({spread_of_ratio})"
            table.add_row(*map(Text, (*shown, peer, ms, spread, ours_over, share)))
            previous = (case, mode)
        out.append((title, table))
    return out


def print_report(results: dict, console: Console, notes: Sequence[str] = ()) -> None:
    """What ``multihead bench`` prints: the machine, calibration and method lines, a rich table per group and
    dtype, and the results' notes and ``notes``; the prose wraps to the console's width."""
    for line in header_lines(results):
        console.print(Text(line, overflow="fold"), highlight=False)
    for title, table in rich_tables(results):
        console.print()
        console.print(Text(title, style="bold", overflow="fold"))
        console.print(table)
    for line in [*results["notes"], *notes]:
        console.print(Text(f"note: {line}", overflow="fold"), highlight=False)
