"""compat.replace: every torch.nn.MultiheadAttention in a torch model swapped for the drop-in, outputs unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from multihead import compat

torch.manual_seed(0)


def drop_ins_called(model: nn.Module) -> list[str]:
    """Record, per forward, the names of the drop-ins whose own forward ran (not torch's fused fast path)."""
    calls: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, compat.MultiheadAttention):
            module.register_forward_hook(lambda module, args, output, name=name: calls.append(name))
    return calls


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "sequence-first"])
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("nested", [False, True], ids=["padded", "nested-fast-path-allowed"])
def test_a_transformer_encoder_gives_the_same_outputs_on_the_drop_in(batch_first, mode, nested):
    layer = nn.TransformerEncoderLayer(24, 4, dim_feedforward=40, dropout=0.0, batch_first=batch_first)
    encoder = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=nested)
    encoder.train(mode == "train")
    x = torch.randn(2, 9, 24) if batch_first else torch.randn(9, 2, 24)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, 6:] = True  # torch's polarity: True = padded
    with torch.no_grad():  # eval + no_grad is where torch would take its fused fast path
        expected = encoder(x, src_key_padding_mask=padding)
    parameters = dict(encoder.named_parameters())
    replaced = compat.replace(encoder)
    assert list(replaced) == [f"layers.{n}.self_attn" for n in range(3)]
    assert all(type(module) is nn.MultiheadAttention for module in replaced.values())
    assert all(type(encoder.layers[n].self_attn) is compat.MultiheadAttention for n in range(3))
    assert all(encoder.layers[n].self_attn.training == (mode == "train") for n in range(3))
    # the very parameters, under the same names: nothing copied, an optimizer built before keeps working
    assert {name: id(p) for name, p in encoder.named_parameters()} == {name: id(p) for name, p in parameters.items()}
    calls = drop_ins_called(encoder)
    with torch.no_grad():
        got = encoder(x, src_key_padding_mask=padding)
    assert calls == [f"layers.{n}.self_attn" for n in range(3)]  # our forward ran, not torch's fused kernel
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_a_full_transformer_with_cross_attention_and_masks_gives_the_same_outputs_and_gradients():
    model = nn.Transformer(
        d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=24, dropout=0.0
    ).double()
    source, target = torch.randn(7, 3, 16, dtype=torch.float64), torch.randn(5, 3, 16, dtype=torch.float64)
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    source_padding = torch.zeros(3, 7, dtype=torch.bool)
    source_padding[2, 4:] = True
    reference = copy.deepcopy(model)

    def step(net: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        net.zero_grad()
        out = net(
            source, target, tgt_mask=causal, src_key_padding_mask=source_padding, memory_key_padding_mask=source_padding
        )
        (out**2).sum().backward()
        return out.detach(), [p.grad.clone() for p in net.parameters()]

    expected, expected_grads = step(reference)
    replaced = compat.replace(model)
    assert sorted(replaced) == sorted(
        [f"encoder.layers.{n}.self_attn" for n in range(2)]
        + [f"decoder.layers.{n}.{kind}" for n in range(2) for kind in ("self_attn", "multihead_attn")]
    )
    got, grads = step(model)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, atol=1e-9, rtol=0)


def test_every_option_is_carried_over():
    holder = nn.ModuleDict(
        {
            "plain": nn.MultiheadAttention(12, 3),
            "options": nn.MultiheadAttention(
                12, 3, dropout=0.25, bias=False, add_bias_kv=True, add_zero_attn=True, kdim=5, vdim=7, batch_first=True
            ),
        }
    )
    holder.eval()
    query, key, value = torch.randn(2, 4, 12), torch.randn(2, 6, 5), torch.randn(2, 6, 7)
    with torch.no_grad():
        expected = holder["options"](query, key, value, average_attn_weights=False)
    compat.replace(holder)
    ours = holder["options"]
    assert (ours.dropout, ours.batch_first, ours.kdim, ours.vdim, ours.add_zero_attn) == (0.25, True, 5, 7, True)
    assert ours.in_proj_bias is None and ours.bias_k is not None and ours.in_proj_weight is None
    assert not any(p.is_meta for p in holder.parameters())
    with torch.no_grad():
        got = ours(query, key, value, average_attn_weights=False)
    torch.testing.assert_close(got[0], expected[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=2e-6, rtol=1e-5)


def test_a_module_held_twice_becomes_one_drop_in():
    shared = nn.MultiheadAttention(8, 2)
    model = nn.ModuleDict({"first": shared, "again": shared})
    replaced = compat.replace(model)
    assert list(replaced) == ["first", "again"] and replaced["first"] is replaced["again"] is shared
    assert model["first"] is model["again"]
    assert type(model["first"]) is compat.MultiheadAttention


class _TweakedAttention(nn.MultiheadAttention):
    """A subclass whose forward might differ: replace must not guess."""


def test_a_refused_model_is_left_exactly_as_it_was():
    model = nn.Sequential(nn.MultiheadAttention(8, 2), _TweakedAttention(8, 2))
    before = list(model)
    with pytest.raises(ValueError, match=r"model: expected torch.nn.MultiheadAttention modules \(not subclasses"):
        compat.replace(model)
    assert list(model) == before and type(model[0]) is nn.MultiheadAttention  # nothing swapped


@pytest.mark.parametrize(
    "model, error, message",
    [
        ("not a model", TypeError, "model: expected a torch.nn.Module, got str"),
        (nn.MultiheadAttention(8, 2), ValueError, "a module cannot replace itself in place"),
        (torch.jit.script(nn.Linear(3, 3)), compat.NotScriptableError, "got a TorchScript module"),
    ],
    ids=["not-a-module", "the-attention-itself", "torchscript"],
)
def test_bad_models_are_refused_with_the_fix(model, error, message):
    with pytest.raises(error, match=message):
        compat.replace(model)


def test_a_model_without_torch_attention_is_unchanged():
    model = nn.Sequential(nn.Linear(4, 4), compat.MultiheadAttention(4, 2))
    assert compat.replace(model) == {}
    assert type(model[1]) is compat.MultiheadAttention
