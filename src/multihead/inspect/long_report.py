"""What `multihead inspect --long FILE` prints and writes: each head's profile over a long text as a terminal table
(a row per head: its role, the weight within 8 pieces and beyond 512, the sink share, the mean entropy, the weight
in each distance band) and ``long.json`` (:meth:`~multihead.inspect.LongInspection.to_dict`: kilobytes per head,
whatever the text's length).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from multihead._figures import Written
from multihead._userfiles import output_folder, writing
from multihead.inspect.long import LONG_ROLES, LongInspection

__all__ = ["LONG_FORMATS", "print_long", "write_long"]

LONG_FORMATS = ("terminal", "json")


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
        table = Table(title=f"layer {layer}", box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
        for name in ("head", "role", "<= 8", "> 512", "sink", "entropy", *(f"{band}" for band in bands)):
            table.add_column(name, justify="left" if name == "role" else "right")
        for profile in (p for p in found.heads if p.layer == layer):
            table.add_row(
                str(profile.head),
                profile.role or "",
                f"{profile.local:.0%}",
                f"{profile.long_range:.0%}",
                f"{profile.sink:.0%}",
                f"{profile.entropy:.2f}",
                *(f"{value:.0%}" for value in profile.bands),
            )
        console.print(table)
    legend = "; ".join(f"{r.name}: {r.measure} >= {r.threshold:.0%} ({r.source})" for r in LONG_ROLES)
    console.print(Text(f"roles, the first reached: {legend}. Distance bands in pieces back.", style="dim"))


def write_long(found: LongInspection, folder: str | Path, formats: Sequence[str], *, argument: str) -> Written:
    """``long.json`` into ``folder`` (with "json" in ``formats``)."""
    written = Written()
    if "json" not in formats:
        return written
    path = output_folder(argument, folder) / "long.json"
    with writing(argument, path):
        path.write_text(json.dumps(found.to_dict(), indent=1), encoding="utf-8")
    written["json"] = path
    return written
