"""multihead.lab.bench (``multihead bench``): interleaved timing, honest roofline shares, the report and its JSON.

Tiny cases keep this fast; no test asserts on a time, only on how the numbers are taken and derived.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

import multihead
from multihead import backend_rates, machine
from multihead.backends import rates as rate_tables
from multihead.cli import main
from multihead.cost import MachineRates
from multihead.lab import bench
from multihead.lab.bench_report import print_report, rich_tables
from multihead.machine import identity_key, save_calibration

SRC = Path(multihead.__file__).resolve().parent
WRONG = MachineRates({"float32": 1e-6}, bandwidth_gbs=1e-6, threads=2, measured_at="busy")  # far too slow
FAST = MachineRates({"float32": 1e9}, bandwidth_gbs=1e9, threads=2, measured_at="quiet")
TINY = [
    bench.Case("attention", 8, True, "forward+backward", "float32"),
    bench.Case("layer", 4, False, "forward", "float32"),
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    save_calibration(FAST)


def test_the_textbook_peers_compute_attention():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        out, weights = bench.textbook_attention(q, k, v, causal)
        assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        assert weights.shape == (2, 3, 5, 5) and torch.allclose(weights.sum(-1), torch.ones(2, 3, 5, dtype=q.dtype))
    ours, theirs, book = bench.attention_layers(16, 4, torch.float64, seed=3)
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=generator)
    with torch.no_grad():
        expected = ours(x)[0]
        assert torch.allclose(book(x)[0], expected) and torch.allclose(theirs(x, x, x, need_weights=False)[0], expected)
    assert bool(ours.q_proj.bias.abs().sum() > 0)  # nonzero biases, so their mapping is exercised


def test_cases_of_a_quick_run():
    cases = bench.cases(quick=True)
    assert {(c.group, c.n) for c in cases} == {("attention", 256), ("attention", 1024), ("layer", 128), ("layer", 512)}
    assert len(cases) == 2 * 2 * 2 + 2 * 2  # attention: n x causal x mode; layer: n x mode
    assert {c.dtype for c in bench.cases(quick=False, dtypes=("float32", "bfloat16"))} == {"float32", "bfloat16"}
    assert max(c.n for c in bench.cases(quick=False)) == 2048


def test_interleave_rotates_the_order_and_warms_up_every_block():
    calls: list[str] = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "ABC"}
    samples = bench.interleave(steps, rounds=3, block_s=0.0)  # one timed call per block
    assert set(samples) == set("ABC") and all(len(times) == 3 and min(times) > 0 for times in samples.values())
    block = bench.WARMUP_CALLS + 1  # Timer.timeit warms up, then times the block's call
    sizing = ["A"] * block + ["B"] * block + ["C"] * block
    rounds = [name for order in ("ABC", "BCA", "CAB") for name in order for _ in range(block)]
    assert calls == sizing + rounds


def test_a_noisy_run_says_so(monkeypatch):
    steady = {"multihead": [1.0] * 4, "torch SDPA": [2.0] * 4, "textbook": [1.0, 2.0, 3.0, 4.0]}  # ±31% spread
    monkeypatch.setattr(bench, "interleave", lambda steps, rounds, block_s: steady)
    monkeypatch.setattr(bench, "cached_rates", lambda dtypes, recalibrate=False, force=False, say=print: (FAST, False))
    results = bench.run(quick=True, only=TINY[:1], rounds=4, block_s=0.0, say=lambda line: None)
    assert results["notes"] == [
        "1 of 3 times vary by more than ±10% between rounds: something else was probably using the CPU. The "
        "ratios, taken round by round, suffer least; run again on a quiet machine for firmer numbers."
    ]
    assert bench._milliseconds(0.000123) == "0.123" and bench._milliseconds(1.2345) == "1234"


def test_measure_reports_medians_spreads_and_paired_ratios(monkeypatch):
    samples = {"multihead": [1.0, 2.0, 3.0, 4.0, 5.0], "torch SDPA": [2.0, 2.0, 3.0, 8.0, 5.0], "textbook": [1.0] * 5}
    monkeypatch.setattr(bench, "interleave", lambda steps, rounds, block_s: samples)
    record = bench.measure(bench.Case("attention", 8, False, "forward", "float32"), rounds=5, block_s=0.0)
    assert record["served_by"] == multihead.explain(*(torch.randn(1, 16, 8, 64) for _ in range(3))).chosen
    ours = record["peers"]["multihead"]
    assert ours["median_s"] == 3.0 and ours["iqr_s"] == 2.0 and ours["samples_s"] == samples["multihead"]
    assert record["ours_over"]["torch SDPA"] == {"median": 1.0, "low": 0.5, "high": 1.0}  # 0.5 1 1 0.5 1
    assert record["ours_over"]["textbook"] == {"median": 3.0, "low": 1.0, "high": 5.0}
    assert "multihead" not in record["ours_over"]


def run_tiny(monkeypatch, *rates: tuple[MachineRates, bool]) -> dict:
    """bench.run on TINY with the calibrations ``rates`` handed out in turn (instead of the cache)."""
    handed: list[bool] = []

    def cached_rates(dtypes, *, recalibrate=False, force=False, say=print):
        handed.append(recalibrate)
        return rates[len(handed) - 1]

    monkeypatch.setattr(bench, "cached_rates", cached_rates)
    results = bench.run(quick=True, only=TINY, rounds=2, block_s=0.0, say=lambda line: None)
    results["handed"] = handed
    return results


def test_a_share_above_1_is_measured_again_then_withheld_never_printed(monkeypatch):
    results = run_tiny(monkeypatch, (WRONG, False), (WRONG, True))
    assert results["handed"] == [False, True]  # the cached calibration, then measured again once
    shares = [peer["roofline_share"] for r in results["cases"] for peer in r["peers"].values()]
    assert shares and all(share is None for share in shares)  # every time beat WRONG's bound: none is shown
    assert "the calibration was measured again" in results["notes"][0]
    assert results["notes"][1].startswith("roofline share withheld for 6 timing(s)")
    assert "run `multihead bench --calibrate`" in results["notes"][1].lower()
    for _, rows in bench.tables(results):
        assert all(row[-1] == "withheld" for row in rows)


def test_a_right_calibration_after_the_wrong_one_gives_shares_below_1(monkeypatch):
    results = run_tiny(monkeypatch, (WRONG, False), (FAST, True))
    shares = [peer["roofline_share"] for r in results["cases"] for peer in r["peers"].values()]
    assert all(0 < share <= 1 for share in shares)
    assert "measured again" in results["notes"][0] and not any("withheld" in note for note in results["notes"])
    assert results["calibration"]["matmul_gflops"] == FAST.matmul_gflops
    assert results["calibration"]["measured_in_this_run"] is True
    untouched = run_tiny(monkeypatch, (FAST, False))
    assert untouched["handed"] == [False]  # no share above 1: no new calibration
    assert not any("calibration" in note for note in untouched["notes"])  # (a busy machine may add a noise note)


def test_a_cache_not_used_is_a_note_of_the_report(cache, monkeypatch):
    monkeypatch.setattr(machine, "calibrate", lambda dtypes: FAST)
    data = json.loads(machine.calibration_path().read_text())
    data["machine"]["cpu"] = "another CPU"
    machine.calibration_path().write_text(json.dumps(data))
    results = bench.run(quick=True, only=TINY[1:], rounds=1, block_s=0.0, say=lambda line: None)
    assert results["notes"][0].startswith("ignored the calibration cache") and "another CPU" in results["notes"][0]
    assert results["calibration"]["measured_in_this_run"] is True


def test_results_json_and_table(monkeypatch, tmp_path):
    results = run_tiny(monkeypatch, (FAST, False))
    written = bench.write_reports(results, tmp_path)
    assert not written.skipped and [p.name for p in written.values()] == ["bench_quick.json", "bench_quick.png"]
    assert written["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(written["json"].read_text())
    assert data["benchmark"] == "multihead bench" and data["quick"] is True
    assert set(data["machine"]) >= {"cpu", "notable_flags", "flags_hash", "threads", "torch", "description"}
    assert {k: data["machine"][k] for k in ("cpu", "threads", "torch")} == {
        k: v for k, v in identity_key().items() if k != "flags"
    }
    assert set(data["calibration"]) >= {"matmul_gflops", "bandwidth_gbs", "measured_at", "age_s"}
    assert data["method"]["rounds"] == 2 and "interleaved" in data["method"]["order"]
    for record, case in zip(data["cases"], TINY, strict=True):
        assert {k: record[k] for k in ("group", "n", "causal", "mode", "dtype")} == {
            "group": case.group,
            "n": case.n,
            "causal": case.causal,
            "mode": case.mode,
            "dtype": case.dtype,
        }
        assert list(record["peers"]) == list(bench.PEERS[case.group])
        for peer in record["peers"].values():
            assert len(peer["samples_s"]) == 2 and peer["median_s"] > 0 and peer["iqr_s"] >= 0
            assert 0 < peer["roofline_share"] <= 1
        assert set(record["ours_over"]) == set(bench.PEERS[case.group][1:])
        assert record["bound_s"] > 0 and record["bound_by"] in ("compute", "memory")
    (title, rows), (layer_title, layer_rows) = bench.tables(data)
    assert title.startswith("attention, float32: ") and layer_title.startswith("layer, float32: ")
    assert [row[2] for row in rows] == [f"multihead ({data['cases'][0]['served_by']})", "torch SDPA", "textbook"]
    assert [row[2] for row in layer_rows] == ["multihead", "torch MHA", "textbook"]
    assert rows[0][:2] == ["n=8 causal", "fwd+bwd"] and layer_rows[0][:2] == ["n=4", "fwd"]
    assert rows[0][5:7] == ["—", ""] and rows[1][6].count("–") == 1 and len(rows[0]) == len(bench.HEADERS)
    ratio = data["cases"][0]["ours_over"]["torch SDPA"]
    assert rows[1][5:7] == [f"{ratio['median']:.2f}", f"{ratio['low']:.2f}–{ratio['high']:.2f}"]
    assert bench.header_lines(data)[0] == f"machine: {data['machine']['description']}"


def test_without_matplotlib_the_json_is_written_and_the_note_names_the_extra(monkeypatch, tmp_path):
    results = run_tiny(monkeypatch, (FAST, False))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    written = bench.write_reports({**results, "quick": False}, tmp_path)
    assert [p.name for p in written.values()] == ["bench.json"] and not (tmp_path / "bench.png").exists()
    assert written.skipped == {"png": tmp_path / "bench.png"}


def test_the_command_prints_the_machine_the_tables_and_what_it_wrote(cache, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(bench.SIZES, True, {"attention": (8,), "layer": (4,)})
    monkeypatch.setitem(bench.ROUNDS, True, 2)
    monkeypatch.setitem(bench.BLOCK_S, True, 0.0)
    assert main(["bench", "--quick", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "calibration: matmul float32 1000000000.0 GFLOP/s" in out
    for text in (
        "attention, float32",
        "layer, float32",
        "torch SDPA",
        "torch MHA",
        "textbook",
        "ours/peer",
        "roofline",
    ):
        assert text in out, text
    assert f"wrote {(tmp_path / 'out' / 'bench_quick.json').resolve()}" in out
    assert len(json.loads((tmp_path / "out" / "bench_quick.json").read_text())["cases"]) == 6


def test_the_terminal_gets_rich_tables_not_markdown(cache, monkeypatch, tmp_path, capsys):
    """The tables are drawn by rich (a header row over a rule, columns aligned, no markdown pipes), fit 80
    columns, and say each ratio with its range as bench.json has them."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setitem(bench.SIZES, True, {"attention": (8,), "layer": (4,)})
    monkeypatch.setitem(bench.ROUNDS, True, 2)
    monkeypatch.setitem(bench.BLOCK_S, True, 0.0)
    assert main(["bench", "--quick", "--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any("|" in line for line in lines)  # no markdown table: | case | mode | ... | and |---|
    assert not any(re.fullmatch(r"\s*\|?\s*:?-{3,}.*", line) for line in lines)
    report = [line for line in lines if not line.startswith("wrote ")]  # paths stay whole, to copy
    assert max(map(len, report)) <= 80 and "…" not in "\n".join(lines)
    columns = ["case", "mode", "peer", "ms", "±", "ours/peer", "roofline"]
    headers = [i for i, line in enumerate(lines) if line.split() == columns]
    assert len(headers) == 2  # attention and layer
    for i in headers:
        assert set(lines[i + 1].strip()) == {"─"}  # rich's rule under the header
    data = json.loads((tmp_path / "out" / "bench_quick.json").read_text())
    record = data["cases"][0]
    ratio = record["ours_over"]["torch SDPA"]
    row = next(line for line in lines if "torch SDPA" in line)  # the first case's second peer
    assert f"{ratio['median']:.2f} ({ratio['low']:.2f}–{ratio['high']:.2f})" in row
    assert lines[headers[0] + 2].split()[:3] == [record["label"], "fwd", "multihead"]


def dressed_results(monkeypatch, *, served_by: str, ratio: tuple[float, float, float]) -> dict:
    """A tiny run's results dressed as a full run's widest rows: "n=2048 causal", ours served by ``served_by``,
    4-digit milliseconds and every ours/peer ``ratio`` (median, low, high)."""
    results = run_tiny(monkeypatch, (FAST, False))
    for record in results["cases"]:
        record["label"], record["served_by"] = "n=2048 causal", served_by
        for peer in record["peers"].values():
            peer["median_s"], peer["iqr_s"] = 9.999, 9.0
        for peer_ratio in record["ours_over"].values():
            peer_ratio.update(median=ratio[0], low=ratio[1], high=ratio[2])
    return results


@pytest.mark.parametrize("width", [80, 120])
def test_a_full_runs_widest_rows_fit_80_columns_one_line_a_row(monkeypatch, width):
    """The widest a full run writes (backends sdpa or tiled, ratios under 10): one line a row in 80 columns."""
    results = dressed_results(monkeypatch, served_by="tiled", ratio=(1.0, 0.01, 9.99))
    for (title, rows), (rich_title, table) in zip(bench.tables(results), rich_tables(results), strict=True):
        assert rich_title == title
        console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
        console.print(table)
        lines = console.export_text().splitlines()
        assert len(lines) == 2 + len(rows)  # header, rule, one line per row: nothing wrapped
        assert max(map(len, lines)) <= 80 and "…" not in "\n".join(lines)
        assert "1.00 (0.01–9.99)" in lines[3] and "9999" in lines[2]
        firsts = [line[:14].strip() for line in lines[2:]]
        assert firsts == ["n=2048 causal", "", ""] * (len(rows) // 3)  # a case once, over its peers


@pytest.mark.parametrize("width", [80, 70])
def test_wider_cells_wrap_words_never_numbers(monkeypatch, width):
    results = dressed_results(monkeypatch, served_by="materialized", ratio=(10.0, 0.01, 99.99))
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    print_report(results, console)
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= width and "…" not in text
    assert text.count("10.00 (0.01–99.99)") == 2 * len(results["cases"])  # every ratio whole
    assert text.count("9999") == 3 * len(results["cases"])
    assert "multihead (materialized)" not in text and "(materialized)" in text  # the peer wrapped at its space


def test_calibrate_alone_saves_the_rates(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    # each backend's rate for auto, measured small and without compiling flex (the real one takes a minute)
    quick = functools.partial(machine.calibrate_kernels, ("float32",), repeats=1, flex=False)
    monkeypatch.setattr(backend_rates, "KERNEL_CASES", {"float32": (torch.float32, (64, 128))})
    monkeypatch.setattr(machine, "calibrate_kernels", quick)
    # --force: the machine running the tests may be busy (the refusal is tested on injected blocks, below)
    assert main(["bench", "--calibrate", "--force"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("calibrated ") and "float32 matmul" in out and "calibration.json" in out
    assert "backends (float32 forward, GFLOP/s): sdpa " in out
    saved = json.loads((tmp_path / "calibration.json").read_text())
    assert saved["matmul_gflops"]["float32"] > 0 and saved["bandwidth_gbs"] > 0
    assert saved["machine"] == identity_key() and saved["measured_unix"] > 0
    kernel = saved["details"]["kernel_rates"]
    assert set(kernel["gflops"]) == {"sdpa", "sdpa masked", "tiled", "materialized"} and kernel["mask_gbs"] > 0
    assert all(rate > 0 for by_key in kernel["gflops"].values() for rate in by_key.values())
    cached = machine.cached_kernel_rates()  # what machine.measured_policy() reads
    assert cached is not None and cached.fresh_gbs == kernel["fresh_gbs"] > 0
    assert cached.masked_gps == kernel["masked_gps"] > 0
    # flex is not compiled here: its score_mod rate is the default
    assert cached.score_mod_gps == kernel["score_mod_gps"] == rate_tables.DEFAULT_SCORE_MOD_GPS
    assert cached.row_us == kernel["row_us"] and set(kernel["row_us"]) == set(kernel["gflops"])
    assert all(cost >= 0 for by_key in kernel["row_us"].values() for cost in by_key.values())
    # a calibration saved before fresh_gbs, masked_gps, row_us and score_mod_gps were measured still serves, with
    # the defaults
    for measured_later in ("fresh_gbs", "masked_gps", "row_us", "score_mod_gps"):
        del saved["details"]["kernel_rates"][measured_later]
    (tmp_path / "calibration.json").write_text(json.dumps(saved))
    older = machine.cached_kernel_rates()
    assert older is not None and older.mask_gbs == kernel["mask_gbs"]
    defaults = (rate_tables.DEFAULT_FRESH_GBS, rate_tables.DEFAULT_MASKED_GPS, {})
    assert (older.fresh_gbs, older.masked_gps, older.row_us) == defaults
    assert older.score_mod_gps == rate_tables.DEFAULT_SCORE_MOD_GPS
    assert main(["bench", "--calibrate", "--dtype", "int8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dtype: expected one of float32" in err


NOISY = MachineRates(
    {"float32": 1e9},
    bandwidth_gbs=1e9,
    threads=2,
    measured_at="busy",
    details={"block_rates": {"float32 matmul": [1e9, 1e9, 4e8, 6e8, 9e8], "copy": [1e9] * 5}},
)


def test_a_noisy_calibration_serves_the_run_and_is_not_saved(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(machine, "calibrate", lambda dtypes: NOISY)
    results = bench.run(quick=True, only=TINY[1:], rounds=1, block_s=0.0, say=lambda line: None)
    assert results["calibration"]["matmul_gflops"] == NOISY.matmul_gflops  # the shares are scored on it
    assert results["calibration"]["spread_pct"] == {"float32 matmul": pytest.approx(200 / 9), "copy": 0.0}
    assert results["notes"][0].startswith("calibration not saved: expected timed blocks within ±10%")
    assert "got float32 matmul ±" in results["notes"][0] and "--force to keep it" in results["notes"][0]
    assert not (tmp_path / "calibration.json").exists()
    forced = bench.run(quick=True, only=TINY[1:], rounds=1, block_s=0.0, force=True, say=lambda line: None)
    assert not any("not saved" in note for note in forced["notes"]) and (tmp_path / "calibration.json").exists()


def noisy_blocks(stmt, names, min_run_time):
    """machine._block_seconds on a busy machine: the matmuls' blocks stray (±39% over three rounds), the copy's
    agree."""
    return [1.0, 1.0, 2.5, 1.6, 1.1, 3.0] if "torch.mm" in stmt else [1.0] * 5


def test_calibrate_refuses_a_noisy_calibration_in_one_line_unless_forced(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(machine, "_block_seconds", noisy_blocks)
    monkeypatch.setattr(machine, "calibrate_kernels", lambda **kwargs: pytest.fail("the kernels were timed"))
    assert main(["bench", "--calibrate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("multihead bench: error: calibration not saved: expected timed")
    assert "got float32 matmul ±39%, copy ±0%" in err and "Fix: rerun on a quiet machine, or --force to keep it" in err
    assert not (tmp_path / "calibration.json").exists()
    quick = functools.partial(backend_rates.calibrate_kernels, ("float32",), repeats=1, flex=False)
    monkeypatch.setattr(backend_rates, "KERNEL_CASES", {"float32": (torch.float32, (64, 128))})
    monkeypatch.setattr(machine, "calibrate_kernels", quick)
    assert main(["bench", "--calibrate", "--force"]) == 0
    out = capsys.readouterr().out
    assert "(kept with --force, though its timed blocks strayed: float32 matmul ±39%, copy ±0%)" in " ".join(
        out.split()
    )
    saved = json.loads((tmp_path / "calibration.json").read_text())
    expected = machine.spread_pct([1 / t for t in noisy_blocks("torch.mm", {}, 0)] * machine.CALIBRATION_ROUNDS)
    assert saved["details"]["spread_pct"]["float32 matmul"] == pytest.approx(expected)
    assert f"±{machine.NOISY_SPREAD_PCT:.0f}%" in " ".join(main_help("bench").split())


def main_help(command: str) -> str:
    from multihead.cli import build_parser

    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices[command].format_help()


def test_calibration_with_flex_times_its_forward_and_its_score_mod(monkeypatch):
    """With flex compiled (as `multihead bench --calibrate` does), its forward rate and the cost of its score_mod
    adding an ALiBi bias are measured, not left at the defaults."""
    monkeypatch.setattr(backend_rates, "KERNEL_CASES", {"float32": (torch.float32, (64, 128))})
    rates = backend_rates.calibrate_kernels(("float32",), repeats=1, flex=True)
    assert rates.gflops["flex"]["forward float32"] > 0
    assert rates.score_mod_gps > 0 and rates.score_mod_gps != rate_tables.DEFAULT_SCORE_MOD_GPS


def test_the_installed_package_has_no_benchmark_harness():
    """The harness (allocator tuning, a self re-exec, git, full runs) stays in benchmarks/; the package keeps a
    small comparison and the machine measurement."""
    assert not (SRC / "lab" / "bench").exists()
    for name in ("lab/bench.py", "machine.py"):
        source = (SRC / name).read_text()
        assert len(source.splitlines()) < 500, name
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
        }
        assert not imported & {"ctypes", "subprocess", "harness"}, (name, imported)
        for call in ("execve", "mallopt", "clear_refs", "MALLOC_MMAP_THRESHOLD_"):
            assert call not in source, (name, call)


def test_import_multihead_does_not_import_bench():
    modules = "('multihead.lab.bench', 'multihead.machine')"
    check = f"import sys, multihead; print(sorted(m for m in sys.modules if m in {modules}))"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
