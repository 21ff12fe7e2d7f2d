"""Shared state under threads and faults: rotary tables and ``attention`` called from 4 threads at once.

- One ``MultiHeadAttention(rotary=True)`` shared by 4 threads, each calling it with its own sequence lengths
  and positions (so the rotary tables grow concurrently), gives every thread the outputs a single-threaded
  run gives, and leaves tables that later calls read correctly.
- ``multihead.attention`` from 4 threads (any backend, masks, weights, LSE) is bitwise equal to the same
  calls made one after another.
- A MemoryError raised by any torch call while a rotary table grows (injected through a TorchFunctionMode
  at the k-th call, for every k) leaves the tables consistent: later calls, shorter and longer, equal a
  fresh module's, bitwise.

Threads switch every microsecond here (``sys.setswitchinterval``) so that interleavings are frequent.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import Findings, backends_or_auto, make_inputs, mask_specs, seeds, selections, shapes
from torch.overrides import TorchFunctionMode

import multihead
from multihead import MultiHeadAttention
from multihead._errors import InputError
from multihead.positional import RotaryEmbedding
from support import tiny_blocks  # tests/support.py

THREADS = 4
JOIN_TIMEOUT = 60.0


@contextlib.contextmanager
def fast_switching(interval: float = 1e-6):
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def run_threads(work: list) -> tuple[list, list]:
    """Run each callable of ``work`` in its own thread, all released at once; (results, errors) per thread."""
    barrier = threading.Barrier(len(work))
    results: list = [None] * len(work)
    errors: list = [None] * len(work)

    def body(n: int) -> None:
        try:
            barrier.wait()
            results[n] = work[n]()
        except BaseException as error:  # noqa: BLE001 - reported per thread
            errors[n] = error

    threads = [threading.Thread(target=body, args=(n,), daemon=True) for n in range(len(work))]
    with fast_switching():
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_TIMEOUT)
    for n, t in enumerate(threads):
        if t.is_alive():
            errors[n] = TimeoutError(f"thread {n} still running after {JOIN_TIMEOUT} s")
    return results, errors


def same(a, b) -> bool:
    """Bitwise equal tensors (or tuples of them, or both None)."""
    if a is None or b is None:
        return a is b
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(map(same, a, b))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


# --------------------------------------------------------------------------- a layer shared by threads


@st.composite
def thread_plans(draw):
    """For each thread, a list of (length, first position or None) calls."""
    call = st.tuples(st.integers(1, 9), st.one_of(st.none(), st.integers(0, 2000)))
    return [draw(st.lists(call, min_size=2, max_size=5)) for _ in range(THREADS)]


def test_layer_shared_by_threads(tally, request):
    """4 threads call one rotary layer with their own lengths and positions: each gets the single-threaded outputs."""
    test = request.node.name

    @settings(max_examples=15)
    @given(
        plan=thread_plans(),
        g=st.sampled_from((1, 3)),
        d=st.sampled_from((2, 4, 8)),
        seed=seeds,
        backend=st.sampled_from(("auto", "tiled", "sdpa")),
    )
    def case(plan, g, d, seed, backend):
        torch.manual_seed(seed)
        layer = MultiHeadAttention(
            7, 3, num_kv_heads=g, head_dim=d, value_head_dim=5, rotary=True, backend=backend
        ).eval()
        single = copy.deepcopy(layer)
        gen = torch.Generator().manual_seed(seed)
        inputs = [
            [
                (torch.randn(2, n, 7, generator=gen), None if start is None else torch.arange(start, start + n))
                for n, start in calls
            ]
            for calls in plan
        ]
        with torch.no_grad():
            expected = [[single(x, positions=p)[0] for x, p in calls] for calls in inputs]

        def work(calls):
            def run():
                with torch.no_grad():
                    return [layer(x, positions=p)[0] for x, p in calls]

            return run

        results, errors = run_threads([work(calls) for calls in inputs])
        problems = []
        for n in range(THREADS):
            if errors[n] is not None:
                tally.record(test, "crash", f"thread {n}: {type(errors[n]).__name__}: {errors[n]}")
                problems.append(f"thread {n} raised {type(errors[n]).__name__}: {errors[n]}")
                continue
            for c, (got, want) in enumerate(zip(results[n], expected[n], strict=True)):
                if same(got, want):
                    tally.record(test, "ok")
                else:
                    diff = (got - want).abs().max().item() if got.shape == want.shape else f"shape {tuple(got.shape)}"
                    tally.record(test, "wrong", f"thread {n} call {c}: off by {diff}")
                    problems.append(f"thread {n} call {c} {plan[n][c]}: output off the single-threaded one by {diff}")
        problems += later_calls_problems(layer.rotary, test, tally)
        findings.add(*problems)

    findings = Findings()
    case()
    findings.check()


LATER_POSITIONS = (0, 7, 150, 700, torch.arange(5) * 97)


def later_calls_problems(rope: RotaryEmbedding, test: str, tally, expected: list | None = None) -> list[str]:
    """Rotations at positions below, within and beyond the tables a module holds now equal a fresh module's
    (``expected``: those, when already computed)."""
    problems = []
    shapes_now = {name: tuple(b.shape) for name, b in rope.named_buffers()}
    if len(shapes_now) > 1 and len({shape[-2] if len(shape) >= 2 else shape[0] for shape in shapes_now.values()}) > 1:
        detail = f"tables of different lengths: {shapes_now}"
        tally.record(test, "state_corrupted", detail)
        problems.append(detail)
    x = torch.randn(2, 3, 5, rope.head_dim, generator=torch.Generator().manual_seed(1))
    if expected is None:
        expected = fresh_rotations(rope.head_dim, rope.base)
    for positions, want in zip(LATER_POSITIONS, expected, strict=True):
        try:
            got = rope.rotate(x, positions)
        except Exception as error:  # noqa: BLE001
            tally.record(test, "crash", f"a later rotate at {positions}: {type(error).__name__}: {error}")
            problems.append(f"a later rotate at {positions} raised {type(error).__name__}: {error}")
            continue
        if not same(got, want):
            tally.record(test, "state_corrupted", f"a later rotate at {positions} differs from a fresh module's")
            problems.append(
                f"a later rotate at {positions} differs from a fresh module's "
                f"({tuple(got.shape)} vs {tuple(want.shape)})"
            )
    return problems


def fresh_rotations(head_dim: int, base: float) -> list[torch.Tensor]:
    fresh = RotaryEmbedding(head_dim, base)
    x = torch.randn(2, 3, 5, head_dim, generator=torch.Generator().manual_seed(1))
    return [fresh.rotate(x, positions) for positions in LATER_POSITIONS]


# --------------------------------------------------------------------------- attention from threads


@st.composite
def attention_calls(draw):
    shape = draw(shapes(max_size=7))
    dtype = draw(st.sampled_from((torch.float32, torch.float64, torch.bfloat16)))
    spec = draw(mask_specs(shape, max_terms=2))
    backend = draw(st.sampled_from(backends_or_auto()))
    return_weights = draw(st.one_of(st.booleans(), selections(shape.h, shape.i)))
    return_lse = draw(st.booleans()) and backend in ("auto", "tiled", "reference")  # the others lack the LSE
    q, k, v = make_inputs(shape, dtype, draw(seeds))
    kwargs = {
        "mask": spec.build(),
        "causal": spec.causal,
        "backend": backend,
        "return_weights": return_weights,
        "return_lse": return_lse,
    }
    return f"{shape} {dtype} {spec} {backend} weights={return_weights} lse={return_lse}", q, k, v, kwargs


def _call(q, k, v, kwargs):
    return tuple(multihead.attention_result(q, k, v, **kwargs))


def test_attention_from_threads_is_bitwise_single_threaded(tally, request):
    """4 threads each making their own attention calls at once: bitwise the results of one thread alone."""
    test = request.node.name

    @settings(max_examples=10)
    @given(calls=st.lists(st.lists(attention_calls(), min_size=1, max_size=3), min_size=THREADS, max_size=THREADS))
    def case(calls):
        # tiny_blocks patches module globals: set once around the single-threaded and the threaded runs
        with tiny_blocks():
            compare(calls)

    def compare(calls):
        expected = []
        for per_thread in calls:
            row = []
            for _, q, k, v, kwargs in per_thread:
                try:
                    row.append(_call(q, k, v, kwargs))
                except Exception as error:  # noqa: BLE001 - a backend that cannot serve it: the same in threads
                    row.append(error)
            expected.append(row)

        def work(per_thread):
            def run():
                out = []
                for _, q, k, v, kwargs in per_thread:
                    try:
                        out.append(_call(q, k, v, kwargs))
                    except Exception as error:  # noqa: BLE001
                        out.append(error)
                return out

            return run

        results, errors = run_threads([work(per_thread) for per_thread in calls])
        problems = []
        for n in range(THREADS):
            if errors[n] is not None:
                tally.record(test, "crash", f"thread {n}: {type(errors[n]).__name__}: {errors[n]}")
                problems.append(f"thread {n} raised {type(errors[n]).__name__}: {errors[n]}")
                continue
            for (label, *_), got, want in zip(calls[n], results[n], expected[n], strict=True):
                if isinstance(want, Exception) and not isinstance(want, InputError):
                    # a valid call that fails even alone: a defect of its own, not of threading
                    tally.record(test, "crash", f"{label}: {type(want).__name__}: {want}")
                    problems.append(f"{label}: raised {type(want).__name__} even single-threaded: {want}")
                    continue
                if isinstance(want, Exception) or isinstance(got, Exception):
                    ok = type(got) is type(want) and str(got) == str(want)
                else:
                    ok = all(same(a, b) for a, b in zip(got, want, strict=True))
                tally.record(test, "ok" if ok else "wrong", "" if ok else f"thread {n}: {label}")
                if not ok:
                    problems.append(f"thread {n}: {label}: differs from the single-threaded result")
        findings.add(*problems)

    findings = Findings()
    case()
    findings.check()


# --------------------------------------------------------------------------- faults during table growth


def _caller_module() -> str:
    """The module of the first frame outside torch and this file: who made the torch call."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_globals.get("__name__", "").startswith("torch") or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    return "" if frame is None else frame.f_globals.get("__name__", "")


class FailAt(TorchFunctionMode):
    """Raise MemoryError at the ``at``-th torch call made from multihead.positional (attribute reads not
    counted); ``at=None`` only counts them."""

    def __init__(self, at: int | None):
        super().__init__()
        self.at, self.count, self.fired = at, 0, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") != "__get__" and _caller_module() == "multihead.positional":
            if self.at is not None and not self.fired and self.count == self.at:
                self.fired = True
                raise MemoryError(f"injected at torch call {self.count} ({getattr(func, '__name__', func)})")
            self.count += 1
        return func(*args, **(kwargs or {}))


def _growth_call(kind: str, target, x: torch.Tensor, start: int):
    n = x.shape[-2]
    if kind == "rotate(int)":
        return lambda: target.rotate(x, start)
    if kind == "rotate(tensor)":
        return lambda: target.rotate(x, torch.arange(start, start + n))
    if kind == "forward":
        return lambda: target(x, x, offset=start)
    if kind == "layer":
        return lambda: target(x, positions=torch.arange(start, start + x.shape[1]))[0]
    raise AssertionError(kind)


def test_memory_error_while_tables_grow(tally, request):
    """A MemoryError at each torch call multihead.positional makes while the tables grow (every one in turn):
    the call raises or is right, and later calls equal those of a module that never met the fault, bitwise."""
    test = request.node.name

    @settings(max_examples=8)
    @given(
        kind=st.sampled_from(("rotate(int)", "rotate(tensor)", "forward", "layer")),
        d=st.sampled_from((2, 4, 6)),
        warm=st.integers(0, 40),
        grow=st.integers(20, 300),
        dtype=st.sampled_from((torch.float32, torch.float64)),
    )
    def case(kind, d, warm, grow, dtype):
        def build():
            if kind == "layer":
                torch.manual_seed(0)
                layer = MultiHeadAttention(5, 2, head_dim=d, value_head_dim=3, rotary=True, dtype=dtype).eval()
                return layer, layer.rotary
            rope = RotaryEmbedding(d)
            return rope, rope

        x = torch.randn(2, 3, 5, dtype=dtype) if kind == "layer" else torch.randn(2, 3, 4, d, dtype=dtype)
        clean, _ = build()
        expected_rotations = fresh_rotations(d, 10000.0)
        problems = []
        starts = (0, warm, grow, grow * 2)
        with torch.no_grad():
            if warm:
                _growth_call(kind, clean, x, warm)()
            expected_grow = _growth_call(kind, copy.deepcopy(clean), x, grow)()
            expected_later = [_growth_call(kind, clean, x, start)() for start in starts]
            counter = FailAt(None)
            with counter:
                _growth_call(kind, copy.deepcopy(clean), x, grow)()
            for at in range(counter.count):
                target, rope = build()
                if warm:  # tables of some size already
                    _growth_call(kind, target, x, warm)()
                where = f"{kind} d={d} {dtype}, tables for {warm} then {grow}, fault at call {at} of {counter.count}"
                result, error = None, None
                try:
                    with FailAt(at):
                        result = _growth_call(kind, target, x, grow)()
                except Exception as raised:  # noqa: BLE001 - MemoryError, or anything it became
                    error = raised
                found = []
                if error is None and not same(result, expected_grow):
                    found.append("the call that met the fault returned a wrong result")
                found += later_calls_problems(rope, test, tally, expected_rotations)
                for start, want in zip(starts, expected_later, strict=True):
                    try:
                        got = _growth_call(kind, target, x, start)()
                    except Exception as raised:  # noqa: BLE001
                        found.append(f"a later call at {start} raised {type(raised).__name__}: {raised}")
                        continue
                    if not same(got, want):
                        found.append(f"a later call at {start} differs from a module that never met the fault")
                tally.record(test, "state_corrupted" if found else "ok", f"{where}: {found}" if found else "")
                problems += [f"{where}: {f}" for f in found]
                if found:
                    break  # one fault point that breaks the tables is enough for this example
        findings.add(*problems)

    findings = Findings()
    case()
    findings.check()
