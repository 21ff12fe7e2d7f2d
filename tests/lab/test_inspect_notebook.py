"""What a REPL and a notebook show of the results: short reprs (not 48k characters of tensors), HTML grids
for statistics and importance, and the inspection's data for the page: role signals, relations and the
head similarity."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from multihead.lab.inspect import head_stats, inspect_text
from multihead.lab.inspect.importance import HeadImportance
from multihead.lab.inspect.roles import HeadRelation
from multihead.lab.models import load_minilm

TEXT = "The bank was full of money."


@pytest.fixture(scope="module")
def minilm():
    model, _ = load_minilm()
    return model


@pytest.fixture(scope="module")
def importance():
    scores = torch.arange(72, dtype=torch.float64).reshape(6, 12) / 1000
    scores[1, 3] = math.nan  # a pruned head
    return HeadImportance(scores, "1 - embedding cosine when the head is zero-ablated", texts=2)


@pytest.fixture(scope="module")
def inspection(minilm):
    return inspect_text(minilm, TEXT, token="bank")


def test_reprs_are_one_short_line(minilm, inspection, importance):
    shown = repr(inspection)
    assert "\n" not in shown and len(shown) < 300 and "tensor" not in shown
    assert shown.startswith("Inspection(model='all-MiniLM-L6-v2'") and "token 2 'bank'" in shown
    stats = head_stats(minilm, [TEXT, "It rained all day."])
    assert re.fullmatch(
        r"HeadStats\(6 layers x 12 heads on 2 texts \(\d+ tokens\); roles: .+; \d+ near-duplicate pairs?\)", repr(stats)
    )
    assert repr(importance) == (
        "HeadImportance(1 - embedding cosine when the head is zero-ablated, 6 layers x 12 heads on 2 texts; "
        "top: L5H11 0.071, L5H10 0.07, L5H9 0.069)"
    )


def test_statistics_and_importance_render_as_html_grids(minilm, importance):
    stats = head_stats(minilm, [TEXT])
    page = stats._repr_html_()
    assert page.startswith("<table") and page.count("<tr>") == 1 + 12  # header + a row per head
    assert "[CLS]" in page and "<script" not in page and "<style" not in page  # inline styles only
    role = stats.roles()[0][2]
    assert role.text.replace("\u00b7", "&middot;") in page or role.text in page
    grid = importance._repr_html_()
    layer, head, score = importance.ranking()[0]
    assert f"{score:.3g}" in grid and grid.count("<tr>") == 13
    assert grid.count(">pruned</td>") == 1


def test_the_data_carries_role_signals_and_the_similarity(inspection):
    data = json.loads(json.dumps(inspection.to_dict()))
    role = data["roles"][0][2]
    assert {"label", "pattern", "summary", "text", "strength", "confidence", "signals", "relation"} <= set(role)
    assert role["confidence"] in ("high", "medium", "low") and role["text"].startswith(role["label"])
    similarity = data["similarity"]
    assert similarity["source"] == "this text" and len(similarity["heads"]) == 72
    assert len(similarity["divergence"]) == 72 and sorted(similarity["order"]) == list(range(72))
    for pair in similarity["near_duplicates"]:
        a, b = similarity["heads"].index(pair["a"]), similarity["heads"].index(pair["b"])
        assert pair["divergence"] == similarity["divergence"][a][b] < similarity["threshold"]


def test_relations_from_syntax_scores_are_weighed_into_the_roles(minilm, inspection):
    relation = HeadRelation("nsubj", 0.9, 0.2)
    labelled = inspect_text(minilm, TEXT, token="bank", relations={(2, 8): relation})
    role = labelled.role_stats.roles()[2][8]
    assert (role.label, role.relation) == ("nsubj", relation)
    assert labelled.to_dict()["roles"][2][8]["relation"] == {
        "name": "nsubj",
        "score": 0.9,
        "baseline": 0.2,
        "direction": "dependent_to_head",
    }
    assert inspection.role_stats.roles()[2][8].relation is None  # the plain inspection is untouched


def test_one_layer_and_one_head_are_counted_in_the_singular(minilm):
    import io

    from rich.console import Console

    from multihead.lab.inspect.terminal import print_inspection

    single = inspect_text(minilm, TEXT, layers=[0], heads=[2], token="bank")
    assert "1 layer x 1 head, token" in repr(single) and "1 layers" not in repr(single)
    console = Console(width=100, file=io.StringIO(), color_system=None)
    print_inspection(single, console)
    assert console.file.getvalue().startswith("all-MiniLM-L6-v2: 1 layer x 1 head on 9 tokens")  # type: ignore[attr-defined]


def test_grids_set_their_own_alignment_whatever_the_notebook_stylesheet(minilm, importance):
    for page in (head_stats(minilm, [TEXT])._repr_html_(), importance._repr_html_()):
        cells = re.findall(r"<t[dh] style=\"([^\"]*)\"", page)
        assert cells and all("text-align:left" in style for style in cells)  # JupyterLab right-aligns cells
        assert page.startswith('<table style="border-collapse:collapse;margin:4px auto 4px 0">')  # and centres tables
