"""``--threads N`` on every command that runs models: applied while the command runs, torch's count put back after
it however it ends, bad values refused in one line before anything runs (issue 47, row 18)."""

from __future__ import annotations

import importlib

import pytest
import torch

from multihead._errors import bad_argument
from multihead.cli import build_parser, main
from multihead.cli._shared import usable_cpus

# each command that runs models: its arguments (the required ones) and the function the command runs
COMMANDS = {
    "train": (["train", "induction"], "multihead.cli.train", "run_train"),
    "inspect": (["inspect", "a text"], "multihead.cli.inspect", "run_inspect"),
    "heads": (["heads", "importance"], "multihead.cli.heads", "run_heads"),
    "circuits patch": (
        ["circuits", "patch", "--model", "m", "--clean", "a", "--corrupt", "b", "--answer", "c", "--wrong", "d"],
        "multihead.cli.circuits",
        "run_patch",
    ),
    "circuits dla": (
        ["circuits", "dla", "--model", "m", "--text", "t", "--answer", "a", "--wrong", "b"],
        "multihead.cli.circuits",
        "run_dla",
    ),
    "circuits lens": (["circuits", "lens", "--model", "m", "--text", "t"], "multihead.cli.circuits", "run_lens"),
    "circuits detect": (["circuits", "detect", "--model", "m"], "multihead.cli.circuits", "run_detect"),
    "bench": (["bench"], "multihead.cli.bench", "run_bench"),
}
# the count a command runs with when --threads is not given: torch's own (None), or the command's
DEFAULTS = {"train": 1}
OUTSIDE = 3  # torch's count around the commands: none of them has it as its default


@pytest.fixture
def outside():
    """torch's count set to OUTSIDE for the test (any count may be set, whatever the CPUs), the suite's put back."""
    saved = torch.get_num_threads()
    torch.set_num_threads(OUTSIDE)
    yield
    torch.set_num_threads(saved)


def recording(monkeypatch, name: str, effect=None) -> list[int]:
    """Replace command ``name``'s run function by one that records torch's thread count (then does ``effect``)."""
    _, module, function = COMMANDS[name]
    seen: list[int] = []

    def run(args):
        seen.append(torch.get_num_threads())
        if effect is not None:
            effect()
        return 0

    monkeypatch.setattr(importlib.import_module(module), function, run)
    return seen


@pytest.mark.parametrize("name", COMMANDS)
def test_threads_are_applied_inside_the_command_and_put_back_after(name, outside, monkeypatch):
    seen = recording(monkeypatch, name)
    argv = COMMANDS[name][0]
    assert main([*argv, "--threads", "1"]) == 0
    assert seen == [1] and torch.get_num_threads() == OUTSIDE
    assert main(argv) == 0  # without --threads: the command's default, or torch's count as it was
    assert seen[-1] == DEFAULTS.get(name, OUTSIDE) and torch.get_num_threads() == OUTSIDE


def fail_as_a_user_mistake():
    raise bad_argument("--model", "a folder", "'m'", "pass one")


def fail_as_a_bug():
    raise RuntimeError("a bug")


def test_threads_are_put_back_when_the_command_fails(outside, monkeypatch, capsys):
    recording(monkeypatch, "inspect", fail_as_a_user_mistake)
    assert main(["inspect", "--threads", "1"]) == 2 and torch.get_num_threads() == OUTSIDE
    assert capsys.readouterr().err.startswith("multihead inspect: error: --model: expected a folder")
    recording(monkeypatch, "inspect", fail_as_a_bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["inspect", "--threads", "1"])
    assert torch.get_num_threads() == OUTSIDE


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "0",
            "--threads: expected a whole number from 1 to {cpus} (the CPUs this process may use), got 0. Fix: pass "
            "e.g. --threads 1",
        ),
        ("-2", "--threads: expected a whole number from 1 to {cpus}"),
        ("{too_many}", "got {too_many}. Fix: pass e.g. --threads 1"),
        ("two", "--threads: expected a whole number, got 'two'"),
        ("1.5", "--threads: expected a whole number, got '1.5'"),
    ],
)
@pytest.mark.parametrize("name", ["train", "inspect", "circuits detect", "bench"])
def test_bad_thread_counts_are_refused_in_one_line_before_the_command_runs(
    name, value, message, outside, monkeypatch, capsys
):
    seen = recording(monkeypatch, name)
    cpus = usable_cpus()
    value, message = (text.format(cpus=cpus, too_many=cpus + 1) for text in (value, message))
    code = None
    try:
        code = main([*COMMANDS[name][0], "--threads", value])
    except SystemExit as exit_:  # argparse's own errors exit from inside parse_args
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert seen == [] and torch.get_num_threads() == OUTSIDE


def test_a_real_training_run_computes_on_the_threads_asked(outside, monkeypatch, tmp_path):
    """End to end, in-process: `multihead train --threads 1` trains on one thread and leaves torch's count as it was."""
    from multihead.lab.train import induction

    real, seen = induction.run_induction, []

    def run_induction(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(induction, "run_induction", run_induction)
    argv = ["train", "induction", "--steps", "2", "--layers", "1", "--heads", "2", "--out", str(tmp_path / "run")]
    assert main([*argv, "--threads", "1"]) == 0
    assert seen == [1] and torch.get_num_threads() == OUTSIDE and (tmp_path / "run" / "model").is_dir()


def test_every_model_command_says_threads_in_its_help():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, (argv, _, _) in COMMANDS.items():
        command = commands[argv[0]]
        if argv[0] == "circuits":
            command = next(a for a in command._actions if a.dest == "mode").choices[argv[1]]
        text = " ".join(command.format_help().split())
        default = DEFAULTS.get(name, "torch's, one per core")
        assert "--threads N the CPU threads torch computes with" in text, name
        assert f"(default: {default})" in text, name
    assert "--threads" not in commands["cost"].format_help()  # cost runs no model
