"""The core as a user installs it (issue 32): the wheel built from this checkout, installed without extras into a
fresh venv beside torch and torch's own requirements (at the test lock's versions, hash-checked, nothing else),
runs attention, the layer, capture, the cost model and ``multihead cost``, and imports no lab package; a lab
package there says in one line that it needs ``multihead[lab]``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

from multihead.lab.extra import LAB_EXTRA, LAB_MODULES

ROOT = Path(__file__).resolve().parents[2]
# torch and what torch requires (pip show torch): the core's whole environment
CORE_ENVIRONMENT = ("torch", "filelock", "fsspec", "jinja2", "markupsafe", "networkx", "setuptools", "sympy", "mpmath")
CORE_ENVIRONMENT += ("typing-extensions",)


def locked(names: tuple[str, ...]) -> str:
    """The test lock's entries (each a `name==version` line and its hash lines) of the packages ``names``."""
    entries = re.split(r"\n(?=[A-Za-z0-9])", (ROOT / "lock" / "test.txt").read_text(encoding="utf-8"))
    chosen = [entry for entry in entries if re.match(r"([A-Za-z0-9._-]+)==", entry)]
    chosen = [entry for entry in chosen if entry.split("==")[0].lower() in names]
    assert {entry.split("==")[0].lower() for entry in chosen} == set(names), "a core package is not in the lock"
    return "\n".join(entry.rstrip() for entry in chosen) + "\n"


def run(*command: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert result.returncode == 0, f"{command}: {result.stderr[-3000:]}"
    return result.stdout


def test_the_core_wheel_installs_and_runs_alone(tmp_path):
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", ROOT)
    (wheel,) = (tmp_path / "dist").glob("multihead-*.whl")
    venv.create(tmp_path / "core", with_pip=True)
    python = tmp_path / "core" / "bin" / "python"
    requirements = tmp_path / "core.txt"
    requirements.write_text(locked(CORE_ENVIRONMENT), encoding="utf-8")
    run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--require-hashes", "-r", requirements)
    run(python, "-m", "pip", "install", "--quiet", "--no-deps", wheel)
    listed = json.loads(run(python, "-m", "pip", "list", "--format=json"))
    installed = {package["name"].lower().replace("_", "-") for package in listed} - {"pip"}
    assert installed == set(CORE_ENVIRONMENT) | {"multihead"}  # no lab package came with the wheel
    script = textwrap.dedent(
        f"""
        import json, sys, torch
        import multihead
        from multihead import masks
        from multihead.capture import capture
        from multihead.cli import main
        from multihead.cost import LayerShape, estimate

        out = multihead.attention(*(torch.randn(1, 2, 8, 4) for _ in range(3)), mask=masks.causal())
        layer = multihead.MultiHeadAttention(16, 4)
        with capture(layer, heads=[1]) as recorder:
            layer(torch.randn(2, 5, 16))
        status = main(["cost", "--embed-dim", "64", "--heads", "4", "--seq", "32"])
        try:
            import multihead.lab.inspect
            refused = None
        except ImportError as error:
            refused = str(error)
        lab = {set(LAB_MODULES)!r}
        print(json.dumps({{
            "out": list(out.shape), "weights": list(recorder.weights(0, 1).shape), "cost": status,
            "flops": estimate(LayerShape(64, 4), seq=32).total_flops, "refused": refused,
            "loaded": sorted(m for m in sys.modules if m.split(".")[0] in lab),
        }}))
        """
    )
    printed = run(python, "-c", script, cwd=tmp_path).splitlines()
    facts = json.loads(printed[-1])
    assert facts["out"] == [1, 2, 8, 4] and facts["weights"] == [2, 5, 5] and facts["flops"] > 0
    assert facts["cost"] == 0 and any(line.startswith("term") for line in printed)  # the plain FLOPs table
    assert facts["loaded"] == []
    assert facts["refused"].startswith("multihead.lab.inspect needs multihead's lab extra, which is not installed")
    assert facts["refused"].endswith(f"Fix: pip install 'multihead[{LAB_EXTRA}]'")
    console = tmp_path / "core" / "bin" / "multihead"  # the console script
    assert "FLOPs" in run(console, "cost", "--embed-dim", "64", "--heads", "4", "--seq", "32")
