"""No host syncs on the hot paths (issue 30): a call reads no tensor's values on the host.

A value read on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``nonzero``, a Python branch on a
tensor) of a CUDA tensor waits for every kernel queued before it: one such read per call stalls the pipeline of a
decode loop or a training step. Two harnesses catch them:

- FakeTensorMode, on every machine: tensors with shapes and no values, so any read of one raises
  DataDependentOutputException (checked below, so the harness cannot pass vacuously). It runs the layer's forward,
  backward and cached decoding, and ``multihead.attention`` with every typed mask on every backend that serves it
  (flex aside: it compiles its kernel with inductor, which cannot compile fake tensors; its host side is checked on
  CUDA, below). Tensors are made by ops (randint, rand), never from literals: FakeTensorMode remembers the values of
  ``torch.tensor([...])`` and would answer reads of them.
- ``torch.cuda.set_sync_debug_mode("error")`` on the ``device`` fixture's CUDA device (``pytest -m portable
  --device cuda``): every synchronizing CUDA call raises, host-to-device copies that wait included. On the CPU the
  same calls run without it (the CPU has no device to wait for) and their results are checked all the same.

Values known on the host are used where they are free: key lengths given as Python ints or in a CPU tensor, RoPE
positions in a CPU tensor, sizes. Those paths are checked to give the same results (and errors) as before.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from unittest.mock import patch

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

import multihead
from multihead import masks
from multihead.backends import available_backends, get_backend
from multihead.masks import AttentionShape, BlockState, bind_mask
from multihead.positional import RotaryEmbedding

B, H, G, I, J, D, E = 2, 6, 3, 5, 7, 4, 3  # noqa: E741 (the axis letters) pairwise-distinct sizes: a swapped axis cannot pass


@contextlib.contextmanager
def fake_tensors() -> Iterator[None]:
    """Every tensor made inside is fake: a read of its values raises (DataDependentOutputException)."""
    with FakeTensorMode():
        yield


@contextlib.contextmanager
def no_device_syncs(device: torch.device) -> Iterator[None]:
    """On CUDA, any synchronizing call inside raises; on the CPU there is no device to wait for."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


# --------------------------------------------------------------------------- the masks, on any device


class Tensors:
    """The data-dependent tensors of the mask cases, made on ``device`` (by ops: see the module docstring).

    ``lengths`` (b,) holds a 0 on real devices, so one batch row has every key masked (output 0, LSE -inf).
    """

    def __init__(self, device: torch.device, *, fake: bool):
        gen = None if fake else torch.Generator().manual_seed(7)
        if fake:  # random by ops: FakeTensorMode knows nothing of their values
            self.lengths = torch.randint(0, J + 1, (B,), device=device)
            self.valid = torch.rand(B, J, device=device) > 0.3
            keep = torch.rand(1, H, I, J, device=device) > 0.2
            self.bias = torch.randn(B, 1, I, J, device=device)
            self.documents = torch.randint(0, 3, (B, J), device=device).sort(-1).values
        else:  # drawn on the CPU and moved before any guarded call
            self.lengths = torch.tensor([J, 0]).to(device)
            self.valid = (torch.rand(B, J, generator=gen) > 0.3).to(device)
            keep = (torch.rand(1, H, I, J, generator=gen) > 0.2).to(device)
            self.bias = torch.randn(B, 1, I, J, generator=gen).to(device)
            self.documents = torch.randint(0, 3, (B, J), generator=gen).sort(-1).values.to(device)
        self.bias = self.bias.masked_fill(~self.valid[:, None, None, :], -math.inf)  # -inf entries mask pairs
        self.keep = keep
        self.slopes = masks.alibi_slopes(H).to(device)


MASKS: dict[str, Callable[[Tensors], object]] = {
    "none": lambda t: None,
    "causal": lambda t: masks.causal(),
    "window": lambda t: masks.window(2, 1),
    "padding lengths": lambda t: masks.padding(t.lengths),
    "padding host lengths": lambda t: masks.padding([J, 3]),
    "padding valid": lambda t: masks.padding(t.valid),
    "alibi": lambda t: masks.alibi(t.slopes),
    "bias": lambda t: masks.bias(t.bias),
    "allowed": lambda t: masks.allowed(t.keep),
    "bool tensor": lambda t: t.keep,
    "softcap": lambda t: masks.softcap(20.0),
    "causal & padding & alibi & softcap": lambda t: (
        masks.causal() & masks.padding(t.lengths) & masks.alibi(t.slopes) & masks.softcap(20.0)
    ),
    "window & padding valid & bias": lambda t: masks.window(3, 0) & masks.padding(t.valid) & masks.bias(t.bias),
    "documents": lambda t: masks.documents(t.documents),
    "causal & documents & alibi": lambda t: masks.causal() & masks.documents(t.documents) & masks.alibi(t.slopes),
    "two alignments & host lengths": lambda t: (
        masks.causal(align="top_left") & masks.window(1, 2) & masks.padding([4, J])
    ),
}

# flex compiles its kernel with inductor, which cannot compile fake tensors (and a failed compile would make auto
# pass flex over for the rest of the session); on the CPU it has no backward either
FAKE_BACKENDS = [name for name in available_backends() if name != "flex"]


def serving(backends: list[str], q, k, v, mask, **options) -> list[str]:
    """The backends among ``backends`` that serve this call (as ``attention`` would check them)."""
    return [name for name in backends if multihead.explain(q, k, v, mask=mask, backend=name, **options).chosen == name]


def run_everything(q, k, v, mask, backends: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """For each backend that serves it: forward, backward, and the LSE and weights where the backend returns them;
    with dropout (training) where it has dropout. Returns each backend's results by name."""
    results = {}
    served = serving(backends, q, k, v, mask)
    assert "reference" in served  # the oracle serves everything: the loop below is never empty
    for name in served:
        caps = get_backend(name).capabilities
        extra = dict(return_lse=caps.lse, return_weights=caps.weights)
        result = multihead.attention_result(q, k, v, mask=mask, backend=name, **extra)
        out = result.output
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        results[name] = {"output": out, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
        extras = {"lse": result.lse, "weights": result.weights}
        results[name].update({part: t for part, t in extras.items() if t is not None})
        if caps.dropout:
            dropped = multihead.attention(q, k, v, mask=mask, backend=name, dropout=0.25, training=True)
            torch.autograd.grad(dropped.sum(), (q, k, v))
    # auto's choice, its estimates (block counts over the mask) and the weights of a backend without native ones
    auto = multihead.attention_result(q, k, v, mask=mask, return_weights=True, return_lse=True)
    torch.autograd.grad(auto.output.sum(), (q, k, v))
    return results


def qkv(device: torch.device, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    shapes = ((B, H, I, D), (B, G, J, D), (B, G, J, E))
    return [torch.randn(*shape, device=device, dtype=dtype, requires_grad=True) for shape in shapes]


# --------------------------------------------------------------------------- the harness is not vacuous


def test_fake_tensors_raise_on_every_kind_of_host_read():
    with fake_tensors():
        lengths = torch.randint(0, J + 1, (B,))
        for read in (lambda: lengths.max().item(), lambda: lengths.tolist(), lambda: bool(lengths.any())):
            with pytest.raises(DataDependentOutputException):
                read()
        with pytest.raises(DataDependentOutputException):
            int(lengths[0])


@pytest.mark.parametrize("backend", ["tiled", "materialized"])
def test_the_harness_catches_a_host_read_on_the_kernel_path(backend):
    """A padding term that read its values to answer block states (what it did before issue 30) fails here: the
    blocked kernels ask for block states (and so do auto's estimates, which count the live blocks)."""

    def reading_state(self, row_start, row_stop, col_start, col_stop):
        return BlockState.EMPTY if not self.valid[..., col_start:col_stop].any().item() else BlockState.PARTIAL

    with fake_tensors(), patch.object(masks._padding._BoundPadding, "span_state", reading_state):
        q, k, v = qkv(torch.device("cpu"))
        mask = masks.padding(torch.randint(0, J + 1, (B,)))
        with pytest.raises(DataDependentOutputException):
            multihead.attention(q, k, v, mask=mask, backend=backend)


# --------------------------------------------------------------------------- attention, every mask, every backend


@pytest.mark.parametrize("kind", list(MASKS))
def test_attention_reads_no_tensor_on_the_host(kind):
    with fake_tensors():
        q, k, v = qkv(torch.device("cpu"))
        mask = MASKS[kind](Tensors(q.device, fake=True))
        results = run_everything(q, k, v, mask, FAKE_BACKENDS)
        for name, parts in results.items():
            assert parts["output"].shape == (B, H, I, E), name
            assert parts["dk"].shape == (B, G, J, D), name
            if "lse" in parts:
                assert parts["lse"].shape == (B, H, I) and parts["lse"].dtype == torch.float32, name


def pytest_generate_tests(metafunc):
    """The device tests run every backend, flex included on CUDA; on the CPU flex is left out of them (its forward
    compiles a kernel per mask kind, about 10 s each here, and test_backends_flex covers it on the CPU)."""
    if "device_backends" in metafunc.fixturenames:
        device = getattr(metafunc.config, "multihead_device", torch.device("cpu"))
        names = available_backends() if device.type == "cuda" else FAKE_BACKENDS
        metafunc.parametrize("device_backends", [names], ids=["backends"])


@pytest.mark.portable
@pytest.mark.parametrize("kind", list(MASKS))
def test_attention_makes_no_device_sync(kind, device, device_backends):
    q, k, v = qkv(device)
    tensors = Tensors(device, fake=False)
    mask = MASKS[kind](tensors)
    with no_device_syncs(device):
        results = run_everything(q, k, v, mask, device_backends)
    # and the results are right: every backend agrees with the oracle, fully masked rows included
    expected = results["reference"]
    for name, parts in results.items():
        for part, value in parts.items():
            torch.testing.assert_close(value, expected[part], atol=2e-5, rtol=2e-4, msg=f"{name} {part}")
    if kind.startswith("padding lengths") or kind.startswith("causal & padding"):  # batch row 1 has no key
        assert (expected["output"][1] == 0).all() and (expected["dq"][1] == 0).all()
        assert (expected["lse"][1] == -math.inf).all()


# --------------------------------------------------------------------------- what masks know without a read


def test_lengths_on_a_device_are_neither_read_nor_checked():
    """Block states and empty rows are answered conservatively (every block PARTIAL, rows may be empty), and a
    length out of [0, j] is not refused: checking it would read it."""
    with fake_tensors():
        lengths = torch.randint(0, 3 * J, (B,))
        bound = bind_mask(masks.padding(lengths) & masks.causal(), False, AttentionShape(B, H, I, J, lengths.device))
        assert bound.state(range(0, I), range(0, J)) is BlockState.PARTIAL
        assert bound.may_empty_rows()
        valid = torch.rand(B, J) > 0.5
        bound = bind_mask(masks.padding(valid), False, AttentionShape(B, H, I, J, valid.device))
        assert bound.state(range(0, I), range(J - 1, J)) is BlockState.PARTIAL and bound.may_empty_rows()


def test_lengths_known_on_the_host_are_used_and_checked_without_a_read():
    """Python ints (and a CPU tensor) give exact block states and empty rows, and out-of-range lengths are refused,
    even where no tensor has values."""
    shape = AttentionShape(B, H, I, J, torch.device("cpu"))
    with fake_tensors():
        bound = bind_mask(masks.padding([J, 3]), True, shape)
        assert bound.state(range(0, 2), range(0, 3)) is BlockState.FULL  # keys 0..2 real everywhere, causal too
        assert bound.state(range(0, I), range(3, J)) is BlockState.PARTIAL
        assert not bound.may_empty_rows()
        assert bind_mask(masks.padding([J, 0]), False, shape).may_empty_rows()
        with pytest.raises(ValueError, match="lengths in \\[0, 7\\]"):
            bind_mask(masks.padding([J + 1, 3]), False, shape)
    with pytest.raises(ValueError, match="values from -1 to 7"):
        bind_mask(masks.padding(torch.tensor([-1, J])), False, shape)
    cpu_lengths = bind_mask(masks.padding(torch.tensor([3, 2])), False, shape)  # a CPU tensor: read, no sync
    assert cpu_lengths.state(range(0, I), range(0, 2)) is BlockState.FULL
    assert cpu_lengths.state(range(0, I), range(2, 3)) is BlockState.PARTIAL
    assert cpu_lengths.state(range(0, I), range(3, J)) is BlockState.EMPTY


def test_rotary_positions_on_a_device_are_computed_without_a_read():
    rope = RotaryEmbedding(D)
    x = torch.randn(B, H, I, D, dtype=torch.float64)
    positions = torch.arange(3, 3 + I).expand(B, I)
    expected = rope.rotate(x, 3)
    with fake_tensors():
        fake_positions = torch.randint(0, 100, (B, I))
        assert rope.rotate(torch.randn(B, H, I, D), fake_positions).shape == (B, H, I, D)
    # the path a device tensor takes (no table, angles for these positions) gives what the tables give
    with patch("multihead.positional.host_readable", return_value=False):
        torch.testing.assert_close(rope.rotate(x, positions), expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="non-negative positions"):
        rope.rotate(x, torch.tensor([-1, 0, 1, 2, 3]))  # a CPU tensor is read, and checked


# --------------------------------------------------------------------------- the layer: training and decoding


def make_layer(device: torch.device, **options) -> multihead.MultiHeadAttention:
    return multihead.MultiHeadAttention(12, H, num_kv_heads=G, rotary=True, device=device, **options)


def training_step(layer, x: torch.Tensor, mask) -> list[torch.Tensor]:
    """Forward and backward through the layer; returns the parameters' gradients."""
    out, weights = layer(x, mask=mask, causal=True, need_weights=True)
    out.sum().backward()
    assert weights is not None
    return [p.grad for p in layer.parameters()]


def decode(layer, x: torch.Tensor, *, window: int | None, prompt: int, valid: torch.Tensor | None) -> torch.Tensor:
    """A prompt of ``prompt`` tokens, then one token a step through a KV cache; the outputs (b, n, out_dim).

    ``valid`` (b, n), True = a real token, masks the keys each call attends (sliced on the device), or None."""
    cache = layer.new_cache(B, x.shape[1], window=window)
    outs = []
    for start, stop in [(0, prompt), *((step, step + 1) for step in range(prompt, x.shape[1]))]:
        first_key = cache.seen - len(cache)  # the position of the first key held (a window cache drops the oldest)
        mask = None if valid is None else masks.padding(valid[:, first_key:stop])
        outs.append(layer(x[:, start:stop], mask=mask, causal=True, cache=cache)[0])
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("window", [None, 3])
def test_layer_training_and_decoding_read_no_tensor_on_the_host(window):
    with fake_tensors():
        layer = make_layer(torch.device("cpu"), dropout=0.25)
        x = torch.randn(B, 9, 12)
        valid = torch.rand(B, 9) > 0.2  # left padding of a batch, as a device would hold it
        grads = training_step(layer, x, masks.padding(valid))
        assert all(g is not None for g in grads)
        layer.eval()
        with torch.no_grad():
            assert decode(layer, x, window=window, prompt=4, valid=None).shape == (B, 9, 12)
            assert decode(layer, x, window=window, prompt=4, valid=valid).shape == (B, 9, 12)
            positions = torch.randint(0, 50, (B, 9))  # explicit positions on the device: never read
            layer(x, causal=True, positions=positions)


@pytest.mark.portable
@pytest.mark.parametrize("window", [None, 3])
def test_layer_training_and_decoding_make_no_device_sync(window, device):
    torch.manual_seed(0)
    layer = make_layer(device, dropout=0.25)
    x = torch.randn(B, 9, 12).to(device)
    valid = torch.ones(B, 9, dtype=torch.bool)
    valid[1, :2] = False  # the second row left-padded by two tokens
    valid = valid.to(device)
    lengths = torch.tensor([9, 6]).to(device)
    with no_device_syncs(device):
        training_step(layer, x, masks.padding(valid))
        training_step(layer, x, masks.padding(lengths) & masks.alibi(masks.alibi_slopes(H).to(device)))
    layer.eval()
    with torch.no_grad():
        with no_device_syncs(device):
            cached = decode(layer, x, window=window, prompt=4, valid=valid)
        # the cached decode equals one full call over the whole sequence
        mask = masks.padding(valid) & (masks.window(window - 1, 0) if window else masks.causal())
        full, _ = layer(x, mask=mask, causal=True)
    torch.testing.assert_close(cached, full, atol=2e-5, rtol=2e-4)


def paged_decode(layer, x: torch.Tensor, *, window: int | None, prompt: int) -> torch.Tensor:
    """Each batch row a sequence of a paged cache: prefilled alone, then decoded together one token a step; the
    outputs (b, n, out_dim)."""
    cache = layer.new_paged_cache(num_pages=16, page_size=2, window=window)
    handles = [cache.add() for _ in range(x.shape[0])]
    prefills = [
        layer(x[row : row + 1, :prompt], causal=True, cache=cache.batch([h]))[0] for row, h in enumerate(handles)
    ]
    steps = [
        layer(x[:, step : step + 1], causal=True, cache=cache.batch(handles))[0] for step in range(prompt, x.shape[1])
    ]
    return torch.cat([torch.cat(prefills), *steps], dim=1)


@pytest.mark.parametrize("window", [None, 3])
def test_paged_decoding_reads_no_tensor_on_the_host(window):
    with fake_tensors():
        layer = make_layer(torch.device("cpu"), dropout=0.0).eval()
        with torch.no_grad():
            assert paged_decode(layer, torch.randn(B, 9, 12), window=window, prompt=4).shape == (B, 9, 12)


@pytest.mark.portable
@pytest.mark.parametrize("window", [None, 3])
def test_paged_decoding_makes_no_device_sync(window, device):
    torch.manual_seed(0)
    layer = make_layer(device, dropout=0.0).eval()
    x = torch.randn(B, 9, 12).to(device)
    with torch.no_grad():
        with no_device_syncs(device):
            paged = paged_decode(layer, x, window=window, prompt=4)
        full, _ = layer(x, mask=masks.window(window - 1, 0) if window else None, causal=True)
    torch.testing.assert_close(paged, full, atol=2e-5, rtol=2e-4)
