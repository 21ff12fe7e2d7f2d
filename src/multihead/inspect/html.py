"""A self-contained, interactive HTML report on the attention heads of an encoder for one text.

``render_html(data)`` turns the report dict built by ``multihead inspect`` into one HTML page with
all CSS and JavaScript inline: no external URL, no CDN, no web fonts, so the file works opened
from disk offline. The page shows

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
  were given, a second one (``#corpus-stats``).

The data travels as JSON in ``<script type="application/json" id="report-data">``. ``</`` and
``<!--`` are escaped inside it, so text such as ``</script>`` cannot end the script element, and
the page inserts every user string with ``textContent`` (never ``innerHTML``), so the text can
hold any markup without it being interpreted. The page is pure ASCII (non-ASCII characters are
JSON or character-reference escapes), so it reads the same whatever encoding it is saved with.
"""

from __future__ import annotations

import html
import json
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from multihead._errors import bad_argument

__all__ = ["render_html"]

REQUIRED_KEYS = (
    "title",
    "text",
    "model",
    "tokens",
    "special",
    "layers",
    "heads",
    "weights",
    "roles",
    "stats",
    "stat_names",
    "roles_source",
    "selected_token",
)
ROLE_KEYS = ("label", "pattern", "summary")
CORPUS_KEYS = ("source", "sentences", "tokens", "stats")


def render_html(data: dict) -> str:
    """Return one self-contained HTML page (a str) reporting on attention heads; see the module docstring.

    ``data`` follows the report schema: ``title``, ``text``, ``model``, ``roles_source`` (str);
    ``tokens`` (n str); ``special`` (n bool); ``layers``, ``heads`` (distinct ints);
    ``weights[li][hi][q][k]`` (floats; li, hi index ``layers``, ``heads``); ``roles[li][hi]``
    (dict with ``label``, ``pattern``, ``summary``); ``stats[li][hi]`` (dict of float or None, with
    every key of ``stat_names``); ``stat_names`` (key -> display name); ``selected_token`` (int);
    optional ``corpus`` (None or dict with ``source``, ``sentences``, ``tokens``, ``stats``) and
    ``extra_columns`` (name -> [li][hi] floats). Raises ValueError (TypeError for a wrong type of
    container) naming the offending key when the data does not match the schema.
    """
    payload = _validated(data)
    values = {
        "TITLE": _ascii_html(payload["title"]),
        "REPORT_DATA": _script_json(payload),
    }
    # One pass, so text inside one substituted value is never taken for the other placeholder.
    return re.sub(r"__(TITLE|REPORT_DATA)__", lambda match: values[match.group(1)], _TEMPLATE)


# --------------------------------------------------------------------------- embedding


def _script_json(payload: dict) -> str:
    """JSON that is safe inside a <script> element: no '</' (ends the element), no '<!--'."""
    text = json.dumps(payload, allow_nan=False, ensure_ascii=True, separators=(",", ":"))
    return text.replace("</", "<\\/").replace("<!--", "<\\u0021--")


def _ascii_html(text: str) -> str:
    """Escape text for HTML element content, with non-ASCII characters as character references."""
    return html.escape(text).encode("ascii", "xmlcharrefreplace").decode("ascii")


# --------------------------------------------------------------------------- validation


def _key(name: str) -> str:
    return f"data[{name!r}]"


def _describe(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of length {len(value)}"
    if isinstance(value, Mapping):
        return f"dict with keys {sorted(map(str, value))}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _as_list(value: object) -> object:
    """Tensors and arrays become nested lists; everything else is returned unchanged."""
    if not isinstance(value, (list, tuple, str, Mapping)) and hasattr(value, "tolist"):
        return value.tolist()
    return value


def _string(data: Mapping, name: str) -> str:
    value = data[name]
    if not isinstance(value, str):
        raise bad_argument(_key(name), "a str", _describe(value), f"pass {_key(name)} as text")
    return value


def _int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _index_list(data: Mapping, name: str) -> list[int]:
    value = _as_list(data[name])
    fix = f"pass {_key(name)} as a non-empty list of distinct ints, e.g. [0, 1, 2]"
    if not isinstance(value, (list, tuple)) or not value:
        raise bad_argument(_key(name), "a non-empty list of ints", _describe(value), fix)
    for i, item in enumerate(value):
        if not _int(item):
            raise bad_argument(_key(name), "a list of ints", f"{_describe(item)} at index {i}", fix)
    if len(set(value)) != len(value):
        raise bad_argument(_key(name), "distinct ints", list(value), fix)
    return [int(item) for item in value]


def _number(name: str, path: str, value: object, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(float(value)):
        expected = "a finite number or None" if allow_none else "a finite number"
        fix = "use None for a value that is undefined" if allow_none else "replace NaN/inf by a finite weight"
        raise bad_argument(_key(name), expected, f"{_describe(value)} at {name}{path}", fix)
    return float(value)


_FROM_DATA = object()


def _grid(
    data: Mapping,
    name: str,
    sizes: Sequence[int],
    axes: str,
    leaf: Callable[[str, Any], Any],
    value: object = _FROM_DATA,
    start: str = "",
) -> list:
    """Check that value (default data[name]) nests as lists of the given sizes; map leaf over the leaves."""
    value = data[name] if value is _FROM_DATA else value
    spec = "".join(f"[{size}]" for size in sizes)

    def walk(item: object, depth: int, path: str) -> object:
        if depth == len(sizes):
            return leaf(path, item)
        item = _as_list(item)
        if not isinstance(item, (list, tuple)) or len(item) != sizes[depth]:
            raise bad_argument(
                _key(name),
                f"nested lists {axes} of sizes {spec}",
                f"{_describe(item)} at {name}{path}",
                f"build {name}{axes} with one entry per element of data['layers'], data['heads']"
                + (" and data['tokens']" if len(sizes) > 2 else ""),
            )
        return [walk(sub, depth + 1, f"{path}[{i}]") for i, sub in enumerate(item)]

    return walk(value, 0, start)


def _stats_leaf(name: str, stat_keys: list[str]) -> Callable[[str, Any], dict]:
    def leaf(path: str, item: object) -> dict:
        if not isinstance(item, Mapping) or any(key not in item for key in stat_keys):
            got = _describe(item)
            raise bad_argument(
                _key(name),
                f"a dict with the keys of data['stat_names'] {stat_keys}",
                f"{got} at {name}{path}",
                "give every head a value for every stat in stat_names",
            )
        return {key: _number(name, f"{path}[{key!r}]", item[key], allow_none=True) for key in stat_keys}

    return leaf


def _role_leaf(path: str, item: object) -> dict:
    if not isinstance(item, Mapping) or any(not isinstance(item.get(key), str) for key in ROLE_KEYS):
        raise bad_argument(
            _key("roles"),
            f"a dict of str with keys {list(ROLE_KEYS)}",
            f"{_describe(item)} at roles{path}",
            "give every head {'label': ..., 'pattern': ..., 'summary': ...}",
        )
    return {key: item[key] for key in ROLE_KEYS}


def _validated(data: object) -> dict:
    """Check data against the schema; return a plain JSON-ready copy of what the page uses."""
    if not isinstance(data, Mapping):
        raise bad_argument(
            "data", "a dict (the report schema)", _describe(data), "pass the dict built for the report", kind=TypeError
        )
    for key in REQUIRED_KEYS:
        if key not in data:
            raise bad_argument(
                _key(key),
                "a value (required key)",
                "no such key",
                f"add {key!r} to the report dict; it has {sorted(map(str, data))}",
            )

    out: dict[str, Any] = {key: _string(data, key) for key in ("title", "text", "model", "roles_source")}

    tokens = _as_list(data["tokens"])
    if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise bad_argument(
            _key("tokens"),
            "a non-empty list of str",
            _describe(tokens),
            "pass the word pieces of the text, special tokens included",
        )
    n = len(tokens)
    out["tokens"] = list(tokens)

    special = _as_list(data["special"])
    if (
        not isinstance(special, (list, tuple))
        or len(special) != n
        or not all(isinstance(s, bool) or s in (0, 1) for s in special)
    ):
        raise bad_argument(
            _key("special"),
            f"a list of {n} bools (one per token)",
            _describe(special),
            "mark [CLS]/[SEP] True and every other token False",
        )
    out["special"] = [bool(s) for s in special]

    out["layers"] = layers = _index_list(data, "layers")
    out["heads"] = heads = _index_list(data, "heads")
    grid = (len(layers), len(heads))

    out["weights"] = _grid(
        data, "weights", (*grid, n, n), "[layer][head][query][key]", lambda path, w: _number("weights", path, w)
    )
    out["roles"] = _grid(data, "roles", grid, "[layer][head]", _role_leaf)

    stat_names = data["stat_names"]
    if not isinstance(stat_names, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in stat_names.items()
    ):
        raise bad_argument(
            _key("stat_names"),
            "a dict str -> str (stat key -> display name)",
            _describe(stat_names),
            "map every stats key to the name shown in the table",
        )
    stat_keys = list(stat_names)
    out["stat_names"] = dict(stat_names)
    out["stats"] = _grid(data, "stats", grid, "[layer][head]", _stats_leaf("stats", stat_keys))

    selected = data["selected_token"]
    if not _int(selected) or not 0 <= selected < n:
        raise bad_argument(
            _key("selected_token"),
            f"an int in [0, {n})",
            _describe(selected),
            "pass the index of a token in data['tokens']",
        )
    out["selected_token"] = int(selected)

    corpus = data.get("corpus")
    if corpus is not None:
        if not isinstance(corpus, Mapping) or any(key not in corpus for key in CORPUS_KEYS):
            raise bad_argument(
                _key("corpus"),
                f"None or a dict with keys {list(CORPUS_KEYS)}",
                _describe(corpus),
                "pass None when no corpus was given",
            )
        if not isinstance(corpus["source"], str) or not _int(corpus["sentences"]) or not _int(corpus["tokens"]):
            raise bad_argument(
                _key("corpus"),
                "source str, sentences int, tokens int",
                _describe({k: corpus[k] for k in ("source", "sentences", "tokens")}),
                "describe the corpus and give its sentence and token counts",
            )
        corpus_stats = _grid(
            data,
            "corpus",
            grid,
            "['stats'][layer][head]",
            _stats_leaf("corpus", stat_keys),
            value=corpus["stats"],
            start="['stats']",
        )
        corpus = {
            "source": corpus["source"],
            "sentences": int(corpus["sentences"]),
            "tokens": int(corpus["tokens"]),
            "stats": corpus_stats,
        }
    out["corpus"] = corpus

    extra = data.get("extra_columns") or {}
    if not isinstance(extra, Mapping):
        raise bad_argument(
            _key("extra_columns"),
            "a dict name -> [layer][head] floats",
            _describe(extra),
            "pass {} when there are no extra columns",
        )
    out["extra_columns"] = {}
    for column, values in extra.items():
        if not isinstance(column, str):
            raise bad_argument(
                _key("extra_columns"), "str column names", _describe(column), "name each extra column with a str"
            )
        out["extra_columns"][column] = _grid(
            data,
            "extra_columns",
            grid,
            f"[{column!r}][layer][head]",
            lambda path, v: _number("extra_columns", path, v, allow_none=True),
            value=values,
            start=f"[{column!r}]",
        )
    return out


# --------------------------------------------------------------------------- the page

_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="color-scheme" content="light">
<link rel="icon" href="data:,">
<title>__TITLE__</title>
<style>
:root {
  --bg: #f5f6f8; --card: #fff; --line: #e1e4e8; --text: #1f2328; --muted: #656d76;
  --accent: #1f6feb; --accent-soft: #ddeafd; --special: #8250df;
  --sans: -apple-system, BlinkMacSystemFont, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
  --mono: ui-monospace, SFMono-Regular, Menlo, Consolas, "Liberation Mono", monospace;
}
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--text); font: 14px/1.45 var(--sans); }
main { max-width: 1180px; margin: 0 auto; padding: 0 20px 40px; }
h1 { font-size: 20px; margin: 0 0 6px; font-weight: 600; }
h2 { font-size: 15px; margin: 0 0 10px; font-weight: 600; }
.hint { color: var(--muted); font-weight: 400; font-size: 12.5px; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 14px 16px;
        margin-top: 14px; }

header.card { margin-top: 20px; }
.meta { display: flex; flex-wrap: wrap; gap: 4px 22px; color: var(--muted); font-size: 13px; margin: 0; }
.meta dt { display: inline; }
.meta dd { display: inline; margin: 0 0 0 4px; color: var(--text); }
.input-text { margin: 10px 0 0; padding: 8px 12px; border-left: 3px solid var(--accent); background: #f6f8fa;
              border-radius: 0 6px 6px 0; white-space: pre-wrap; overflow-wrap: anywhere; }

.controls { position: sticky; top: 0; z-index: 5; display: flex; align-items: center; gap: 10px 18px; flex-wrap: wrap;
            padding: 10px 16px; }
.controls label { font-weight: 600; font-size: 13px; }
.controls select { font: inherit; padding: 3px 6px; margin-left: 6px; border: 1px solid #c9ced4; border-radius: 6px;
                   background: #fff; }
.head-summary { flex: 1 1 420px; color: var(--muted); font-size: 13px; }
.head-summary .role { color: var(--text); font-weight: 600; }
.pill { display: inline-block; padding: 0 7px; border-radius: 10px; background: var(--accent-soft); color: #0b3d91;
        font-size: 12px; margin: 0 4px; }

.focus { display: grid; grid-template-columns: minmax(0, 1fr) 460px; gap: 14px; align-items: start; }
.focus > .card { margin-top: 14px; }
.tokens { display: flex; flex-wrap: wrap; gap: 5px; margin-bottom: 14px; }
.token { font: 13px/1.3 var(--mono); padding: 3px 7px; border: 1px solid #d0d7de; border-radius: 5px; cursor: pointer;
         background: #fff; color: var(--text); white-space: pre; min-width: 1.6em; }
.token.special { color: var(--special); }
.token.dark { color: #fff; }
.token:hover { border-color: var(--accent); }
.token.selected { outline: 2px solid #e8590c; outline-offset: 1px; border-color: #e8590c; }
.token:focus-visible { outline: 2px solid var(--accent); }

#attention-bars { display: grid; gap: 2px; }
.weight-row { display: grid; grid-template-columns: 2.2em minmax(4em, 11em) minmax(0, 1fr) 4.2em; align-items: center;
              gap: 8px; padding: 1px 4px; border-radius: 4px; font-size: 13px; }
.weight-row.is-query { background: #fff4e6; }
.weight-row.is-max .key-token { font-weight: 700; }
.key-index { color: var(--muted); text-align: right; font-size: 11.5px; font-variant-numeric: tabular-nums; }
.key-token { font-family: var(--mono); white-space: pre; overflow: hidden; text-overflow: ellipsis; }
.key-token.special { color: var(--special); }
.bar-track { height: 12px; background: #eef1f4; border-radius: 3px; overflow: hidden; }
.bar-fill { height: 100%; background: #2f7fd0; border-radius: 3px; min-width: 1px; }
.weight-pct { text-align: right; font-variant-numeric: tabular-nums; }

.detail-wrap { overflow: auto; }
#head-detail { display: block; cursor: pointer; }
.legend { display: flex; align-items: center; gap: 8px; color: var(--muted); font-size: 12px; margin-top: 8px; }
.legend .ramp { width: 160px; height: 10px; border-radius: 2px; border: 1px solid var(--line); }

.grid-wrap { overflow-x: auto; }
#head-grid { display: grid; gap: 6px 8px; align-items: center; justify-content: start; }
.axis { color: var(--muted); font-size: 12px; text-align: center; white-space: nowrap; }
.axis.row { text-align: right; padding-right: 4px; }
.head-cell { margin: 0; padding: 3px; border: 2px solid transparent; border-radius: 6px; cursor: pointer; }
.head-cell:hover { border-color: #c9d6e8; }
.head-cell.current { border-color: #e8590c; background: #fff4e6; }
canvas.heatmap { display: block; width: 100%; aspect-ratio: 1 / 1; image-rendering: pixelated; border-radius: 2px; }
.role-label { display: block; margin-top: 2px; text-align: center; font-size: 11.5px; color: var(--text);
              white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }

.table-wrap { overflow-x: auto; }
table.stats { border-collapse: collapse; width: 100%; font-size: 12.5px; font-variant-numeric: tabular-nums; }
table.stats th, table.stats td { padding: 4px 8px; border-bottom: 1px solid #eceef1; text-align: right;
                                 white-space: nowrap; }
table.stats th { position: sticky; top: 0; background: #f6f8fa; font-weight: 600; cursor: pointer; user-select: none;
                 border-bottom: 1px solid var(--line); }
table.stats th.text, table.stats td.text { text-align: left; }
table.stats th[aria-sort="ascending"]::after { content: " \25B2"; font-size: 9px; }
table.stats th[aria-sort="descending"]::after { content: " \25BC"; font-size: 9px; }
table.stats tbody tr { cursor: pointer; }
table.stats tbody tr:hover td { background: #f3f6fa; }
table.stats tbody tr.current td { background: #fff4e6; }
footer { color: var(--muted); font-size: 12px; margin-top: 16px; }

@media (max-width: 960px) { .focus { grid-template-columns: minmax(0, 1fr); } }
</style>
</head>
<body>
<main>
  <header class="card">
    <h1 id="report-title"></h1>
    <dl class="meta">
      <div><dt>model</dt><dd id="report-model"></dd></div>
      <div><dt>tokens</dt><dd id="report-ntokens"></dd></div>
      <div><dt>roles from</dt><dd id="report-roles-source"></dd></div>
      <div id="report-corpus-meta" hidden><dt>corpus</dt><dd id="report-corpus"></dd></div>
    </dl>
    <p class="input-text" id="report-text"></p>
  </header>

  <section class="card controls" aria-label="head selection">
    <label>Layer<select id="layer-select"></select></label>
    <label>Head<select id="head-select"></select></label>
    <div class="head-summary" id="head-summary" aria-live="polite"></div>
  </section>

  <div class="focus">
    <section class="card">
      <h2>Query token <span class="hint">click a token; shading = attention it receives from the query</span></h2>
      <div class="tokens" id="tokens"></div>
      <h2 id="bars-title"></h2>
      <div id="attention-bars"></div>
    </section>
    <section class="card">
      <h2>This head, all queries <span class="hint">rows = query, columns = key; click a row</span></h2>
      <div class="detail-wrap"><canvas id="head-detail"></canvas></div>
      <div class="legend"><span>weight</span><span class="ramp" id="legend-ramp"></span>
        <span>0 &middot; 0.25 &middot; 1 (square-root scale)</span></div>
    </section>
  </div>

  <section class="card">
    <h2>All heads <span class="hint">rows = layers, columns = heads; click a heatmap to select it</span></h2>
    <div class="grid-wrap"><div id="head-grid"></div></div>
  </section>

  <section class="card">
    <h2>Per-head statistics on this text <span class="hint">click a header to sort, a row to select the head</span></h2>
    <div class="table-wrap"><table class="stats" id="head-stats"></table></div>
  </section>

  <div id="corpus-slot"></div>
  <footer>Generated by multihead inspect. Self-contained page: no network access needed.</footer>
</main>

<script type="application/json" id="report-data">__REPORT_DATA__</script>
<script>
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var n = data.tokens.length;
  var state = { li: 0, hi: 0, q: data.selected_token };

  function byId(id) { return document.getElementById(id); }

  /* Create an element; text (user data included) goes in through textContent only. */
  function el(tag, className, text) {
    var node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  /* Sequential color scale (light to dark blue) on sqrt(weight), so small weights stay visible. */
  var STOPS = [[247, 251, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];
  function rgb(w) {
    var t = Math.sqrt(Math.min(1, Math.max(0, w))) * (STOPS.length - 1);
    var i = Math.min(STOPS.length - 2, Math.floor(t)), f = t - i, a = STOPS[i], b = STOPS[i + 1];
    return [0, 1, 2].map(function (c) { return Math.round(a[c] + f * (b[c] - a[c])); });
  }
  function css(w) { return "rgb(" + rgb(w).join(",") + ")"; }
  function pct(w) { return (100 * w).toFixed(1) + "%"; }
  function fmt(x) {
    if (x === null || x === undefined) return "\u2014";
    if (Number.isInteger(x)) return String(x);
    var a = Math.abs(x);
    return x.toFixed(a >= 100 ? 0 : a >= 10 ? 1 : 3);
  }
  function weights() { return data.weights[state.li][state.hi]; }
  function role() { return data.roles[state.li][state.hi]; }

  /* ---------------------------------------------------------------- header and controls */
  byId("report-title").textContent = data.title;
  byId("report-model").textContent = data.model;
  byId("report-ntokens").textContent = String(n);
  byId("report-roles-source").textContent = data.roles_source;
  byId("report-text").textContent = data.text;
  if (data.corpus) {
    byId("report-corpus").textContent = data.corpus.source;
    byId("report-corpus-meta").hidden = false;
  }
  byId("legend-ramp").style.background = "linear-gradient(to right, " +
    [0, 0.0625, 0.25, 0.5625, 1].map(css).join(", ") + ")";

  var layerSelect = byId("layer-select"), headSelect = byId("head-select");
  data.layers.forEach(function (layer) {
    var option = el("option", "", "layer " + layer); option.value = String(layer); layerSelect.appendChild(option);
  });
  data.heads.forEach(function (head) {
    var option = el("option", "", "head " + head); option.value = String(head); headSelect.appendChild(option);
  });
  layerSelect.addEventListener("change", function () { state.li = layerSelect.selectedIndex; render(); });
  headSelect.addEventListener("change", function () { state.hi = headSelect.selectedIndex; render(); });

  function selectHead(li, hi) { state.li = li; state.hi = hi; render(); }
  function selectQuery(q) { state.q = q; render(); }

  /* ---------------------------------------------------------------- tokens */
  var tokenNodes = data.tokens.map(function (token, q) {
    var node = el("button", "token" + (data.special[q] ? " special" : ""), token);
    node.type = "button";
    node.setAttribute("data-index", String(q));
    node.addEventListener("click", function () { selectQuery(q); });
    byId("tokens").appendChild(node);
    return node;
  });

  /* ---------------------------------------------------------------- heatmap grid */
  var grid = byId("head-grid"), cells = [];
  grid.style.gridTemplateColumns = "auto repeat(" + data.heads.length + ", minmax(58px, 92px))";
  grid.appendChild(el("div", "axis"));
  data.heads.forEach(function (head) { grid.appendChild(el("div", "axis", "head " + head)); });
  data.layers.forEach(function (layer, li) {
    grid.appendChild(el("div", "axis row", "layer " + layer));
    cells.push(data.heads.map(function (head, hi) {
      var r = data.roles[li][hi];
      var cell = el("figure", "head-cell");
      var canvas = el("canvas", "heatmap");
      canvas.setAttribute("data-layer", String(layer));
      canvas.setAttribute("data-head", String(head));
      canvas.setAttribute("role", "button");
      canvas.setAttribute("tabindex", "0");
      canvas.setAttribute("aria-label", "layer " + layer + ", head " + head + ": " + r.label);
      cell.title = "layer " + layer + ", head " + head + " \u2014 " + r.label + " (" + r.pattern + "): " + r.summary;
      drawSmall(canvas, data.weights[li][hi]);
      canvas.addEventListener("click", function () { selectHead(li, hi); });
      canvas.addEventListener("keydown", function (event) {
        if (event.key === "Enter" || event.key === " ") { event.preventDefault(); selectHead(li, hi); }
      });
      cell.appendChild(canvas);
      cell.appendChild(el("figcaption", "role-label", r.label));
      grid.appendChild(cell);
      return cell;
    }));
  });

  /* One pixel per (query, key); CSS scales it up without smoothing. */
  function drawSmall(canvas, matrix) {
    canvas.width = n; canvas.height = n;
    var ctx = canvas.getContext("2d"), image = ctx.createImageData(n, n);
    for (var q = 0; q < n; q++) for (var k = 0; k < n; k++) {
      var c = rgb(matrix[q][k]), o = 4 * (q * n + k);
      image.data[o] = c[0]; image.data[o + 1] = c[1]; image.data[o + 2] = c[2]; image.data[o + 3] = 255;
    }
    ctx.putImageData(image, 0, 0);
  }

  /* ---------------------------------------------------------------- large heatmap of the selected head */
  var detail = byId("head-detail");
  /* Cells as large as the card allows (at most 30px); token labels (vertical above) when cells fit the text. */
  var layout = (function () {
    var ctx = detail.getContext("2d"), room = Math.max(120, detail.parentElement.clientWidth - 2);
    ctx.font = "11px " + getComputedStyle(document.body).getPropertyValue("--mono");
    var names = data.tokens.map(function (t) { return t.length > 12 ? t.slice(0, 11) + "\u2026" : t; });
    var width = Math.ceil(Math.max.apply(null, names.map(function (t) { return ctx.measureText(t).width; }))) + 8;
    var cell = Math.min(30, Math.floor((room - width) / n));
    if (cell >= 11) return { cell: cell, labels: true, names: names, left: width, top: width };
    return { cell: Math.max(2, Math.min(30, Math.floor(room / n))), labels: false, names: names, left: 0, top: 0 };
  })();
  (function () {
    var dpr = window.devicePixelRatio || 1, w = layout.left + n * layout.cell + 2, h = layout.top + n * layout.cell + 2;
    detail.width = Math.round(w * dpr); detail.height = Math.round(h * dpr);
    detail.style.width = w + "px"; detail.style.height = h + "px";
    detail.getContext("2d").scale(dpr, dpr);
  })();
  function rowAt(event) {
    var box = detail.getBoundingClientRect(), y = event.clientY - box.top - layout.top;
    var x = event.clientX - box.left - layout.left, q = Math.floor(y / layout.cell), k = Math.floor(x / layout.cell);
    return { q: q, k: k, inside: q >= 0 && q < n };
  }
  detail.addEventListener("click", function (event) { var at = rowAt(event); if (at.inside) selectQuery(at.q); });
  detail.addEventListener("mousemove", function (event) {
    var at = rowAt(event);
    detail.title = at.inside && at.k >= 0 && at.k < n
      ? data.tokens[at.q] + " \u2192 " + data.tokens[at.k] + ": " + pct(weights()[at.q][at.k]) : "";
  });

  function drawDetail() {
    var ctx = detail.getContext("2d"), m = weights(), s = layout.cell, x0 = layout.left, y0 = layout.top;
    ctx.clearRect(0, 0, detail.width, detail.height);
    for (var q = 0; q < n; q++) for (var k = 0; k < n; k++) {
      ctx.fillStyle = css(m[q][k]); ctx.fillRect(x0 + k * s, y0 + q * s, s, s);
    }
    if (layout.labels) {
      ctx.font = "11px " + getComputedStyle(document.body).getPropertyValue("--mono");
      ctx.textBaseline = "middle";
      layout.names.forEach(function (name, i) {
        ctx.fillStyle = i === state.q ? "#c2410c" : data.special[i] ? "#8250df" : "#1f2328";
        ctx.textAlign = "right"; ctx.fillText(name, x0 - 5, y0 + (i + 0.5) * s);
        ctx.save(); ctx.translate(x0 + (i + 0.5) * s, y0 - 5); ctx.rotate(-Math.PI / 2);
        ctx.textAlign = "left"; ctx.fillStyle = data.special[i] ? "#8250df" : "#1f2328"; ctx.fillText(name, 0, 0);
        ctx.restore();
      });
    }
    ctx.strokeStyle = "#e8590c"; ctx.lineWidth = 2;
    ctx.strokeRect(x0 + 1, y0 + state.q * s + 1, n * s - 2, Math.max(2, s - 2));
  }

  /* ---------------------------------------------------------------- where the query attends */
  function drawBars() {
    var row = weights()[state.q], max = Math.max.apply(null, row), bars = byId("attention-bars");
    var title = byId("bars-title");
    title.textContent = "";
    title.appendChild(document.createTextNode("Where "));
    title.appendChild(el("code", "", data.tokens[state.q]));
    title.appendChild(document.createTextNode(" (#" + state.q + ") attends in layer " + data.layers[state.li] +
      ", head " + data.heads[state.hi]));
    bars.textContent = "";
    row.forEach(function (w, k) {
      var line = el("div", "weight-row" + (k === state.q ? " is-query" : "") + (w === max ? " is-max" : ""));
      line.setAttribute("data-key", String(k));
      line.setAttribute("data-weight", String(w));
      line.appendChild(el("span", "key-index", k));
      line.appendChild(el("span", "key-token" + (data.special[k] ? " special" : ""), data.tokens[k]));
      var track = el("div", "bar-track"), fill = el("div", "bar-fill");
      fill.style.width = (100 * w) + "%";
      track.appendChild(fill);
      line.appendChild(track);
      line.appendChild(el("span", "weight-pct", pct(w)));
      bars.appendChild(line);
    });
    tokenNodes.forEach(function (node, k) {
      var w = row[k];
      node.classList.toggle("selected", k === state.q);
      node.style.background = css(w);
      node.classList.toggle("dark", Math.sqrt(w) > 0.55);
      node.title = pct(w) + " of the attention of \u201c" + data.tokens[state.q] + "\u201d";
    });
  }

  function drawSummary() {
    var r = role(), box = byId("head-summary");
    box.textContent = "";
    box.appendChild(document.createTextNode(
      "layer " + data.layers[state.li] + " \u00b7 head " + data.heads[state.hi] + ": "));
    box.appendChild(el("span", "role", r.label));
    box.appendChild(el("span", "pill", r.pattern));
    box.appendChild(document.createTextNode(r.summary));
  }

  /* ---------------------------------------------------------------- statistics tables */
  function statColumns() {
    return Object.keys(data.stat_names).map(function (key) {
      return { label: data.stat_names[key], title: key,
               get: function (li, hi, stats) { return stats[li][hi][key]; } };
    });
  }
  function headColumns() {
    return [
      { label: "layer", get: function (li) { return data.layers[li]; } },
      { label: "head", get: function (li, hi) { return data.heads[hi]; } },
    ];
  }

  /* A table with one row per (layer, head); click a header to sort, a row to select the head. */
  function buildTable(table, columns, stats) {
    var rows = [];
    data.layers.forEach(function (layer, li) {
      data.heads.forEach(function (head, hi) {
        var tr = el("tr");
        tr.setAttribute("data-layer", String(layer));
        tr.setAttribute("data-head", String(head));
        var values = columns.map(function (column) {
          var value = column.get(li, hi, stats);
          var td = el("td", column.text ? "text" : "", column.text ? value : fmt(value));
          if (column.tip) td.title = column.tip(li, hi);
          tr.appendChild(td);
          return value;
        });
        tr.addEventListener("click", function () { selectHead(li, hi); });
        rows.push({ tr: tr, li: li, hi: hi, values: values, order: rows.length });
      });
    });
    var head = el("thead"), headRow = el("tr"), body = el("tbody"), sorted = { index: -1, dir: 1 };
    columns.forEach(function (column, index) {
      var th = el("th", column.text ? "text" : "", column.label);
      th.setAttribute("scope", "col");
      if (column.title) th.title = column.title;
      th.addEventListener("click", function () {
        sorted.dir = sorted.index === index ? -sorted.dir : (column.text ? 1 : -1);
        sorted.index = index;
        Array.prototype.forEach.call(headRow.children, function (other) { other.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", sorted.dir > 0 ? "ascending" : "descending");
        rows.sort(function (a, b) {
          var x = a.values[index], y = b.values[index];
          if (x === y) return a.order - b.order;
          if (x === null) return 1;
          if (y === null) return -1;
          return (x < y ? -1 : 1) * sorted.dir;
        });
        rows.forEach(function (row) { body.appendChild(row.tr); });
      });
      headRow.appendChild(th);
    });
    head.appendChild(headRow);
    rows.forEach(function (row) { body.appendChild(row.tr); });
    table.appendChild(head);
    table.appendChild(body);
    return rows;
  }

  var roleColumns = [
    { label: "role", text: true, get: function (li, hi) { return data.roles[li][hi].label; },
      tip: function (li, hi) { return data.roles[li][hi].summary; } },
    { label: "pattern", text: true, get: function (li, hi) { return data.roles[li][hi].pattern; } },
  ];
  var extraColumns = Object.keys(data.extra_columns).map(function (name) {
    return { label: name, get: function (li, hi) { return data.extra_columns[name][li][hi]; } };
  });
  var tableRows = [buildTable(byId("head-stats"),
    headColumns().concat(roleColumns, statColumns(), extraColumns), data.stats)];

  if (data.corpus) {
    var section = el("section", "card");
    var heading = el("h2", "", "Per-head statistics on the corpus ");
    heading.appendChild(el("span", "hint", data.corpus.source + " \u00b7 " + data.corpus.tokens + " tokens"));
    var wrap = el("div", "table-wrap"), table = el("table", "stats");
    table.id = "corpus-stats";
    wrap.appendChild(table);
    section.appendChild(heading);
    section.appendChild(wrap);
    byId("corpus-slot").appendChild(section);
    tableRows.push(buildTable(table, headColumns().concat(statColumns()), data.corpus.stats));
  }

  /* ---------------------------------------------------------------- render */
  function render() {
    layerSelect.selectedIndex = state.li;
    headSelect.selectedIndex = state.hi;
    cells.forEach(function (row, li) {
      row.forEach(function (cell, hi) { cell.classList.toggle("current", li === state.li && hi === state.hi); });
    });
    tableRows.forEach(function (rows) {
      rows.forEach(function (row) { row.tr.classList.toggle("current", row.li === state.li && row.hi === state.hi); });
    });
    drawSummary();
    drawBars();
    drawDetail();
  }
  render();
})();
</script>
</body>
</html>
"""
