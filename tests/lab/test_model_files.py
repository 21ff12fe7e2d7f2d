"""The files of a --model folder, whichever loader reads them (issue 31, rows 4, 7 and 10).

Row 4: a damaged weights or tokenizer file is one line naming the file and the fix, on our own encoder's path
and on the transformers path alike. Row 7: a BERT folder with pytorch_model.bin or vocab.txt (no safetensors, no
tokenizer.json) loads through transformers, and without transformers the error gives the commands that convert
it. Row 10: a Hub id given as --model says that multihead never downloads, and how to fetch it.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_checkpoints import save
from multihead._errors import InputError
from multihead.cli import main
from multihead.integrations import load_text_model
from multihead.integrations.transformers_models import TransformersModel
from multihead.lab.models import Encoder, load_encoder

FIX = "Fix: point --model at an intact checkpoint folder (download or save it again)"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: save(name, root / name) for name in ("bert", "gpt2")}


def copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def truncate(path: Path, size: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:size])


def one_line_error(capsys, folder: Path | str) -> str:
    """`multihead inspect --model folder` exits 2 with one line on stderr and no traceback; the line."""
    code = main(["inspect", "The bank.", "--model", str(folder), "--format", "terminal"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


# --------------------------------------------------------------------- row 4: damaged files, every loader path


@pytest.mark.parametrize("name", ["bert", "gpt2"])  # bert: our own encoder reads it; gpt2: transformers
def test_a_truncated_model_safetensors_is_one_line_on_every_loader_path(name, folders, tmp_path, capsys):
    folder = copy(folders[name], tmp_path / name)
    truncate(folder / "model.safetensors")
    weights = str(folder / "model.safetensors")
    line = one_line_error(capsys, folder)
    assert line.startswith("multihead inspect: error: --model model.safetensors: expected "), line
    assert f"got {weights!r}, which cannot be read (Error while deserializing header" in line and line.endswith(FIX)
    with pytest.raises(ValueError) as raised:  # the Python API: an InputError, catchable as ValueError
        load_text_model(folder)
    assert isinstance(raised.value, InputError)
    assert str(raised.value).startswith("model.safetensors: expected ") and weights in str(raised.value)


def test_other_damaged_files_of_a_transformers_checkpoint_are_named(folders, tmp_path, capsys):
    tokenizer = copy(folders["gpt2"], tmp_path / "tokenizer")
    truncate(tokenizer / "tokenizer.json", 200)
    line = one_line_error(capsys, tokenizer)
    assert "--model tokenizer.json: expected a tokenizer file" in line and "which cannot be read" in line
    settings = copy(folders["gpt2"], tmp_path / "settings")
    truncate(settings / "tokenizer_config.json", 20)
    assert "--model tokenizer_config.json: expected" in one_line_error(capsys, settings)
    pickled = copy(folders["gpt2"], tmp_path / "pickled")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"not a pickle" * 100)
    line = one_line_error(capsys, pickled)
    assert "--model pytorch_model.bin: expected a weights file" in line and line.endswith(FIX)


@pytest.mark.parametrize("name", ["bert", "gpt2"])  # bert: our own encoder reads it; gpt2: transformers
def test_a_config_that_does_not_match_the_weights_is_one_line_naming_the_first_mismatch(
    name, folders, tmp_path, capsys
):
    """A config.json whose sizes are not the weights': transformers raised pointing at a report it logged (one we
    silence), and the line said the weights file cannot be read. Now one line names the first tensor of another
    shape, both shapes, and how many differ."""
    import json

    folder = copy(folders[name], tmp_path / name)
    config = json.loads((folder / "config.json").read_text())
    size = "hidden_size" if "hidden_size" in config else "n_embd"
    config[size] *= 2
    config["intermediate_size" if name == "bert" else "n_inner"] = 4 * config[size]
    (folder / "config.json").write_text(json.dumps(config))
    line = one_line_error(capsys, folder)
    assert "which cannot be read" not in line, line
    if name == "gpt2":
        assert re.search(r"got \d+ of another shape \(first: '[\w.]+' of shape \([\d, ]+\) in the weights", line), line
        assert "from config.json)" in line and "Fix: check that config.json belongs to these weights" in line
    else:
        assert re.search(r"expected '[\w.]+' of shape \(\d+, \d+\) \(from config.json's sizes\)", line), line


# --------------------------------------------------------------- row 7: BERT in the formats transformers reads


def bert_with_bin(source: Path, target: Path) -> Path:
    """The BERT checkpoint with pytorch_model.bin instead of model.safetensors (as older checkpoints are)."""
    folder = copy(source, target)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


def bert_with_vocab(source: Path, target: Path) -> Path:
    """The BERT checkpoint with vocab.txt instead of tokenizer.json."""
    import transformers

    folder = copy(source, target)
    vocab = transformers.AutoTokenizer.from_pretrained(folder).get_vocab()
    (folder / "vocab.txt").write_text("".join(f"{piece}\n" for piece in sorted(vocab, key=vocab.__getitem__)))
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").write_text('{"do_lower_case": true}')
    return folder


@pytest.mark.parametrize("make", [bert_with_bin, bert_with_vocab])
def test_a_bert_folder_in_another_format_loads_through_transformers(make, folders, tmp_path, capsys):
    folder = make(folders["bert"], tmp_path / "bert")
    model = load_text_model(folder)
    assert isinstance(model, TransformersModel)
    assert model.tokenizer.tokenize("The bank was full of money.")[:3] == ["[CLS]", "the", "bank"]
    assert main(["inspect", "The bank was full of money.", "--model", str(folder), "--format", "terminal"]) == 0
    assert "bank" in capsys.readouterr().out


def hide_transformers(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "multihead.integrations.transformers_models")  # imported again: it fails
    monkeypatch.setitem(sys.modules, "transformers", None)


def run_fix(line: str) -> None:
    """Run the `python -c "..."` commands the error's fix gives (in this process: they need no transformers)."""
    commands = line.partition("convert once: ")[2].split(" && ")
    assert commands and all(command.startswith('python -c "') for command in commands), line
    for command in commands:
        exec(command.removeprefix('python -c "').removesuffix('"'), {})


def test_without_transformers_a_bert_folder_in_another_format_says_how_to_convert(
    folders, tmp_path, capsys, monkeypatch
):
    folder = bert_with_vocab(bert_with_bin(folders["bert"], tmp_path / "bin"), tmp_path / "both")
    hide_transformers(monkeypatch)
    line = one_line_error(capsys, folder)
    assert "(safetensors format)" not in line
    assert "pytorch_model.bin instead of model.safetensors, vocab.txt instead of tokenizer.json" in line, line
    assert "Fix: install transformers (pip install 'multihead[hf]' reads pytorch_model.bin and vocab.txt)" in line
    # the Python API's own encoder says the same fix, naming the function that goes through transformers
    with pytest.raises(FileNotFoundError, match=r"Fix: load it with multihead\.integrations\.load_text_model"):
        load_encoder(folder)
    run_fix(line)  # the exact fix: after it, multihead's own encoder reads the folder
    model = load_text_model(folder)
    assert isinstance(model, Encoder)
    assert model.tokenizer.tokenize("The bank was full of money.")[:3] == ["[CLS]", "the", "bank"]


# ------------------------------------------------------------------------------- row 10: a Hub id as --model


@pytest.mark.parametrize(
    ("value", "local"), [("bert-base-uncased", "bert-base-uncased"), ("google-bert/bert-base-cased", "bert-base-cased")]
)
def test_a_hub_id_says_multihead_never_downloads_and_how_to_fetch_it(value, local, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    line = one_line_error(capsys, value)
    expected = (
        f"Fix: multihead never downloads: fetch it first (`hf download {value} --local-dir {local}`), "
        f"then pass the folder ({local})"
    )
    assert line.endswith(expected) and "does not exist" not in line, line
    with pytest.raises(FileNotFoundError, match=re.escape(expected)):
        load_text_model(value)


def test_a_missing_path_that_is_no_hub_id_still_says_it_does_not_exist(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # runs/last reads as a path under a local folder, not owner/name
    for value in ("runs/last", str(tmp_path / "nowhere"), "./model"):
        line = one_line_error(capsys, value)
        assert "which does not exist" in line and "never downloads" not in line, line
