"""PyTorch's own module tests for MultiheadAttention, run against multihead.compat.MultiheadAttention.

The inputs are torch's: ``torch.testing._internal.common_modules.module_db`` (installed with torch)
holds a ModuleInfo for ``torch.nn.MultiheadAttention`` whose ``module_inputs_func`` gives constructor
arguments, forward inputs and a reference function. For every ModuleInput (cpu; float32 and float64;
inputs requiring grad or not; training and eval mode: its dropout is 0, so both compare), the drop-in
holding torch's state_dict must give torch's outputs, weights and gradients. The per-module checks of
PyTorch's test/test_modules.py that apply to a drop-in follow: the reference function (no batch dim
equals a batch of one), repeated calls, state_dict both ways, pickle and deepcopy, non-contiguous
inputs and gradients, factory kwargs, the device context, .to(dtype), repr, and gradcheck /
gradgradcheck as test_modules runs them (fast mode, batched gradients: vmap over backward).

The one intended difference (rows whose keys are all masked give 0 where torch gives NaN) is
handled by the comparison; torch's samples have no such row.
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from torch import nn

from multihead import compat


def _torch_module_db():
    """torch's module_db. Its helpers change process-wide state when imported (they load their own hypothesis
    profile, which would shrink the fuzz suite's budget, and freeze torch.backends flags): put both back."""
    profile, frozen = settings.get_current_profile_name(), torch.backends.flags_frozen()
    from torch.testing._internal.common_modules import module_db  # needs expecttest, a test dependency

    settings.load_profile(profile)
    if not frozen:  # undo torch.backends.disable_global_flags(), in the namespace flags_frozen() reads
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    return module_db


INFO = next(info for info in _torch_module_db() if info.module_cls is nn.MultiheadAttention)
SETTINGS = [
    (dtype, requires_grad, training)
    for dtype in (torch.float32, torch.float64)
    for requires_grad in (False, True)
    for training in (False, True)
]


@dataclass(frozen=True)
class Sample:
    index: int  # position in the module_inputs_func list
    dtype: torch.dtype
    requires_grad: bool
    training: bool

    def __str__(self) -> str:
        return (
            f"{str(self.dtype)[6:]}-{'grad' if self.requires_grad else 'nograd'}-"
            f"{'train' if self.training else 'eval'}-{self.index:02d}"
        )

    def module_input(self):
        """A fresh ModuleInput (new tensors each time: nothing leaks between tests). torch draws its values from the
        global generator: seeded here, so that they do not depend on which tests ran before (an unlucky draw once
        put a float32 gradient just past the error bound when an earlier test file changed)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.index)
            inputs = INFO.module_inputs_func(
                INFO, device="cpu", dtype=self.dtype, requires_grad=self.requires_grad, training=self.training
            )
        return inputs[self.index]


N_INPUTS = len(INFO.module_inputs_func(INFO, device="cpu", dtype=torch.float32, requires_grad=False, training=False))
SAMPLES = [Sample(index, *setting) for setting in SETTINGS for index in range(N_INPUTS)]
F64_GRAD = [s for s in SAMPLES if s.dtype == torch.float64 and s.requires_grad and not s.training]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (see tests/conftest.py)


def test_module_db_entry_is_the_one_we_cover():
    assert set(INFO.dtypes) == {torch.float32, torch.float64}
    assert N_INPUTS == 64  # bias x add_bias_kv x add_zero_attn x key_padding_mask x attn_mask x batch_first
    options = set()
    for sample in SAMPLES[:N_INPUTS]:
        mi = sample.module_input()
        kw = mi.constructor_input.kwargs
        options.add(
            (
                kw["bias"],
                kw["add_bias_kv"],
                kw["add_zero_attn"],
                kw["batch_first"],
                mi.forward_input.kwargs["key_padding_mask"] is None,
                mi.forward_input.kwargs["attn_mask"] is None,
            )
        )
        assert mi.reference_fn is not None
    assert len(options) == 64


def randomize_(module: nn.Module, seed: int) -> nn.Module:
    """Random parameters (torch's initialisation zeroes the biases, which would test nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return module


def pair(sample: Sample, mi) -> tuple[nn.MultiheadAttention, compat.MultiheadAttention]:
    """torch's module built from the sample's constructor input (random parameters), and the drop-in with its
    state_dict, both moved to the sample's dtype as test_modules does, in the sample's mode."""
    args, kwargs = mi.constructor_input.args, mi.constructor_input.kwargs
    theirs = randomize_(nn.MultiheadAttention(*args, **kwargs), 1000 + sample.index).to(sample.dtype)
    ours = compat.MultiheadAttention(*args, **kwargs).to(sample.dtype)
    report = ours.load_state_dict(theirs.state_dict())
    assert not report.missing_keys and not report.unexpected_keys
    return theirs.train(sample.training), ours.train(sample.training)


def assert_matches_torch(
    ours: torch.Tensor | None, theirs: torch.Tensor | None, what: str, truth: torch.Tensor | None = None
) -> None:
    """Ours equals torch's result: in float64 within 1e-10 relative; in float32 by DESIGN.md's rule against
    ``truth`` (torch in float64): max|ours - truth| <= 2 max|torch - truth| + 1e-5. Where torch has NaN
    (a row with every key masked) ours must be finite; those entries are not compared."""
    if theirs is None:
        assert ours is None, what
        return
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (what, ours.shape, theirs.shape)
    assert ours.isfinite().all(), what
    keep = ~theirs.isnan()
    if theirs.dtype == torch.float64:
        torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")
        return
    assert truth is not None, what
    truth = truth.detach()[keep]
    error = (ours.detach()[keep].double() - truth).abs().max().item() if keep.any() else 0.0
    bound = 2 * ((theirs.detach()[keep].double() - truth).abs().max().item() if keep.any() else 0.0) + 1e-5
    assert error <= bound, f"{what}: max error {error:.3g} > bound {bound:.3g}"


def cotangents(out: torch.Tensor, weights: torch.Tensor | None, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) for t in (out, weights) if t is not None
    ]


def forward_and_grads(module: nn.Module, args, kwargs, seed: int):
    """(out, weights) and, when anything requires grad, d <outputs, cotangents> / d (inputs, parameters)."""
    out, weights = module(*args, **kwargs)
    leaves = [t for t in args if t.requires_grad] + list(module.parameters())
    if not out.requires_grad:
        return out, weights, None
    outputs = [t for t in (out, weights) if t is not None]
    grads = torch.autograd.grad(outputs, leaves, cotangents(out, weights, seed))
    return out, weights, grads


@pytest.mark.parametrize("sample", SAMPLES, ids=str)
def test_matches_torch_on_torch_module_inputs(sample: Sample):
    mi = sample.module_input()
    theirs, ours = pair(sample, mi)
    args, kwargs = mi.forward_input.args, mi.forward_input.kwargs
    out_t, w_t, grads_t = forward_and_grads(theirs, args, kwargs, sample.index)
    out_o, w_o, grads_o = forward_and_grads(ours, args, kwargs, sample.index)
    # torch in float64 on the same values: the truth float32 results are measured against
    args64 = [t.detach().double().requires_grad_(t.requires_grad) for t in args]
    kwargs64 = {k: m if m is None or m.dtype == torch.bool else m.double() for k, m in kwargs.items()}
    out_64, w_64, grads_64 = forward_and_grads(copy.deepcopy(theirs).double(), args64, kwargs64, sample.index)
    assert not out_t.isnan().any(), "torch's samples have no fully masked row"
    assert_matches_torch(out_o, out_t, "output", out_64)
    assert_matches_torch(w_o, w_t, "weights", w_64)
    assert out_o.requires_grad == out_t.requires_grad
    assert (grads_o is None) == (grads_t is None)
    names = [f"input{n}" for n, t in enumerate(args) if t.requires_grad] + [n for n, _ in ours.named_parameters()]
    if grads_o is not None:  # None where nothing requires grad
        for name, g_o, g_t, g_64 in zip(names, grads_o, grads_t, grads_64, strict=True):
            assert_matches_torch(g_o, g_t, f"grad {name}", g_64)
    # torch's reference function: the unbatched call equals a batch of one, on our module
    expected = mi.reference_fn(ours, *args, **kwargs)  # torch passes the parameters itself
    torch.testing.assert_close((out_o, w_o), expected, rtol=0, atol=1e-6 if sample.dtype == torch.float32 else 1e-14)


@pytest.mark.parametrize("sample", F64_GRAD, ids=str)
def test_repeated_calls_give_identical_results(sample: Sample):
    mi = sample.module_input()
    _, ours = pair(sample, mi)
    args, kwargs = mi.forward_input.args, mi.forward_input.kwargs
    first, second = ours(*args, **kwargs), ours(*args, **kwargs)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for t in args:  # the call changed no input
        assert t.grad is None


@pytest.mark.parametrize("sample", F64_GRAD, ids=str)
def test_state_dict_round_trips_both_ways(sample: Sample):
    mi = sample.module_input()
    theirs, ours = pair(sample, mi)
    args, kwargs = mi.forward_input.args, mi.forward_input.kwargs
    ours_state, torch_state = ours.state_dict(), theirs.state_dict()
    assert list(ours_state) == list(torch_state)  # same names, same order
    for name, tensor in torch_state.items():
        assert ours_state[name].shape == tensor.shape and ours_state[name].dtype == tensor.dtype, name
    fresh_torch = nn.MultiheadAttention(*mi.constructor_input.args, **mi.constructor_input.kwargs)
    fresh_torch.to(sample.dtype).load_state_dict(ours_state)
    assert_matches_torch(ours(*args, **kwargs)[0], fresh_torch(*args, **kwargs)[0], "output after ours -> torch")


@pytest.mark.parametrize("sample", F64_GRAD, ids=str)
def test_pickle_and_deepcopy_keep_the_module(sample: Sample):
    mi = sample.module_input()
    _, ours = pair(sample, mi)
    args, kwargs = mi.forward_input.args, mi.forward_input.kwargs
    expected = ours(*args, **kwargs)
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(ours)
    for other in (loaded, copied):
        assert type(other) is compat.MultiheadAttention and other.training == ours.training
        assert torch.equal(other(*args, **kwargs)[0], expected[0])
        assert all(a is not b for a, b in zip(other.parameters(), ours.parameters(), strict=True))


def _non_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """The same values in a tensor whose last dim has stride 2 (a leaf again when t was one)."""
    if t is None:
        return None
    spread = torch.stack([t.detach(), torch.zeros_like(t)], dim=-1)[..., 0]
    assert not spread.is_contiguous() and torch.equal(spread, t)
    return spread.requires_grad_(t.requires_grad)


@pytest.mark.parametrize("sample", F64_GRAD, ids=str)
def test_non_contiguous_inputs_and_gradients(sample: Sample):
    mi = sample.module_input()
    _, ours = pair(sample, mi)
    args, kwargs = mi.forward_input.args, mi.forward_input.kwargs
    out, weights, grads = forward_and_grads(ours, args, kwargs, sample.index)
    nc_args = [_non_contiguous(t) for t in args]
    nc_kwargs = {name: _non_contiguous(m) for name, m in kwargs.items()}
    nc_out, nc_weights = ours(*nc_args, **nc_kwargs)
    torch.testing.assert_close((nc_out, nc_weights), (out, weights), rtol=0, atol=1e-14)
    leaves = [t for t in nc_args if t.requires_grad] + list(ours.parameters())
    nc_cotangents = [_non_contiguous(c) for c in cotangents(out, weights, sample.index)]
    nc_grads = torch.autograd.grad([nc_out, nc_weights], leaves, nc_cotangents)
    torch.testing.assert_close(nc_grads, grads, rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_factory_kwargs_device_context_to_and_repr(dtype):
    for mi in INFO.module_inputs_func(INFO, device="cpu", dtype=dtype, requires_grad=False, training=False):
        args, kwargs = mi.constructor_input.args, mi.constructor_input.kwargs
        theirs = nn.MultiheadAttention(*args, **kwargs)
        ours = compat.MultiheadAttention(*args, **kwargs, device="cpu", dtype=dtype)
        assert [(n, p.shape) for n, p in ours.named_parameters()] == [
            (n, p.shape) for n, p in theirs.named_parameters()
        ]
        assert all(p.dtype == dtype and p.device.type == "cpu" for p in ours.parameters())
        assert repr(ours) == repr(theirs)
        with torch.device("meta"):
            on_meta = compat.MultiheadAttention(*args, **kwargs)
        assert all(p.is_meta for p in on_meta.parameters())
        materialized = on_meta.to_empty(device="cpu")
        materialized.load_state_dict(randomize_(theirs, 3).state_dict())
        other = torch.float64 if dtype == torch.float32 else torch.float32
        moved = materialized.to(other)
        assert all(p.dtype == other for p in moved.parameters())
        forward_args = [t.to(other) for t in mi.forward_input.args]
        torch.testing.assert_close(
            moved(*forward_args, **mi.forward_input.kwargs), theirs.to(other)(*forward_args, **mi.forward_input.kwargs)
        )


def _functional(ours: compat.MultiheadAttention, n_inputs: int, kwargs: dict):
    """(inputs..., parameters...) -> (out, weights) through torch.func.functional_call, as test_modules does."""
    names = [name for name, _ in ours.named_parameters()]

    def fn(*flat):
        params = dict(zip(names, flat[n_inputs:], strict=True))
        return torch.func.functional_call(ours, params, tuple(flat[:n_inputs]), kwargs)

    return fn


def _gradcheck_inputs(sample: Sample):
    mi = sample.module_input()
    _, ours = pair(sample, mi)
    args = mi.forward_input.args
    flat = [t.detach().requires_grad_(True) for t in args] + [
        p.detach().requires_grad_(True) for p in ours.parameters()
    ]
    return _functional(ours, len(args), mi.forward_input.kwargs), flat


@pytest.mark.parametrize("sample", F64_GRAD, ids=str)
def test_gradcheck_as_test_modules_runs_it(sample: Sample):
    """test_modules' gradcheck (common_utils.gradcheck): fast mode, with batched gradients (vmap over backward)."""
    fn, flat = _gradcheck_inputs(sample)
    assert torch.autograd.gradcheck(fn, flat, fast_mode=True, check_batched_grad=True)


# batch_first does not change an unbatched call: the samples come in pairs that differ only there
GRADGRAD = [s for s in F64_GRAD if s.module_input().constructor_input.kwargs["batch_first"]]


@pytest.mark.parametrize("sample", GRADGRAD, ids=str)
def test_gradgradcheck_as_test_modules_runs_it(sample: Sample):
    """Double backward (need_weights=True: the weights are an output too), with batched gradients."""
    fn, flat = _gradcheck_inputs(sample)
    assert torch.autograd.gradgradcheck(fn, flat, fast_mode=True, check_batched_grad=True)
