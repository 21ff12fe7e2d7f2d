"""What `multihead inspect --long FILE` prints and writes: each head's profile over a long text.

- terminal: a table per layer, a row per head: its role, the weight within 8 pieces and beyond 512, the sink
  share, the mean entropy, the weight in each distance band, the piece that receives the most of its attention
  (a window's special pieces count as the text's own: [CLS] gathers what every window's [CLS] receives);
- ``long.html`` (:func:`long_page`, drawn by :mod:`multihead.inspect.page`: static, offline): the heads' roles,
  shares and three heaviest hitters, their distance profiles (head x band) and their entropy along the text
  (head x stretch);
- ``long.png``: the same two grids as heatmaps;
- ``long.json``: :meth:`~multihead.inspect.LongInspection.to_dict`.

Every format is kilobytes per head, whatever the text's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text

from multihead._figures import Written
from multihead.inspect.long import LONG_ROLES, PROFILE_POINTS, LongInspection
from multihead.inspect.page import Grid, Page, Table, write_report

__all__ = ["print_long", "long_page", "write_long"]


def print_long(console: Console, found: LongInspection) -> None:
    """A table per layer: a row per head."""
    windows = len(found.windows)
    console.print(
        Text(
            f"{found.model}: {len(found.pieces):,} pieces in {windows} window{'s' if windows != 1 else ''} "
            f"({found.part}{', causal' if found.causal else ''})",
            style="bold",
        )
    )
    bands = found.to_dict()["bands"]
    for layer in dict.fromkeys(profile.layer for profile in found.heads):
        table = RichTable(title=f"layer {layer}", box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
        for name in (
            "head",
            "role",
            "<= 8",
            "> 512",
            "sink",
            "entropy",
            *(f"{band}" for band in bands),
            "most received",
        ):
            table.add_column(name, justify="left" if name in ("role", "most received") else "right")
        for profile in (p for p in found.heads if p.layer == layer):
            table.add_row(
                str(profile.head),
                profile.role or "",
                f"{profile.local:.0%}",
                f"{profile.long_range:.0%}",
                f"{profile.sink:.0%}",
                f"{profile.entropy:.2f}",
                *(f"{value:.0%}" for value in profile.bands),
                Text(_hitters(profile.heavy_hitters[:1])),
            )
        console.print(table)
    legend = "; ".join(f"{r.name}: {r.measure} >= {r.threshold:.0%} ({r.source})" for r in LONG_ROLES)
    console.print(Text(f"roles, the first reached: {legend}. Distance bands in pieces back.", style="dim"))


def _hitters(hitters: list[dict]) -> str:
    """Heavy hitters as "[CLS]@0 12% · the@41 3%": piece, position in the text, share of the attention."""
    return " \u00b7 ".join(f"{h['piece']}@{h['position']} {h['share']:.0%}" for h in hitters)


def long_page(found: LongInspection) -> Page:
    """The page of a long inspection: a table of the heads' roles and shares, a head x band grid of their distance
    profiles, and a head x stretch grid of their entropy along the text."""
    labels = [f"L{profile.layer} H{profile.head}" for profile in found.heads]
    windows = len(found.windows)
    size = found.windows[0][1] - found.windows[0][0]
    facts = {
        "model": found.model,
        "pieces": f"{len(found.pieces):,}",
        "read": f"in {windows} window{'s' if windows != 1 else ''} of {size} pieces of text, sliding by half"
        if windows > 1
        else "whole",
        "part": found.part + (" (causal)" if found.causal else ""),
    }
    roles = Table(
        "each head's role and shares: the weight within 8 pieces, beyond 512, and on the window's first piece; the "
        "pieces that receive most of its attention (piece@position share)",
        ("head", "role", "<= 8", "> 512", "sink", "most received"),
        [
            (
                label,
                profile.role or "",
                profile.local,
                profile.long_range,
                profile.sink,
                _hitters(profile.heavy_hitters[:3]),
            )
            for label, profile in zip(labels, found.heads, strict=True)
        ],
    )
    bands = Grid(
        "distance profile: the mean weight at each distance, in pieces (before the query, or after it where the head "
        "sees later pieces)",
        torch.tensor([profile.bands for profile in found.heads], dtype=torch.float64),
        across="distance",
        columns=found.to_dict()["bands"],
        label="mean weight",
        bound=1.0,
        down="head",
        rows=labels,
    )
    points = max(len(profile.entropy_profile) for profile in found.heads)
    entropy = torch.full((len(found.heads), points), torch.nan, dtype=torch.float64)
    for row, profile in enumerate(found.heads):
        entropy[row, : len(profile.entropy_profile)] = torch.tensor(profile.entropy_profile, dtype=torch.float64)
    along = Grid(
        f"entropy along the text: the mean over each of at most {PROFILE_POINTS} stretches of it, in nats",
        entropy,
        across="stretch",
        columns=[str(index) for index in range(points)],
        label="entropy (nats)",
        down="head",
        rows=labels,
        numbers=False,
    )
    legend = "; ".join(f"{r.name}: {r.measure} >= {r.threshold:.0%} ({r.source})" for r in LONG_ROLES)
    return Page(
        f"multihead inspect --long: {found.model}",
        facts,
        grids=[bands, along],
        tables=[roles],
        notes=[f"roles, the first reached: {legend}"],
    )


def write_long(found: LongInspection, folder: str | Path, formats: Sequence[str], *, argument: str) -> Written:
    """``long.json``, ``long.html`` and ``long.png`` (those of ``formats`` asked for) into ``folder``."""
    return write_report(found.to_dict(), "long", folder, formats, long_page(found), argument=argument)
