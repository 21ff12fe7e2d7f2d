"""Every user error: the right exception type and a message of the form
"<argument>: expected <...>, got <...>. Fix: <...>".

One table of bad inputs. Sizes are pairwise distinct (b=2, h=6, g=3, i=5, j=7, d=4, e=3)
so that an axis checked against the wrong one cannot pass by accident.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from multihead import WeightSelection, attention, attention_result, explain, masks
from multihead._errors import InputError
from multihead.backends import Capabilities, registry
from support import is_input_error

# sizes by axis: b, h, g, i (Q_LEN: query positions), j, d, e
B, H, G, Q_LEN, J, D, E = 2, 6, 3, 5, 7, 4, 3

_gen = torch.Generator().manual_seed(0)


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen).to(dtype)


Q = _randn(B, H, Q_LEN, D)
K = _randn(B, G, J, D)
V = _randn(B, G, J, E)


def _noop_backend(q, k, v, *, mask, scale, dropout, need_weights, need_lse):
    return registry.BackendOutput(torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype))


# --------------------------------------------------------------------------- how a row is called


def call(*qkv, **kwargs):
    """A row that is a call of attention_result(*qkv, **kwargs); explain() must reject it the same way."""

    def run(fn):
        return fn(*qkv, **kwargs)

    run.explainable = True
    return run


def call_attention_only(*qkv, **kwargs):
    """A call of attention() that fails only when a backend must be run (explain() reports it instead)."""

    def run(fn):
        return fn(*qkv, **kwargs)

    run.explainable = False
    return run


def other(thunk):
    """A row that calls something other than attention (a mask constructor, the registry)."""

    def run(fn):
        return thunk()

    run.explainable = False
    return run


# --------------------------------------------------------------------------- the table

ROWS = [
    # ---- q, k, v: type and rank
    pytest.param(call(Q.tolist(), K, V), TypeError, "q: expected a torch.Tensor, got list", id="q-not-tensor"),
    pytest.param(call(Q, None, V), TypeError, "k: expected a torch.Tensor, got NoneType None", id="k-not-tensor"),
    pytest.param(call(Q, K, 3.0), TypeError, "v: expected a torch.Tensor, got float 3.0", id="v-not-tensor"),
    pytest.param(
        call(Q[0, 0], K, V),
        ValueError,
        "q: expected shape (b, h, i, d), or unbatched (h, i, d), got shape (5, 4)",
        id="q-2d",
    ),
    pytest.param(
        call(Q[None], K, V),
        ValueError,
        "q: expected shape (b, h, i, d), or unbatched (h, i, d), got shape (1, 2, 6, 5, 4)",
        id="q-5d",
    ),
    pytest.param(
        call(Q, K[0], V),
        ValueError,
        "k: expected 4 dims like q, (b, g, j, d), got shape (3, 7, 4)",
        id="k-rank-differs",
    ),
    pytest.param(
        call(Q, K, V[None]),
        ValueError,
        "v: expected 4 dims like q, (b, g, j, e), got shape (1, 2, 3, 7, 3)",
        id="v-rank-differs",
    ),
    # ---- dtypes
    pytest.param(call(Q.long(), K.long(), V.long()), TypeError, "q: expected a floating dtype", id="q-int-dtype"),
    pytest.param(
        call(Q, K.double(), V),
        TypeError,
        "k: expected dtype torch.float32 (the dtype of q), got torch.float64",
        id="k-dtype-differs",
    ),
    pytest.param(
        call(Q, K, V.double()),
        TypeError,
        "v: expected dtype torch.float32 (the dtype of q), got torch.float64",
        id="v-dtype-differs",
    ),
    # ---- sizes
    pytest.param(
        call(Q, _randn(3, G, J, D), V),
        ValueError,
        "k: expected batch size b = 2 (from q), got 3",
        id="k-batch-mismatch",
    ),
    pytest.param(
        call(Q, K, _randn(3, G, J, E)),
        ValueError,
        "v: expected batch size b = 2 (from q), got 3",
        id="v-batch-mismatch",
    ),
    pytest.param(
        call(Q, K, _randn(B, 2, J, E)),
        ValueError,
        "v: expected g = 3 key/value heads (from k), got 2",
        id="g-differs-k-v",
    ),
    pytest.param(
        call(Q, _randn(B, 4, J, D), _randn(B, 4, J, E)),
        ValueError,
        "k: expected a number of key/value heads g that divides the query heads h = 6, got g = 4. "
        "Fix: use g in [1, 2, 3, 6]",
        id="h-not-divisible-by-g",
    ),
    pytest.param(
        call(Q, _randn(B, G, J, 5), V), ValueError, "k: expected head dim d = 4 (from q), got 5", id="d-mismatch"
    ),
    pytest.param(
        call(Q, K, _randn(B, G, 8, E)), ValueError, "v: expected key length j = 7 (from k), got 8", id="j-mismatch-k-v"
    ),
    pytest.param(
        call(Q[:, :, :0], K, V),
        ValueError,
        "q: expected every size at least 1, got shape (2, 6, 0, 4)",
        id="q-empty-dim",
    ),
    pytest.param(
        call(Q, K[:, :, :0], V[:, :, :0]),
        ValueError,
        "k: expected every size at least 1, got shape (2, 3, 0, 4)",
        id="k-empty-dim",
    ),
    # ---- mask: tensors
    pytest.param(
        call(Q, K, V, mask=torch.ones(Q_LEN, 6, dtype=torch.bool)),
        ValueError,
        "mask: expected a shape broadcastable to (b, h, i, j) = (2, 6, 5, 7) (each dim 1 or equal), got (5, 6)",
        id="mask-not-broadcastable",
    ),
    pytest.param(
        call(Q, K, V, mask=torch.ones(3, H, Q_LEN, J, dtype=torch.bool)),
        ValueError,
        "mask: expected a shape broadcastable to (b, h, i, j) = (2, 6, 5, 7)",
        id="mask-batch-mismatch",
    ),
    pytest.param(
        call(Q, K, V, mask=torch.ones(B, J, dtype=torch.bool)),
        ValueError,
        "mask: expected a shape broadcastable to (b, h, i, j) = (2, 6, 5, 7) (each dim 1 or equal), got (2, 7)",
        id="mask-b-j-without-middle-axes",
    ),
    pytest.param(
        call(Q, K, V, mask=torch.ones(Q_LEN, J, dtype=torch.uint8)),
        TypeError,
        "mask: expected a bool tensor (True = may attend) or a floating tensor",
        id="mask-uint8",
    ),
    pytest.param(
        call(Q, K, V, mask=torch.ones(1, B, H, Q_LEN, J, dtype=torch.bool)),
        ValueError,
        "mask: expected at most 4 dims",
        id="mask-5d",
    ),
    pytest.param(
        call(Q, K, V, mask=[[True] * J] * Q_LEN),
        TypeError,
        "mask: expected a multihead.masks mask, a bool tensor or a float tensor, got list",
        id="mask-list",
    ),
    # ---- mask: combining with &
    pytest.param(
        other(lambda: masks.causal() & [True] * J),
        TypeError,
        "mask: expected a multihead.masks mask, a bool tensor or a float tensor, got list",
        id="and-with-list",
    ),
    pytest.param(
        call(Q, K, V, mask=masks.causal() & masks.allowed(torch.ones(Q_LEN, 6, dtype=torch.bool))),
        ValueError,
        "allowed(tensor): expected a shape broadcastable to (b, h, i, j) = (2, 6, 5, 7)",
        id="and-allowed-not-broadcastable",
    ),
    pytest.param(
        call(Q, K, V, mask=masks.window(2) & torch.zeros(B, H, J, Q_LEN)),
        ValueError,
        "mask: expected a shape broadcastable to (b, h, i, j) = (2, 6, 5, 7) (each dim 1 or equal), got (2, 6, 7, 5)",
        id="and-bias-i-j-swapped",
    ),
    # ---- mask: padding
    pytest.param(
        call(Q, K, V, mask=masks.padding(torch.tensor([3, 4, 5]))),
        ValueError,
        "padding(lengths): expected shape (b,) = (2,), got (3,)",
        id="padding-lengths-wrong-batch",
    ),
    pytest.param(
        call(Q, K, V, mask=masks.padding([3, 8])),
        ValueError,
        "padding(lengths): expected lengths in [0, 7] (the key length j), got values from 3 to 8",
        id="padding-length-above-j",
    ),
    pytest.param(
        call(Q, K, V, mask=masks.padding([-1, 7])),
        ValueError,
        "padding(lengths): expected lengths in [0, 7] (the key length j), got values from -1 to 7",
        id="padding-length-negative",
    ),
    pytest.param(
        call(Q, K, V, mask=masks.padding(torch.ones(B, 6, dtype=torch.bool))),
        ValueError,
        "padding(valid): expected shape (b, j) = (2, 7), got (2, 6)",
        id="padding-valid-wrong-shape",
    ),
    pytest.param(
        call(Q, K, V, mask=masks.padding(torch.ones(J, B, dtype=torch.bool))),
        ValueError,
        "padding(valid): expected shape (b, j) = (2, 7), got (7, 2)",
        id="padding-valid-transposed",
    ),
    pytest.param(
        other(lambda: masks.padding(torch.ones(J, dtype=torch.bool))),
        ValueError,
        "padding(keys): expected a (b, j) bool tensor of real keys",
        id="padding-valid-1d",
    ),
    pytest.param(
        other(lambda: masks.padding(torch.tensor([[3, 4]]))),
        ValueError,
        "padding(keys): expected a (b,) integer tensor of key lengths",
        id="padding-lengths-2d",
    ),
    pytest.param(
        other(lambda: masks.padding(torch.tensor([3.0, 4.0]))),
        TypeError,
        "padding(keys): expected integer lengths (b,) or a bool (b, j) tensor",
        id="padding-float",
    ),
    pytest.param(
        other(lambda: masks.padding("ab")),
        TypeError,
        "padding(keys): expected a (b,) tensor of key lengths or a (b, j) bool tensor, got str 'ab'",
        id="padding-str",
    ),
    # ---- mask: window / causal
    pytest.param(
        other(lambda: masks.window(-1)),
        ValueError,
        "window(left=...): expected a non-negative int or None, got -1",
        id="window-negative-left",
    ),
    pytest.param(
        other(lambda: masks.window(2, -3)),
        ValueError,
        "window(right=...): expected a non-negative int or None, got -3",
        id="window-negative-right",
    ),
    pytest.param(
        other(lambda: masks.window(2.5)),
        TypeError,
        "window(left=...): expected a non-negative int or None, got float 2.5",
        id="window-float-left",
    ),
    pytest.param(
        other(lambda: masks.window(True)),
        TypeError,
        "window(left=...): expected a non-negative int or None, got bool True",
        id="window-bool-left",
    ),
    pytest.param(
        other(lambda: masks.causal("bottom-right")),
        ValueError,
        "causal(align=...): expected one of ('bottom_right', 'top_left'), got 'bottom-right'",
        id="causal-bad-align",
    ),
    pytest.param(
        other(lambda: masks.window(2, align="top-left")),
        ValueError,
        "window(align=...): expected one of ('bottom_right', 'top_left'), got 'top-left'",
        id="window-bad-align",
    ),
    # ---- mask: alibi
    pytest.param(
        call(Q, K, V, mask=masks.alibi(masks.alibi_slopes(4))),
        ValueError,
        "alibi(slopes): expected (h,) = (6,) one slope per query head, or (b, h) = (2, 6) one per batch row and "
        "head, got (4,). Fix: use multihead.masks.alibi_slopes(6)",
        id="alibi-wrong-number-of-slopes",
    ),
    pytest.param(
        call(Q, K, V, mask=masks.alibi(torch.ones(1, H))),
        ValueError,
        "alibi(slopes): expected (h,) = (6,) one slope per query head, or (b, h) = (2, 6) one per batch row and "
        "head, got (1, 6). Fix: give one row per batch row (2 of them), or (h,) slopes shared by all",
        id="alibi-slopes-one-row-for-a-batch-of-two",
    ),
    pytest.param(
        call(Q, K, V, mask=masks.alibi(torch.ones(B, 4))),
        ValueError,
        "alibi(slopes): expected (h,) = (6,) one slope per query head, or (b, h) = (2, 6) one per batch row and "
        "head, got (2, 4). Fix: give one column per query head: 6",
        id="alibi-slopes-per-row-wrong-heads",
    ),
    pytest.param(
        other(lambda: masks.alibi(torch.ones(B, H, 1))),
        ValueError,
        "alibi(slopes): expected a float tensor of slopes, (h,) one per query head or (b, h) one per batch row",
        id="alibi-slopes-3d",
    ),
    pytest.param(
        other(lambda: masks.alibi(masks.alibi_slopes(H), align="left")),
        ValueError,
        "alibi(align=...): expected one of ('bottom_right', 'top_left'), got 'left'",
        id="alibi-bad-align",
    ),
    pytest.param(
        other(lambda: masks.alibi(torch.arange(H))),
        TypeError,
        "alibi(slopes): expected a float tensor of slopes",
        id="alibi-int-slopes",
    ),
    pytest.param(other(lambda: masks.alibi("steep")), TypeError, "alibi(slopes): expected", id="alibi-slopes-str"),
    pytest.param(other(lambda: masks.alibi(None)), TypeError, "alibi(slopes): expected", id="alibi-slopes-none"),
    pytest.param(
        other(lambda: masks.alibi_slopes(0)),
        ValueError,
        "num_heads: expected a positive int, got 0",
        id="alibi-slopes-zero",
    ),
    pytest.param(
        other(lambda: masks.alibi_slopes(-6)),
        ValueError,
        "num_heads: expected a positive int, got -6",
        id="alibi-slopes-negative",
    ),
    pytest.param(
        other(lambda: masks.alibi_slopes("6")),
        TypeError,
        "num_heads: expected a positive int, got str '6'",
        id="alibi-slopes-str-count",
    ),
    # ---- mask: bias / allowed
    pytest.param(
        other(lambda: masks.bias(torch.ones(Q_LEN, J, dtype=torch.bool))),
        TypeError,
        "bias(tensor): expected a floating tensor",
        id="bias-given-bool",
    ),
    pytest.param(
        other(lambda: masks.allowed(torch.ones(Q_LEN, J))),
        TypeError,
        "allowed(tensor): expected a bool tensor (True = may attend)",
        id="allowed-given-float",
    ),
    pytest.param(
        other(lambda: masks.bias([[0.0] * J] * Q_LEN)),
        TypeError,
        "bias(tensor): expected a torch.Tensor, got list",
        id="bias-given-list",
    ),
    # ---- scale / dropout / flags
    pytest.param(
        call(Q, K, V, scale="0.5"),
        TypeError,
        "scale: expected a real number or None (1/sqrt(d)), got str",
        id="scale-str",
    ),
    pytest.param(
        call(Q, K, V, scale=True),
        TypeError,
        "scale: expected a real number or None (1/sqrt(d)), got bool",
        id="scale-bool",
    ),
    pytest.param(call(Q, K, V, scale=math.nan), ValueError, "scale: expected a finite number, got nan", id="scale-nan"),
    pytest.param(call(Q, K, V, scale=math.inf), ValueError, "scale: expected a finite number, got inf", id="scale-inf"),
    pytest.param(
        call(Q, K, V, dropout=1.0, training=True),
        ValueError,
        "dropout: expected a probability in [0, 1), got 1.0",
        id="dropout-one",
    ),
    pytest.param(
        call(Q, K, V, dropout=-0.1, training=True),
        ValueError,
        "dropout: expected a probability in [0, 1), got -0.1",
        id="dropout-negative",
    ),
    pytest.param(
        call(Q, K, V, dropout=math.nan, training=True),
        ValueError,
        "dropout: expected a probability in [0, 1), got nan",
        id="dropout-nan",
    ),
    pytest.param(
        call(Q, K, V, dropout="0.1", training=True),
        TypeError,
        "dropout: expected a probability in [0, 1), got str",
        id="dropout-str",
    ),
    pytest.param(
        call(Q, K, V, dropout=0.1, training=1),
        TypeError,
        "training: expected True or False, got int 1",
        id="training-int",
    ),
    pytest.param(
        call(Q, K, V, training="yes"), TypeError, "training: expected True or False, got str 'yes'", id="training-str"
    ),
    pytest.param(call(Q, K, V, causal=1), TypeError, "causal: expected True or False, got int 1", id="causal-int"),
    pytest.param(
        call(Q, K, V, causal="yes"), TypeError, "causal: expected True or False, got str 'yes'", id="causal-str"
    ),
    pytest.param(
        call(Q, K, V, return_lse=1), TypeError, "return_lse: expected True or False, got int 1", id="return-lse-int"
    ),
    pytest.param(
        call(Q, K, V, return_lse="yes"),
        TypeError,
        "return_lse: expected True or False, got str 'yes'",
        id="return-lse-str",
    ),
    # ---- backend
    pytest.param(call(Q, K, V, backend="flash"), ValueError, "'sdpa'", id="backend-unknown-lists-names"),
    pytest.param(
        call(Q, K, V, backend="flash"), ValueError, "backend: expected 'auto' or one of", id="backend-unknown"
    ),
    pytest.param(
        call(Q, K, V, backend=None),
        TypeError,
        "backend: expected a backend name (str), got NoneType None",
        id="backend-not-str",
    ),
    pytest.param(
        call_attention_only(Q, K, V, backend="sdpa", return_lse=True),
        ValueError,
        "sdpa lacks return_lse",
        id="backend-sdpa-lacks-lse",
    ),
    pytest.param(
        call_attention_only(Q, K, V, backend="materialized", dropout=0.1, training=True),
        ValueError,
        "materialized lacks dropout",
        id="backend-materialized-lacks-dropout",
    ),
    # ---- return_weights / WeightSelection
    pytest.param(
        call(Q, K, V, return_weights="all"),
        TypeError,
        "return_weights: expected True, False or a multihead.WeightSelection, got str 'all'",
        id="return-weights-str",
    ),
    pytest.param(
        call(Q, K, V, return_weights=1),
        TypeError,
        "return_weights: expected True, False or a multihead.WeightSelection, got int 1",
        id="return-weights-int",
    ),
    pytest.param(
        call(Q, K, V, return_weights=WeightSelection(heads=[0, H])),
        ValueError,
        "WeightSelection.heads: expected head indices in 0..5 (or -6..-1, from the end), got 6",
        id="selection-head-too-big",
    ),
    pytest.param(
        call(Q, K, V, return_weights=WeightSelection(heads=[-7])),
        ValueError,
        "WeightSelection.heads: expected head indices in 0..5 (or -6..-1, from the end), got -7",
        id="selection-head-negative",
    ),
    pytest.param(
        call(Q, K, V, return_weights=WeightSelection(queries=[Q_LEN])),
        ValueError,
        "WeightSelection.queries: expected query indices in 0..4 (or -5..-1, from the end), got 5",
        id="selection-query-too-big",
    ),
    pytest.param(
        call(Q, K, V, return_weights=WeightSelection(heads=[0.5])),
        TypeError,
        "WeightSelection.heads: expected head indices (int), got float 0.5",
        id="selection-heads-float",
    ),
    pytest.param(
        call(Q, K, V, return_weights=WeightSelection(heads={3, 1})),
        TypeError,
        "WeightSelection.heads: expected an ordered list of head indices (the result comes in their order), got a "
        "set, whose order is its hashing's. Fix: pass a list",
        id="selection-heads-set",
    ),
    pytest.param(
        call(Q, K, V, return_weights=WeightSelection(queries=frozenset({4, 0}))),
        TypeError,
        "WeightSelection.queries: expected an ordered list of query indices",
        id="selection-queries-frozenset",
    ),
    pytest.param(
        call(Q, K, V, return_weights=WeightSelection(heads=3)),
        TypeError,
        "WeightSelection.heads: expected a sequence of ints",
        id="selection-heads-bare-int",
    ),
    pytest.param(
        call(Q, K, V, return_weights=WeightSelection(heads=[])),
        ValueError,
        "WeightSelection.heads: expected at least one head index",
        id="selection-heads-empty",
    ),
    pytest.param(
        call(Q, K, V, return_weights=WeightSelection(queries=slice(0, 3, 0))),
        ValueError,
        "WeightSelection.queries: expected",
        id="selection-queries-zero-step-slice",
    ),
    pytest.param(
        call(Q, K, V, return_weights=WeightSelection(queries=slice(None, None, -1))),
        ValueError,
        "WeightSelection.queries: expected",
        id="selection-queries-negative-step-slice",
    ),
    # ---- registry
    pytest.param(
        other(lambda: registry.register("auto", _noop_backend, Capabilities())),
        ValueError,
        "name: expected a non-empty string other than 'auto', got 'auto'",
        id="register-auto",
    ),
    pytest.param(
        other(lambda: registry.register("", _noop_backend, Capabilities())),
        ValueError,
        "name: expected a non-empty string other than 'auto', got ''",
        id="register-empty-name",
    ),
    pytest.param(
        other(lambda: registry.register(3, _noop_backend, Capabilities())),
        TypeError,
        "name: expected a string, got 3",
        id="register-name-not-str",
    ),
    pytest.param(
        other(lambda: registry.register("sdpa", _noop_backend, Capabilities())),
        ValueError,
        "name: expected a name not yet registered, got 'sdpa'. Fix: pass replace=True",
        id="register-duplicate",
    ),
    pytest.param(
        other(lambda: registry.register("mine", _noop_backend, {"lse": True})),
        TypeError,
        "capabilities: expected a multihead.backends.Capabilities, got dict",
        id="register-bad-capabilities",
    ),
    pytest.param(
        other(lambda: registry.register("mine", None, Capabilities())),
        TypeError,
        "fn: expected",
        id="register-fn-not-callable",
    ),
]

MESSAGE_FORM = re.compile(r"^[^\s:]+: expected .+, got .*\. Fix: \S.*$", re.DOTALL)


def _raised(run, fn) -> BaseException:
    try:
        run(fn)
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        return exc
    pytest.fail("no error was raised")


def _check(exc: BaseException, kind: type[Exception], fragment: str) -> None:
    message = str(exc)
    assert is_input_error(exc, kind), f"raised {type(exc).__name__} instead of {kind.__name__}: {message}"
    assert fragment in message, f"{fragment!r} not in message {message!r}"
    for word in ("expected", "got", "Fix:"):
        assert word in message, f"{word!r} not in message {message!r}"
    assert MESSAGE_FORM.match(message), f"message not of the form '<arg>: expected ..., got .... Fix: ...': {message!r}"


@pytest.fixture(autouse=True)
def _isolated_registry(monkeypatch):
    """A row that wrongly succeeds in registering must not leak a backend into other tests."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


@pytest.mark.parametrize(("run", "kind", "fragment"), ROWS)
def test_bad_input_raises_a_helpful_error(run, kind, fragment):
    # attention_result takes every argument attention takes, and return_weights / return_lse
    _check(_raised(run, attention_result), kind, fragment)


def test_table_ids_are_unique():
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids))


EXPLAINABLE = [row for row in ROWS if row.values[0].explainable]


@pytest.mark.parametrize(("run", "kind", "fragment"), EXPLAINABLE)
def test_explain_rejects_bad_input_like_attention(run, kind, fragment):
    from_attention = _raised(run, attention_result)
    from_explain = _raised(run, explain)
    _check(from_explain, kind, fragment)
    assert type(from_explain) is type(from_attention)
    assert str(from_explain) == str(from_attention)


def test_explain_spot_checks_are_present():
    ids = {row.id for row in EXPLAINABLE}
    assert {
        "k-batch-mismatch",
        "mask-not-broadcastable",
        "scale-nan",
        "backend-unknown",
        "selection-head-too-big",
        "padding-lengths-wrong-batch",
    } <= ids


def test_explain_reports_what_a_backend_lacks_instead_of_raising():
    why = explain(Q, K, V, backend="sdpa", return_lse=True)
    assert why.chosen is None
    assert any("return_lse" in reason for reason in why.rejected["sdpa"])
    why = explain(Q, K, V, backend="materialized", dropout=0.1, training=True)
    assert why.chosen is None
    assert any("dropout" in reason for reason in why.rejected["materialized"])


# --------------------------------------------------------------------------- valid counterparts

GOOD = [
    pytest.param({}, id="plain"),
    pytest.param({"mask": torch.ones(Q_LEN, J, dtype=torch.bool)}, id="mask-i-j"),
    pytest.param({"mask": torch.zeros(B, 1, 1, J)}, id="mask-b-1-1-j-bias"),
    pytest.param({"mask": masks.causal() & masks.allowed(torch.ones(Q_LEN, J, dtype=torch.bool))}, id="and-allowed"),
    pytest.param({"mask": masks.padding(torch.tensor([3, 7]))}, id="padding-lengths"),
    pytest.param({"mask": masks.padding([0, 7])}, id="padding-lengths-zero-and-j"),
    pytest.param({"mask": masks.padding(torch.ones(B, J, dtype=torch.bool))}, id="padding-valid"),
    pytest.param({"mask": masks.window(2, 1)}, id="window"),
    pytest.param({"mask": masks.causal("top_left")}, id="causal-top-left"),
    pytest.param({"mask": masks.alibi(masks.alibi_slopes(H))}, id="alibi"),
    pytest.param({"scale": 0.5}, id="scale"),
    pytest.param({"dropout": 0.1, "training": True}, id="dropout"),
    pytest.param({"dropout": 0.1, "training": True, "backend": "tiled"}, id="dropout-tiled"),
    pytest.param({"causal": True, "backend": "sdpa"}, id="backend-sdpa"),
    pytest.param({"backend": "tiled", "return_lse": True}, id="backend-tiled-lse"),
    pytest.param({"backend": "materialized", "return_weights": True}, id="backend-materialized-weights"),
    pytest.param({"return_weights": WeightSelection(heads=[0, H - 1], queries=[Q_LEN - 1])}, id="selection-edges"),
    pytest.param({"return_weights": WeightSelection(queries=slice(1, 4))}, id="selection-slice"),
]


@pytest.mark.parametrize("kwargs", GOOD)
def test_valid_counterparts_run(kwargs):
    output = attention_result(Q, K, V, **kwargs).output
    assert output.shape == (B, H, Q_LEN, E)
    assert torch.isfinite(output).all()
    assert explain(Q, K, V, **kwargs).chosen is not None


def test_valid_counterparts_of_size_rows_run():
    for k, v in (
        (_randn(B, 2, J, D), _randn(B, 2, J, E)),  # g = 2 divides h = 6
        (_randn(B, 1, J, D), _randn(B, 1, J, E)),  # multi-query
        (_randn(B, H, J, D), _randn(B, H, J, 8)),
    ):  # e free, g = h
        output = attention(Q, k, v)
        assert output.shape == (B, H, Q_LEN, v.shape[-1])
        assert torch.isfinite(output).all()
    unbatched = attention(Q[0], K[0], V[0])
    assert unbatched.shape == (H, Q_LEN, E)
    assert torch.isfinite(unbatched).all()
    assert attention(Q.double(), K.double(), V.double()).dtype == torch.float64


def test_valid_counterparts_of_constructor_and_registry_rows():
    assert masks.alibi_slopes(H).shape == (H,)
    masks.window(0)
    masks.window(None, None)
    masks.bias(torch.zeros(Q_LEN, J))
    masks.allowed(torch.ones(Q_LEN, J, dtype=torch.bool))
    registry.register("mine", _noop_backend, Capabilities())
    registry.register("sdpa", _noop_backend, Capabilities(), replace=True)
    assert attention(Q, K, V, backend="mine").shape == (B, H, Q_LEN, E)


def test_another_librarys_message_is_kept_in_whole_sentences():
    from multihead._errors import whole_sentences

    text = "First sentence here.\n\nSecond one,\nbroken across lines. Third sentence that is rather long."
    assert whole_sentences(text, limit=60) == "First sentence here. Second one, broken across lines."
    assert whole_sentences(text, limit=10) == "First ..."  # a first sentence past the limit: cut at a word
    assert whole_sentences("no full stop at all") == "no full stop at all"


def _mismatched_input_errors() -> dict[str, Exception]:
    """The error each entry point raises for an input of the wrong dtype (float64 where float32 is due)."""
    from multihead import KVCache, MultiHeadAttention, compat

    x = torch.randn(2, 5, 12)
    layer, module = MultiHeadAttention(12, 3), compat.MultiheadAttention(12, 3, batch_first=True)
    cache = KVCache(2, 8, 3, 4, 4, dtype=torch.float32)
    calls = {
        "attention": lambda: attention(Q, K.double(), V),
        "layer": lambda: layer(x, x.double()),
        "compat": lambda: module(x, x.double(), x),
        "cache": lambda: cache.append(torch.randn(2, 3, 1, 4, dtype=torch.float64), torch.randn(2, 3, 1, 4)),
    }
    errors = {}
    for name, bad_call in calls.items():
        with pytest.raises(TypeError) as raised:
            bad_call()
        errors[name] = raised.value
    return errors


def test_every_entry_point_says_a_dtype_mismatch_in_the_same_words():
    # one validator (multihead._inputs.matching) serves attention, the layer, the torch drop-in and the cache
    errors = _mismatched_input_errors()
    pattern = re.compile(r"^\w+: expected dtype torch\.float32 \(the dtype of [^)]+\), got torch\.float64\. Fix: ")
    for name, error in errors.items():
        assert isinstance(error, InputError), name  # compat's is DtypeError, a TypeError subclass like torch's
        assert pattern.match(str(error)), (name, str(error))
    assert {error.argument for error in errors.values()} == {"k", "key", "keys"}
