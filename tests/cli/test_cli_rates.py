"""`multihead cost --gflops/--memory-gbs`: the rates given price every time the command prints, each labelled as
given, on one rank as across ranks, whatever this machine's calibration says (issue 47, row 9)."""

from __future__ import annotations

import json
import re

import pytest

from multihead.cli import main
from multihead.cost import LayerShape, MachineRates, estimate, roofline
from multihead.cost_parallel import parallel_cost, parallel_time
from multihead.cost_report import _seconds
from multihead.machine import save_calibration

LAYER = ["cost", "--embed-dim", "512", "--heads", "8", "--seq", "4096", "--causal", "--backward"]
GIVEN = MachineRates({"float32": 250.0}, bandwidth_gbs=40.0, threads=0)  # --gflops 250 --memory-gbs 40
CALIBRATED = MachineRates({"float32": 7.0}, bandwidth_gbs=3.0, threads=2, measured_at="2026-01-01 00:00:00")


@pytest.fixture(params=["no calibration", "a calibration of this machine"])
def calibration(request, tmp_path, monkeypatch):
    """Either no calibration cache, or one of this machine with other rates than those given."""
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    if request.param != "no calibration":
        save_calibration(CALIBRATED)
    return request.param


def report():
    return estimate(LayerShape(512, 8), seq=4096, causal=True, mode="forward+backward")


def test_the_rates_given_price_the_single_process_roofline(calibration, capsys):
    assert main([*LAYER, "--gflops", "250", "--memory-gbs", "40"]) == 0
    captured = capsys.readouterr()
    bound = roofline(report(), GIVEN)
    line = next(line for line in captured.out.splitlines() if line.startswith("roofline"))
    assert line == (
        f"roofline (250.0 GFLOP/s for float32 work, 40.0 GB/s, the rates given): at least {_seconds(bound.bound_s)}, "
        f"{bound.bound_by}-bound (compute {_seconds(bound.compute_s)}, memory {_seconds(bound.memory_s)}; "
        f"{bound.arithmetic_intensity:.1f} FLOP/byte vs ridge {bound.ridge_point:.1f})"
    )
    assert "not calibrated" not in captured.out + captured.err and "measured" not in line


def test_the_rates_given_price_every_line_across_ranks(calibration, capsys):
    assert main([*LAYER, "--cp", "4", "--link-gbs", "1", "--gflops", "250", "--memory-gbs", "40"]) == 0
    out = capsys.readouterr().out
    single = roofline(report(), GIVEN)
    cost = parallel_cost(LayerShape(512, 8), seq=4096, cp=4, causal=True, mode="forward+backward")
    timing = parallel_time(cost, GIVEN, link_gbs=1.0)
    assert f"the rates given): at least {_seconds(single.bound_s)}" in out
    assert f"time per rank (the rates given): at least {_seconds(timing.total_s)} " in out
    assert "not calibrated" not in out
    times = [line for line in out.splitlines() if re.search(r"\bat least\b", line)]
    assert len(times) == 2 and all("the rates given" in line for line in times)


def test_the_json_roofline_is_priced_at_the_rates_given(calibration, capsys):
    assert main([*LAYER, "--gflops", "250", "--memory-gbs", "40", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["roofline"]["bound_s"] == roofline(report(), GIVEN).bound_s
    assert data["roofline"]["rates"] == {
        "matmul_gflops": {"float32": 250.0},
        "bandwidth_gbs": 40.0,
        "source": "the rates given",
    }


def test_one_rate_given_takes_the_other_from_the_calibration_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    save_calibration(CALIBRATED)
    assert main([*LAYER, "--gflops", "250"]) == 0
    out = capsys.readouterr().out
    bound = roofline(report(), MachineRates({"float32": 250.0}, CALIBRATED.bandwidth_gbs, threads=0))
    assert (
        f"(250.0 GFLOP/s for float32 work, 3.0 GB/s, --gflops given, measured {CALIBRATED.measured_at}): at least "
        f"{_seconds(bound.bound_s)}"
    ) in out
    assert main([*LAYER, "--memory-gbs", "40"]) == 0
    assert "(7.0 GFLOP/s for float32 work, 40.0 GB/s, --memory-gbs given, measured" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gflops", "250"], "--memory-gbs: expected it beside --gflops (this machine has no calibration"),
        (["--memory-gbs", "40"], "--gflops: expected it beside --memory-gbs"),
        (["--gflops", "0", "--memory-gbs", "40"], "--gflops: expected a positive rate, got 0.0"),
        (["--gflops", "250", "--memory-gbs", "-1"], "--memory-gbs: expected a positive rate, got -1.0"),
        (["--link-gbs", "10"], "--link-gbs: expected --tp or --cp above 1"),
    ],
)
def test_rates_that_cannot_price_a_time_are_one_line(tmp_path, monkeypatch, extra, message, capsys):
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))  # no calibration
    assert main([*LAYER, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
