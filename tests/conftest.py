"""Shared fixtures (the helpers themselves live in support.py), the thread count every test runs with, and the
rule that no test reads state outside the checkout."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from multihead.backends import native, policy
from support import tiny_blocks

# The tests live in one folder per wing (core, lab, cli), as src/ does; some import another's helpers by module name
# (test_integrations_transformers' tiny models, test_cli_errors' checkpoints), whichever wing they sit in
for wing in ("core", "lab", "cli"):
    folder = str(Path(__file__).resolve().parent / wing)
    if folder not in sys.path:
        sys.path.insert(0, folder)

# The rule: no outcome depends on what the user's earlier commands left in their home (a `multihead bench
# --calibrate` result, a matplotlib, Hugging Face or torch.compile cache). `make test` already runs pytest with
# HOME in an empty folder; this holds the rule for a bare `pytest` too, for this process and every command a test
# starts.
ISOLATED_HOME = tempfile.mkdtemp(prefix="multihead-test-home-")
os.environ["HOME"] = ISOLATED_HOME
os.environ["XDG_CACHE_HOME"] = os.path.join(ISOLATED_HOME, ".cache")
os.environ["XDG_CONFIG_HOME"] = os.path.join(ISOLATED_HOME, ".config")
for pointer_out_of_home in ("MULTIHEAD_CACHE", "HF_HOME", "HF_HUB_CACHE", "MPLCONFIGDIR"):
    os.environ.pop(pointer_out_of_home, None)
# torch.compile's caches too: a kernel compiled by another run (another torch, other ISA settings, a run writing
# the same folder at the same time) is never loaded
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(ISOLATED_HOME, "torchinductor")
os.environ["TRITON_CACHE_DIR"] = os.path.join(ISOLATED_HOME, "triton")

# multihead's native CPU kernel is built once into the checkout's build folder (ignored by git), never into or from
# the user's cache; built here, before any test, so that no test's output carries the build's notice
os.environ[native.DIR_ENV] = str(Path(__file__).resolve().parent.parent / "build" / "native")
native.available()

torch.set_num_threads(2)
# auto plans every CPU call of the suite as the kind its choices were written for (cpu-avx2, whose table was
# measured), so that a test passes on every CPU kind; tests of the kinds themselves install their own policy
policy.set_policy(policy.STATIC.assuming(policy.DeviceKind("cpu", "cpu-avx2", "as assumed by the tests")))


SUITE_POLICY = policy.current_policy()


@pytest.fixture(autouse=True)
def suite_policy():
    """Every test starts with the suite's policy, whatever the test before installed (set_policy is process-wide)."""
    policy.set_policy(SUITE_POLICY)
    yield
    policy.set_policy(SUITE_POLICY)


@pytest.fixture
def small_blocks():
    with tiny_blocks():
        yield


@pytest.fixture
def one_thread():
    """One intra-op thread, for files of tiny tensors: faster, and immune to a busy machine's scheduling."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# --------------------------------------------------------------------------- the device a portable test runs on
# `pytest --device cuda` runs every test marked `portable` on that device (the others run on the CPU as always):
# a portable test takes the `device` fixture and builds every tensor and module on it.

DEVICE_OPTION_HELP = "the device portable tests run on: cpu (default), cuda or cuda:N"


def pytest_addoption(parser):
    parser.addoption("--device", action="store", default="cpu", metavar="DEVICE", help=DEVICE_OPTION_HELP)


def _parse_device(value: str) -> torch.device:
    """--device's value as a torch.device with an index for cuda (a tensor's .device compares equal to it), or a
    one-line pytest.UsageError naming the option and the fix."""
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise pytest.UsageError(
            f"--device: expected cpu, cuda or cuda:N, got {value!r}. Fix: pass --device cpu or --device cuda"
        ) from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise pytest.UsageError(
            f"--device: expected cpu, cuda or cuda:N, got {value!r}. Fix: pass --device cpu or --device cuda"
        )
    if not torch.cuda.is_available():
        raise pytest.UsageError(
            f"--device {value}: CUDA is not available to this torch ({torch.__version__}). "
            "Fix: run on a machine with a CUDA GPU and a CUDA build of torch, or drop --device (cpu)"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise pytest.UsageError(
            f"--device {value}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1}). "
            "Fix: pass --device cuda or an index below the count"
        )
    return torch.device("cuda", index)


def pytest_configure(config):
    config.multihead_device = _parse_device(config.getoption("--device"))
    if config.multihead_device.type == "cuda":
        torch.cuda.set_device(config.multihead_device)


def pytest_report_header(config):
    return f"multihead portable tests run on: {config.multihead_device}"


def pytest_collection_modifyitems(config, items):
    """A test that takes `device` is portable: it must carry the marker, or `-m portable` would leave it out."""
    unmarked = [
        item.nodeid for item in items if "device" in item.fixturenames and not item.get_closest_marker("portable")
    ]
    if unmarked:
        raise pytest.UsageError(
            f"{len(unmarked)} test(s) take the `device` fixture without the `portable` marker, e.g. {unmarked[0]}. "
            "Fix: mark them @pytest.mark.portable (or pytestmark = pytest.mark.portable for the file)"
        )


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The torch.device of --device (cpu unless asked): portable tests build their tensors and modules on it."""
    return request.config.multihead_device
