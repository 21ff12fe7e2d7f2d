"""The HTML report as a page part: fragments scoped to their root (any number in one page, none touching the host
page or another report), and the page's views, driven in Debian's chromium through Playwright (one browser for the
module, never a downloaded one).
"""

from __future__ import annotations

import dataclasses
import doctest
import json
import math
import re

import pytest
import torch

from multihead.lab.inspect.colours import MASKED_RGB, WEIGHT_SCALE_LABEL, WEIGHT_STOPS, WEIGHT_TICKS, weight_rgb
from multihead.lab.inspect.html import LINE_THRESHOLD, render_fragment, render_html, word_groups
from multihead.lab.inspect.inspection import Inspection
from multihead.lab.inspect.stats import STAT_NAMES, weight_stats
from multihead.lab.inspect.syntax import word_attention
from support_inspect import CORPUS_SOURCE, HEADS, LAYERS, TEXT, TOKENS, rectangular_inspection, synthetic_inspection
from test_inspect_html import ROLES, browser, open_page, page_data, read_bars  # noqa: F401 (fixtures)

OTHER_TOKENS = ["[CLS]", "a", "river", "bank", "flood", "##ed", "[SEP]"]
OTHER_TEXT = "A river bank flooded."

# A host page that styles body, h1 and the ids and classes a report uses inside itself.
HOST_STYLE = """
body { font-family: serif; color: rgb(10, 20, 30); background: rgb(250, 240, 230); margin: 3px; font-size: 17px; }
h1 { color: rgb(200, 0, 0); font-size: 40px; }
h2, .card, .token { color: rgb(0, 128, 0); padding: 7px; border: 0; }
#layer-select { width: 77px; }
table.stats td { padding: 9px; }
"""
HOST_BODY = """
<h1 id="report-title">Host title</h1>
<div class="card" id="tokens"><span class="token">host token</span></div>
<h2 id="bars-title">host heading</h2>
<select id="layer-select"><option>host</option></select>
<table class="stats" id="head-stats"><tr><td>host cell</td></tr></table>
"""
HOST_ELEMENTS = [
    "body",
    "h1#report-title",
    "#tokens",
    "#tokens .token",
    "#bars-title",
    "#layer-select",
    "#head-stats td",
]
PROPERTIES = ["color", "font-family", "font-size", "background-color", "margin", "padding", "width", "display"]


def host_page(*fragments: str) -> str:
    parts = "\n<p>between the reports</p>\n".join(fragments)
    return f"<!DOCTYPE html><html><head><style>{HOST_STYLE}</style></head><body>{HOST_BODY}{parts}</body></html>"


def host_styles(page) -> dict:
    """The computed styles of the host page's own elements."""
    return page.evaluate(
        """([selectors, properties]) => Object.fromEntries(selectors.map(s => {
            const style = getComputedStyle(document.querySelector(s));
            return [s, properties.map(p => style.getPropertyValue(p))];
        }))""",
        [HOST_ELEMENTS, PROPERTIES],
    )


def report_state(report) -> dict:
    """What one report shows now: its selects, selected token, bars and current thumbnail."""
    return {
        "layer": report.locator("#layer-select").input_value(),
        "head": report.locator("#head-select").input_value(),
        "tokens": report.locator(".token").evaluate_all("ts => ts.map(t => t.textContent)"),
        "selected": report.locator(".token.selected").evaluate_all("ts => ts.map(t => t.dataset.index)"),
        "bars": read_bars(report),
        "current": report.locator(".head-cell.current canvas").evaluate_all(
            "cs => cs.map(c => [c.dataset.layer, c.dataset.head])"
        ),
        "summary": report.locator("#head-summary").text_content(),
        "title": report.locator("#report-title").text_content(),
    }


# --------------------------------------------------------------------------- Python level


def test_a_fragment_is_one_scoped_element():
    inspection = synthetic_inspection()
    fragment = render_fragment(inspection)
    assert re.match(r'<div class="mh-report" id="mh-[0-9a-f]{16}"><div class="mh-static">', fragment)
    # the interactive markup, hidden without script: by an inline style and a valued hidden, both of which
    # JupyterLab's sanitizer keeps (a bare `hidden` it drops)
    assert '<div class="mh-markup" hidden="hidden" style="display:none"><template>' in fragment
    assert fragment.rstrip().endswith("</div>") and fragment.isascii()
    for tag in ("<html", "<head>", "<body", "<!DOCTYPE", "<title", "<link"):
        assert tag not in fragment, tag
    # the stylesheet and the data are inside the inert template; outside it only the static view and the script
    inside = fragment[fragment.index("<template>") : fragment.index("</template>")]
    outside = fragment.replace(inside, "")
    assert "<style>" in inside and "<style" not in outside
    assert 'id="report-data"' in inside and 'id="report-data"' not in outside
    assert page_data(fragment) == page_data(render_html(inspection))
    # the same report renders the same bytes; another report has another root id
    assert render_fragment(inspection) == fragment
    other = render_fragment(synthetic_inspection(tokens=OTHER_TOKENS, text=OTHER_TEXT, seed=1))
    assert re.search(r'id="(mh-\w+)"', other).group(1) != re.search(r'id="(mh-\w+)"', fragment).group(1)
    # the full page is the fragment in a minimal document
    assert fragment in render_html(inspection)


def test_an_inspection_shows_in_a_notebook_as_its_fragment():
    inspection = synthetic_inspection(corpus=True)
    assert inspection._repr_html_() == render_fragment(inspection)


def test_the_stylesheet_has_no_rule_outside_the_report():
    from importlib import resources

    css = (resources.files("multihead.lab.inspect") / "templates" / "report.css").read_text(encoding="utf-8")
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    selectors = [s.strip() for block in re.findall(r"([^{}]+)\{", css) for s in block.split(",")]
    selectors = [s for s in selectors if not s.startswith("@")]
    assert selectors
    for selector in selectors:  # the root is :host; nothing names the document's html, body or :root
        assert not re.match(r"(html|body|:root)\b", selector), selector


# --------------------------------------------------------------------------- in the browser


def test_two_reports_in_one_page_stay_apart_and_leave_the_host_alone(open_page):  # noqa: F811 (the fixture)
    first = synthetic_inspection()
    second = synthetic_inspection(tokens=OTHER_TOKENS, text=OTHER_TEXT, model_name="other-model", seed=1)
    bare = open_page(host_page())
    expected_host = host_styles(bare)
    page = open_page(host_page(render_fragment(first), render_fragment(second)))
    assert host_styles(page) == expected_host  # no report rule reaches the host's body, h1, ids or classes
    assert page.evaluate("document.getElementById('report-title').textContent") == "Host title"
    assert page.evaluate("document.querySelectorAll('[id=report-data], [id=layer-select]').length") == 1  # host's
    one, two = page.locator(".mh-report").nth(0), page.locator(".mh-report").nth(1)
    assert page.locator(".mh-report").count() == 2
    # the host's h1 rule does not restyle the reports' own title
    title_style = two.locator("#report-title").evaluate(
        "h => [getComputedStyle(h).fontSize, getComputedStyle(h).color]"
    )
    assert title_style == ["20px", "rgb(31, 35, 40)"]

    before = report_state(one)
    assert before["tokens"] == first.tokens and before["title"] == "multihead inspect: all-MiniLM-L6-v2"
    state = report_state(two)
    assert state["tokens"] == OTHER_TOKENS and state["title"] == "multihead inspect: other-model"
    data = second.to_dict()
    assert [w for _, w, _, _ in state["bars"]] == data["weights"][0][0][second.token]

    two.locator('.token[data-index="4"]').click()
    two.locator(f'canvas.heatmap[data-layer="{LAYERS[1]}"][data-head="{HEADS[2]}"]').click()
    after = report_state(two)
    assert (after["layer"], after["head"], after["selected"]) == (str(LAYERS[1]), str(HEADS[2]), ["4"])
    assert after["current"] == [[str(LAYERS[1]), str(HEADS[2])]]
    assert [w for _, w, _, _ in after["bars"]] == data["weights"][1][2][4]
    two.locator("#head-select").select_option(str(HEADS[1]))
    assert [w for _, w, _, _ in read_bars(two)] == data["weights"][1][1][4]
    assert report_state(one) == before  # report 1 unchanged
    one.locator('.token[data-index="6"]').click()
    assert report_state(one)["selected"] == ["6"] and report_state(two)["selected"] == ["4"]
    assert host_styles(page) == expected_host


def test_the_same_report_twice_draws_twice(open_page):  # noqa: F811 (the fixture)
    inspection = synthetic_inspection()
    fragment = render_fragment(inspection)
    page = open_page(host_page(fragment, fragment))
    ids = page.eval_on_selector_all(".mh-report", "rs => rs.map(r => r.id)")
    assert len(ids) == 2 and ids[1] == ids[0] + "-2"  # the later copy gets an id of its own
    one, two = page.locator(".mh-report").nth(0), page.locator(".mh-report").nth(1)
    before = report_state(one)
    assert report_state(two) == before and len(before["bars"]) == len(inspection.tokens)
    two.locator('.token[data-index="5"]').click()
    assert report_state(two)["selected"] == ["5"] and report_state(one) == before


def test_the_page_works_from_disk_offline(browser, tmp_path):  # noqa: F811 (the fixture)
    inspection = synthetic_inspection(corpus=True)
    path = tmp_path / "report.html"
    path.write_text(render_html(inspection), encoding="utf-8")
    context = browser.new_context(offline=True, viewport={"width": 1200, "height": 900})
    requests, errors = [], []
    page = context.new_page()
    page.on("request", lambda request: requests.append(request.url))
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.goto(path.as_uri())
    try:
        assert requests == [path.as_uri()] and errors == []
        assert page.locator(".token").count() == len(inspection.tokens)
        assert len(read_bars(page)) == len(inspection.tokens)
        assert page.locator("canvas.heatmap").count() == len(LAYERS) * len(HEADS)
        assert page.text_content("#report-corpus") == inspection.corpus.source
    finally:
        context.close()


# --------------------------------------------------------------------------- a long page: sticky header, scrolling


def many_heads(
    layers: int = 6, heads: int = 12, tokens: list[str] | None = None, seed: int = 0, copies=()
) -> Inspection:
    """An Inspection of ``layers`` x ``heads`` random heads (a table too long for its box); ``copies``:
    ((layer, head), (layer, head)) pairs, the second head given the first one's weights (a near-duplicate)."""
    tokens = list(TOKENS if tokens is None else tokens)
    gen = torch.Generator().manual_seed(seed)
    weights = (2.5 * torch.randn(layers, heads, len(tokens), len(tokens), generator=gen)).softmax(-1)
    for (la, ha), (lb, hb) in copies:
        weights[lb, hb] = weights[la, ha]
    stats = weight_stats(
        [weights[row][None] for row in range(layers)],
        [tokens],
        layers=list(range(layers)),
        heads=list(range(heads)),
        source="this text",
    )
    return Inspection(
        model_name="many-heads",
        text=TEXT,
        tokens=tokens,
        layers=list(range(layers)),
        heads=list(range(heads)),
        weights=weights,
        stats=stats,
        role_stats=stats,
        corpus=None,
        token=2,
    )


def box(page, selector: str) -> dict:
    return page.locator(selector).first.evaluate(
        "e => { const r = e.getBoundingClientRect(); return {top: r.top, bottom: r.bottom, height: r.height}; }"
    )


def test_the_stats_header_sticks_to_the_top_of_its_scroller(open_page):  # noqa: F811 (the fixture)
    page = open_page(render_html(many_heads()))
    wrap = page.locator("#head-stats-wrap")
    sizes = wrap.evaluate("w => [w.scrollHeight, w.clientHeight]")
    assert sizes[0] > 2 * sizes[1]  # 72 rows scroll inside the table's own box
    wrap.scroll_into_view_if_needed()
    top = box(page, "#head-stats-wrap")["top"]
    assert abs(box(page, "#head-stats th")["top"] - top) <= 1.5
    first_row = box(page, "#head-stats tbody tr")["top"]
    wrap.evaluate("w => { w.scrollTop = 600; }")
    assert box(page, "#head-stats tbody tr")["top"] < first_row - 500  # the rows moved up...
    header = box(page, "#head-stats th")
    assert abs(header["top"] - top) <= 1.5 and header["height"] > 10  # ...and the header stayed at the top
    # the header still sorts once scrolled
    page.locator("#head-stats th", has_text="entropy (nats)").click()
    assert page.locator("#head-stats th", has_text="entropy (nats)").get_attribute("aria-sort") == "descending"


def focus_in_view(page) -> None:
    """The bars and the heatmap of the selected head are in the viewport, below the sticky controls."""
    height = page.evaluate("innerHeight")
    controls = box(page, "#controls")
    for selector in ("#bars-title", "#head-detail"):
        seen = box(page, selector)
        assert seen["top"] >= controls["bottom"] - 1 and seen["top"] < height - 40, (selector, seen, controls)


def test_a_row_or_thumbnail_far_below_brings_the_head_into_view(open_page):  # noqa: F811 (the fixture)
    inspection = many_heads()
    page = open_page(render_html(inspection), height=700)
    row = page.locator('#head-stats tbody tr[data-layer="5"][data-head="11"]')
    row.scroll_into_view_if_needed()
    assert box(page, "#head-detail")["bottom"] < 0  # the heatmap is far above
    row.click()
    assert (page.input_value("#layer-select"), page.input_value("#head-select")) == ("5", "11")
    focus_in_view(page)
    cell = page.locator('canvas.heatmap[data-layer="4"][data-head="7"]')
    cell.scroll_into_view_if_needed()
    assert box(page, "#bars-title")["bottom"] < 0
    cell.click()
    assert (page.input_value("#layer-select"), page.input_value("#head-select")) == ("4", "7")
    focus_in_view(page)
    assert page.evaluate("scrollY") > 0  # only as far as needed: the header above stays scrolled away


def test_corpus_statistics_are_folded(open_page):  # noqa: F811 (the fixture)
    page = open_page(render_html(synthetic_inspection(corpus=True)))
    assert page.is_visible("#corpus-section") and page.is_hidden("#corpus-stats")
    assert page.locator("#corpus-stats tbody tr").count() == len(LAYERS) * len(HEADS)
    page.click("#corpus-section summary")
    assert page.is_visible("#corpus-stats")
    assert page.locator("#corpus-section").evaluate("d => d.open")
    page = open_page(render_html(synthetic_inspection()))
    assert page.is_hidden("#corpus-section") and page.locator("#corpus-stats").count() == 0


# --------------------------------------------------------------------------- long texts: labels, bars, words

LONG_TOKENS = (
    "[CLS] the una ##ff ##ord ##able riverside apartments , overlooking the shimmering harbour , were repeatedly "
    "advertised by enthusiastic estate agents although nobody could realistic ##ally afford them during the "
    "prolonged economic down ##turn , while the bewildered inhabitants of the neighbouring villages kept "
    "complaining loudly about over ##crow ##ded trains , cancelled buses , closed baker ##ies and unpredictable "
    "weather . [SEP]"
).split()
LONG_TEXT = "The unaffordable riverside apartments ... and unpredictable weather."


def long_inspection(**kwargs) -> Inspection:
    return synthetic_inspection(tokens=LONG_TOKENS, text=LONG_TEXT, **kwargs)


def short_label(text: str) -> str:
    return text if len(text) <= 12 else text[:11] + "\u2026"


def drawn_labels(page) -> dict:
    return json.loads(page.get_attribute("#head-detail", "data-labels"))


def test_word_groups_merge_hash_pieces():
    from multihead.lab.inspect import roles

    result = doctest.testmod(roles)
    assert result.attempted > 0 and result.failed == 0  # the docstring's example runs as written
    assert word_groups(["[CLS]", "una", "##ff", "##ord", "##able", "flat", "[SEP]"]) == (
        [0, 1, 1, 1, 1, 2, 3],
        ["[CLS]", "unaffordable", "flat", "[SEP]"],
        [True, False, False, True],
    )
    # a "##" piece after a special piece, first, or alone ("##" itself) starts a word; specials never merge
    assert word_groups(["##a", "[CLS]", "##b", "##", "c", "##d", "[SEP]", "##e"]) == (
        [0, 1, 2, 3, 4, 4, 5, 6],
        ["##a", "[CLS]", "##b", "##", "cd", "[SEP]", "##e"],
        [False, True, False, False, False, True, False],
    )
    index, words, special = word_groups(LONG_TOKENS)
    assert len(LONG_TOKENS) == 63 and len(words) == 55 and words[2] == "unaffordable" and words[-3] == "weather"
    view = page_data(render_html(long_inspection()))["view"]["words"]
    assert view["query"] == view["key"] == {"index": index, "labels": words, "special": special}


def test_a_long_text_keeps_every_heatmap_label_when_the_cells_fit(open_page):  # noqa: F811 (the fixture)
    page = open_page(render_html(long_inspection()), width=1200)
    assert page.locator("#focus").evaluate("f => f.classList.contains('long')")  # the heatmap gets the width
    labels = drawn_labels(page)
    assert labels["rows"] == [[i, short_label(t)] for i, t in enumerate(LONG_TOKENS)]
    assert labels["cols"] == labels["rows"]
    assert page.get_attribute("#head-detail", "data-step") == "1"


def test_a_long_text_in_a_narrow_card_labels_a_thinned_subset(open_page):  # noqa: F811 (the fixture)
    inspection = long_inspection(token=7)
    data = inspection.to_dict()
    page = open_page(render_html(inspection), width=760)
    step = int(page.get_attribute("#head-detail", "data-step"))
    assert step >= 2
    for q in (7, 40):
        page.click(f'.token[data-index="{q}"]')
        labels = drawn_labels(page)
        rows, cols = [i for i, _ in labels["rows"]], [k for k, _ in labels["cols"]]
        strongest = max(range(len(LONG_TOKENS)), key=lambda k: data["weights"][0][0][q][k])
        assert q in rows and strongest in cols  # the selected query and its strongest key are labelled
        assert len(rows) >= len(LONG_TOKENS) // step - 2 and len(cols) >= len(LONG_TOKENS) // step - 2
        for drawn in (rows, cols):  # evenly thinned, never two labels closer than the step
            assert all(b - a >= step for a, b in zip(drawn, drawn[1:], strict=False))
        assert all(text == short_label(LONG_TOKENS[i]) for i, text in labels["rows"] + labels["cols"])
    # hovering a cell labels its row and column, and the title names both in full
    r, c = 33, 59  # "##turn" (an odd row: thinned away) -> "unpredictable" (13 characters: cut in its label)
    assert r not in [i for i, _ in drawn_labels(page)["rows"]] or step == 1
    canvas = page.locator("#head-detail")
    canvas.scroll_into_view_if_needed()
    geometry = json.loads(canvas.get_attribute("data-geometry"))
    bounds = canvas.bounding_box()
    page.mouse.move(
        bounds["x"] + geometry["left"] + (c + 0.5) * geometry["cell"],
        bounds["y"] + geometry["top"] + (r + 0.5) * geometry["cell"],
    )
    labels = drawn_labels(page)
    assert [r, short_label(LONG_TOKENS[r])] in labels["rows"] and [c, "unpredictab\u2026"] in labels["cols"]
    weight = data["weights"][0][0][r][c]
    assert canvas.get_attribute("title") == f"##turn \u2192 unpredictable: {100 * weight:.1f}%"
    page.mouse.move(1, 1)
    assert r not in [i for i, _ in drawn_labels(page)["rows"]]


def test_bars_are_sorted_and_folded(open_page):  # noqa: F811 (the fixture)
    inspection = long_inspection()
    data = inspection.to_dict()
    page = open_page(render_html(inspection))
    rows = page.locator("#attention-bars .weight-row")
    in_order = rows.evaluate_all("rs => rs.map(r => [Number(r.dataset.key), Number(r.dataset.weight), !r.hidden])")
    weights = [w for _, w, _ in in_order]
    assert weights == sorted(weights, reverse=True) and len(in_order) == 63
    assert sorted(k for k, _, _ in in_order) == list(range(63))
    assert [shown for _, _, shown in in_order] == [True] * 12 + [False] * 51
    expected = sorted(range(63), key=lambda k: (-data["weights"][0][0][2][k], k))
    assert [k for k, _, _ in in_order] == expected
    assert page.locator("#attention-bars .weight-row:visible").count() == 12
    assert page.text_content("#bars-toggle") == "show all 63 keys"
    page.click("#bars-toggle")
    assert page.locator("#attention-bars .weight-row:visible").count() == 63
    assert page.text_content("#bars-toggle") == "show the strongest 12"
    page.click("#bars-toggle")
    assert page.locator("#attention-bars .weight-row:visible").count() == 12
    # a short text shows every bar, no toggle
    page = open_page(render_html(synthetic_inspection()))
    assert page.locator("#attention-bars .weight-row:visible").count() == len(TOKENS)
    assert page.is_hidden("#bars-toggle") and page.is_hidden("#word-view-label")  # no word has two pieces


def test_the_word_view_merges_pieces_as_word_attention_does(open_page):  # noqa: F811 (the fixture)
    inspection = long_inspection()
    data = inspection.to_dict()
    index, words, special = word_groups(LONG_TOKENS)
    # word_attention's ids: specials dropped (None), the other words numbered in order
    plain = [w for w in range(len(words)) if not special[w]]
    word_ids = [None if special[w] else plain.index(w) for w in index]
    page = open_page(render_html(inspection))
    assert page.is_visible("#word-view-label")
    page.check("#word-view")
    assert drawn_labels(page)["rows"] == [[w, short_label(t)] for w, t in enumerate(words)]
    for li, hi, piece in [(0, 0, 3), (1, 1, 49), (0, 2, 60)]:
        page.select_option("#layer-select", str(LAYERS[li]))
        page.select_option("#head-select", str(HEADS[hi]))
        page.click(f'.token[data-index="{piece}"]')
        word = index[piece]
        selected = page.eval_on_selector_all(".token.selected", "ts => ts.map(t => Number(t.dataset.index))")
        assert selected == [p for p, w in enumerate(index) if w == word]  # every piece of the word
        expected = word_attention(torch.tensor(data["weights"][li][hi], dtype=torch.float64), word_ids)
        bars = read_bars(page)
        assert [(k, token) for k, _, token, _ in bars] == list(enumerate(words))
        for k, weight, _, pct in bars:
            if not special[k]:
                assert weight == pytest.approx(float(expected[plain.index(word), plain.index(k)]), abs=1e-9)
            assert pct == f"{100 * weight:.1f}%"
        # a special word is the sum of its one piece's weight, like any other word
        cls = data["weights"][li][hi]
        rows = [p for p, w in enumerate(index) if w == word]
        assert bars[0][1] == pytest.approx(sum(cls[p][0] for p in rows) / len(rows), abs=1e-9)
        assert sum(weight for _, weight, _, _ in bars) == pytest.approx(1.0, abs=1e-5)
    assert page.text_content("#bars-title").startswith("Where the word " + words[index[60]])
    page.uncheck("#word-view")
    assert len(read_bars(page)) == 63
    assert page.eval_on_selector_all(".token.selected", "ts => ts.map(t => t.dataset.index)") == ["60"]


# --------------------------------------------------------------------------- the head view


def head_view_lines(page) -> list[tuple[int, int, int, str, float]]:
    """(head, query, key, stroke colour, weight) of every line the head view shows (not those of a hidden group);
    their count is the svg's data-lines."""
    return [
        tuple(line)
        for line in page.locator("#head-view line").evaluate_all(
            """ls => ls.filter(l => l.parentNode.style.display !== "none").map(l => [
            Number(l.dataset.head), Number(l.dataset.query), Number(l.dataset.key),
            l.getAttribute("stroke"), Number(l.dataset.weight)])"""
        )
    ]


def expected_lines(data: dict, li: int, hi: int, queries=None, keys=None, causal: bool = False) -> set:
    """(head, query, key) of the weights at least LINE_THRESHOLD (keys after the query dropped when causal)."""
    matrix = data["weights"][li][hi]
    return {
        (data["heads"][hi], q, k)
        for q, row in enumerate(matrix)
        for k, w in enumerate(row)
        if w >= LINE_THRESHOLD
        and (queries is None or q in queries)
        and (keys is None or k in keys)
        and not (causal and k > q)
    }


def test_the_head_view_draws_a_line_per_weight_over_the_threshold(open_page):  # noqa: F811 (the fixture)
    inspection = synthetic_inspection(seed=4)
    data = inspection.to_dict()
    page = open_page(render_html(inspection))
    assert float(page.get_attribute("#head-view", "data-threshold")) == LINE_THRESHOLD
    assert page.text_content("#head-view-layer") == f"layer {LAYERS[0]}"
    left = page.eval_on_selector_all('#head-view text[data-side="query"]', "ts => ts.map(t => t.textContent)")
    right = page.eval_on_selector_all('#head-view text[data-side="key"]', "ts => ts.map(t => t.textContent)")
    assert left == right == TOKENS
    page.select_option("#head-select", str(HEADS[1]))
    lines = head_view_lines(page)
    assert page.get_attribute("#head-view", "data-lines") == str(len(lines))
    assert {line[:3] for line in lines} == expected_lines(data, 0, 1) and len(lines) == len(set(lines))
    for _, q, k, _, weight in lines:
        assert weight == data["weights"][0][1][q][k]
    # hovering a query shows its lines only: one per key over the threshold
    page.hover('#head-view text[data-query="3"]')
    lines = head_view_lines(page)
    assert {line[:3] for line in lines} == expected_lines(data, 0, 1, queries=[3])
    assert len(lines) == sum(w >= LINE_THRESHOLD for w in data["weights"][0][1][3]) > 0
    assert page.get_attribute("#head-view", "data-lines") == str(len(lines))
    assert page.get_attribute('#head-view text[data-query="3"]', "class").split()[-1] == "hover"
    page.hover('#head-view text[data-key="6"]')  # a key: the lines into it
    assert {line[:3] for line in head_view_lines(page)} == expected_lines(data, 0, 1, keys=[6])
    page.mouse.move(1, 1)
    assert len(head_view_lines(page)) == len(expected_lines(data, 0, 1))
    # clicking a query selects it
    page.click('#head-view text[data-query="5"]')
    assert page.eval_on_selector_all(".token.selected", "ts => ts.map(t => t.dataset.index)") == ["5"]


def test_toggling_a_head_adds_and_removes_its_colour(open_page):  # noqa: F811 (the fixture)
    inspection = synthetic_inspection(seed=4)
    data = inspection.to_dict()
    page = open_page(render_html(inspection))
    page.select_option("#layer-select", str(LAYERS[1]))
    selected = page.locator(f'#head-view-heads input[data-head="{HEADS[0]}"]')
    assert selected.is_checked() and selected.is_disabled()  # the selected head is always drawn
    colours = {colour for *_, colour, _ in head_view_lines(page)}
    assert len(colours) == 1 and {head for head, *_ in head_view_lines(page)} == {HEADS[0]}
    page.check(f'#head-view-heads input[data-head="{HEADS[2]}"]')
    lines = head_view_lines(page)
    assert {line[:3] for line in lines} == expected_lines(data, 1, 0) | expected_lines(data, 1, 2)
    by_head = {head: {colour for h, *_, colour, _ in lines if h == head} for head in (HEADS[0], HEADS[2])}
    assert len(by_head[HEADS[2]]) == 1 and by_head[HEADS[2]] != by_head[HEADS[0]]  # a colour of its own
    page.hover('#head-view text[data-query="2"]')  # hovering keeps every shown head, for that token
    assert {line[:3] for line in head_view_lines(page)} == expected_lines(data, 1, 0, [2]) | expected_lines(
        data, 1, 2, [2]
    )
    page.mouse.move(1, 1)
    page.uncheck(f'#head-view-heads input[data-head="{HEADS[2]}"]')
    assert {colour for *_, colour, _ in head_view_lines(page)} == colours
    page.click("#head-view-all")
    assert {head for head, *_ in head_view_lines(page)} == set(HEADS)
    assert len({colour for *_, colour, _ in head_view_lines(page)}) == len(HEADS)
    page.click("#head-view-one")
    assert {head for head, *_ in head_view_lines(page)} == {HEADS[0]}


def test_the_head_view_of_a_causal_part_draws_no_line_to_a_masked_key(open_page):  # noqa: F811 (the fixture)
    # random weights over every key: a causal page must still draw nothing to a key after the query
    inspection = dataclasses.replace(synthetic_inspection(seed=4), causal=True)
    data = inspection.to_dict()
    page = open_page(render_html(inspection))
    lines = head_view_lines(page)
    assert lines and all(k <= q for _, q, k, _, _ in lines)
    assert {line[:3] for line in lines} == expected_lines(data, 0, 0, causal=True)


def test_the_head_view_of_cross_attention_has_the_source_on_the_right(open_page):  # noqa: F811 (the fixture)
    inspection = rectangular_inspection()
    queries, keys = inspection.tokens, inspection.key_tokens
    page = open_page(render_html(inspection))
    left = page.eval_on_selector_all('#head-view text[data-side="query"]', "ts => ts.map(t => t.textContent)")
    right = page.eval_on_selector_all('#head-view text[data-side="key"]', "ts => ts.map(t => t.textContent)")
    assert (left, right) == (queries, keys)
    assert {line[:3] for line in head_view_lines(page)} == expected_lines(inspection.to_dict(), 0, 0)
    assert page.locator("b").count() == 0


def test_the_head_view_follows_the_word_view(open_page):  # noqa: F811 (the fixture)
    page = open_page(render_html(long_inspection()))
    page.check("#word-view")
    _, words, _ = word_groups(LONG_TOKENS)
    left = page.eval_on_selector_all('#head-view text[data-side="query"]', "ts => ts.map(t => t.textContent)")
    assert left == [short_label(word) for word in words]
    assert max(q for _, q, _, _, _ in head_view_lines(page)) < len(words)


# --------------------------------------------------------------------------- where the columns come from


def table_headers(page, table: str) -> list[tuple[str, str | None]]:
    return [
        tuple(header)
        for header in page.eval_on_selector_all(f"{table} th", "ths => ths.map(th => [th.textContent, th.title])")
    ]


def test_the_stats_table_says_where_its_roles_come_from(open_page):  # noqa: F811 (the fixture)
    page = open_page(render_html(synthetic_inspection()))
    tips = {"strength": ": the measure behind the label", "signals": ": the strongest places the head looks"}
    assert table_headers(page, "#head-stats")[2:7] == [
        (name, "labelled from this text" + tips.get(name, "")) for name in ROLES
    ]
    assert page.text_content("#head-stats-note") == "Every column is measured on this text, the roles included."

    inspection = synthetic_inspection(corpus=True)
    data = inspection.to_dict()
    assert data["roles_from"] == CORPUS_SOURCE != data["text_stats"]["source"]
    page = open_page(render_html(inspection))
    tip = f"labelled from {CORPUS_SOURCE}"
    headers = table_headers(page, "#head-stats")
    assert headers[2:7] == [(f"{name} (corpus)", tip + tips.get(name, "")) for name in ROLES]
    assert headers[7][0] == STAT_NAMES["entropy"]  # the numbers: unlabelled, this text's
    assert page.text_content("#head-stats-note") == (
        "Numbers: this text. Role, strength, confidence, signals and pattern: labelled from the corpus, "
        f"{CORPUS_SOURCE}."
    )
    # the corpus table, where they were measured, has them unqualified next to the corpus numbers
    assert [label for label, _ in table_headers(page, "#corpus-stats")[:8]] == [
        "layer",
        "head",
        *ROLES,
        STAT_NAMES["entropy"],
    ]
    cells = page.eval_on_selector_all("#head-stats tbody tr", "rs => rs.map(r => r.children[2].textContent)")
    assert cells == [role["label"] for layer in data["roles"] for role in layer]


# --------------------------------------------------------------------------- one colour scale


def thumbnail_pixels(page, layer: int, head: int) -> list[list[list[int]]]:
    """The (r, g, b) of every cell of a thumbnail (one canvas pixel per query and key)."""
    return page.locator(f'canvas.heatmap[data-layer="{layer}"][data-head="{head}"]').evaluate(
        """c => { const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data, rows = [];
        for (let y = 0; y < c.height; y++) { const row = [];
          for (let x = 0; x < c.width; x++) { const o = 4 * (y * c.width + x); row.push([d[o], d[o + 1], d[o + 2]]); }
          rows.push(row); }
        return rows; }"""
    )


def test_the_page_colours_weights_as_colours_weight_rgb(open_page):  # noqa: F811 (the fixture)
    inspection = synthetic_inspection(seed=5)
    data = inspection.to_dict()
    page = open_page(render_html(inspection))
    assert page_data(render_html(inspection))["view"]["scale"] == {
        "stops": [list(stop) for stop in WEIGHT_STOPS],
        "ticks": list(WEIGHT_TICKS),
        "label": WEIGHT_SCALE_LABEL,
        "masked": list(MASKED_RGB),
    }
    for li, hi in ((0, 1), (1, 2), (1, 0)):  # every cell of a thumbnail
        pixels = thumbnail_pixels(page, LAYERS[li], HEADS[hi])
        expected = [[list(weight_rgb(w)) for w in row] for row in data["weights"][li][hi]]
        assert pixels == expected
    # the large heatmap's cells and the token chips use the same colours
    page.select_option("#layer-select", str(LAYERS[1]))
    page.select_option("#head-select", str(HEADS[1]))
    geometry = json.loads(page.get_attribute("#head-detail", "data-geometry"))
    for q, k in ((0, 0), (3, 5), (8, 2)):
        x = geometry["left"] + (k + 0.5) * geometry["cell"]
        y = geometry["top"] + (q + 0.5) * geometry["cell"]
        pixel = page.locator("#head-detail").evaluate(
            "(c, [x, y]) => { const r = window.devicePixelRatio || 1;"
            " return Array.from(c.getContext('2d').getImageData(Math.round(x * r), Math.round(y * r), 1, 1).data)"
            ".slice(0, 3); }",
            [x, y],
        )
        assert pixel == list(weight_rgb(data["weights"][1][1][q][k])), (q, k)
    row = data["weights"][1][1][inspection.token]
    chips = page.eval_on_selector_all(".token", "ts => ts.map(t => getComputedStyle(t).backgroundColor)")
    assert chips == ["rgb({}, {}, {})".format(*weight_rgb(w)) for w in row]
    # the legend: the scale's label and its ticks, placed along sqrt(weight)
    assert page.text_content("#legend-label") == WEIGHT_SCALE_LABEL
    ticks = page.eval_on_selector_all(
        "#legend-ticks .tick", "ts => ts.map(t => [t.textContent, t.getBoundingClientRect().left + t.offsetWidth / 2])"
    )
    assert [text for text, _ in ticks] == [f"{tick:g}" for tick in WEIGHT_TICKS]
    ramp = box(page, "#legend-ramp")
    ramp_x = page.locator("#legend-ramp").evaluate("r => [r.getBoundingClientRect().left, r.offsetWidth]")
    for (_, centre), tick in zip(ticks, WEIGHT_TICKS, strict=True):
        assert centre == pytest.approx(ramp_x[0] + math.sqrt(tick) * ramp_x[1], abs=1.5)
    assert ramp["height"] > 0


def test_masked_cells_take_the_scales_grey(open_page):  # noqa: F811 (the fixture)
    inspection = dataclasses.replace(synthetic_inspection(seed=5), causal=True)
    data = inspection.to_dict()
    page = open_page(render_html(inspection))
    pixels = thumbnail_pixels(page, LAYERS[0], HEADS[1])
    for q, row in enumerate(data["weights"][0][1]):
        for k, w in enumerate(row):
            assert pixels[q][k] == list(MASKED_RGB if k > q else weight_rgb(w)), (q, k)
    assert page.is_visible("#legend-masked")


def test_the_page_draws_with_the_scale_it_is_given(open_page, monkeypatch):  # noqa: F811 (the fixture)
    """The page has no colours of its own: another scale in colours (and so in the data) changes every cell."""
    from multihead.lab.inspect import colours, html

    stops = ((255, 250, 240), (200, 40, 10), (30, 10, 5))
    for module in (colours, html):
        monkeypatch.setattr(module, "WEIGHT_STOPS", stops)
        monkeypatch.setattr(module, "MASKED_RGB", (1, 2, 3))
    inspection = dataclasses.replace(synthetic_inspection(seed=6), causal=True)
    data = inspection.to_dict()
    page = open_page(render_html(inspection))
    pixels = thumbnail_pixels(page, LAYERS[1], HEADS[2])
    for q, row in enumerate(data["weights"][1][2]):
        for k, w in enumerate(row):
            assert pixels[q][k] == list((1, 2, 3) if k > q else colours.weight_rgb(w)), (q, k)


# --------------------------------------------------------------------------- role signals and head similarity


def test_roles_show_their_strength_confidence_and_signals(open_page):  # noqa: F811 (the fixture)
    inspection = synthetic_inspection(seed=0)
    data = inspection.to_dict()
    roles = [role for layer in data["roles"] for role in layer]
    assert {role["confidence"] for role in roles} == {"high", "medium", "low"}  # the data exercises the page
    page = open_page(render_html(inspection))
    # thumbnails: the label, its strength, "?" when the confidence is low; the tooltip the signals
    captions = page.eval_on_selector_all(".head-cell .caption", "cs => cs.map(c => c.textContent)")
    assert captions == [
        f"{role['label']} {role['strength']:.0%}" + ("?" if role["confidence"] == "low" else "") for role in roles
    ]
    assert page.eval_on_selector_all(".head-cell .role-label", "ls => ls.map(l => l.textContent)") == [
        role["label"] for role in roles
    ]
    titles = page.eval_on_selector_all(".head-cell", "cs => cs.map(c => c.title)")
    for title, role in zip(titles, roles, strict=True):
        assert f"{role['text']}; {role['confidence']} confidence" in title and role["summary"] in title
    # the head summary
    for li, hi in ((0, 1), (1, 2)):
        page.click(f'canvas.heatmap[data-layer="{LAYERS[li]}"][data-head="{HEADS[hi]}"]')
        role = data["roles"][li][hi]
        assert page.text_content("#head-summary .signals") == role["text"]
        assert page.text_content("#head-summary .confidence") == f"{role['confidence']} confidence"
        assert role["summary"] in page.text_content("#head-summary")
    # the table: strength as a percentage, sortable by confidence (high first)
    page.click("#head-stats th:has-text('confidence')")
    order = {"high": 3, "medium": 2, "low": 1}
    shown = page.eval_on_selector_all("#head-stats tbody tr", "rs => rs.map(r => r.children[4].textContent)")
    assert [order[c] for c in shown] == sorted((order[role["confidence"]] for role in roles), reverse=True)
    page.click("#head-stats th:has-text('strength')")
    shown = page.eval_on_selector_all("#head-stats tbody tr", "rs => rs.map(r => r.children[3].textContent)")
    assert shown == [f"{s:.0%}" for s in sorted((role["strength"] for role in roles), reverse=True)]


def test_the_similarity_map_selects_heads_and_lists_near_duplicates(open_page):  # noqa: F811 (the fixture)
    inspection = many_heads(layers=3, heads=4, seed=8, copies=[((0, 1), (0, 3)), ((1, 2), (2, 0))])
    similarity = inspection.to_dict()["similarity"]
    pairs = {(tuple(p["a"]), tuple(p["b"])) for p in similarity["near_duplicates"]}
    assert {((0, 1), (0, 3)), ((1, 2), (2, 0))} <= pairs  # the copies are near-duplicates
    page = open_page(render_html(inspection))
    assert page.is_visible("#similarity-section")
    assert page.text_content("#similarity-source") == similarity["source"]
    order = [similarity["heads"][i] for i in similarity["order"]]
    assert json.loads(page.get_attribute("#similarity-map", "data-heads")) == order
    # a cell selects its row's head, and the map marks the selected head
    geometry = json.loads(page.get_attribute("#similarity-map", "data-geometry"))
    canvas = page.locator("#similarity-map")
    canvas.scroll_into_view_if_needed()
    bounds = canvas.bounding_box()
    for r, c in ((5, 1), (9, 9)):
        page.mouse.click(
            bounds["x"] + geometry["left"] + (c + 0.5) * geometry["cell"],
            bounds["y"] + geometry["top"] + (r + 0.5) * geometry["cell"],
        )
        layer, head = order[r]
        assert (page.input_value("#layer-select"), page.input_value("#head-select")) == (str(layer), str(head))
        assert page.get_attribute("#similarity-map", "data-current") == str(r)
        focus_in_view(page)
        canvas.scroll_into_view_if_needed()
        bounds = canvas.bounding_box()
    page.mouse.move(
        bounds["x"] + geometry["left"] + 2.5 * geometry["cell"], bounds["y"] + geometry["top"] + 0.5 * geometry["cell"]
    )
    a, b = order[0], order[2]
    divergence = similarity["divergence"][similarity["order"][0]][similarity["order"][2]]
    assert canvas.get_attribute("title") == f"L{a[0]} H{a[1]} vs L{b[0]} H{b[1]}: {divergence:.3f} bits"
    # the near-duplicate pairs, listed; one selects its first head and shows the second in the head view
    listed = page.eval_on_selector_all("#near-duplicates button", "bs => bs.map(b => [b.dataset.a, b.dataset.b])")
    assert listed == [[",".join(map(str, p["a"])), ",".join(map(str, p["b"]))] for p in similarity["near_duplicates"]]
    assert page.text_content("#near-count") == f"({len(listed)})"
    page.click('#near-duplicates button[data-a="0,1"][data-b="0,3"]')
    assert (page.input_value("#layer-select"), page.input_value("#head-select")) == ("0", "1")
    assert page.is_checked('#head-view-heads input[data-head="3"]')
    assert {head for head, *_ in head_view_lines(page)} == {1, 3}


def test_no_similarity_no_map(open_page):  # noqa: F811 (the fixture)
    inspection = synthetic_inspection()
    inspection = dataclasses.replace(inspection, role_stats=dataclasses.replace(inspection.stats, similarity=None))
    assert inspection.to_dict()["similarity"] is None
    page = open_page(render_html(inspection))
    assert page.is_hidden("#similarity-section")
    page = open_page(render_html(many_heads(layers=2, heads=3)))
    assert page.text_content("#near-duplicates") == "none"


def test_word_groups_join_gpt2_and_sentencepiece_pieces_as_the_roles_do():
    assert word_groups(["The", "\u0120un", "believ", "able", "\u0120news"]) == (
        [0, 1, 1, 1, 2],
        ["The", "unbelievable", "news"],
        [False, False, False],
    )
    assert word_groups(["<s>", "\u2581Hello", "\u2581wor", "ld", "</s>"]) == (
        [0, 1, 2, 2, 3],
        ["<s>", "Hello", "world", "</s>"],
        [True, False, False, True],
    )


# --------------------------------------------------------------------------- as wide as its box, not the window

# Where a drawn report's parts lie, relative to the boxes that would cut them off (all in its shadow root): the head
# view's labels and its scroller, the visible bars, the heads grid's thumbnails and its scroller.
FIT = """(report) => {
  const shadow = report.shadowRoot;
  const box = (node) => { const r = node.getBoundingClientRect(); return {left: r.left, right: r.right,
    width: r.width}; };
  const scroller = (id, outer) => { const node = shadow.getElementById(id).closest(outer);
    return {box: box(node), scroll: node.scrollWidth, client: node.clientWidth}; };
  return {
    width: report.getBoundingClientRect().width,
    headView: scroller('head-view', '.hv-wrap'),
    labels: [...shadow.querySelectorAll('#head-view text.hv-token')].map(box),
    bars: [...shadow.querySelectorAll('#attention-bars .weight-row:not([hidden]) .bar-track')].map(box),
    grid: scroller('head-grid', '.grid-wrap'),
    heads: [...shadow.querySelectorAll('#head-grid canvas.heatmap')].map(box),
  };
}"""


def assert_fits(report, tokens: int, heads: int) -> dict:
    """The drawn report (a locator of its .mh-report) lays out on its own width: no head view label cut off, bars
    of a readable length (not the ~20 px of two columns squeezed into a notebook cell), every head of the grid in
    view without scrolling. Returns the measures."""
    layout = report.evaluate(FIT)
    view = layout["headView"]
    assert view["scroll"] <= view["client"] + 1, view
    assert len(layout["labels"]) == 2 * tokens
    assert all(
        view["box"]["left"] - 1 <= label["left"] and label["right"] <= view["box"]["right"] + 1
        for label in layout["labels"]
    ), (view, layout["labels"])
    assert len(layout["bars"]) == tokens and min(bar["width"] for bar in layout["bars"]) >= 200, layout["bars"]
    grid = layout["grid"]
    assert len(layout["heads"]) == heads
    assert grid["scroll"] <= grid["client"] + 1, grid
    assert all(head["right"] <= grid["box"]["right"] + 1 and head["width"] >= 24 for head in layout["heads"])
    return layout


@pytest.mark.parametrize("box_width", [800, 560])
def test_a_fragment_in_a_narrow_box_of_a_wide_window_reflows_on_its_own_width(open_page, box_width):  # noqa: F811
    """A notebook's output area: the window is 1280 px wide (over any viewport breakpoint), the report's box is not.
    The report takes its one-column layout from its own width (issue 47, row 3)."""
    body = f'<div style="width: {box_width}px">{render_fragment(many_heads())}</div>'
    page = open_page(f"<!DOCTYPE html><html><body>{body}</body></html>", width=1280)
    report = page.locator(".mh-report")
    layout = assert_fits(report, len(TOKENS), 6 * 12)
    assert layout["width"] == box_width
    # the wide window itself keeps the two columns: the heatmap's card beside the bars
    wide = open_page(render_html(many_heads()), width=1280)
    assert wide.locator("#focus").evaluate("f => getComputedStyle(f).gridTemplateColumns.split(' ').length") == 2
