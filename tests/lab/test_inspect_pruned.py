"""A model saved by `multihead heads prune` inspects with no --heads: layers with different head counts, every
head named by its checkpoint number (Encoder.head_ids), a pruned head shown as pruned, never renumbered.

all-MiniLM-L6-v2 is pruned by the command line (layer 2 loses heads 0 and 5, layer 4 head 3, layer 5 heads 2
and 11), saved and loaded back. Pruning a head equals zero-ablating it, so every kept head's weights equal
those of the unpruned model with the same heads zero-ablated; in layers 0-2, before any output changed, they
equal the unpruned model's own weights.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from multihead.cli import main
from multihead.lab.inspect import capture
from multihead.lab.inspect.html import render_html
from multihead.lab.inspect.importance import ablated, ablation_importance, gradient_importance, pruning_order
from multihead.lab.inspect.inspection import inspect_text
from multihead.lab.inspect.stats import head_grid, head_stats
from multihead.lab.inspect.syntax import bundled_treebank, syntax_scores
from multihead.lab.inspect.terminal import attention_table, role_grid, strongest_links
from multihead.lab.models import load_minilm
from test_inspect_html import browser, open_report, page_data, read_bars  # noqa: F401 (fixtures)

TEXT = "The bank was full of money."
REMOVED = {2: [0, 5], 4: [3], 5: [2, 11]}
SPEC = "2:0,5;4:3;5:2,11"
PRUNED_CELLS = sorted((layer, head) for layer, heads in REMOVED.items() for head in heads)
FIRST_PRUNED = min(REMOVED)  # layers up to this one see the same inputs as in the unpruned model


def no_constants(text: str) -> dict:
    """json.loads that refuses NaN and Infinity (Python's json would read them)."""

    def refuse(name):
        raise AssertionError(f"{name} in the JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The folder `multihead heads prune --remove ...` saved the pruned model to."""
    out = tmp_path_factory.mktemp("heads")
    assert main(["heads", "prune", "--remove", SPEC, "--out", str(out)]) == 0
    return out / "model"


@pytest.fixture(scope="module")
def pruned(saved):
    model, _ = load_minilm(saved)
    assert model.head_ids == [[h for h in range(12) if h not in REMOVED.get(layer, [])] for layer in range(6)]
    return model


@pytest.fixture(scope="module")
def inspection(pruned):
    return inspect_text(pruned, TEXT, token="bank")


def ablated_weights(minilm) -> list[torch.Tensor]:
    """The unpruned model's (heads, n, n) weights of every layer, with the pruned heads zero-ablated."""
    with ablated(minilm, REMOVED), torch.no_grad(), capture(minilm) as rec:
        minilm.encode(TEXT)
    return [rec.weights(layer)[0] for layer in range(6)]


# --------------------------------------------------------------------------- the Inspection


def test_every_kept_head_is_recorded_by_its_checkpoint_number(minilm, pruned, inspection):
    assert (inspection.layers, inspection.heads) == (list(range(6)), list(range(12)))
    assert inspection.pruned and inspection.layer_heads == pruned.head_ids
    expected = torch.ones(6, 12, dtype=torch.bool)
    for layer, head in PRUNED_CELLS:
        expected[layer, head] = False
    assert torch.equal(inspection.present, expected)
    assert torch.count_nonzero(inspection.weights[~expected]) == 0  # the pruned cells are empty
    unpruned = inspect_text(minilm, TEXT, token="bank")
    reference = ablated_weights(minilm)
    for layer, heads in enumerate(pruned.head_ids):
        for head in heads:
            shown = inspection.head_weights(layer, head)
            torch.testing.assert_close(shown, reference[layer][head], atol=1e-5, rtol=0)
            if layer <= FIRST_PRUNED:  # pruning other heads does not change a head's own attention
                torch.testing.assert_close(shown, unpruned.head_weights(layer, head), atol=1e-5, rtol=0)
    # after the first pruned layer the inputs differ, so the weights do
    assert (inspection.head_weights(3, 0) - unpruned.head_weights(3, 0)).abs().max() > 1e-3


def test_a_pruned_head_is_refused_by_name_not_renumbered(inspection):
    with pytest.raises(
        ValueError, match=r"head: expected one of layer 2's heads \[1, 2, 3, 4, 6, .*got 5, which was pruned"
    ):
        inspection.head_weights(2, 5)
    with pytest.raises(ValueError, match="pruned from layer 5"):
        inspection.top_attended(5, 11)
    with pytest.raises(ValueError, match="pruned from layer 4"):
        inspection.stats.stat(4, 3)
    roles = inspection.role_stats.roles()
    assert [(layer, head) for layer in range(6) for head in range(12) if roles[layer][head].label == "pruned"] == (
        PRUNED_CELLS
    )
    assert roles[2][5].summary == "head 5 was pruned from layer 2"


def test_to_dict_lists_each_layers_heads_and_empties_pruned_cells(pruned, inspection):
    data = no_constants(json.dumps(inspection.to_dict(), allow_nan=False))
    assert data["heads"] == list(range(12)) and data["layer_heads"] == pruned.head_ids
    assert data["text_stats"]["layer_heads"] == pruned.head_ids
    for layer in range(6):
        for head in range(12):
            cells = [data[key][layer][head] for key in ("weights", "top_attended", "most_attended")]
            stat = data["text_stats"]["stats"][layer][head]
            if (layer, head) in PRUNED_CELLS:
                assert cells == [[], [], []] and stat is None and data["text_stats"]["patterns"][layer][head] is None
                assert data["roles"][layer][head]["label"] == "pruned"
            else:
                weights = torch.tensor(cells[0], dtype=torch.float64)
                torch.testing.assert_close(weights, inspection.head_weights(layer, head).double(), atol=1e-6, rtol=0)
                assert cells[1][0]["index"] == inspection.top_attended(layer, head)[0][1]
                assert set(stat) >= {"entropy", "cls"}


def test_an_unpruned_inspection_keeps_its_schema(minilm):
    data = inspect_text(minilm, TEXT, layers=[0, 1], heads=[2, 9]).to_dict()
    assert "layer_heads" not in data and "layer_heads" not in data["text_stats"]
    assert torch.tensor(data["weights"]).shape == (2, 2, 9, 9)


# --------------------------------------------------------------------------- choosing heads


def test_heads_are_checkpoint_numbers_and_a_head_no_layer_has_is_an_error(pruned):
    chosen = inspect_text(pruned, TEXT, layers=[1, 2], heads=[5, 1])
    assert (chosen.heads, chosen.layer_heads) == ([5, 1], [[5, 1], [1]])
    torch.testing.assert_close(chosen.head_weights(2, 1), inspect_text(pruned, TEXT).head_weights(2, 1))
    assert chosen.role_stats.roles()[1][0].label == "pruned"
    only = inspect_text(pruned, TEXT, layers=[2])  # one layer: its own heads, no pruned cell
    assert only.heads == [1, 2, 3, 4, 6, 7, 8, 9, 10, 11] and not only.pruned
    with pytest.raises(
        ValueError, match=r"heads: expected heads that a chosen layer still has .* got 0, pruned from layer 2"
    ):
        inspect_text(pruned, TEXT, layers=[2], heads=[0])
    with pytest.raises(ValueError, match=r"heads: expected head indices in 0\.\.11 \(or -12\.\.-1, .*\), got 12"):
        inspect_text(pruned, TEXT, heads=[12])
    with pytest.raises(ValueError, match="heads: expected each head once"):
        inspect_text(pruned, TEXT, heads=[1, 1])
    grid = head_grid(pruned, layers=[4, 5], heads=[11, 10, 3])  # layer 4 lost head 3, layer 5 heads 2 and 11
    assert (grid.layer_heads, grid.positions) == ([[11, 10], [10, 3]], [[10, 9], [9, 2]])


# --------------------------------------------------------------------------- the command line


def test_inspect_a_pruned_save_in_every_format(saved, pruned, inspection, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["inspect", TEXT, "--model", str(saved), "--token", "bank", "--format", "terminal,html,png,json"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "6 layers x 12 heads (5 pruned) on 9 tokens" in printed and "pruned" in printed.split("Head roles")[1]
    assert (out / "heads.png").stat().st_size > 0
    data = no_constants((out / "inspect.json").read_text())
    assert data["layer_heads"] == pruned.head_ids
    assert data == json.loads(json.dumps(inspection.to_dict()))
    assert page_data((out / "report.html").read_text())["report"] == data
    # --heads names checkpoint heads: head 5 shows in layers 0, 1, 3, 4, 5 and is pruned in layer 2
    assert main([*argv[:-1], "json", "--heads", "5,6", "--out", str(out)]) == 0
    data = no_constants((out / "inspect.json").read_text())
    assert data["heads"] == [5, 6] and data["layer_heads"][2] == [6] and data["weights"][2][0] == []
    # a head pruned from every chosen layer is one line naming --heads
    assert main([*argv[:-1], "json", "--layers", "2", "--heads", "5", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--heads: expected heads that a chosen layer still has" in err
    assert "got 5, pruned from layer 2" in err


def test_terminal_tables_show_pruned_cells(inspection):
    import re

    from rich.console import Console

    console = Console(width=100, record=True)
    console.print(role_grid(inspection))  # rows heads, columns layers; cells two or more blanks apart
    rows = [re.split(r"\s{2,}", line.strip()) for line in console.export_text().splitlines()]
    cells = {
        (layer, int(row[0][1:]))
        for row in rows
        if re.fullmatch(r"h\d+", row[0])
        for layer, label in enumerate(row[1:])
        if label == "pruned"
    }
    assert sorted(cells) == PRUNED_CELLS
    console.print(attention_table(inspection))
    assert all((layer, head) not in PRUNED_CELLS for layer, head, *_ in strongest_links(inspection, count=72))


# --------------------------------------------------------------------------- the page, in the browser


def test_the_page_shows_pruned_heads_as_pruned(open_report, inspection):  # noqa: F811 (the fixture)
    data = inspection.to_dict()
    page = open_report(inspection, width=1400)
    pruned = page.eval_on_selector_all(
        "canvas.heatmap[data-pruned]", "cs => cs.map(c => [Number(c.dataset.layer), Number(c.dataset.head)])"
    )
    assert sorted(map(tuple, pruned)) == PRUNED_CELLS
    assert page.eval_on_selector_all(".head-cell.pruned .role-label", "ls => ls.map(l => l.textContent)") == (
        ["pruned"] * len(PRUNED_CELLS)
    )
    assert page.locator("#head-stats tbody tr").count() == 72 - len(PRUNED_CELLS)  # the heads each layer has
    page.select_option("#layer-select", "2")
    page.select_option("#head-select", "5")
    assert page.text_content("#bars-title") == "Head 5 was pruned from layer 2"
    assert read_bars(page) == []
    assert page.input_value("#head-select") == "5"
    assert "head 5 (pruned)" in page.eval_on_selector_all("#head-select option", "os => os.map(o => o.textContent)")
    page.select_option("#head-select", "6")  # the next head of layer 2 keeps its number
    page.click('.token[data-index="2"]')
    bars = read_bars(page)
    for (_, weight, _, _), expected in zip(bars, data["weights"][2][6][2], strict=True):
        assert abs(weight - expected) <= 1e-9
    torch.testing.assert_close(
        torch.tensor([weight for _, weight, _, _ in bars]), inspection.head_weights(2, 6)[2], atol=5e-7, rtol=0
    )


def test_a_page_whose_first_cell_is_pruned_opens_on_a_kept_head(open_report, pruned):  # noqa: F811
    chosen = inspect_text(pruned, TEXT, layers=[2, 3], heads=[0, 1])
    page = open_report(chosen)
    assert (page.input_value("#layer-select"), page.input_value("#head-select")) == ("2", "1")
    assert page_data(render_html(chosen))["report"]["weights"][0][0] == []
    assert len(read_bars(page)) == len(chosen.tokens)


# --------------------------------------------------------------------------- statistics, syntax, importance


def test_head_stats_of_a_pruned_model(minilm, pruned):
    texts = ["The bank was full of money.", "We sat on the river bank and watched the boats."]
    stats = head_stats(pruned, texts)
    assert stats.values["entropy"].shape == (6, 12) and stats.layer_heads == pruned.head_ids
    assert all(math.isnan(stats.values["entropy"][layer, head]) for layer, head in PRUNED_CELLS)
    assert not stats.values["entropy"][stats.present].isnan().any()
    unpruned = head_stats(minilm, texts, layers=list(range(FIRST_PRUNED + 1)))
    for layer in range(FIRST_PRUNED + 1):
        for head in pruned.head_ids[layer]:
            assert stats.stat(layer, head) == pytest.approx(unpruned.stat(layer, head), abs=1e-6)
    no_constants(json.dumps(stats.as_dict(), allow_nan=False))
    assert stats.roles()[5][11].label == "pruned"


def test_syntax_scores_of_a_pruned_model(pruned):
    scores = syntax_scores(pruned, bundled_treebank(), relations=["det", "nsubj"], max_sentences=40)
    assert scores.dependent_to_head["det"].shape == (6, 12) and scores.layer_heads == pruned.head_ids
    best = scores.per_head_best()
    assert all(math.isnan(best[layer, head]) for layer, head in PRUNED_CELLS)
    assert not best[head_grid(pruned).present].isnan().any()
    for row in scores.table():
        assert (row["layer"], row["head"]) not in PRUNED_CELLS
    data = no_constants(json.dumps(scores.as_dict(), allow_nan=False))
    assert data["layer_heads"] == pruned.head_ids and data["dependent_to_head"]["det"][2][0] is None


def test_importance_of_a_pruned_model_is_by_checkpoint_number(pruned):
    texts = ["The bank was full of money.", "We sat on the river bank.", "It rained all night."]
    importance = ablation_importance(pruned, texts, layers=[4, 5])
    assert importance.scores.shape == (6, 12)
    measured = {(layer, head) for layer, head, _ in importance.ranking()}
    assert measured == {(layer, head) for layer in (4, 5) for head in pruned.head_ids[layer]}
    reference = pruned.encode(texts, truncate=True)
    with ablated(pruned, {5: [pruned.head_ids[5].index(10)]}):  # layer 5's head 10 sits at position 9
        cosine = (pruned.encode(texts, truncate=True) * reference).sum(-1).mean()
    assert float(importance.scores[5, 10]) == pytest.approx(1 - float(cosine), abs=1e-6)

    def loss(model, batch):
        return model(batch.input_ids).pow(2).mean()

    batch = pruned.tokenizer.batch(texts)
    gradient = gradient_importance(pruned, loss, [batch])
    assert torch.equal(gradient.scores.isnan(), ~head_grid(pruned).present)
    order = pruning_order(gradient.scores, pruned.head_ids)
    assert all((layer, head) not in PRUNED_CELLS for layer, head in order)
    assert {head for layer, head in order if layer == 5} < set(pruned.head_ids[5])
