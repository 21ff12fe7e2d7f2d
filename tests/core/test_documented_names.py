"""Every dotted ``multihead.X.Y`` name README.md, ARCHITECTURE.md and docs/ write is reachable after a plain
``import multihead`` (issue 47, row 11): attribute by attribute, as a reader types it, the modules loading on
first use; and ``import multihead`` alone loads neither the lab nor transformers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED = re.compile(r"\bmultihead(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def documented_names() -> set[str]:
    names = set()
    for document in DOCUMENTS:
        names |= set(DOTTED.findall(document.read_text(encoding="utf-8")))
    # a file name written with the package's spelling is not an attribute (multihead.egg-info)
    return {name for name in names if not name.endswith((".md", ".py", ".json"))}


REACH = """
import functools, json, sys
import multihead
missing = {}
for name in json.loads(sys.argv[1]):
    try:
        functools.reduce(getattr, name.split(".")[1:], multihead)
    except AttributeError as error:
        missing[name] = str(error)
print(json.dumps(missing))
"""


def test_every_documented_dotted_name_is_reachable_after_import_multihead():
    names = sorted(documented_names())
    assert len(names) > 40  # the scan found the documents' names
    result = subprocess.run(
        [sys.executable, "-c", REACH, json.dumps(names)], capture_output=True, text=True, timeout=300, check=True
    )
    facts = json.loads(result.stdout.splitlines()[-1])
    assert facts == {}


def test_import_multihead_loads_neither_the_lab_nor_transformers_nor_the_cost_model():
    script = (
        "import sys, multihead; print(sorted(m for m in sys.modules if m.startswith(('multihead.lab', "
        "'multihead.cost', 'multihead.integrations', 'transformers', 'rich'))))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
