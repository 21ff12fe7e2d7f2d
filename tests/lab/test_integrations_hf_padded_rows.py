"""Query rows with every key masked (left padding) on attn_implementation="multihead": transformers' eager numbers.

Eager adds the dtype's lowest value to every masked score, so a row whose keys are all masked has uniform weights
over its j keys and outputs the mean of the values, with softmax's gradient at those weights (into q and k too);
multihead's kernel gives that row 0. With HF-style labels (-100 on the padding), the last padding position predicts
the first real token, so the loss depends on it. Tiny random models built in memory (tests/hf_tiny.py), float32,
against eager; the kernel alone keeps its 0.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import multihead
import multihead.integrations.transformers as integration
from hf_tiny import VOCAB, tiny_model
from multihead.integrations.transformers_masks import typed_mask
from multihead.integrations.transformers_rows import eager_rows, rows_without_keys
from multihead.lab.inspect import attention_sites, capture
from multihead.masks import AttentionShape, allowed, bind_mask, causal, documents, padding, window

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BATCH, LENGTH, PADS = 2, 9, 4  # the second row starts after 4 padding tokens
TOLERANCE = 1e-5


def left_padded(device) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and HF-style labels (the input ids, -100 on padding), (BATCH, LENGTH)."""
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, :PADS] = 0
    ids[1, :PADS] = 0  # the pad token
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def twins(model_type: str, device, implementation: str = "eager") -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the tiny model on transformers' ``implementation``, a copy with the same weights on ours), float32."""
    theirs = tiny_model(model_type).to(device=device, dtype=torch.float32)
    theirs.set_attn_implementation(implementation)
    ours = copy.deepcopy(theirs)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    return theirs, ours


# Qwen3 and Llama: plain scores, grouped key/value heads (4 over 2); Gemma 2: a soft-cap and a window of 4 keys
# every other layer, whose scores eager builds whole (the gradient through them is not bilinear)
PLAIN_AND_CAPPED = ["qwen3", "llama", "gemma2"]


@pytest.mark.portable
@pytest.mark.parametrize("model_type", PLAIN_AND_CAPPED)
def test_a_left_padded_batch_trains_on_eagers_loss_logits_and_gradients(model_type, device):
    theirs, ours = twins(model_type, device)
    batch = left_padded(device)
    expected, got = theirs(**batch), ours(**batch)
    torch.testing.assert_close(got.loss, expected.loss, atol=TOLERANCE, rtol=TOLERANCE)
    # every position, the padded ones included: the last of them predicts the first real token
    torch.testing.assert_close(got.logits, expected.logits, atol=TOLERANCE, rtol=TOLERANCE)
    expected.loss.backward()
    got.loss.backward()
    named = dict(ours.named_parameters())
    compared = 0
    for name, parameter in theirs.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(named[name].grad, parameter.grad, atol=TOLERANCE, rtol=TOLERANCE, msg=name)
            compared += 1
    assert compared > 10


@pytest.mark.portable
def test_transformers_sdpa_gives_those_rows_the_kernels_zero_not_eagers_mean(device):
    """The oracle is eager: transformers' sdpa hands torch's kernel the boolean mask, which gives a row with
    every key masked 0 on the CPU (as multihead's kernel does) where eager gives the mean of the values."""
    sdpa, ours = twins("qwen3", device, "sdpa")
    eager = copy.deepcopy(sdpa)
    eager.set_attn_implementation("eager")
    batch = left_padded(device)
    with torch.no_grad():
        by_sdpa, by_eager, by_ours = (model(**batch) for model in (sdpa, eager, ours))
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(by_sdpa.logits[real], by_eager.logits[real], atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(by_ours.logits, by_eager.logits, atol=TOLERANCE, rtol=TOLERANCE)
    if device.type == "cpu":  # torch's CPU kernels, verified here; another device's may differ
        assert (by_sdpa.logits[1, :PADS] - by_eager.logits[1, :PADS]).abs().max() > 1e-2
        assert (by_sdpa.loss - by_eager.loss).abs() > 1e-4


@pytest.mark.portable
@pytest.mark.parametrize("model_type", ["qwen3", "gemma2"])
def test_weights_of_a_padded_row_are_eagers_captured_or_asked_for(model_type, device):
    """Every way the weights come back: asked for (output_attentions), captured from the kernel call (all heads),
    sliced from the weights the model asked for, or computed again for a recorder inside another one."""
    theirs, ours = twins(model_type, device)
    batch = {name: tensor for name, tensor in left_padded(device).items() if name != "labels"}
    heads, queries = [1, 3], [0, 2, 3, 6]  # the first three rows of the second text are padding
    with torch.no_grad():
        eager = theirs(**batch, output_attentions=True).attentions  # per layer (b, h, i, j)
        with capture(ours, heads=heads, queries=queries) as sliced:
            asked = ours(**batch, output_attentions=True).attentions
        with capture(ours) as every, capture(ours, heads=heads, queries=queries) as again:
            ours(**batch)
    sites = attention_sites(ours)
    assert len(sites) == len(eager) == 2
    for site, expected, returned in zip(sites, eager, asked, strict=True):
        assert torch.allclose(expected[1, :, :PADS], torch.tensor(1.0 / LENGTH))  # eager's rows: uniform over j
        torch.testing.assert_close(returned, expected, atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(every.weights(site.index), expected, atol=TOLERANCE, rtol=TOLERANCE)
        selected = expected[:, heads][:, :, queries]
        for recorder in (sliced, again):
            torch.testing.assert_close(recorder.weights(site.index), selected, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.portable
def test_with_learned_sinks_eagers_padded_rows_are_the_kernels_zero(device):
    """gpt-oss's sink takes the whole of a row with every key masked: eager's output there is 0, the kernel's."""
    theirs, ours = twins("gpt_oss", device)
    with torch.no_grad():  # sinks that take a visible share of the other rows (their initial values are 0)
        for model in (theirs, ours):
            for name, parameter in model.named_parameters():
                if name.endswith("sinks"):
                    parameter.copy_(torch.linspace(-1.0, 2.0, parameter.numel()).view_as(parameter))
    batch = left_padded(device)
    expected, got = theirs(**batch), ours(**batch)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-4, rtol=1e-4)
    expected.loss.backward()
    got.loss.backward()
    named = dict(ours.named_parameters())
    for name, parameter in theirs.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(named[name].grad, parameter.grad, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.portable
def test_the_kernel_alone_keeps_zero_for_a_row_with_every_key_masked(device):
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 5, 3, generator=generator).to(device).requires_grad_() for _ in range(3))
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[1, :2] = False  # left padding: the second text's first two queries see no key
    mask = causal() & padding(valid.to(device))
    result = multihead.attention_result(q, k, v, mask=mask, return_weights=True)
    torch.testing.assert_close(multihead.attention(q, k, v, mask=mask), result.output)
    assert result.output[1, :, :2].abs().max() == 0
    assert result.weights is not None and result.weights[1, :, :2].abs().max() == 0
    result.output[1, :, :2].sum().backward()
    assert all(t.grad is not None and t.grad.abs().max() == 0 for t in (q, k, v))


def dense_empty_rows(mask, is_causal: bool, shape: AttentionShape) -> torch.Tensor:
    keep, _ = bind_mask(mask, is_causal, shape).dense(torch.float32)
    assert keep is not None
    return ~keep.any(-1).expand(shape.batch, shape.heads, shape.q_len)


VALID = torch.tensor(
    [[True] * 7, [False] * 3 + [True] * 4, [False] * 7, [True, False] * 3 + [True]], dtype=torch.bool
)  # (4, 7): real, left-padded, all padding, every other key


@pytest.mark.parametrize(
    "build, queries",
    [
        (lambda: causal() & padding(VALID), 7),
        (lambda: causal() & padding(VALID), 3),  # a cache step: the last 3 queries of 7 keys
        (lambda: causal("top_left") & padding(VALID), 5),
        (lambda: window(1, 0) & padding(VALID), 7),  # a window of 2 keys over every other key
        (lambda: window(2, 1, align="top_left") & padding(VALID), 7),
        (lambda: window(0, 0) & causal(), 9),  # more queries than keys: the first rows see nothing
        (lambda: padding(VALID), 4),
        (lambda: allowed(VALID[:, None, None, :] & (torch.arange(7) % 3 != 0)), 5),  # a tensor: by blocks
        (lambda: documents(torch.tensor([[0, 0, 1, 1, 1, 2, 2]] * 4)) & padding(VALID), 7),  # by blocks
    ],
    ids=["causal", "cache step", "top-left", "window", "two-sided", "more queries", "padding", "tensor", "documents"],
)
def test_the_rows_without_keys_are_the_dense_masks(build, queries):
    shape = AttentionShape(4, 2, queries, 7, torch.device("cpu"))
    bound = bind_mask(build(), False, shape)
    found = rows_without_keys(bound)
    expected = dense_empty_rows(build(), False, shape)
    if found is None:  # the host saw that no row can be one
        assert not expected.any()
    else:
        assert torch.equal(found.expand_as(expected), expected)
    assert expected.any()  # each case has rows without a key


def test_the_rows_are_found_and_filled_without_reading_a_value_on_the_host():
    """dynamo refuses (fullgraph=True) any read of a tensor's value on the host or branch on one: finding the rows
    from the mask transformers' interface builds and blending eager's in need neither, so a CUDA device never
    waits for the host on them."""
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 6, 3, generator=generator)
    k, v = (torch.randn(2, 2, 6, 3, generator=generator) for _ in range(2))
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, :2] = False

    def attend(q, k, v, valid):
        mask = typed_mask(2, 6, 6, attention_mask=valid)
        finish = eager_rows(q, k, v, keys=mask, causal=False, mask=mask, scale=None, sinks=None)
        assert finish is not None
        result = multihead.attention_result(q, k, v, mask=mask, return_weights=True)
        return finish(result, True)

    compiled = torch.compile(attend, fullgraph=True, backend="eager")
    expected, got = attend(q, k, v, valid), compiled(q, k, v, valid)
    torch.testing.assert_close(got.output, expected.output)
    torch.testing.assert_close(got.weights, expected.weights)
    # rows 0 and 1 of the second text: the mean of their key/value head's values, weights 1 / j
    means = v[1].mean(-2).repeat_interleave(2, dim=0)  # (h, e)
    torch.testing.assert_close(got.output[1, :, :2], means[:, None].expand(4, 2, 3))
    assert torch.equal(got.weights[1, :, :2], torch.full((4, 2, 6), 1 / 6))
