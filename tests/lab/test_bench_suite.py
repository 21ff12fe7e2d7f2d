"""benchmarks/harness/suite.py: both benchmarks in one run, their ratios and roofline shares derived from their
records, never a share above 1, and ``--rescore`` of results on disk (damaged ones refused in one line).

Tiny configurations keep this fast; tests never assert on time, only on how the numbers are derived.
"""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path

import pytest

from multihead import machine
from multihead.cost import LayerShape, MachineRates, attention_kernel_cost, bound, estimate
from multihead.machine import save_calibration

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the harness lives beside its scripts, not in the package

from harness import kernel, layer, suite  # noqa: E402

RATES = MachineRates({"float32": 500.0}, bandwidth_gbs=50.0, threads=2, measured_at="test")  # above any tiny case
WRONG = MachineRates({"float32": 1e-6}, bandwidth_gbs=1e-6, threads=2, measured_at="busy")
HOUSE_FORM = re.compile(r"^\S.*: expected .+, got .+\. Fix: .+")


def no_calibration(*args, **kwargs):
    raise AssertionError("the tests use the cached rates; nothing may measure this machine")


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.setattr(machine, "calibrate", no_calibration)
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
        summary = suite.run_suite(quick=True, out_dir=out, configs=configs, progress=lines.append)
    finally:
        gc.unfreeze()
        monkeypatch.undo()
    return summary, out, lines


def test_suite_writes_every_report(ran):
    summary, out, lines = ran
    for name in ("bench_quick.json", "bench_quick.md", "bench_quick.png", "kernel_quick.json", "layer_quick.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "bench_quick.json").read_text())["rows"] == summary["rows"]
    assert summary["rates"]["matmul_gflops"] == {"float32": 500.0}  # the cached calibration was used
    assert summary["notes"] == []
    assert any("kernel benchmark" in line for line in lines) and any("layer benchmark" in line for line in lines)


def test_kernel_rows_ratios_and_roofline(ran):
    summary, out, _ = ran
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


def test_layer_rows_ratios_and_roofline(ran):
    summary, _, _ = ran
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


def test_markdown_lists_every_row(ran):
    summary, _, _ = ran
    text = suite.markdown_summary(summary)
    assert "| case | dtype | mode | ours | time (ms) | vs textbook | vs torch SDPA |" in text
    assert "vs torch MHA (no weights)" in text and "| roofline share |" in text
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
    (row,) = suite.kernel_rows(results, RATES)
    assert row["ratios"] == {"textbook": 0.25, "sdpa": 0.5}
    assert row["roofline_fraction"] is None and row["bound_s"] is None
    assert suite.layer_rows({"cases": []}, RATES) == []


# --------------------------------------------------------------------------- never a share above 1 (fake results)

GOOD_KERNEL = {
    "machine": {},
    "config": {"batch": 1, "heads": 2, "head_dim": 8},
    "cases": [
        {"impl": impl, "n": 16, "causal": False, "dtype": "float32", "mode": "forward", "status": "ok", "median_s": s}
        for impl, s in (("auto", 1e-4), ("sdpa", 2e-4), ("textbook", 4e-4))
    ],
}
GOOD_LAYER = {
    "machine": {},
    "cases": [
        {
            "impl": impl,
            "shape": "tiny",
            "n": 16,
            "causal": True,
            "dtype": "float32",
            "mode": "forward",
            "batch": 1,
            "embed_dim": 16,
            "heads": 2,
            "status": "ok",
            "median_s": s,
        }
        for impl, s in (("multihead", 1e-4), ("textbook", 2e-4), ("torch_mha_noweights", 3e-4))
    ],
}


@pytest.mark.parametrize("measured_again, withheld", [(WRONG, True), (RATES, False)])
def test_a_share_above_1_is_measured_again_then_withheld(tmp_path, monkeypatch, measured_again, withheld):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    save_calibration(WRONG)  # a calibration of a busy machine: every measured time beats its bound
    calls: list[list[str]] = []
    monkeypatch.setattr(machine, "calibrate", lambda dtypes: calls.append(list(dtypes)) or measured_again)
    lines: list[str] = []
    results = {"kernel": GOOD_KERNEL, "layer": GOOD_LAYER}
    summary = suite.summarize(results, ["float32"], out_dir=tmp_path / "out", quick=False, say=lines.append)
    assert calls == [["float32"]]  # measured again once
    assert "measured again" in summary["notes"][0]
    fractions = [row["roofline_fraction"] for row in summary["rows"]]
    assert all(f is None for f in fractions) if withheld else all(0 < f <= 1 for f in fractions)
    assert any("withheld" in note for note in summary["notes"]) is withheld
    markdown = (tmp_path / "out" / "bench.md").read_text()
    assert ("| withheld |" in markdown) is withheld
    assert all(float(cell) <= 1 for cell in re.findall(r"\| ([0-9.]+) \|\n", markdown))


# --------------------------------------------------------------------------- --rescore


def _bench_results(out: Path, kernel_json: object, layer_json: object) -> None:
    out.mkdir(exist_ok=True)
    for name, data in (("kernel", kernel_json), ("layer", layer_json)):
        (out / f"{name}.json").write_text(data if isinstance(data, str) else json.dumps(data))


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """A calibration cache of our own, so no case measures this machine (and none touches ~/.cache)."""
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(machine, "calibrate", no_calibration)
    save_calibration(MachineRates({"float32": 50.0}, bandwidth_gbs=5.0, threads=2, measured_at="test"))


def assert_one_line(capsys, argv: list[str], fragment: str) -> str:
    """suite.main(argv) exits 2 with one house-form stderr line naming --out (and ``fragment``)."""
    code = suite.main(argv, reexec=False)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    assert err.startswith("error: "), err
    message = err[len("error: ") :].rstrip("\n")
    assert HOUSE_FORM.match(message) and message.startswith("--out: ") and fragment in message, message
    return message


BENCH_CASES = {
    "both empty objects": ({}, {}, 'the key "machine"'),
    "kernel.json not JSON": ("{'cases': []}", GOOD_LAYER, "not valid JSON"),
    "kernel.json a list": ([], GOOD_LAYER, "got a list"),
    "layer case without a shape": (
        GOOD_KERNEL,
        {**GOOD_LAYER, "cases": [{**GOOD_LAYER["cases"][0], "shape": None}]},
        '["cases"][0]["shape"] is a string',
    ),
    "kernel case of an unknown dtype": (
        {**GOOD_KERNEL, "cases": [{**GOOD_KERNEL["cases"][0], "dtype": "int4"}]},
        GOOD_LAYER,
        '"dtype"] is one of "float32"',
    ),
    "layer case of sizes that make no layer": (
        GOOD_KERNEL,
        {**GOOD_LAYER, "cases": [{**case, "heads": 3} for case in GOOD_LAYER["cases"]]},
        "num_heads",
    ),
}


@pytest.mark.parametrize("case", BENCH_CASES)
def test_rescore_on_corrupt_results(case, cached, tmp_path, capsys):
    kernel_json, layer_json, fragment = BENCH_CASES[case]
    _bench_results(tmp_path / "results", kernel_json, layer_json)
    assert_one_line(capsys, ["--rescore", "--out", str(tmp_path / "results")], fragment)


def test_rescore_on_good_results_and_missing_ones(cached, tmp_path, capsys):
    _bench_results(tmp_path / "results", GOOD_KERNEL, GOOD_LAYER)
    assert suite.main(["--rescore", "--out", str(tmp_path / "results")], reexec=False) == 0
    assert "| tiny n16 |" in capsys.readouterr().out
    assert (tmp_path / "results" / "bench.json").is_file()
    assert_one_line(capsys, ["--rescore", "--quick", "--out", str(tmp_path / "results")], "kernel_quick.json")
    assert_one_line(capsys, ["--rescore", "--out", str(tmp_path / "nowhere")], "does not exist")
    assert suite.main(["--rescore", "--only", "layer", "--out", str(tmp_path / "results")], reexec=False) == 0
    assert "## kernel" not in capsys.readouterr().out


def test_the_suite_checks_its_out_folder_before_measuring(cached, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    assert_one_line(capsys, ["--quick", "--out", str(tmp_path / "a-file")], "which is a file")
