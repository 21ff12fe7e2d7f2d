"""docs/architectures.md, the table of the installed transformers' architectures on attn_implementation="multihead",
cannot drift from the code: it lists exactly the architectures whose modeling code calls the attention function,
and rows re-run here (a fixed spread of the table, and the architectures issue 45 served) come out as written.
Regenerate it with `make architectures` (python scripts/architectures.py: every row, about 12 minutes on 2 cores)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "architectures.md"
ROW = re.compile(r"^\| `([\w-]+)` \| ([\w ]+) \| (.*) \|$")


def load_script():
    spec = importlib.util.spec_from_file_location("architectures_script", ROOT / "scripts" / "architectures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SCRIPT = load_script()


def table_rows() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in TABLE.read_text().splitlines():
        found = ROW.match(line)
        if found:
            rows[found.group(1)] = (found.group(2), found.group(3))
    return rows


def test_the_table_lists_every_architecture_that_calls_the_attention_function():
    rows = table_rows()
    assert sorted(rows) == SCRIPT.attention_architectures()
    counts = re.search(r"^(\d+) architectures: (.*)\.$", TABLE.read_text(), re.MULTILINE)
    assert counts is not None and int(counts.group(1)) == len(rows)
    said = {status: int(count) for count, status in re.findall(r"(\d+) ([a-z ]+?)(?:,|$)", counts.group(2))}
    statuses = [status for status, _ in rows.values()]
    assert said == {status: statuses.count(status) for status in set(statuses)}


# the architectures issue 45 served, and the two that need eager's mask (NEEDS_EAGER_MASK)
SERVED_BY_ISSUE_45 = ["gpt_oss", "granite_swa", "deepseek_v32", "gemma4", "qwen3_next", "minimax", "hy_v4"]
NEED_EAGER_MASK = ["deepseek_v4", "git"]


def sample() -> list[str]:
    """Every 40th row and the named ones; never a "too large" row (one model past the sweep's memory limit, run
    here without it, would take the machine's memory: it says nothing about attention)."""
    rows = table_rows()
    every = sorted(rows)
    chosen = set(every[::40]) | set(SERVED_BY_ISSUE_45) | set(NEED_EAGER_MASK)
    return sorted(name for name in chosen if rows[name][0] != "too large")


@pytest.mark.portable
@pytest.mark.parametrize("model_type", sample())
def test_a_row_re_run_comes_out_as_the_table_says(model_type, device):
    status, detail = table_rows()[model_type]
    row = SCRIPT.compare(model_type, device)
    # the figure of an "equal" row is float32 rounding, which differs between CPU kinds; the result does not
    assert row.status == status, f"{model_type}: the table says {status} ({detail}), a run now gives {row.line()}"
