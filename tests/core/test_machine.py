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
