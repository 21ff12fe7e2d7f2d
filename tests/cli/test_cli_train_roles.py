"""`multihead train`'s table labels every head as `multihead inspect` labels it on the checkpoint the run saved: one
rule, one threshold, one label (the role grid's cell: label, strength, "?" when the confidence is low)."""

from __future__ import annotations

import re

import pytest

from multihead.cli import main

TASKS = {
    "induction": ["--steps", "40", "--layers", "2", "--heads", "2"],
    "reverse": ["--steps", "30", "--layers", "1", "--heads", "2"],
}


def train_roles(printed: str) -> dict[str, str]:
    """The role column of train's table, by its head column ("L0H1")."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in printed.splitlines()]
    return {cells[0]: cells[-1] for cells in rows if re.fullmatch(r"L\d+H\d+", cells[0])}


def inspect_roles(printed: str) -> dict[str, str]:
    """The cells of inspect's role grid, by head ("L0H1"): rows h0, h1, ... under "head  layer 0  layer 1"."""
    lines = printed.split("Head roles")[1].split("prev/next/self")[0].splitlines()  # the grid, up to its legend
    layers = [int(number) for number in re.findall(r"layer (\d+)", next(line for line in lines if "layer" in line))]
    roles = {}
    for line in lines:
        cells = re.split(r"\s{2,}", line.strip())
        if re.fullmatch(r"h\d+", cells[0]):
            roles |= {f"L{layer}H{cells[0][1:]}": cell for layer, cell in zip(layers, cells[1:], strict=True)}
    return roles


@pytest.mark.parametrize("task", sorted(TASKS))
def test_train_labels_every_head_as_inspect_does_on_its_checkpoint(task, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")  # every cell on one line
    out = tmp_path / "run"
    assert main(["train", task, *TASKS[task], "--out", str(out)]) == 0
    trained = train_roles(capsys.readouterr().out)
    assert main(["inspect", "--model", str(out / "model"), "--format", "terminal"]) == 0
    inspected = inspect_roles(capsys.readouterr().out)
    layers, heads = (1, 2) if task == "reverse" else (2, 2)  # reverse: its cross-attention heads
    assert sorted(trained) == sorted(f"L{layer}H{head}" for layer in range(layers) for head in range(heads))
    assert trained == inspected
    assert all(re.fullmatch(r".+ \d+%\??", label) for label in trained.values())  # a label, never "-"
