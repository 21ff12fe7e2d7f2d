"""Head gates, ablations and pruning on MultiHeadAttention: each checked against the formula it stands for."""

from __future__ import annotations

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.masks import padding
from support import randn

B, N, E = 3, 7, 30


def make_layer(device: torch.device | str = "cpu", **options) -> MultiHeadAttention:
    torch.manual_seed(11)
    return MultiHeadAttention(E, options.pop("num_heads", 6), dtype=torch.float64, device=device, **options)


def per_head(layer, x, **kwargs):
    """The per-head outputs (b, h, i, e) as the layer computes them, via a forward hook on its attend step (which
    returns an AttentionResult)."""
    seen = {}

    def keep(module, args, result):  # returns None: the step's own result goes on
        seen.setdefault("out", result.output)

    handle = layer.attend.register_forward_hook(keep)
    layer(x, **kwargs)
    handle.remove()
    return seen["out"], seen


def from_heads(layer, heads_out):
    b, h, i, e = heads_out.shape
    return layer.out_proj(heads_out.transpose(1, 2).reshape(b, i, h * e))


@pytest.fixture
def x(device):
    """The layer's input (b, n, E) on the device portable tests run on: a test taking it must be portable."""
    return randn(B, N, E, seed=4, device=device)


@pytest.mark.portable
@pytest.mark.parametrize(
    "options, heads",
    [
        (dict(), [1, 4]),
        (dict(num_kv_heads=2), [0, 1, 2]),  # a whole key/value group (heads 0-2 read kv head 0)
        (dict(num_kv_heads=3), [0, 3, 5]),  # one query head from each group of two... left: 1 per group
        (dict(num_kv_heads=1), [2]),  # multi-query
    ],
)
def test_pruning_equals_zero_ablation_and_survives_save_and_load(options, heads, x, device):
    layer = make_layer(device, **options)
    layer.ablate_heads(heads, how="zero")
    ablated, _ = layer(x, causal=True)
    layer.restore_heads()
    kept = layer.prune_heads(heads)
    assert kept == [n for n in range(6) if n not in heads]
    pruned, _ = layer(x, causal=True)
    torch.testing.assert_close(pruned, ablated, atol=1e-12, rtol=0)
    assert layer.num_heads == 6 - len(heads)
    assert layer.q_proj.weight.shape == (layer.num_heads * 5, E)
    assert layer.out_proj.weight.shape == (E, layer.num_heads * 5)
    rebuilt = MultiHeadAttention(**layer.config(), dtype=torch.float64, device=device)
    rebuilt.load_state_dict(layer.state_dict())
    torch.testing.assert_close(rebuilt(x, causal=True)[0], pruned, atol=0, rtol=0)


@pytest.mark.portable
def test_uniform_ablation_attends_evenly_over_the_allowed_keys(x, device):
    layer = make_layer(device)
    lengths = torch.tensor([7, 4, 2], device=device)
    mask = padding(lengths)
    plain, _ = per_head(layer, x, mask=mask, causal=True)
    layer.ablate_heads([2], how="uniform")
    out, _ = layer(x, mask=mask, causal=True)
    v = (x @ layer.v_proj.weight.T + layer.v_proj.bias).view(B, N, 6, 5).transpose(1, 2)  # (b, h, j, e)
    expected = plain.clone()
    for b in range(B):
        for t in range(N):
            allowed = min(t + 1, int(lengths[b]))  # causal and padding together
            expected[b, 2, t] = v[b, 2, :allowed].mean(dim=0)
    torch.testing.assert_close(out, from_heads(layer, expected), atol=1e-12, rtol=0)


@pytest.mark.portable
def test_mean_ablation_outputs_the_given_vectors(x, device):
    layer = make_layer(device)
    plain, _ = per_head(layer, x)
    means = randn(2, 5, seed=5, device=device)
    layer.ablate_heads([0, 5], how="mean", mean_outputs=means)
    expected = plain.clone()
    expected[:, 0] = means[0]
    expected[:, 5] = means[1]
    torch.testing.assert_close(layer(x)[0], from_heads(layer, expected), atol=1e-12, rtol=0)


@pytest.mark.portable
def test_gate_scales_heads_and_its_gradient_is_the_head_output_times_its_gradient(x, device):
    layer = make_layer(device)
    plain, _ = layer(x)
    layer.head_gate = torch.ones(6, dtype=torch.float64, device=device)
    assert torch.equal(layer(x)[0], plain)  # a gate of ones changes nothing
    gate = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64, device=device)
    layer.head_gate = gate
    gated, _ = layer(x)
    layer.head_gate = None
    layer.ablate_heads([1, 4])
    torch.testing.assert_close(gated, layer(x)[0], atol=1e-12, rtol=0)
    layer.restore_heads()
    # d loss / d gate_h = sum over positions of (head h's output) . (d loss / d head h's output)
    gate = torch.ones(6, dtype=torch.float64, device=device, requires_grad=True)
    layer.head_gate = gate
    target = randn(B, N, E, seed=6, device=device)
    ((layer(x)[0] - target) ** 2).sum().backward()
    layer.head_gate = None
    heads_out, _ = per_head(layer, x)
    heads_out = heads_out.detach().requires_grad_(True)
    ((from_heads(layer, heads_out) - target) ** 2).sum().backward()
    torch.testing.assert_close(gate.grad, (heads_out * heads_out.grad).sum(dim=(0, 2, 3)), atol=1e-9, rtol=0)


@pytest.mark.portable
def test_restore_brings_back_the_exact_ungated_output(x, device):
    layer = make_layer(device, num_kv_heads=3)
    plain, _ = layer(x, causal=True)
    layer.ablate_heads([1], how="uniform")
    layer.head_gate = torch.full((6,), 0.5, dtype=torch.float64, device=device)
    assert not torch.equal(layer(x, causal=True)[0], plain)
    layer.restore_heads()
    assert torch.equal(layer(x, causal=True)[0], plain)


@pytest.mark.portable
@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda layer: layer.ablate_heads([6]), ValueError, r"heads: expected head indices in 0\.\.5 \(or -6\.\.-1"),
        (lambda layer: layer.ablate_heads([1, 1]), ValueError, "heads: expected each head once, got head 1 twice"),
        (lambda layer: layer.ablate_heads([5, -1]), ValueError, "heads: expected each head once, got head 5 twice"),
        (lambda layer: layer.ablate_heads(["a"]), TypeError, "heads: expected head indices"),
        (lambda layer: layer.ablate_heads([1], how="noise"), ValueError, "how: expected one of zero, uniform, mean"),
        (
            lambda layer: layer.ablate_heads([1], how="mean"),
            ValueError,
            r"mean_outputs: expected a tensor of shape "
            r"\(len\(heads\), e\) = \(1, 5\)",
        ),
        (
            lambda layer: layer.ablate_heads([1], mean_outputs=torch.zeros(1, 5, device=layer.q_proj.weight.device)),
            ValueError,
            "mean_outputs: expected None",
        ),
        (
            lambda layer: layer.prune_heads(list(range(6))),
            ValueError,
            "heads: expected fewer than all 6 heads of the layer",
        ),
    ],
)
def test_bad_head_arguments(call, error, message, device):
    with pytest.raises(error, match=message):
        call(make_layer(device))


@pytest.mark.portable
def test_pruning_must_keep_grouped_heads_even(device):
    layer = make_layer(device, num_kv_heads=2)  # groups {0, 1, 2} and {3, 4, 5}
    with pytest.raises(
        ValueError,
        match=r"heads: expected the same number of query heads removed from every "
        r"key/value group kept \(groups of 3\), got query heads left per group "
        r"kv head 0: 2, kv head 1: 3",
    ):
        layer.prune_heads([0])
    assert layer.num_heads == 6  # nothing changed
    assert layer.prune_heads([0, 4]) == [1, 2, 3, 5] and layer.num_kv_heads == 2


@pytest.mark.portable
def test_a_gate_of_the_wrong_shape_is_refused_when_set_and_the_old_gate_stays(device):
    layer = make_layer(device)
    gate = torch.full((6,), 0.5, dtype=torch.float64, device=device)
    layer.head_gate = gate
    for bad in (torch.ones(5, device=device), torch.ones(6, 1, device=device), [1.0] * 6):
        with pytest.raises((ValueError, TypeError), match=r"head_gate: expected a tensor of shape \(h,\) = \(6,\)"):
            layer.head_gate = bad
        assert layer.head_gate is gate


@pytest.mark.portable
def test_surgery_lives_on_the_attention_step_and_hooks_there_see_the_gated_outputs(x, device):
    # the layer's forward knows nothing of surgery: the gate is the attend module's, and a forward hook on
    # layer.attend (what capture uses) sees the per-head outputs the layer concatenates
    layer = make_layer(device)
    seen = []
    handle = layer.attend.register_forward_hook(lambda module, args, result: seen.append(result.output))
    try:
        plain, _ = layer(x)
        layer.head_gate = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64, device=device)
        assert layer.attend.head_gate is layer.head_gate
        gated, _ = layer(x)
    finally:
        handle.remove()
        layer.restore_heads()
    assert seen[1][:, [1, 4]].abs().max() == 0 and seen[0][:, [1, 4]].abs().max() > 0
    torch.testing.assert_close(gated, from_heads(layer, seen[1]), atol=1e-12, rtol=0)
    assert layer.attend.head_gate is None and layer.head_ablation is None
