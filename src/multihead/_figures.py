"""PNG figures: matplotlib is an optional extra (`pip install 'multihead[plots]'`), loaded only to draw one.

Every PNG the package writes goes through :func:`pyplot` (the Agg backend, or a clear error naming the extra when
matplotlib is missing) and :func:`save_figure` (one dpi, the user's missing glyphs drawn as boxes quietly, the figure
closed even when saving fails).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from multihead._errors import InputError

PNG_DPI = 110
INSTALL_HINT = "pip install 'multihead[plots]' (or pip install matplotlib)"


class MissingExtraError(InputError, ImportError):
    """An optional dependency a requested output needs is not installed (the user's environment, not our bug)."""


def pyplot(purpose: str = "PNG output") -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display); MissingExtraError naming the fix without it."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtraError(f"{purpose} needs matplotlib, which is not installed. Fix: {INSTALL_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def has_matplotlib() -> bool:
    """Whether PNG figures can be drawn here (reports skip their PNG with a note when not)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def save_figure(
    figure: Any, path: Path, *, tight: bool = True, rect: tuple[float, float, float, float] | None = None
) -> Path:
    """Lay out (unless ``tight=False``), save ``figure`` as a PNG at ``path`` and close it; returns ``path``."""
    import matplotlib.pyplot as plt

    try:
        with warnings.catch_warnings():  # a character of the user's text the font lacks is drawn as a box, quietly
            warnings.filterwarnings("ignore", message="Glyph .* missing from font")
            if tight:
                figure.tight_layout(rect=rect)
            path.parent.mkdir(parents=True, exist_ok=True)
            figure.savefig(path, dpi=PNG_DPI)
    finally:
        plt.close(figure)
    return path
