"""benchmarks/harness: the kernel and layer benchmarks of this repository, run on tiny configurations (their
structure, never their timings), and the thin scripts in benchmarks/. The harness is not installed: it is imported
from beside its scripts."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the harness lives beside its scripts, not in the package

from harness import common, kernel, layer  # noqa: E402

# --------------------------------------------------------------------------- tiny runs, shared by the tests


def run_frozen(run, config) -> tuple[dict, list[str]]:
    """``run(config)`` with the progress lines collected. The objects alive now are frozen for it: the
    benchmarks call gc.collect() around every case, which otherwise takes most of a tiny run's time."""
    lines: list[str] = []
    gc.freeze()
    try:
        return run(config, progress=lines.append), lines
    finally:
        gc.unfreeze()


@pytest.fixture(scope="module")
def kernel_results() -> tuple[kernel.Config, dict, list[str]]:
    """Two sizes, so the second is predicted from the first; one call per case; no b*h = 12 weights section."""
    config = kernel.Config(
        sizes=(16, 32), dtypes=("float32",), heads=2, max_repeats=1, max_total_s=0.0, weights=False, bh1=False
    )
    return (config, *run_frozen(kernel.run, config))


@pytest.fixture(scope="module")
def layer_results() -> tuple[layer.Config, dict, list[str]]:
    """GPT-2-small's shape (causal, and the decode shape) at two sizes, one call per case, a two-token decode;
    never waits for a quiet machine."""
    config = layer.Config(
        shapes=("gpt2-small",),
        sizes=(8, 16),
        dtypes=("float32",),
        max_repeats=1,
        max_total_s=0.0,
        decode_prompts=(8, 16),
        decode_new_tokens=2,
        decode_repeats=1,
        busy_retries=0,
    )
    return (config, *run_frozen(layer.run, config))


# --------------------------------------------------------------------------- kernel


def test_kernel_run_records(kernel_results):
    config, results, lines = kernel_results
    assert results["complete"] is True
    assert set(results) >= {"machine", "config", "cases", "textbook_bh1", "weights", "targets", "elapsed_s"}
    assert results["textbook_bh1"] == [] and results["weights"] == []
    cases = results["cases"]
    expected = {
        (impl, n, causal, mode)
        for impl in kernel.IMPLS
        for n in config.sizes
        for causal in config.causal
        for mode in config.modes
    }
    assert {(r["impl"], r["n"], r["causal"], r["mode"]) for r in cases} == expected
    assert len(cases) == len(expected)
    for r in cases:
        assert r["status"] == "ok", r
        assert r["repeats"] == 1 and len(r["times_s"]) == 1 and r["median_s"] > 0
        assert r["gflop"] > 0 and r["gflops"] > 0
        assert {
            "warmup_s",
            "peak_mib",
            "baseline_rss_mib",
            "returned_mib",
            "predicted_s",
            "predicted_mib",
            "served_by",
            "pct_peak",
        } <= set(r)
        assert r["served_by"] == {"textbook": None, "sdpa": None, "tiled": "tiled"}.get(r["impl"], r["served_by"])
        # the second size is predicted from the first of its series
        assert (r["predicted_s"] is None) == (r["n"] == 16)
    assert "float32" in results["machine"]["matmul_peak"]
    assert any(line.startswith("[1/") for line in lines) and any("matmul peak" in line for line in lines)


def test_kernel_targets_ratios(kernel_results):
    _, results, _ = kernel_results
    target = results["targets"]["1_auto_within_5pct_of_sdpa"]
    served_by_sdpa = [r for r in results["cases"] if r["impl"] == "auto" and r["served_by"] == "sdpa"]
    assert len(target["cases"]) == len(served_by_sdpa)  # every case where SDPA served auto, with its ratio
    for check in target["cases"]:
        key = {k: check[k] for k in ("n", "causal", "dtype", "mode")}
        auto, sdpa = (common.find(results["cases"], impl=impl, **key) for impl in ("auto", "sdpa"))
        assert check["ratio"] == pytest.approx(auto["median_s"] / sdpa["median_s"])
    assert target["pass"] is (None if not served_by_sdpa else target["worst"]["ratio"] <= 1.05)
    # nothing measured at n = 4096 or 16384, nor weights: those targets are not evaluated
    for name in (
        "2_tiled_memory_16384",
        "3_tiled_time_4096",
        "4_return_weights_speed_memory",
        "5_one_head_weights_cost",
    ):
        assert results["targets"][name]["pass"] is None


def test_kernel_reports(kernel_results, tmp_path):
    _, results, _ = kernel_results
    markdown = kernel.write_reports(results, tmp_path, "tiny")
    assert markdown == (tmp_path / "tiny.md").read_text()
    assert markdown.startswith("# Attention kernel benchmark")
    assert "| impl | n | causal | dtype | mode | time ms |" in markdown
    for impl in kernel.IMPLS:
        assert f"| {impl} | 16 | False | float32 | forward |" in markdown
    # the last two columns: the case's time over sdpa's and over the textbook's on the same case
    key = {"n": 32, "causal": True, "dtype": "float32", "mode": "forward"}
    tiled, sdpa, book = (common.find(results["cases"], impl=impl, **key) for impl in ("tiled", "sdpa", "textbook"))
    row = next(line for line in markdown.splitlines() if line.startswith("| tiled | 32 | True | float32 | forward |"))
    assert [cell.strip() for cell in row.split("|")[-3:-1]] == [
        f"{tiled['median_s'] / sdpa['median_s']:.2f}",
        f"{tiled['median_s'] / book['median_s']:.2f}",
    ]
    assert json.loads((tmp_path / "tiny.json").read_text())["cases"] == json.loads(json.dumps(results["cases"]))
    assert (tmp_path / "tiny.png").read_bytes()[:4] == b"\x89PNG"
    path = kernel.write_json(results, tmp_path / "json")
    assert path == tmp_path / "json" / "kernel.json" and json.loads(path.read_text())["complete"] is True


def test_kernel_quick_config():
    quick = kernel.Config.quick_config(budget_s=5.0)
    assert quick.quick and quick.stem == "kernel_quick" and quick.budget_s == 5.0
    assert quick.sizes == (256, 1024) and quick.dtypes == ("float32",)
    assert kernel.Config().stem == "kernel"


# --------------------------------------------------------------------------- layer


def test_layer_run_records(layer_results):
    config, results, lines = layer_results
    assert results["complete"] is True and results["benchmark"] == "layer"
    assert set(results) >= {"machine", "config", "cases", "sanity", "decode", "targets", "elapsed_s"}
    cases = results["cases"]
    expected = {
        (impl, shape, n, mode)
        for impl in layer.IMPLS
        for shape in config.shapes
        for n in config.sizes
        for mode in config.modes
    }
    assert {(r["impl"], r["shape"], r["n"], r["mode"]) for r in cases} == expected
    assert len(cases) == len(expected)
    for r in cases:
        assert r["status"] == "ok", r
        assert r["repeats"] == 1 and r["median_s"] > 0 and r["gflops"] > 0
        assert {
            "warmup_s",
            "peak_mib",
            "memory_call_s",
            "returned_mib",
            "other_cpu_frac",
            "embed_dim",
            "heads",
            "causal",
        } <= set(r)
        # every peer was measured at the same (shape, n, dtype, mode): a ratio to each
        assert set(r["ratios"]) == set(layer.IMPLS) - {r["impl"]}
        for peer, value in r["ratios"].items():
            other = common.find(cases, impl=peer, shape=r["shape"], n=r["n"], dtype=r["dtype"], mode=r["mode"])
            assert value == pytest.approx(r["median_s"] / other["median_s"])
    assert len(results["sanity"]) == len(config.shapes) * len(config.sizes)
    assert all(check["pass"] for check in results["sanity"])
    assert [r["prompt"] for r in results["decode"]] == list(config.decode_prompts)
    for r in results["decode"]:
        assert r["cache"]["per_token_s_median"] > 0 and r["no_cache"]["status"] == "ok"
        assert r["sanity"]["pass"] and r["speedup_cache_vs_no_cache"] > 0
    assert any(line.startswith("sanity ") for line in lines) and any(line.startswith("[decode") for line in lines)


def test_layer_targets(layer_results):
    _, results, _ = layer_results
    targets = results["targets"]
    first = targets["1_multihead_vs_torch_noweights"]
    assert {(c["shape"], c["n"], c["mode"]) for c in first["cases"]} == {
        (r["shape"], r["n"], r["mode"]) for r in results["cases"] if r["impl"] == "multihead"
    }
    assert targets["2_weights_speedup_n2048"]["n"] == 16  # n = 2048 not measured: the largest n instead
    decode = targets["3_decode_flat"]
    assert decode["prompts"] == [8, 16] and decode["ratio"] > 0
    assert targets["sanity"]["pass"] is True


def test_layer_reports(layer_results, tmp_path):
    _, results, _ = layer_results
    markdown = layer.write_reports(results, tmp_path, "tiny")
    assert markdown == (tmp_path / "tiny.md").read_text()
    assert markdown.startswith("# Attention layer benchmark")
    assert "## float32, forward" in markdown and "## float32, forward+backward" in markdown
    for impl in layer.IMPLS:
        assert f"| gpt2-small | 8 | {impl} |" in markdown and f"| gpt2-small | 16 | {impl} |" in markdown
    assert "| prompt | new tokens | cache ms/token |" in markdown
    assert json.loads((tmp_path / "tiny.json").read_text())["targets"]["sanity"]["pass"] is True
    assert (tmp_path / "tiny.png").read_bytes()[:4] == b"\x89PNG"
    path = layer.write_json(results, tmp_path / "json")
    assert path == tmp_path / "json" / "layer.json" and json.loads(path.read_text())["complete"] is True


def test_layer_quick_config():
    quick = layer.Config.quick_config()
    assert quick.quick and quick.stem == "layer_quick" and quick.sizes == (128, 512)
    assert quick.decode_prompts == (128, 512) and quick.decode_new_tokens == 8
    assert layer.Config().stem == "layer"


# --------------------------------------------------------------------------- common


def test_common_helpers():
    assert common.ratio(3.0, 2.0) == 1.5 and common.ratio(None, 2.0) is None and common.ratio(1.0, 0) is None
    assert common.fmt(None, ".1f") == "—" and common.fmt(1.25, ".1f") == "1.2"
    records = [{"status": "skipped", "n": 1}, {"status": "ok", "n": 1}, {"status": "ok", "n": 2}]
    assert common.find(records, n=1) is records[1] and common.find(records, n=3) is None
    assert common.ratio_target("g", [], 1.0) == {"goal": "g", "pass": None, "cases": []}
    target = common.ratio_target("g", [{"ratio": 0.5}, {"ratio": 1.5}], 1.0)
    assert target["worst"] == {"ratio": 1.5} and target["failing"] == [{"ratio": 1.5}] and target["pass"] is False
    assert common.all_pass([]) is None and common.all_pass([{"pass": True}, {"pass": False}]) is False
    assert common.int_list("16,32,") == (16, 32) and common.dtype_list("float32") == ("float32",)
    with pytest.raises(Exception, match="unknown dtype"):
        common.dtype_list("float8")
    assert common.skip_reason(2.0, None, 1.0, None) == "predicted 2 s > budget 1 s"
    assert common.skip_reason(0.5, None, 1.0, None) is None
    assert common.scaled_from_previous(32, None) == (None, None)
    assert common.scaled_from_previous(32, {"n": 16, "median_s": 1.0, "peak_mib": 2.0}) == (4.0, 8.0)


def test_ensure_malloc_env_reexecutes(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "execve", lambda *args: calls.append(args))
    monkeypatch.setenv(common.MALLOC_ENV, "65536")
    common.ensure_malloc_env()
    assert calls == []
    monkeypatch.delenv(common.MALLOC_ENV)
    common.ensure_malloc_env()
    [(executable, argv, env)] = calls
    assert executable == sys.executable and argv == [sys.executable, *sys.orig_argv[1:]]
    assert env[common.MALLOC_ENV] == "65536"


def test_default_out_is_the_checkout_results():
    assert kernel.build_parser().parse_args([]).out == ROOT / "benchmarks" / "results"
    assert layer.build_parser(Path("/x")).parse_args([]).out == Path("/x")


# --------------------------------------------------------------------------- the scripts


@pytest.fixture(scope="module")
def started() -> dict[str, subprocess.Popen]:
    """The subprocesses of the tests below, started together (each spends its time importing torch): the
    kernel script's --help through the re-exec with MALLOC_MMAP_THRESHOLD_, the layer script's with it
    already set (one start fewer), and the suite script's."""
    env = {k: v for k, v in os.environ.items() if k != common.MALLOC_ENV}
    commands = {
        "kernel": ([str(ROOT / "benchmarks" / "kernel.py"), "--help"], env),
        "layer": ([str(ROOT / "benchmarks" / "layer.py"), "--help"], {**env, common.MALLOC_ENV: "65536"}),
        "suite": ([str(ROOT / "benchmarks" / "suite.py"), "--help"], env),
    }
    processes = {
        name: subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=env_, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for name, (args, env_) in commands.items()
    }
    yield processes
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.parametrize("script", ["kernel", "layer"])
def test_script_help(started, script):
    out, err = started[script].communicate(timeout=120)
    assert started[script].returncode == 0, err
    assert out.startswith(f"usage: {script}.py")
    for option in ("--quick", "--budget-s", "--out", "--sizes", "--dtypes"):
        assert option in out


def test_suite_script_help(started):
    out, err = started["suite"].communicate(timeout=120)
    assert started["suite"].returncode == 0, err
    assert out.startswith("usage: suite.py")
    for option in ("--quick", "--only", "--rescore", "--out"):
        assert option in out


def test_a_benchmark_script_checks_its_out_folder_first(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    assert kernel.main(["--quick", "--out", str(tmp_path / "a-file")], reexec=False) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --out: expected a folder") and "which is a file" in err
