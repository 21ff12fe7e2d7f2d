"""Options that belong to one mode of a command are refused in another, in one line, before anything runs (issue
47, row 10: `heads importance --max-sentences 0` ran for minutes); an empty value is a value, never the default."""

from __future__ import annotations

import argparse
import re

import pytest

from multihead.cli import build_parser, main
from multihead.cli._shared import ModeOptions


def declared() -> dict[str, tuple[argparse.ArgumentParser, ModeOptions]]:
    """Each command that declares mode-bound options: its parser and its declaration."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    found = {}
    for name, parser in commands.items():
        modes = parser.get_default("mode_options")
        if modes is not None:
            found[name] = (parser, modes)
    return found


def misplaced() -> list[tuple[str, str, str, str]]:
    """(command, mode, option, value) for every mode-bound option in every mode it does not belong to."""
    cases = []
    for command, (parser, declaration) in declared().items():
        positional = next(a for a in parser._actions if a.dest in ("mode", "task"))
        for option, modes in declaration.modes.items():
            action = parser._option_string_actions[option]
            value = action.choices[-1] if action.choices else {int: "0", float: "0.5"}.get(action.type, "x")
            for mode in positional.choices:
                if mode not in modes:
                    cases.append((command, mode, option, value))
    return cases


def test_heads_and_train_declare_their_mode_bound_options():
    assert set(declared()) == {"heads", "train"}
    assert len(misplaced()) >= 12


@pytest.mark.parametrize(("command", "mode", "option", "value"), misplaced())
def test_an_option_of_another_mode_is_one_line_before_anything_runs(command, mode, option, value, capsys, tmp_path):
    argv = [command, mode, option, value, "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"multihead {command}: error: {option}: expected an option of `multihead {command} ")
    assert f"got `multihead {command} {mode} {option} {value}`" in captured.err
    assert f"Fix: leave out {option} (it applies to " in captured.err
    assert not (tmp_path / "out").exists()


def test_every_option_whose_help_names_its_modes_is_declared():
    """An option's help says "syntax: ..." for the modes it serves; the declaration must say the same."""
    for command, (parser, declaration) in declared().items():
        positional = next(a for a in parser._actions if a.dest in ("mode", "task"))
        for action in parser._actions:
            named = re.match(r"([a-z]+(?: and [a-z]+)?): ", action.help or "")
            if not action.option_strings or named is None:
                continue
            modes = tuple(named.group(1).split(" and "))
            if set(modes) <= set(positional.choices):
                assert declaration.modes.get(action.option_strings[0], ()) >= modes, (command, action.option_strings)


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["inspect", "The bank.", "--format", ""], "--format"),
        (["circuits", "detect", "--model", "x", "--format", ""], "--format"),
        (["heads", "importance", "--corpus", ""], "--corpus"),
        (["heads", "syntax", "--treebank", ""], "--treebank"),
    ],
)
def test_an_empty_value_is_refused_not_taken_for_the_default(argv, option, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {option}: expected" in err, err
