"""The terminal view of an :class:`~multihead.lab.inspect.inspection.Inspection`, drawn with rich to fit the width.

Two tables in one orientation, rows heads and columns layers: the grid of role labels with their strength
("[CLS] 61%", see :class:`~multihead.lab.inspect.roles.Role`), and for the selected token each head's two most
attended tokens with their weights. Heads go by their checkpoint numbers; a head pruned from a layer reads
"pruned" in both.

Both fit the console's width (80 columns and up) without cutting a cell: when the layers do not fit side by
side, they are split into groups of neighbouring layers, one table each (the heads, the rows, never need
splitting). In the token table, word pieces longer than the room a column has are shortened with "~"
(down to ``MIN_TOKEN_CHARS``; below that the layers are split instead), and a wider console shows more of
them (up to ``MAX_TOKEN_CHARS``).

The header names the part shown when it is not a one-stack model's self-attention ("cross-attention:
decoder input -> source text") and says when it is causal ("causal: each token attends only to itself and
earlier tokens"); in cross-attention the attended tokens are the source text's (the key pieces), listed
under the query pieces.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Sequence

from rich import box
from rich.cells import cell_len, set_cell_size
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from multihead._console import MIN_WIDTH, PIPED_WIDTH, make_console, report_width
from multihead._stdout import discard_stdout
from multihead.lab._words import counted
from multihead.lab.inspect.inspection import SPECIAL_TOKENS, Inspection
from multihead.lab.inspect.roles import NO_LEARNED_SINK
from multihead.lab.inspect.stats import PRUNED, Role

__all__ = [
    "make_console",
    "discard_stdout",
    "report_width",
    "role_grid",
    "role_grids",
    "attention_table",
    "attention_tables",
    "strongest_links",
    "near_duplicates_line",
    "paged_tables",
    "print_inspection",
    "PIPED_WIDTH",
    "MIN_WIDTH",
]

MIN_TOKEN_CHARS = 5  # a word piece is never shortened below this ("[CLS]" whole): the layers are split instead
MAX_TOKEN_CHARS = 12  # nor shown longer, however wide the console
_ROLE_STYLES = {
    "prev": "cyan",
    "next": "cyan",
    "self": "cyan",
    "[CLS]": "magenta",
    "[SEP]": "magenta",
    "punct": "yellow",
    "rare": "blue",
    "broad": "green",
    "focused": "bold red",
    PRUNED: "dim italic",
}
LEGEND = (
    "prev/next/self/pos+k: positional, rare: the rarest word (Voita 2019); [CLS]/[SEP]: sink; punct; broad; "
    "focused (Clark 2019); a relation (nsubj, ...): syntactic. The % is the label's strength; ?: low confidence"
)
# added to the legend when the roles weighed behaviour probes or the head detectors (on repeated random tokens)
BEHAVIOUR_LEGEND = (
    "; prefix/induction: prefix matching, and copying (Olsson 2022); prev-tok/dup-tok: previous- and "
    "duplicate-token heads (TransformerLens' detectors); sink: first-token share (Gu 2024)"
)

# added when a head's weight goes to its layer's learned sink (a model with sinks: gpt-oss and its kin)
LEARNED_SINK_LEGEND = "; learned sink: the weight a head leaves its keys for the layer's learned sink logit (gpt-oss)"


def _has_learned_sinks(inspection: Inspection) -> bool:
    """Whether any head of the statistics the roles come from puts a measurable share on a learned sink."""
    shares = inspection.role_stats.values.get("learned_sink")
    return shares is not None and bool((shares > NO_LEARNED_SINK).any())


# --------------------------------------------------------------------------- the console


# --------------------------------------------------------------------------- fitting tables to the width


def _table_width(table: Table) -> int:
    """The columns ``table`` takes when nothing in it is wrapped or cut."""
    console = Console(width=10_000, file=io.StringIO(), color_system=None)
    return Measurement.get(console, console.options, table).maximum


def _split(items: Sequence[int], groups: int) -> list[list[int]]:
    """``items`` in ``groups`` runs of neighbours whose sizes differ by at most one (the first ones larger)."""
    size, extra = divmod(len(items), groups)
    runs, start = [], 0
    for group in range(groups):
        end = start + size + (group < extra)
        runs.append(list(items[start:end]))
        start = end
    return runs


def paged_tables(columns: Sequence[int], width: int, build: Callable[[list[int]], Table]) -> list[Table]:
    """Tables of ``build(columns of a block)`` for the fewest blocks of neighbouring ``columns`` that each fit
    ``width``: the one way every terminal table of the lab splits (the layers of the role grid and the token
    table; the measures of ``inspect --long``'s table). ``build`` repeats the row labels in each block. One
    column per table when even one is wider (rich then wraps its cells)."""
    for groups in range(1, len(columns) + 1):
        tables = [build(run) for run in _split(columns, groups)]
        if all(_table_width(table) <= width for table in tables):
            return tables
    return tables


def _new_table() -> Table:
    # no outer padding or edge; columns two apart (one padding, one blank divider)
    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))


def _shortened(piece: str, chars: int) -> str:
    """``piece`` in at most ``chars`` cells: longer ones are cut and end in "~"."""
    return piece if cell_len(piece) <= chars else set_cell_size(piece, chars - 1) + "~"


# --------------------------------------------------------------------------- the role grid


def _role_cell(role: Role) -> Text:
    """The label with its strength ("[CLS] 61%"), coloured by kind; a low-confidence label (no behaviour measured
    near its threshold: only the strongest guess) ends in "?" and is dim."""
    style = _ROLE_STYLES.get(role.label, "cyan")
    return Text(role.cell, style=f"{style} dim" if role.confidence == "low" else style)


def role_grid(inspection: Inspection, layers: Sequence[int] | None = None) -> Table:
    """Rows heads, columns ``layers`` (layer values of ``inspection.layers``; default all), cells role labels with
    their strength ("[CLS] 61%")."""
    shown = list(inspection.layers if layers is None else layers)
    rows = [inspection.layers.index(layer) for layer in shown]
    roles = inspection.role_stats.roles()  # roles[row][col]
    table = _new_table()
    table.add_column("head", justify="right", style="bold", no_wrap=True)
    for layer in shown:
        table.add_column(f"layer {layer}", no_wrap=True)
    for col, head in enumerate(inspection.heads):
        table.add_row(f"h{head}", *(_role_cell(roles[row][col]) for row in rows))
    return table


def role_grids(inspection: Inspection, width: int) -> list[Table]:
    """:func:`role_grid` in as few tables as fit ``width`` columns: all layers in one when they fit, else groups
    of neighbouring layers."""
    return paged_tables(inspection.layers, width, lambda run: role_grid(inspection, run))


def role_title(inspection: Inspection) -> str:
    return f"Head roles (from {inspection.role_stats.roles_source})"


# --------------------------------------------------------------------------- where the token attends


def attention_table(
    inspection: Inspection, top: int = 2, layers: Sequence[int] | None = None, token_chars: int = MAX_TOKEN_CHARS
) -> Table:
    """Rows heads, columns ``layers`` (default all): the key pieces the selected token attends to most, one line
    each with its weight in percent; pieces longer than ``token_chars`` cells are shortened with "~"."""
    shown = list(inspection.layers if layers is None else layers)
    rows = [inspection.layers.index(layer) for layer in shown]
    present = inspection.present.tolist()
    tops = {  # (layer, head) -> its top (key piece, weight) pairs; None where the head was pruned
        (layer, head): [(piece, weight) for piece, _, weight in inspection.top_attended(layer, head, k=top)]
        if present[row][col]
        else None
        for row, layer in zip(rows, shown, strict=True)
        for col, head in enumerate(inspection.heads)
    }
    pieces = [piece for pairs in tops.values() for piece, _ in pairs or []]
    chars = min(token_chars, max(map(cell_len, pieces), default=1))
    table = _new_table()
    table.add_column("head", justify="right", style="bold", no_wrap=True)
    for layer in shown:
        table.add_column(f"layer {layer}", no_wrap=True)
    for head in inspection.heads:
        cells: list[Text] = []
        for layer in shown:
            pairs = tops[layer, head]
            if pairs is None:
                cells.append(Text(PRUNED, style=_ROLE_STYLES[PRUNED]))
                continue
            lines = [set_cell_size(_shortened(piece, chars), chars) + f" {weight:4.0%}" for piece, weight in pairs]
            cells.append(Text("\n".join(lines)))
        table.add_row(f"h{head}", *cells)
    return table


def attention_tables(inspection: Inspection, width: int, top: int = 2) -> list[Table]:
    """:func:`attention_table` fitted to ``width`` columns: all layers in one table with pieces shortened as
    little as that allows, down to ``MIN_TOKEN_CHARS``; below that, groups of neighbouring layers with pieces
    shortened no further."""
    wanted, floor = MAX_TOKEN_CHARS, MIN_TOKEN_CHARS
    for chars in range(wanted, floor - 1, -1):  # a table whose pieces are shorter than chars is drawn once more
        table = attention_table(inspection, top, token_chars=chars)
        if _table_width(table) <= width:
            return [table]
    return paged_tables(inspection.layers, width, lambda run: attention_table(inspection, top, run, token_chars=wanted))


def attention_title(inspection: Inspection, top: int = 2) -> str:
    """The token table's title, naming the query as it stands in the text: "Where 'bank' (tokens 1-3)
    attends: top 2 per head" for a word of several pieces (:attr:`Inspection.query_title`)."""
    where = "" if inspection.same_axes else " in the source text"
    return f"Where {inspection.query_title} attends{where}: top {top} per head"


# --------------------------------------------------------------------------- the strongest links


def strongest_links(inspection: Inspection, count: int = 6) -> list[tuple[int, int, str, float]]:
    """The heads where the selected token puts most weight on another word (not the pieces of the word it
    stands for, :attr:`Inspection.query`, nor [CLS] or [SEP]); in cross-attention, on a word of the source text
    (any key piece but [CLS] and [SEP]).

    Returns up to ``count`` (layer, head, key piece, weight), strongest first.
    """
    links = []
    present = inspection.present.tolist()
    _, first, last = inspection.query  # the pieces of its word (the query alone when it stands for a piece)
    for row, layer in enumerate(inspection.layers):
        for col, head in enumerate(inspection.heads):
            if not present[row][col]:
                continue
            weights = inspection.weights[row, col, inspection.token]  # (j,)
            for key in weights.argsort(descending=True).tolist():
                piece = inspection.key_tokens[key]
                itself = inspection.same_axes and first <= key <= last
                if not itself and piece not in SPECIAL_TOKENS:
                    links.append((layer, head, piece, float(weights[key])))
                    break
    return sorted(links, key=lambda link: -link[3])[:count]


# --------------------------------------------------------------------------- the whole view


def _print_tables(console: Console, title: str, tables: list[Table]) -> None:
    console.print(Text(title, style="bold", overflow="fold"))
    for number, table in enumerate(tables):
        if number:
            console.print()
        console.print(table)


def near_duplicates_line(inspection: Inspection, shown: int = 8) -> str:
    """The heads that attend alike (Jensen-Shannon divergence under the threshold, on the texts the roles come
    from), closest first, at most ``shown`` pairs; "" when the inspection has no similarity."""
    similarity = inspection.similarity
    if similarity is None:
        return ""
    pairs = similarity.near_duplicates()
    head = f"Near-duplicate heads (under {similarity.threshold:g} bits apart on {similarity.source}): "
    if not pairs:
        return head + "none"
    listed = ", ".join(f"L{a[0]}H{a[1]} & L{b[0]}H{b[1]} ({d:.3f})" for a, b, d in pairs[:shown])
    return head + listed + (f" and {len(pairs) - shown} more pairs" if len(pairs) > shown else "")


def _layers_elsewhere(inspection: Inspection) -> str:
    """A line naming each layer's module where the model's own layer numbers are not these (a hybrid's attention
    layers among its Mamba or linear-attention ones: "layers: 0 = model.layers.1.self_attn, ..."), else ""."""
    modules = inspection.layer_modules
    numbers = [re.search(r"\.(\d+)\.", f".{name}.") for name in modules]
    if not modules or all(
        found is not None and int(found.group(1)) == layer
        for found, layer in zip(numbers, inspection.layers, strict=True)
    ):
        return ""
    return "layers: " + ", ".join(f"{layer} = {name}" for layer, name in zip(inspection.layers, modules, strict=True))


def print_inspection(inspection: Inspection, console: Console | None = None) -> None:
    """Print the header, the role grid and the token table to ``console`` (default: :func:`make_console`), fitted
    to its width."""
    if console is None:
        console = make_console()
    width = console.width
    pruned = int((~inspection.present).sum())
    same = inspection.same_axes
    console.print(
        Text(
            f"{inspection.model_name}: {counted(len(inspection.layers), 'layer')} x "
            f"{counted(len(inspection.heads), 'head')} "
            + (f"({pruned} pruned) " if pruned else "")
            + (
                f"on {counted(len(inspection.tokens), 'token')}"
                if same
                else f"from {counted(len(inspection.tokens), 'query token')} "
                f"to {counted(len(inspection.key_tokens), 'key token')}"
            ),
            style="bold",
            overflow="fold",
        )
    )
    for note in inspection.notes:
        console.print(Text(note, style="bold", overflow="fold"))
    moved = _layers_elsewhere(inspection)
    if moved:
        console.print(Text(moved, overflow="fold"))
    if same:
        console.print(Text(" ".join(inspection.tokens), overflow="fold"))
    else:
        console.print(Text("queries: " + " ".join(inspection.tokens), overflow="fold"))
        console.print(Text("keys:    " + " ".join(inspection.key_tokens), overflow="fold"))
    console.print()
    _print_tables(console, role_title(inspection), role_grids(inspection, width))
    console.print(
        Text(
            LEGEND
            + (BEHAVIOUR_LEGEND if inspection.role_stats.behaviours else "")
            + (LEARNED_SINK_LEGEND if _has_learned_sinks(inspection) else "")
            + ("; pruned: the layer no longer has this head" if pruned else "")
            + ("; prev/next/self are the source positions i-1, i+1, i" if not same else "")
            + ".",
            style="dim",
            overflow="fold",
        )
    )
    redundancy = near_duplicates_line(inspection)
    if redundancy:
        console.print(Text(redundancy, overflow="fold"))
    console.print()
    _print_tables(console, attention_title(inspection), attention_tables(inspection, width))
    links = strongest_links(inspection)
    if links:
        target = "another word" if same else "a word of the source text"
        console.print(
            Text(
                f"Strongest links from '{inspection.query[0]}' to {target}: "
                + ", ".join(f"{piece} {weight:.0%} (L{layer} H{head})" for layer, head, piece, weight in links),
                overflow="fold",
            )
        )
