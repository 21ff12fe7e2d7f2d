"""PNG figures: matplotlib is an optional extra (`pip install 'multihead[plots]'`), loaded only to draw one.

Every PNG the package writes goes through :func:`pyplot` (the Agg backend, or a clear error naming the extra when
matplotlib is missing) and :func:`save_figure` (one dpi, the user's missing glyphs drawn as boxes quietly, the figure
closed even when saving fails).

A missing optional figure never fails a command: a writer that writes a figure among other files draws it through
:func:`draw_figure`, which without matplotlib leaves it out and records it in the :class:`Written` the writer
returns; :func:`print_written` then prints the files written and one line, :func:`skipped_note`, that names the
figures left out and the install. A function that only draws a figure (``plot_history``, ``heatmap_grid``) raises
:class:`MissingExtraError` instead: without the figure it has nothing to do.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

from multihead._errors import InputError
from multihead._limits import format_bytes

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


class Written(dict[str, Path]):
    """{what: path} of the files a writer wrote, and ``skipped``: {what: path} of the figures it left out because
    matplotlib is not installed (:func:`draw_figure` fills both; :func:`print_written` prints them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skipped: dict[str, Path] = {}


def draw_figure(written: Written, what: str, path: Path, draw: Callable[[Path], object]) -> None:
    """``draw(path)`` and ``written[what] = path`` when matplotlib is installed; without it nothing is drawn and
    ``path`` goes to ``written.skipped[what]``, so that the command writes its other files and says so in one line."""
    if has_matplotlib():
        draw(path)
        written[what] = path
    else:
        written.skipped[what] = path


def skipped_note(skipped: Iterable[Path | str]) -> str | None:
    """The one line a command prints for the figures ``skipped`` it did not draw (None when there are none):
    ``note: curves.png not drawn: matplotlib is not installed. Fix: pip install 'multihead[plots]' (...)``."""
    names = [Path(path).name for path in skipped]
    if not names:
        return None
    return f"note: {', '.join(names)} not drawn: matplotlib is not installed. Fix: {INSTALL_HINT}"


def written_line(path: str | Path) -> str:
    """The line every command prints for a file it wrote: ``wrote <absolute path> (<size>)``; a folder (a saved
    model) has no size."""
    path = Path(path).resolve()
    return f"wrote {path} ({format_bytes(path.stat().st_size)})" if path.is_file() else f"wrote {path}"


def print_written(console: Console, written: Mapping[str, Path] | Iterable[Path]) -> None:
    """One :func:`written_line` per file written (plain text: a folder named [x] is not rich markup), then, when
    ``written`` is a :class:`Written` that left figures out, the one :func:`skipped_note` line."""
    paths = written.values() if isinstance(written, Mapping) else written
    lines = [written_line(path) for path in paths]
    note = skipped_note(written.skipped.values()) if isinstance(written, Written) else None
    for line in [*lines, *([note] if note else [])]:
        console.print(line, soft_wrap=True, markup=False, highlight=False)
