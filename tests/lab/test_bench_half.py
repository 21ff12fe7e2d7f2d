"""benchmarks/half.py at a tiny size: both dtypes run auto on the same values, the order alternates, the ratio is
per round, and the report marks the cases past the goal. No assertion on time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script and its harness live in benchmarks/, not the package

import half as bench  # noqa: E402


def test_both_dtypes_compute_the_same_attention():
    thunks, picks = bench.calls("window", 40, backward=False)
    single, half, floor = thunks["float32"](), thunks["bfloat16"](), thunks[bench.CAST_FLOOR]()
    assert single.dtype == torch.float32 and half.dtype == floor.dtype == torch.bfloat16
    assert (half.float() - single).abs().max() < 2e-2 and (floor.float() - single).abs().max() < 2e-2
    assert set(picks) == {"float32", "bfloat16", bench.CAST_FLOOR} and picks["float32"] is not None
    thunks, _ = bench.calls("causal", 40, backward=True)
    assert thunks["bfloat16"]().requires_grad  # its backward ran
    assert thunks[bench.CAST_FLOOR]().dtype == torch.bfloat16  # through float32 and back, backward included


def test_the_order_alternates_and_the_ratio_is_per_round():
    order: list[str] = []
    calls = {name: (lambda name=name: order.append(name)) for name in bench.DTYPES}
    times = bench.common.interleaved_rounds(calls, rounds=3)
    assert order == ["float32", "bfloat16", "float32", "bfloat16", "bfloat16", "float32", "float32", "bfloat16"]
    assert len(times["float32"]) == 3
    summary = bench.summarize({"bfloat16": [1.0, 3.0, 2.0], "float32": [2.0, 2.0, 2.0], bench.CAST_FLOOR: [1, 1, 4]})
    assert (summary["ratio"], summary["ratio_min"], summary["ratio_max"]) == (1.0, 0.5, 1.5)
    assert (summary["floor_ratio"], summary["floor_ratio_min"], summary["floor_ratio_max"]) == (1.0, 0.5, 3.0)


def test_the_report_marks_the_cases_past_the_goal(tmp_path):
    assert bench.main(["--sizes", "32", "--masks", "causal", "--rounds", "1", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "half.md").read_text()
    assert report.count("| causal | 32 |") == 2 and "Met in" in report
    case = {"mask": "none", "n": 8, "mode": "forward", "picks": {"bfloat16": "sdpa", "float32": "sdpa"}}
    slower = {**case, **bench.summarize({"bfloat16": [2.0], "float32": [1.0], bench.CAST_FLOOR: [1.9]})}
    results = {"machine": "m", "torch_threads": 2, "load": ["a", "b"], "cases": [slower]}
    report = bench.markdown(results)
    assert "**2.00 [2.00, 2.00]**" in report and "Met in 0 of 1" in report
    assert "| 1,900.0 | 1.05 [1.05, 1.05] |" in report and "within 5% of it in 0 of 1" in report  # 2.0 / 1.9


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--masks", "causal,sliding"], "--masks: unknown ['sliding'] in 'causal,sliding'; choose from causal,window"),
        (["--rounds", "0"], "--rounds: expected >= 1, got 0"),
    ],
)
def test_bad_options_are_refused_naming_the_option(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.main([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran
