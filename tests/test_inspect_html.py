"""The HTML report of `multihead inspect`: schema errors, no external resources, safe embedding of the
text, and the page itself driven in Debian's chromium through Playwright (never a downloaded browser).

The synthetic report has 2 layers x 3 heads that are non-contiguous subsets ([2, 5] and [0, 3, 7]),
so a page that confuses a layer's value with its position in data["layers"] fails.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import torch

from multihead.inspect.html import render_html

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
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"

TOKENS = ["[CLS]", "the", "bank", "was", "full", "of", "money", ".", "[SEP]"]
LAYERS = [2, 5]
HEADS = [0, 3, 7]
STAT_NAMES = {
    "entropy": "entropy (nats)",
    "distance": "mean distance (tokens)",
    "special": "on [CLS]/[SEP]",
    "prev": "on previous",
    "next": "on next",
    "self": "on self",
    "punct": "on punctuation",
    "max_weight": "max weight",
}


def head_stats(w: torch.Tensor, special: list[bool], punct: list[bool]) -> dict:
    """The statistics of one head's (n, n) weights, computed the obvious way (realistic values for the table)."""
    n = w.shape[0]
    pos = torch.arange(n, dtype=w.dtype)
    return {
        "entropy": round(float(-(w * w.clamp_min(1e-12).log()).sum(-1).mean()), 5),
        "distance": round(float((w * (pos[None, :] - pos[:, None]).abs()).sum(-1).mean()), 5),
        "special": round(float(w[:, torch.tensor(special)].sum(-1).mean()), 5),
        "prev": round(float(w.diagonal(-1).sum() / n), 5),
        "next": round(float(w.diagonal(1).sum() / n), 5),
        "self": round(float(w.diagonal().mean()), 5),
        "punct": round(float(w[:, torch.tensor(punct)].sum(-1).mean()), 5),
        "max_weight": round(float(w.max()), 5),
    }


def make_data(*, tokens: list[str] = TOKENS, corpus: bool = False, extra: bool = False, seed: int = 0) -> dict:
    """A report dict as `multihead inspect` builds it: random softmax rows rounded to 5 decimals."""
    n = len(tokens)
    gen = torch.Generator().manual_seed(seed)
    logits = 2.5 * torch.randn(len(LAYERS), len(HEADS), n, n, generator=gen, dtype=torch.float64)
    weights = logits.softmax(-1).round(decimals=5)
    special = [t in ("[CLS]", "[SEP]") for t in tokens]
    punct = [t in (".", ",", "!", "?") for t in tokens]
    labels = ["prev", "[SEP]", "broad", "self", "focused", "mixed"]
    patterns = ["diagonal", "vertical", "heterogeneous", "diagonal", "block", "vertical+diagonal"]
    roles = [
        [
            {
                "label": labels[li * len(HEADS) + hi],
                "pattern": patterns[li * len(HEADS) + hi],
                "summary": f"synthetic head {li}.{hi}: max weight on offset -1 in {40 + 9 * hi}% of tokens",
            }
            for hi in range(len(HEADS))
        ]
        for li in range(len(LAYERS))
    ]
    stats = [[head_stats(weights[li, hi], special, punct) for hi in range(len(HEADS))] for li in range(len(LAYERS))]
    data = {
        "title": "multihead inspect: all-MiniLM-L6-v2",
        "text": "The bank was full of money.",
        "model": "all-MiniLM-L6-v2",
        "tokens": list(tokens),
        "special": special,
        "layers": list(LAYERS),
        "heads": list(HEADS),
        "weights": weights.tolist(),
        "roles": roles,
        "stats": stats,
        "stat_names": dict(STAT_NAMES),
        "roles_source": "this text",
        "selected_token": 2,
        "corpus": None,
        "extra_columns": {},
    }
    if corpus:
        data["corpus"] = {
            "source": "bundled corpus (150 sentences)",
            "sentences": 150,
            "tokens": 2400,
            "stats": [[{k: round(v * 0.9, 5) for k, v in head.items()} for head in layer] for layer in stats],
        }
        data["roles_source"] = "corpus (150 sentences)"
    if extra:
        data["extra_columns"] = {
            "importance": [
                [round(0.1 * (li + 1) * (hi + 1), 5) for hi in range(len(HEADS))] for li in range(len(LAYERS))
            ]
        }
    return data


# --------------------------------------------------------------------------- Python level


@pytest.mark.parametrize("key", ["weights", "tokens", "roles", "stats", "stat_names", "selected_token"])
def test_missing_key_is_named(key):
    data = make_data()
    del data[key]
    with pytest.raises(ValueError, match=re.escape(f"data[{key!r}]")) as info:
        render_html(data)
    assert "Fix:" in str(info.value)


def _drop_layer(w):
    return w[:1]


def _drop_head(w):
    return [layer[:2] for layer in w]


def _short_row(w):
    w = copy.deepcopy(w)
    w[1][2][4] = w[1][2][4][:-1]
    return w


def _no_key_axis(w):
    return [[[sum(row) for row in head] for head in layer] for layer in w]


@pytest.mark.parametrize("break_weights", [_drop_layer, _drop_head, _short_row, _no_key_axis])
def test_misnested_weights_name_weights(break_weights):
    data = make_data()
    data["weights"] = break_weights(data["weights"])
    with pytest.raises(ValueError, match=r"data\['weights'\]: expected nested lists .*Fix:"):
        render_html(data)


def test_weights_as_tensor_and_nan_weight():
    data = make_data()
    expected = render_html(data)
    data["weights"] = torch.tensor(data["weights"], dtype=torch.float64)
    assert render_html(data) == expected
    data["weights"][0, 1, 2, 3] = math.nan
    with pytest.raises(ValueError, match=re.escape("data['weights']: expected a finite number")):
        render_html(data)


def test_no_external_resources():
    page = render_html(make_data(corpus=True, extra=True))
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//", page, re.I)
    assert page.count("<script") == 2  # the data block and the inline code, neither with a src


HOSTILE = "</script><b>x</b>"


def test_script_breaking_text_stays_inside_the_data_block():
    tokens = ["[CLS]", "a", HOSTILE, "<!--", "&amp;", "\u00e9t\u00e9", ".", "[SEP]"]
    data = make_data(tokens=tokens)
    data["title"] = data["text"] = "a " + HOSTILE + " <!-- &amp;"
    page = render_html(data)
    block = page.split('<script type="application/json" id="report-data">', 1)[1].split("</script>", 1)[0]
    assert "</" not in block and "<!--" not in block
    assert page.count("</script>") == 2
    outside = page.replace(block, "")
    assert "<b>" not in outside and "&lt;/script&gt;&lt;b&gt;" in outside  # the <title>, HTML-escaped
    assert page.isascii()


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


@pytest.fixture
def open_report(browser, tmp_path):
    """open_report(data) -> page; after the test, asserts that the page logged no error."""
    pages, errors = [], []

    def open_(data: dict, width: int = 1200):
        path = tmp_path / f"report{len(pages)}.html"
        path.write_text(render_html(data), encoding="utf-8")
        page = browser.new_page(viewport={"width": width, "height": 900})
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


def read_bars(page) -> list[tuple[int, float, str, str]]:
    """(data-key, data-weight, key token text, percentage text) for every .weight-row, in order."""
    return page.eval_on_selector_all(
        "#attention-bars .weight-row",
        """rows => rows.map(row => [
        Number(row.getAttribute("data-key")), Number(row.getAttribute("data-weight")),
        row.querySelector(".key-token").textContent, row.querySelector(".weight-pct").textContent])""",
    )


def assert_bars_match(page, data: dict, li: int, hi: int, q: int) -> None:
    expected = data["weights"][li][hi][q]
    bars = read_bars(page)
    assert [key for key, *_ in bars] == list(range(len(data["tokens"])))
    for (k, weight, token, text), w in zip(bars, expected):
        assert abs(weight - w) <= 1e-9, (li, hi, q, k, weight, w)
        assert text == f"{100 * w:.1f}%", (li, hi, q, k, text, w)
        assert token == data["tokens"][k]


def select(page, li: int, hi: int, q: int) -> None:
    page.select_option("#layer-select", str(LAYERS[li]))
    page.select_option("#head-select", str(HEADS[hi]))
    page.click(f'.token[data-index="{q}"]')


def test_initial_view(open_report):
    data = make_data()
    page = open_report(data)
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
    assert page.text_content("#report-title") == data["title"]
    assert page.text_content("#report-text") == data["text"]
    assert page.text_content("#report-roles-source") == "this text"


def test_bars_follow_layer_head_and_token(open_report):
    data = make_data()
    page = open_report(data)
    for li, hi, q in [(1, 2, 3), (0, 1, 6), (1, 0, 0)]:
        select(page, li, hi, q)
        assert page.eval_on_selector_all(".token.selected", "ts => ts.map(t => t.dataset.index)") == [str(q)]
        assert_bars_match(page, data, li, hi, q)
        assert page.text_content(".head-cell.current .role-label") == data["roles"][li][hi]["label"]


def test_heatmap_click_selects_head(open_report):
    data = make_data()
    page = open_report(data)
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
    page = open_report(make_data())
    assert page.locator("#corpus-stats").count() == 0
    rows = len(LAYERS) * len(HEADS)
    assert page.locator("#head-stats tbody tr").count() == rows
    headers = page.eval_on_selector_all("#head-stats th", "ths => ths.map(th => th.textContent)")
    assert headers[: 4 + len(STAT_NAMES)] == ["layer", "head", "role", "pattern", *STAT_NAMES.values()]

    data = make_data(corpus=True, extra=True)
    page = open_report(data)
    assert page.locator("#corpus-stats").count() == 1
    assert page.locator("#corpus-stats tbody tr").count() == rows
    headers = page.eval_on_selector_all("#head-stats th", "ths => ths.map(th => th.textContent)")
    assert headers[4 + len(STAT_NAMES)] == "importance"
    first = page.eval_on_selector_all("#head-stats tbody tr:first-child td", "tds => tds.map(td => td.textContent)")
    assert first[:4] == [str(LAYERS[0]), str(HEADS[0]), data["roles"][0][0]["label"], data["roles"][0][0]["pattern"]]
    assert float(first[4]) == pytest.approx(data["stats"][0][0]["entropy"], abs=1e-3)
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
    data = make_data(tokens=tokens)
    data["text"] = "a " + HOSTILE + " <!-- &amp; \u00e9t\u00e9."
    page = open_report(data)
    assert page.text_content('.token[data-index="2"]') == HOSTILE
    assert page.eval_on_selector_all(".token", "ts => ts.map(t => t.textContent)") == tokens
    assert page.text_content("#report-text") == data["text"]
    assert page.locator("b").count() == 0
    page.click('.token[data-index="2"]')
    assert read_bars(page)[2][2] == HOSTILE
    assert_bars_match(page, data, 0, 0, 2)


# --------------------------------------------------------------------------- the real model's report


def test_minilm_report_displays_the_captured_weights(open_report):
    """The report of all-MiniLM-L6-v2 on the textbook sentence shows exactly the captured weights."""
    from multihead.inspect import capture
    from multihead.inspect.report import inspect_text
    from multihead.models import load_minilm

    model, _ = load_minilm()
    text = "The bank was full of money."
    inspection = inspect_text(model, text, token="bank")
    with torch.no_grad(), capture(model, layers=[0, 5], heads=[2, 9]) as rec:
        model.encode(text)
    page = open_report(inspection.report_data(), width=1400)
    for layer, head in ((0, 2), (5, 9)):
        page.select_option("#layer-select", str(layer))
        page.select_option("#head-select", str(head))
        page.click('.token[data-index="2"]')  # "bank"
        captured = rec.weights(layer, head)[0, 2]  # (j,): where "bank" attends
        bars = read_bars(page)
        assert [token for _, _, token, _ in bars] == inspection.tokens
        for (key, weight, _, pct), expected in zip(bars, captured.tolist()):
            assert abs(weight - expected) <= 5e-6, (layer, head, key, weight, expected)  # 5 decimals in the page
            assert pct == f"{100 * weight:.1f}%"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "inspect-minilm-report.png"), full_page=True)
