"""The static pages of `multihead circuits` and `multihead inspect --long` (multihead.lab.inspect.page): every score a
cell carrying its value and coloured on the score scale, every mosaic tile an inline PNG of its pixels, user text
escaped and the page ASCII, and the page opened offline in Debian's chromium."""

from __future__ import annotations

import base64
import math
import struct
import zlib
from html.parser import HTMLParser

import pytest
import torch

from multihead.lab.inspect.colours import SCORE_STOPS, score_rgb
from multihead.lab.inspect.page import Grid, Mosaic, Page, Table, render_page
from test_inspect_html import browser, open_page  # noqa: F401 (fixtures)


class Cells(HTMLParser):
    """The page's grid cells (their attributes and text), its table rows (their cells' text and style) and its
    images (their attributes)."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[dict] = []
        self.images: list[dict] = []
        self.rows: list[list[dict]] = []
        self._in: dict | None = None
        self._table_kind: str | None = None
        self._body = False  # inside a rows table's tbody (its header row is not a row)

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag == "img":
            self.images.append(attributes)
        elif tag == "table":
            self._table_kind = (attributes.get("class") or "").split()[0]  # "grid", "grid compact" or "rows"
        elif tag == "tbody" and self._table_kind == "rows":
            self._body = True
        elif tag == "tr" and self._table_kind == "rows" and self._body:
            self.rows.append([])
        elif tag == "td":
            self._in = attributes | {"text": ""}
            if self._table_kind == "grid":
                self.cells.append(self._in)
            elif self.rows:
                self.rows[-1].append(self._in)

    def handle_endtag(self, tag):
        if tag == "td":
            self._in = None
        elif tag == "tbody":
            self._body = False

    def handle_data(self, data):
        if self._in is not None:
            self._in["text"] += data


def parsed(html: str) -> Cells:
    reader = Cells()
    reader.feed(html)
    return reader


def png_pixels(source: str) -> torch.Tensor:
    """The (h, w, 3) uint8 pixels of an inline 8-bit RGB PNG without filters (``data:image/png;base64,...``),
    read back by hand: the page's picture, not the code that wrote it."""
    prefix = "data:image/png;base64,"
    assert source.startswith(prefix)
    data = base64.b64decode(source[len(prefix) :])
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, chunks = 8, {}
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind = data[at + 4 : at + 8]
        chunks[kind] = chunks.get(kind, b"") + data[at + 8 : at + 8 + length]
        at += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2)
    rows = torch.frombuffer(bytearray(zlib.decompress(chunks[b"IDAT"])), dtype=torch.uint8).reshape(height, -1)
    assert rows[:, 0].eq(0).all()  # no filter on any row
    return rows[:, 1:].reshape(height, width, 3)


def background(rgb: tuple[int, int, int]) -> str:
    return f"background: rgb({rgb[0]}, {rgb[1]}, {rgb[2]})"


SCORES = torch.tensor([[0.5, -0.25, float("nan")], [1.0, 0.0, -2.0]], dtype=torch.float64)


def test_every_score_is_a_cell_with_its_value_title_and_colour():
    html = render_page(Page("patching", grids=[Grid("a grid", SCORES, label="share restored")]))
    cells = parsed(html).cells
    assert [(int(c["data-row"]), int(c["data-column"])) for c in cells] == [(r, c) for r in range(2) for c in range(3)]
    for cell, value in zip(cells, SCORES.flatten().tolist(), strict=True):
        if math.isnan(value):
            assert cell["data-value"] == "" and cell["text"] == "" and "none" in cell["class"].split()
            continue
        assert float(cell["data-value"]) == value  # exactly the score, as repr writes it
        assert cell["text"] == f"{value:+.2f}"
        assert cell["title"] == f"layer {cell['data-row']}, head {cell['data-column']}: {value:+.3f}"
        assert cell["style"].startswith(background(score_rgb(value, 2.0)))  # bound: the largest |score|
    dark = next(c for c in cells if c["data-value"] == "-2.0")
    assert dark["style"].endswith("color: #fff") and background(SCORE_STOPS[0]) in dark["style"]
    assert "color" not in next(c for c in cells if c["data-value"] == "0.0")["style"].replace("background", "")
    assert "-2" in html and "+2" in html and "share restored" in html  # the legend's ends and label


def test_a_given_bound_and_position_labels():
    grid = Grid("by position", SCORES, across="position", columns=["<b>", "caf\u00e9", "x"], bound=4.0)
    cells = parsed(render_page(Page("p", grids=[grid]))).cells
    assert cells[0]["style"] == background(score_rgb(0.5, 4.0))
    assert cells[1]["title"] == "layer 0, position 1 (caf\u00e9): -0.250"


def test_user_text_is_escaped_and_the_page_is_ascii():
    hostile = "</title><script>alert(1)</script> caf\u00e9 \u2192"
    page = Page(
        hostile,
        facts={"clean": hostile},
        grids=[Grid(hostile, SCORES, columns=[hostile] * 3)],
        tables=[Table(hostile, ["after", hostile], [["embedding", hostile]])],
        notes=[hostile],
    )
    html = render_page(page)
    html.encode("ascii")  # raises on any non-ASCII character
    assert "<script>" not in html and "&lt;script&gt;" in html and "caf&#233;" in html


def test_a_table_shades_its_numbers_on_its_largest_magnitude():
    table = Table("lens", ["after", "tokens", "answer - wrong"], [["layer 0", "'a'", -0.5], ["layer 1", "'b'", 2.0]])
    rows = parsed(render_page(Page("lens", tables=[table]))).rows
    assert [[cell["text"] for cell in row] for row in rows] == [
        ["layer 0", "'a'", "-0.500"],
        ["layer 1", "'b'", "+2.000"],
    ]
    assert rows[0][2]["style"] == background(score_rgb(-0.5, 2.0)) and rows[0][0]["style"] == ""


def test_the_page_opens_offline_with_the_colours_it_was_given(open_page):  # noqa: F811
    page = open_page(render_page(Page("patching", {"model": "m"}, grids=[Grid("grid", SCORES)])))
    colours = page.locator("td.cell").evaluate_all("cs => cs.map(c => getComputedStyle(c).backgroundColor)")
    expected = [
        "rgb(240, 241, 243)" if math.isnan(value) else "rgb({}, {}, {})".format(*score_rgb(value, 2.0))
        for value in SCORES.flatten().tolist()
    ]
    assert colours == expected
    assert page.locator("h1").text_content() == "patching"


@pytest.mark.parametrize("value, bound", [(0.0, 1.0), (-1.0, 1.0), (1.0, 1.0), (7.0, 1.0), (-0.5, 2.0)])
def test_the_score_scale_runs_blue_white_red(value, bound):
    share = min(1.0, max(0.0, (value / bound + 1) / 2))
    rgb = score_rgb(value, bound)
    if share in (0.0, 0.5, 1.0):
        assert rgb == SCORE_STOPS[int(share * (len(SCORE_STOPS) - 1))]
    else:
        assert rgb == score_rgb(-1.0, 4.0)  # -0.5 of 2 sits where -1 of 4 does


def test_the_png_draws_every_grid_on_the_score_scale(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from multihead.lab.inspect import page as report

    drawn = []
    monkeypatch.setattr(report, "save_figure", lambda figure, path: drawn.append(figure) or path)
    page = Page("two grids", grids=[Grid("a", SCORES), Grid("b", SCORES * 3, bound=1.0)])
    written = report.write_report({"x": 1}, "patching", tmp_path, ["json", "png"], page)
    assert set(written) == {"json", "png"} and written["png"].name == "patching.png"
    images = [axes.images[0] for axes in drawn[0].axes if axes.images]
    assert [image.get_clim() for image in images] == [(-2.0, 2.0), (-1.0, 1.0)]
    colours = torch.tensor(images[0].get_cmap()([0.0, 0.5, 1.0], bytes=True)[:, :3].tolist())
    expected = torch.tensor([SCORE_STOPS[0], SCORE_STOPS[5], SCORE_STOPS[-1]])  # the page's scale
    assert (colours - expected).abs().max() <= 1  # matplotlib samples the ramp at 256 levels
    plt.close(drawn[0])


def test_the_png_of_a_page_of_tables_alone_draws_its_tables_shaded_as_the_html(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from multihead.lab.inspect import page as report

    drawn = []
    monkeypatch.setattr(report, "save_figure", lambda figure, path: drawn.append(figure) or path)
    rows = [["embedding", "'$' 'a'", -0.5], ["layer 0", "'b' '$'", 2.0]]  # "$" twice: text, not mathtext
    lens = Page("lens", tables=[Table("the lens", ["after", "likeliest tokens", "answer - wrong"], rows)])
    assert set(report.write_report({}, "lens", tmp_path, ["png", "html"], lens)) == {"png", "html"}
    (axes,) = drawn[0].axes
    (table,) = axes.tables
    cells = table.get_celld()
    texts = [[cells[row, column].get_text().get_text() for column in range(3)] for row in range(3)]
    assert texts == [["after", "likeliest tokens", "answer - wrong"], *([*row[:2], f"{row[2]:+.3f}"] for row in rows)]
    assert not any(cell.get_text().get_parse_math() for cell in cells.values())
    scale = lens.tables[0].scale()
    for row, value in ((1, -0.5), (2, 2.0)):
        shade = [round(channel * 255) for channel in cells[row, 2].get_facecolor()[:3]]
        assert shade == list(scale.rgb(value))
    assert axes.get_title() == "the lens"
    plt.close(drawn[0])
    drawn.clear()
    both = Page("dla", grids=[Grid("a", SCORES)], tables=lens.tables)  # a page with a grid: its PNG is the grid
    report.write_report({}, "dla", tmp_path, ["png"], both)
    assert not any(axes.tables for axes in drawn[0].axes)
    plt.close(drawn[0])
    assert "png" not in report.write_report({}, "empty", tmp_path, ["png", "html"], Page("empty"))


TILES = [
    [torch.randint(0, 256, (4, 4, 3), generator=torch.Generator().manual_seed(s), dtype=torch.uint8) for s in (0, 1)],
    [None, torch.zeros(4, 4, 3, dtype=torch.uint8)],
]


def test_a_mosaic_tile_is_an_inline_png_of_its_pixels_named_in_full():
    mosaic = Mosaic("maps", TILES, [["L0 H0", "L0 H1"], ["", "L1 H1 <b>"]], ["L0", "L1"], ["H0", "H1"], note="dark")
    html = render_page(Page("long", mosaics=[mosaic]))
    images = parsed(html).images
    assert [image["title"] for image in images] == ["L0 H0", "L0 H1", "L1 H1 <b>"]  # the missing tile: no image
    assert [image["alt"] for image in images] == [image["title"] for image in images]
    for image, tile in zip(images, [TILES[0][0], TILES[0][1], TILES[1][1]], strict=True):
        assert torch.equal(png_pixels(image["src"]), tile)
    assert "&lt;b&gt;" in html and html.isascii() and "dark" in html


def test_the_mosaic_opens_offline_and_draws_its_pictures(open_page):  # noqa: F811
    mosaic = Mosaic("maps", TILES, [["a", "b"], ["", "c"]], ["L0", "L1"], ["H0", "H1"])
    page = open_page(render_page(Page("long", mosaics=[mosaic])))
    sizes = page.locator("table.mosaic img").evaluate_all("images => images.map(i => [i.complete, i.naturalWidth])")
    assert sizes == [[True, 4]] * 3  # each decoded from its data: address, nothing fetched


def test_the_png_draws_the_mosaic_after_the_grids(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from multihead.lab.inspect import page as report

    drawn = []
    monkeypatch.setattr(report, "save_figure", lambda figure, path: drawn.append(figure) or path)
    mosaic = Mosaic("maps", TILES, [["a", "b"], ["", "c"]], ["L0", "L1"], ["H0", "H1"])
    report.write_report({}, "long", tmp_path, ["png"], Page("long", grids=[Grid("a", SCORES)], mosaics=[mosaic]))
    images = [axes.images[0] for axes in drawn[0].axes if axes.images]
    canvas = torch.tensor(images[1].get_array().tolist(), dtype=torch.uint8)  # tiles of 4 with a gap of 1
    assert torch.equal(canvas[:4, :4], TILES[0][0]) and torch.equal(canvas[:4, 5:9], TILES[0][1])
    assert torch.equal(canvas[5:9, 5:9], TILES[1][1]) and canvas[5:9, :4].eq(255).all()  # no tile: white
    plt.close(drawn[0])


def test_a_grid_with_row_labels_and_colour_alone():
    grid = Grid("profile", SCORES, across="stretch", down="head", rows=["L0 H1", "L3 H0"], numbers=False)
    html = render_page(Page("p", grids=[grid]))
    cells = parsed(html).cells
    assert all(cell["text"] == "" for cell in cells)  # colour alone; the value stays in data-value and the title
    assert float(cells[1]["data-value"]) == -0.25 and cells[1]["title"] == "L0 H1, stretch 1: -0.250"
    assert '<th scope="row">L3 H0</th>' in html and "<th>head</th>" in html and 'class="grid compact"' in html
