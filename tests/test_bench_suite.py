"""`multihead bench`: the suite runs both benchmarks, and its ratios and roofline fractions follow from their records.

Tiny configurations keep this fast; tests never assert on time, only on how the numbers are derived.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

from multihead.bench import kernel, layer
from multihead.bench.suite import kernel_rows, layer_rows, markdown_summary, run_suite
from multihead.cost import LayerShape, MachineRates, attention_kernel_cost, bound, estimate, save_calibration

RATES = MachineRates({"float32": 50.0}, bandwidth_gbs=5.0, threads=2, measured_at="test")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cache = tmp_path_factory.mktemp("cache")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("MULTIHEAD_CACHE", str(cache))
    save_calibration(RATES)  # the suite must use the cached rates, not measure its own
    configs = {
        "kernel": kernel.Config(
            sizes=(16, 32),
            dtypes=("float32",),
            heads=2,
            max_repeats=1,
            max_total_s=0.0,
            weights=False,
            bh1=False,
            quick=True,
            out_dir=out,
        ),
        "layer": layer.Config(
            shapes=("gpt2-small",),
            sizes=(8, 16),
            dtypes=("float32",),
            max_repeats=1,
            max_total_s=0.0,
            decode_prompts=(8,),
            decode_new_tokens=2,
            decode_repeats=1,
            busy_retries=0,
            quick=True,
            out_dir=out,
        ),
    }
    lines: list[str] = []
    gc.freeze()  # the benchmarks collect garbage around each case: keep the test process's heap out of it
    try:
        summary = run_suite(quick=True, out_dir=out, configs=configs, progress=lines.append)
    finally:
        gc.unfreeze()
        monkeypatch.undo()
    return summary, out, lines


def test_suite_writes_every_report(suite):
    summary, out, lines = suite
    for name in ("bench_quick.json", "bench_quick.md", "bench_quick.png", "kernel_quick.json", "layer_quick.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "bench_quick.json").read_text())["rows"] == summary["rows"]
    assert summary["rates"]["matmul_gflops"] == {"float32": 50.0}  # the cached calibration was used
    assert any("kernel benchmark" in line for line in lines) and any("layer benchmark" in line for line in lines)


def test_kernel_rows_ratios_and_roofline(suite):
    summary, out, _ = suite
    results = json.loads((out / "kernel_quick.json").read_text())
    rows = [row for row in summary["rows"] if row["benchmark"] == "kernel"]
    assert {row["impl"] for row in rows} == {"auto", "tiled"}
    assert len(rows) == 2 * 2 * 2 * 2  # two sizes x causal or not x two modes x our two kernels
    times = {
        (r["impl"], r["n"], r["causal"], r["mode"]): r["median_s"] for r in results["cases"] if r["status"] == "ok"
    }
    for row in rows:
        n = int(row["case"].split(" n")[1].split()[0])
        causal = row["case"].endswith("causal")
        ours = times[(row["impl"], n, causal, row["mode"])]
        assert row["seconds"] == ours
        assert row["ratios"]["sdpa"] == pytest.approx(ours / times[("sdpa", n, causal, row["mode"])])
        assert row["ratios"]["textbook"] == pytest.approx(ours / times[("textbook", n, causal, row["mode"])])
        flops, traffic = attention_kernel_cost(
            batch=1, heads=2, q_len=n, k_len=n, head_dim=64, causal=causal, mode=row["mode"]
        )
        assert row["roofline_fraction"] == pytest.approx(bound(flops, traffic, "float32", RATES).bound_s / ours)


def test_layer_rows_ratios_and_roofline(suite):
    summary, _, _ = suite
    rows = [row for row in summary["rows"] if row["benchmark"] == "layer"]
    assert {row["impl"] for row in rows} == {"multihead", "multihead_weights"}
    for row in rows:
        assert set(row["ratios"]) == (
            {"textbook", "torch_mha_noweights", "torch_mha_weights"}
            if row["impl"] == "multihead"
            else {"textbook", "torch_mha_weights"}
        )
        n = int(row["case"].split(" n")[1])
        report = estimate(
            LayerShape(768, 12), seq=n, causal=True, mode=row["mode"], need_weights=row["impl"] == "multihead_weights"
        )
        expected = bound(report.needed_flops, report.bytes.traffic, "float32", RATES).bound_s
        assert row["bound_s"] == pytest.approx(expected)
        assert row["roofline_fraction"] == pytest.approx(expected / row["seconds"])


def test_markdown_lists_every_row(suite):
    summary, _, _ = suite
    text = markdown_summary(summary)
    assert "| case | dtype | mode | ours | time (ms) | vs textbook | vs torch SDPA |" in text
    assert "vs torch MHA (no weights)" in text
    assert text.count("\n| b1 h2 d64 n") == sum(row["benchmark"] == "kernel" for row in summary["rows"])
    assert text.count("\n| gpt2-small n") == sum(row["benchmark"] == "layer" for row in summary["rows"])


def test_rows_skip_the_roofline_for_an_uncalibrated_dtype():
    results = {
        "config": {"batch": 1, "heads": 2, "head_dim": 8},
        "cases": [
            {
                "impl": impl,
                "n": 4,
                "causal": False,
                "dtype": "bfloat16",
                "mode": "forward",
                "status": "ok",
                "median_s": seconds,
            }
            for impl, seconds in (("auto", 1.0), ("sdpa", 2.0), ("textbook", 4.0))
        ],
    }
    (row,) = kernel_rows(results, RATES)
    assert row["ratios"] == {"textbook": 0.25, "sdpa": 0.5}
    assert row["roofline_fraction"] is None and row["bound_s"] is None
    assert layer_rows({"cases": []}, RATES) == []


def test_calibrate_alone_saves_the_rates(tmp_path):
    env = {"MULTIHEAD_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "multihead.cli", "bench", "--calibrate"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert "calibrated: float32 matmul" in result.stdout
    saved = json.loads((tmp_path / "calibration.json").read_text())
    assert saved["matmul_gflops"]["float32"] > 0 and saved["bandwidth_gbs"] > 0
    bad = subprocess.run(
        [sys.executable, "-m", "multihead.cli", "bench", "--calibrate", "--dtype", "int8"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--dtype: expected one of float32" in bad.stderr
