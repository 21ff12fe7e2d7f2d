"""multihead.lab.inspect.capture: hooks that record per-head tensors without changing the model's results.

Every test is portable: the model, its inputs and what capture records live on the --device.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multihead import MultiHeadAttention
from multihead.lab.inspect import attention_layers, capture
from support import randn

pytestmark = pytest.mark.portable


class TwoLayers(nn.Module):
    """Self-attention (GQA, rotary) then cross-attention: the kinds of layer capture must handle."""

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__()
        torch.manual_seed(3)
        self.first = MultiHeadAttention(24, 6, num_kv_heads=2, rotary=True, dtype=torch.float64, device=device)
        self.second = MultiHeadAttention(24, 4, kdim=10, vdim=10, value_head_dim=5, dtype=torch.float64, device=device)

    def forward(self, x, memory, mask=None):
        x = x + self.first(x, causal=True)[0]
        return self.second(x, memory, mask=mask)[0]


@pytest.fixture
def model_and_inputs(device):
    """TwoLayers, x (b, i, 24) and memory (b, j, 10), all on the device."""
    x = randn(2, 9, 24, seed=5, device=device)
    memory = randn(2, 11, 10, seed=6, device=device)
    return TwoLayers(device), x, memory


def expected_weights(layer, query, key=None, **kwargs):
    _, weights = layer(query, key, need_weights=True, **kwargs)
    return weights  # (b, h, i, j)


def test_weights_of_chosen_layers_heads_and_queries_equal_the_layers_own(model_and_inputs, device):
    model, x, memory = model_and_inputs
    with torch.no_grad():
        plain = model(x, memory)
        hidden = x + model.first(x, causal=True)[0]
        first = expected_weights(model.first, x, causal=True)
        second = expected_weights(model.second, hidden, memory)
        with capture(model, heads=[3, 1], queries=[0, 4, 8]) as rec:
            recorded = model(x, memory)
    assert torch.equal(recorded, plain)  # recording never changes the output
    assert rec.layers == [0, 1] and rec.heads(0) == [3, 1]
    assert rec.weights(0).shape == (2, 2, 3, 9)
    torch.testing.assert_close(rec.weights(0, 3), first[:, 3][:, [0, 4, 8]], atol=1e-12, rtol=0)
    torch.testing.assert_close(rec.weights(1, 1), second[:, 1][:, [0, 4, 8]], atol=1e-12, rtol=0)
    assert rec.weights(1).shape == (2, 2, 3, 11)  # cross-attention: j = memory length


def test_qkv_and_outputs_are_each_heads_own(model_and_inputs, device):
    model, x, memory = model_and_inputs
    with torch.no_grad(), capture(model, layers=[0], heads=[5], qkv=True, outputs=True) as rec:
        model(x, memory)
    q, k, v, out, w = rec.q(0, 5), rec.k(0, 5), rec.v(0, 5), rec.outputs(0, 5), rec.weights(0, 5)
    assert q.shape == (2, 9, 4) and k.shape == (2, 9, 4) and v.shape == (2, 9, 4)
    # head 5 reads kv head 5 // 3 = 1 (GQA): its keys are rows 4..8 of k_proj, rotated
    layer = model.first
    keys = layer.rotary.rotate((x @ layer.k_proj.weight.T + layer.k_proj.bias).view(2, 9, 2, 4).transpose(1, 2), 0)
    torch.testing.assert_close(k, keys[:, 1], atol=1e-12, rtol=0)
    torch.testing.assert_close(out, w @ v, atol=1e-12, rtol=0)  # the output is the weights applied to v
    causal = torch.ones(9, 9, dtype=torch.bool, device=device).tril()
    scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~causal, float("-inf"))  # scale 1/sqrt(4)
    torch.testing.assert_close(w, scores.softmax(-1), atol=1e-12, rtol=0)


def test_only_recorded_layers_ask_the_kernel_for_weights(model_and_inputs, device):
    """Layers not recorded run exactly as without the recorder (no weights asked, same backend choice)."""
    model, x, memory = model_and_inputs
    asked = {}

    def spy(name):
        def hook(module, args, kwargs):
            asked[name] = kwargs.get("return_weights")

        return hook

    with capture(model, layers=[1], heads=[2]):
        handles = [
            model.first.attend.register_forward_pre_hook(spy("first"), with_kwargs=True),
            model.second.attend.register_forward_pre_hook(spy("second"), with_kwargs=True),
        ]
        with torch.no_grad():
            model(x, memory)
    assert asked["first"] is False
    assert list(asked["second"].heads) == [2]  # a WeightSelection of the one recorded head
    model(x, memory)  # after the block: no recording, plain calls again
    assert asked["first"] is False and asked["second"] is False
    for handle in handles:
        handle.remove()


def test_caller_asking_for_weights_gets_them_unchanged(model_and_inputs, device):
    model, x, _ = model_and_inputs
    with torch.no_grad():
        out_plain, weights_plain = model.first(x, need_weights=True)
        with capture(model, layers=[0], heads=[4]) as rec:
            out, weights = model.first(x, need_weights=True)
    assert torch.equal(out, out_plain) and torch.equal(weights, weights_plain)
    torch.testing.assert_close(rec.weights(0, 4), weights_plain[:, 4], atol=0, rtol=0)


def test_every_call_is_kept_and_the_cache_decode_is_recorded(device):
    torch.manual_seed(2)
    layer = MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64, device=device)
    prompt, steps = randn(1, 5, 16, seed=3, device=device), randn(1, 3, 16, seed=4, device=device)
    cache = layer.new_cache(1, 8)
    with torch.no_grad(), capture(layer) as rec:
        layer(prompt, cache=cache, causal=True)
        for t in range(3):
            layer(steps[:, t : t + 1], cache=cache, causal=True)
    assert rec.calls(0) == 4
    assert rec.weights(0, call=0).shape == (1, 4, 5, 5)
    assert rec.weights(0).shape == (1, 4, 1, 8)  # the last decode step sees all 8 keys
    full = expected_weights(layer, torch.cat([prompt, steps], 1), causal=True)
    torch.testing.assert_close(rec.weights(0), full[:, :, -1:], atol=1e-12, rtol=0)
    rec.clear()
    assert rec.calls(0) == 0


def test_training_backward_works_and_recorded_tensors_are_detached(model_and_inputs, device):
    model, x, memory = model_and_inputs
    x.requires_grad_(True)
    with capture(model, outputs=True) as rec:
        model(x, memory).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert not rec.weights(0).requires_grad and not rec.outputs(1).requires_grad
    grad_plain = torch.autograd.grad(model(x, memory).sum(), x)[0]
    torch.testing.assert_close(x.grad, grad_plain, atol=1e-12, rtol=0)  # gradients unchanged by recording


def test_layer_order_and_bad_arguments(model_and_inputs, device):
    model, x, memory = model_and_inputs
    assert attention_layers(model) == [model.first, model.second]
    assert attention_layers(model.first) == [model.first]
    with pytest.raises(ValueError, match=r"layers: expected layer indices in 0\.\.1 \(or -2\.\.-1, .*\), got 2"):
        capture(model, layers=[2])
    with pytest.raises(ValueError, match=r"heads: expected head indices in 0\.\.3 \(or -4\.\.-1, .*\), got 5"):
        capture(model, heads=[5])  # the second layer has 4 heads
    with pytest.raises(TypeError, match="heads: expected head indices"):
        capture(model, heads=["a"])
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        capture("model")
    with pytest.raises(ValueError, match="model: expected a model built with multihead.MultiHeadAttention, or a"):
        capture(nn.Linear(2, 3, device=device))
    with pytest.raises(ValueError, match=r"part: expected one of the model's parts \['self'\], got 'cross'"):
        capture(model, part="cross")
    with pytest.raises(TypeError, match="queries: expected a slice or a list"):
        capture(model, queries=3)
    with capture(model, layers=[0], heads=[1]) as rec:
        with pytest.raises(ValueError, match="call: expected a recorded forward pass, got none recorded yet"):
            rec.weights(0)
        model(x, memory)
    with pytest.raises(ValueError, match=r"layer: expected one of the recorded layers \[0\], got 1"):
        rec.weights(1)
    with pytest.raises(ValueError, match=r"head: expected one of the recorded heads \[1\], got 2"):
        rec.weights(0, 2)
    with pytest.raises(ValueError, match=r"qkv: expected True to record q"):
        rec.q(0)
    with pytest.raises(ValueError, match=r"call: expected an index into the 1 recorded passes, got 3"):
        rec.weights(0, call=3)
