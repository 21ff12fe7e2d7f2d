"""The HTML report of `multihead inspect`: a packaged jinja2 template that embeds Inspection.to_dict() safely,
no external resources, and the page itself driven in Debian's chromium through Playwright (never a downloaded
browser).

The synthetic inspection (support_inspect) has 2 layers x 3 heads that are non-contiguous subsets ([2, 5] and
[0, 3, 7]), so a page that confuses a layer's value with its position in the layer list fails.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from importlib import resources
from pathlib import Path

import pytest
import torch

from multihead.lab.inspect.colours import MASKED_RGB, WEIGHT_SCALE_LABEL, WEIGHT_STOPS, WEIGHT_TICKS
from multihead.lab.inspect.html import render_html
from multihead.lab.inspect.stats import STAT_NAMES
from support_inspect import CORPUS_SOURCE, HEADS, LAYERS, TOKENS, synthetic_inspection

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
EXTRA = {"importance": [[round(0.1 * (li + 1) * (hi + 1), 5) for hi in range(len(HEADS))] for li in range(len(LAYERS))]}
ROLES = ["role", "strength", "confidence", "signals", "pattern"]  # the role columns of the statistics table
ROLE_COLUMNS = len(ROLES)
DATA_BLOCK = re.compile(r'<script type="application/json" id="report-data">(.*?)</script>', re.S)


def page_data(page: str) -> dict:
    """The JSON the page carries in its data block."""
    return json.loads(DATA_BLOCK.search(page).group(1))


# --------------------------------------------------------------------------- Python level


def test_the_page_carries_to_dict_and_the_view():
    inspection = synthetic_inspection(corpus=True)
    data = page_data(render_html(inspection, EXTRA))
    special = [piece in ("[CLS]", "[SEP]") for piece in TOKENS]
    words = {"index": list(range(len(TOKENS))), "labels": TOKENS, "special": special}  # no "##" piece
    assert data["report"] == json.loads(json.dumps(inspection.to_dict()))  # one serialisation, inspect.json's
    assert data["view"] == {
        "title": "multihead inspect: all-MiniLM-L6-v2",
        "notes": [],
        "special": [piece in ("[CLS]", "[SEP]") for piece in TOKENS],
        "key_special": [piece in ("[CLS]", "[SEP]") for piece in TOKENS],
        "stat_names": STAT_NAMES,
        "extra_columns": EXTRA,
        "words": {"query": words, "key": words},
        "queries": [[token, index, index] for index, token in enumerate(TOKENS)],  # each a word of one piece
        "bars_shown": 12,
        "line_threshold": 0.01,
        "scale": {
            "stops": [list(stop) for stop in WEIGHT_STOPS],
            "ticks": list(WEIGHT_TICKS),
            "label": WEIGHT_SCALE_LABEL,
            "masked": list(MASKED_RGB),
        },
    }
    assert page_data(render_html(synthetic_inspection()))["view"]["extra_columns"] == {}


def test_weights_are_rounded_once_for_json_and_page():
    inspection = synthetic_inspection()
    weights = page_data(render_html(inspection))["report"]["weights"]
    expected = inspection.weights.to(torch.float64).round(decimals=6)
    torch.testing.assert_close(torch.tensor(weights, dtype=torch.float64), expected, rtol=0, atol=0)


def test_nan_in_the_data_is_refused_not_written_as_invalid_json():
    inspection = synthetic_inspection()
    inspection.weights[0, 1, 2, 3] = math.nan
    with pytest.raises(ValueError, match="not JSON compliant"):
        render_html(inspection)


def test_no_external_resources():
    page = render_html(synthetic_inspection(corpus=True), EXTRA)
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//", page, re.I)
    assert page.count("<script") == 2  # the data block and the inline code, neither with a src
    assert page.count("<style>") == 1 and '<link rel="stylesheet"' not in page


def test_the_template_and_its_assets_are_package_files_inlined_whole():
    folder = resources.files("multihead.lab.inspect") / "templates"
    page = render_html(synthetic_inspection())
    for name, closing in (("report.css", "</style"), ("report.js", "</script")):
        text = (folder / name).read_text(encoding="utf-8")
        assert text.isascii() and closing not in text.lower(), name  # it cannot end its element early
        assert text in page, name
    assert (folder / "report.html.j2").is_file()


HOSTILE = "</script><b>x</b>"


def test_script_breaking_text_stays_inside_the_data_block():
    tokens = ["[CLS]", "a", HOSTILE, "<!--", "&amp;", "\u00e9t\u00e9", ".", "[SEP]"]
    hostile = "a " + HOSTILE + " <!-- &amp; \u00e9t\u00e9"
    page = render_html(synthetic_inspection(tokens=tokens, text=hostile, model_name=hostile))
    block = DATA_BLOCK.search(page).group(1)
    assert "</" not in block and "<!--" not in block and "<b>" not in block
    assert page.count("</script>") == 2
    outside = page.replace(block, "")
    assert "<b>" not in outside and "&lt;/script&gt;&lt;b&gt;" in outside  # the <title>, HTML-escaped
    assert "&#233;t&#233;" in outside  # non-ASCII in the title as character references
    assert page.isascii()
    assert page_data(page)["report"]["tokens"] == tokens and page_data(page)["report"]["text"] == hostile


# --------------------------------------------------------------------------- in the browser


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium, started once for the module. Missing chromium is a failure, not a skip."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} not found: the HTML report tests drive Debian's chromium. "
            "`make test` installs it (apt-get install chromium chromium-driver)."
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@contextlib.contextmanager
def page_opener(browser, folder: Path):
    """Yields open_(html, width, height) -> page: the html written to a file in ``folder`` and opened from disk
    (file://); on exit, closes the pages and asserts that none logged an error or asked for anything but a
    file: or data: URL."""
    pages, errors = [], []

    def open_(html: str, width: int = 1200, height: int = 900):
        path = folder / f"page{len(pages)}.html"
        path.write_text(html, encoding="utf-8")
        page = browser.new_page(viewport={"width": width, "height": height})
        page.on("console", lambda msg: errors.append(f"console: {msg.text}") if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
        page.on(
            "request",
            lambda req: errors.append(f"request: {req.url}") if not req.url.startswith(("file:", "data:")) else None,
        )
        page.goto(path.as_uri())
        pages.append(page)
        return page

    yield open_
    for page in pages:
        page.close()
    assert not errors, errors


@pytest.fixture
def open_page(browser, tmp_path):
    """open_page(html, width, height) -> page: any html opened from disk; the test fails on a page error."""
    with page_opener(browser, tmp_path) as open_:
        yield open_


@pytest.fixture
def open_report(browser, tmp_path):
    """open_report(inspection, extra_columns, width, height) -> page: render_html's page, opened from disk;
    after the test, asserts that the page logged no error and fetched nothing."""
    with page_opener(browser, tmp_path) as open_html:

        def open_(inspection, extra_columns=None, width: int = 1200, height: int = 900):
            return open_html(render_html(inspection, extra_columns), width=width, height=height)

        yield open_


def read_bars(page) -> list[tuple[int, float, str, str]]:
    """(data-key, data-weight, key token text, percentage text) for every .weight-row, by data-key (the page
    lists them by weight, the weakest folded away but there). ``page``: a page, or a locator of one report."""
    rows = page.locator("#attention-bars .weight-row").evaluate_all(
        """rows => rows.map(row => [
        Number(row.getAttribute("data-key")), Number(row.getAttribute("data-weight")),
        row.querySelector(".key-token").textContent, row.querySelector(".weight-pct").textContent])"""
    )
    return sorted((tuple(row) for row in rows), key=lambda row: row[0])  # type: ignore[return-value]


def assert_bars_match(page, data: dict, li: int, hi: int, q: int) -> None:
    """The bars show row q of head (li, hi) of ``data`` (an Inspection's to_dict()) exactly."""
    expected = data["weights"][li][hi][q]
    bars = read_bars(page)
    assert [key for key, *_ in bars] == list(range(len(data["tokens"])))
    for (k, weight, token, text), w in zip(bars, expected, strict=True):
        assert abs(weight - w) <= 1e-9, (li, hi, q, k, weight, w)
        assert text == f"{100 * w:.1f}%", (li, hi, q, k, text, w)
        assert token == data["tokens"][k]


def select(page, li: int, hi: int, q: int) -> None:
    page.select_option("#layer-select", str(LAYERS[li]))
    page.select_option("#head-select", str(HEADS[hi]))
    page.click(f'.token[data-index="{q}"]')


def test_initial_view(open_report):
    inspection = synthetic_inspection()
    data = inspection.to_dict()
    page = open_report(inspection)
    assert page.input_value("#layer-select") == str(LAYERS[0])
    assert page.input_value("#head-select") == str(HEADS[0])
    assert page.eval_on_selector_all("#layer-select option", "os => os.map(o => [o.value, o.textContent])") == [
        [str(layer), f"layer {layer}"] for layer in LAYERS
    ]
    assert page.eval_on_selector_all("#head-select option", "os => os.map(o => o.value)") == [str(h) for h in HEADS]
    assert page.eval_on_selector_all(".token", "ts => ts.map(t => [t.dataset.index, t.textContent])") == [
        [str(i), t] for i, t in enumerate(TOKENS)
    ]
    assert page.eval_on_selector_all(".token.selected", "ts => ts.map(t => t.dataset.index)") == ["2"]
    assert_bars_match(page, data, 0, 0, 2)
    assert page.text_content("#report-title") == "multihead inspect: all-MiniLM-L6-v2"
    assert page.text_content("#report-model") == "all-MiniLM-L6-v2"
    assert page.text_content("#report-ntokens") == str(len(TOKENS))
    assert page.text_content("#report-text") == data["text"]
    assert page.text_content("#report-roles-source") == "this text"
    assert page.is_hidden("#report-corpus-meta")
    assert page.eval_on_selector_all(".token.special", "ts => ts.map(t => t.textContent)") == ["[CLS]", "[SEP]"]


def test_bars_follow_layer_head_and_token(open_report):
    inspection = synthetic_inspection()
    data = inspection.to_dict()
    page = open_report(inspection)
    for li, hi, q in [(1, 2, 3), (0, 1, 6), (1, 0, 0)]:
        select(page, li, hi, q)
        assert page.eval_on_selector_all(".token.selected", "ts => ts.map(t => t.dataset.index)") == [str(q)]
        assert_bars_match(page, data, li, hi, q)
        assert page.text_content(".head-cell.current .role-label") == data["roles"][li][hi]["label"]


def test_heatmap_click_selects_head(open_report):
    inspection = synthetic_inspection()
    data = inspection.to_dict()
    page = open_report(inspection)
    assert page.locator("canvas.heatmap").count() == len(LAYERS) * len(HEADS)
    assert page.eval_on_selector_all(".role-label", "ls => ls.map(l => l.textContent)") == [
        role["label"] for layer in data["roles"] for role in layer
    ]
    page.click('.token[data-index="5"]')
    page.click(f'canvas.heatmap[data-layer="{LAYERS[1]}"][data-head="{HEADS[1]}"]')
    assert page.input_value("#layer-select") == str(LAYERS[1])
    assert page.input_value("#head-select") == str(HEADS[1])
    assert_bars_match(page, data, 1, 1, 5)
    page.click(f'canvas.heatmap[data-layer="{LAYERS[0]}"][data-head="{HEADS[2]}"]')
    assert (page.input_value("#layer-select"), page.input_value("#head-select")) == (str(LAYERS[0]), str(HEADS[2]))
    assert_bars_match(page, data, 0, 2, 5)


def test_stats_tables(open_report):
    page = open_report(synthetic_inspection())
    assert page.locator("#corpus-stats").count() == 0
    rows = len(LAYERS) * len(HEADS)
    assert page.locator("#head-stats tbody tr").count() == rows
    headers = page.eval_on_selector_all("#head-stats th", "ths => ths.map(th => th.textContent)")
    assert headers[: ROLE_COLUMNS + 2 + len(STAT_NAMES)] == ["layer", "head", *ROLES, *STAT_NAMES.values()]

    inspection = synthetic_inspection(corpus=True)
    data = inspection.to_dict()
    page = open_report(inspection, EXTRA)
    assert page.text_content("#report-corpus") == CORPUS_SOURCE and page.is_visible("#report-corpus-meta")
    assert page.text_content("#report-roles-source") == CORPUS_SOURCE
    assert page.locator("#corpus-stats").count() == 1
    assert page.locator("#corpus-stats tbody tr").count() == rows
    headers = page.eval_on_selector_all("#head-stats th", "ths => ths.map(th => th.textContent)")
    assert headers[ROLE_COLUMNS + 2 + len(STAT_NAMES)] == "importance"
    first = page.eval_on_selector_all("#head-stats tbody tr:first-child td", "tds => tds.map(td => td.textContent)")
    role = data["roles"][0][0]
    assert first[:3] == [str(LAYERS[0]), str(HEADS[0]), role["label"]]
    assert first[3:7] == [f"{role['strength']:.0%}", role["confidence"], role["text"], role["pattern"]]
    assert float(first[7]) == pytest.approx(data["text_stats"]["stats"][0][0]["entropy"], abs=1e-3)
    corpus_first = page.eval_on_selector_all(
        "#corpus-stats tbody tr:first-child td", "tds => tds.map(td => td.textContent)"
    )
    assert corpus_first[2] == role["label"] and corpus_first[6] == role["pattern"]  # the corpus's roles
    assert float(corpus_first[7]) == pytest.approx(data["corpus_stats"]["stats"][0][0]["entropy"], abs=1e-3)
    # Sorting by importance (descending on first click) puts the last head first; a row click selects it.
    page.click("#head-stats th:has-text('importance')")
    top = page.locator("#head-stats tbody tr").first
    assert (top.get_attribute("data-layer"), top.get_attribute("data-head")) == (str(LAYERS[-1]), str(HEADS[-1]))
    top.click()
    assert (page.input_value("#layer-select"), page.input_value("#head-select")) == (str(LAYERS[-1]), str(HEADS[-1]))
    page.click('.token[data-index="4"]')
    ARTIFACTS.mkdir(exist_ok=True)
    page.evaluate("window.scrollTo(0, 0)")  # the controls bar is sticky: keep it at the top of the image
    page.screenshot(path=str(ARTIFACTS / "inspect-report.png"), full_page=True)


def test_hostile_token_is_text_in_the_page(open_report):
    tokens = ["[CLS]", "a", HOSTILE, "<!--", "&amp;", "\u00e9t\u00e9", ".", "[SEP]"]
    text = "a " + HOSTILE + " <!-- &amp; \u00e9t\u00e9."
    inspection = synthetic_inspection(tokens=tokens, text=text, model_name=HOSTILE)
    data = inspection.to_dict()
    page = open_report(inspection)
    assert page.text_content('.token[data-index="2"]') == HOSTILE
    assert page.eval_on_selector_all(".token", "ts => ts.map(t => t.textContent)") == tokens
    assert page.text_content("#report-text") == text
    assert page.text_content("#report-model") == HOSTILE
    assert page.title() == "multihead inspect: " + HOSTILE
    assert page.locator("b").count() == 0
    page.click('.token[data-index="2"]')
    assert read_bars(page)[2][2] == HOSTILE
    assert_bars_match(page, data, 0, 0, 2)


# --------------------------------------------------------------------------- the real model's report


def test_minilm_report_displays_the_captured_weights(open_report):
    """The report of all-MiniLM-L6-v2 on the textbook sentence shows exactly the captured weights."""
    from multihead.lab.inspect import capture
    from multihead.lab.inspect.inspection import inspect_text
    from multihead.lab.models import load_minilm

    model, _ = load_minilm()
    text = "The bank was full of money."
    inspection = inspect_text(model, text, token="bank")
    with torch.no_grad(), capture(model, layers=[0, 5], heads=[2, 9]) as rec:
        model.encode(text)
    page = open_report(inspection, width=1400)
    for layer, head in ((0, 2), (5, 9)):
        page.select_option("#layer-select", str(layer))
        page.select_option("#head-select", str(head))
        page.click('.token[data-index="2"]')  # "bank"
        captured = rec.weights(layer, head)[0, 2]  # (j,): where "bank" attends
        bars = read_bars(page)
        assert [token for _, _, token, _ in bars] == inspection.tokens
        for (key, weight, _, pct), expected in zip(bars, captured.tolist(), strict=True):
            assert abs(weight - expected) <= 5e-7, (layer, head, key, weight, expected)  # 6 decimals in the page
            assert pct == f"{100 * weight:.1f}%"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "inspect-minilm-report.png"), full_page=True)
