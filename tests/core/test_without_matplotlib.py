"""Without matplotlib (the optional ``plots`` extra), every command that writes a PNG among other outputs still
succeeds: it writes everything else, prints one line that names the figure left out and the install, and exits 0.

matplotlib is hidden in-process: ``sys.modules["matplotlib"] = None`` makes ``import matplotlib`` (and
``import matplotlib.pyplot``) raise ImportError, with every matplotlib module already imported taken out for the
test and put back after it.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator

import pytest

from multihead._figures import INSTALL_HINT, has_matplotlib, pyplot, save_figure
from multihead.cli import main

TEXT = "The bank was full of money."
TINY_RUN = ["--steps", "3", "--layers", "1", "--heads", "2", "--hidden", "16"]  # `multihead train` in a second


def note(*names: str) -> str:
    """The one line a command prints for the figures it left out."""
    return f"note: {', '.join(names)} not drawn: matplotlib is not installed. Fix: {INSTALL_HINT}"


@contextlib.contextmanager
def hidden_matplotlib() -> Iterator[None]:
    """matplotlib not importable inside the block; after it, sys.modules holds the same matplotlib modules again."""
    with pytest.MonkeyPatch.context() as patch:
        for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
            patch.delitem(sys.modules, name)
        patch.setitem(sys.modules, "matplotlib", None)
        yield


@pytest.fixture
def no_matplotlib() -> Iterator[None]:
    with hidden_matplotlib():
        yield


def skipped_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "not drawn" in line or "matplotlib" in line]


def test_the_helper_hides_matplotlib_and_puts_it_back(tmp_path):
    pyplot()  # imported before, as another test may have done
    before = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "matplotlib"}
    with hidden_matplotlib():
        assert not has_matplotlib()
        for statement in ("import matplotlib", "import matplotlib.pyplot", "from matplotlib import colors"):
            with pytest.raises(ImportError):
                exec(statement, {})
    after = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "matplotlib"}
    assert after == before and has_matplotlib()
    figure, axis = pyplot().subplots()  # the next test can still draw
    axis.plot([0, 1], [1, 0])
    assert save_figure(figure, tmp_path / "line.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_writes_the_other_reports(no_matplotlib, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["inspect", TEXT, "--layers", "0", "--heads", "0,1", "--format", "terminal,html,png,json", "--out"]
    assert main([*argv, str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""
    assert printed.out.startswith("all-MiniLM-L6-v2: 1 layer x 2 heads") and "Head roles" in printed.out  # terminal
    assert f"wrote {(out / 'report.html').resolve()} (" in printed.out
    assert f"wrote {(out / 'inspect.json').resolve()} (" in printed.out
    assert skipped_lines(printed.out) == [note("heads.png")]
    assert sorted(path.name for path in out.iterdir()) == ["inspect.json", "report.html"]
    assert json.loads((out / "inspect.json").read_text(encoding="utf-8"))["layers"] == [0]


@pytest.mark.parametrize("as_json", [False, True])
def test_cost_plot(as_json, no_matplotlib, tmp_path, capsys):
    plot = tmp_path / "x.png"
    argv = ["cost", "--embed-dim", "64", "--heads", "4", "--seq", "32", "--plot", str(plot)]
    assert main([*argv, *(["--json"] if as_json else [])]) == 0
    printed = capsys.readouterr()
    if as_json:  # stdout stays the JSON; the note goes to stderr
        assert json.loads(printed.out)["params"]["weights"] == 4 * 64 * 64
        assert skipped_lines(printed.err) == [note("x.png")] and skipped_lines(printed.out) == []
    else:
        assert "parameters:" in printed.out and "plot:" not in printed.out
        assert skipped_lines(printed.out) == [note("x.png")] and printed.err == ""
    assert not plot.exists()


@pytest.mark.parametrize(
    "task, files",
    [
        ("induction", ["log.json", "model"]),
        ("reverse", ["log.json", "model"]),
        ("symmetry", ["symmetry.json"]),
    ],
)
def test_train(task, files, no_matplotlib, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", task, *TINY_RUN, "--out", str(out)]) == 0
    printed = capsys.readouterr()
    figure = "symmetry.png" if task == "symmetry" else "curves.png"
    assert skipped_lines(printed.out) == [note(figure)] and printed.err == ""
    assert sorted(path.name for path in out.iterdir()) == files
    for name in files:
        assert f"wrote {(out / name).resolve()}" in printed.out
    if task != "symmetry":
        assert (out / "model" / "behaviours.json").is_file() and "inspect it:" in printed.out


def test_heads_syntax(no_matplotlib, tmp_path, capsys):
    argv = ["heads", "syntax", "--max-sentences", "5", "--relations", "det,case", "--out", str(tmp_path)]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert skipped_lines(printed.out) == [note("syntax.png")] and printed.err == ""
    assert f"wrote {(tmp_path / 'syntax.json').resolve()}" in printed.out
    assert sorted(path.name for path in tmp_path.iterdir()) == ["syntax.json"]


def test_heads_importance(no_matplotlib, tmp_path, capsys):
    """On a `multihead train` checkpoint: its heads' cost to its own task, fast."""
    run = tmp_path / "run"
    assert main(["train", "induction", *TINY_RUN, "--out", str(run)]) == 0
    capsys.readouterr()
    out = tmp_path / "heads"
    assert main(["heads", "importance", "--model", str(run / "model"), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert skipped_lines(printed.out) == [note("importance.png")] and printed.err == ""
    assert f"wrote {(out / 'importance.json').resolve()}" in printed.out
    assert sorted(path.name for path in out.iterdir()) == ["importance.json"]


def test_heads_prune(no_matplotlib, tmp_path, capsys):
    """MiniLM pruned by a given importance (no ablation), its curve over a two-text corpus."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The bank was full of money.\nWe sat on the river bank.\n")
    scores = [[float(layer * 12 + head) for head in range(12)] for layer in range(6)]
    (tmp_path / "importance.json").write_text(json.dumps({"scores": scores}))
    out = tmp_path / "heads"
    argv = ["heads", "prune", "--fraction", "0.25", "--importance", str(tmp_path / "importance.json")]
    assert main([*argv, "--corpus", str(corpus), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert skipped_lines(printed.out) == [note("pruning.png")] and printed.err == ""
    assert f"wrote {(out / 'pruning.json').resolve()}" in printed.out
    assert sorted(path.name for path in out.iterdir()) == ["model", "pruning.json"]


def test_bench(no_matplotlib, tmp_path, monkeypatch, capsys):
    """Tiny sizes, a saved calibration: the tables and bench_quick.json, and the one line for the PNG."""
    from multihead.cost import MachineRates
    from multihead.lab import bench
    from multihead.machine import save_calibration

    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    save_calibration(MachineRates({"float32": 1e9}, bandwidth_gbs=1e9, threads=2, measured_at="quiet"))
    monkeypatch.setitem(bench.SIZES, True, {"attention": (8,), "layer": (4,)})
    monkeypatch.setitem(bench.ROUNDS, True, 2)
    monkeypatch.setitem(bench.BLOCK_S, True, 0.0)
    out = tmp_path / "out"
    assert main(["bench", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("machine: ") and printed.err == ""
    assert skipped_lines(printed.out) == [note("bench_quick.png")]
    assert f"wrote {(out / 'bench_quick.json').resolve()}" in printed.out
    assert sorted(path.name for path in out.iterdir()) == ["bench_quick.json"]


def test_circuits_lens(no_matplotlib, tmp_path, capsys):
    """lens.png, its table drawn as the other modes draw their grids: left out with the one line."""
    run = tmp_path / "run"
    assert main(["train", "induction", *TINY_RUN, "--out", str(run)]) == 0
    capsys.readouterr()
    out = tmp_path / "circuits"
    argv = ["circuits", "lens", "--model", str(run / "model"), "--text", "b c d b c", "--format", "json,png"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert skipped_lines(printed.out) == [note("lens.png")] and printed.err == ""
    assert f"wrote {(out / 'lens.json').resolve()}" in printed.out
    assert sorted(path.name for path in out.iterdir()) == ["lens.json"]
