"""The HTML report of an :class:`~multihead.inspect.report.Inspection`: one self-contained, interactive page.

The page is a jinja2 template packaged beside this module (``templates/report.html.j2``) with its
stylesheet and script as real files (``templates/report.css``, ``templates/report.js``), all three
inlined into the one page: no external URL, no CDN, no web fonts, so the file works opened from
disk offline. It shows

* a header: title, model, the text, and where the role labels were computed;
* controls: a layer select (``#layer-select``) and a head select (``#head-select``);
* the text as clickable tokens (``.token[data-index]``); the selected query token has class
  ``selected``, and every token is shaded by how much the query attends to it;
* where the selected query attends in the selected head: one ``.weight-row`` per key token in
  ``#attention-bars`` (``data-key``, ``data-weight``, a ``.key-token``, a bar, a ``.weight-pct``),
  next to a labelled heatmap of the whole head (``#head-detail``; click a row to pick the query);
* a grid of every head's heatmap (``canvas.heatmap[data-layer][data-head]``, rows = layers,
  columns = heads) with its role label (``.role-label``); clicking one selects that head;
* a sortable table of per-head statistics (``#head-stats``) and, only when corpus statistics
  were measured, a second one (``#corpus-stats``).

The page shows one part of the model's attention (``inspection.part``). Its header names the part when it
is not a one-stack model's self-attention (``#report-notes``: "cross-attention: decoder input -> source
text") and says when it is causal ("causal: each token attends only to itself and earlier tokens"). Of a
causal part, the masked cells (keys after the query) are hatched grey in the large heatmap and plain grey
in the thumbnails, apart from the colour of a weight of 0, and their bars read "masked". In
cross-attention the key pieces (the source text) differ from the query pieces: the query pieces stay the
clickable tokens, the key pieces are a second, shaded strip (``#key-strip``, ``.key-chip[data-key]``), and
the bars, the heatmap's columns and its labels are the key pieces.

Heads go by their checkpoint numbers. Of a pruned model, a head a layer no longer has (its weights
are an empty list in the data) is an empty thumbnail (``.head-cell.pruned``, ``canvas[data-pruned]``)
captioned "pruned" that cannot be selected; picked with the selects, the page says it was pruned;
the statistics tables list only the heads each layer has.

The data travels as JSON in ``<script type="application/json" id="report-data">``:
``{"report": inspection.to_dict(), "view": {...}}``, the report exactly as ``inspect.json`` holds
it. jinja2's ``|tojson`` escapes ``<``, ``>``, ``&`` and ``'`` inside it, so text such as
``</script>`` cannot end the script element, and the script inserts every user string with
``textContent`` (never ``innerHTML``), so the text can hold any markup without it being
interpreted. The page is pure ASCII (non-ASCII characters are JSON or character-reference
escapes), so it reads the same whatever encoding it is saved with.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from importlib import resources

import jinja2
from markupsafe import Markup, escape

from multihead.inspect.report import SPECIAL_TOKENS, Inspection
from multihead.inspect.stats import STAT_NAMES

__all__ = ["render_html", "TEMPLATE"]

TEMPLATE = "report.html.j2"
# Compact, ASCII and strict: NaN or infinity in the data is a bug, not something to write as invalid JSON.
_JSON_OPTIONS = {"separators": (",", ":"), "ensure_ascii": True, "allow_nan": False}


def render_html(
    inspection: Inspection, extra_columns: Mapping[str, Sequence[Sequence[float | None]]] | None = None
) -> str:
    """One self-contained HTML page (a str) on every head of ``inspection``; see the module docstring.

    ``extra_columns``: per-head scores shown as more columns of the statistics table,
    ``{name: [layer row][head column]}`` over the inspection's layers and heads (from
    :func:`multihead.inspect.headreport.report_columns`).
    """
    view = {
        "title": f"multihead inspect: {inspection.model_name}",
        "notes": inspection.notes,
        "special": [piece in SPECIAL_TOKENS for piece in inspection.tokens],
        "key_special": [piece in SPECIAL_TOKENS for piece in inspection.key_tokens],
        "stat_names": STAT_NAMES,
        "extra_columns": dict(extra_columns or {}),
    }
    template = _environment().get_template(TEMPLATE)
    return template.render(
        title=view["title"],
        css=_asset("report.css"),
        js=_asset("report.js"),
        data={"report": inspection.to_dict(), "view": view},
    )


def _ascii(value: object) -> Markup:
    """HTML-escaped text with every non-ASCII character as a character reference (the page stays ASCII)."""
    return Markup(str(escape(value)).encode("ascii", "xmlcharrefreplace").decode("ascii"))


@functools.cache
def _environment() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("multihead.inspect", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    environment.filters["ascii"] = _ascii
    environment.policies["json.dumps_kwargs"] = _JSON_OPTIONS
    return environment


@functools.cache
def _asset(name: str) -> Markup:
    """A packaged stylesheet or script, inlined as it is (our own file: it is code, not text to escape)."""
    return Markup((resources.files("multihead.inspect") / "templates" / name).read_text(encoding="utf-8"))
