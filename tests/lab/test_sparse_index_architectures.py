"""Sparse-index attention (an indexer picks each query's keys) on attn_implementation="multihead": the picks reach
the kernel as masks.selected, so past index_topk (4 keys here, on 12-token texts) the logits and gradients equal
the model's own eager attention, which masks the unpicked keys itself."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import multihead.integrations.transformers as integration
from hf_tiny import VOCAB, assert_outputs_and_gradients_equal, tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPARSE_INDEX_ARCHITECTURES = ["deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4"]
LENGTH = 12  # past index_topk = 4


@pytest.mark.portable
@pytest.mark.parametrize("model_type", SPARSE_INDEX_ARCHITECTURES)
def test_logits_and_gradients_equal_eager_past_index_topk(model_type, device):
    theirs = tiny_model(model_type).to(device)
    config = getattr(theirs.config, "text_config", None) or theirs.config
    assert config.index_topk < LENGTH
    theirs.set_attn_implementation("eager")
    ours = copy.deepcopy(theirs)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    ids = torch.randint(3, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1)).to(device)
    assert_outputs_and_gradients_equal(theirs, ours, 1e-4, input_ids=ids)
