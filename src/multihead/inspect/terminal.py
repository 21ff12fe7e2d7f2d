"""The terminal view of an :class:`~multihead.inspect.report.Inspection`, drawn with rich in 100 columns.

Two tables: the layer x head grid of role labels, and for the selected token each head's two
most attended tokens with their weights (rows heads, columns layers). Heads go by their checkpoint
numbers; a head pruned from a layer reads "pruned" in both.

The header names the part shown when it is not a one-stack model's self-attention ("cross-attention:
decoder input -> source text") and says when it is causal ("causal: each token attends only to itself and
earlier tokens"); in cross-attention the attended tokens are the source text's (the key pieces), listed
under the query pieces.
"""

from __future__ import annotations

import sys

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from multihead.inspect.report import SPECIAL_TOKENS, Inspection
from multihead.inspect.stats import PRUNED

__all__ = ["make_console", "role_grid", "attention_table", "strongest_links", "print_inspection", "MAX_WIDTH"]

MAX_WIDTH = 100
_TOKEN_CHARS = 8  # longer word pieces are shortened so six layers fit in 100 columns
_ROLE_STYLES = {
    "prev": "cyan",
    "next": "cyan",
    "self": "cyan",
    "[CLS]": "magenta",
    "[SEP]": "magenta",
    "punct": "yellow",
    "broad": "green",
    "focused": "bold red",
    "mixed": "dim",
    PRUNED: "dim italic",
}


def make_console() -> Console:
    """A console for reports: the terminal's width up to 100 columns, and 100 when output is piped."""
    console = Console() if sys.stdout.isatty() else Console(width=MAX_WIDTH)
    console.width = min(console.width, MAX_WIDTH)
    return console


def _short(piece: str) -> str:
    return piece if len(piece) <= _TOKEN_CHARS else piece[: _TOKEN_CHARS - 1] + "~"


def role_grid(inspection: Inspection) -> Table:
    """Rows layers, columns heads, cells role labels."""
    roles = inspection.role_stats.roles()
    # 12 heads of labels up to 7 characters and one space each, beside the layer number: 99 columns
    table = Table(
        title=f"Head roles (from {inspection.role_stats.source})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1, 0, 0),
    )
    table.add_column("L", justify="right", style="bold", no_wrap=True)
    for head in inspection.heads:
        table.add_column(f"h{head}", justify="left", no_wrap=True)
    for layer, row in zip(inspection.layers, roles, strict=True):
        cells = [Text(role.label, style=_ROLE_STYLES.get(role.label, "cyan")) for role in row]
        table.add_row(str(layer), *cells)
    return table


def attention_table(inspection: Inspection, top: int = 2) -> Table:
    """Rows heads, columns layers: the key pieces the selected token attends to most, with percentages."""
    token = inspection.tokens[inspection.token]
    where = "" if inspection.same_axes else " in the source text"
    table = Table(
        title=f"Where '{token}' (token {inspection.token}) attends{where}: top {top} per head",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1),
    )
    table.add_column("head", justify="right", style="bold", no_wrap=True)
    for layer in inspection.layers:
        table.add_column(f"layer {layer}", no_wrap=True)
    present = inspection.present.tolist()
    for col, head in enumerate(inspection.heads):
        cells: list[str | Text] = []
        for row, layer in enumerate(inspection.layers):
            if not present[row][col]:
                cells.append(Text(PRUNED, style=_ROLE_STYLES[PRUNED]))
                continue
            lines = [
                f"{_short(piece):<{_TOKEN_CHARS}} {weight:4.0%}"
                for piece, _, weight in inspection.top_attended(layer, head, k=top)
            ]
            cells.append("\n".join(lines))
        table.add_row(f"h{head}", *cells)
    return table


def strongest_links(inspection: Inspection, count: int = 6) -> list[tuple[int, int, str, float]]:
    """The heads where the selected token puts most weight on another word (not itself, [CLS] or [SEP]); in
    cross-attention, on a word of the source text (any key piece but [CLS] and [SEP]).

    Returns up to ``count`` (layer, head, key piece, weight), strongest first.
    """
    links = []
    present = inspection.present.tolist()
    for row, layer in enumerate(inspection.layers):
        for col, head in enumerate(inspection.heads):
            if not present[row][col]:
                continue
            weights = inspection.weights[row, col, inspection.token]  # (j,)
            for key in weights.argsort(descending=True).tolist():
                piece = inspection.key_tokens[key]
                itself = inspection.same_axes and key == inspection.token
                if not itself and piece not in SPECIAL_TOKENS:
                    links.append((layer, head, piece, float(weights[key])))
                    break
    return sorted(links, key=lambda link: -link[3])[:count]


def print_inspection(inspection: Inspection, console: Console | None = None) -> None:
    """Print the header, the role grid and the token table to ``console`` (default: stdout, <= 100 cols)."""
    if console is None:
        console = make_console()
    pruned = int((~inspection.present).sum())
    same = inspection.same_axes
    console.print(
        Text(
            f"{inspection.model_name}: {len(inspection.layers)} layers x {len(inspection.heads)} heads "
            + (f"({pruned} pruned) " if pruned else "")
            + (
                f"on {len(inspection.tokens)} tokens"
                if same
                else f"from {len(inspection.tokens)} query tokens to {len(inspection.key_tokens)} key tokens"
            ),
            style="bold",
        )
    )
    for note in inspection.notes:
        console.print(Text(note, style="bold"))
    if same:
        console.print(Text(" ".join(inspection.tokens), overflow="fold"))
    else:
        console.print(Text("queries: " + " ".join(inspection.tokens), overflow="fold"))
        console.print(Text("keys:    " + " ".join(inspection.key_tokens), overflow="fold"))
    console.print()
    console.print(role_grid(inspection))
    console.print(
        Text(
            "prev/next/self: positional (Voita 2019); [CLS]/[SEP]: sink; punct; broad; focused "
            "(Clark 2019); mixed: none of these"
            + ("; pruned: the layer no longer has this head" if pruned else "")
            + ("; prev/next/self are the source positions i-1, i+1, i" if not same else ""),
            style="dim",
            overflow="fold",
        )
    )
    console.print()
    console.print(attention_table(inspection))
    links = strongest_links(inspection)
    if links:
        token = inspection.tokens[inspection.token]
        console.print(
            Text(
                f"Strongest links from '{token}' to {'another word' if same else 'a word of the source text'}: "
                + ", ".join(f"{piece} {weight:.0%} (L{layer} H{head})" for layer, head, piece, weight in links),
                overflow="fold",
            )
        )
