"""Shared fixtures (the helpers themselves live in support.py) and the thread count every test runs with."""

from __future__ import annotations

import pytest
import torch

from support import tiny_blocks

torch.set_num_threads(2)


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
