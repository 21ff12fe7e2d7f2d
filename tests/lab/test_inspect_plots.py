"""multihead.lab.inspect.plots: the PNG grid of every head's heatmap on the page's colour scale, labelled, and the
clear error without matplotlib (the commands that write a PNG among other files skip it instead: see
test_without_matplotlib.py).

The colour checks read the written PNG back and compare the pixel at the centre of each cell with
``weight_rgb`` of that cell's weight (the page's square-root scale), within 2 per channel.
"""

from __future__ import annotations

import dataclasses
import struct
import sys

import numpy as np
import pytest
import torch

import multihead.lab.inspect.plots as plots
from multihead._figures import PNG_DPI, MissingExtraError, save_figure
from multihead.lab.inspect.colours import MASKED_RGB, WEIGHT_SCALE_LABEL, WEIGHT_TICKS, weight_rgb
from multihead.lab.inspect.inspection import CAUSAL_NOTE, PART_TITLES, Inspection
from multihead.lab.inspect.plots import (
    CELL_INCHES,
    HEAD_TITLE_FONT,
    MAX_LABELS,
    PRUNED_GREY,
    TOKEN_FONT,
    cell_inches,
    heatmap_figure,
    heatmap_grid,
    weight_colours,
)
from multihead.lab.inspect.stats import weight_stats
from support_inspect import HEADS, LAYERS, TEXT, TOKENS, synthetic_inspection, synthetic_weights

TOLERANCE = 2  # per channel, 0-255


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


def rendered(inspection: Inspection, tmp_path, name: str = "heads.png"):
    """(figure, (height, width, 3) uint8 pixels of the PNG written): the figure keeps its saved layout."""
    from matplotlib.image import imread

    figure = heatmap_figure(inspection)
    path = save_figure(figure, tmp_path / name, tight=False)
    pixels = np.rint(imread(path)[..., :3] * 255).astype(int)
    assert pixels.shape[:2] == png_size(path)[::-1]
    return figure, pixels


def heatmaps(figure, inspection: Inspection) -> np.ndarray:
    """The (layers, heads) grid of heatmap axes (the colour bar's axis comes after them)."""
    count = len(inspection.layers) * len(inspection.heads)
    return np.array(figure.axes[:count], dtype=object).reshape(len(inspection.layers), len(inspection.heads))


def pixel(pixels: np.ndarray, axis, x: float, y: float) -> tuple[int, int, int]:
    """The PNG's (r, g, b) at data point (x, y) of ``axis`` (the figure is drawn at PNG_DPI, so display
    coordinates are the PNG's pixels, counted from the bottom)."""
    dx, dy = axis.transData.transform((x, y))
    row, col = int(pixels.shape[0] - dy), int(dx)
    r, g, b = pixels[row, col]
    return int(r), int(g), int(b)


def assert_close(got, want, where=""):
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOLERANCE, f"{where}: {got} != {want}"


def colour_bar(figure):
    """The one axis labelled with the scale (the colour bar's)."""
    bars = [axis for axis in figure.axes if axis.get_ylabel() == WEIGHT_SCALE_LABEL]
    assert len(bars) == 1
    return bars[0]


def causal_inspection() -> Inspection:
    """The synthetic inspection as a decoder's: weights 0 above the diagonal (rows renormalised), causal."""
    weights = torch.tril(synthetic_weights(len(TOKENS), 0))
    weights = weights / weights.sum(-1, keepdim=True)
    return dataclasses.replace(synthetic_inspection(), weights=weights, part="decoder", causal=True)


def pruned_inspection() -> Inspection:
    """Layer 5 lacks head 3 (pruned): its cell is all 0 and ``present`` says so."""
    weights = synthetic_weights(len(TOKENS), 0)
    weights[1, 1] = 0.0
    stats = weight_stats(
        [weights[0][None], weights[1][None][:, [0, 2]]],
        [TOKENS],
        layers=LAYERS,
        heads=HEADS,
        layer_heads=[HEADS, [0, 7]],
    )
    return dataclasses.replace(synthetic_inspection(), weights=weights, stats=stats, role_stats=stats)


def tick_texts(axis) -> tuple[list[str], list[str]]:
    return [t.get_text() for t in axis.get_xticklabels()], [t.get_text() for t in axis.get_yticklabels()]


# --------------------------------------------------------------------------- the scale


def test_the_colormap_gives_each_weight_its_weight_rgb():
    colormap, norm = weight_colours()
    for weight in [0.0, 1e-4, 0.003, 0.01, 0.05, 0.0625, 0.1, 0.2, 0.25, 0.4, 0.5, 0.5625, 0.7, 0.9, 0.999, 1.0]:
        rgb = tuple(round(channel * 255) for channel in colormap(norm(weight))[:3])
        assert_close(rgb, weight_rgb(weight), f"w={weight}")
    masked = colormap(norm(np.ma.masked_array([0.5], mask=[True])))[0][:3]
    assert tuple(round(channel * 255) for channel in masked) == MASKED_RGB


def test_every_cell_in_the_png_has_the_colour_of_its_weight(tmp_path):
    inspection = synthetic_inspection()
    figure, pixels = rendered(inspection, tmp_path)
    grid = heatmaps(figure, inspection)
    n = len(TOKENS)
    zeros = 0
    for r in range(len(LAYERS)):
        for c in range(len(HEADS)):
            weights = inspection.weights[r, c]
            for i in range(n):
                for j in range(n):
                    weight = float(weights[i, j])
                    zeros += weight == 0.0
                    assert_close(pixel(pixels, grid[r, c], j, i), weight_rgb(weight), f"L{r} H{c} ({i}, {j}) {weight}")
    assert zeros > 100  # the previous-token and [CLS] heads: weight 0 is drawn as weight 0, not as masked grey
    assert max(abs(a - b) for a, b in zip(weight_rgb(0.0), MASKED_RGB, strict=True)) > 20


def test_one_colour_bar_labelled_with_the_scale_and_its_ticks(tmp_path):
    inspection = synthetic_inspection()
    figure, pixels = rendered(inspection, tmp_path)
    bar = colour_bar(figure)
    np.testing.assert_allclose(bar.get_yticks(), WEIGHT_TICKS)
    assert [t.get_text() for t in bar.get_yticklabels()] == ["0", "0.05", "0.25", "0.5", "1"]
    heights = []
    for tick in (0.05, 0.25, 0.5, 0.8):  # the bar shows the same colours as the cells, on the square-root axis
        assert_close(pixel(pixels, bar, 0.5, tick), weight_rgb(tick), f"bar at {tick}")
        heights.append(bar.transData.transform((0.5, tick))[1])
    bottom, top = bar.transData.transform((0.5, 0.0))[1], bar.transData.transform((0.5, 1.0))[1]
    assert heights[1] - bottom == pytest.approx(0.5 * (top - bottom), abs=1.5)  # 0.25 halfway up: sqrt
    right = max(axis.get_window_extent().x1 for axis in heatmaps(figure, inspection).flat)
    assert bar.get_window_extent().x0 > right  # beside the grid, not over a head


def test_a_causal_part_draws_its_masked_cells_in_the_masked_grey(tmp_path):
    inspection = causal_inspection()
    figure, pixels = rendered(inspection, tmp_path)
    grid = heatmaps(figure, inspection)
    n = len(TOKENS)
    for r in range(len(LAYERS)):
        for c in range(len(HEADS)):
            for i in range(n):
                for j in range(n):
                    got = pixel(pixels, grid[r, c], j, i)
                    want = MASKED_RGB if j > i else weight_rgb(float(inspection.weights[r, c, i, j]))
                    assert_close(got, want, f"L{r} H{c} ({i}, {j})")
    title = figure._suptitle.get_text()
    assert title.split("\n")[-2:] == [PART_TITLES["decoder"], CAUSAL_NOTE]  # the notes on lines of their own
    assert "grey: masked, later tokens" in " ".join(title.split())


def test_a_pruned_head_is_an_empty_grey_cell(tmp_path):
    inspection = pruned_inspection()
    figure, pixels = rendered(inspection, tmp_path)
    grid = heatmaps(figure, inspection)
    cell = grid[1, 1]
    assert cell.get_title() == "L5 H3: pruned" and not cell.images
    grey = round(float(PRUNED_GREY) * 255)
    for i, j in [(0, 0), (4, 4), (8, 2)]:
        assert pixel(pixels, cell, j, i) == (grey, grey, grey)
    assert_close(pixel(pixels, grid[1, 2], 0, 3), weight_rgb(float(inspection.weights[1, 2, 3, 0])), "kept head")


# --------------------------------------------------------------------------- labels and layout


def test_the_grid_draws_every_head_with_its_role(monkeypatch, tmp_path):
    inspection = synthetic_inspection(corpus=True)
    drawn = {}

    def keep(figure, path, **options):  # look at the figure instead of saving it
        drawn.update(figure=figure, path=path, options=options)
        return path

    monkeypatch.setattr(plots, "save_figure", keep)
    assert heatmap_grid(inspection, str(tmp_path / "heads.png")) == tmp_path / "heads.png"
    grid = heatmaps(drawn["figure"], inspection)
    roles = inspection.role_stats.roles()
    for r, layer in enumerate(LAYERS):
        for c, head in enumerate(HEADS):
            axis = grid[r, c]
            assert axis.get_title() == f"L{layer} H{head}: {roles[r][c].label}"
            assert axis.title.get_fontsize() >= 9
            np.testing.assert_array_equal(axis.images[0].get_array(), inspection.weights[r, c].numpy())
    assert grid[0, 0].get_title() == "L2 H0: prev" and grid[1, 2].get_title() == "L5 H7: [CLS]"
    title = " ".join(drawn["figure"]._suptitle.get_text().split())  # the lines wrapped to the figure, joined
    assert f'"{TEXT}"' in title and "roles from bundled corpus (150 sentences)" in title
    assert drawn["figure"]._suptitle.get_fontsize() >= 9 and HEAD_TITLE_FONT >= 9


def test_every_token_labels_the_first_column_and_the_last_row(tmp_path):
    inspection = synthetic_inspection()
    figure, _ = rendered(inspection, tmp_path)
    grid = heatmaps(figure, inspection)
    for r in range(len(LAYERS)):
        for c in range(len(HEADS)):
            xs, ys = tick_texts(grid[r, c])
            assert ys == (TOKENS if c == 0 else [])  # query pieces down the first column
            assert xs == (TOKENS if r == len(LAYERS) - 1 else [])  # key pieces along the last row
    assert all(label.get_fontsize() == TOKEN_FONT >= 6 for label in grid[1, 0].get_xticklabels())
    assert "labelled" not in figure._suptitle.get_text()


@pytest.mark.parametrize("count, step", [(MAX_LABELS, 1), (60, 3)])
def test_many_tokens_are_thinned_to_every_kth_and_never_overlap(tmp_path, count, step):
    tokens = [f"tok{k}" for k in range(count)]
    inspection = synthetic_inspection(tokens=tokens, text=" ".join(tokens))
    figure, _ = rendered(inspection, tmp_path)
    grid = heatmaps(figure, inspection)
    xs, ys = tick_texts(grid[-1, 0])
    assert xs == ys == tokens[::step]
    assert list(grid[-1, 0].get_xticks()) == list(range(0, count, step))
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(figure).get_renderer()  # saving closed the figure; measure the text as drawn
    for labels, side in [(grid[-1, 0].get_xticklabels(), 0), (grid[-1, 0].get_yticklabels(), 1)]:
        boxes = sorted((label.get_window_extent(renderer) for label in labels), key=lambda box: box.min[side])
        for before, after in zip(boxes, boxes[1:], strict=False):
            assert after.min[side] >= before.max[side]  # side by side, none over another
    heading = " ".join(figure._suptitle.get_text().split())
    assert ("every 3rd token labelled" in heading) == (step == 3)
    assert cell_inches(count) > CELL_INCHES  # more tokens get larger heatmaps, up to MAX_CELL_INCHES


def test_cross_attention_labels_queries_and_keys_on_their_own_axes(tmp_path):
    queries = ["<s>", "la", "banque", "</s>"]
    keys = [f"key{k}" for k in range(7)]
    weights = synthetic_weights(len(keys), 0)[:, :, : len(queries)]
    weights = weights / weights.sum(-1, keepdim=True)
    inspection = dataclasses.replace(
        synthetic_inspection(),
        tokens=queries,
        key_tokens=keys,
        weights=weights,
        part="cross",
        pieces=None,
        key_pieces=None,
    )
    figure, pixels = rendered(inspection, tmp_path)
    grid = heatmaps(figure, inspection)
    assert tick_texts(grid[-1, 0]) == (keys, queries)
    assert_close(pixel(pixels, grid[0, 1], 6, 3), weight_rgb(float(weights[0, 1, 3, 6])), "cross cell")
    title = " ".join(figure._suptitle.get_text().split())
    assert "rows: decoder input, columns: source text" in title
    assert figure._suptitle.get_text().split("\n")[-1] == PART_TITLES["cross"]


def test_a_long_token_is_clipped_in_its_label(tmp_path):
    tokens = ["[CLS]", "supercalifragilisticexpialidocious", "[SEP]"]
    figure, _ = rendered(synthetic_inspection(tokens=tokens, text=tokens[1]), tmp_path)
    assert tick_texts(figure.axes[0])[1] == ["[CLS]", "supercalifr...", "[SEP]"]


def test_the_grid_is_a_png_of_square_heatmaps_sized_by_the_heads(tmp_path):
    inspection = synthetic_inspection()
    path = heatmap_grid(inspection, tmp_path / "deeper" / "heads.png")  # the folder is made
    figure = heatmap_figure(inspection)
    width, height = figure.get_size_inches()
    assert png_size(path) == (int(width * PNG_DPI), int(height * PNG_DPI))
    figure, pixels = rendered(inspection, tmp_path)
    boxes = [axis.get_window_extent() for axis in heatmaps(figure, inspection).flat]
    for box in boxes:  # every heatmap a square of about CELL_INCHES, inside the figure
        assert box.width == pytest.approx(box.height, abs=1)
        assert box.width / PNG_DPI == pytest.approx(CELL_INCHES, rel=0.08)
        assert 0 <= box.x0 and box.x1 <= pixels.shape[1] and 0 <= box.y0 and box.y1 <= pixels.shape[0]
    for k, box in enumerate(boxes):
        assert not any(box.overlaps(other) for other in boxes[k + 1 :])
    title = figure._suptitle.get_window_extent()
    assert 0 <= title.x0 and title.x1 <= pixels.shape[1]  # the title is wrapped to the figure's width


def test_a_long_text_is_clipped_in_the_title(monkeypatch, tmp_path):
    drawn = {}
    monkeypatch.setattr(plots, "save_figure", lambda figure, path, **_: drawn.setdefault("figure", figure) and path)
    heatmap_grid(synthetic_inspection(text="word " * 40), tmp_path / "heads.png")
    title = " ".join(drawn["figure"]._suptitle.get_text().split())
    assert '"' + ("word " * 12)[:57] + '..."' in title


# --------------------------------------------------------------------------- without matplotlib


def test_without_matplotlib_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    with pytest.raises(MissingExtraError, match=r"the png report needs matplotlib.*pip install 'multihead\[plots\]'"):
        heatmap_grid(synthetic_inspection(), tmp_path / "heads.png")
    assert not (tmp_path / "heads.png").exists()
