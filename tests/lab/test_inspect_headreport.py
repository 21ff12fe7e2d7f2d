"""multihead.lab.inspect.headreport: the tables and files of `multihead heads` (importance, pruning, syntax), and the
per-head columns they give the inspect HTML report."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
import torch
from rich.console import Console

from multihead._figures import written_line
from multihead.lab.inspect import headreport
from multihead.lab.inspect.importance import HeadImportance
from multihead.lab.inspect.syntax import Sentence, _score

SENTENCE = Sentence(["The", "dog", "barks", "loudly"], [2, 3, 0, 3], ["det", "nsubj", "root", "advmod"])


def cells(table) -> list[list[str]]:
    """The table's cell texts (rich markup kept), row by row."""
    columns = [list(column._cells) for column in table.columns]
    return [list(row) for row in zip(*columns, strict=True)]


def console() -> Console:
    return Console(width=200, file=io.StringIO(), record=True, color_system=None)


def importance() -> HeadImportance:
    scores = torch.tensor([[0.001, 0.004, float("nan"), 0.0002], [0.002, 0.0005, 0.003, 0.006]])
    return HeadImportance(scores, "1 - embedding cosine", {"nn_agreement": torch.ones(2, 4)}, texts=5)


def syntax_scores():
    """Layer 0 head 0 points every word at its syntactic head; head 1 looks at the word itself."""
    to_head = torch.zeros(4, 4)
    for word, head in enumerate(SENTENCE.heads):
        to_head[word, (head or word + 1) - 1] = 1.0
    attention = torch.stack([to_head, torch.eye(4)])[None]  # (layers 1, heads 2, W, W)
    return _score([attention], [SENTENCE], relations=["det", "nsubj", "advmod"])


# --------------------------------------------------------------------------- importance


def test_importance_reads_at_one_scale_in_the_table_the_ranking_and_the_png():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    scores = importance()
    assert cells(headreport.importance_table(scores.scores, "title"))[1][4] == "[bold red]6.0[/bold red]"
    assert headreport.ranked_line(scores, 2) == "L1H3 6.0, L0H1 4.0 (scores x 1000)"  # the table's numbers
    figure = headreport.importance_figure(scores)
    try:
        axis, bar = figure.axes
        assert float(axis.images[0].get_array().max()) == pytest.approx(6.0)  # not 0.006: the table's scale
        assert bar.get_ylabel() == "score x 1000"
    finally:
        plt.close(figure)


def test_importance_table_marks_the_five_most_important_and_shows_nan_as_a_dash():
    table = headreport.importance_table(importance().scores, "title")
    assert [column.header for column in table.columns] == ["L", "h0", "h1", "h2", "h3"]
    bold = "[bold red]{}[/bold red]".format
    assert cells(table) == [
        ["0", bold("1.0"), bold("4.0"), "-", "0.2"],
        ["1", bold("2.0"), "0.5", bold("3.0"), bold("6.0")],
    ]
    assert cells(headreport.importance_table(importance().scores, "title", scale=1.0))[0][2] == bold("0.0")


def test_write_importance_then_load_it_back(tmp_path):
    out = tmp_path / "heads"
    paths = headreport.write_importance(importance(), out, source="3 texts")
    assert paths == {"json": out / "importance.json", "png": out / "importance.png"}
    data = json.loads(paths["json"].read_text())
    assert data["scores"][0][2] is None and data["scores"][1][2] == pytest.approx(0.003)
    assert data["metric"] == "1 - embedding cosine" and data["source"] == "3 texts" and data["texts"] == 5
    assert data["nn_agreement"] == [[1.0] * 4] * 2
    ranked = [(row["layer"], row["head"]) for row in data["ranking"]]
    assert ranked == [(1, 3), (0, 1), (1, 2), (1, 0), (0, 0), (1, 1), (0, 3)]  # the unmeasured head left out
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for source in (out, paths["json"]):  # the folder or the file
        torch.testing.assert_close(headreport.load_importance(source), importance().scores, equal_nan=True)


def test_load_importance_refuses_another_models_scores_and_missing_files(tmp_path):
    headreport.write_importance(importance(), tmp_path, source="3 texts")
    with pytest.raises(
        ValueError, match=r"--importance: expected scores of a model with 6 layers x 12 heads, got 2 x 4"
    ):
        headreport.load_importance(tmp_path, argument="--importance", shape=(6, 12))
    with pytest.raises(FileNotFoundError, match="--importance: expected an importance.json"):
        headreport.load_importance(tmp_path / "elsewhere", argument="--importance")
    (tmp_path / "importance.json").write_text(json.dumps({"scores": [[1, "high"]]}))
    with pytest.raises(ValueError, match="--importance"):
        headreport.load_importance(tmp_path, argument="--importance")


# --------------------------------------------------------------------------- pruning curve

CURVE = [
    {"fraction": f, "heads_removed": r, "cosine": c, "min_cosine": c - 0.01, "nn_agreement": a, "seconds": 0.02,
     "attention_seconds": 0.01, "speedup": s, "attention_speedup": s + 0.1, "removed": [],
     "speedup_range": [s - 0.05, s + 0.05], "attention_speedup_range": [s - 0.02, s + 0.2], "repeats": 3}
    for f, r, c, a, s in [(0.0, 0, 1.0, 1.0, 1.0), (0.1, 7, 0.995, 1.0, 1.05), (0.2, 14, 0.97, 0.9, 1.1)]
]  # fmt: skip


def test_curve_table_and_the_most_heads_at_a_fidelity():
    rows = cells(headreport.curve_table(CURVE))
    assert rows[1] == ["7 (0.10)", "0.9950", "0.9850", "1.00", "20", "1.05 1.00-1.10", "1.15 1.03-1.25"]
    console = Console(width=80, record=True, color_system=None)
    console.print(headreport.curve_table(CURVE))
    lines = console.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80 and "…" not in "".join(lines)  # nothing cut at 80
    assert headreport.heads_at_fidelity(CURVE)["heads_removed"] == 7
    assert headreport.heads_at_fidelity(CURVE, threshold=0.96)["heads_removed"] == 14
    assert headreport.heads_at_fidelity(CURVE, threshold=1.5) is None


def test_a_slower_pruned_model_reads_slower_with_its_spread():
    """A loaded machine made a pruned model's attention slower: it read "0.79x faster"."""
    slower = {"attention_speedup": 0.79, "attention_speedup_range": [0.70, 0.85], "repeats": 3}
    assert headreport.speed_words(slower) == "1.27x slower (speed-up 0.70-0.85x over 3 paired runs)"
    noisy = {"attention_speedup": 1.04, "attention_speedup_range": [0.93, 1.20], "repeats": 1}
    assert headreport.speed_words(noisy) == "1.04x faster (speed-up 0.93-1.20x over 1 paired run; within the noise)"


def test_write_curve(tmp_path):
    paths = headreport.write_curve(CURVE, tmp_path)
    assert json.loads(paths["json"].read_text()) == CURVE
    assert paths["json"].name == "pruning.json" and paths["png"].read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------- syntax


def test_syntax_table_names_the_best_head_and_its_margin():
    rows = cells(headreport.syntax_table(syntax_scores()))
    assert [row[0] for row in rows] == ["det", "nsubj", "advmod"]
    det = rows[0]
    assert det[1:6] == ["1", "1.000 at +1", "L0 H0", "dependent -> head", "1.000"]
    assert det[6] == "+0.000"  # the offset baseline is as good on one sentence


def test_write_syntax_then_its_column_for_the_report(tmp_path):
    scores = syntax_scores()
    paths = headreport.write_syntax(scores, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["relations"] == ["det", "nsubj", "advmod"] and data["per_head_best"] == [[1.0, 0.0]]
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert headreport.report_columns(tmp_path) == {"best syntax score": [[1.0, 0.0]]}


def test_report_relations_name_each_heads_relation_from_syntax_json(tmp_path):
    headreport.write_syntax(syntax_scores(), tmp_path)
    path = tmp_path / "syntax.json"
    data = json.loads(path.read_text())
    assert headreport.report_relations(tmp_path, argument="--scores") == {}  # 1 sentence: too few dependents
    data["counts"] = {relation: 20 for relation in data["counts"]}  # as if over a treebank,
    data["baseline"]["nsubj"]["score"] = 0.5  # where a fixed offset finds nsubj half the time
    path.write_text(json.dumps(data))
    relations = headreport.report_relations(tmp_path, argument="--scores")
    assert set(relations) == {(0, 0)}  # head 1 looks at the word itself: no relation beats its offset baseline
    assert (relations[(0, 0)].name, relations[(0, 0)].score, relations[(0, 0)].margin) == ("nsubj", 1.0, 0.5)
    del data["head_to_dependent"][data["relations"][0]]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"--scores: expected a syntax.json .* with counts, baseline and scores"):
        headreport.report_relations(tmp_path, argument="--scores")
    path.unlink()
    assert headreport.report_relations(tmp_path, argument="--scores") is None


def test_report_columns_from_a_heads_folder(tmp_path):
    headreport.write_importance(importance(), tmp_path, source="3 texts")
    columns = headreport.report_columns(tmp_path, argument="--scores", shape=(2, 4))
    assert columns == {"importance (1 - cos) x 1000": [[1.0, 4.0, None, 0.2], [2.0, 0.5, 3.0, 6.0]]}
    with pytest.raises(ValueError, match=r"--scores: expected scores of a model with 6 layers x 12 heads"):
        headreport.report_columns(tmp_path, argument="--scores", shape=(6, 12))
    (tmp_path / "importance.json").unlink()
    with pytest.raises(ValueError, match=r"--scores: expected a folder with importance.json or syntax.json"):
        headreport.report_columns(tmp_path, argument="--scores")
    with pytest.raises(FileNotFoundError, match=r"--scores: expected a folder written by `multihead heads"):
        headreport.report_columns(tmp_path / "nowhere", argument="--scores")


# --------------------------------------------------------------------------- without matplotlib


def test_without_matplotlib_the_json_is_written_and_the_png_left_out_with_a_note(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    paths = headreport.write_importance(importance(), tmp_path, source="3 texts")
    assert list(paths) == ["json"] and not (tmp_path / "importance.png").exists()
    out = console()
    headreport.print_written(out, paths)
    assert out.export_text().splitlines() == [
        written_line(paths["json"]),
        "note: importance.png not drawn: matplotlib is not installed. Fix: pip install 'multihead[plots]' "
        "(or pip install matplotlib)",
    ]


def test_print_written_lists_every_file(tmp_path):
    out = console()
    headreport.print_written(out, headreport.write_curve(CURVE, tmp_path))
    assert out.export_text().splitlines() == [written_line(tmp_path / name) for name in ("pruning.json", "pruning.png")]


def test_nan_scores_never_reach_the_json_as_nan(tmp_path):
    broken = HeadImportance(torch.tensor([[math.nan, 0.1]]), "metric")
    data = json.loads(headreport.write_importance(broken, tmp_path, source="s")["json"].read_text())
    assert data["scores"] == [[None, pytest.approx(0.1)]]
