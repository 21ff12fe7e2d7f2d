"""rich's table with its title above it and its caption under it at the width it is printed in, not its own.

rich draws a table's title and caption inside the table's width: a table of a few narrow columns (the importance
table of a model with two heads, a dozen columns wide) squeezed a one-line title into five lines. Every titled
rich table the package prints is a :class:`TitledTable` instead; rich is the lab extra's, so only code that has
it imports this module (the lab, and :func:`multihead._console.table` where rich is installed).
"""

from __future__ import annotations

from copy import copy
from typing import TYPE_CHECKING, Any

from rich.style import Style
from rich.table import Table

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, JustifyMethod, RenderResult
    from rich.text import TextType

__all__ = ["TitledTable"]


class TitledTable(Table):
    """A rich Table (same arguments) whose ``title`` is printed above it and ``caption`` under it across the
    whole width it is printed in (the console's, or its container's), wrapped between words; a word longer than
    a line folds onto the next, never cut. Both are left-justified unless said (``title_justify``,
    ``caption_justify``). The table itself is drawn as rich draws it, without them."""

    def __init__(self, *headers: Any, title_justify: JustifyMethod = "left", **options: Any) -> None:
        options.setdefault("caption_justify", "left")
        super().__init__(*headers, title_justify=title_justify, **options)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.title:
            yield from _annotation(console, options, self.title, self.title_style, "table.title", self.title_justify)
        body = copy(self)  # the same columns and rows, drawn by rich without the title and caption
        body.title = body.caption = None
        yield from Table.__rich_console__(body, console, options)
        if self.caption:
            style, justify = self.caption_style, self.caption_justify
            yield from _annotation(console, options, self.caption, style, "table.caption", justify)


def _annotation(
    console: Console,
    options: ConsoleOptions,
    text: TextType,
    style: str | Style | None,
    default: str,
    justify: JustifyMethod,
) -> RenderResult:
    """``text`` (markup when a str, as rich's own title) in ``style`` (else the theme's ``default``) over the
    full width of ``options``."""
    shown = (
        console.render_str(text, style=Style.pick_first(style, default), highlight=False)
        if isinstance(text, str)
        else text
    )
    # "default" is left-justified without padding each line out to the width with spaces
    return console.render(shown, options.update(justify="default" if justify == "left" else justify))
