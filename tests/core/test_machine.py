"""multihead.machine: what the machine is, its calibration and the cache keyed on it, and the peak-memory probe."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from multihead import machine
from multihead.cost import MachineRates
from multihead.machine import (
    MAX_AGE_S,
    age_text,
    cached_rates,
    calibrate,
    identity,
    identity_key,
    measure_peak_bytes,
    read_calibration,
    save_calibration,
)

MIB = 2**20
RATES = MachineRates({"float32": 100.0}, bandwidth_gbs=10.0, threads=2, measured_at="test")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty calibration cache of this test's own."""
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "calibration.json"


def test_identity_names_the_cpu_its_flags_and_threads():
    me = identity()
    assert me.cpu and me.threads == torch.get_num_threads() and me.torch == torch.__version__
    assert me.torch_isa == torch.backends.cpu.get_cpu_capability()
    assert set(me.notable_flags) <= set(machine.NOTABLE_FLAGS)
    assert me.cpu in me.describe() and f"{me.threads} threads" in me.describe()
    assert identity_key(me) == {"cpu": me.cpu, "flags": me.flags_hash, "threads": me.threads, "torch": me.torch}
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert identity_key()["threads"] == 1  # a calibration is only good for the threads it was measured with
    finally:
        torch.set_num_threads(saved)


def test_save_stamps_this_machine_and_read_gives_it_back(cache):
    path = save_calibration(RATES)
    assert path == cache
    rates, note = read_calibration()
    assert note is None and rates is not None
    assert (rates.matmul_gflops, rates.bandwidth_gbs, rates.threads, rates.measured_at) == (
        RATES.matmul_gflops,
        RATES.bandwidth_gbs,
        RATES.threads,
        RATES.measured_at,
    )
    assert rates.machine == identity_key() and rates.measured_unix is not None
    assert read_calibration(cache.parent / "missing.json") == (None, None)


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"machine": {"cpu": "another CPU"}}, "measured on another machine or setup (cpu 'another CPU'"),
        ({"machine": {"threads": 64}}, "threads 64, here"),
        ({"machine": {"flags": "0123456789abcdef"}}, "flags '0123456789abcdef'"),
        ({"machine": {"torch": "1.0"}}, "torch '1.0'"),
        ({"age_s": MAX_AGE_S + 3600}, "old (older than 30 days)"),
        ({"age_s": -2 * 86400}, "its time is in the future"),
        ({"unstamped": True}, "does not say which machine"),
    ],
)
def test_a_cache_for_another_machine_or_too_old_is_ignored_with_a_note(cache, change, fragment):
    save_calibration(RATES)
    data = json.loads(cache.read_text())
    data["machine"].update(change.get("machine", {}))
    data["measured_unix"] -= change.get("age_s", 0)
    if change.get("unstamped"):
        del data["machine"], data["measured_unix"]
    cache.write_text(json.dumps(data))
    rates, note = read_calibration()
    assert rates is None
    assert note.startswith(f"ignored the calibration cache {cache}: ") and fragment in note, note
    assert "multihead bench --calibrate" in note


def test_a_damaged_cache_is_ignored_with_a_note(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text('{"matmul_gflops": {"float32": "fast"}')
    rates, note = read_calibration()
    assert rates is None and note.startswith("ignored the calibration cache (") and "not valid JSON" in note
    cache.write_text('{"matmul_gflops": {"float32": -1}, "bandwidth_gbs": 5, "threads": 2}')
    assert "positive finite number" in read_calibration()[1]


def test_cached_rates_use_the_cache_or_measure_and_save(cache, monkeypatch):
    measured = MachineRates({"float32": 50.0, "bfloat16": 5.0}, 20.0, 2, "now")
    asked: list[list[str]] = []
    monkeypatch.setattr(machine, "calibrate", lambda dtypes: asked.append(list(dtypes)) or measured)
    lines: list[str] = []
    save_calibration(RATES)
    rates, fresh = cached_rates(["float32"], say=lines.append)
    assert not fresh and rates.matmul_gflops == RATES.matmul_gflops and asked == [] and lines == []
    rates, fresh = cached_rates(["bfloat16"], say=lines.append)  # a dtype the cache lacks: measured, with float32
    assert fresh and rates is measured and asked == [["bfloat16", "float32"]]
    assert read_calibration()[0].matmul_gflops == measured.matmul_gflops  # and saved
    assert any("calibrating this machine" in line for line in lines)
    cached_rates(["float32"], recalibrate=True, say=lines.append)
    assert asked[-1] == ["bfloat16", "float32"]  # asked for: measured again, with the dtypes cached before


def test_cached_rates_say_when_the_cache_cannot_be_written(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "file"))  # a file where the folder should be
    monkeypatch.setattr(machine, "calibrate", lambda dtypes: RATES)
    lines: list[str] = []
    rates, fresh = cached_rates(["float32"], say=lines.append)
    assert rates is RATES and fresh and "calibration not saved" in lines[-1] and "MULTIHEAD_CACHE" in lines[-1]


def test_calibrate_measures_positive_rates_keyed_on_this_machine():
    rates = calibrate(["float32", "bfloat16"], matmul_sizes=(64, 128), copy_mib=4, min_run_time=0.01)
    assert set(rates.matmul_gflops) == {"float32", "bfloat16"} and all(v > 0 for v in rates.matmul_gflops.values())
    by_size = rates.details["matmul_gflops_by_size"]
    assert set(by_size["float32"]) == {64, 128} and rates.matmul_gflops["float32"] == max(by_size["float32"].values())
    assert rates.bandwidth_gbs > 0 and rates.threads == torch.get_num_threads()
    assert rates.machine == identity_key() and rates.measured_unix is not None
    with pytest.raises(ValueError, match="dtype: expected one of float32"):
        calibrate(["int8"])


def test_age_text():
    assert [age_text(s) for s in (5, 90, 7200, 3 * 86400)] == ["5 s", "2 min", "2 h", "3 days"]


def test_measure_peak_bytes_counts_what_a_step_allocates():
    keep = []
    peak = measure_peak_bytes(lambda: keep.append(torch.empty(3 * MIB, dtype=torch.uint8)))
    assert peak == 3 * MIB
    transient = measure_peak_bytes(lambda: [torch.empty(MIB, dtype=torch.uint8) for _ in range(2)])
    assert transient == 2 * MIB
    assert measure_peak_bytes(lambda: None) == 0


def test_the_suite_reads_no_calibration_from_the_users_home():
    """conftest's rule: HOME and the caches lie in an empty folder of this run, so `auto` and the CLI see no
    calibration an earlier `multihead bench --calibrate` left (make test sets HOME the same way)."""
    home = Path(os.environ["HOME"])
    assert home.name.startswith("multihead-test-home-") and "MULTIHEAD_CACHE" not in os.environ
    assert machine.calibration_path().is_relative_to(home)
    assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).is_relative_to(home)
    assert read_calibration()[0] is None and machine.cached_kernel_rates() is None


# --------------------------------------------------------------------------- a noisy calibration is not cached

QUIET_BLOCKS = [1.00, 1.01, 0.99, 1.00, 1.02]  # seconds per call of each timed block: their rates ±0.5%
NOISY_BLOCKS = [1.0, 1.0, 2.5, 1.6, 1.1, 3.0]  # another process took the CPU in four of them: their rates ±39%


def blocks_of(matmul: list[float], copy: list[float]):
    """A stand-in for machine._block_seconds: these block times for every matmul and for the copy (no timing)."""

    def block_seconds(stmt, names, min_run_time):
        return list(copy if "copy_" in stmt else matmul)

    return block_seconds


def test_every_round_times_every_measurement_once(monkeypatch):
    """The blocks of one measurement come from every round, so a slow spell of the machine falls on some of each."""
    timed: list[tuple[str, int]] = []

    def block_seconds(stmt, names, min_run_time):
        timed.append(("copy", names["src"].numel()) if "copy_" in stmt else ("mm", names["a"].shape[0]))
        return [1.0] * machine.MIN_BLOCKS

    monkeypatch.setattr(machine, "_block_seconds", block_seconds)
    calibrate(["float32"], matmul_sizes=(64, 128), copy_mib=4)
    assert timed == [("mm", 64), ("mm", 128), ("copy", 2**20)] * machine.CALIBRATION_ROUNDS


def test_spread_is_half_the_interquartile_range_over_the_median():
    assert machine.spread_pct([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(100 / 3)  # (4 - 2) / 2 / 3
    assert machine.spread_pct([7.0]) == 0.0 and machine.spread_pct([2.0, 2.0, 2.0]) == 0.0
    assert machine.spread_pct(NOISY_BLOCKS) > machine.NOISY_SPREAD_PCT > machine.spread_pct(QUIET_BLOCKS)


def test_a_calibration_keeps_its_block_rates_and_their_spread(cache, monkeypatch):
    monkeypatch.setattr(machine, "_block_seconds", blocks_of(QUIET_BLOCKS, QUIET_BLOCKS))
    rates = calibrate(["float32"], matmul_sizes=(64, 128), copy_mib=4)
    blocks = rates.details["block_rates"]
    assert set(blocks) == {"float32 matmul", "copy"}
    assert len(blocks["copy"]) == machine.CALIBRATION_ROUNDS * len(QUIET_BLOCKS)  # every round times every one
    # the cached rate is the fastest block of the fastest size, and the spread is of that size's blocks
    assert rates.matmul_gflops["float32"] == max(blocks["float32 matmul"]) == 2 * 128**3 / 0.99 / 1e9
    assert rates.bandwidth_gbs == max(blocks["copy"])
    assert rates.details["spread_pct"] == {what: machine.spread_pct(values) for what, values in blocks.items()}
    assert machine.calibration_noise(rates) is None
    assert save_calibration(rates) == cache and read_calibration()[0] is not None


@pytest.mark.parametrize(
    ("matmul", "copy", "named"),
    [(NOISY_BLOCKS, QUIET_BLOCKS, "float32 matmul ±"), (QUIET_BLOCKS, NOISY_BLOCKS, "copy ±")],
)
def test_a_noisy_calibration_is_refused_with_its_spread_and_the_fix(cache, monkeypatch, matmul, copy, named):
    monkeypatch.setattr(machine, "_block_seconds", blocks_of(matmul, copy))
    rates = calibrate(["float32"], matmul_sizes=(64,), copy_mib=4)
    noise = machine.calibration_noise(rates)
    assert noise is not None and noise.startswith(named)
    spread = max(rates.details["spread_pct"].values())
    assert f"±{spread:.0f}%" in noise and spread > machine.NOISY_SPREAD_PCT
    with pytest.raises(machine.NoisyCalibration) as refused:
        save_calibration(rates)
    message = str(refused.value)
    assert message.startswith("calibration not saved: expected timed blocks within ±10% of their median")
    assert f"got {noise}" in message and "Fix: rerun on a quiet machine, or --force to keep it" in message
    assert "\n" not in message and isinstance(refused.value, ValueError)
    assert not cache.exists()  # nothing written
    assert save_calibration(rates, force=True) == cache  # kept when asked
    assert read_calibration()[0].matmul_gflops == rates.matmul_gflops


def test_calibrate_refuses_a_noisy_one_before_timing_the_kernels(monkeypatch):
    monkeypatch.setattr(machine, "_block_seconds", blocks_of(NOISY_BLOCKS, QUIET_BLOCKS))
    monkeypatch.setattr(machine, "calibrate_kernels", lambda **kwargs: pytest.fail("the kernels were timed"))
    with pytest.raises(machine.NoisyCalibration, match="float32 matmul ±"):
        calibrate(["float32"], matmul_sizes=(64,), copy_mib=4, kernels=True, refuse_noisy=True)


def test_cached_rates_use_a_noisy_calibration_but_do_not_save_it(cache, monkeypatch):
    monkeypatch.setattr(machine, "_block_seconds", blocks_of(NOISY_BLOCKS, QUIET_BLOCKS))
    small = calibrate  # the real calibration on injected blocks, small
    monkeypatch.setattr(machine, "calibrate", lambda dtypes: small(dtypes, matmul_sizes=(64,), copy_mib=4))
    lines: list[str] = []
    rates, fresh = cached_rates(["float32"], say=lines.append)
    assert fresh and rates.matmul_gflops["float32"] > 0 and not cache.exists()
    assert lines[-1].startswith("calibration not saved: ") and "--force to keep it" in lines[-1]
    rates, fresh = cached_rates(["float32"], force=True, say=lines.append)
    assert fresh and lines[-1] == f"calibration saved to {cache}" and cache.exists()


def test_hand_made_rates_have_no_blocks_and_are_saved(cache):
    assert machine.calibration_noise(RATES) is None and save_calibration(RATES) == cache


def test_a_measurement_gets_enough_blocks_for_its_spread():
    """A call slower than min_run_time is one block for blocked_autorange: it gets more, of the same size."""
    seconds = machine._block_seconds("time.sleep(0.002)", {"time": __import__("time")}, min_run_time=0.001)
    assert len(seconds) >= machine.MIN_BLOCKS and all(s > 0 for s in seconds)
