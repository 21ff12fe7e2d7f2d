"""The HTML report of `multihead train` checkpoints, as `multihead inspect --model RUN/model` writes it, driven in
Debian's chromium through Playwright and checked against the inspect.json of the same run.

Two short runs, trained once for the module: an encoder-decoder reversing 7 symbols (100 updates: every
cross-attention head aligns target position s with source position L - 1 - s) and a 2-layer causal decoder on
the induction task (a few updates: the layout matters, not the behaviour; a copy of its checkpoint with edited
probe measures pins the "induction" and "prefix" labels). The cross-attention page must put the decoder input on
the rows and the source text on the columns, the causal page must mask every key after its query, and the
probes of behaviours.json must reach the role column and the "(probe)" columns of the statistics table.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from multihead.cli import main
from multihead.lab.inspect.colours import MASKED_RGB, weight_rgb
from multihead.lab.inspect.inspection import CAUSAL_NOTE, PART_TITLES
from multihead.lab.train.induction import InductionSettings, run_induction
from multihead.lab.train.reverse import ReverseSettings, run_reverse
from test_inspect_html import browser, open_page, page_data, read_bars  # noqa: F401 (fixtures)
from test_inspect_html_page import drawn_labels, expected_lines, head_view_lines, short_label, thumbnail_pixels

LENGTH = 7  # source symbols of the reverse run: 7 target positions (<bos> and the first 6 outputs) read 7 keys
REVERSE = ReverseSettings(length=LENGTH, vocab_size=12, steps=100, log_every=100, probe_size=64)
# half_length 8: 17 pieces (<bos> and a segment twice), few enough for one label per heatmap row
INDUCTION = InductionSettings(half_length=8, steps=40, log_every=40, probe_size=16)
ALIGNED = 0.9  # the reverse run's heads align on the probe well over this (measured: 0.97 to 0.998)
# Of the 7 rows of the inspected text, each head's strongest key is the reversed position on at least this many:
# the trained weights differ in their last bits between CPU kinds, so a test asks for the behaviour, not every argmax
MOSTLY_REVERSED = LENGTH - 2
# An edited copy of the induction checkpoint's probes: (layer, head) -> (prefix_matching, copying)
EDITED = {(1, 2): (0.9, 0.8), (1, 3): (0.9, 0.05)}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one thread is faster and immune to a busy machine."""


def with_one_thread(function, *args):
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return function(*args)
    finally:
        torch.set_num_threads(saved)


def strongest_keys(weights: list[list[float]]) -> list[int]:
    """Each query row's strongest key (the first on a tie), as the page's bars and lines pick it."""
    return [max(range(len(row)), key=row.__getitem__) for row in weights]


def inspect_folder(model_dir: Path, out: Path, *part: str) -> dict:
    """`multihead inspect --model model_dir [--part ...] --format html,json --out out`: the page (str), the JSON
    report and the checkpoint's behaviours.json."""
    assert main(["inspect", "--model", str(model_dir), *part, "--format", "html,json", "--out", str(out)]) == 0
    return {
        "html": (out / "report.html").read_text(encoding="utf-8"),
        "data": json.loads((out / "inspect.json").read_text()),
        "probes": json.loads((model_dir / "behaviours.json").read_text()),
    }


@pytest.fixture(scope="module")
def reverse_report(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("reverse")
    model_dir = with_one_thread(run_reverse, REVERSE).save(root / "run")["model"]
    return inspect_folder(model_dir, root / "cross", "--part", "cross")


@pytest.fixture(scope="module")
def induction_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("induction")
    return with_one_thread(run_induction, INDUCTION).save(root / "run")["model"]


@pytest.fixture(scope="module")
def induction_report(induction_run, tmp_path_factory) -> dict:
    return inspect_folder(induction_run, tmp_path_factory.mktemp("induction-report"))


@pytest.fixture(scope="module")
def edited_report(induction_run, tmp_path_factory) -> dict:
    """The induction checkpoint with behaviours.json edited so that L1H2 matches prefixes and copies (an induction
    head) and L1H3 only matches prefixes."""
    root = tmp_path_factory.mktemp("edited")
    model_dir = Path(shutil.copytree(induction_run, root / "model"))
    path = model_dir / "behaviours.json"
    saved = json.loads(path.read_text())
    for (layer, head), (prefix, copying) in EDITED.items():
        saved["behaviours"]["prefix_matching"][layer][head] = prefix
        saved["behaviours"]["copying"][layer][head] = copying
    path.write_text(json.dumps(saved))
    return inspect_folder(model_dir, root / "report")


# --------------------------------------------------------------------------- page readers


def texts(page, selector: str) -> list[str]:
    return page.eval_on_selector_all(selector, "ns => ns.map(n => n.textContent)")


def detail_pixels(page, rows: int, cols: int) -> list[list[list[int]]]:
    """The (r, g, b) at the centre of every cell (query q, key k) of the large heatmap, [q][k]."""
    geometry = json.loads(page.get_attribute("#head-detail", "data-geometry"))
    return page.locator("#head-detail").evaluate(
        """(c, [g, rows, cols]) => { const r = window.devicePixelRatio || 1, ctx = c.getContext('2d'), out = [];
        for (let q = 0; q < rows; q++) { const row = [];
          for (let k = 0; k < cols; k++) {
            const x = Math.round((g.left + (k + 0.5) * g.cell) * r), y = Math.round((g.top + (q + 0.5) * g.cell) * r);
            row.push(Array.from(ctx.getImageData(x, y, 1, 1).data).slice(0, 3)); }
          out.push(row); }
        return out; }""",
        [geometry, rows, cols],
    )


def detail_cell_colours(page, q: int, k: int) -> set[tuple[int, int, int]]:
    """Every (r, g, b) drawn inside cell (q, k) of the large heatmap (its border pixels left out)."""
    geometry = json.loads(page.get_attribute("#head-detail", "data-geometry"))
    cell = geometry["cell"]
    return {
        tuple(rgb)
        for rgb in page.locator("#head-detail").evaluate(
            """(c, [x, y, s]) => { const r = window.devicePixelRatio || 1;
            const d = c.getContext('2d').getImageData(Math.round((x + 1) * r), Math.round((y + 1) * r),
              Math.round((s - 2) * r), Math.round((s - 2) * r)).data, out = [];
            for (let o = 0; o < d.length; o += 4) out.push([d[o], d[o + 1], d[o + 2]]);
            return out; }""",
            [geometry["left"] + k * cell, geometry["top"] + q * cell, cell],
        )
    }


def is_masked_grey(rgb: tuple[int, int, int]) -> bool:
    """The masked grey, or it darkened by the hatching's translucent black (no weight's colour)."""
    shade = rgb[0] / MASKED_RGB[0]
    return shade <= 1 and all(abs(c - shade * m) <= 2 for c, m in zip(rgb, MASKED_RGB, strict=True))


def hover_cell_title(page, q: int, k: int) -> str:
    """The title the large heatmap gives cell (q, k) under the mouse."""
    geometry = json.loads(page.get_attribute("#head-detail", "data-geometry"))
    box = page.locator("#head-detail").bounding_box()
    page.mouse.move(
        box["x"] + geometry["left"] + (k + 0.5) * geometry["cell"],
        box["y"] + geometry["top"] + (q + 0.5) * geometry["cell"],
    )
    title = page.get_attribute("#head-detail", "title")
    page.mouse.move(1, 1)
    return title


def head_view_geometry(page) -> dict:
    """The head view's token labels ({side: [(index, text, x, y)]}) and lines ([(query, key, x1, y1, x2, y2)])
    as drawn."""
    labels = page.eval_on_selector_all(
        "#head-view text.hv-token",
        """ts => ts.map(t => [t.dataset.side, Number(t.dataset.side === "query" ? t.dataset.query : t.dataset.key),
            t.textContent, Number(t.getAttribute("x")), Number(t.getAttribute("y"))])""",
    )
    lines = page.eval_on_selector_all(
        "#head-view line",
        """ls => ls.filter(l => l.parentNode.style.display !== "none").map(l => [Number(l.dataset.query),
            Number(l.dataset.key), ...["x1", "y1", "x2", "y2"].map(a => Number(l.getAttribute(a)))])""",
    )
    return {
        "query": [tuple(label[1:]) for label in labels if label[0] == "query"],
        "key": [tuple(label[1:]) for label in labels if label[0] == "key"],
        "lines": [tuple(line) for line in lines],
    }


def stats_table(page) -> tuple[list[str], list[dict]]:
    """The statistics table's headers and its rows, each {header: cell text}, "layer" and "head" as ints."""
    headers = texts(page, "#head-stats thead th")
    rows = page.eval_on_selector_all(
        "#head-stats tbody tr",
        "rs => rs.map(r => [Number(r.dataset.layer), Number(r.dataset.head), "
        "Array.from(r.children).map(td => td.textContent)])",
    )
    table = []
    for layer, head, cells in rows:
        row = dict(zip(headers, cells, strict=True))
        assert (row["layer"], row["head"]) == (str(layer), str(head))  # the cells name the row's head
        table.append({**row, "layer": layer, "head": head})
    return headers, table


def assert_probe_columns(page, html: str, data: dict, probes: dict) -> None:
    """The statistics table has one "NAME (probe)" column per measure of behaviours.json, with its values."""
    saved = probes["behaviours"]
    headers, rows = stats_table(page)
    assert [h for h in headers if h.endswith(" (probe)")] == [f"{name} (probe)" for name in saved]
    # after the statistics: the probes, then the head detectors' scores (`multihead inspect` probes a causal part
    # of a one-stack model; not a reverse run's cross-attention)
    detected = ("previous_token", "duplicate_token", "prefix_matching", "sink") if data["causal"] else ()
    detectors = [f"{name} (detector)" for name in detected]
    assert headers[-len(saved) - len(detectors) :] == [f"{name} (probe)" for name in saved] + detectors
    assert [(row["layer"], row["head"]) for row in rows] == [(li, h) for li in data["layers"] for h in data["heads"]]
    columns = page_data(html)["view"]["extra_columns"]
    for name, table in saved.items():
        shown = columns[f"{name} (probe)"]  # [layer row][head column]
        assert [row == pytest.approx(values, abs=1e-9) for row, values in zip(shown, table, strict=True)] == [
            True
        ] * len(table)
        for row in rows:
            value = table[row["layer"]][row["head"]]
            assert float(row[f"{name} (probe)"]) == pytest.approx(value, abs=5e-4 + 1e-9)  # fmt(): 3 decimals
            # inspect.json carries the same measures, rounded
            assert data["behaviours"][name][row["layer"]][row["head"]] == pytest.approx(value, abs=1e-6)


def role_column(page) -> list[str]:
    _, rows = stats_table(page)
    return [row["role"] for row in rows]


def json_labels(data: dict) -> list[str]:
    return [role["label"] for layer in data["roles"] for role in layer]


# --------------------------------------------------------------------------- cross-attention of the reverse run


def test_the_cross_attention_page_has_the_decoder_input_as_queries_and_the_source_as_keys(
    reverse_report,
    open_page,  # noqa: F811 (the fixture)
):
    data = reverse_report["data"]
    queries, keys = data["tokens"], data["key_tokens"]
    # the JSON: the source text as keys, the decoder input (<bos>, then the model's outputs) as queries
    assert (data["part"], data["causal"]) == ("cross", False)
    assert keys == data["text"].split() and len(keys) == LENGTH
    assert queries[0] == "<bos>" and len(queries) == LENGTH
    page = open_page(reverse_report["html"])
    # the page says what it shows
    assert texts(page, "#report-notes p") == [PART_TITLES["cross"]]
    assert PART_TITLES["cross"] == "cross-attention: decoder input -> source text"
    assert page.text_content("#report-part") == "cross" and page.is_visible("#report-part-meta")
    assert page.text_content("#report-ntokens") == f"{LENGTH} queries \u00b7 {LENGTH} keys"
    assert page.is_hidden("#legend-masked")
    # query tokens: the clickable strip; key tokens: the second strip
    assert texts(page, ".token:not(.key-chip)") == queries
    assert page.is_visible("#key-strip") and texts(page, ".key-chip") == keys
    # thumbnails: one pixel per (query, key), as many columns as keys and rows as queries
    sizes = page.eval_on_selector_all("canvas.heatmap", "cs => cs.map(c => [c.width, c.height])")
    assert sizes == [[len(keys), len(queries)]] * (len(data["layers"]) * len(data["heads"]))
    for hi in range(len(data["heads"])):
        pixels = thumbnail_pixels(page, data["layers"][0], data["heads"][hi])
        assert pixels == [[list(weight_rgb(w)) for w in row] for row in data["weights"][0][hi]], hi
    # the large heatmap: rows labelled with the queries, columns with the keys, every one
    labels = drawn_labels(page)
    assert page.get_attribute("#head-detail", "data-step") == "1"
    assert labels["rows"] == [[i, short_label(t)] for i, t in enumerate(queries)]
    assert labels["cols"] == [[k, short_label(t)] for k, t in enumerate(keys)]
    for q, k in ((0, LENGTH - 1), (2, 5), (LENGTH - 1, 1)):
        weight = data["weights"][0][0][q][k]
        assert hover_cell_title(page, q, k) == f"{queries[q]} \u2192 {keys[k]}: {100 * weight:.1f}%"


def test_an_aligned_head_reads_the_reversed_position_in_every_view(reverse_report, open_page):  # noqa: F811
    data, probes = reverse_report["data"], reverse_report["probes"]
    queries, keys = data["tokens"], data["key_tokens"]
    alignment = probes["behaviours"]["alignment"][0]
    assert min(alignment) > ALIGNED  # every head aligned on the probe
    page = open_page(reverse_report["html"])
    for hi, head in enumerate(data["heads"]):
        weights = data["weights"][0][hi]  # (target, source)
        strongest = strongest_keys(weights)
        # The behaviour, with a margin: a model trained on another CPU kind rounds differently, and a head aligned
        # at 0.97 may put one position's maximum elsewhere (seen on AVX-512: [4, 5, 4, 3, ...] for [6, 5, 4, 3, ...]).
        assert sum(k == LENGTH - 1 - q for q, k in enumerate(strongest)) >= MOSTLY_REVERSED, (hi, strongest)
        page.select_option("#head-select", str(head))
        # the large heatmap draws each cell in its weight's colour
        assert detail_pixels(page, LENGTH, LENGTH) == [[list(weight_rgb(w)) for w in row] for row in weights], hi
        for q in range(LENGTH):
            page.click(f'.token[data-index="{q}"]')
            # the bars: every source token, the strongest of inspect.json on top (on most rows the reversed one)
            bars = read_bars(page)
            assert [(k, token) for k, _, token, _ in bars] == list(enumerate(keys))
            assert [weight for _, weight, _, _ in bars] == weights[q]
            top = page.locator("#attention-bars .weight-row").first
            assert int(top.get_attribute("data-key")) == strongest[q]
            assert top.locator(".key-token").text_content() == keys[strongest[q]]
            assert "is-max" in top.get_attribute("class")
            title = page.text_content("#bars-title")
            assert title == (
                f"Where {queries[q]} (#{q}) attends in the source text in layer {data['layers'][0]}, head {head}"
            )
            # the heatmap labels the selected query's row and its strongest key's column
            labels = drawn_labels(page)
            assert [q, short_label(queries[q])] in labels["rows"]
            assert [strongest[q], short_label(keys[strongest[q]])] in labels["cols"]
        # the role column and the thumbnails' captions say "aligned", as the roles of inspect.json do
        assert data["roles"][0][hi]["label"] == "aligned"
    assert role_column(page) == json_labels(data) == ["aligned"] * len(data["heads"])
    assert texts(page, ".role-label") == json_labels(data)


def test_the_cross_attention_head_view_joins_target_queries_to_source_keys(reverse_report, open_page):  # noqa: F811
    data = reverse_report["data"]
    queries, keys = data["tokens"], data["key_tokens"]
    page = open_page(reverse_report["html"])
    for hi, head in enumerate(data["heads"]):
        page.select_option("#head-select", str(head))
        drawn = head_view_geometry(page)
        assert [text for _, text, _, _ in drawn["query"]] == [short_label(t) for t in queries]
        assert [text for _, text, _, _ in drawn["key"]] == [short_label(t) for t in keys]
        assert [i for i, *_ in drawn["query"]] == [k for k, *_ in drawn["key"]] == list(range(LENGTH))
        query_at = {i: (x, y) for i, _, x, y in drawn["query"]}
        key_at = {k: (x, y) for k, _, x, y in drawn["key"]}
        assert max(x for x, _ in query_at.values()) < min(x for x, _ in key_at.values())  # queries left
        assert {line[:3] for line in head_view_lines(page)} == expected_lines(data, 0, hi)
        for q, k, x1, y1, x2, y2 in drawn["lines"]:
            # from the query's label (left) to the key's label (right)
            assert (y1, y2) == (query_at[q][1], key_at[k][1]), (q, k)
            assert query_at[q][0] < x1 < x2 < key_at[k][0]
        # the strongest line of each query goes to its strongest source token in inspect.json (on most rows the
        # reversed one: the previous test holds the behaviour)
        strongest = {}
        for _, q, k, _, weight in head_view_lines(page):
            if weight > strongest.get(q, (-1, -1.0))[1]:
                strongest[q] = (k, weight)
        assert {q: k for q, (k, _) in strongest.items()} == dict(enumerate(strongest_keys(data["weights"][0][hi])))
    # hovering a target token leaves its lines only, into the source
    page.hover('#head-view text[data-query="2"]')
    assert {line[:3] for line in head_view_lines(page)} == expected_lines(data, 0, len(data["heads"]) - 1, [2])
    page.mouse.move(1, 1)


def test_the_cross_attention_page_lists_the_alignment_probe(reverse_report, open_page):  # noqa: F811 (the fixture)
    page = open_page(reverse_report["html"])
    assert set(reverse_report["probes"]["behaviours"]) == {"alignment"}
    assert_probe_columns(page, reverse_report["html"], reverse_report["data"], reverse_report["probes"])


# --------------------------------------------------------------------------- the causal induction decoder


def test_the_causal_page_masks_every_key_after_its_query(induction_report, open_page):  # noqa: F811 (the fixture)
    data = induction_report["data"]
    tokens = data["tokens"]
    n = len(tokens)
    assert (data["part"], data["causal"]) == ("self", True)
    assert data["key_tokens"] == tokens and tokens[0] == "<bos>" and n == 2 * INDUCTION.half_length + 1
    for layer in data["weights"]:  # the JSON: nothing above the diagonal
        for matrix in layer:
            assert all(w == 0 for q, row in enumerate(matrix) for w in row[q + 1 :])
    page = open_page(induction_report["html"])
    assert texts(page, "#report-notes p") == [CAUSAL_NOTE]
    assert CAUSAL_NOTE == "causal: each token attends only to itself and earlier tokens"
    assert page.is_visible("#legend-masked") and page.is_hidden("#key-strip") and page.is_hidden("#report-part-meta")
    assert page.text_content("#report-ntokens") == str(n)
    # rows and columns are the same tokens
    labels = drawn_labels(page)
    assert labels["rows"] == labels["cols"] == [[i, short_label(t)] for i, t in enumerate(tokens)]
    for li, layer in enumerate(data["layers"]):
        for hi, head in enumerate(data["heads"]):
            # thumbnails: masked cells grey, the others their weight's colour
            pixels = thumbnail_pixels(page, layer, head)
            for q, row in enumerate(data["weights"][li][hi]):
                for k, w in enumerate(row):
                    assert pixels[q][k] == list(MASKED_RGB if k > q else weight_rgb(w)), (li, hi, q, k)
    page.select_option("#layer-select", str(data["layers"][1]))
    page.select_option("#head-select", str(data["heads"][2]))
    page.click(f'.token[data-index="{n - 1}"]')  # the selected query's outline on the last row: no masked cell
    matrix = data["weights"][1][2]
    hatch = None
    centres = detail_pixels(page, n, n)
    for q in range(n):
        for k in range(n):
            if k <= q:
                assert centres[q][k] == list(weight_rgb(matrix[q][k])), (q, k)
                continue
            colours = detail_cell_colours(page, q, k)  # grey hatching: the masked grey and its darker lines
            assert tuple(MASKED_RGB) in colours and all(is_masked_grey(rgb) for rgb in colours), (q, k, colours)
            hatch = colours if hatch is None else hatch | colours
    assert hatch and len(hatch) > 1  # the hatching's lines are there too
    for q in (0, 7, n - 1):
        assert hover_cell_title(page, q, n - 1) == (
            f"{tokens[q]} \u2192 {tokens[n - 1]}: "
            + ("masked (a later token)" if q < n - 1 else f"{100 * matrix[q][n - 1]:.1f}%")
        )
        page.click(f'.token[data-index="{q}"]')
        bars = read_bars(page)  # the keys the query sees only; the later ones are one line after the bars
        assert [token for _, _, token, _ in bars] == tokens[: q + 1]
        assert all(pct != "masked" for _, _, _, pct in bars)
        note = page.locator("#attention-bars .masked-note")
        assert note.count() == (1 if q < n - 1 else 0)
        # the head view: query and key columns are the same tokens, no line to a later key
    drawn = head_view_geometry(page)
    assert (
        [t for _, t, _, _ in drawn["query"]] == [t for _, t, _, _ in drawn["key"]] == [short_label(t) for t in tokens]
    )
    page.click("#head-view-all")
    lines = head_view_lines(page)
    assert lines and all(k <= q for _, q, k, _, _ in lines)
    assert {line[:3] for line in lines} == set().union(
        *(expected_lines(data, 1, hi, causal=True) for hi in range(len(data["heads"])))
    )


def test_the_causal_page_shows_the_probe_roles_and_columns(induction_report, open_page):  # noqa: F811 (the fixture)
    data, probes = induction_report["data"], induction_report["probes"]
    assert (probes["task"], probes["part"]) == ("induction", "self")
    assert set(probes["behaviours"]) == {"prefix_matching", "copying"}
    page = open_page(induction_report["html"])
    # a short run: whatever the roles say (the probes measure no induction head yet), the page says the same
    assert role_column(page) == texts(page, ".role-label") == json_labels(data)
    for li, layer in enumerate(probes["behaviours"]["prefix_matching"]):
        for hi, prefix in enumerate(layer):
            copying = probes["behaviours"]["copying"][li][hi]
            if prefix >= 0.4:  # roles.ROLE_RULES: prefix matching makes the head "induction" or "prefix"
                assert data["roles"][li][hi]["label"] == ("induction" if copying >= 0.25 else "prefix")
    assert_probe_columns(page, induction_report["html"], data, probes)


def test_probes_that_find_induction_and_prefix_heads_label_them_on_the_page(edited_report, open_page):  # noqa: F811
    data, probes = edited_report["data"], edited_report["probes"]
    page = open_page(edited_report["html"])
    labels = json_labels(data)
    expected = {(1, 2): "induction", (1, 3): "prefix"}
    _, rows = stats_table(page)
    for row in rows:
        key = (row["layer"], row["head"])
        if key in expected:
            assert row["role"] == expected[key]
            assert row["strength"] == "90%"  # the prefix-matching measure
        else:
            assert row["role"] not in ("induction", "prefix")
    assert [row["role"] for row in rows] == labels == texts(page, ".role-label")
    assert_probe_columns(page, edited_report["html"], data, probes)
    for (layer, head), (prefix, copying) in EDITED.items():
        row = next(r for r in rows if (r["layer"], r["head"]) == (layer, head))
        assert (row["prefix_matching (probe)"], row["copying (probe)"]) == (f"{prefix:.3f}", f"{copying:.3f}")
    # the selected head's summary names its role too
    page.select_option("#layer-select", "1")
    page.select_option("#head-select", "2")
    assert page.text_content("#head-summary .role") == "induction"
