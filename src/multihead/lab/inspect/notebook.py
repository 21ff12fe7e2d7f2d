"""How results show themselves in a notebook and a REPL: a one-line ``repr`` and a small HTML grid.

Jupyter calls an object's ``_repr_html_`` to display it; the REPL prints ``repr``. Statistics, importance
and syntax scores are (layers, heads) grids of numbers, so they share :func:`head_grid_html`: one table,
rows heads and columns layers (the orientation of the terminal report), each cell its text, shaded by an
optional value in [0, 1] on the reports' colour scale. Every style is inline on the table's own elements:
nothing restyles the notebook, and any number of grids can sit in one page. The interactive report of an
:class:`~multihead.lab.inspect.inspection.Inspection` is its HTML page's scoped fragment (see
``Inspection._repr_html_``).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence

from multihead.lab.inspect.colours import weight_rgb

__all__ = ["head_grid_html", "shorten"]

# Alignment and the table's margins are set here, not left to the notebook's stylesheet: JupyterLab's right-aligns
# table cells (and centres tables), which scattered the role labels of a HeadStats grid.
_CELL = "padding:2px 6px;border:1px solid #e1e4e8;font:12px/1.3 ui-monospace,Menlo,Consolas,monospace;text-align:left;"


def shorten(text: str, limit: int = 60) -> str:
    """``text`` on one line, cut to ``limit`` characters with "..." (for reprs)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def head_grid_html(
    title: str,
    layers: Sequence[int],
    heads: Sequence[int],
    cell: Callable[[int, int], str | None],
    shade: Callable[[int, int], float | None] | None = None,
    note: str = "",
    images: Callable[[int, int], str] | None = None,
) -> str:
    """An HTML table: rows ``heads``, columns ``layers``; ``cell(row, col)`` is the text of layers[row], heads[col]
    (None: a pruned head, shown "pruned"), ``shade(row, col)`` a value in [0, 1] colouring the cell (None: white),
    ``images(row, col)`` the address of an image shown above the text (a ``data:`` URI; none for a pruned head).
    ``title`` and ``note`` are text (escaped)."""
    lines = [
        '<table style="border-collapse:collapse;margin:4px auto 4px 0">',
        f'<caption style="text-align:left;font-weight:600;padding:2px 0">{html.escape(title)}</caption>',
        "<thead><tr>"
        + f'<th style="{_CELL}"></th>'
        + "".join(f'<th style="{_CELL}">L{layer}</th>' for layer in layers)
        + "</tr></thead><tbody>",
    ]
    for col, head in enumerate(heads):
        cells = []
        for row in range(len(layers)):
            text = cell(row, col)
            value = None if shade is None or text is None else shade(row, col)
            style = _CELL
            if value is not None and value == value:  # not NaN
                r, g, b = weight_rgb(value)
                style += f"background:rgb({r},{g},{b});" + ("color:#fff;" if value > 0.3 else "")
            shown = html.escape("pruned" if text is None else text)
            if images is not None and text is not None:
                source = html.escape(images(row, col))
                label = f"layer {layers[row]} head {head}: {text}"
                shown = f'<img src="{source}" alt="{html.escape(label)}" style="display:block">' + shown
            cells.append(f'<td style="{style}">{shown}</td>')
        lines.append(f'<tr><th style="{_CELL}">h{head}</th>' + "".join(cells) + "</tr>")
    lines.append("</tbody></table>")
    if note:
        lines.append(f'<div style="color:#656d76;font-size:12px">{html.escape(note)}</div>')
    return "\n".join(lines)
