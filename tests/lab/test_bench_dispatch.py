"""benchmarks/dispatch.py's pure parts on synthetic records: the skip prediction, the rounds, the rotation, the
measured and predicted winners, auto / best, the run's verdict and the markdown tables. No timing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script and its harness live in benchmarks/, not the package

import dispatch as bench  # noqa: E402

from multihead.machine import measure_peak_bytes  # noqa: E402


def record(mask="window", n=1024, dtype="float32", mode="forward", times=None, chosen="tiled", estimates=None):
    """A measured case: seconds per round for each contestant."""
    times = times or {
        "sdpa": [0.30, 0.20, 0.25],
        "tiled": [0.10, 0.12, 0.11],
        "flex": [0.05, 0.06, 0.07],
        "auto": [0.11, 0.10, 0.13],
        bench.SDPA_PEER: [0.09, 0.08, 0.10],
        bench.FLEX_PEER: [0.04, 0.05, 0.04],
    }
    estimates = {"sdpa": 0.5, "tiled": 0.2, "flex": 0.1} if estimates is None else estimates
    return {
        "mask": mask,
        "n": n,
        "dtype": dtype,
        "mode": mode,
        "status": "ok",
        "times": times,
        "chosen": chosen,
        "estimates": estimates,
        "skipped": {},
        "rounds": 3,
    }


def test_predict_from_previous_n_scales_by_n_squared():
    seconds, source = bench.predict_seconds(4096, {"n": 1024, "median_s": 0.5}, estimate_s=99.0)
    assert seconds == pytest.approx(0.5 * 16)
    assert "n=1024" in source


def test_predict_uses_a_skipped_series_prediction_then_the_estimate_then_nothing():
    assert bench.predict_seconds(2048, {"n": 1024, "median_s": None, "predicted_s": 3.0}, None)[0] == 12.0
    assert bench.predict_seconds(1024, None, 0.25) == (0.25, "estimate")
    assert bench.predict_seconds(1024, None, None) == (None, "unknown")


def test_skip_reason_names_time_and_memory():
    assert bench.skip_reason(5.0, 0, budget_s=20.0, ram=2**34) is None
    assert bench.skip_reason(None, 0, budget_s=20.0, ram=None) is None
    why = bench.skip_reason(30.0, 2**34, budget_s=20.0, ram=2**34)
    assert "predicted 30 s > budget 20 s" in why
    assert "dense mask 16.0 GiB > 50% of 16 GiB" in why


def test_our_backends_dense_masks_count_in_the_ram_check(monkeypatch):
    """The sdpa backend builds ALiBi's (1, h, n, n) bias itself, at the size its estimate counts (16 GiB at
    n = 16384 in float32); torch SDPA given the prebuilt bias peaks at twice that. Each is skipped on its own
    peak. Two runs were killed: one before our backends' masks counted at all, one while the bias was built in
    float32 and cast, at three times the bfloat16 size counted."""
    import torch

    n = 512
    _, _, own = bench.explain("alibi", n, torch.float32, False)
    assert own["sdpa"] == bench.HEADS * n * n * 4 and own["tiled"] == 0
    assert bench.dense_mask_bytes("alibi", n) == 2 * own["sdpa"]
    config = bench.Config(sizes=(n,), dtypes=("float32",), masks=("alibi",), repeats=1, backends=("sdpa", "tiled"))
    # half of RAM, 24 MiB, lies between our bias (16) and the peer's peak (32): the peer alone is skipped
    monkeypatch.setattr(bench.common, "ram_bytes", lambda: 3 * own["sdpa"])
    record = bench.run_case(config, "alibi", n, "float32", "forward", {}, None, {"failed": {}})
    assert set(record["skipped"]) == {bench.SDPA_PEER} and "dense mask" in record["skipped"][bench.SDPA_PEER]
    assert record["status"] == "ok" and {"sdpa", "tiled"} <= set(record["stats"])
    # half of RAM, 12 MiB, is below our bias too: our sdpa is skipped, naming its dense mask
    monkeypatch.setattr(bench.common, "ram_bytes", lambda: 3 * own["sdpa"] // 2)
    record = bench.run_case(config, "alibi", n, "float32", "forward", {}, None, {"failed": {}})
    assert set(record["skipped"]) == {"sdpa", bench.SDPA_PEER} and "dense mask" in record["skipped"]["sdpa"]
    assert record["status"] == "ok" and record["chosen"] != "sdpa" and "tiled" in record["stats"]


def test_repeats_shrink_to_fit_the_case_budget_but_never_below_one():
    assert bench.repeats_for(None, 60.0, 5) == 5
    assert bench.repeats_for(1.0, 60.0, 5) == 5
    assert bench.repeats_for(25.0, 60.0, 5) == 2
    assert bench.repeats_for(100.0, 60.0, 5) == 1


def test_rotation_puts_each_contestant_first_in_turn():
    names = ["a", "b", "c"]
    assert [bench.rotation(names, r)[0] for r in range(4)] == ["a", "b", "c", "a"]
    assert sorted(bench.rotation(names, 2)) == names
    assert bench.rotation([], 3) == []


def test_summarize_winner_auto_over_best_and_prediction():
    r = bench.summarize(record())
    assert r["stats"]["tiled"] == {"median_s": 0.11, "min_s": 0.10, "max_s": 0.12, "repeats": 3}
    assert r["winner"] == "flex"  # among multihead's backends only
    assert r["best_with_peers"] == bench.FLEX_PEER
    assert r["auto_over_best"] == pytest.approx(0.11 / 0.06)
    assert r["auto_over_best_with_peers"] == pytest.approx(0.11 / 0.04)
    assert r["auto_picked_winner"] is False
    assert r["predicted"] == "flex" and r["prediction_right"] is True
    assert r["measured_over_estimated"] == pytest.approx({"sdpa": 0.5, "tiled": 0.55, "flex": 0.6})


def test_summarize_without_estimates_predicts_nothing():
    r = bench.summarize(record(estimates={}, chosen="sdpa"))
    assert r["predicted"] is None and r["prediction_right"] is None
    assert r["measured_over_estimated"] == {}


def test_overall_counts_and_worst_ratio():
    good = bench.summarize(
        record(mask="causal", times={"sdpa": [0.1], "tiled": [0.2], "auto": [0.105]}, chosen="sdpa",
               estimates={"sdpa": 0.1, "tiled": 0.4})
    )  # fmt: skip
    bad = bench.summarize(record())
    skipped = {"mask": "none", "n": 16384, "dtype": "float32", "mode": "forward", "status": "skipped", "reason": "x"}
    verdict = bench.overall([good, bad, skipped])
    assert verdict["cases"] == 2
    assert verdict["auto_picked_winner"] == 1
    assert verdict["prediction_right"] == 2 and verdict["predicted"] == 2
    assert verdict["worst_auto_over_best"] == pytest.approx(0.11 / 0.06)
    assert "causal & window(256), n=1024" in verdict["worst_case"]
    assert verdict["within_10pct"] == 1 and verdict["goal_met"] is False
    assert verdict["measured_over_estimated"]["tiled"]["cases"] == 2
    assert verdict["measured_over_estimated"]["tiled"]["min"] == pytest.approx(0.5)


def test_overall_of_nothing_measured():
    verdict = bench.overall([])
    assert verdict["cases"] == 0 and verdict["goal_met"] is None and verdict["worst_auto_over_best"] is None


def test_case_table_rows_columns_and_marks():
    measured = bench.summarize(record())
    measured["skipped"] = {"materialized": "predicted 30 s > budget 20 s"}
    skipped = {"mask": "alibi", "n": 16384, "dtype": "float32", "mode": "forward", "status": "skipped",
               "reason": "auto (tiled) predicted 40 s > budget 20 s"}  # fmt: skip
    lines = bench.case_table([measured, skipped])
    header = lines[0]
    assert header.index("sdpa") < header.index("tiled") < header.index("flex") < header.index("materialized")
    assert header.index("materialized") < header.index("torch sdpa") < header.index("torch flex")
    row = lines[2]
    assert row.startswith("| causal & window(256) | 1024 | 250 (200–300) | 110 (100–120) | 60 (50–70) | skipped |")
    assert "**1.83**" in row and "| flex | yes |" in row
    assert "skipped: auto (tiled) predicted 40 s" in lines[3]
    assert all(line.count("|") == header.count("|") for line in lines)


def test_single_round_is_marked_k1():
    assert bench._ms({"median_s": 1.5, "min_s": 1.5, "max_s": 1.5, "repeats": 1}) == "1,500 (k=1)"


def test_markdown_report_has_tables_verdict_and_skips():
    measured = bench.summarize(record())
    measured["skipped"] = {"materialized": "predicted 30 s > budget 20 s"}
    backward = bench.summarize(
        record(mode="forward+backward", times={"sdpa": [0.3], "tiled": [0.4], "auto": [0.31]}, chosen="sdpa",
               estimates={"sdpa": 0.2, "tiled": 0.5})
    )  # fmt: skip
    results = {
        "config": {"quick": True, "dtypes": ["float32"], "modes": ["forward", "forward+backward"]},
        "machine_line": "AMD EPYC (2 CPUs; fma avx avx2)",
        "load": {"start": "load average: 1.0", "end": "load average: 2.0"},
        "elapsed_s": 12.0,
        "compile_s": {"torch flex (window, float32)": 11.5},
        "records": [measured, backward],
    }
    results["overall"] = bench.overall(results["records"])
    text = bench.markdown_report(results)
    assert "## float32, forward\n" in text and "## float32, forward+backward\n" in text
    assert "auto picked the measured winner in 1 of 2 measured cases" in text
    assert "Goal (every row within 10%): **FAIL**" in text
    assert "| torch flex (window, float32) | 11.5 |" in text
    assert "| materialized | predicted 30 s > budget 20 s |" in text
    assert "AMD EPYC (2 CPUs; fma avx avx2)" in text
    assert "Not timed" not in text  # every backend was (the config predates --backends)
    results["config"]["backends"] = ["sdpa", "tiled", "reference"]
    assert "Not timed (`--backends`): flex, materialized; 'best' is over the backends timed." in (
        bench.markdown_report(results)
    )


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        (
            "--backends",
            "tiled,fast",
            "--backends: unknown ['fast'] in 'tiled,fast'; choose from sdpa,tiled,flex,materialized",
        ),
        ("--backends", "reference", "--backends: unknown ['reference']"),  # the oracle is --reference
        ("--masks", "causal,sliding", "--masks: unknown ['sliding'] in 'causal,sliding'; choose from causal,window"),
        ("--modes", ",", "--modes: no name in ','; choose from forward,forward+backward"),
    ],
)
def test_name_options_refuse_unknown_names_before_running(tmp_path, capsys, option, value, message):
    assert bench.main([option, value, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_option_names_keeps_the_order_given():
    assert bench.option_names("--backends", "tiled,sdpa,", bench.OWN) == ("tiled", "sdpa")


def test_error_text_is_one_table_safe_line():
    text = bench.error_text(RuntimeError("C++ compile error | x\n\nCommand: g++ ..."))
    assert text == "error: RuntimeError: C++ compile error / x"


@pytest.mark.parametrize("kind", bench.MASKS)
def test_the_sdpa_peer_gets_the_same_mask_as_multihead(kind):
    import torch

    import multihead

    n = 300
    q, k, v = (torch.randn(1, bench.HEADS, n, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ours = multihead.attention(q, k, v, backend="reference", **bench.mask_arguments(kind, n))
    torch.testing.assert_close(bench.sdpa_peer(kind, n, torch.float32)(q, k, v), ours, atol=1e-5, rtol=1e-5)


def test_dense_mask_sizes_and_unknown_kind():
    import torch

    assert bench.dense_mask("causal", 64, torch.float32) is None
    assert bench.dense_mask("none", 64, torch.float32) is None
    assert bench.dense_mask_bytes("window", 1024) == 1024**2
    for dtype in (torch.float32, torch.bfloat16):  # the peer's ALiBi bias peaks at its float32 product and copy
        peak = measure_peak_bytes(lambda dtype=dtype: bench.dense_mask("alibi", 256, dtype))
        assert bench.dense_mask_bytes("alibi", 256) <= peak <= 1.1 * bench.dense_mask_bytes("alibi", 256)
    with pytest.raises(ValueError, match="mask kind 'diagonal'"):
        bench.mask_arguments("diagonal", 64)


def test_bfloat16_auto_is_compared_with_float32_auto_case_by_case():
    single = bench.summarize(record(dtype="float32", times={"auto": [0.2, 0.2, 0.2], "tiled": [0.2] * 3}))
    half = bench.summarize(record(dtype="bfloat16", times={"auto": [0.1, 0.1, 0.1], "tiled": [0.1] * 3}))
    slower = bench.summarize(record(n=4096, dtype="bfloat16", times={"auto": [0.5] * 3, "tiled": [0.5] * 3}))
    alone = bench.summarize(record(mask="alibi", dtype="bfloat16", times={"auto": [0.1] * 3, "tiled": [0.1] * 3}))
    rows = bench.half_against_float32([single, half, slower, alone])
    assert [(row["n"], row["ratio"]) for row in rows] == [(1024, 0.5)]  # no float32 twin: no row
    table = "\n".join(bench.half_table(rows))
    assert "| 0.50 |" in table
    slower_twin = bench.summarize(record(n=4096, dtype="float32", times={"auto": [0.25] * 3, "tiled": [0.25] * 3}))
    assert "**2.00**" in "\n".join(bench.half_table(bench.half_against_float32([slower, slower_twin])))


def test_auto_under_each_rate_table_is_timed_against_the_same_best():
    """--compare-kinds: "auto as <kind>" runs beside auto in the same rounds; each is a ratio to the measured
    winner among multihead's backends (never a peer nor the best itself), and the run sums them up per table."""
    times = {**record()["times"], "auto as cpu-avx2": [0.30, 0.20, 0.25]}
    r = bench.summarize({**record(), "times": times})
    assert r["winner"] == "flex" and r["best_with_peers"] == bench.FLEX_PEER  # auto as <kind> is no contestant
    assert r["tables_over_best"] == pytest.approx({"auto": 0.11 / 0.06, "auto as cpu-avx2": 0.25 / 0.06})
    verdict = bench.overall([r])
    assert verdict["tables_over_best"]["auto as cpu-avx2"] == {
        "cases": 1,
        "median": pytest.approx(0.25 / 0.06),
        "worst": pytest.approx(0.25 / 0.06),
        "within_10pct": 0,
    }
    results = {
        "config": {"quick": True, "dtypes": ["float32"], "modes": ["forward"]},
        "machine_line": "AMD EPYC (2 CPUs; fma avx avx2)",
        "load": {"start": "load average: 1.0", "end": "load average: 1.0"},
        "elapsed_s": 1.0,
        "compile_s": {},
        "records": [r],
        "overall": verdict,
    }
    assert "| auto as cpu-avx2 | 1 | 4.167 | 4.17 | 0 of 1 |" in bench.markdown_report(results)
