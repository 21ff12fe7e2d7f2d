"""scripts/gpu_check.sh, the one command a GPU window runs, in its CPU smoke mode: every step runs, writes its
files (non-empty) and passes, so the script cannot rot between GPU windows. No assertion on time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
EXPECTED = {
    1: ["env.txt", "env.json", "tests.txt", "tests-ignored.txt", "summary-part1.txt"],
    2: ["gpu_kernels.json", "gpu_kernels.md", "gpu_kernels.log", "summary-part2.txt"],
    3: [
        "gpu_heads.json",
        "gpu_heads.md",
        "gpu_heads.log",
        "host_overhead_smoke.json",
        "host_overhead_smoke.md",
        "host_overhead.log",
        "summary-part3.txt",
    ],
    4: ["parallel_nccl.txt", "parallel_nccl.xml", "parallel_shared.txt", "parallel_shared.xml", "summary-part4.txt"],
}
STEPS = {
    1: ["env", "tests"],
    2: ["gpu_kernels"],
    3: ["gpu_heads", "host_overhead"],
    4: ["parallel_nccl", "parallel_shared"],
}


def run_script(*args: str, timeout: float = 150, hide_gpus: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)  # the device tool's folder, when this runs there: --out decides here
    if hide_gpus:  # a machine without CUDA, on any machine
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_smoke_run_writes_every_file_and_passes(tmp_path):
    done = run_script("--smoke", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for part, names in EXPECTED.items():
        for name in names:
            path = tmp_path / name
            assert path.is_file() and path.stat().st_size > 0, f"part {part}: {name} missing or empty"
        summary = (tmp_path / f"summary-part{part}.txt").read_text().splitlines()
        assert summary[0].startswith(f"part {part}, device cpu, smoke=1")
        steps = {line.split("\t")[0]: line.split("\t")[1] for line in summary[1:]}
        assert list(steps) == STEPS[part]
        assert all(status in ("ok", "no tests selected") for status in steps.values()), steps
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["torch"] == torch.__version__ and env["multihead"]["import"] == "ok"
    assert "## nvidia-smi" in (tmp_path / "env.txt").read_text()
    if (tmp_path / "tests.xml").exists():  # pytest writes it when any test was selected
        assert (tmp_path / "tests.xml").stat().st_size > 0
    kernels = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert kernels["config"]["smoke"] is True and kernels["cases"] and not kernels["not_started"]
    for case in kernels["cases"]:
        assert case["contestants"]["auto"]["status"] == "ok", case
        assert case["contestants"]["torch flash"]["status"] == "unavailable"  # a CUDA kernel, reported, not run
    heads = json.loads((tmp_path / "gpu_heads.json").read_text())
    assert [row["n"] for row in heads["rows"]] == list(heads["config"]["sizes"])
    for row in heads["rows"]:
        assert all(entry["status"] == "ok" for entry in row["contestants"].values()), row
    overhead = json.loads((tmp_path / "host_overhead_smoke.json").read_text())
    assert overhead["machine"]["device"] == "cpu" and overhead["cases"]


def test_without_cuda_and_without_smoke_it_stops_with_a_message(tmp_path):
    done = run_script("--part", "2", "--out", str(tmp_path), timeout=60, hide_gpus=True)
    assert done.returncode == 2
    assert "no CUDA device is visible to torch" in done.stderr and "--smoke" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--part", "5"], "--part: expected 1, 2, 3, 4 or all, got '5'"), (["--frobnicate"], "unknown argument")],
)
def test_a_bad_argument_is_refused(tmp_path, args, message):
    done = run_script(*args, "--out", str(tmp_path), timeout=60)
    assert done.returncode == 2 and message in done.stderr
