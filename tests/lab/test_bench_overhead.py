"""benchmarks/host_overhead.py at its smoke size: every case and comparison is reported, in JSON and markdown, with
the machine named. No assertion on time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script lives in benchmarks/, not the package

import host_overhead as bench  # noqa: E402


def test_the_spread_and_the_ratio_are_per_round():
    assert bench.spread([4.0, 1.0, 3.0, 2.0]) == {"median": 2.5, "q1": 1.75, "q3": 3.25, "min": 1.0, "max": 4.0, "n": 4}
    assert bench.spread([2.0])["q1"] == bench.spread([2.0])["q3"] == 2.0
    comparison = bench.compare([2e-6, 3e-6, 9e-6], [1e-6, 3e-6, 3e-6])  # per round: 2, 1, 3
    assert comparison["difference_us"] == pytest.approx(0.0)  # medians 3 µs and 3 µs
    assert comparison["ratio"]["median"] == 2.0 and (comparison["ratio"]["min"], comparison["ratio"]["max"]) == (1, 3)
    assert bench.rotations(["a", "b", "c"], 4) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_the_smoke_run_writes_every_case_in_json_and_markdown(tmp_path):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "host_overhead_smoke.json").read_text())
    assert results["benchmark"] == "host_overhead" and results["config"]["smoke"] is True
    machine = results["machine"]
    assert {"cpu_model", "cpu_flags", "torch_threads", "torch", "device"} <= set(machine)
    assert machine["torch_threads"] >= 1 and machine["device"] == "cpu"
    kinds = [case["kind"] for case in results["cases"]]
    config = results["config"]
    assert kinds == ["kernel"] * (len(config["decode_keys"]) + len(config["prefill"])) + ["layer"]
    for case in results["cases"]:
        assert case["outputs_agree"] is True, case["name"]
        expected = {"auto", "sdpa", "torch sdpa"} if case["kind"] == "kernel" else set(case["contestants"])
        assert set(case["contestants"]) == expected
        for times in case["contestants"].values():
            assert times["min"] <= times["q1"] <= times["median"] <= times["q3"] <= times["max"]
        for name, series in case["times_s"].items():
            assert len(series) == config["rounds"], name
        for comparison in case["comparisons"]:
            assert {comparison["subject"], comparison["baseline"]} <= set(case["contestants"])
            assert set(comparison["ratio"]) == {"median", "q1", "q3", "min", "max", "n"}
            assert isinstance(comparison["difference_us"], float)
    kernel = results["cases"][0]
    assert kernel["auto_choice"] and ("auto", "torch sdpa") == (
        kernel["comparisons"][0]["subject"],
        kernel["comparisons"][0]["baseline"],
    )
    layer = results["cases"][-1]
    assert set(layer["contestants"]) == {bench.CACHED, bench.TORCH_STEP, bench.UNCACHED, bench.TORCH_MHA}
    report = (tmp_path / "host_overhead_smoke.md").read_text()
    assert machine["cpu_model"] is None or machine["cpu_model"] in report
    assert f"torch {machine['torch']} with {machine['torch_threads']} threads" in report
    for case in results["cases"]:
        assert f"| {case['name']} |" in report
    assert f"| {kernel['name']} | {kernel['auto_choice']} |" in report


def test_a_bad_option_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    assert "--rounds: expected a positive number, got '0'" in capsys.readouterr().err
