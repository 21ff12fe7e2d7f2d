"""The HTML report of an :class:`~multihead.lab.inspect.inspection.Inspection`: one self-contained, interactive page.

    render_html(inspection)        # a whole page (str): what `multihead inspect` writes as report.html
    render_fragment(inspection)    # the same report as one <div>, to put in any page or a notebook's output
    inspection                     # in a notebook: that fragment (Inspection._repr_html_, registered here)

The report is a jinja2 template packaged beside this module (``templates/fragment.html.j2``, wrapped into a
page by ``templates/report.html.j2``) with its stylesheet and script as real files (``templates/report.css``,
``templates/report.js``), all inlined: no external URL, no CDN, no web fonts, so the file works opened from
disk offline. ``docs/report.md`` describes what the page shows and how to use it.

**Any number of reports in one page.** A fragment is one root element, ``<div class="mh-report"
id="mh-...">``, its id unique to the report's data (a hash). Its markup, stylesheet and data are an inert
``<template>`` inside the root; the fragment's script attaches a shadow root to *its* root element (the one
holding the script, or the first of its id not yet drawn) and draws the report there. So the report's
stylesheet applies inside it only (no rule reaches the host page's ``body``, ``h1`` or anything else, and the
host's rules do not restyle the report), and its ids (``#layer-select``, ``#report-data``, ...) are unique
within its own shadow tree: a second report never reads the first one's data or draws into its elements, and
the host page may use the same ids and classes. Without JavaScript (an untrusted notebook, whose sanitizer
also drops ``<style>`` and ``<template>``), the root shows the static view of :mod:`multihead.lab.inspect.static`
(the heads grid as inline images, the roles, a line on how to get the interactive report); the markup of the
interactive report sits in an element hidden by its inline style (``display:none``, which JupyterLab's sanitizer
keeps, as it keeps ``hidden="hidden"`` but not a bare ``hidden``), so a sanitized page shows no empty skeleton.

**Its own width.** The report's layout follows the width of its root element, not the window's: the
stylesheet's breakpoints are container queries on the root (``:host``), so a report in a notebook's ~850 px
output area of a wide window takes the one-column layout (the heatmap under the bars and the head view), and the
heads grid's thumbnails share the card's width before it scrolls.

Inside a report (the ids below are those of its shadow tree):

* a header: title, model, the text, and where the role labels were computed;
* controls, sticky at the top: a layer select (``#layer-select``), a head select (``#head-select``), a
  word-level view switch (``#word-view``, shown when some word has several pieces) and the selected head's
  summary;
* the text as clickable tokens (``.token[data-index]``); the selected query token has class
  ``selected``, and every token is shaded by how much the query attends to it;
* where the selected query attends in the selected head: one ``.weight-row`` per key in ``#attention-bars``
  (``data-key``, ``data-weight``, a ``.key-token``, a bar, a ``.weight-pct``), sorted by weight (masked keys last),
  under a title naming the query as the terminal does (``#bars-title``: "Where bank (#1-3) attends ..." for the piece
  that stands for a word of several pieces, from ``view["queries"]``), the :data:`BARS_SHOWN` strongest shown and the
  others behind a "show all" toggle (``#bars-toggle``); next to a labelled heatmap of the whole head (``#head-detail``;
  click a row to pick the query), which takes the whole width for a text over 24 pieces. When the cells are too small
  for every label, the heatmap labels every k-th row and column plus the selected query and its strongest key, and the
  hovered cell's row and column; the labels drawn are in the canvas' ``data-labels`` (``{"rows": [[i, text], ...],
  "cols": [[j, text], ...]}``) and hovering a cell names its query and key in full (its title);
* the head view (bertviz's, ``#head-view``, an SVG): for the selected layer, a line from each query (left
  column) to each key (right column) it attends to with weight at least :data:`LINE_THRESHOLD`, opacity =
  weight, one colour per head (``line[data-head][data-query][data-key]``). The selected head is always
  drawn and checkboxes (``#head-view-heads input[data-head]``) add others; hovering a token shows only its
  lines, clicking a query selects it. In cross-attention the right column is the key pieces (the source
  text); no line goes to a masked key of a causal part. The word view draws words here too;
* a grid of every head's heatmap (``canvas.heatmap[data-layer][data-head]``, rows = layers, columns =
  heads) captioned with its role (``.caption``: the label ``.role-label``, its strength, and "?" when the
  confidence is low, as the terminal prints it), the tooltip giving its signals (the role's ``text``),
  confidence, relation and summary; clicking one selects that head. The head summary of the controls shows
  the same;
* the head similarity (``#similarity-section``, shown when the report has ``similarity``): a heads x heads
  heatmap of the Jensen-Shannon divergence (``#similarity-map``, ``data-heads`` its heads in the clustered
  order) where clicking a cell selects its row's head, and the near-duplicate pairs
  (``#near-duplicates button[data-a][data-b]``; one selects its first head and adds the second to the head
  view when they share a layer);
* a sortable table of per-head statistics on this text (``#head-stats``, its header sticky inside its own
  scroller) and, only when corpus statistics were measured, a second one (``#corpus-stats``) folded in a
  ``<details>`` (``#corpus-section``). The role columns (role, strength, confidence, signals, pattern) come
  from ``roles``, labelled from ``roles_from`` (the corpus when one was given): then the first table's
  headers read "role (corpus)", "pattern (corpus)", ... and its note (``#head-stats-note``) says the
  numbers are this text's, and the corpus table has the role columns too.

Clicking a thumbnail or a table row selects the head and brings the bars and heatmap into view.

**One colour scale.** Every weight is coloured by :mod:`multihead.lab.inspect.colours`, the scale of the PNG
too, which the page receives as data (``view["scale"]``: its stops, ticks, label and the grey of masked
cells); the legend shows the label (``#legend-label``) and the ticks (``#legend-ticks``).

**Word-level view.** Word pieces merge into the words the tokenizer made of the text
(:attr:`Inspection.pieces <multihead.lab.inspect.inspection.Inspection>`, :class:`multihead.lab.models.Pieces`: its
pre-tokenizer's words, split at white space; a word is labelled as it stands in the text). Attention TO a word is the
sum over its pieces and FROM a word the mean over its pieces, the definition of
:func:`multihead.lab.inspect.syntax.word_attention`; the page computes it from the piece weights and the per-piece
word index it receives (``view["words"]``). Special pieces ([CLS], [SEP]) stay entries of their own, so the word
view still shows how much goes to them (``word_attention`` drops them: its matrix is the page's without those
rows and columns). The bars and the heatmap switch to words; the thumbnails stay pieces.

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

The data travels as JSON in ``<script type="application/json" id="report-data">`` (inside the template):
``{"report": inspection.to_dict(), "view": {...}}``, the report exactly as ``inspect.json`` holds it.
jinja2's ``|tojson`` escapes ``<``, ``>``, ``&`` and ``'`` inside it, so text such as ``</script>`` cannot end
the script element, and the script inserts every user string with ``textContent`` (never ``innerHTML``), so
the text can hold any markup without it being interpreted. The page is pure ASCII (non-ASCII characters are
JSON or character-reference escapes), so it reads the same whatever encoding it is saved with.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from importlib import resources

from markupsafe import Markup

from multihead.lab._html import JSON_OPTIONS, template_environment
from multihead.lab.inspect.colours import MASKED_RGB, WEIGHT_SCALE_LABEL, WEIGHT_STOPS, WEIGHT_TICKS
from multihead.lab.inspect.inspection import SPECIAL_TOKENS, Inspection, set_html_renderer
from multihead.lab.inspect.roles import word_groups
from multihead.lab.inspect.static import static_view
from multihead.lab.inspect.stats import STAT_NAMES
from multihead.lab.models.tokenizer import Pieces

__all__ = ["render_html", "render_fragment", "word_groups", "TEMPLATE", "FRAGMENT", "BARS_SHOWN", "LINE_THRESHOLD"]

TEMPLATE = "report.html.j2"  # the whole page: FRAGMENT in a minimal document
FRAGMENT = "fragment.html.j2"  # one report, scoped to its root element
BARS_SHOWN = 12  # the bars list shows the strongest keys; the others are one click away
LINE_THRESHOLD = 0.01  # the head view draws a line for a weight at least this

ExtraColumns = Mapping[str, Sequence[Sequence[float | None]]]


def render_html(inspection: Inspection, extra_columns: ExtraColumns | None = None) -> str:
    """One self-contained HTML page (a str) on every head of ``inspection``: :func:`render_fragment` in a
    minimal document titled after the model; see the module docstring.

    ``extra_columns``: per-head scores shown as more columns of the statistics table,
    ``{name: [layer row][head column]}`` over the inspection's layers and heads (from
    :func:`multihead.lab.inspect.headreport.report_columns`).
    """
    data = _data(inspection, extra_columns)
    template = template_environment("multihead.lab.inspect").get_template(TEMPLATE)
    return template.render(title=data["view"]["title"], **_fragment_context(data, inspection))


def render_fragment(inspection: Inspection, extra_columns: ExtraColumns | None = None) -> str:
    """The report of ``inspection`` as one ``<div class="mh-report">`` (a str, no ``<html>`` or ``<body>``):
    its stylesheet, data and script included and scoped to that element, so any number of fragments, of
    the same inspection or others, live in one page (a notebook's outputs) without touching each other or
    the page. ``extra_columns`` as in :func:`render_html`.
    """
    data = _data(inspection, extra_columns)
    return (
        template_environment("multihead.lab.inspect")
        .get_template(FRAGMENT)
        .render(**_fragment_context(data, inspection))
    )


def _words_view(pieces: Pieces) -> dict:
    index, labels, special = pieces.groups()
    return {"index": index, "labels": labels, "special": special}


def _data(inspection: Inspection, extra_columns: ExtraColumns | None) -> dict:
    """What the page draws: ``{"report": inspection.to_dict(), "view": what only the page needs}``."""
    view = {
        "title": f"multihead inspect: {inspection.model_name}",
        "notes": inspection.notes,
        "special": [piece in SPECIAL_TOKENS for piece in inspection.tokens],
        "key_special": [piece in SPECIAL_TOKENS for piece in inspection.key_tokens],
        "stat_names": STAT_NAMES,
        "extra_columns": dict(extra_columns or {}),
        "words": {"query": _words_view(inspection.words[0]), "key": _words_view(inspection.words[1])},
        # what each query piece's row stands for (Inspection.query_of): [its word, first piece, last piece]
        "queries": [list(inspection.query_of(index)) for index in range(len(inspection.tokens))],
        "bars_shown": BARS_SHOWN,
        "line_threshold": LINE_THRESHOLD,
        "scale": {
            "stops": [list(stop) for stop in WEIGHT_STOPS],
            "ticks": list(WEIGHT_TICKS),
            "label": WEIGHT_SCALE_LABEL,
            "masked": list(MASKED_RGB),
        },
    }
    return {"report": inspection.to_dict(), "view": view}


def _fragment_context(data: dict, inspection: Inspection) -> dict:
    """The fragment template's variables; its root id is a hash of the data (the same report renders the
    same bytes; two copies of one report in a page are told apart by the script)."""
    digest = hashlib.sha256(json.dumps(data, **JSON_OPTIONS).encode("ascii")).hexdigest()  # type: ignore[arg-type]
    return {
        "uid": f"mh-{digest[:16]}",
        "css": _asset("report.css"),
        "js": _asset("report.js"),
        "data": data,
        # escaped text and data: URIs; the page stays ASCII (every other character a character reference)
        "static": Markup(static_view(inspection).encode("ascii", "xmlcharrefreplace").decode("ascii")),
    }


# An Inspection shows in a notebook as its report's fragment (Inspection._repr_html_).
set_html_renderer(render_fragment)


@functools.cache
def _asset(name: str) -> Markup:
    """A packaged stylesheet or script, inlined as it is (our own file: it is code, not text to escape)."""
    return Markup((resources.files("multihead.lab.inspect") / "templates" / name).read_text(encoding="utf-8"))
