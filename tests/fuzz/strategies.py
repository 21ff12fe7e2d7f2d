"""Hypothesis strategies shared by the fuzz suite: shapes, dtypes, typed masks, selections, backends.

Every mask comes as a :class:`MaskSpec`: ``build()`` gives what a user would pass (a typed mask from
:mod:`multihead.masks`, ``&`` combinations, or a plain bool/float tensor) and ``dense(shape)`` gives the
same mask evaluated independently, here, in float64 ((b, h, i, j) keep and bias), so tests know which
rows are fully masked and can check the oracle itself without trusting multihead's mask code.
"""

from __future__ import annotations

import contextlib
import math
import resource
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import strategies as st

import multihead
from multihead import masks
from multihead._errors import InputError
from multihead.backends import available_backends, get_backend

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
LOW_PRECISION = (torch.float16, torch.bfloat16)

# --------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """Sizes of one attention call: q (b, h, i, d), k (b, g, j, d), v (b, g, j, e); unbatched drops b (b = 1)."""

    b: int
    h: int
    g: int
    i: int
    j: int
    d: int
    e: int
    unbatched: bool = False

    def lead(self) -> tuple[int, ...]:
        return () if self.unbatched else (self.b,)

    @property
    def q(self) -> tuple[int, ...]:
        return (*self.lead(), self.h, self.i, self.d)

    @property
    def k(self) -> tuple[int, ...]:
        return (*self.lead(), self.g, self.j, self.d)

    @property
    def v(self) -> tuple[int, ...]:
        return (*self.lead(), self.g, self.j, self.e)

    @property
    def full(self) -> tuple[int, int, int, int]:
        """(b, h, i, j): what masks broadcast to."""
        return (self.b, self.h, self.i, self.j)


SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9)


@st.composite
def shapes(
    draw, *, max_size: int = 9, allow_unbatched: bool = True, equal_lengths: bool | None = None, min_len: int = 1
) -> Shape:
    """GQA (h % g == 0), d != e, i != j unless ``equal_lengths`` (None: sometimes), batched or unbatched."""
    g = draw(st.sampled_from((1, 2, 3)))
    r = draw(st.sampled_from((1, 2, 3)))
    h = g * r
    unbatched = allow_unbatched and draw(st.booleans())
    b = 1 if unbatched else draw(st.sampled_from((1, 2, 3)))
    sizes = [s for s in SIZES if min_len <= s <= max_size]
    same = draw(st.booleans()) if equal_lengths is None else equal_lengths
    i = draw(st.sampled_from(sizes))
    j = i if same else draw(st.sampled_from([s for s in sizes if s != i] or sizes))
    d = draw(st.sampled_from([s for s in SIZES if s <= max_size]))
    e = draw(st.sampled_from([s for s in SIZES if s != d and s <= max_size]))
    return Shape(b, h, g, i, j, d, e, unbatched)


dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**31 - 1)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_inputs(
    shape: Shape, dtype: torch.dtype, seed: int, magnitude: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of ``shape`` drawn N(0, 1) in float64 from ``seed``, times ``magnitude``, cast to ``dtype``."""
    gen = generator(seed)
    return tuple(
        (torch.randn(size, generator=gen, dtype=torch.float64) * magnitude).to(dtype)
        for size in (shape.q, shape.k, shape.v)
    )


# backends that compile a kernel per new head shape, dtype and mask structure (flex: ~10 s each on a small CPU):
# random calls would spend the budget compiling; tests/core/test_backends_flex.py covers them on shared kernels
COMPILING_BACKENDS = ("flex",)


def backends_or_auto() -> list[str]:
    """'auto' and every registered backend of dense keys but the compiling ones, in auto's order (the paged backend
    serves paged calls only: tests/core/test_paged_seam.py and the state fuzz cover it)."""
    return [
        "auto",
        *(
            name
            for name in available_backends()
            if name not in COMPILING_BACKENDS and not get_backend(name).capabilities.paged
        ),
    ]


backend_names = st.sampled_from(backends_or_auto())

# --------------------------------------------------------------------------- masks, evaluated here


def _positions(shape: Shape, align: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Aligned query positions (i, 1) and key positions (1, j), as int64."""
    offset = shape.j - shape.i if align == "bottom_right" else 0
    rows = torch.arange(shape.i)[:, None] + offset
    cols = torch.arange(shape.j)[None, :]
    return rows, cols


def _broadcast4(t: torch.Tensor, shape: Shape) -> torch.Tensor:
    return t.reshape((1,) * (4 - t.ndim) + tuple(t.shape)).expand(shape.full)


@dataclass(frozen=True, eq=False)
class Term:
    """One primitive mask: ``kind`` and its arguments; ``plain`` passes a tensor without a typed wrapper."""

    kind: str  # causal, window, lengths, valid, alibi, bias, allowed
    args: dict = field(default_factory=dict)
    plain: bool = False

    def build(self) -> masks.Mask | torch.Tensor:
        a = self.args
        if self.kind == "causal":
            return masks.causal(a["align"])
        if self.kind == "window":
            return masks.window(a["left"], a["right"], align=a["align"])
        if self.kind in ("lengths", "valid"):
            return masks.padding(a["keys"])
        if self.kind == "alibi":
            return masks.alibi(a["slopes"], align=a["align"])
        if self.kind == "bias":
            return a["tensor"] if self.plain else masks.bias(a["tensor"])
        if self.kind == "allowed":
            return a["tensor"] if self.plain else masks.allowed(a["tensor"])
        raise AssertionError(self.kind)

    def dense(self, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
        """(keep bool, bias float64), each (b, h, i, j), computed from the definitions in multihead.masks' docstring."""
        keep = torch.ones(shape.full, dtype=torch.bool)
        bias = torch.zeros(shape.full, dtype=torch.float64)
        a = self.args
        if self.kind in ("causal", "window"):
            left, right = (None, 0) if self.kind == "causal" else (a["left"], a["right"])
            rows, cols = _positions(shape, a["align"])
            k2 = torch.ones(shape.i, shape.j, dtype=torch.bool)
            if right is not None:
                k2 &= cols <= rows + right
            if left is not None:
                k2 &= cols >= rows - left
            keep = keep & k2
        elif self.kind == "lengths":
            lengths = torch.as_tensor(a["keys"])
            keep = keep & (torch.arange(shape.j)[None, :] < lengths[:, None])[:, None, None, :]
        elif self.kind == "valid":
            keep = keep & a["keys"][:, None, None, :]
        elif self.kind == "alibi":
            rows, cols = _positions(shape, a["align"])
            slopes = torch.as_tensor(a["slopes"], dtype=torch.float32).double()
            bias = bias - slopes[None, :, None, None] * (cols - rows).abs().double()[None, None]
        elif self.kind == "bias":
            t = _broadcast4(a["tensor"].double(), shape)
            bias = bias + t
            keep = keep & (t > -math.inf)
        elif self.kind == "allowed":
            keep = keep & _broadcast4(a["tensor"], shape)
        return keep, bias

    def __repr__(self) -> str:
        shown = {}
        for key, value in self.args.items():
            shown[key] = (
                f"tensor{tuple(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
                if isinstance(value, torch.Tensor)
                else value
            )
        return f"{'plain ' if self.plain else ''}{self.kind}({shown})"


@dataclass(frozen=True, eq=False)
class MaskSpec:
    """A mask for one call: the ``&`` of ``terms`` (None when empty), plus the call's ``causal`` flag."""

    terms: tuple[Term, ...] = ()
    causal: bool = False

    def build(self) -> masks.Mask | torch.Tensor | None:
        if not self.terms:
            return None
        built = [t.build() for t in self.terms]
        mask = built[0]
        for part in built[1:]:
            if isinstance(mask, torch.Tensor) and isinstance(part, torch.Tensor):
                part = masks.as_mask(part)  # tensor & tensor would be torch's bitwise and
            mask = mask & part  # a typed mask & a tensor, a tensor & a typed mask (__rand__), typed & typed
        return mask

    def dense(self, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
        """keep (b, h, i, j) bool and bias (b, h, i, j) float64 of the whole mask, causal flag included."""
        keep = torch.ones(shape.full, dtype=torch.bool)
        bias = torch.zeros(shape.full, dtype=torch.float64)
        terms = list(self.terms) + ([Term("causal", {"align": "bottom_right"})] if self.causal else [])
        for term in terms:
            k, b = term.dense(shape)
            keep, bias = keep & k, bias + b
        return keep, bias

    def dead_rows(self, shape: Shape) -> torch.Tensor:
        """(b, h, i) True where every key is masked."""
        keep, bias = self.dense(shape)
        return ~(keep & (bias > -math.inf)).any(-1)

    def __repr__(self) -> str:
        return f"MaskSpec({' & '.join(map(repr, self.terms)) or 'None'}, causal={self.causal})"


aligns = st.sampled_from(("bottom_right", "top_left"))


def _tensor_shape(draw, shape: Shape) -> tuple[int, ...]:
    """A shape broadcastable to (b, h, i, j): 2 to 4 dims, each 1 or full; the key dim mostly full."""
    ndim = draw(st.sampled_from((2, 3, 4)))
    dims = [draw(st.sampled_from((1, n))) for n in shape.full]
    dims[3] = shape.j if draw(st.integers(0, 3)) else dims[3]
    return tuple(dims[4 - ndim :])


@st.composite
def terms(draw, shape: Shape, *, allow_bias: bool = True) -> Term:
    """One primitive mask for calls of ``shape``."""
    kinds = ["causal", "window", "lengths", "valid", "allowed"] + (["alibi", "bias"] if allow_bias else [])
    kind = draw(st.sampled_from(kinds))
    seed = draw(seeds)
    gen = generator(seed)
    if kind == "causal":
        return Term("causal", {"align": draw(aligns)})
    if kind == "window":
        side = st.one_of(st.none(), st.integers(0, shape.j + 1))
        return Term("window", {"left": draw(side), "right": draw(side), "align": draw(aligns)})
    if kind == "lengths":
        lengths = draw(st.lists(st.integers(0, shape.j), min_size=shape.b, max_size=shape.b))
        keys = lengths if draw(st.booleans()) else torch.tensor(lengths)  # a list or a (b,) tensor
        return Term("lengths", {"keys": keys})
    if kind == "valid":
        p = draw(st.sampled_from((0.2, 0.6, 0.9)))
        return Term("valid", {"keys": torch.rand(shape.b, shape.j, generator=gen) < p, "seed": seed})
    if kind == "alibi":
        slopes = masks.alibi_slopes(shape.h) if draw(st.booleans()) else torch.rand(shape.h, generator=gen) * 2
        return Term("alibi", {"slopes": slopes, "align": draw(aligns), "seed": seed})
    size = _tensor_shape(draw, shape)
    plain = draw(st.booleans())
    if kind == "bias":
        tensor = torch.randn(size, generator=gen) * draw(st.sampled_from((0.5, 3.0)))
        if draw(st.booleans()):  # some -inf entries: masked by the bias itself
            tensor = tensor.masked_fill(torch.rand(size, generator=gen) < 0.3, -math.inf)
        return Term("bias", {"tensor": tensor, "seed": seed}, plain)
    p = draw(st.sampled_from((0.3, 0.7, 0.95)))
    return Term("allowed", {"tensor": torch.rand(size, generator=gen) < p, "seed": seed}, plain)


@st.composite
def mask_specs(draw, shape: Shape, *, max_terms: int = 3, allow_bias: bool = True) -> MaskSpec:
    """None, one primitive mask or several combined with ``&``, and sometimes ``causal=True``."""
    n = draw(st.integers(0, max_terms))
    drawn = tuple(draw(terms(shape, allow_bias=allow_bias)) for _ in range(n))
    return MaskSpec(drawn, draw(st.booleans()))


# --------------------------------------------------------------------------- selections


@st.composite
def selections(draw, h: int, i: int) -> multihead.WeightSelection:
    """A valid WeightSelection: heads None or a non-empty list; queries None, a list or a non-empty slice."""
    heads = None
    if draw(st.booleans()):
        heads = draw(st.lists(st.integers(0, h - 1), min_size=1, max_size=h, unique=True))
    queries = None
    kind = draw(st.sampled_from(("none", "list", "slice")))
    if kind == "list":
        queries = draw(st.lists(st.integers(0, i - 1), min_size=1, max_size=i, unique=True))
    elif kind == "slice":
        start = draw(st.one_of(st.none(), st.integers(0, i - 1)))
        first = 0 if start is None else start
        stop = draw(st.one_of(st.none(), st.integers(first + 1, i + 2)))
        step = draw(st.sampled_from((None, 1, 2, 3)))
        queries = slice(start, stop, step)
    return multihead.WeightSelection(heads=heads, queries=queries)


def select_weights(weights: torch.Tensor, selection: multihead.WeightSelection | None) -> torch.Tensor:
    """Weights (..., h, i, j) restricted to a selection, computed here (the expected value)."""
    if selection is None:
        return weights
    if selection.heads is not None:
        weights = weights[..., list(selection.heads), :, :]
    if selection.queries is not None:
        queries = selection.queries
        weights = weights[..., queries, :] if isinstance(queries, slice) else weights[..., list(queries), :]
    return weights


# --------------------------------------------------------------------------- guards for bad inputs


class Overtime(BaseException):
    """Raised by :func:`guarded` when a call runs past its time budget."""


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def guarded(seconds: float = 2.0, extra_memory: int = 2 << 30):
    """At most ``seconds`` of wall time (an Overtime raised in the call) and ``extra_memory`` more bytes of
    address space (an allocation beyond fails at once instead of swapping or waking the OOM killer)."""
    limit_set = False
    old_limit = resource.getrlimit(resource.RLIMIT_AS)
    vm = _vm_size()
    if vm:
        soft = vm + extra_memory
        if old_limit[1] == resource.RLIM_INFINITY or soft < old_limit[1]:
            resource.setrlimit(resource.RLIMIT_AS, (soft, old_limit[1]))
            limit_set = True

    def alarm(signum, frame):
        raise Overtime(f"still running after {seconds} s")

    old_handler = signal.signal(signal.SIGALRM, alarm)
    started = time.monotonic()
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)  # pytest-timeout's alarm, if armed
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:  # re-arm the alarm we displaced, less the time spent here
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - started), 0.01), old_interval)
        if limit_set:
            resource.setrlimit(resource.RLIMIT_AS, old_limit)


@dataclass
class Attempt:
    """What one call did: its result or error, and how long it took."""

    result: object = None
    error: BaseException | None = None
    seconds: float = 0.0


def attempt(call: Callable[[], object], *, seconds: float = 2.0) -> Attempt:
    """Run ``call`` under :func:`guarded`; never raises (except KeyboardInterrupt)."""
    out = Attempt()
    start = time.perf_counter()
    try:
        with guarded(seconds):
            out.result = call()
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - Overtime, MemoryError, torch's RuntimeError: all recorded
        out.error = error
    out.seconds = time.perf_counter() - start
    return out


def contains_nan(value: object) -> bool:
    """NaN anywhere in a tensor or a tuple/list/NamedTuple of them."""
    if isinstance(value, torch.Tensor):
        return bool(value.is_floating_point() and not value.is_meta and value.isnan().any())
    if isinstance(value, (tuple, list)):
        return any(contains_nan(v) for v in value)
    return False


def is_input_error(error: BaseException | None) -> bool:
    return isinstance(error, InputError)


def warm_up_threads() -> None:
    """Start torch's intra-op thread pool before any address-space limit is in force."""
    a = torch.randn(256, 256)
    (a @ a).sum()


# --------------------------------------------------------------------------- failing after the whole budget


class Findings:
    """Problems found across a test's examples, asserted once after hypothesis has run them all.

    The examples do not fail one by one: a failing example would make hypothesis shrink it (up to minutes
    for the costly ones), so a run with defects would blow the suite's time budget and stop at the first
    defect. Instead every case is recorded (see the tally) and the test fails at the end, listing them.
    """

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, *problems: str) -> None:
        self.items.extend(problems)

    def check(self, limit: int = 12) -> None:
        if not self.items:
            return
        distinct = list(dict.fromkeys(self.items))
        shown = "\n".join(f"- {item}" for item in distinct[:limit])
        more = f"\n... and {len(distinct) - limit} more" if len(distinct) > limit else ""
        raise AssertionError(f"{len(self.items)} failing case(s):\n{shown}{more}")
