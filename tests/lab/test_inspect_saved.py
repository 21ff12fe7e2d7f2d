"""What a checkpoint folder adds to inspecting its model, called from Python: saved_model_extras (a `multihead train`
checkpoint's part, probes and task), Inspection.head_columns and headreport.read_scores_folder."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from multihead._errors import InputError
from multihead.integrations import load_text_model
from multihead.lab.inspect import SavedModelExtras, inspect_text, saved_model_extras
from multihead.lab.inspect.behaviours import BEHAVIOURS_FILE
from multihead.lab.inspect.headreport import ScoresFolder, read_scores_folder, write_importance
from multihead.lab.inspect.html import render_html
from multihead.lab.inspect.importance import HeadImportance
from multihead.lab.models import Encoder, EncoderConfig
from multihead.lab.models.tasks import example_text
from multihead.lab.train.induction import InductionSettings, run_induction
from multihead.lab.train.reverse import ReverseSettings, run_reverse

# two updates of tiny models: the files and their reading are under test, not what the heads learn
INDUCTION = InductionSettings(
    layers=2, heads=2, hidden=16, vocab_size=8, half_length=4, min_half_length=2, batch=2, steps=2, log_every=2
)
REVERSE = ReverseSettings(heads=2, hidden=16, vocab_size=8, length=5, batch=2, steps=2, log_every=2, probe_size=4)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one thread is faster and immune to a busy machine."""


@pytest.fixture(scope="module")
def induction(tmp_path_factory):
    """(the run, its saved model folder) of a 2-layer, 2-head induction decoder."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = run_induction(INDUCTION)
    finally:
        torch.set_num_threads(saved)
    return run, run.save(tmp_path_factory.mktemp("induction") / "run")["model"]


@pytest.fixture(scope="module")
def reverse_folder(tmp_path_factory) -> Path:
    return run_reverse(REVERSE).save(tmp_path_factory.mktemp("reverse") / "run")["model"]


def damaged_copy(folder: Path, target: Path, **changes) -> Path:
    """A copy of the checkpoint ``folder``'s behaviours.json (alone) in ``target``, with ``changes`` made to it."""
    target.mkdir()
    data = json.loads((folder / BEHAVIOURS_FILE).read_text())
    data.update(changes)
    (target / BEHAVIOURS_FILE).write_text(json.dumps(data))
    return target


def test_an_induction_checkpoint_gives_its_part_probes_and_task(induction):
    run, folder = induction
    model = load_text_model(folder)
    extras = saved_model_extras(folder, model)
    assert isinstance(extras, SavedModelExtras) and extras.part == "self"
    assert extras.behaviours is not None and set(extras.behaviours) == {"prefix_matching", "copying"}
    for name, values in run.behaviours().items():  # (layers, heads) as the run measured them
        assert extras.behaviours[name].shape == (2, 2)
        torch.testing.assert_close(extras.behaviours[name], values.double())
    assert extras.task_text == example_text("induction", dataclasses.asdict(INDUCTION))
    assert extras.task_text.split()[0] == "<bos>" and len(extras.task_text.split()) == 2 * INDUCTION.half_length + 1
    # the probes as the HTML report's columns, over every layer and head
    columns = extras.probe_columns()
    assert set(columns) == {"prefix_matching (probe)", "copying (probe)"}
    assert columns["copying (probe)"] == run.behaviours()["copying"].tolist()
    # a part asked for explicitly is checked against the model's parts
    assert saved_model_extras(str(folder), model, "self").behaviours is not None
    with pytest.raises(ValueError) as raised:
        saved_model_extras(folder, model, "cross")
    assert raised.value.argument == "part" and "['self']" in str(raised.value)


def test_the_extras_inspect_the_checkpoint_and_become_report_columns(induction):
    _, folder = induction
    model = load_text_model(folder)
    extras = saved_model_extras(folder, model)
    inspection = inspect_text(
        model, extras.task_text, part=extras.part, behaviours=extras.behaviours, layers=[1], heads=[1, 0]
    )
    assert inspection.part == "self" and inspection.causal
    columns = extras.probe_columns()
    shown = inspection.head_columns(columns)  # rows: layers [1]; columns: heads [1, 0]
    assert shown == {name: [[grid[1][1], grid[1][0]]] for name, grid in columns.items()}
    assert inspection.head_columns({"t": torch.arange(4.0).view(2, 2)}) == {"t": [[3.0, 2.0]]}
    with pytest.raises(ValueError, match="columns: expected 'small': a \\(layers, heads\\) grid"):
        inspection.head_columns({"small": [[1.0, 2.0]]})


def test_a_reverse_checkpoint_shows_its_cross_attention(reverse_folder):
    model = load_text_model(reverse_folder)
    extras = saved_model_extras(reverse_folder, model)
    assert extras.part == "cross"  # the part its probes measured, without asking
    assert extras.behaviours is not None and set(extras.behaviours) == {"alignment"}
    assert extras.task_text == example_text("reverse", dataclasses.asdict(REVERSE))
    assert len(extras.task_text.split()) == REVERSE.length
    other = saved_model_extras(reverse_folder, model, "encoder")  # another part: no probes of it, the task still
    assert (other.part, other.behaviours, other.task_text) == ("encoder", None, extras.task_text)


def test_a_folder_without_probes_adds_nothing(tmp_path):
    model = Encoder(EncoderConfig(vocab_size=11, hidden_size=12, num_layers=1, num_heads=3, intermediate_size=7))
    assert saved_model_extras(None, model) == SavedModelExtras()
    assert saved_model_extras(tmp_path, model) == SavedModelExtras()
    # without probes the part is not resolved here: inspect_text checks it where it is used
    assert saved_model_extras(tmp_path, model, "cross") == SavedModelExtras(part="cross")
    assert SavedModelExtras().probe_columns() == {}


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"task": "sorting"}, "the task of a multihead train run (induction or reverse), got 'sorting'"),
        ({"settings": {"vocab_size": 8}}, "the settings of a multihead train induction run"),
        ({"behaviours": {"speed": [[1.0]]}}, "'speed'"),
    ],
)
def test_a_damaged_behaviours_file_is_one_error_naming_it(induction, tmp_path, changes, fragment):
    _, folder = induction
    model = load_text_model(folder)
    damaged = damaged_copy(folder, tmp_path / "damaged", **changes)
    with pytest.raises(InputError) as raised:
        saved_model_extras(damaged, model)
    assert isinstance(raised.value, ValueError) and raised.value.argument == BEHAVIOURS_FILE
    assert fragment in str(raised.value)


def test_read_scores_folder_sizes_the_columns_by_the_model(tmp_path):
    torch.manual_seed(0)
    model = Encoder(EncoderConfig(vocab_size=11, hidden_size=12, num_layers=2, num_heads=3, intermediate_size=7))
    scores = torch.tensor([[0.001, 0.002, 0.003], [0.004, 0.005, 0.006]], dtype=torch.float64)
    write_importance(HeadImportance(scores, "test"), tmp_path, source="test")
    folder = read_scores_folder(tmp_path, model)
    assert isinstance(folder, ScoresFolder) and folder.relations is None  # no syntax.json
    assert folder.columns == {"importance (1 - cos) x 1000": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]}
    model.prune_heads({1: [0]})  # a pruned model keeps its checkpoint's head numbers: the same grid reads
    assert read_scores_folder(tmp_path, model).columns == folder.columns
    other = Encoder(EncoderConfig(vocab_size=11, hidden_size=12, num_layers=1, num_heads=3, intermediate_size=7))
    with pytest.raises(ValueError, match="^--scores"):  # another model's scores, named as the caller says
        read_scores_folder(tmp_path, other, argument="--scores")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="^folder: expected a folder with importance.json or syntax.json"):
        read_scores_folder(empty, model)


def test_nan_probes_stay_nan_in_the_columns(induction, tmp_path):
    _, folder = induction
    model = load_text_model(folder)
    data = json.loads((folder / BEHAVIOURS_FILE).read_text())
    data["behaviours"]["copying"][0][1] = None  # a head the probe did not measure
    copy = tmp_path / "nan"
    copy.mkdir()
    (copy / BEHAVIOURS_FILE).write_text(json.dumps(data))
    extras = saved_model_extras(copy, model)
    assert extras.behaviours is not None and math.isnan(float(extras.behaviours["copying"][0, 1]))
    assert math.isnan(extras.probe_columns()["copying (probe)"][0][1])
    # a column cut to the shown heads has no NaN: JSON and the HTML report show the head's cell empty
    inspection = inspect_text(model, extras.task_text, behaviours=extras.behaviours)
    columns = inspection.head_columns(extras.probe_columns())
    assert columns["copying (probe)"][0][1] is None and columns["copying (probe)"][0][0] is not None
    assert "copying (probe)" in render_html(inspection, columns)
