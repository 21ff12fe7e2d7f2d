"""multihead.inspect.plots: the PNG grid of every head's heatmap, and the clear error without matplotlib."""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest

import multihead.inspect.plots as plots
from multihead._figures import MissingExtraError
from multihead.cli import main
from multihead.inspect.plots import CELL_INCHES, heatmap_grid
from support_inspect import HEADS, LAYERS, TEXT, synthetic_inspection


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


def test_the_grid_draws_every_head_with_its_role(monkeypatch, tmp_path):
    inspection = synthetic_inspection(corpus=True)
    drawn = {}

    def keep(figure, path, **options):  # look at the figure instead of saving it
        drawn.update(figure=figure, path=path, options=options)
        return path

    monkeypatch.setattr(plots, "save_figure", keep)
    assert heatmap_grid(inspection, str(tmp_path / "heads.png")) == tmp_path / "heads.png"
    axes = np.array(drawn["figure"].axes[: len(LAYERS) * len(HEADS)]).reshape(len(LAYERS), len(HEADS))
    roles = inspection.role_stats.roles()
    for r, layer in enumerate(LAYERS):
        for c, head in enumerate(HEADS):
            axis = axes[r, c]
            assert axis.get_title() == f"L{layer} H{head}: {roles[r][c].label}"
            np.testing.assert_array_equal(axis.images[0].get_array(), inspection.weights[r, c].numpy())
    assert axes[0, 0].get_title() == "L2 H0: prev" and axes[1, 2].get_title() == "L5 H7: [CLS]"
    title = drawn["figure"]._suptitle.get_text()
    assert TEXT in title and "roles from bundled corpus (150 sentences)" in title


def test_the_grid_is_a_png_sized_by_the_heads(tmp_path):
    path = heatmap_grid(synthetic_inspection(), tmp_path / "deeper" / "heads.png")  # the folder is made
    width, height = png_size(path)
    assert width == int((len(HEADS) * CELL_INCHES + 0.6) * 110)
    assert height == int((len(LAYERS) * CELL_INCHES + 0.9) * 110)


def test_a_long_text_is_clipped_in_the_title(monkeypatch, tmp_path):
    drawn = {}
    monkeypatch.setattr(plots, "save_figure", lambda figure, path, **_: drawn.setdefault("figure", figure) and path)
    heatmap_grid(synthetic_inspection(text="word " * 40), tmp_path / "heads.png")
    assert '"' + ("word " * 12)[:57] + '..."' in drawn["figure"]._suptitle.get_text()


def test_without_matplotlib_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    with pytest.raises(MissingExtraError, match=r"the png report needs matplotlib.*pip install 'multihead\[plots\]'"):
        heatmap_grid(synthetic_inspection(), tmp_path / "heads.png")
    assert not (tmp_path / "heads.png").exists()


def test_inspect_format_png_without_matplotlib_is_one_line_before_any_work(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "report"
    assert main(["inspect", "The bank was full of money.", "--format", "html,png", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err == (
        "multihead inspect: error: --format: expected formats whose libraries are installed (png is drawn with "
        "matplotlib), got png, but matplotlib is not installed. Fix: pip install 'multihead[plots]' (or pip install "
        "matplotlib)\n"
    )
    assert not out.exists()  # refused before the model ran or a file was written
