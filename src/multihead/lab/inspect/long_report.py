"""What `multihead inspect --long FILE` prints and writes: each head's profile over a long text.

- terminal: a table per layer, a row per head: its role, the sink share, the weight on its window's heavy
  hitters, the mean entropy, the weight in each distance band, the piece that receives the most of its attention
  (a window's special pieces count as the text's own: [CLS] gathers what every window's [CLS] receives); then
  each head's pooled map in shade characters, 16 x 8. A table wider than the console (it takes about 100
  columns) is split into blocks of neighbouring columns, each with the heads, by
  :func:`~multihead.lab.inspect.terminal.paged_tables`, the way plain inspect splits its layers: no column is cut;
- ``long.html`` (:func:`long_page`, drawn by :mod:`multihead.lab.inspect.page`: static, offline): the heads' roles,
  shares and three heaviest hitters, their distance profiles (head x band), their entropy along the text (head x
  stretch) and their pooled maps (a layer x head mosaic of inline PNGs). None of these numbers is negative, so
  the page's one choice of scale (:func:`~multihead.lab.inspect.colours.value_scale`) colours them from 0 and
  prints them unsigned;
- ``long.png``: the same two grids as heatmaps on the same scales, and the maps;
- ``long.json``: :meth:`~multihead.lab.inspect.LongInspection.to_dict`.

Every format is kilobytes per head, whatever the text's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from rich import box
from rich.columns import Columns
from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text

from multihead._figures import Written
from multihead._titled_table import TitledTable
from multihead.lab.inspect.colours import MASKED_RGB, weight_rgb_pixels
from multihead.lab.inspect.long import LONG_ROLES, PROFILE_POINTS, HeadProfile, LongInspection
from multihead.lab.inspect.page import Grid, Mosaic, Page, Table, write_report
from multihead.lab.inspect.terminal import paged_tables

__all__ = ["print_long", "long_page", "write_long", "map_pixels", "shaded_map", "SHADES"]

SHADES = "\u00b7\u2591\u2592\u2593\u2588"  # a map cell in the terminal: 0, then darker by the square root of its weight
_TERMINAL_MAP = (8, 16)  # character rows x columns of a head's map (a character is about twice as tall as wide)


def print_long(console: Console, found: LongInspection) -> None:
    """A table per layer, a row per head (in blocks of columns that fit ``console.width``); then the maps."""
    windows = len(found.windows)
    console.print(
        Text(
            f"{found.model}: {len(found.pieces):,} pieces in {windows} window{'s' if windows != 1 else ''} "
            f"({found.part}{', causal' if found.causal else ''})",
            style="bold",
        )
    )
    # the weight within 8 pieces and beyond 512 (the role's measures) are the bands' own: 0 to 2-8, and 513+
    columns = ("role", "sink", "hitters", "entropy", *found.to_dict()["bands"], "most received")
    for layer in dict.fromkeys(profile.layer for profile in found.heads):
        rows = [
            (
                str(profile.head),
                profile.role or "",
                f"{profile.sink:.0%}",
                f"{profile.heavy_share:.0%}",
                f"{profile.entropy:.2f}",
                *(f"{value:.0%}" for value in profile.bands),
                _hitters(profile.heavy_hitters[:1]),
            )
            for profile in found.heads
            if profile.layer == layer
        ]
        # narrower than the table (100 columns): blocks of neighbouring columns, each with the heads, as plain
        # inspect splits its layers
        for table in paged_tables(range(len(columns)), console.width, partial(_layer_table, layer, columns, rows)):
            console.print(table)
    legend = "; ".join(f"{r.name}: {r.measure} >= {r.threshold:.0%} ({r.source})" for r in LONG_ROLES)
    console.print(Text(f"roles, the first reached: {legend}. Distance bands in pieces back.", style="dim"))
    _print_maps(console, found)


def _layer_table(layer: int, columns: Sequence[str], rows: Sequence[Sequence[str]], shown: list[int]) -> RichTable:
    """One layer's table of its heads (``rows``: the head, then a cell per name of ``columns``), of the ``shown``
    columns (indices into ``columns``) after the head; a block after the first is titled "continued"."""
    title = f"layer {layer}" if shown[0] == 0 else f"layer {layer}, continued"
    table = TitledTable(  # collapsed padding: two spaces between columns, so a whole row fits 100 columns
        title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True
    )
    for name in ("head", *(columns[index] for index in shown)):
        # the role and the numbers keep their width; the piece most received wraps in what is left
        table.add_column(
            name,
            justify="left" if name in ("role", "most received") else "right",
            no_wrap=name != "most received",
            min_width=max(len(rule.name) for rule in LONG_ROLES) if name == "role" else max(len(name), 4),
        )
    for row in rows:  # Text: a piece such as "[CLS]" is not rich markup
        table.add_row(row[0], *(Text(row[1 + index]) for index in shown))
    return table


def _print_maps(console: Console, found: LongInspection) -> None:
    """Each head's pooled map in shade characters, the heads of a layer side by side as the width allows."""
    if found.reachable is None:
        return
    console.print(Text(_map_note(found) + f"; shades {SHADES} from 0 up, blank: {_UNSEEN}", style="dim"))
    for layer in dict.fromkeys(profile.layer for profile in found.heads):
        tiles = [
            Text(f"L{p.layer} H{p.head} {p.role or ''}\n" + "\n".join(shaded_map(found, p)))
            for p in found.heads
            if p.layer == layer and p.pooled_map is not None
        ]
        console.print(Columns(tiles, padding=(0, 3)))


def _scale(found: LongInspection, profile: HeadProfile) -> float:
    """What the darkest colour stands for: weight 1 in a max map; the head's largest cell in a mean map."""
    assert profile.pooled_map is not None
    return 1.0 if found.pool == "max" else max(float(profile.pooled_map.max()), 1e-12)


_UNSEEN = "no window let the model see the pair (for a causal model: a piece after the query)"


def _map_note(found: LongInspection) -> str:
    cells = f"{found.pieces_per_cell} x {found.pieces_per_cell} pieces"
    what = "the largest weight" if found.pool == "max" else "the mean weight, over the head's largest cell,"
    return f"pooled maps: queries down, pieces across, each cell {cells}; a cell's shade is {what} in it"


def shaded_map(found: LongInspection, profile: HeadProfile) -> list[str]:
    """A head's pooled map as lines of :data:`SHADES` (at most 8 lines of 16): each character pools its cells as
    the map does (max or mean), shaded by the square root of its share of :func:`_scale`; blank where no cell of
    it is reachable."""
    assert profile.pooled_map is not None and found.reachable is not None
    cells = profile.pooled_map.double()
    size = (min(_TERMINAL_MAP[0], cells.shape[0]), min(_TERMINAL_MAP[1], cells.shape[1]))
    pool = F.adaptive_max_pool2d if found.pool == "max" else F.adaptive_avg_pool2d
    values = pool(cells[None, None], size)[0, 0] / _scale(found, profile)
    seen = F.adaptive_max_pool2d(found.reachable.double()[None, None], size)[0, 0] > 0
    levels = (values.clamp(0, 1).sqrt() * (len(SHADES) - 1)).ceil().long()
    return [
        "".join(SHADES[level] if visible else " " for level, visible in zip(row, seen_row, strict=True))
        for row, seen_row in zip(levels.tolist(), seen.tolist(), strict=True)
    ]


def map_pixels(found: LongInspection, profile: HeadProfile) -> torch.Tensor:
    """(P, P, 3) uint8: a head's pooled map on the reports' weight ramp (square root; dark: :func:`_scale`), grey
    where no cell is reachable."""
    assert profile.pooled_map is not None and found.reachable is not None
    pixels = weight_rgb_pixels(profile.pooled_map / _scale(found, profile))
    pixels[~found.reachable] = torch.tensor(MASKED_RGB, dtype=torch.uint8)
    return pixels


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
        "each head's role and shares: the weight within 8 pieces, beyond 512, on the window's first piece and on the "
        "8 heaviest pieces of its body; the pieces that receive most of its attention (piece@position share)",
        ("head", "role", "<= 8", "> 512", "sink", "hitters", "most received"),
        [
            (
                label,
                profile.role or "",
                profile.local,
                profile.long_range,
                profile.sink,
                profile.heavy_share,
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
        mosaics=[] if found.reachable is None else [_maps_mosaic(found)],
    )


def _maps_mosaic(found: LongInspection) -> Mosaic:
    """The heads' pooled maps, a layer per row and a head per column."""
    layers = list(dict.fromkeys(profile.layer for profile in found.heads))
    heads = sorted({profile.head for profile in found.heads})
    by_place = {(profile.layer, profile.head): profile for profile in found.heads}
    tiles: list[list[torch.Tensor | None]] = []
    titles: list[list[str]] = []
    for layer in layers:
        tiles.append([])
        titles.append([])
        for head in heads:
            profile = by_place.get((layer, head))  # None: a head not chosen in this layer
            tiles[-1].append(None if profile is None else map_pixels(found, profile))
            titles[-1].append("" if profile is None else _tile_title(found, profile))
    return Mosaic(
        "pooled maps: where each head's attention goes over the whole text",
        tiles,
        titles,
        rows=[f"L{layer}" for layer in layers],
        columns=[f"H{head}" for head in heads],
        note=f"{_map_note(found)}, dark = {'1' if found.pool == 'max' else 'its largest'} on a square-root "
        f"scale; grey: {_UNSEEN}",
    )


def _tile_title(found: LongInspection, profile: HeadProfile) -> str:
    assert profile.pooled_map is not None
    largest = float(profile.pooled_map.max())
    return (
        f"layer {profile.layer}, head {profile.head}: {profile.role or 'no role'}; largest cell {largest:.3g} "
        f"({found.pool} over {found.pieces_per_cell} x {found.pieces_per_cell} pieces)"
    )


def write_long(found: LongInspection, folder: str | Path, formats: Sequence[str], *, argument: str) -> Written:
    """``long.json``, ``long.html`` and ``long.png`` (those of ``formats`` asked for) into ``folder``."""
    return write_report(found.to_dict(), "long", folder, formats, long_page(found), argument=argument)
