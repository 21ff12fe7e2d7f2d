"""One convention for every command (issue 47, row 15), held here over each of them: a file written is the line
``wrote <absolute path> (<size>)``; stdout starts with its first line of content (no blank line); bare
``multihead`` is the help; a mistake is one line in the command line's words (no Python type names, no
``name=value`` of the library, no "in Python")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from multihead.cli import main

TEXT = "The bank was full of money."
TINY = ["--steps", "3", "--layers", "1", "--heads", "2", "--hidden", "16"]
WRITTEN = re.compile(r"wrote (?P<path>/.+?)(?: \((?P<size>[0-9.]+ (?:bytes|KiB|MiB|GiB))\))?$")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("conventions")
    assert main(["train", "induction", *TINY, "--out", str(root / "run")]) == 0
    (root / "long.txt").write_text(TEXT * 3, encoding="utf-8")
    (root / "corpus.txt").write_text("The cat sat.\nA dog ran home.\nBirds sing.\n", encoding="utf-8")
    return {"root": root, "model": root / "run" / "model", "long": root / "long.txt", "corpus": root / "corpus.txt"}


def commands(f: dict[str, Path]) -> dict[str, list[str]]:
    """A cheap run of every command (and mode) that writes files, with its --out."""
    model, out = str(f["model"]), str(f["root"] / "out")
    circuit = ["--model", model, "--out", out, "--format", "terminal,json,html"]
    return {
        "inspect": ["inspect", TEXT, "--format", "terminal,json,html", "--out", out],
        "inspect --long": ["inspect", "--long", str(f["long"]), "--format", "terminal,json", "--out", out],
        "heads syntax": ["heads", "syntax", "--max-sentences", "2", "--out", out],
        "heads importance": ["heads", "importance", "--corpus", str(f["corpus"]), "--out", out],
        "train induction": ["train", "induction", *TINY, "--out", out],
        "circuits patch": ["circuits", "patch", *circuit, "--clean", "a b c a", "--corrupt", "a b d a"]
        + ["--answer", "b", "--wrong", "d"],
        "circuits dla": ["circuits", "dla", *circuit, "--text", "a b c a", "--answer", "b", "--wrong", "d"],
        "circuits lens": ["circuits", "lens", *circuit, "--text", "a b c a", "--top", "2"],
        "circuits detect": ["circuits", "detect", *circuit, "--half-length", "4", "--batch", "2"],
        "cost": ["cost", "--embed-dim", "64", "--heads", "4", "--seq", "32", "--json"],
    }


NAMES = list(commands({"root": Path("r"), "model": Path("m"), "long": Path("l"), "corpus": Path("c")}))


@pytest.mark.parametrize("name", NAMES)
def test_every_command_names_its_files_one_way_and_starts_with_content(name, folders, capsys):
    assert main(commands(folders)[name]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines and lines[0].strip(), f"{name}: stdout starts with a blank line"
    for line in lines:
        if str(folders["root"] / "out") in line and not line.startswith("wrote "):  # a file of the run's
            assert "inspect it" in line or "model saved to" in line, f"{name}: a file not said as 'wrote': {line!r}"
        assert not re.match(r"\w+ report: /", line), f"{name}: {line!r}"
        written = WRITTEN.fullmatch(line)
        if written is not None:
            path = Path(written["path"])
            assert path.exists(), line
            assert path.is_dir() or written["size"] is not None, f"{name}: a file without its size: {line!r}"


def test_bare_multihead_is_the_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: multihead") and all(c in out for c in ("inspect", "heads", "train", "circuits"))


@pytest.mark.parametrize(
    "argv",
    [
        ["heads", "syntax", "--max-sentences", "0"],
        ["inspect", "word " * 600, "--format", "terminal"],
        ["inspect", "The bank by the bank", "--token", "bank:3", "--format", "terminal"],
        ["inspect", TEXT, "--heads", "x"],
        ["inspect", TEXT, "--model", "/nonexistent/model"],
        ["circuits", "lens", "--model", "/nonexistent", "--text", "a"],
        ["train", "induction", "--steps", "0"],
        ["cost", "--embed-dim", "0", "--heads", "4", "--seq", "32"],
    ],
)
def test_a_mistake_is_one_line_in_the_command_lines_words(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"multihead {argv[0]}: error: "), err
    assert not re.search(r"got (?:int|str|float|bool|NoneType) ", err), err
    assert not re.search(r"\b(?:an? )?positive int\b| or None\b", err), err
    assert not re.search(r"\b[a-z_]+=(?:True|\(|'|\")", err) and "in Python" not in err, err


def test_a_folder_without_any_model_is_not_called_a_bert_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("no model here", encoding="utf-8")
    assert main(["inspect", TEXT, "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "BERT" not in err and "Hugging Face checkpoint (config.json, weights, tokenizer files)" in err, err


def every_parser() -> list[tuple[str, object]]:
    """(name, parser) of every command and mode of `multihead`."""
    import argparse

    from multihead.cli import build_parser

    found, todo = [], [("multihead", build_parser())]
    while todo:
        name, parser = todo.pop()
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{name} {sub}", child) for sub, child in action.choices.items()]
    return found


def test_every_format_option_has_the_one_default():
    from multihead.cli._shared import DEFAULT_FORMATS

    formats = {
        name: action
        for name, parser in every_parser()
        for action in parser._actions
        if "--format" in action.option_strings
    }
    assert {"multihead inspect", "multihead circuits patch", "multihead circuits lens"} <= set(formats)
    for name, action in formats.items():
        assert action.default == DEFAULT_FORMATS, name
        assert f"(default {DEFAULT_FORMATS})" in action.help, name
