"""Titles fit: a PNG's title inside its figure (wrapped to the room it has, measured with matplotlib's renderer by
``multihead._figures.fitted_title``), and a terminal table's title above the table at the console's width, not
squeezed into the table's own (``multihead._titled_table.TitledTable``), for a model with few heads."""

from __future__ import annotations

import io
import json

import pytest
import transformers
from rich import box
from rich.console import Console
from rich.text import Text

import hf_checkpoints
from multihead._figures import fitted_title, pyplot, save_figure
from multihead._titled_table import TitledTable
from multihead.cli import main
from multihead.lab.inspect import headreport
from multihead.lab.train.induction import InductionSettings, run_induction


def extent_inside(figure, artist) -> tuple[bool, str]:
    """Whether ``artist``'s drawn extent lies inside ``figure`` (its renderer, after saving), and both boxes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(figure).get_renderer()  # saving closed the figure; measure the text as drawn
    box, bounds = artist.get_window_extent(renderer), figure.bbox
    inside = bounds.x0 <= box.x0 and box.x1 <= bounds.x1 and bounds.y0 <= box.y0 and box.y1 <= bounds.y1
    return inside, f"title {box} in figure {bounds}"


def test_the_importance_png_title_of_a_model_with_few_heads_fits_in_the_figure(tmp_path, monkeypatch, capsys):
    run = run_induction(InductionSettings(layers=1, heads=2, steps=2, log_every=1, probe_size=4)).save(tmp_path)
    saved = []

    def keep(figure, path, **options):  # save as the command does, then keep the figure to measure
        saved.append(figure)
        return save_figure(figure, path, **options)

    monkeypatch.setattr(headreport, "save_figure", keep)
    out = tmp_path / "heads"
    assert main(["heads", "importance", "--model", str(run["model"]), "--out", str(out)]) == 0
    capsys.readouterr()
    (figure,) = saved
    (axes, _bar) = figure.axes
    inside, boxes = extent_inside(figure, axes.title)
    assert inside, boxes
    metric = json.loads((out / "importance.json").read_text())["metric"]
    assert " ".join(axes.get_title().split()) == f"head importance: {metric}"  # wrapped, nothing left out
    assert len(axes.get_title().split("\n")) > 1  # the long metric of a task's probe needs the room of two lines


@pytest.mark.parametrize("width", [5.0, 9.0])
def test_titles_of_side_by_side_axes_and_the_figure_fit_without_meeting(tmp_path, width):
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(width, 4))
    for axes in (left, right):
        axes.imshow([[0.0, 1.0], [1.0, 0.0]], aspect="auto")  # as the package draws its heatmaps
        figure.colorbar(axes.images[0], ax=axes, label="score")
    words = "a title that is much longer than the half of the figure its axes stand in, " * 2
    titles = [fitted_title(left, words + "left"), fitted_title(right, words + "right", fontsize=8)]
    titles.append(fitted_title(figure, "a_single_word_far_wider_than_any_line_of_the_figure_" * 3))
    save_figure(figure, tmp_path / "two.png")
    for title in titles:
        inside, boxes = extent_inside(figure, title)
        assert inside, boxes
    assert titles[0].get_window_extent().x1 < titles[1].get_window_extent().x0  # the two never meet
    assert titles[2].get_text().replace("\n", "") == "a_single_word_far_wider_than_any_line_of_the_figure_" * 3


def two_head_gpt2(folder):
    """A tiny transformers GPT-2 of 2 layers x 2 heads, saved as a user's checkpoint folder is."""
    model, tokenizer = hf_checkpoints.build("gpt2")
    model.config.n_head = 2
    transformers.GPT2LMHeadModel(model.config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_importance_table_title_of_a_two_head_model_is_printed_at_80_columns(tmp_path, monkeypatch, capsys):
    folder = two_head_gpt2(tmp_path / "gpt2")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("The bank was full of money.\nShe sat on the bank of the river.\n")
    monkeypatch.setenv("COLUMNS", "80")
    capsys.readouterr()
    assert main(["heads", "importance", "--model", str(folder), "--corpus", "corpus.txt", "--out", "heads"]) == 0
    lines = capsys.readouterr().out.strip("\n").splitlines()
    header = next(index for index, line in enumerate(lines) if line.split() == ["L", "h0", "h1"])
    title = [line.rstrip() for line in lines[:header] if line.strip()]
    expected = "Ablation importance over corpus.txt: (1 - mean cosine) x 1000 when the head is zero-ablated"
    assert len(title) <= 2 and all(len(line) <= 80 for line in title), title
    assert " ".join(title) == expected  # wrapped between words, nothing cut


def test_a_titled_table_prints_its_title_and_caption_at_the_console_width():
    table = TitledTable(
        title=Text("the [b] title " * 5), caption="its caption " * 7, box=box.SIMPLE_HEAD
    )  # Text: no markup
    table.add_column("h0")
    table.add_row("1.0")
    console = Console(width=40, record=True, file=io.StringIO(), color_system=None)
    console.print(table)
    lines = [line.rstrip() for line in console.export_text().splitlines()]
    assert lines[:2] == ["the [b] title the [b] title the [b]", "title the [b] title the [b] title"]
    assert lines[-3:] == ["its caption its caption its caption its", "caption its caption its caption its", "caption"]
    assert [line.split() for line in lines[2:-3] if line.strip(" ─")] == [["h0"], ["1.0"]]
