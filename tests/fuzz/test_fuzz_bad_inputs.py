"""Fuzz every public entry with bad inputs: each must be refused with multihead's InputError (a ValueError or
TypeError) whose message reads "<arg>: expected ..., got .... Fix: ...", at once (under 2 s, and without
reaching for more than 2 GiB: sizes that cannot fit are refused before allocating), never accepted
silently and never answered with NaN.

Entries: ``attention`` and ``explain`` (tensors, options, masks, selections, sizes that cannot fit), the
mask constructors and ``&`` (``masks``), ``masks.alibi_slopes``, ``WeightSelection`` (built, then used),
the ``MultiHeadAttention`` constructor and ``forward``, ``KVCache`` and ``KVCache.append``, and the
positional modules. Each entry draws a valid baseline and one defect from its own table.
``test_issue_listed_bad_input`` runs the cases the issue names, every time.

Choices where the contract leaves room (see DESIGN.md): a layer's input must have the dtype and device of
its parameters (a mixed dtype is a TypeError, not a silent cast); ``device="cuda"`` on a machine without
CUDA is a bad device; a negative head or query index in a WeightSelection counts from the end, as everywhere
in multihead (issue 32: one meaning), so only one below -h (or -i) is out of range; an error may come when a
WeightSelection is built or when it is used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Findings, Overtime, Shape, attempt, contains_nan, make_inputs, seeds, shapes, warm_up_threads

import multihead
from multihead import KVCache, MultiHeadAttention, WeightSelection, masks
from multihead.positional import LearnedPositions, RotaryEmbedding, SinusoidalPositions

TIME_BUDGET = 2.0  # seconds for one refusal: "refuse before allocating", not a benchmark
HUGE = 2**40

warm_up_threads()


@dataclass(frozen=True, eq=False)
class Bad:
    """One bad call: ``call()`` must raise an InputError."""

    entry: str
    label: str
    call: Callable[[], object]

    def __repr__(self) -> str:
        return f"Bad({self.entry}: {self.label})"


def judge(case: Bad, tally, test: str) -> tuple[str, str]:
    """Run the case under the time and memory guard and record its outcome."""
    result = attempt(case.call, seconds=TIME_BUDGET)
    where = f"{case.entry}: {case.label}"
    if isinstance(result.error, Overtime) or result.seconds > TIME_BUDGET:
        detail = f"{where}: took {result.seconds:.1f} s" + (
            f" and raised {type(result.error).__name__}" if result.error is not None else ""
        )
        return tally.record(test, "crash", detail), detail
    if result.error is None:
        nan = " (and returned NaN)" if contains_nan(result.result) else ""
        detail = f"{where}: accepted{nan}, returned {type(result.result).__name__}"
        tally.record(test, "bad_input_accepted", detail)
        return "bad_input_accepted", detail
    outcome = tally.rejection(test, result.error)
    return outcome, f"{where}: {type(result.error).__name__}: {result.error}"


def check(case: Bad, tally, test: str) -> None:
    outcome, detail = judge(case, tally, test)
    assert outcome == "ok", f"[{outcome}] {detail}"


# --------------------------------------------------------------------------- attention and explain


def _with_batch(t: torch.Tensor, n: int) -> torch.Tensor:
    """t (b, ...) with batch n (rows repeated or cut)."""
    return t[:1].expand(n, *t.shape[1:]).clone()


class later:
    """An argument built only when the bad call runs (so a constructor that validates raises inside the guard)."""

    def __init__(self, make: Callable[[], object]):
        self.make = make


def _resolve(value):
    return value.make() if isinstance(value, later) else value


def _mutations(shape, q, k, v, huge: bool):
    """(label, args, kwargs) bad calls derived from a valid q, k, v of ``shape``."""
    b, h, g, i, j, d, e = shape.b, shape.h, shape.g, shape.i, shape.j, shape.d, shape.e
    lead = shape.lead()
    batched = not shape.unbatched
    bool_full = torch.ones(b, h, i, j, dtype=torch.bool)
    other = torch.float32 if q.dtype == torch.float64 else torch.float64
    m = [
        ("q is a list", (q.tolist(), k, v), {}),
        ("k is None", (q, None, v), {}),
        ("v is a numpy array", (q, k, v.numpy()), {}),
        ("q, k, v int64", (q.long(), k.long(), v.long()), {}),
        ("q, k, v complex64", (q.to(torch.complex64), k.to(torch.complex64), v.to(torch.complex64)), {}),
        ("q, k, v bool", (q > 0, k > 0, v > 0), {}),
        (f"k {other} with q {q.dtype}", (q, k.to(other), v), {}),
        (f"v float16 with q {q.dtype}", (q, k, v.half()), {}),
        ("k on the meta device", (q, k.to("meta"), v), {}),
        ("q 2-D", (q.reshape(-1, d), k, v), {}),
        ("q, k, v 5-D", (q[None, None], k[None, None], v[None, None]), {}),
        ("k has one dim fewer than q", (q, k.flatten(0, 1), v), {}),
        (f"v has g = {g + 1} heads, k has {g}", (q, k, torch.randn(*lead, g + 1, j, e)), {}),
        (
            f"k, v have g = {h + 1} heads, h = {h} is not a multiple",
            (q, torch.randn(*lead, h + 1, j, d), torch.randn(*lead, h + 1, j, e)),
            {},
        ),
        (f"k head dim {d + 1} != q's {d}", (q, torch.randn(*lead, g, j, d + 1), v), {}),
        (f"v length {j + 1} != k's {j}", (q, k, torch.randn(*lead, g, j + 1, e)), {}),
        ("no queries (i = 0)", (q[..., :0, :], k, v), {}),
        ("no keys (j = 0)", (q, k[..., :0, :], v[..., :0, :]), {}),
        ("scale inf", (q, k, v), {"scale": math.inf}),
        ("scale nan", (q, k, v), {"scale": math.nan}),
        ("scale '0.5'", (q, k, v), {"scale": "0.5"}),
        ("scale True", (q, k, v), {"scale": True}),
        ("scale complex", (q, k, v), {"scale": 1j}),
        ("scale a tensor of 2 values", (q, k, v), {"scale": torch.tensor([0.5, 0.5])}),
        ("dropout -0.1", (q, k, v), {"dropout": -0.1}),
        ("dropout 1.0", (q, k, v), {"dropout": 1.0}),
        ("dropout nan", (q, k, v), {"dropout": math.nan}),
        ("dropout '0.1'", (q, k, v), {"dropout": "0.1"}),
        ("training 'yes'", (q, k, v), {"training": "yes"}),
        ("causal 1", (q, k, v), {"causal": 1}),
        ("causal None", (q, k, v), {"causal": None}),
        ("return_lse 1", (q, k, v), {"return_lse": 1}),
        ("backend 3", (q, k, v), {"backend": 3}),
        ("backend 'nope'", (q, k, v), {"backend": "nope"}),
        ("backend ''", (q, k, v), {"backend": ""}),
        ("return_weights 'all'", (q, k, v), {"return_weights": "all"}),
        ("return_weights 1", (q, k, v), {"return_weights": 1}),
        ("return_weights [0]", (q, k, v), {"return_weights": [0]}),
        ("mask 'causal'", (q, k, v), {"mask": "causal"}),
        ("mask 3", (q, k, v), {"mask": 3}),
        ("mask a nested list", (q, k, v), {"mask": bool_full.tolist()}),
        ("mask int64 tensor", (q, k, v), {"mask": bool_full.long()}),
        ("mask complex tensor", (q, k, v), {"mask": bool_full.to(torch.complex64)}),
        ("mask 5-D", (q, k, v), {"mask": bool_full[None]}),
        (f"bool mask of key length {j + 1}", (q, k, v), {"mask": torch.ones(b, 1, 1, j + 1, dtype=torch.bool)}),
        (f"float mask of query length {i + 2}", (q, k, v), {"mask": torch.zeros(1, 1, i + 2, j)}),
        (f"bool mask of {h + 1} heads", (q, k, v), {"mask": torch.ones(1, h + 1, 1, j, dtype=torch.bool)}),
        ("bool mask on the meta device", (q, k, v), {"mask": bool_full.to("meta")}),
        ("mask a WeightSelection", (q, k, v), {"mask": WeightSelection()}),
        (
            f"padding lengths for batch {b + 1}",
            (q, k, v),
            {"mask": later(lambda: masks.padding(torch.ones(b + 1, dtype=torch.long)))},
        ),
        (f"padding length {j + 1} > j", (q, k, v), {"mask": later(lambda: masks.padding(torch.full((b,), j + 1)))}),
        ("padding length -1", (q, k, v), {"mask": later(lambda: masks.padding(torch.full((b,), -1)))}),
        (
            f"padding valid of {j + 2} keys",
            (q, k, v),
            {"mask": later(lambda: masks.padding(torch.ones(b, j + 2, dtype=torch.bool)))},
        ),
        (
            "padding lengths on the meta device",
            (q, k, v),
            {"mask": later(lambda: masks.padding(torch.ones(b, dtype=torch.long, device="meta")))},
        ),
        (f"alibi with {h + 1} slopes", (q, k, v), {"mask": later(lambda: masks.alibi(masks.alibi_slopes(h + 1)))}),
        (
            "alibi slopes on the meta device",
            (q, k, v),
            {"mask": later(lambda: masks.alibi(torch.ones(h, device="meta")))},
        ),
        (f"bias of key length {j + 2}", (q, k, v), {"mask": later(lambda: masks.bias(torch.zeros(i, j + 2)))}),
        ("bias on the meta device", (q, k, v), {"mask": later(lambda: masks.bias(torch.zeros(i, j, device="meta")))}),
        (
            f"allowed of {i + 1} queries & causal",
            (q, k, v),
            {"mask": later(lambda: masks.causal() & masks.allowed(torch.ones(i + 1, j, dtype=torch.bool)))},
        ),
        (f"WeightSelection heads=[{h}]", (q, k, v), {"return_weights": later(lambda: WeightSelection(heads=[h]))}),
        (
            f"WeightSelection heads=[{-h - 1}]",
            (q, k, v),
            {"return_weights": later(lambda: WeightSelection(heads=[-h - 1]))},
        ),
        ("WeightSelection heads=[]", (q, k, v), {"return_weights": later(lambda: WeightSelection(heads=[]))}),
        ("WeightSelection heads='0'", (q, k, v), {"return_weights": later(lambda: WeightSelection(heads="0"))}),
        ("WeightSelection heads=[0.0]", (q, k, v), {"return_weights": later(lambda: WeightSelection(heads=[0.0]))}),
        ("WeightSelection heads=[True]", (q, k, v), {"return_weights": later(lambda: WeightSelection(heads=[True]))}),
        ("WeightSelection heads=0", (q, k, v), {"return_weights": later(lambda: WeightSelection(heads=0))}),
        (f"WeightSelection queries=[{i}]", (q, k, v), {"return_weights": later(lambda: WeightSelection(queries=[i]))}),
        (
            "WeightSelection queries=slice(0, 2.5)",
            (q, k, v),
            {"return_weights": later(lambda: WeightSelection(queries=slice(0, 2.5)))},
        ),
        (
            "WeightSelection queries=slice('a', None)",
            (q, k, v),
            {"return_weights": later(lambda: WeightSelection(queries=slice("a", None)))},
        ),
        (
            "WeightSelection queries=slice(None, None, 0)",
            (q, k, v),
            {"return_weights": later(lambda: WeightSelection(queries=slice(None, None, 0)))},
        ),
        (
            "WeightSelection queries=slice(None, None, -1)",
            (q, k, v),
            {"return_weights": later(lambda: WeightSelection(queries=slice(None, None, -1)))},
        ),
        (
            f"WeightSelection queries=slice({i}, {i + 3}) (selects none)",
            (q, k, v),
            {"return_weights": later(lambda: WeightSelection(queries=slice(i, i + 3)))},
        ),
        (
            "WeightSelection queries={0} (a set)",
            (q, k, v),
            {"return_weights": later(lambda: WeightSelection(queries={0}))},
        ),
    ]
    if batched:
        m += [
            (f"k batch {b + 1} != q's {b}", (q, _with_batch(k, b + 1), v), {}),
            ("empty batch (b = 0)", (q[:0], k[:0], v[:0]), {}),
        ]
    if huge:
        big_k = torch.randn(*lead, g, 1, d).expand(*lead, g, HUGE, d)
        big_v = torch.randn(*lead, g, 1, e).expand(*lead, g, HUGE, e)
        big_q = torch.randn(*lead, h, 1, d).expand(*lead, h, HUGE, d)
        for backend in ("auto", "tiled", "reference", "materialized", "sdpa"):
            m.append((f"k, v expanded to j = 2**40 keys, backend={backend!r}", (q, big_k, big_v), {"backend": backend}))
        m.append(("q expanded to i = 2**40 queries", (big_q, k, v), {}))
        m.append(("q expanded to i = 2**40 queries, return_weights=True", (big_q, k, v), {"return_weights": True}))
    return m


def attention_cases(entry: str, fn: Callable, *, huge: bool) -> st.SearchStrategy[Bad]:
    @st.composite
    def strategy(draw):
        shape = draw(shapes(max_size=6))
        q, k, v = make_inputs(shape, draw(st.sampled_from((torch.float32, torch.float64))), draw(seeds))
        label, args, kwargs = draw(st.sampled_from(_mutations(shape, q, k, v, huge)))
        return Bad(
            entry, f"{label} [{shape}]", lambda: fn(*args, **{name: _resolve(value) for name, value in kwargs.items()})
        )

    return strategy()


# --------------------------------------------------------------------------- masks


MASK_CASES: list[tuple[str, Callable[[], object]]] = [
    ("causal(align='x')", lambda: masks.causal("x")),
    ("causal(align=3)", lambda: masks.causal(3)),
    ("causal('top-left')", lambda: masks.causal("top-left")),
    ("window(-1)", lambda: masks.window(-1)),
    ("window(1, -1)", lambda: masks.window(1, -1)),
    ("window(1.5)", lambda: masks.window(1.5)),
    ("window('2')", lambda: masks.window("2")),
    ("window(True)", lambda: masks.window(True)),
    ("window(None, 1.5)", lambda: masks.window(None, 1.5)),
    ("window(1, align='x')", lambda: masks.window(1, align="x")),
    ("padding('abc')", lambda: masks.padding("abc")),
    ("padding(None)", lambda: masks.padding(None)),
    ("padding(3)", lambda: masks.padding(3)),
    ("padding(float lengths)", lambda: masks.padding(torch.tensor([1.0, 2.0]))),
    ("padding([1.5, 2.0])", lambda: masks.padding([1.5, 2.0])),
    ("padding(complex lengths)", lambda: masks.padding(torch.tensor([1j]))),
    ("padding(3-D bool)", lambda: masks.padding(torch.ones(2, 3, 4, dtype=torch.bool))),
    ("padding(1-D bool)", lambda: masks.padding(torch.ones(3, dtype=torch.bool))),
    ("padding(2-D int)", lambda: masks.padding(torch.ones(2, 3, dtype=torch.long))),
    ("padding(0-d int)", lambda: masks.padding(torch.tensor(3))),
    ("padding(ragged list)", lambda: masks.padding([[1, 2], [3]])),
    ("alibi(int slopes)", lambda: masks.alibi(torch.tensor([1, 2]))),
    ("alibi(3-D slopes)", lambda: masks.alibi(torch.ones(2, 2, 2))),  # (h,) and (b, h) are slopes
    ("alibi(0-d slope)", lambda: masks.alibi(torch.tensor(0.5))),
    ("alibi('x')", lambda: masks.alibi("x")),
    ("alibi(None)", lambda: masks.alibi(None)),
    ("alibi(complex slopes)", lambda: masks.alibi(torch.tensor([1j, 2j]))),
    ("alibi(align='x')", lambda: masks.alibi([0.5, 0.25], align="x")),
    ("bias(bool tensor)", lambda: masks.bias(torch.ones(2, 3, dtype=torch.bool))),
    ("bias(int tensor)", lambda: masks.bias(torch.ones(2, 3, dtype=torch.long))),
    ("bias(complex tensor)", lambda: masks.bias(torch.ones(2, 3, dtype=torch.complex64))),
    ("bias([1.0])", lambda: masks.bias([1.0])),
    ("bias(None)", lambda: masks.bias(None)),
    ("bias(5-D)", lambda: masks.bias(torch.zeros(1, 1, 1, 2, 3))),
    ("allowed(float tensor)", lambda: masks.allowed(torch.ones(2, 3))),
    ("allowed(int tensor)", lambda: masks.allowed(torch.ones(2, 3, dtype=torch.long))),
    ("allowed([True])", lambda: masks.allowed([True])),
    ("allowed(5-D)", lambda: masks.allowed(torch.ones(1, 1, 1, 2, 3, dtype=torch.bool))),
    ("causal() & 3", lambda: masks.causal() & 3),
    ("causal() & 'x'", lambda: masks.causal() & "x"),
    ("causal() & None", lambda: masks.causal() & None),
    ("causal() & [True]", lambda: masks.causal() & [True]),
    ("causal() & int tensor", lambda: masks.causal() & torch.ones(2, 3, dtype=torch.long)),
    ("causal() & 5-D tensor", lambda: masks.causal() & torch.ones(1, 1, 1, 2, 3, dtype=torch.bool)),
    ("3 & causal()", lambda: 3 & masks.causal()),
    ("None & window(2)", lambda: None & masks.window(2)),
    ("int tensor & causal()", lambda: torch.ones(2, 3, dtype=torch.long) & masks.causal()),
    ("as_mask(3)", lambda: masks.as_mask(3)),
    ("as_mask('causal')", lambda: masks.as_mask("causal")),
]

SLOPES_CASES: list[tuple[str, Callable[[], object]]] = [
    (f"alibi_slopes({n!r})", (lambda n=n: masks.alibi_slopes(n)))
    for n in (0, -1, 2.5, "8", True, None, torch.tensor(8), HUGE, 2**62)
]


def table_cases(entry: str, table) -> st.SearchStrategy[Bad]:
    return st.sampled_from(table).map(lambda item: Bad(entry, item[0], item[1]))


@st.composite
def selection_cases(draw) -> Bad:
    """A WeightSelection built from bad arguments, then used on a valid call."""
    shape = draw(shapes(max_size=6))
    q, k, v = make_inputs(shape, torch.float32, draw(seeds))
    h, i = shape.h, shape.i
    label, kwargs = draw(
        st.sampled_from(
            [
                (f"heads=[{h}]", {"heads": [h]}),
                (f"heads=[{-h - 1}]", {"heads": [-h - 1]}),
                ("heads=[]", {"heads": []}),
                ("heads='0'", {"heads": "0"}),
                ("heads=[0.5]", {"heads": [0.5]}),
                ("heads=0", {"heads": 0}),
                ("heads=[None]", {"heads": [None]}),
                ("heads=[2**40]", {"heads": [HUGE]}),
                (f"queries=[{i}]", {"queries": [i]}),
                (f"queries=[{-i - 1}]", {"queries": [-i - 1]}),
                ("queries=slice(0, 2.5)", {"queries": slice(0, 2.5)}),
                ("queries=slice(0.5, 2)", {"queries": slice(0.5, 2)}),
                ("queries=slice(0, 2, 0)", {"queries": slice(0, 2, 0)}),
                ("queries=slice(0, 2, 1.5)", {"queries": slice(0, 2, 1.5)}),
                (f"queries=slice({i}, None)", {"queries": slice(i, None)}),
                ("queries='0'", {"queries": "0"}),
                ("queries=3", {"queries": 3}),
                ("queries=[[0]]", {"queries": [[0]]}),
            ]
        )
    )
    backend = draw(st.sampled_from(("auto", "reference", "tiled", "sdpa", "materialized")))
    return Bad(
        "WeightSelection",
        f"{label} on {shape}, backend={backend!r}",
        lambda: multihead.attention_result(q, k, v, backend=backend, return_weights=WeightSelection(**kwargs)),
    )


# --------------------------------------------------------------------------- the layer


LAYER_INIT_CASES: list[tuple[str, Callable[[], object]]] = [
    (label, (lambda kw=kw: MultiHeadAttention(**{"embed_dim": 8, "num_heads": 2, **kw})))
    for label, kw in [
        ("embed_dim=0", {"embed_dim": 0}),
        ("embed_dim=-4", {"embed_dim": -4}),
        ("embed_dim=2.5", {"embed_dim": 2.5}),
        ("embed_dim='8'", {"embed_dim": "8"}),
        ("embed_dim=True", {"embed_dim": True}),
        ("embed_dim=None", {"embed_dim": None}),
        ("num_heads=0", {"num_heads": 0}),
        ("num_heads=3", {"num_heads": 3}),
        ("num_heads='2'", {"num_heads": "2"}),
        ("num_heads=-2", {"num_heads": -2}),
        ("head_dim=0", {"head_dim": 0}),
        ("head_dim='4'", {"head_dim": "4"}),
        ("value_head_dim=-1", {"value_head_dim": -1}),
        ("num_kv_heads=3", {"num_kv_heads": 3}),
        ("num_kv_heads=0", {"num_kv_heads": 0}),
        ("num_kv_heads=1.0", {"num_kv_heads": 1.0}),
        ("kdim=-1", {"kdim": -1}),
        ("kdim='4'", {"kdim": "4"}),
        ("vdim=0", {"vdim": 0}),
        ("out_dim=0", {"out_dim": 0}),
        ("bias='yes'", {"bias": "yes"}),
        ("bias=1", {"bias": 1}),
        ("dropout=1.0", {"dropout": 1.0}),
        ("dropout=-0.1", {"dropout": -0.1}),
        ("dropout='0.1'", {"dropout": "0.1"}),
        ("dropout=nan", {"dropout": math.nan}),
        ("dropout=True", {"dropout": True}),
        ("rotary='yes'", {"rotary": "yes"}),
        ("rotary=1", {"rotary": 1}),
        ("rotary=RotaryEmbedding(6) for head_dim 4", {"rotary": RotaryEmbedding(6)}),
        ("rotary=True with odd head_dim 3", {"embed_dim": 6, "num_heads": 2, "rotary": True}),
        ("backend='nope'", {"backend": "nope"}),
        ("backend=3", {"backend": 3}),
        ("backend=None", {"backend": None}),
        ("dtype=torch.int64", {"dtype": torch.int64}),
        ("dtype=torch.int32", {"dtype": torch.int32}),
        ("dtype=torch.bool", {"dtype": torch.bool}),
        ("dtype='float32'", {"dtype": "float32"}),
        ("dtype=torch.complex64", {"dtype": torch.complex64}),
        ("dtype=torch.complex128", {"dtype": torch.complex128}),
        ("device='nope'", {"device": "nope"}),
        ("device='cuda' (no CUDA here)", {"device": "cuda"} if not torch.cuda.is_available() else {"device": "nope"}),
        ("device=3.5", {"device": 3.5}),
        ("device=object()", {"device": object()}),
        ("embed_dim=2**17, num_heads=1", {"embed_dim": 2**17, "num_heads": 1}),
        ("embed_dim=2**17, num_heads=2**17", {"embed_dim": 2**17, "num_heads": 2**17}),
        ("embed_dim=2**20, num_heads=2**17", {"embed_dim": 2**20, "num_heads": 2**17}),
        ("head_dim=2**40", {"head_dim": HUGE}),
        ("kdim=2**40", {"kdim": HUGE}),
        ("out_dim=2**40", {"out_dim": HUGE}),
        ("num_heads=2**40 with head_dim=1", {"num_heads": HUGE, "head_dim": 1}),
    ]
]


@st.composite
def layer_configs(draw):
    g = draw(st.sampled_from((1, 2)))
    h = g * draw(st.sampled_from((1, 3)))
    d = draw(st.sampled_from((2, 4)))
    e = draw(st.sampled_from([n for n in (3, 5) if n != d]))
    embed = draw(st.sampled_from((5, 7)))
    rotary = draw(st.booleans())
    dtype = draw(st.sampled_from((torch.float32, torch.float64)))
    return {
        "embed_dim": embed,
        "num_heads": h,
        "num_kv_heads": g,
        "head_dim": d,
        "value_head_dim": e,
        "rotary": rotary,
        "dtype": dtype,
    }


@st.composite
def layer_forward_cases(draw) -> Bad:
    config = draw(layer_configs())
    torch.manual_seed(draw(seeds))
    layer = MultiHeadAttention(**config)
    E, dtype, h = config["embed_dim"], config["dtype"], config["num_heads"]
    b = draw(st.sampled_from((1, 2, 3)))
    n = draw(st.sampled_from((2, 3, 4)))
    x = torch.randn(b, n, E, dtype=dtype)
    other = torch.float64 if dtype == torch.float32 else torch.float32
    cases = [
        (f"query {other}", lambda: layer(x.to(other))),
        ("query float16", lambda: layer(x.half())),
        ("query bfloat16", lambda: layer(x.bfloat16())),
        ("query int64", lambda: layer(x.long())),
        ("query complex64", lambda: layer(x.to(torch.complex64))),
        ("query bool", lambda: layer(x > 0)),
        ("query on the meta device", lambda: layer(x.to("meta"))),
        ("query a list", lambda: layer(x.tolist())),
        ("query None", lambda: layer(None)),
        ("query 2-D", lambda: layer(x[0])),
        ("query 4-D", lambda: layer(x[None])),
        (f"query features {E + 1}", lambda: layer(torch.randn(b, n, E + 1, dtype=dtype))),
        ("query batch 0", lambda: layer(x[:0])),
        ("query length 0", lambda: layer(x[:, :0])),
        ("mask 'causal'", lambda: layer(x, mask="causal")),
        ("mask int64 tensor", lambda: layer(x, mask=torch.ones(n, n, dtype=torch.long))),
        (f"mask of key length {n + 1}", lambda: layer(x, mask=torch.ones(b, 1, n, n + 1, dtype=torch.bool))),
        (f"mask of {h + 1} heads", lambda: layer(x, mask=torch.zeros(1, h + 1, n, n))),
        ("mask a list", lambda: layer(x, mask=[[True] * n] * n)),
        (f"padding for batch {b + 1}", lambda: layer(x, mask=masks.padding(torch.ones(b + 1, dtype=torch.long)))),
        (f"padding length {n + 1}", lambda: layer(x, mask=masks.padding(torch.full((b,), n + 1)))),
        (f"alibi with {h + 1} slopes", lambda: layer(x, mask=masks.alibi(masks.alibi_slopes(h + 1)))),
        ("need_weights 'yes'", lambda: layer(x, need_weights="yes")),
        ("average_weights 1", lambda: layer(x, need_weights=True, average_weights=1)),
        ("causal None", lambda: layer(x, causal=None)),
        ("cache a dict", lambda: layer(x, cache={})),
        (f"cache for batch {b + 1}", lambda: layer(x, cache=layer.new_cache(b + 1, 16))),
        (
            f"cache of {other}",
            lambda: layer(
                x,
                cache=KVCache(b, 16, config["num_kv_heads"], config["head_dim"], config["value_head_dim"], dtype=other),
            ),
        ),
        (
            f"cache for {config['num_kv_heads'] + 1} kv heads",
            lambda: layer(
                x,
                cache=KVCache(
                    b, 16, config["num_kv_heads"] + 1, config["head_dim"], config["value_head_dim"], dtype=dtype
                ),
            ),
        ),
        (f"cache of max_len {n - 1} < {n} tokens", lambda: layer(x, cache=layer.new_cache(b, n - 1))),
        ("value without key", lambda: layer(x, value=x)),
    ]
    if config["rotary"]:
        cases += [
            ("key with rotary", lambda: layer(x, x)),
            ("positions float", lambda: layer(x, positions=torch.arange(n).float())),
            (f"positions of shape ({n + 1},)", lambda: layer(x, positions=torch.arange(n + 1))),
            ("positions negative", lambda: layer(x, positions=torch.arange(n) - 5)),
            ("positions a list", lambda: layer(x, positions=list(range(n)))),
        ]  # (positions of 2**40 are valid in the layer: it rotates them without growing a table)
    else:
        cases += [
            ("positions without rotary", lambda: layer(x, positions=torch.arange(n))),
            (f"key batch {b + 1}", lambda: layer(x, torch.randn(b + 1, n, E, dtype=dtype))),
            (f"key features {E + 2}", lambda: layer(x, torch.randn(b, n, E + 2, dtype=dtype))),
            (f"key {other}", lambda: layer(x, x.to(other))),
            ("value length differs from key", lambda: layer(x, x, torch.randn(b, n + 1, E, dtype=dtype))),
        ]
    label, call = draw(st.sampled_from(cases))
    return Bad("MultiHeadAttention.forward", f"{label} [{config}, b={b}, n={n}]", call)


def _kdim_vdim_without_value():
    layer = MultiHeadAttention(8, 2, kdim=3, vdim=5)
    return layer(torch.randn(2, 4, 8), torch.randn(2, 6, 3))


# --------------------------------------------------------------------------- KV cache


KVCACHE_CASES: list[tuple[str, Callable[[], object]]] = [
    (label, (lambda kw=kw: KVCache(**{"batch_size": 2, "max_len": 8, "num_kv_heads": 3, "head_dim": 4, **kw})))
    for label, kw in [
        ("batch_size=0", {"batch_size": 0}),
        ("batch_size=-1", {"batch_size": -1}),
        ("batch_size=2.5", {"batch_size": 2.5}),
        ("batch_size='2'", {"batch_size": "2"}),
        ("batch_size=True", {"batch_size": True}),
        ("batch_size=None", {"batch_size": None}),
        ("max_len=0", {"max_len": 0}),
        ("num_kv_heads=0", {"num_kv_heads": 0}),
        ("head_dim=0", {"head_dim": 0}),
        ("value_head_dim=-2", {"value_head_dim": -2}),
        ("window=0", {"window": 0}),
        ("window=-1", {"window": -1}),
        ("window='3'", {"window": "3"}),
        ("window=2.5", {"window": 2.5}),
        ("dtype=torch.int64", {"dtype": torch.int64}),
        ("dtype='float32'", {"dtype": "float32"}),
        ("dtype=torch.complex64", {"dtype": torch.complex64}),
        ("dtype=torch.bool", {"dtype": torch.bool}),
        ("device='nope'", {"device": "nope"}),
        ("device='cuda' (no CUDA here)", {"device": "cuda"} if not torch.cuda.is_available() else {"device": "nope"}),
        ("device=3.5", {"device": 3.5}),
        ("max_len=2**40", {"max_len": HUGE}),
        ("batch_size=2**40", {"batch_size": HUGE}),
        ("head_dim=2**40", {"head_dim": HUGE}),
        ("max_len=2**33, head_dim=2**10", {"max_len": 2**33, "head_dim": 2**10}),
    ]
]


@st.composite
def append_cases(draw) -> Bad:
    """A valid cache (b > 1, g > 1, d != e), sometimes partly filled, then one bad append."""
    b, g = draw(st.sampled_from((2, 3))), draw(st.sampled_from((2, 3)))
    d, e = draw(st.sampled_from((2, 4))), draw(st.sampled_from((3, 5)))
    window = draw(st.sampled_from((None, 2, 3)))
    dtype = draw(st.sampled_from((torch.float32, torch.float64)))
    cache = KVCache(b, 8, g, d, e, window=window, dtype=dtype)
    filled = draw(st.integers(0, 3))
    if filled:
        cache.append(torch.randn(b, g, filled, d, dtype=dtype), torch.randn(b, g, filled, e, dtype=dtype))
    n = draw(st.sampled_from((1, 2, 3)))
    keys, values = torch.randn(b, g, n, d, dtype=dtype), torch.randn(b, g, n, e, dtype=dtype)
    other = torch.float64 if dtype == torch.float32 else torch.float32
    room = 8 - filled
    cases = [
        ("keys of batch 1", lambda: cache.append(keys[:1], values)),
        ("values of batch 1", lambda: cache.append(keys, values[:1])),
        ("keys and values of batch 1", lambda: cache.append(keys[:1], values[:1])),
        ("keys of one head", lambda: cache.append(keys[:, :1], values)),
        ("values of one head", lambda: cache.append(keys, values[:, :1])),
        ("values of length 1, keys of 3", lambda: cache.append(torch.randn(b, g, 3, d, dtype=dtype), values[:, :, :1])),
        (
            f"values of length {n + 1}, keys of {n}",
            lambda: cache.append(keys, torch.randn(b, g, n + 1, e, dtype=dtype)),
        ),
        ("keys 3-D", lambda: cache.append(keys[0], values)),
        ("values 3-D", lambda: cache.append(keys, values[0])),
        ("keys and values 3-D", lambda: cache.append(keys[0], values[0])),
        ("keys 5-D", lambda: cache.append(keys[None], values)),
        (f"keys {other}", lambda: cache.append(keys.to(other), values)),
        (f"values {other}", lambda: cache.append(keys, values.to(other))),
        ("keys int64", lambda: cache.append(keys.long(), values)),
        ("values complex64", lambda: cache.append(keys, values.to(torch.complex64))),
        ("keys a list", lambda: cache.append(keys.tolist(), values)),
        ("values a list", lambda: cache.append(keys, values.tolist())),
        ("keys None", lambda: cache.append(None, values)),
        ("values None", lambda: cache.append(keys, None)),
        (f"keys head dim {d + 1}", lambda: cache.append(torch.randn(b, g, n, d + 1, dtype=dtype), values)),
        (f"values head dim {e + 1}", lambda: cache.append(keys, torch.randn(b, g, n, e + 1, dtype=dtype))),
        ("keys on the meta device", lambda: cache.append(keys.to("meta"), values)),
        (
            f"{room + 1} tokens with room for {room}",
            lambda: cache.append(
                torch.randn(b, g, room + 1, d, dtype=dtype), torch.randn(b, g, room + 1, e, dtype=dtype)
            ),
        ),
    ]
    label, call = draw(st.sampled_from(cases))
    return Bad(
        "KVCache.append",
        f"{label} [b={b}, g={g}, d={d}, e={e}, window={window}, filled={filled}, n={n}, {dtype}]",
        call,
    )


# --------------------------------------------------------------------------- positional modules


def _rope_call(fn):
    return lambda: fn(RotaryEmbedding(4))


POSITIONAL_CASES: list[tuple[str, Callable[[], object]]] = [
    *[(f"RotaryEmbedding(head_dim={v!r})", (lambda v=v: RotaryEmbedding(v))) for v in (0, 3, -2, "8", 2.5, True, None)],
    *[
        (f"RotaryEmbedding(4, base={v!r})", (lambda v=v: RotaryEmbedding(4, v)))
        for v in (0, -1.0, math.inf, math.nan, "1e4", True)
    ],
    ("rope(q, k, offset=-1)", _rope_call(lambda r: r(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), offset=-1))),
    ("rope(q, k, offset='1')", _rope_call(lambda r: r(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), offset="1"))),
    ("rope(q, k, offset=2.5)", _rope_call(lambda r: r(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), offset=2.5))),
    ("rope(int q, k)", _rope_call(lambda r: r(torch.ones(1, 2, 3, 4, dtype=torch.long), torch.randn(1, 2, 3, 4)))),
    ("rope(2-D q, k)", _rope_call(lambda r: r(torch.randn(3, 4), torch.randn(1, 2, 3, 4)))),
    ("rope(q of last dim 6, k)", _rope_call(lambda r: r(torch.randn(1, 2, 3, 6), torch.randn(1, 2, 3, 4)))),
    ("rope(q, k 5-D)", _rope_call(lambda r: r(torch.randn(1, 2, 3, 4), torch.randn(1, 1, 2, 3, 4)))),
    ("rope(q, None)", _rope_call(lambda r: r(torch.randn(1, 2, 3, 4), None))),
    ("rope(q with i > j)", _rope_call(lambda r: r(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 3, 4)))),
    ("rope.rotate(x, float positions)", _rope_call(lambda r: r.rotate(torch.randn(1, 2, 3, 4), torch.arange(3.0)))),
    (
        "rope.rotate(x, bool positions)",
        _rope_call(lambda r: r.rotate(torch.randn(1, 2, 3, 4), torch.ones(3, dtype=torch.bool))),
    ),
    (
        "rope.rotate(x, negative positions)",
        _rope_call(lambda r: r.rotate(torch.randn(1, 2, 3, 4), torch.arange(3) - 4)),
    ),
    (
        "rope.rotate(x, positions of shape (4,))",
        _rope_call(lambda r: r.rotate(torch.randn(1, 2, 3, 4), torch.arange(4))),
    ),
    (
        "rope.rotate(x, positions (2, 3) for batch 1)",
        _rope_call(lambda r: r.rotate(torch.randn(1, 2, 3, 4), torch.arange(6).view(2, 3))),
    ),
    ("rope.rotate(x, -1)", _rope_call(lambda r: r.rotate(torch.randn(1, 2, 3, 4), -1))),
    ("rope.rotate(x, 2.0)", _rope_call(lambda r: r.rotate(torch.randn(1, 2, 3, 4), 2.0))),
    (
        "rope(q, k, offset=2**53)",
        _rope_call(lambda r: r(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), offset=2**53)),
    ),
    ("SinusoidalPositions(4)(x, offset=2**53)", lambda: SinusoidalPositions(4)(torch.randn(2, 3, 4), offset=2**53)),
    (
        "rope.rotate(x, positions 2**62)",
        _rope_call(lambda r: r.rotate(torch.randn(1, 2, 3, 4), torch.arange(3) + 2**62)),
    ),
    *[
        (f"SinusoidalPositions({args})", (lambda args=args: SinusoidalPositions(*args)))
        for args in ((3,), (0,), ("4",), (4, 0), (4, -1), (4, "8"), (4, None, 0.0), (4, None, math.nan))
    ],
    ("SinusoidalPositions(4)(x of last dim 6)", lambda: SinusoidalPositions(4)(torch.randn(2, 3, 6))),
    ("SinusoidalPositions(4)(int x)", lambda: SinusoidalPositions(4)(torch.ones(2, 3, 4, dtype=torch.long))),
    ("SinusoidalPositions(4)(4-D x)", lambda: SinusoidalPositions(4)(torch.randn(1, 2, 3, 4))),
    ("SinusoidalPositions(4)(x, offset=-1)", lambda: SinusoidalPositions(4)(torch.randn(2, 3, 4), offset=-1)),
    (
        "SinusoidalPositions(4, max_len=4)(x of 3, offset=2)",
        lambda: SinusoidalPositions(4, max_len=4)(torch.randn(2, 3, 4), offset=2),
    ),
    ("SinusoidalPositions(4).table(-1)", lambda: SinusoidalPositions(4).table(-1)),
    ("SinusoidalPositions(4).table(3, dtype=torch.int64)", lambda: SinusoidalPositions(4).table(3, dtype=torch.int64)),
    ("SinusoidalPositions(4).table(2**40)", lambda: SinusoidalPositions(4).table(HUGE)),
    ("SinusoidalPositions(4).table(3, device='nope')", lambda: SinusoidalPositions(4).table(3, device="nope")),
    *[
        (f"LearnedPositions({args}, {kw})", (lambda args=args, kw=kw: LearnedPositions(*args, **kw)))
        for args, kw in (
            ((0, 4), {}),
            (("8", 4), {}),
            ((8, 0), {}),
            ((8, 4.0), {}),
            ((HUGE, 4), {}),
            ((8, HUGE), {}),
            ((8, 4), {"dtype": torch.int64}),
            ((8, 4), {"dtype": "float32"}),
            ((8, 4), {"dtype": torch.complex64}),
            ((8, 4), {"device": "nope"}),
        )
    ],
    ("LearnedPositions(8, 4)(x of last dim 5)", lambda: LearnedPositions(8, 4)(torch.randn(2, 3, 5))),
    ("LearnedPositions(8, 4)(x, offset=6)", lambda: LearnedPositions(8, 4)(torch.randn(2, 3, 4), offset=6)),
    ("LearnedPositions(8, 4)(x of 9 positions)", lambda: LearnedPositions(8, 4)(torch.randn(2, 9, 4))),
    ("LearnedPositions(8, 4)(x, offset=-1)", lambda: LearnedPositions(8, 4)(torch.randn(2, 3, 4), offset=-1)),
]


# --------------------------------------------------------------------------- the tests


ENTRIES: dict[str, st.SearchStrategy[Bad]] = {
    "attention": attention_cases("attention", multihead.attention, huge=True),
    "explain": attention_cases("explain", multihead.explain, huge=False),
    "masks": table_cases("masks", MASK_CASES),
    "alibi_slopes": table_cases("masks.alibi_slopes", SLOPES_CASES),
    "WeightSelection": selection_cases(),
    "MultiHeadAttention": table_cases("MultiHeadAttention", LAYER_INIT_CASES),
    "MultiHeadAttention.forward": layer_forward_cases(),
    "KVCache": table_cases("KVCache", KVCACHE_CASES),
    "KVCache.append": append_cases(),
    "positional": table_cases("positional", POSITIONAL_CASES),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_bad_input_is_refused(entry, tally, request):
    """A drawn bad input to ``entry``: an InputError in the house form, fast, never accepted."""
    test = request.node.name

    @given(case=ENTRIES[entry])
    def case(case):
        outcome, detail = judge(case, tally, test)
        if outcome != "ok":
            findings.add(f"[{outcome}] {detail}")

    findings = Findings()
    case()
    findings.check()


def _layer_forward(dtype_in=None, *, layer_dtype=torch.float32, **call):
    layer = MultiHeadAttention(8, 2, dtype=layer_dtype)
    x = torch.randn(2, 3, 8, dtype=layer_dtype)
    return layer(x if dtype_in is None else x.to(dtype_in), **call)


def _append(keys_fn, values_fn):
    cache = KVCache(3, 8, 2, 4, 5)
    keys, values = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 5)
    return cache.append(keys_fn(keys), values_fn(values))


ISSUE_CASES: list[tuple[str, Callable[[], object]]] = [
    ("forward: float64 input to a float32 layer", lambda: _layer_forward(torch.float64)),
    ("forward: float16 input to a float32 layer", lambda: _layer_forward(torch.float16)),
    ("forward: int64 input", lambda: _layer_forward(torch.int64)),
    ("forward: complex64 input", lambda: _layer_forward(torch.complex64)),
    ("forward: meta input", lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 8, device="meta"))),
    (
        "forward: float64 key to a float32 layer",
        lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 8), torch.randn(2, 4, 8, dtype=torch.float64)),
    ),
    ("forward: batch 0", lambda: MultiHeadAttention(8, 2)(torch.randn(0, 3, 8))),
    ("forward: kdim != vdim with value omitted", _kdim_vdim_without_value),
    ("forward: mask of the wrong shape", lambda: _layer_forward(mask=torch.ones(2, 1, 3, 4, dtype=torch.bool))),
    ("MultiHeadAttention(dtype=torch.int64)", lambda: MultiHeadAttention(8, 2, dtype=torch.int64)),
    ("MultiHeadAttention(device='nope')", lambda: MultiHeadAttention(8, 2, device="nope")),
    ("MultiHeadAttention(dtype='float32')", lambda: MultiHeadAttention(8, 2, dtype="float32")),
    ("MultiHeadAttention(dtype=torch.complex64)", lambda: MultiHeadAttention(8, 2, dtype=torch.complex64)),
    ("MultiHeadAttention(2**17, 1)", lambda: MultiHeadAttention(2**17, 1)),
    ("MultiHeadAttention(2**17, 2**17)", lambda: MultiHeadAttention(2**17, 2**17)),
    ("KVCache(dtype='float32')", lambda: KVCache(2, 8, 2, 4, dtype="float32")),
    ("KVCache(dtype=torch.int64)", lambda: KVCache(2, 8, 2, 4, dtype=torch.int64)),
    ("KVCache(device='nope')", lambda: KVCache(2, 8, 2, 4, device="nope")),
    ("KVCache(max_len=2**40)", lambda: KVCache(2, HUGE, 2, 4)),
    ("KVCache.append: values of batch 1", lambda: _append(lambda k: k, lambda v: v[:1])),
    ("KVCache.append: values of one head", lambda: _append(lambda k: k, lambda v: v[:, :1])),
    ("KVCache.append: values of length 1", lambda: _append(lambda k: k, lambda v: v[:, :, :1])),
    ("KVCache.append: values 3-D", lambda: _append(lambda k: k, lambda v: v[0])),
    ("KVCache.append: values float64", lambda: _append(lambda k: k, lambda v: v.double())),
    ("KVCache.append: values of another length", lambda: _append(lambda k: k, lambda v: torch.cat([v, v], 2))),
    ("KVCache.append: keys a list", lambda: _append(lambda k: k.tolist(), lambda v: v)),
    ("KVCache.append: values None", lambda: _append(lambda k: k, lambda v: None)),
    ("alibi_slopes(2**40)", lambda: masks.alibi_slopes(HUGE)),
    (
        "WeightSelection(queries=slice(0, 2.5))",
        lambda: multihead.attention_result(
            *make_inputs(shapes_fixed(), torch.float32, 0), return_weights=WeightSelection(queries=slice(0, 2.5))
        ),
    ),
    (
        "padding lengths on the meta device",
        lambda: multihead.attention(
            *make_inputs(shapes_fixed(), torch.float32, 0), mask=masks.padding(torch.tensor([1, 2], device="meta"))
        ),
    ),
    (
        "allowed on the meta device",
        lambda: multihead.attention(
            *make_inputs(shapes_fixed(), torch.float32, 0),
            mask=masks.allowed(torch.ones(5, 7, dtype=torch.bool, device="meta")),
        ),
    ),
    (
        "tiled with k expanded to j = 2**40",
        lambda: multihead.attention(
            torch.randn(1, 1, 2, 4),
            torch.randn(1, 1, 1, 4).expand(1, 1, HUGE, 4),
            torch.randn(1, 1, 1, 3).expand(1, 1, HUGE, 3),
            backend="tiled",
        ),
    ),
    ("RotaryEmbedding.rotate at position 2**53", lambda: RotaryEmbedding(4).rotate(torch.randn(1, 1, 2, 4), 2**53)),
    ("LearnedPositions(2**40, 8)", lambda: LearnedPositions(HUGE, 8)),
]


def shapes_fixed() -> Shape:
    return Shape(2, 6, 3, 5, 7, 4, 3)


@pytest.mark.parametrize("label, call", ISSUE_CASES, ids=[label for label, _ in ISSUE_CASES])
def test_issue_listed_bad_input(label, call, tally, request):
    """The bad inputs the issue names, every run: refused with an InputError in the house form, fast."""
    check(Bad("issue", label, call), tally, request.node.name)
