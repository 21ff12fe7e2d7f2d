"""PNG figures of an inspection: a grid of every recorded head's heatmap with its role label."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multihead.inspect.report import Inspection


def heatmap_grid(inspection: Inspection, path: Path) -> Path:
    """Save rows = layers, columns = heads of (n, n) heatmaps (query rows, key columns) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows, cols = len(inspection.layers), len(inspection.heads)
    roles = inspection.role_stats.roles()
    cell = 1.35
    figure, axes = plt.subplots(rows, cols, figsize=(cols * cell + 0.6, rows * cell + 0.9), squeeze=False)
    for r, layer in enumerate(inspection.layers):
        for c, head in enumerate(inspection.heads):
            axis = axes[r][c]
            axis.imshow(inspection.weights[r, c].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
            axis.set_xticks([])
            axis.set_yticks([])
            axis.set_title(f"L{layer} H{head}: {roles[r][c].label}", fontsize=7, pad=2)
    figure.suptitle(
        f'{inspection.model_name}: attention weights on "{_clip(inspection.text)}" '
        f"(rows: query tokens, columns: key tokens; roles from {inspection.role_stats.source})",
        fontsize=8,
    )
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # a character of the user's text the font lacks is drawn as a box, quietly
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
