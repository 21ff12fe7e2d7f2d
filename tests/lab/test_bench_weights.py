"""benchmarks/weights.py at a tiny size: the four contestants agree and return what they claim, the rounds rotate,
the per-round ratio and the report are built from the measured times. No assertion on time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script and its harness live in benchmarks/, not the package

import weights as bench  # noqa: E402


@pytest.mark.parametrize("mode", bench.MODES)
@pytest.mark.parametrize("shape", list(bench.SHAPES))
def test_contestants_return_per_head_and_averaged_weights(shape, mode):
    calls = bench.contestants(shape, 24, mode)
    causal = bench.SHAPES[shape][2]
    with_floor = mode == "forward" and not causal  # the floor is timed for a full mask's forward only
    assert set(calls) == set(bench.CONTESTANTS) | ({bench.FLOOR} if with_floor else set())
    if mode == "forward":
        out, weights = calls["ours_weights"]()
        _, averaged = calls["torch_weights"]()
        assert weights.shape == (1, 12, 24, 24) and averaged.shape == (1, 24, 24)
        assert calls["ours"]()[1] is None and calls["torch"]()[1] is None
        if causal:  # nothing above the diagonal
            assert torch.equal(weights.triu(1), torch.zeros_like(weights))
        else:  # the floor does the same work: the same output and per-head weights
            floor_out, floor_weights = calls[bench.FLOOR]()
            torch.testing.assert_close(floor_weights, weights[0], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(floor_out, out, atol=1e-5, rtol=1e-5)
    else:
        for name in bench.CONTESTANTS:
            assert calls[name]().requires_grad  # the loss, after its backward ran


def test_rounds_rotate_and_the_ratio_is_per_round():
    order: list[str] = []
    calls = {name: (lambda name=name: order.append(name)) for name in bench.CONTESTANTS}
    times = bench.common.interleaved_rounds(calls, rounds=4)
    assert order[:4] == list(bench.CONTESTANTS)  # the warm-up
    rounds = [order[4 + 4 * r : 8 + 4 * r] for r in range(4)]
    assert [r[0] for r in rounds] == list(bench.CONTESTANTS)  # each starts one later
    summary = bench.summarize(
        {
            "ours_weights": [1.0, 2.0, 1.0],
            "torch_weights": [2.0, 2.0, 1.5],
            "ours": [0.5] * 3,
            "torch": [0.6] * 3,
        }
    )
    assert (summary["speedup"], summary["speedup_min"], summary["speedup_max"]) == (1.5, 1.0, 2.0)
    assert summary["ms"]["ours_weights"] == 1000.0 and len(times["ours"]) == 4
    assert summary["ceiling"] is None  # no floor timed
    with_floor = bench.summarize(
        {"torch_weights": [2.0, 3.0, 1.0], "ours_weights": [1.0] * 3, bench.FLOOR: [1.0, 2.0, 1.0]}
    )
    assert (with_floor["ceiling"]["median"], with_floor["ceiling"]["min"], with_floor["ceiling"]["max"]) == (
        1.5,
        1.0,
        2.0,
    )


def test_the_run_writes_its_table(tmp_path):
    assert bench.main(["--n", "16", "--rounds", "1", "--train-rounds", "1", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "weights.md").read_text()
    assert table.count("| bert-base | 16 |") == 2 and table.count("| gpt2-small | 16 |") == 2
    rows = [line for line in table.splitlines() if line.startswith(("| bert-base", "| gpt2-small"))]
    floors = [row for row in rows if not row.endswith("| — | — | 1 |")]
    assert [row.split(" | ")[:3] for row in floors] == [["| bert-base", "16", "forward"]]  # the only floor timed
    assert "Machine:" in table and (tmp_path / "weights.json").exists()
