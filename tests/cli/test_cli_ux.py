"""What the `multihead` command says about itself: --version, the py.typed marker it ships, and --model's help on
every command that has one."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.resources
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from multihead.cli import MODEL_HELP, build_parser, main
from multihead.lab.models.loading import SERVED_MODEL_TYPES

ROOT = Path(__file__).resolve().parents[2]


def test_version_prints_the_package_metadata_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out == f"multihead {importlib.metadata.version('multihead')}\n"
    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert declared is not None and out == f"multihead {declared[1]}\n"  # what pyproject.toml declares


def test_version_from_the_console_script():
    result = subprocess.run([sys.executable, "-m", "multihead.cli", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.strip() == f"multihead {importlib.metadata.version('multihead')}"


def test_py_typed_marker_is_in_the_package():
    marker = importlib.resources.files("multihead") / "py.typed"
    assert marker.is_file() and marker.read_text() == ""


def test_py_typed_ships_in_the_wheel(tmp_path):
    """A wheel built from the project (its pyproject.toml, README and src/, copied) holds multihead/py.typed."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build = f"from setuptools import build_meta; print(build_meta.build_wheel({str(wheels)!r}))"
    result = subprocess.run([sys.executable, "-c", build], cwd=tree, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    wheel = wheels / result.stdout.strip().splitlines()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    assert "multihead/py.typed" in names
    assert "multihead/cli/__init__.py" in names and "multihead/cli/inspect.py" in names  # the package, not a shell


def commands_with_model(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return {
        name: sub
        for name, sub in subparsers.choices.items()
        if any("--model" in action.option_strings for action in sub._actions)
    }


def test_every_command_with_model_says_which_checkpoints_it_accepts():
    commands = commands_with_model(build_parser())
    assert set(commands) >= {"inspect", "heads"}
    for name, sub in commands.items():
        (model,) = [action for action in sub._actions if "--model" in action.option_strings]
        assert model.help is not None and model.help.startswith(MODEL_HELP), name


@pytest.mark.parametrize("command", ["inspect", "heads"])
def test_model_help_names_our_encoder_and_transformers(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # argparse wraps help at COLUMNS, breaking words at hyphens
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for model_type in SERVED_MODEL_TYPES:  # what loads on our own encoder
        assert f'model_type "{model_type}"' in text
    assert "saved by `multihead heads prune`" in text and "multihead's own encoder" in text
    assert "any other Hugging Face model_type" in text and "pip install 'multihead[hf]'" in text
    assert "default: the bundled all-MiniLM-L6-v2" in text


# --------------------------------------------------------------------------- a reader that stops reading


def _with_stdout_closed(argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``multihead argv`` with stdout a pipe whose reader has gone before anything is printed (`| head` that
    read its lines, `less` quit): every write to stdout fails with EPIPE."""
    process = subprocess.Popen(
        [sys.executable, "-m", "multihead.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # the read end: the child has not printed yet (starting Python takes longer)
    stderr = process.stderr.read().decode()
    return subprocess.CompletedProcess(process.args, process.wait(timeout=120), None, stderr)


def test_inspect_writes_its_reports_when_stdout_is_closed(tmp_path):
    out = tmp_path / "report"
    result = _with_stdout_closed(["inspect", "--format", "terminal,html,json", "--layers", "0", "--out", str(out)])
    assert result.stderr == ""  # no traceback, no message: the reader chose to stop
    assert result.returncode == 0
    assert json.loads((out / "inspect.json").read_text())["layers"] == [0]
    assert (out / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_a_plain_print_to_a_closed_stdout_ends_quietly():
    result = _with_stdout_closed(["cost", "--embed-dim", "64", "--heads", "4", "--seq", "8", "--json"])
    assert (result.returncode, result.stderr) == (0, "")


# --------------------------------------------------------------------------- help that is true


def test_heads_help_names_no_model_and_bench_help_names_the_quick_files(capsys):
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    heads = " ".join(commands["heads"].format_help().split())
    assert "MiniLM's" not in heads and "Score a model's heads by ablation" in heads  # --model's default aside
    bench = " ".join(commands["bench"].format_help().split())
    assert "bench_quick.json and bench_quick.png with --quick" in bench


def test_the_license_file_is_the_mit_license_pyproject_declares():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n\nCopyright (c) 2026 The multihead authors\n")
    assert "Permission is hereby granted, free of charge" in text
    declared = re.search(r"^license = (.+)$", (ROOT / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert declared is not None and declared[1] == '"MIT"'
