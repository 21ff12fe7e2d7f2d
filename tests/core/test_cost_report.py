"""multihead.cost_report: the tables, JSON and plot of ``multihead cost``, called directly."""

from __future__ import annotations

import io
import sys

import pytest
from rich.console import Console

from multihead._figures import MissingExtraError
from multihead.cost import LayerShape, MachineRates, crossover, estimate, roofline
from multihead.cost_report import cost_json, human_bytes, human_flops, plot_cost, print_cost

RATES = MachineRates({"float32": 100.0}, bandwidth_gbs=10.0, threads=2, measured_at="test")


def printed(report, rates) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    print_cost(report, rates, console)
    return console.file.getvalue()


def test_human_units():
    assert [human_flops(v) for v in (12, 1.5e3, 2e6, 3e9, 4.25e12)] == [
        "12 FLOP",
        "1.50 kFLOP",
        "2.00 MFLOP",
        "3.00 GFLOP",
        "4.25 TFLOP",
    ]
    assert [human_bytes(v) for v in (100, 2048, 3 * 2**20, 2**31)] == ["100 B", "2.00 KiB", "3.00 MiB", "2.00 GiB"]


def test_forward_tables_with_the_roofline():
    report = estimate(LayerShape(512, 8), seq=128)
    text = printed(report, RATES)
    assert text.startswith("embed_dim 512, heads 8 (d=64), batch 1, i=128: forward, float32")
    assert "parameters: 1,050,624 (1,048,576 weights + 2,048 biases; W^Q 262,144, W^K 262,144" in text
    for term, share in (("Q/K/V projections", "66.5%"), ("Q K^T", "5.5%"), ("softmax", "0.2%")):
        line = next(line for line in text.splitlines() if line.strip().startswith(term))
        assert line.rstrip().endswith(share), line
    assert "backward" not in text and "dominant term: Q/K/V projections" in text
    assert f"at n = {crossover(report.shape):.0f}" in text and "take 11% of the FLOPs and the projections 89%" in text
    assert "peak allocated by the layer (multihead on CPU)" in text and "least memory traffic" in text
    limit = roofline(report, RATES)
    assert (
        f"roofline (100.0 GFLOP/s for float32 work, 10.0 GB/s, measured test): at least {limit.bound_s * 1e3:.3f} ms"
        in text
    )
    assert f"{limit.bound_by}-bound" in text and "causal:" not in text


def test_training_decode_and_causal_rows():
    trained = printed(estimate(LayerShape(64, 4), seq=16, mode="forward+backward", causal=True), RATES)
    assert "backward" in trained and "saved for backward" in trained
    assert "causal: a block-skipping kernel needs 53.1% of the Q K^T and weights x V FLOPs" in trained
    decode = printed(estimate(LayerShape(64, 4), seq=1, mode="decode", cache_len=4095), RATES)
    assert "KV cache (4096 tokens)" in decode and "memory-bound" in decode
    weights = printed(estimate(LayerShape(64, 4), seq=16, need_weights=True), None)
    assert "attention weights (b, h, i, j)" in weights and "weights returned" in weights


def test_the_roofline_line_without_a_calibration():
    report = estimate(LayerShape(64, 4), seq=16, dtype="bfloat16")
    assert "roofline: not calibrated on this machine; run `multihead bench --calibrate`" in printed(report, None)
    assert "roofline: bfloat16 not calibrated; run `multihead bench --calibrate --dtype bfloat16`" in printed(
        report, RATES
    )


def test_the_roofline_line_says_where_its_rates_come_from():
    report = estimate(LayerShape(64, 4), seq=16)
    assert "GB/s, measured test): at least" in printed(report, RATES)
    console = Console(file=io.StringIO(), width=200, color_system=None)
    print_cost(report, RATES, console, rates_source="the rates given")
    text = console.file.getvalue()
    assert "100.0 GFLOP/s for float32 work, 10.0 GB/s, the rates given): at least" in text and "measured" not in text


def test_cost_json():
    report = estimate(LayerShape(64, 4, num_kv_heads=2), seq=16, batch=3)
    data = cost_json(report, None)
    assert data == {**report.as_dict(), "crossover_n": crossover(report.shape)}
    limit = roofline(report, RATES)
    with_rates = cost_json(report, RATES)["roofline"]
    assert with_rates["bound_s"] == limit.bound_s and with_rates["bound_by"] == limit.bound_by
    assert with_rates["rates"] == {
        "matmul_gflops": {"float32": 100.0},
        "bandwidth_gbs": 10.0,
        "source": "measured test",
    }
    given = cost_json(report, RATES, rates_source="the rates given")["roofline"]["rates"]
    assert given["source"] == "the rates given"
    assert "roofline" not in cost_json(estimate(LayerShape(64, 4), seq=16, dtype="float64"), RATES)


def test_plot_cost_draws_a_png(tmp_path):
    path = plot_cost(LayerShape(64, 4), tmp_path / "new" / "cost.png", seq=32, batch=2, dtype="float32", mode="forward")
    assert path == tmp_path / "new" / "cost.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="^--plot: expected"):
        plot_cost(
            LayerShape(64, 4),
            tmp_path / "file" / "c.png",
            seq=32,
            batch=1,
            dtype="float32",
            mode="forward",
            argument="--plot",
        )


def test_plot_cost_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'multihead\[plots\]'"):
        plot_cost(LayerShape(64, 4), tmp_path / "cost.png", seq=32, batch=1, dtype="float32", mode="forward")
    assert not (tmp_path / "cost.png").exists()
