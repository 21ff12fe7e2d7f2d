"""Shared fixtures (the helpers themselves live in support.py) and the thread count every test runs with."""

from __future__ import annotations

import pytest
import torch

from multihead.backends import costs
from support import tiny_blocks

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
