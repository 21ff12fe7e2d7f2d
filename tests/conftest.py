"""Shared fixtures (the helpers themselves live in support.py), the thread count every test runs with, and the
rule that no test reads state outside the checkout."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from multihead.backends import costs
from support import tiny_blocks

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

torch.set_num_threads(2)
# auto's choices rest on the measured defaults in every test, whatever this machine's cached calibration says
costs.set_kernel_rates(costs.DEFAULT_RATES)


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
