"""multihead.cost_parallel and ``multihead cost --tp/--cp``: per-rank FLOPs, memory, bytes sent and time.

The byte formulas are checked here against hand counts of what each method exchanges; the parallel tests
(test_parallel_heads.py, test_parallel_sequence.py) count what the ranks really send against the same functions,
and benchmarks/parallel.py measures the bytes on loopback.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from multihead.cli import main
from multihead.cost import LayerShape, MachineRates, estimate
from multihead.cost_parallel import check_head_split, check_sequence_split, parallel_cost, parallel_time
from support import is_input_error

F32 = 4
RATES = MachineRates({"float32": 100.0, "bfloat16": 1000.0}, bandwidth_gbs=50.0, threads=1)


def test_head_parallel_sends_one_all_reduce_of_the_output_and_one_of_the_input_gradient():
    shape = LayerShape(96, 8, num_kv_heads=4, out_dim=40)
    cost = parallel_cost(shape, seq=10, batch=3, tp=4, mode="forward+backward")
    # ring all-reduce: 2 (P - 1)/P of the tensor per rank
    assert cost.sent_bytes == {"forward": 2 * 3 * 10 * 40 * F32 * 3 // 4, "backward": 2 * 3 * 10 * 96 * F32 * 3 // 4}
    assert cost.collectives == {"all_reduce": 2, "all_to_all": 0, "send": 0}
    assert (cost.heads_per_rank, cost.kv_heads_per_rank, cost.positions_per_rank) == (2, 1, 10)
    # a rank holds h/P heads of W^Q, W^K, W^V and their W^O columns, and the whole W^O bias
    d = 12
    rank_params = 96 * 2 * d + 2 * 96 * 1 * d + 2 * d * 40 + (2 * d + 2 * d + 40)
    assert cost.weight_bytes == rank_params * F32
    assert parallel_cost(shape, seq=10, batch=3, tp=4).sent_bytes["backward"] == 0


def test_ulysses_sends_p_minus_1_over_p_of_q_k_v_and_the_output_each_way():
    shape = LayerShape(64, 8, num_kv_heads=2)  # d = 8; P = 4 > g = 2: each kv head is sent twice
    cost = parallel_cost(
        shape, seq=32, batch=2, cp=4, cp_method="ulysses", mode="forward+backward", layout="contiguous"
    )
    m = 8
    exchanged = 2 * m * (8 * 8 + 4 * 8 + 4 * 8 + 8 * 8) * F32  # q, k and v with 4 kv heads, the output
    assert cost.sent_bytes == {"forward": exchanged * 3 // 4, "backward": exchanged * 3 // 4}
    assert cost.collectives["all_to_all"] == 8
    # g = 4 divides by P = 4: no replication
    plain = parallel_cost(LayerShape(64, 8, num_kv_heads=4), seq=32, batch=2, cp=4, cp_method="ulysses")
    assert plain.sent_bytes["forward"] == exchanged * 3 // 4


def test_ring_sends_p_minus_1_kv_shards_forward_and_2p_minus_1_backward():
    shape = LayerShape(64, 8, num_kv_heads=2, value_head_dim=5)
    cost = parallel_cost(shape, seq=48, batch=2, cp=3, causal=True, mode="forward+backward")
    shard = 2 * 2 * 16 * (8 + 5) * F32  # b g (n/P) (d + e) s
    assert cost.kv_shard_bytes == shard
    assert cost.sent_bytes == {"forward": 2 * shard, "backward": 5 * shard}
    assert cost.collectives == {"all_reduce": 0, "all_to_all": 0, "send": 2 + 5}


def test_both_splits_add_their_traffic_on_the_local_heads():
    shape = LayerShape(64, 8)
    both = parallel_cost(shape, seq=64, tp=2, cp=4, causal=True)
    ring = parallel_cost(LayerShape(64, 4, head_dim=8), seq=64, cp=4, causal=True)  # one head shard's ring
    tp = parallel_cost(shape, seq=16, tp=2)  # the all-reduce of one sequence shard
    assert both.sent_bytes["forward"] == ring.sent_bytes["forward"] + tp.sent_bytes["forward"]
    assert both.all_reduce_bytes == tp.all_reduce_bytes
    assert both.world_size == 8
    # tensor parallelism inside a node (fast link), the ring across nodes: the all-reduce runs on the fast link
    slow, fast = (parallel_time(both, RATES, 1.0, tp_link_gbs=link) for link in (1.0, 100.0))
    assert slow.exposed_s - fast.exposed_s == pytest.approx(both.all_reduce_bytes / 1e9 - both.all_reduce_bytes / 1e11)
    assert slow.crossover_seq == fast.crossover_seq == parallel_time(ring, RATES, 1.0).crossover_seq


@pytest.mark.parametrize(
    "split", [{"tp": 2}, {"cp": 4, "cp_method": "ulysses"}, {"cp": 4}, {"tp": 2, "cp": 2}], ids=str
)
def test_each_rank_does_one_pth_of_the_work_and_ring_recomputes_its_blocks(split):
    shape = LayerShape(64, 4)
    single = estimate(shape, seq=64, causal=True, mode="forward+backward")
    cost = parallel_cost(shape, seq=64, causal=True, mode="forward+backward", **split)
    world = cost.world_size
    recompute = cost.attention_flops["forward"] * world if split.get("cp", 1) > 1 and "cp_method" not in split else 0
    assert abs(cost.flops * world - (single.needed_flops + recompute)) < world
    assert cost.peak_bytes < single.bytes.peak  # the model: each rank holds less than the whole layer's peak
    forward = parallel_cost(shape, seq=64, causal=True, **split)
    assert forward.sent_bytes["backward"] == 0 and forward.flops < cost.flops


def test_ring_peak_per_rank_falls_with_p_so_the_longest_sequence_grows():
    shape = LayerShape(512, 8)
    peaks = [parallel_cost(shape, seq=4096, cp=p, causal=True).peak_bytes for p in (1, 2, 4, 8)]
    # P = 2 pays for the K/V shard in flight and the packed copy it sends: about the saving of halving n
    assert peaks[1:] == sorted(peaks[1:], reverse=True) and peaks[0] > 3 * peaks[3]
    # P ranks at P times the sequence need the same per rank whatever P: the longest sequence grows P times
    # (over one process, the ring's buffers cost a constant factor: the K/V block in flight and the merge's partials)
    scaled = [parallel_cost(shape, seq=4096 * p, cp=p, causal=True).peak_bytes for p in (2, 4, 8)]
    assert max(scaled) < 1.05 * min(scaled) and scaled[0] < 3 * peaks[0], scaled


def test_ring_time_hides_the_sends_from_the_crossover_on():
    shape = LayerShape(256, 4)
    cost = parallel_cost(shape, seq=4096, cp=4, causal=True)
    timing = parallel_time(cost, RATES, link_gbs=0.1)
    n_star = timing.crossover_seq
    assert n_star is not None and n_star > 0
    below, above = (parallel_time(parallel_cost(shape, seq=n, cp=4, causal=True), RATES, 0.1) for n in (4096, 65536))
    assert (below.hidden, above.hidden) == (n_star <= 4096, n_star <= 65536)
    assert not below.hidden and above.hidden  # this link puts the crossover between them
    assert above.exposed_s == 0 and below.exposed_s > 0
    assert below.total_s == pytest.approx(below.local.bound_s + below.exposed_s)
    assert below.communication_s == pytest.approx(cost.sent_bytes["forward"] / 0.1e9)


def test_head_parallel_and_ulysses_communication_is_all_exposed():
    shape = LayerShape(256, 4)
    for split in ({"tp": 4}, {"cp": 4, "cp_method": "ulysses"}):
        cost = parallel_cost(shape, seq=1024, mode="forward+backward", **split)
        timing = parallel_time(cost, RATES, link_gbs=10.0)
        assert timing.exposed_s == pytest.approx(cost.total_sent_bytes / 10e9)
        assert timing.crossover_seq is None and not timing.hidden


def test_refusals_name_the_argument():
    shape = LayerShape(64, 8, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"tp: .*num_heads = 8 and num_kv_heads = 4.*\[1, 2, 4\]") as caught:
        parallel_cost(shape, seq=16, tp=3)
    assert is_input_error(caught.value, ValueError)
    with pytest.raises(ValueError, match=r"seq: .*divisible by 8.*n = 20.*pad the sequence to 24"):
        parallel_cost(shape, seq=20, cp=4)  # zigzag: 2 chunks per rank
    assert parallel_cost(shape, seq=20, cp=4, layout="contiguous").positions_per_rank == 5
    with pytest.raises(ValueError, match=r"cp: .*h = 8, g = 4, P = 3"):
        parallel_cost(shape, seq=24, cp=3, cp_method="ulysses")
    with pytest.raises(ValueError, match=r"cp: .*kv heads .*h = 12, g = 4, P = 6"):
        parallel_cost(LayerShape(96, 12, num_kv_heads=4), seq=24, cp=6, cp_method="ulysses")
    with pytest.raises(ValueError, match="shape: expected a self-attention layer"):
        parallel_cost(LayerShape(64, 8, kdim=32), seq=16, cp=2)
    with pytest.raises(ValueError, match="mode: .*decode"):
        parallel_cost(shape, seq=16, mode="decode")
    with pytest.raises(ValueError, match="cp_method"):
        parallel_cost(shape, seq=16, cp=2, cp_method="tree")
    with pytest.raises(ValueError, match="link_gbs"):
        parallel_time(parallel_cost(shape, seq=16, cp=2), RATES, link_gbs=0)
    with pytest.raises(TypeError, match="shape"):
        parallel_cost((64, 8), seq=16)  # type: ignore[arg-type]
    check_head_split(8, 4, 2)
    assert check_sequence_split(12, 3) == 4


CLI = ["cost", "--embed-dim", "512", "--heads", "8", "--kv-heads", "2", "--seq", "4096", "--causal", "--backward"]


def test_cli_prints_the_per_rank_table_and_the_time(capsys):
    assert main([*CLI, "--cp", "4", "--link-gbs", "1", "--gflops", "100", "--memory-gbs", "50"]) == 0
    out = capsys.readouterr().out
    assert "Across 4 ranks: sequence over cp = 4 (ring), per rank" in out
    cost = parallel_cost(LayerShape(512, 8, num_kv_heads=2), seq=4096, cp=4, causal=True, mode="forward+backward")
    assert "3 send" not in out and "10 send" in out  # 3 forward + 7 backward
    timing = parallel_time(cost, RATES, link_gbs=1.0)
    assert f"the sends hide from n = {timing.crossover_seq:,.0f} on" in out
    assert "time per rank (the rates given): at least" in out


def test_cli_json_has_the_parallel_part(capsys):
    assert main([*CLI, "--tp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parallel"]["tp"] == 2 and data["parallel"]["collectives"]["all_reduce"] == 2
    assert "time" not in data["parallel"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tp", "3"], "--tp: expected a group size P that divides --heads = 8 and --kv-heads = 2"),  # CLI spelling
        (["--cp", "2", "--cp-method", "ulysses", "--kv-heads", "1", "--heads", "3", "--embed-dim", "513"], "cp:"),
        (["--link-gbs", "10"], "--link-gbs: expected --tp or --cp above 1"),
        (["--cp", "2", "--tp-link-gbs", "10"], "--tp-link-gbs: expected --link-gbs as well"),
        (["--cp", "2", "--link-gbs", "-1", "--gflops", "1", "--memory-gbs", "1"], "--link-gbs: expected a positive"),
        (["--cp", "2", "--need-weights"], "--tp/--cp: expected self-attention"),
    ],
)
def test_cli_errors_are_one_line(extra, message, capsys):
    assert main([*CLI, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_docs_planning_table_is_the_scripts_output():
    """docs/parallel.md carries scripts/parallel_plan.py's table, so the page says what the cost model says."""
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("parallel_plan", root / "scripts" / "parallel_plan.py")
    assert spec is not None and spec.loader is not None
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    page = (root / "docs" / "parallel.md").read_text()
    carried = page.split("<!-- parallel-plan: begin -->\n")[1].split("\n<!-- parallel-plan: end -->")[0]
    assert carried == plan.table()
