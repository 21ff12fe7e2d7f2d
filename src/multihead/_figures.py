"""PNG figures: matplotlib is an optional extra (`pip install 'multihead[plots]'`), loaded only to draw one.

Every PNG the package writes goes through :func:`pyplot` (the Agg backend, or a clear error naming the extra when
matplotlib is missing) and :func:`save_figure` (one dpi, the user's missing glyphs drawn as boxes quietly, the figure
closed even when saving fails), and titles its figures with :func:`fitted_title` (wrapped between words to the
width the title has, measured with matplotlib's renderer, so that no title is clipped by the figure's edge).

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
from weakref import WeakKeyDictionary

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
    """Lay out (tightly, unless ``tight=False``: then by the figure's own layout engine, if any), fit the titles
    :func:`fitted_title` set to where the layout put them, save ``figure`` as a PNG at ``path`` and close it;
    returns ``path``."""
    import matplotlib.pyplot as plt

    try:
        with warnings.catch_warnings():  # a character of the user's text the font lacks is drawn as a box, quietly
            warnings.filterwarnings("ignore", message="Glyph .* missing from font")
            engine = figure.get_layout_engine()  # tight=False: the figure's own (constrained), if any
            for _ in range(LAYOUT_ROUNDS):  # a title wrapped anew takes another height: lay out again
                if tight:
                    figure.tight_layout(rect=rect)
                elif engine is not None:
                    engine.execute(figure)  # placed now, as the saving will place them
                if not _refit_titles(figure):
                    break
            path.parent.mkdir(parents=True, exist_ok=True)
            figure.savefig(path, dpi=PNG_DPI)
    finally:
        plt.close(figure)
    return path


# layouts and title fits save_figure goes through at most, until the titles' lines no longer change (an image kept
# square moves its axes when a title of another height changes the room it has)
LAYOUT_ROUNDS = 4
TITLE_ROOM = 0.96  # of the width a title has, what its longest line may take (the rest: air at its ends)
# the titles fitted_title set on each figure, fitted again by save_figure once the layout has placed their axes
_FITTED: WeakKeyDictionary[Any, list[tuple[Any, Any, str]]] = WeakKeyDictionary()


def fitted_title(target: Any, text: str, **style: Any) -> Any:
    """Title ``target`` with ``text`` wrapped to fit: every PNG the package draws titles its figures through this.

    ``target`` is an Axes (its title: ``set_title(text, **style)``) or a Figure (its ``suptitle``). Each line of
    ``text`` (it may hold newlines of its own) is wrapped between words so that no line is wider than
    ``TITLE_ROOM`` of the room the title has: the widest run centred on where it stands (the middle of its axes,
    or of the figure) that stays inside its strip of the figure: the whole width for a suptitle, for an axes its
    columns' share of the figure's grid of subplots (all of it for a single axes, a half for one of two side by
    side), so that it never runs into its neighbour's. Widths are measured with the figure's renderer in the
    title's own font and size; a word wider than a line on its own is cut between characters, and a "$" is a
    dollar sign, not mathtext. The layout (tight or constrained) moves axes but ignores the width of their
    titles, so :func:`save_figure` fits the titles again once the layout has placed them. Returns the title's
    Text artist.
    """
    is_figure = hasattr(target, "suptitle")
    figure = target if is_figure else target.figure
    style.setdefault("parse_math", False)  # a user's "$5 to $6" (a text, a token) is text, not mathtext
    artist = target.suptitle(text, **style) if is_figure else target.set_title(text, **style)
    _FITTED.setdefault(figure, []).append((target, artist, text))
    _fit(figure, target, artist, text)
    return artist


def _fit(figure: Any, target: Any, artist: Any, text: str) -> bool:
    """Set ``artist`` (``target``'s title) to ``text`` wrapped to the room it has now; whether its lines changed."""
    if not text.strip():
        return False
    if target is not figure and target.get_axes_locator() is None:
        target.apply_aspect()  # the box it is drawn in: an image's aspect narrows it (beside its colour bar)
    renderer = figure.canvas.get_renderer()
    left, right = _strip(figure, target)  # pixels, as the extents below
    drawn = artist.get_window_extent(renderer)  # where it stands
    middle = (drawn.x0 + drawn.x1) / 2
    room = {"left": right - drawn.x0, "right": drawn.x1 - left}.get(
        artist.get_horizontalalignment(), 2 * min(middle - left, right - middle)
    )
    room = TITLE_ROOM * max(room, 0.1 * (right - left))  # a title at its strip's very edge: still a tenth of it

    def fits(line: str) -> bool:
        artist.set_text(line)
        return artist.get_window_extent(renderer).width <= room

    before = artist.get_text()
    artist.set_text("\n".join(_wrapped(text, fits)))
    return artist.get_text() != before


def _refit_titles(figure: Any) -> bool:
    """Fit each title :func:`fitted_title` set on ``figure`` to where the layout has put it; whether one changed."""
    changed = [_fit(figure, target, artist, text) for target, artist, text in _FITTED.get(figure, [])]
    return any(changed)


def _strip(figure: Any, target: Any) -> tuple[float, float]:
    """The left and right edges, in pixels, of the strip of the figure a title of ``target`` may take: the whole
    width for the figure's own, and for an axes its columns' share of the figure's grid of subplots (all of it
    for a single axes, a half for one of two side by side; a colour bar made beside it, a grid within its cell,
    does not count)."""
    width = figure.bbox.width
    spec = None if target is figure else target.get_subplotspec()
    if spec is None:
        return 0.0, width
    spec = spec.get_topmost_subplotspec()
    ratios = spec.get_gridspec().get_width_ratios()
    total = sum(ratios)
    return width * sum(ratios[: spec.colspan.start]) / total, width * sum(ratios[: spec.colspan.stop]) / total


def _wrapped(text: str, fits: Callable[[str], bool]) -> list[str]:
    """The lines of ``text`` (its own lines kept), each wrapped between words to the longest run that ``fits``; a
    word that does not fit alone is cut into the longest pieces that do (at least a character each)."""
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split():
            if fits(f"{line} {word}" if line else word):
                line = f"{line} {word}" if line else word
                continue
            if line:
                lines.append(line)
            while len(word) > 1 and not fits(word):
                cut = max([1, *(end for end in range(2, len(word)) if fits(word[:end]))])
                lines.append(word[:cut])
                word = word[cut:]
            line = word
        lines.append(line)
    return lines


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
