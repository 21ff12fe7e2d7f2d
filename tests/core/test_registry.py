"""The backend registry on its own: registering, looking up, capabilities, and how auto chooses and explains.

Calls are described with hand-built :class:`AttentionCall` values, so every rule of
:meth:`Capabilities.reasons` and of auto's order is checked without running a kernel. The portable tests describe
calls on the --device (their masks bound there); the real registry's choices are the CPU's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from multihead.backends import registry
from multihead.backends.registry import AttentionCall, BackendOutput, Capabilities
from multihead.masks import AttentionShape, bias, bind_mask

CPU = torch.device("cpu")


def make_call(device: torch.device = CPU, **changes) -> AttentionCall:
    """A plain float32 self-attention call (b=2, h=g=4, i=j=8, d=e=16) on ``device`` with ``changes`` applied."""
    mask = changes.pop("mask", None)
    shape = AttentionShape(batch=2, heads=4, q_len=8, k_len=8, device=device)
    call = AttentionCall(
        batch=2,
        heads=4,
        kv_heads=4,
        q_len=8,
        k_len=8,
        qk_dim=16,
        v_dim=16,
        dtype=torch.float32,
        device=device,
        mask=bind_mask(mask, False, shape),
        dropout=0.0,
        weights="none",
        need_lse=False,
        requires_grad=False,
    )
    return dataclasses.replace(call, **changes)


def never_called(q, k, v, *, mask, scale, dropout, need_weights, need_lse) -> BackendOutput:
    raise AssertionError("the registry never runs a kernel")


EVERYTHING = Capabilities(lse=True, weights=True, dropout=True, backward=True, bias_grad=True)


def bias_needing_grad(device: torch.device):
    """An additive bias (i, j) = (8, 8) on ``device`` that requires grad."""
    return bias(torch.zeros(8, 8, device=device, requires_grad=True))


@pytest.fixture
def scratch_registry(monkeypatch):
    """An empty registry for the test (the real backends come back afterwards)."""
    monkeypatch.setattr(registry, "_REGISTRY", {})
    return registry


# --------------------------------------------------------------------------- capabilities


@pytest.mark.portable
@pytest.mark.parametrize(
    "capabilities, change, expected",
    [
        (Capabilities(dtypes=frozenset({torch.float32})), {"dtype": torch.float16}, "dtype torch.float16"),
        (Capabilities(device_types=frozenset({"meta"})), {}, "device {device} (supports ['meta'])"),
        (Capabilities(), {"need_lse": True}, "return_lse"),
        (Capabilities(lse=True), {"dropout": 0.1}, "dropout"),
        (Capabilities(dropout=True), {"dropout": 0.1, "weights": "all"}, "returning the weights it applied"),
        (Capabilities(backward=False), {"requires_grad": True}, "backward (inputs require grad)"),
        (
            Capabilities(),
            {"requires_grad": True, "mask": bias_needing_grad},
            "gradient with respect to an additive bias",
        ),
    ],
    ids=["dtype", "device", "lse", "dropout", "weights-under-dropout", "backward", "bias-grad"],
)
def test_each_capability_a_call_needs_is_named_when_missing(capabilities, change, expected, device):
    change = {name: value(device) if callable(value) else value for name, value in change.items()}
    expected = expected.format(device=device.type)
    reasons = capabilities.reasons(make_call(device, **change))
    assert len(reasons) == 1 and expected in reasons[0], reasons
    # a backend with every capability and no dtype or device limit serves the same call
    assert EVERYTHING.reasons(make_call(device, **change)) == []


@pytest.mark.portable
def test_a_backend_check_adds_its_limits_and_auto_skip_counts_for_auto_only(device):
    capabilities = Capabilities(
        check=lambda call: ["q_len over 4"] if call.q_len > 4 else [],
        auto_skip=lambda call: ["slower here"],
    )
    assert capabilities.reasons(make_call(device)) == ["q_len over 4"]
    assert capabilities.reasons(make_call(device), for_auto=True) == ["q_len over 4", "slower here"]
    assert capabilities.reasons(make_call(device, q_len=4)) == []


# --------------------------------------------------------------------------- register / lookup


def test_register_orders_auto_by_priority_and_unregister_removes(scratch_registry):
    scratch_registry.register("late", never_called, Capabilities(), priority=90)
    scratch_registry.register("early", never_called, Capabilities(), priority=10)
    assert scratch_registry.available_backends() == ["early", "late"]
    assert scratch_registry.get_backend("late").priority == 90
    scratch_registry.unregister("early")
    assert scratch_registry.available_backends() == ["late"]


def test_registering_a_taken_name_needs_replace(scratch_registry):
    scratch_registry.register("mine", never_called, Capabilities(), priority=5)
    with pytest.raises(ValueError, match="name: expected a name not yet registered, got 'mine'.*replace=True"):
        scratch_registry.register("mine", never_called, Capabilities(lse=True))
    assert scratch_registry.get_backend("mine").capabilities == Capabilities()  # the failed call changed nothing
    scratch_registry.register("mine", never_called, Capabilities(lse=True), replace=True)
    assert scratch_registry.get_backend("mine").capabilities.lse


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((3, never_called, Capabilities()), TypeError, "name: expected a string"),
        (("", never_called, Capabilities()), ValueError, "name: expected a non-empty string other than 'auto'"),
        (("auto", never_called, Capabilities()), ValueError, "other than 'auto'"),
        (("x", "not callable", Capabilities()), TypeError, "fn: expected a callable"),
        (("x", never_called, {"lse": True}), TypeError, "capabilities: expected a multihead.backends.Capabilities"),
    ],
    ids=["name-type", "empty-name", "auto", "fn", "capabilities"],
)
def test_register_refuses_bad_arguments_and_registers_nothing(scratch_registry, args, error, message):
    with pytest.raises(error, match=message):
        scratch_registry.register(*args)
    assert scratch_registry.available_backends() == []


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"backend: expected 'auto' or one of \[.*'reference'.*\], got 'nope'"):
        registry.get_backend("nope")
    with pytest.raises(ValueError, match="got 'nope'"):
        registry.unregister("nope")


# --------------------------------------------------------------------------- auto: choose and explain


@pytest.mark.portable
def test_auto_takes_the_first_that_serves_and_explains_the_others(scratch_registry, device):
    scratch_registry.register("fast", never_called, Capabilities(), priority=1)
    scratch_registry.register("lse", never_called, Capabilities(lse=True), priority=2)
    scratch_registry.register("spare", never_called, Capabilities(lse=True), priority=3)
    assert scratch_registry.choose(make_call(device), "auto").name == "fast"
    call = make_call(device, need_lse=True)
    assert scratch_registry.choose(call, "auto").name == "lse"
    explanation = scratch_registry.explain_call(call, "auto")
    assert explanation.chosen == "lse"
    assert "return_lse" in explanation.rejected["fast"][0]
    assert explanation.rejected["spare"] == ["could serve, but 'lse' ranks first"]
    assert str(explanation).splitlines()[0] == "chosen: lse"


@pytest.mark.portable
def test_with_every_weight_asked_a_backend_that_writes_them_goes_first(scratch_registry, device):
    scratch_registry.register("fused", never_called, Capabilities(), priority=1)
    scratch_registry.register("materialized", never_called, Capabilities(weights=True), priority=9)
    assert scratch_registry.choose(make_call(device, weights="subset"), "auto").name == "fused"
    call = make_call(device, weights="all")
    assert scratch_registry.choose(call, "auto").name == "materialized"
    assert "writes all of them in one pass" in scratch_registry.explain_call(call, "auto").rejected["fused"][0]


@pytest.mark.portable
def test_a_named_backend_that_cannot_serve_says_what_it_lacks(scratch_registry, device):
    scratch_registry.register("plain", never_called, Capabilities(), priority=1)
    call = make_call(device, need_lse=True)
    explanation = scratch_registry.explain_call(call, "plain")
    assert explanation.chosen is None and "return_lse" in explanation.rejected["plain"][0]
    with pytest.raises(ValueError, match=r"backend: .*'plain' requested.*plain lacks return_lse.*use backend='auto'"):
        scratch_registry.choose(call, "plain")
    with pytest.raises(ValueError, match="drop the unsupported option"):
        scratch_registry.choose(call, "auto")


def test_the_real_registry_has_the_documented_backends_in_auto_order():
    assert registry.available_backends() == ["sdpa", "tiled", "spans", "flex", "materialized", "reference", "paged"]
    assert registry.choose(make_call(paged=True), "auto").name == "paged"  # first for a paged call, whatever order
    assert registry.choose(make_call(need_lse=True), "auto").name == "tiled"
    assert registry.choose(make_call(weights="all"), "auto").name == "materialized"
