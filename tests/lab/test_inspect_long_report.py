"""What `multihead inspect --long` prints and draws (multihead.lab.inspect.long_report): its tables fit the terminal
(split into blocks of neighbouring columns, each with the heads, as plain inspect splits its layers), and its page
and PNG colour non-negative measures (mean weights, entropy) on a sequential scale from 0, printed unsigned, while
a quantity with a negative value keeps the diverging scale and its signs."""

from __future__ import annotations

import io
import re

import pytest
import torch
from rich.cells import cell_len
from rich.console import Console

from multihead.lab.inspect import bundled_corpus, inspect_long
from multihead.lab.inspect.colours import SCORE_STOPS, SEQUENTIAL_STOPS, score_rgb
from multihead.lab.inspect.long_report import long_page, print_long
from multihead.lab.inspect.page import Grid, Page, Table, print_page, render_page
from multihead.lab.models import load_minilm
from test_inspect_page import background, parsed

BANDS = ["0", "1", "2-8", "9-64", "65-512", "513+"]
HEADERS = ["head", "role", "sink", "hitters", "entropy", *BANDS, "most received"]


@pytest.fixture(scope="module")
def found():
    """MiniLM on 12 sentences of the bundled corpus (one window of 145 pieces), layers 0 and 5, heads 1 and 2."""
    model, _ = load_minilm()
    return inspect_long(model, " ".join(bundled_corpus()[:12]), layers=[0, 5], heads=[1, 2])


def printed(found, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    print_long(console, found)
    return console.export_text()


def layer_blocks(text: str) -> dict[int, list[list[str]]]:
    """{layer: its tables' lines (header, rule, rows), in order}: a table starts at its title "layer L" (or
    "layer L, continued") and ends at the first blank line after its rows."""
    blocks: dict[int, list[list[str]]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        title = re.fullmatch(r"layer (\d+)(, continued)?", line.strip())
        if title:
            current = []
            blocks.setdefault(int(title.group(1)), []).append(current)
        elif current is not None:
            if not line.strip():
                if len(current) > 2:  # the blank line after the rows (rich leaves one under the title)
                    current = None
                continue
            current.append(line)
    return blocks


def _css(rgb: tuple[int, int, int]) -> str:
    return f"rgb({rgb[0]}, {rgb[1]}, {rgb[2]})"


def expected_cells(profile) -> list[str]:
    """A head's cells after its number, as the table prints them, in the order of :data:`HEADERS`."""
    hitter = profile.heavy_hitters[0]
    return [
        profile.role or "",
        f"{profile.sink:.0%}",
        f"{profile.heavy_share:.0%}",
        f"{profile.entropy:.2f}",
        *(f"{value:.0%}" for value in profile.bands),
        f"{hitter['piece']}@{hitter['position']} {hitter['share']:.0%}",
    ]


@pytest.mark.parametrize("width", [100, 80, 60])
def test_the_tables_fit_the_width_with_every_column_and_value(found, width):
    text = printed(found, width)
    assert max(cell_len(line) for line in text.splitlines()) <= width
    blocks = layer_blocks(text)
    assert sorted(blocks) == [0, 5]
    for layer, tables in blocks.items():
        # every column once, in order, across the layer's blocks; each block leads with the heads
        headers = []
        for lines in tables:
            names = re.findall(r"most received|\S+", lines[0])
            assert names[0] == "head" and set(lines[1].strip()) == {"\u2500"}
            headers += names[1:]
        assert ["head", *headers] == HEADERS
        # every value of every head of the layer, in the order of the columns
        for profile in (p for p in found.heads if p.layer == layer):
            cells = []
            for lines in tables:
                row = [line for line in lines[2:] if line.split()[0] == str(profile.head)]
                assert len(row) == 1
                cells.append(row[0].split(maxsplit=1)[1])
            shown = " ".join(" ".join(cells).split())
            assert shown == " ".join(" ".join(cell for cell in expected_cells(profile) if cell).split())
    # a table that fits (97 columns) is not split; narrower consoles split it into the fewest blocks that fit
    assert all(len(tables) == (1 if width >= 100 else 2) for tables in blocks.values())


def test_the_command_fits_the_width_columns_says(found, tmp_path, capsys, monkeypatch):
    from multihead.cli import main

    source = tmp_path / "long.txt"
    source.write_text(" ".join(bundled_corpus()[:12]), encoding="utf-8")
    monkeypatch.setenv("COLUMNS", "60")
    assert main(["inspect", "--long", str(source), "--layers", "0", "--heads", "1", "--format", "terminal"]) == 0
    out = capsys.readouterr().out
    assert max(cell_len(line) for line in out.splitlines()) <= 60
    assert "513+" in out and "most received" in out and "layer 0, continued" in out


# --------------------------------------------------------------------------- the scales of the page and the PNG


def test_the_page_colours_non_negative_measures_from_0_and_prints_them_unsigned(found):
    html = render_page(long_page(found))
    page = parsed(html)
    heads = len(found.heads)
    bands, entropy = page.cells[: heads * 6], page.cells[heads * 6 :]
    assert [float(cell["data-value"]) for cell in bands] == [value for p in found.heads for value in p.bands]
    zeros = [cell for cell in bands if float(cell["data-value"]) == 0.0]
    assert zeros  # the 513+ band of a text of 145 pieces
    for cell in zeros:  # 0 is the sequential scale's start, not the diverging scale's white middle
        assert cell["style"] == background(SEQUENTIAL_STOPS[0])
        assert cell["style"] != background(score_rgb(0.0, 1.0))
    for cell in bands:
        value = float(cell["data-value"])
        assert cell["text"] == f"{value:.2f}" and cell["title"].endswith(f": {value:.3f}")  # no sign
    dark = max(bands, key=lambda cell: float(cell["data-value"]))
    assert float(dark["data-value"]) > 0.9 and "color: #fff" in dark["style"]
    # the entropy along the text: from 0 (its lightest colour is not the start: no stretch has entropy 0) to
    # its largest, which is the ramp's end
    values = [float(cell["data-value"]) for cell in entropy if cell["data-value"]]
    assert min(values) > 0 and all(cell["title"].split(": ")[-1][0] != "+" for cell in entropy)
    largest = next(cell for cell in entropy if cell["data-value"] and float(cell["data-value"]) == max(values))
    assert largest["style"].startswith(background(SEQUENTIAL_STOPS[-1]))
    # each legend: 0 on the left, the bound on the right, the sequential ramp between
    legends = re.findall(
        r'<div class="legend"><span>([^<]*)</span><span class="ramp" style="([^"]*)"></span><span>([^<]*)</span>', html
    )
    assert [(low, high) for low, _, high in legends] == [("0", "1"), ("0", f"{max(values):.3g}")]
    assert all(
        ramp.startswith(f"background: linear-gradient(to right, {_css(SEQUENTIAL_STOPS[0])}") for _, ramp, _ in legends
    )
    # the table of roles and shares: its numbers unsigned too
    for row in page.rows:
        for cell in row[2:6]:
            assert re.fullmatch(r"\d\.\d{3}", cell["text"])


def test_the_png_draws_non_negative_measures_from_0(found, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from multihead.lab.inspect import page as report
    from multihead.lab.inspect.long_report import write_long

    drawn = []
    monkeypatch.setattr(report, "save_figure", lambda figure, path: drawn.append(figure) or path)
    assert "png" in write_long(found, tmp_path, ["png"], argument="--out")
    images = [axes.images[0] for axes in drawn[0].axes if axes.images][:2]  # the two grids, then the mosaic
    largest_entropy = max(value for p in found.heads for value in p.entropy_profile)
    assert [(image.norm.vmin, image.norm.vmax) for image in images] == [
        (0.0, 1.0),
        pytest.approx((0.0, largest_entropy)),
    ]
    for image in images:
        assert image.colorbar is not None and image.colorbar.norm.vmin == 0.0  # the colour bar starts at 0
        start, end = image.get_cmap()([0.0, 1.0], bytes=True)[:, :3].tolist()
        assert max(abs(a - b) for a, b in zip(start, SEQUENTIAL_STOPS[0], strict=True)) <= 1
        assert max(abs(a - b) for a, b in zip(end, SEQUENTIAL_STOPS[-1], strict=True)) <= 1
    plt.close(drawn[0])


def test_one_negative_value_keeps_the_diverging_scale_everywhere(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from multihead.lab.inspect import page as report

    positive = torch.tensor([[0.0, 0.5], [2.0, float("nan")]], dtype=torch.float64)
    signed = positive.clone()
    signed[0, 1] = -0.5
    page = Page(
        "p",
        grids=[Grid("positive", positive), Grid("signed", signed)],
        tables=[Table("shares", ["a", "b"], [["x", 0.25]]), Table("differences", ["a", "b"], [["x", -0.25]])],
    )
    view = parsed(render_page(page))
    assert [cell["text"] for cell in view.cells] == ["0.00", "0.50", "2.00", "", "+0.00", "-0.50", "+2.00", ""]
    assert view.cells[0]["style"] == background(SEQUENTIAL_STOPS[0])  # sequential from 0
    assert view.cells[4]["style"] == background(SCORE_STOPS[5])  # diverging: 0 is the white middle
    assert [row[1]["text"] for row in view.rows] == ["0.250", "-0.250"]
    console = Console(width=100, file=io.StringIO(), record=True, color_system=None)
    print_page(console, page)
    text = console.export_text()
    assert " 0.50 " in text and "-0.50" in text and "+2.00" in text and " 0.250" in text and "+0.250" not in text
    drawn = []
    monkeypatch.setattr(report, "save_figure", lambda figure, path: drawn.append(figure) or path)
    report.plot_grids(page.grids, tmp_path / "p.png")
    assert [axes.images[0].get_clim() for axes in drawn[0].axes if axes.images] == [(0.0, 2.0), (-2.0, 2.0)]
    plt.close(drawn[0])
