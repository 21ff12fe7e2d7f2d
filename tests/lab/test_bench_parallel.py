"""benchmarks/parallel.py's pure parts on synthetic inputs: the /proc parsers, the issue's byte formulas, what an
all-reduce's per-rank bytes say about its algorithm, the summary of ranks' records and the markdown report. No
torchrun, no process, no timing assertion."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script and its harness live in benchmarks/, not the package

import parallel as bench  # noqa: E402

NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier
    lo: 4815329   20108    0    0    0     0          0         0  4815331   20109    0    0    0     0       0
  eth0: 442972337   12768    0    0    0     0          0         0   505342    6185    0    0    0     0       0
"""

PROC_IO = """rchar: 6976
wchar: 123456
syscr: 10
syscw: 3
"""

MHA = bench.Shape("MHA 64/4", 64, 4, 4)
GQA = bench.Shape("GQA 64/4/2", 64, 4, 2)


def test_parse_net_dev_reads_rx_and_tx_of_the_interface():
    assert bench.parse_net_dev(NET_DEV) == (4815329, 4815331)
    assert bench.parse_net_dev(NET_DEV, "eth0") == (442972337, 505342)
    with pytest.raises(KeyError, match="wlan0"):
        bench.parse_net_dev(NET_DEV, "wlan0")


def test_parse_proc_io():
    assert bench.parse_proc_io(PROC_IO) == 123456
    assert bench.parse_proc_io(PROC_IO, "syscw") == 3
    with pytest.raises(KeyError, match="write_bytes"):
        bench.parse_proc_io(PROC_IO, "write_bytes")


def test_counters_read_this_machine():
    if not Path("/proc/net/dev").exists() or not Path("/proc/self/io").exists():
        pytest.skip("no /proc/net/dev or /proc/self/io here")
    assert bench.lo_tx_bytes() >= 0
    assert bench.wchar_bytes() >= 0


def test_formula_sent_bytes():
    b, n, d = 2, 24, 16  # head_dim 64 / 4
    # tp: ring all-reduce 2 (P - 1)/P of the (b, n, D) tensor, forward and backward
    assert bench.formula_sent_bytes("tp", MHA, seq=n, batch=b, world=4) == {
        "forward": 2 * 3 * b * n * 64 * 4 // 4,
        "backward": 2 * 3 * b * n * 64 * 4 // 4,
    }
    # ulysses: (P - 1)/P of q, k, v, out shards (b, n/P, heads d); GQA g = 2 < P = 4: kv heads replicated to 4
    m = n // 4
    assert (
        bench.formula_sent_bytes("ulysses", MHA, seq=n, batch=b, world=4)["forward"] == 3 * b * m * 4 * 4 * d * 4 // 4
    )
    assert bench.formula_sent_bytes("ulysses", GQA, seq=n, batch=b, world=4)["backward"] == (
        3 * b * m * (2 * 4 * d + 2 * 4 * d) * 4 // 4
    )
    assert bench.formula_sent_bytes("ulysses", GQA, seq=n, batch=b, world=2)["forward"] == (
        1 * b * (n // 2) * (2 * 4 * d + 2 * 2 * d) * 4 // 2
    )
    # ring: P - 1 K/V shards forward, 2P - 1 backward; GQA sends only its g kv heads
    shard = b * 2 * m * 2 * d * 4
    assert bench.formula_sent_bytes("ring", GQA, seq=n, batch=b, world=4) == {
        "forward": 3 * shard,
        "backward": 7 * shard,
    }
    for method in bench.METHODS:
        assert bench.formula_sent_bytes(method, MHA, seq=n, batch=b, world=1) == {"forward": 0, "backward": 0}
    with pytest.raises(ValueError, match="unknown method"):
        bench.formula_sent_bytes("allgather", MHA, seq=n, batch=b, world=2)


def test_formula_of_the_2d_cases():
    b, n, d, s = 2, 24, 16, 4
    m = n // 2  # the sequence over cp = 2
    all_reduce = 2 * 1 * b * m * 64 * s // 2  # (b, n/cp, D) float32 over the 2 tp ranks: 2 (t - 1)/t x size
    # ring over cp = 2 with g' = g/2 kv heads: (c - 1) forward, (2c - 1) backward K/V shards (b, g', m, 2d)
    for shape, gl in ((MHA, 2), (GQA, 1)):
        shard = b * gl * m * 2 * d * s
        assert bench.formula_sent_bytes("tp2 x ring2", shape, seq=n, batch=b, world=4) == {
            "forward": all_reduce + shard,
            "backward": all_reduce + 3 * shard,
        }
    # Ulysses over cp = 2, h' = 2: MHA g' = 2 (cp | g'); GQA g' = 1 replicated to G = c = 2
    for shape in (MHA, GQA):
        each = 1 * b * m * (2 * 2 * d + 2 * 2 * d) * s // 2
        assert bench.formula_sent_bytes("tp2 x ulysses2", shape, seq=n, batch=b, world=4) == {
            "forward": all_reduce + each,
            "backward": all_reduce + each,
        }
    assert bench.split_of("tp2 x ring2", 4) == (2, 2, "ring")
    assert bench.split_of("tp", 4) == (4, 1, None) and bench.split_of("ulysses", 2) == (1, 2, "ulysses")
    with pytest.raises(ValueError, match="world"):
        bench.formula_sent_bytes("tp2 x ulysses2", MHA, seq=n, batch=b, world=2)


@pytest.mark.parametrize("method", ["tp2 x ring2", "tp2 x ulysses2"])
@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("shape", [MHA, GQA, bench.MHA, bench.GQA], ids=lambda s: s.name)
def test_the_2d_formula_equals_parallel_cost(method, mode, shape):
    pytest.importorskip("multihead.cost_parallel")
    got = bench.predicted(case(method, mode, shape, seq=48), 4)
    assert got["source"] == "multihead.cost_parallel.parallel_cost", got["source"]
    assert got["sent"] == got["formula_sent"]  # parallel_cost(..., tp=2, cp=2, cp_method=...) and the formula
    assert got["sent"]["forward"] > 0 and (got["sent"]["backward"] > 0) == (mode == "forward+backward")
    assert got["peak_bytes"] > 0


def case(method: str, mode: str, shape: bench.Shape = MHA, seq: int = 24, kind: str = "main") -> dict:
    return {
        "kind": kind,
        "shape": {"name": shape.name, "embed_dim": shape.embed_dim, "num_heads": shape.num_heads,
                  "num_kv_heads": shape.num_kv_heads},
        "method": method,
        "mode": mode,
        "seq": seq,
        "batch": 2,
        "causal": True,
        "repeats": 2,
    }  # fmt: skip


def test_predicted_gives_the_formula_and_the_cost_model_when_present():
    got = bench.predicted(case("ring", "forward"), 4)
    assert got["formula_sent"]["backward"] == 0  # forward mode sends nothing backward
    if got["sent"] is None:
        assert "formula only" in got["source"]
    else:  # the cost model implements the same formulas
        assert got["sent"] == got["formula_sent"]
        assert got["peak_bytes"] > 0
    both = bench.predicted(case("tp", "forward+backward"), 2)
    assert both["formula_sent"]["forward"] == both["formula_sent"]["backward"] > 0


def test_feasible_not_run_and_plan():
    assert bench.feasible("tp", GQA, 4) is not None  # g = 2 cannot split over 4 ranks head-wise
    assert bench.feasible("ulysses", GQA, 4) is None  # kv heads replicated
    assert bench.feasible("ring", GQA, 4) is None
    config = bench.Config(quick=True, batch=1, seq=32, shapes=(MHA, GQA), repeats=1, noop_repeats=1, scale_n0=16)
    assert bench.not_run(config) == [f"GQA 64/4/2 tp at P = 4: {bench.feasible('tp', GQA, 4)}"]
    cases = bench.plan_cases(config, 4)
    assert {(c["shape"]["name"], c["method"]) for c in cases if c["kind"] == "main"} == {
        ("MHA 64/4", "tp"),
        ("MHA 64/4", "ulysses"),
        ("MHA 64/4", "ring"),
        ("GQA 64/4/2", "ulysses"),
        ("GQA 64/4/2", "ring"),
        ("MHA 64/4", "tp2 x ring2"),  # the 2-D cases: P = 4 only; GQA's g/tp = 1 divides cp = 2 for Ulysses
        ("MHA 64/4", "tp2 x ulysses2"),
        ("GQA 64/4/2", "tp2 x ring2"),
        ("GQA 64/4/2", "tp2 x ulysses2"),
    }
    for world in (1, 2):
        methods = {c["method"] for c in bench.plan_cases(config, world) if c["kind"] == "main"}
        assert methods == {"tp", "ulysses", "ring"}, world
    # the library's rules for the 2-D cases: tp | h and g; Ulysses over cp needs cp | h/tp and (cp | g/tp or g/tp | cp)
    odd = bench.Shape("odd 96/6/3", 96, 6, 3)
    assert "tp = 2 must divide" in bench.feasible("tp2 x ring2", odd, 4)
    assert bench.feasible("tp2 x ulysses2", bench.Shape("h6 96/6/6", 96, 6, 6), 4).startswith("Ulysses over cp = 2")
    assert bench.feasible("tp2 x ulysses2", bench.Shape("h8 96/8/8", 96, 8, 8), 4) is None
    odd_config = bench.Config(quick=True, batch=1, seq=32, shapes=(odd,), repeats=1, noop_repeats=1, scale_n0=16)
    assert [line for line in bench.not_run(odd_config) if "x" in line.split(" at ")[0]] == [
        f"odd 96/6/3 tp2 x ring2 at P = 4: {bench.feasible('tp2 x ring2', odd, 4)}",
        f"odd 96/6/3 tp2 x ulysses2 at P = 4: {bench.feasible('tp2 x ulysses2', odd, 4)}",
    ]  # listed at P = 4 only, where they would run
    scaling = [c for c in cases if c["kind"] == "scaling"]
    assert [(c["method"], c["mode"], c["seq"]) for c in scaling] == [
        (method, mode, 64) for method in ("ring", "ulysses", "tp") for mode in ("forward", "forward+backward")
    ]
    single = [(c["method"], c["seq"]) for c in bench.plan_cases(config, 1) if c["kind"] == "single"]
    assert single == [("layer", n) for n in (16, 32, 64) for _ in range(2)]  # the plain layer at n = P x n0
    assert not [c for c in cases if c["kind"] == "single"]  # only in the P = 1 launch
    assert [bench.threads_per_rank(p) for p in (1, 2, 4)] == [2, 1, 1]


def test_all_reduce_evidence():
    size = 1000
    ring = bench.all_reduce_evidence([1500.0, 1502.0, 1499.0, 1501.0], size)
    assert ring["verdict"].startswith("ring volume")
    assert ring["ring_ratios"] == pytest.approx([1.0, 1.0013, 0.9993, 1.0007], abs=1e-3)
    assert bench.all_reduce_evidence([3000.0] * 4, size)["verdict"].startswith("direct")
    assert bench.all_reduce_evidence([1000.0, 1000.0, 3000.0, 1000.0], size)["verdict"].startswith("reduce")
    assert bench.all_reduce_evidence([10.0, 20.0], size)["verdict"].startswith("none")
    assert "P = 2" in bench.all_reduce_evidence([1000.0, 1000.0], size)["verdict"]
    assert bench.all_reduce_evidence([0.0], size)["verdict"].startswith("no communication")


def rank_record(world: int, rank: int, cases: list[dict], sent: int) -> dict:
    """One rank's JSON as the worker writes it: barrier-only windows of 100 lo bytes (rank 0) and 40 written
    bytes; each step sends ``sent`` bytes from every rank."""
    noop = [{"s": 1e-4, "wchar": 40, "lo_tx": 100 if rank == 0 else None}] * 3
    records = []
    for i, c in enumerate(cases):
        steps = [
            {"s": 0.01 * (1 + rank + step), "wchar": 40 + sent, "lo_tx": 100 + world * sent if rank == 0 else None}
            for step in range(3)
        ]
        memory_window = {"s": 0.5, "wchar": 40 + sent, "lo_tx": 100 + world * sent if rank == 0 else None}
        records.append({"case": c, "peak_mib": 10.0 + rank + i, "rss_before_mib": 300.0, "memory_call_s": 0.5,
                        "input_mib": 2.0 / world,
                        "memory_window": memory_window, "steps": steps})  # fmt: skip
    return {"rank": rank, "world": world, "threads": 1, "noop": noop, "noop_end": noop,
            "idle": {"s": 1.0, "wchar": 0, "lo_tx": 500 if rank == 0 else None}, "records": records}  # fmt: skip


def synthetic_results() -> dict:
    cases = [case("tp", "forward"), case("ring", "forward+backward"), case("ring", "forward", seq=48, kind="scaling")]
    rows, launches = [], []
    torch_cp = None
    for world in (1, 2, 4):
        sent = 0 if world == 1 else 2 * (world - 1) * 2 * 24 * 64 * 4 // world  # the tp all-reduce's ring volume
        launch_cases = cases + ([case("tp2 x ring2", "forward")] if world == 4 else [])
        ranks = [rank_record(world, r, launch_cases, sent) for r in range(world)]
        if world == 2:
            for r in ranks:
                r["torch_context_parallel"] = dict(TORCH_CP_ERROR)
        torch_cp = bench.summarise_torch_cp(ranks) or torch_cp
        noop = bench.summarise_noop(ranks)
        for index in range(len(launch_cases)):
            rows.append(bench.summarise_case(ranks, index, noop["lo_tx_median"], noop["wchar_median"]))
        launches.append({"world": world, "threads_per_rank": 1, "noop": noop, "noop_end": noop,
                         "idle_lo_tx_per_s": 500.0, "seconds": 3.0})  # fmt: skip
    config = bench.Config(quick=True, batch=2, seq=24, shapes=(MHA,), repeats=3, noop_repeats=3, scale_n0=24)
    machine = {"processor": "Test CPU", "simd_flags": ["avx2"], "cpu_count": 2, "ram_gib": 1.0, "torch": "x",
               "multihead": "y", "python": "3"}  # fmt: skip
    return {"config": bench.asdict(config), "machine": machine, "load_before": (0.1, 0.2, 0.3), "load_after": None,
            "git": {"commit": "abc1234", "modified": ["src/x.py"]},
            "launches": launches, "not_run": ["nothing at P = 4: because"], "rows": rows,
            "torch_context_parallel": torch_cp, "elapsed_s": 1.0}  # fmt: skip


TORCH_CP_ERROR = {"ran": False, "error_type": "NotImplementedError", "shard": [1, 2, 16, 8],
                  "error": "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a "
                           "sharding strategy registered."}  # fmt: skip


def test_summarise_torch_cp_and_its_line():
    ranks = [{"torch_context_parallel": dict(TORCH_CP_ERROR)} for _ in range(2)]
    got = bench.summarise_torch_cp(ranks)
    assert got["world"] == 2 and got["agree"] and got["error_type"] == "NotImplementedError"
    assert bench.summarise_torch_cp([{}, {}]) is None  # a launch that did not try it
    ranks[1]["torch_context_parallel"] = {**TORCH_CP_ERROR, "error": "something else"}
    assert not bench.summarise_torch_cp(ranks)["agree"]
    line = bench.torch_cp_text(got)
    assert "raised NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu" in line
    assert "not measured" in line and "P = 2" in line
    ran = bench.torch_cp_text({**TORCH_CP_ERROR, "ran": True, "error_type": None, "error": None, "world": 2})
    assert "ran" in ran and "not measured" in ran and "raised" not in ran
    assert "not tried" in bench.torch_cp_text(None)


def test_summarise_case_subtracts_the_barrier_only_bytes_and_takes_the_slowest_rank():
    results = synthetic_results()
    tp2 = next(r for r in results["rows"] if r["world"] == 2 and r["method"] == "tp")
    size = 2 * 24 * 64 * 4
    assert tp2["bytes_per_rank"] == size  # (100 + 2 size - 100) / 2: at P = 2 the ring volume is the tensor
    assert tp2["wchar_per_rank"] == [size, size]
    assert tp2["bytes_ratio"] == pytest.approx(1.0)
    assert tp2["all_reduce"]["verdict"].startswith("ring volume")
    assert tp2["times_s"] == pytest.approx([0.02, 0.03, 0.04])  # per step the slower of the two ranks
    assert tp2["median_s"] == pytest.approx(0.03) and tp2["min_s"] == pytest.approx(0.02)
    assert tp2["peak_mib_per_rank"] == [10.0, 11.0] and tp2["peak_mib"] == 11.0
    tp1 = next(r for r in results["rows"] if r["world"] == 1 and r["method"] == "tp")
    assert tp1["bytes_per_rank"] == 0 and tp1["bytes_ratio"] is None and tp1["all_reduce"] is None


def test_markdown_and_reports(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "plot", lambda results, path: False)  # matplotlib's import alone takes seconds
    results = synthetic_results()
    text = bench.markdown(results)
    assert "Test CPU (avx2)" in text and "before the run 0.10, 0.20, 0.30" in text and "a quiet machine" in text
    assert "abc1234 (working tree: src/x.py modified)" in text
    assert "4 ranks share 2 cores" in text and "make bench-parallel" in text
    assert "| MHA 64/4 | tp | forward | 2 | 24 KiB" not in text  # sizes are written in MiB or bytes
    bytes_rows = [line for line in text.splitlines() if line.startswith("| MHA 64/4 | tp | forward | 2 |")]
    assert len(bytes_rows) == 2  # the bytes table and the memory/time table
    assert bytes_rows[0].endswith("| 1.000 |")
    assert "Not run: nothing at P = 4: because." in text
    assert "HeadParallel()" in text and 'ContextParallel(method="ring", layout="zigzag")' in text
    # the torch context_parallel outcome of the P = 2 launch
    assert (
        "torch's own context parallel (`torch.distributed.tensor.experimental.context_parallel`, a 1-D mesh of "
        "P = 2 gloo ranks" in text
    )
    assert "raised NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu" in text
    # the 2-D case at P = 4 in both tables, and its ratio in the notes
    grid_rows = [line for line in text.splitlines() if line.startswith("| MHA 64/4 | tp2 x ring2 | forward | 4 |")]
    assert len(grid_rows) == 2
    assert "2-D cases (P = 4 on a (cp 2, tp 2) mesh)" in text
    scaling = [line for line in text.splitlines() if line.startswith("| ring | forward | 2 | 48 |")]  # longest n
    # the synthetic ranks send 12288 B each (tp's volume); ring forward predicts one K/V shard, 2 * 4 * 24 * 32 * 4 B
    assert len(scaling) == 1 and scaling[0].endswith("| 0.0117 MiB / 0.0117 MiB / 0.0234 MiB |")
    # P = 1: peak 12 + input 2; P = 2: the larger rank's peak 13 + its half of the input, 1: the same total
    assert "| ring | forward | 1 | 48 | 12.0 | 2.0 | 1.00 |" in text
    assert scaling[0].startswith("| ring | forward | 2 | 48 | 13.0 | 1.0 | 1.00 |")
    written = bench.write_reports(results, tmp_path, "parallel_test")
    assert written == text
    assert (tmp_path / "parallel_test.json").exists() and (tmp_path / "parallel_test.md").read_text() == text


def test_load_verdict():
    assert bench.load_verdict((0.2, 1.0, 1.0)) == "quiet"
    assert bench.load_verdict((3.5, 1.0, 1.0)) == "loaded"
    assert bench.load_verdict(None) == "unknown"


def test_fmt_bytes_and_ratio():
    assert bench.fmt_bytes(None) == "—"
    assert bench.fmt_bytes(0) == "0"
    assert bench.fmt_bytes(512) == "512 B"
    assert bench.fmt_bytes(3 * 2**20) == "3 MiB"
    assert bench.ratio(3.0, 2.0) == 1.5
    assert bench.ratio(3.0, 0) is None and bench.ratio(None, 2.0) is None
