"""PNG figures of an inspection: a grid of every recorded head's heatmap with its role label.

The colours are the HTML page's (:mod:`multihead.lab.inspect.colours`): a weight w is drawn in ``weight_rgb(w)``,
the light-to-dark blue ramp along sqrt(w), and one colour bar beside the grid is labelled
``WEIGHT_SCALE_LABEL`` with ticks at ``WEIGHT_TICKS``. The keys a causal query cannot see are ``MASKED_RGB``;
a head pruned from a layer is an empty light grey cell titled "pruned". Query tokens label the rows of the
first column and key tokens the columns of the last row: every token while they fit (up to
:data:`MAX_LABELS` on an axis), beyond that every k-th, so that the labels stay legible.

Needs matplotlib, the ``plots`` extra (``pip install 'multihead[plots]'``); without it,
:func:`heatmap_grid` (and :func:`heatmap_figure`) raise :class:`~multihead._figures.MissingExtraError` naming
the install; :func:`~multihead.lab.inspect.write.write_reports` (``multihead inspect --format png``) leaves the PNG out
instead and writes the other formats.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy

from multihead._figures import PNG_DPI, fitted_title, pyplot, save_figure
from multihead.lab.inspect.colours import MASKED_RGB, WEIGHT_SCALE_LABEL, WEIGHT_STOPS, WEIGHT_TICKS
from multihead.lab.inspect.inspection import Inspection

__all__ = ["heatmap_figure", "heatmap_grid", "weight_colours"]

CELL_INCHES = 1.35  # one head's heatmap (a square), for texts of up to 14 tokens
MAX_CELL_INCHES = 2.2  # the cells grow with the tokens up to this, so that 24 labels fit on an axis
TOKEN_FONT = 6.0  # points: the token labels on the axes
LABEL_PITCH_INCHES = 6.6 / 72  # the room one token label takes along an axis
MAX_LABELS = math.floor(MAX_CELL_INCHES / LABEL_PITCH_INCHES)  # 24: more tokens than this are thinned
TOKEN_CHARS = 14  # a longer token is clipped to this many characters in its label
HEAD_TITLE_FONT = 9.0  # points: "L2 H5: prev" above each heatmap
TITLE_FONT = 10.0  # points: the figure's title
CELL_GAP_INCHES = 0.1  # between two heatmaps of a row
HEAD_TITLE_INCHES = 0.25  # a head's title and the gap above it
PRUNED_GREY = "0.93"  # the face of a pruned head's empty cell


def weight_colours() -> tuple[Any, Any]:
    """The (colormap, norm) that draw a weight w in ``weight_rgb(w)``: a ramp through :data:`WEIGHT_STOPS`
    evenly spaced in [0, 1], reached through ``PowerNorm(0.5)`` (so along sqrt(w)); masked cells ("bad")
    are ``MASKED_RGB``."""
    colors = pyplot("the png report").matplotlib.colors  # matplotlib only through pyplot (or the error)
    stops = [tuple(channel / 255 for channel in rgb) for rgb in WEIGHT_STOPS]
    ramp = colors.LinearSegmentedColormap.from_list("multihead_weight", stops, N=1024)  # 1024: within 1 of weight_rgb
    red, green, blue = MASKED_RGB
    colormap = ramp.with_extremes(bad=(red / 255, green / 255, blue / 255))
    return colormap, colors.PowerNorm(0.5, vmin=0.0, vmax=1.0, clip=True)


def heatmap_figure(inspection: Inspection) -> Any:
    """The matplotlib Figure of rows = layers, columns = heads of (i, j) heatmaps (query rows, key columns).

    Heads are titled by their checkpoint numbers and role labels; a head pruned from a layer is an empty grey
    cell titled "pruned". Of a causal part, the masked cells (keys after the query) are ``MASKED_RGB``, apart
    from the colour of a weight of 0; the title names the part and says it is causal. The figure has
    ``PNG_DPI`` dots per inch and a constrained layout (drawn when it is saved); :func:`heatmap_grid` saves
    and closes it, a caller of this function closes it (``matplotlib.pyplot.close``)."""
    plt = pyplot("the png report")
    colormap, norm = weight_colours()
    rows, cols = len(inspection.layers), len(inspection.heads)
    cell = cell_inches(max(len(inspection.tokens), len(inspection.key_tokens)))
    y_labels = _labels(inspection.tokens, cell)
    x_labels = _labels(inspection.key_tokens, cell)
    y_margin = _label_inches(y_labels.values())
    x_margin = _label_inches(x_labels.values())

    width = cols * (cell + CELL_GAP_INCHES) + y_margin + 1.0  # 1.0: the colour bar with its ticks and label
    height = rows * (cell + HEAD_TITLE_INCHES) + x_margin + 0.2  # and the title's lines, once wrapped
    figure, axes = plt.subplots(rows, cols, figsize=(width, height), dpi=PNG_DPI, squeeze=False, layout="constrained")
    try:
        _draw(figure, axes, inspection, colormap, norm, cell, x_labels, y_labels)
        title = fitted_title(figure, _title(inspection, _thinned(inspection, cell)), fontsize=TITLE_FONT)
        figure.set_figheight(height + (TITLE_FONT * 1.4 / 72) * len(title.get_text().split("\n")))
    except BaseException:
        plt.close(figure)
        raise
    return figure


def _draw(
    figure: Any,
    axes: Any,
    inspection: Inspection,
    colormap: Any,
    norm: Any,
    cell: float,
    x_labels: dict[int, str],
    y_labels: dict[int, str],
) -> None:
    """Fill :func:`heatmap_figure`'s grid of ``axes`` and its colour bar."""
    rows = len(inspection.layers)
    queries, keys = len(inspection.tokens), len(inspection.key_tokens)
    roles = inspection.role_stats.roles()
    present = inspection.present.tolist()
    masked = _masked(inspection)
    for r, layer in enumerate(inspection.layers):
        for c, head in enumerate(inspection.heads):
            axis = axes[r][c]
            if present[r][c]:
                weights = inspection.weights[r, c].numpy()  # (i, j)
                shown = weights if masked is None else numpy.ma.masked_array(weights, mask=masked)
                axis.imshow(shown, cmap=colormap, norm=norm, interpolation="nearest", aspect="auto")
            else:  # a head pruned from this layer: an empty, greyed cell titled "pruned"
                axis.set_facecolor(PRUNED_GREY)
            axis.set_xlim(-0.5, keys - 0.5)
            axis.set_ylim(queries - 0.5, -0.5)  # query 0 at the top, as imshow draws it
            axis.set_box_aspect(1)
            _tick(axis.yaxis, y_labels if c == 0 else {})
            _tick(axis.xaxis, x_labels if r == rows - 1 else {}, rotation=90)
            axis.set_title(f"L{layer} H{head}: {roles[r][c].label}", fontsize=HEAD_TITLE_FONT, pad=3)
    bar = figure.colorbar(
        pyplot("the png report").cm.ScalarMappable(norm=norm, cmap=colormap),
        ax=axes,
        ticks=list(WEIGHT_TICKS),
        shrink=min(1.0, 3.0 / (rows * (cell + HEAD_TITLE_INCHES))),  # at most about 3 inches tall
        aspect=16,
        pad=0.02,
    )
    bar.ax.set_yticklabels([f"{tick:g}" for tick in WEIGHT_TICKS], fontsize=8)
    bar.set_label(WEIGHT_SCALE_LABEL, fontsize=9)
    bar.outline.set_linewidth(0.5)


def heatmap_grid(inspection: Inspection, path: str | Path) -> Path:
    """Save :func:`heatmap_figure` of ``inspection`` as a PNG at ``path`` (its folder is made); returns it."""
    return save_figure(heatmap_figure(inspection), Path(path), tight=False)  # the layout is constrained


def cell_inches(tokens: int) -> float:
    """The side of one head's heatmap for a text of ``tokens`` pieces (the longer axis): CELL_INCHES, growing
    by one label's room per token past 14, up to MAX_CELL_INCHES."""
    return min(MAX_CELL_INCHES, max(CELL_INCHES, tokens * LABEL_PITCH_INCHES))


def label_step(tokens: int, cell: float) -> int:
    """Label every k-th token of an axis of ``tokens`` pieces on a heatmap ``cell`` inches wide: 1 while every
    label has its room (LABEL_PITCH_INCHES), else the smallest k that gives each shown label that room."""
    room = max(1, math.floor(cell / LABEL_PITCH_INCHES + 1e-9))
    return max(1, math.ceil(tokens / room))


def _labels(tokens: list[str], cell: float) -> dict[int, str]:
    """{position: label} of the tokens shown on an axis (every ``label_step``-th, long ones clipped)."""
    step = label_step(len(tokens), cell)
    return {position: _clip(tokens[position], TOKEN_CHARS) for position in range(0, len(tokens), step)}


def _label_inches(labels: Any) -> float:
    """About how far the longest label sticks out from its axis (DejaVu Sans: ~0.62 em a character)."""
    longest = max((len(label) for label in labels), default=0)
    return longest * 0.62 * TOKEN_FONT / 72 + 0.12


def _tick(axis: Any, labels: dict[int, str], rotation: float = 0) -> None:
    axis.set_ticks(list(labels), list(labels.values()), fontsize=TOKEN_FONT, rotation=rotation)
    axis.set_tick_params(length=2, pad=1.5, width=0.5)


def _thinned(inspection: Inspection, cell: float) -> str:
    """What the title says of thinned labels ("" when every token is labelled)."""
    rows, columns = (label_step(len(tokens), cell) for tokens in (inspection.tokens, inspection.key_tokens))
    if rows == columns == 1:
        return ""
    if rows == columns:
        return f"every {_ordinal(rows)}token labelled"
    return f"every {_ordinal(rows)}row and every {_ordinal(columns)}column labelled"


def _ordinal(k: int) -> str:
    """ "3rd " for every 3rd token, "" for every token."""
    if k == 1:
        return ""
    return f"{k}th " if 10 <= k % 100 <= 20 else f"{k}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th') } "


def _title(inspection: Inspection, thinned: str = "") -> str:
    """The figure's title (:func:`~multihead._figures.fitted_title` wraps it to the figure): the model, the text,
    what the axes are (and ``thinned``, which labels are shown) and where the roles come from; then the part and
    its causality (:attr:`Inspection.notes`) on lines of their own."""
    axes_note = "rows: query tokens, columns: key tokens"
    if not inspection.same_axes:
        axes_note = "rows: decoder input, columns: source text"
    if inspection.causal:
        axes_note += "; grey: masked, later tokens"
    if thinned:
        axes_note += f"; {thinned}"
    title = f'{inspection.model_name}: attention weights on "{_clip(inspection.text)}" ' + (
        f"({axes_note}; roles from {inspection.role_stats.roles_source})"
    )
    return "\n".join(" ".join(line.split()) for line in [title, *inspection.notes])  # a newline of the text: a space


def _masked(inspection: Inspection) -> numpy.ndarray | None:
    """:attr:`Inspection.masked` as a numpy array (None when nothing is masked)."""
    masked = inspection.masked
    return None if masked is None else masked.numpy()


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
