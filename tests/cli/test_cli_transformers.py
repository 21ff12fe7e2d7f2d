"""`multihead inspect` and `multihead heads` with --model pointing at any local transformers checkpoint."""

from __future__ import annotations

import json
import sys

import pytest

from hf_checkpoints import save
from multihead.cli import main
from multihead.integrations import load_text_model
from multihead.integrations.transformers_models import TransformersModel
from multihead.lab.models import Encoder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: save(name, root / name) for name in ("gpt2", "llama", "bert")}


def test_model_folders_go_to_the_loader_that_reads_them(folders):
    assert isinstance(load_text_model(folders["gpt2"]), TransformersModel)
    assert isinstance(load_text_model(folders["llama"]), TransformersModel)
    assert isinstance(load_text_model(folders["bert"]), Encoder)  # BERT-style: our own encoder reads it
    assert isinstance(load_text_model(None), Encoder)  # the bundled all-MiniLM-L6-v2


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_inspect_reports_a_decoder_checkpoint(name, folders, tmp_path, capsys):
    out = tmp_path / "report"
    code = main(
        ["inspect", "The bank was full of money.", "--model", str(folders[name]), "--token", "bank"]
        + ["--format", "terminal,json,html", "--out", str(out)]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert name in printed and "bank" in printed
    report = json.loads((out / "inspect.json").read_text())
    assert report["model"] == name and report["tokens"][report["token"]] == "bank"
    weights = report["weights"]  # (layers, heads, n, n): a decoder's token sees only itself and earlier ones
    assert len(weights) == 2 and len(weights[0]) == 4
    for row, weights_of_row in enumerate(weights[1][3]):
        assert all(weight == 0 for weight in weights_of_row[row + 1 :])
        assert abs(sum(weights_of_row) - 1) < 1e-4
    assert (out / "report.html").is_file()


def test_heads_importance_ranks_a_transformers_checkpoints_heads_by_ablation(folders, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The bank was full of money.\nShe sat on the bank of the river.\nMoney does not grow.\n")
    out = tmp_path / "heads"
    code = main(["heads", "importance", "--model", str(folders["gpt2"]), "--corpus", str(corpus), "--out", str(out)])
    assert code == 0
    assert "most important" in capsys.readouterr().out
    scores = json.loads((out / "importance.json").read_text())["scores"]
    assert len(scores) == 2 and all(len(row) == 4 and all(v is not None for v in row) for row in scores)


def test_pruning_a_transformers_checkpoint_is_one_line_saying_to_rank_by_ablation(folders, tmp_path, capsys):
    code = main(["heads", "prune", "--model", str(folders["gpt2"]), "--fraction", "0.2", "--out", str(tmp_path / "p")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--model: expected a model on multihead's own layer" in err and "heads importance" in err


def test_without_transformers_another_model_type_names_the_extra(folders, monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "multihead.integrations.transformers_models")  # imported again: it fails
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError):
        import transformers  # noqa: F401 - the block really hides it
    code = main(["inspect", "The bank.", "--model", str(folders["gpt2"]), "--format", "terminal"])
    assert code == 2
    err = capsys.readouterr().err
    assert "model_type 'gpt2' without transformers" in err and "pip install 'multihead[hf]'" in err


def test_a_transformers_without_an_internal_the_integration_needs_is_one_line(folders, monkeypatch, capsys):
    import importlib

    from multihead.integrations import TRANSFORMERS_TESTED

    masking_utils = importlib.import_module("transformers.masking_utils")  # the one the integration imports now
    monkeypatch.delattr(masking_utils, "sliding_window_bidirectional_overlay")  # as transformers 5.0 lacks it
    kept = "multihead.integrations.transformers_versions"  # the error's class: the one caught by name
    prefix = "multihead.integrations.transformers"
    for name in [name for name in sys.modules if name.startswith(prefix) and name != kept]:
        monkeypatch.delitem(sys.modules, name)  # imported again by --model: it fails, then is put back
    code = main(["inspect", "The bank.", "--model", str(folders["gpt2"]), "--format", "terminal"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    oldest, newest = TRANSFORMERS_TESTED
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("multihead inspect: error: --model transformers: expected a version")
    assert "masking_utils has no sliding_window_bidirectional_overlay" in err
    assert err.endswith(f"Fix: pip install 'transformers>={oldest},<={newest}'")
