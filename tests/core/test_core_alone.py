"""The core needs torch alone (issue 32, first step): ``import multihead`` loads no lab module and no package of the
lab extra; attention, the layer, capture and the cost model run with every lab package unimportable; the lab's
packages and commands say in one line that they need ``multihead[lab]``.

Each check runs in a fresh interpreter whose imports of the lab's packages fail, as in an environment where
``pip install multihead`` installed the core alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from multihead.lab.extra import LAB_EXTRA, LAB_MODULES

ROOT = Path(__file__).resolve().parents[2]
# every import of a lab package fails, as when it is not installed
WITHOUT_LAB = textwrap.dedent(
    f"""
    import importlib.abc, importlib.util, sys
    LAB = {set(LAB_MODULES) | {"markupsafe", "matplotlib", "transformers"}!r}

    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in LAB:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    _find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *rest: None if name.split(".")[0] in LAB else _find_spec(name, *rest)
    """
)
LAB_PACKAGES = ("multihead.lab.inspect", "multihead.lab.models", "multihead.lab.train", "multihead.integrations")


def run_without_lab(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_LAB + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_the_core_runs_and_imports_nothing_of_the_lab():
    result = run_without_lab(
        """
        import json, sys, torch
        import multihead
        from multihead import masks
        from multihead.capture import capture
        from multihead.cost import LayerShape, estimate

        torch.manual_seed(0)
        q = k = v = torch.randn(1, 2, 8, 4)
        out = multihead.attention(q, k, v, mask=masks.causal())
        layer = multihead.MultiHeadAttention(16, 4)
        x = torch.randn(2, 5, 16)  # (b, n, embed)
        with capture(layer, heads=[1]) as recorder:
            layer(x)
        weights = recorder.weights(0, 1)
        report = estimate(LayerShape(16, 4), seq=128)
        loaded = sorted(
            name for name in sys.modules
            if name.split(".")[0] in LAB or name.startswith(tuple(p + "." for p in PACKAGES)) or name in PACKAGES
        )
        print(json.dumps({"out": list(out.shape), "weights": list(weights.shape), "flops": report.total_flops,
                          "loaded": loaded}))
        """.replace("PACKAGES", repr(LAB_PACKAGES)),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts["out"] == [1, 2, 8, 4] and facts["weights"] == [2, 5, 5] and facts["flops"] > 0
    assert facts["loaded"] == []  # no lab module, no lab package: the old __init__ loaded inspect and models


COST = ["cost", "--embed-dim", "384", "--heads", "12", "--seq", "128", "--causal", "--backward", "--tp", "2"]


def test_multihead_cost_runs_on_the_core_and_prints_what_the_lab_console_prints(capsys, monkeypatch):
    result = run_without_lab(
        """
        import json
        from multihead.cli import main
        status = main(sys.argv[1:])
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in LAB or m.startswith("multihead.lab.inspect"))
        print(json.dumps({"status": status, "loaded": loaded}))
        """,
        *COST,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
    *printed, facts = result.stdout.splitlines()
    assert json.loads(facts) == {"status": 0, "loaded": []}
    from multihead.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    assert main(COST) == 0  # the same command with rich (the lab extra) installed
    with_rich = capsys.readouterr().out.splitlines()

    def cells(lines: list[str]) -> list[list[str]]:  # every row's cells, whatever draws the table
        return [line.strip(" │─-").split() for line in lines if line.strip(" │─-")]

    assert cells(printed) == cells(with_rich)
    assert any(line.startswith("term") and "backward" in line for line in printed)  # a plain table, aligned


@pytest.mark.parametrize("package", ["multihead.lab.inspect", "multihead.lab.models", "multihead.lab.train"])
def test_a_lab_package_without_the_extra_is_one_line_naming_it(package):
    result = run_without_lab(
        f"""
        import multihead
        try:
            import {package}
        except ImportError as error:
            print(type(error).__name__, str(error))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip()
    assert line.startswith(f"MissingExtraError {package} needs multihead's lab extra, which is not installed")
    assert line.endswith(f"Fix: pip install 'multihead[{LAB_EXTRA}]'") and "\n" not in line


@pytest.mark.parametrize("command", [["inspect"], ["heads", "importance"], ["train", "induction", "--steps", "2"]])
def test_a_lab_command_without_the_extra_is_one_line_naming_it(command):
    result = run_without_lab("from multihead.cli import main; sys.exit(main(sys.argv[1:]))", *command)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"multihead {command[0]}: error: ") and result.stderr.count("\n") == 1
    assert "needs multihead's lab extra, which is not installed (missing: " in result.stderr
    assert result.stderr.rstrip().endswith(f"Fix: pip install 'multihead[{LAB_EXTRA}]'")


def test_the_core_depends_on_torch_and_numpy_alone_and_the_lab_extra_lists_the_lab_modules():
    """numpy beside torch: without it torch warns "Failed to initialize NumPy" on every import (issue 47, row 13)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert [requirement.split(">")[0] for requirement in project["dependencies"]] == ["torch", "numpy"]
    lab = {requirement.split(">")[0].split("=")[0] for requirement in project["optional-dependencies"][LAB_EXTRA]}
    assert lab == set(LAB_MODULES)  # their import names are their distribution names


def test_import_multihead_loads_neither_dynamo_nor_sympy():
    """torch's dynamo and sympy took 0.75 s of `import multihead` (0.79 s on top of torch's own import, now about
    0.05 s): SDPA's CausalBias and statically_known_true load only where a call needs them."""
    result = run_without_lab(
        """
        import torch
        before = {"torch._dynamo", "sympy"} & set(sys.modules)
        import multihead
        print(sorted(({"torch._dynamo", "sympy"} & set(sys.modules)) - before))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"
