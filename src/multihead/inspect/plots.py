"""PNG figures of an inspection: a grid of every recorded head's heatmap with its role label.

Needs matplotlib, the ``plots`` extra (``pip install 'multihead[plots]'``); without it,
:func:`heatmap_grid` raises :class:`~multihead._figures.MissingExtraError` naming the install.
"""

from __future__ import annotations

from pathlib import Path

import numpy

from multihead._figures import pyplot, save_figure
from multihead.inspect.report import Inspection

__all__ = ["heatmap_grid"]

CELL_INCHES = 1.35  # one head's heatmap
TITLE_LINE_INCHES = 0.3  # the figure grows by this for each line of the title past the first (a note)


def heatmap_grid(inspection: Inspection, path: str | Path) -> Path:
    """Save rows = layers, columns = heads of (i, j) heatmaps (query rows, key columns) to ``path``; returns it.

    Heads are titled by their checkpoint numbers; a head pruned from a layer is an empty grey cell titled
    "pruned". Of a causal part, the masked cells above the diagonal (keys after the query) are light grey,
    apart from the colour of a weight of 0; the title names the part and says it is causal."""
    plt = pyplot("the png report")
    rows, cols = len(inspection.layers), len(inspection.heads)
    roles = inspection.role_stats.roles()
    present = inspection.present.tolist()
    colours = plt.get_cmap("viridis").with_extremes(bad="0.85")  # masked (causal) cells: light grey
    masked = _masked(inspection)
    axes_note = "rows: query tokens, columns: key tokens"
    if not inspection.same_axes:
        axes_note = "rows: decoder input, columns: source text"
    if inspection.causal:
        axes_note += "; grey: masked, later tokens"
    width = cols * CELL_INCHES + 0.6
    title = f'{inspection.model_name}: attention weights on "{_clip(inspection.text)}" ' + (
        f"({axes_note}; roles from {inspection.role_stats.source})"
    )
    lines = [title, *inspection.notes]  # the part and its causality on lines of their own
    extra = TITLE_LINE_INCHES * (len(lines) - 1)
    height = rows * CELL_INCHES + 0.9 + extra
    figure, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    for r, layer in enumerate(inspection.layers):
        for c, head in enumerate(inspection.heads):
            axis = axes[r][c]
            if present[r][c]:
                weights = inspection.weights[r, c].numpy()  # (i, j)
                shown = weights if masked is None else numpy.ma.masked_array(weights, mask=masked)
                axis.imshow(shown, cmap=colours, vmin=0.0, vmax=1.0, interpolation="nearest")
            else:  # a head pruned from this layer: an empty, greyed cell titled "pruned"
                axis.set_facecolor("0.93")
                axis.set_aspect("equal")
            axis.set_xticks([])
            axis.set_yticks([])
            axis.set_title(f"L{layer} H{head}: {roles[r][c].label}", fontsize=7, pad=2)
    figure.suptitle("\n".join(lines), fontsize=8)
    return save_figure(figure, Path(path), rect=(0, 0, 1, 0.97))  # tight_layout leaves the title its lines


def _masked(inspection: Inspection) -> numpy.ndarray | None:
    """(i, j) bool, True where a causal part masks the key (j after the query, aligned bottom-right); None
    when nothing is masked."""
    if not inspection.causal:
        return None
    i, j = len(inspection.tokens), len(inspection.key_tokens)
    return numpy.triu(numpy.ones((i, j), dtype=bool), k=1 + j - i)


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
