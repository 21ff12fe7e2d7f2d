"""The lower bounds of pyproject.toml as exact pins: `make test-floors` installs the package's dependencies (and its
test, plots and hf extras) at these versions and runs the suite, so every floor is a version the code has run on.

    python3 scripts/floors.py            # prints one `name==version` constraint per `name>=version` requirement

torch is left out: its floor is the CPU build this machine kind carries (the only torch that installs here without
GBs of CUDA packages), which the Makefile names itself.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
LEFT_OUT = {"torch"}
# name, then the specifiers: `conllu>=4.5`, `torch>=2.13,<2.15`, `ruff==0.17.6`
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$")


def floor_pins(project: dict) -> list[str]:
    """`name==floor` for every requirement of the project and its extras with a `>=` bound, in their order."""
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    pins: dict[str, str] = {}
    for requirement in requirements:
        match = REQUIREMENT.match(requirement.split(";")[0])
        if match is None:
            raise ValueError(f"pyproject.toml: cannot read the requirement {requirement!r}")
        name, specifiers = match.group(1).lower(), match.group(2)
        floor = re.search(r">=\s*([^,\s]+)", specifiers)
        if floor is None or name in LEFT_OUT:
            continue
        if pins.get(name, floor.group(1)) != floor.group(1):
            raise ValueError(f"pyproject.toml: {name} has two floors, {pins[name]} and {floor.group(1)}; keep one")
        pins[name] = floor.group(1)
    return [f"{name}=={version}" for name, version in pins.items()]


def main() -> int:
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    sys.stdout.write("".join(pin + "\n" for pin in floor_pins(project)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
