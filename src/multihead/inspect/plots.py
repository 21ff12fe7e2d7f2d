"""PNG figures of an inspection: a grid of every recorded head's heatmap with its role label.

Needs matplotlib, the ``plots`` extra (``pip install 'multihead[plots]'``); without it,
:func:`heatmap_grid` raises :class:`~multihead._figures.MissingExtraError` naming the install.
"""

from __future__ import annotations

from pathlib import Path

from multihead._figures import pyplot, save_figure
from multihead.inspect.report import Inspection

__all__ = ["heatmap_grid"]

CELL_INCHES = 1.35  # one head's heatmap


def heatmap_grid(inspection: Inspection, path: str | Path) -> Path:
    """Save rows = layers, columns = heads of (n, n) heatmaps (query rows, key columns) to ``path``; returns it.

    Heads are titled by their checkpoint numbers; a head pruned from a layer is an empty grey cell titled
    "pruned"."""
    plt = pyplot("the png report")
    rows, cols = len(inspection.layers), len(inspection.heads)
    roles = inspection.role_stats.roles()
    present = inspection.present.tolist()
    figure, axes = plt.subplots(rows, cols, figsize=(cols * CELL_INCHES + 0.6, rows * CELL_INCHES + 0.9), squeeze=False)
    for r, layer in enumerate(inspection.layers):
        for c, head in enumerate(inspection.heads):
            axis = axes[r][c]
            if present[r][c]:
                axis.imshow(
                    inspection.weights[r, c].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest"
                )
            else:  # a head pruned from this layer: an empty, greyed cell titled "pruned"
                axis.set_facecolor("0.93")
                axis.set_aspect("equal")
            axis.set_xticks([])
            axis.set_yticks([])
            axis.set_title(f"L{layer} H{head}: {roles[r][c].label}", fontsize=7, pad=2)
    figure.suptitle(
        f'{inspection.model_name}: attention weights on "{_clip(inspection.text)}" '
        f"(rows: query tokens, columns: key tokens; roles from {inspection.role_stats.source})",
        fontsize=8,
    )
    return save_figure(figure, Path(path), rect=(0, 0, 1, 0.97))


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
