"""The files of a --model folder, whichever loader reads them (issue 31, rows 4, 7 and 10).

Row 4: a damaged weights or tokenizer file is one line naming the file and the fix, on our own encoder's path
and on the transformers path alike. Row 7: a BERT folder with pytorch_model.bin or vocab.txt (no safetensors, no
tokenizer.json) loads through transformers, and without transformers the error gives the commands that convert
it. Row 10: a Hub id given as --model says that multihead never downloads, and how to fetch it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from hf_checkpoints import save
from multihead._errors import InputError
from multihead.cli import main
from multihead.integrations import load_text_model

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
