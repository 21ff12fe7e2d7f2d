"""Fuzz ``multihead.attention`` on valid calls against the float64 oracle.

For every drawn call (shape with GQA, d != e, i != j or equal, unbatched; every dtype; typed masks,
plain tensors and ``&`` combinations; a scale; weights all/selected/none; LSE; gradients) and every
backend ("auto" and each registered name) the suite pins:

- a named backend either serves the call, as ``explain`` says, or raises an InputError in the
  "<arg>: expected ..., got .... Fix: ..." form naming what it lacks; "auto" always serves;
- output, weights (all or a selection), LSE and gradients pass the tolerance rule of DESIGN.md,
  ``|fast - ref64| <= 2 |ref_lowp - ref64| + tiny``, ref64 = reference backend on float64 copies,
  ref_lowp = the reference backend in the call's dtype or, where it is further from ref64, the textbook in
  the call's dtype without upcast (FlashAttention's baseline, tests/support.py's textbook_lowp: the reference
  now upcasts half types, so on its own it no longer measures what low precision costs);
- rows whose keys are all masked give exactly 0 output, 0 weights, 0 gradient and LSE -inf;
- asking for weights or the LSE (and passing dropout with training=False) never changes the output;
- no NaN anywhere.

The oracle itself is checked against a textbook float64 computation made here from the masks'
definitions (strategies.MaskSpec.dense), and, in low precision, against a bound of its own: it must be
the most robust path (extreme-but-valid magnitudes: float16 scores near 65504, q and k ~ 1e20 on rows
that are fully masked).
"""

from __future__ import annotations

import math
import re

import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import (
    DTYPES,
    Findings,
    MaskSpec,
    Shape,
    Term,
    backends_or_auto,
    dtypes,
    make_inputs,
    mask_specs,
    seeds,
    select_weights,
    selections,
    shapes,
)

import multihead
from multihead._errors import InputError
from support import TINY, assert_within_rule, tiny_blocks  # tests/support.py

MESSAGE_FORM = re.compile(r"^\S.*: expected .+, got .+\. Fix: .+", re.DOTALL)
SEVERITY = ("ok", "poor_message", "wrong", "nan", "crash")  # the worst problem of a case is its outcome


# --------------------------------------------------------------------------- helpers


def batched(t: torch.Tensor, shape: Shape) -> torch.Tensor:
    return t.unsqueeze(0) if shape.unbatched else t


def unbatched(t: torch.Tensor, shape: Shape) -> torch.Tensor:
    return t.squeeze(0) if shape.unbatched else t


def textbook(q, k, v, spec: MaskSpec, shape: Shape, scale: float | None):
    """softmax(q k^T * scale + bias, masked) v in float64, written out here; dead rows 0, LSE -inf."""
    q, k, v = (batched(t.detach(), shape).double() for t in (q, k, v))
    r = shape.h // shape.g
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)  # (b, h, j, d), (b, h, j, e)
    scale = 1.0 / math.sqrt(shape.d) if scale is None else scale
    keep, bias = spec.dense(shape)
    scores = (q @ k.transpose(-2, -1)) * scale + bias
    scores = scores.masked_fill(~keep, -math.inf)
    dead = spec.dead_rows(shape)[..., None]  # (b, h, i, 1)
    row_max = scores.amax(-1, keepdim=True).masked_fill(dead, 0.0)
    p = torch.exp(scores - row_max)
    total = p.sum(-1, keepdim=True)
    weights = p / total.masked_fill(dead, 1.0)
    lse = (torch.log(total.masked_fill(dead, 1.0)) + row_max).masked_fill(dead, -math.inf).squeeze(-1)
    return tuple(unbatched(t, shape) for t in (weights @ v, weights, lse))


def unpack(result, return_weights, return_lse):
    """(output, weights, lse) from attention_result's result; raises AssertionError on a wrong result type."""
    assert isinstance(result, multihead.AttentionResult), f"expected AttentionResult, got {type(result).__name__}"
    out, weights, lse = result
    assert (weights is None) == (return_weights is False), "weights returned iff asked for"
    assert (lse is None) == (not return_lse), "lse returned iff asked for"
    return out, weights, lse


class Call:
    """One drawn call: inputs (kept in their dtype), mask spec and options; runs any backend on copies."""

    def __init__(
        self,
        shape,
        dtype,
        spec,
        q,
        k,
        v,
        *,
        scale=None,
        return_weights=False,
        return_lse=False,
        grad=False,
        dropout=0.0,
        seed=0,
    ):
        self.shape, self.dtype, self.spec = shape, dtype, spec
        self.q, self.k, self.v = q, k, v
        self.scale, self.return_weights, self.return_lse = scale, return_weights, return_lse
        self.grad, self.dropout, self.seed = grad, dropout, seed
        self.selection = return_weights if isinstance(return_weights, multihead.WeightSelection) else None
        self.dead = unbatched(spec.dead_rows(shape), shape)  # (..., h, i)
        self.text_out, self.text_w, self.text_lse = textbook(q, k, v, spec, shape, scale)
        # cotangents representable in the call's dtype (as FlashAttention's tests draw g in it): every run, float64
        # included, backpropagates the same values, so gradient errors measure the backends, not g's rounding
        gen = torch.Generator().manual_seed(seed + 1)
        self.cot_out, self.cot_w, self.cot_lse = (
            torch.randn(size, generator=gen, dtype=torch.float64).to(dtype).double()
            for size in (self.text_out.shape, select_weights(self.text_w, self.selection).shape, self.text_lse.shape)
        )

    def describe(self) -> str:
        return (
            f"shape={self.shape} dtype={self.dtype} seed={self.seed} mask={self.spec} scale={self.scale} "
            f"return_weights={self.return_weights} return_lse={self.return_lse} grad={self.grad} "
            f"dropout={self.dropout}"
        )

    def inputs(self, dtype=None):
        dtype = self.dtype if dtype is None else dtype
        return [t.detach().to(dtype).clone().requires_grad_(self.grad) for t in (self.q, self.k, self.v)]

    def kwargs(self, backend, *, plain=False):
        return {
            "mask": self.spec.build(),
            "causal": self.spec.causal,
            "scale": self.scale,
            "dropout": 0.0 if plain else self.dropout,
            "training": False,
            "backend": backend,
            "return_weights": False if plain else self.return_weights,
            "return_lse": False if plain else self.return_lse,
        }

    def loss(self, out, weights, lse):
        total = (out.double() * self.cot_out).sum()
        if weights is not None:
            total = total + (weights.double() * self.cot_w).sum()
        if lse is not None:
            total = total + (torch.where(self.dead, 0.0, lse.double()) * self.cot_lse).sum()
        return total

    def textbook_lowp(self):
        """The rule's low-precision baseline (FlashAttention's ``attention_ref(upcast=False)``, as tests/conftest's
        ``textbook_lowp``): the textbook in the call's dtype throughout, no upcast; (output, weights, lse, grads)."""
        leaves = [t.detach().to(self.dtype).clone().requires_grad_(self.grad) for t in (self.q, self.k, self.v)]
        q, k, v = (batched(t, self.shape) for t in leaves)
        r = self.shape.h // self.shape.g
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)  # (b, h, j, d), (b, h, j, e)
        scale = 1.0 / math.sqrt(self.shape.d) if self.scale is None else self.scale
        keep, bias = self.spec.dense(self.shape)
        scores = (q @ k.transpose(-2, -1) * scale + bias.to(self.dtype)).masked_fill(~keep, -math.inf)
        row_max = scores.amax(-1, keepdim=True).detach()
        row_max = row_max.masked_fill(row_max == -math.inf, 0.0)
        p = torch.exp(scores - row_max)
        total = p.sum(-1, keepdim=True)
        alive = total > 0
        weights = p / torch.where(alive, total, torch.ones_like(total))
        lse = torch.where(
            alive,
            torch.log(torch.where(alive, total, torch.ones_like(total))) + row_max,
            torch.full_like(total, -math.inf),
        ).squeeze(-1)
        out = unbatched(weights @ v, self.shape)
        weights = (
            select_weights(unbatched(weights, self.shape), self.selection) if self.return_weights is not False else None
        )
        lse = unbatched(lse, self.shape) if self.return_lse else None
        grads = None
        if self.grad:
            grads = torch.autograd.grad(self.loss(out, weights, lse), leaves, allow_unused=True)
            grads = tuple(torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads, strict=True))
        return out.detach(), None if weights is None else weights.detach(), None if lse is None else lse.detach(), grads

    def run(self, backend, dtype=None):
        """(output, weights, lse, grads or None), computed by ``backend`` in ``dtype``."""
        qkv = self.inputs(dtype)
        with tiny_blocks():
            result = multihead.attention_result(*qkv, **self.kwargs(backend))
        out, weights, lse = unpack(result, self.return_weights, self.return_lse)
        grads = None
        if self.grad:
            grads = torch.autograd.grad(self.loss(out, weights, lse), qkv, allow_unused=True)
            grads = tuple(torch.zeros_like(t) if g is None else g for t, g in zip(qkv, grads, strict=True))
        return out.detach(), None if weights is None else weights.detach(), None if lse is None else lse.detach(), grads


def nan_in(*tensors) -> bool:
    return any(t is not None and t.isnan().any().item() for t in tensors)


def within_rule(what, fast, ref64, baselines, problems, *, where=None):
    """The DESIGN.md rule ``|fast - ref64| <= 2 |ref_lowp - ref64| + tiny`` with ref_lowp the low-precision baseline
    of ``baselines`` that is further from ref64 (see run_all_backends); entries where a baseline is not finite count
    as no error of it. ``where`` (bool, broadcastable) restricts the rule to some entries (the rest set to 0).

    ``tiny`` is the project's TINY for the dtype; for float16/bfloat16 at least one unit of rounding of the largest
    entry (eps * max|ref64|): these tensors have a handful of entries, so the max error of a baseline can be far
    below a rounding (it was, for the reference itself), while a result that adds separately rounded terms (a
    gradient through both the output and the weights) is off by about one.
    """
    dtype = fast.dtype
    fast, ref64 = fast.double(), ref64.double()
    if where is not None:
        fast, ref64 = torch.where(where, fast, 0.0), torch.where(where, ref64, 0.0)
    tiny = TINY[dtype]
    if dtype in (torch.float16, torch.bfloat16) and ref64.numel():
        tiny = max(tiny, torch.finfo(dtype).eps * ref64.abs().max().item())
    candidates = []
    for baseline in baselines:
        baseline = baseline.double()
        if where is not None:
            baseline = torch.where(where, baseline, 0.0)
        candidates.append(torch.where(torch.isfinite(baseline), baseline, ref64))
    ref_lowp = max(candidates, key=lambda b: (b - ref64).abs().max().item() if b.numel() else 0.0)
    try:
        assert_within_rule(fast, ref64, ref_lowp, what=what, tiny=tiny)
    except AssertionError as error:
        problems.append(("wrong", str(error)))


def check_backend(call: Call, backend: str, ref64, baselines) -> list[tuple[str, str]]:
    """Every contract of one backend on one call; returns [(outcome, detail)] of the problems found."""
    problems: list[tuple[str, str]] = []
    try:
        explanation = multihead.explain(*call.inputs(), **call.kwargs(backend))
    except Exception as error:  # noqa: BLE001
        return [("crash", f"explain raised {type(error).__name__}: {error}")]
    serves = explanation.chosen is not None
    if backend == "auto" and not serves:
        return [("crash", f"auto refuses a valid call: {explanation}")]
    try:
        out, weights, lse, grads = call.run(backend)
    except InputError as error:
        if serves:
            return [("crash", f"explain chose {explanation.chosen!r} but attention raised {error}")]
        message = str(error)
        reasons = explanation.rejected.get(backend, [])
        if not MESSAGE_FORM.match(message):
            return [("poor_message", message)]
        if backend not in message or not any(reason in message for reason in reasons):
            return [("poor_message", f"the refusal does not say what {backend!r} lacks ({reasons}): {message}")]
        return []
    except AssertionError as error:
        return [("wrong", f"result: {error}")]
    except Exception as error:  # noqa: BLE001
        return [("crash", f"{type(error).__name__}: {error}")]
    if not serves:
        problems.append(("wrong", f"explain says {backend!r} cannot serve ({explanation}) but it ran"))

    r64_out, r64_w, r64_lse, r64_grads = ref64
    lo_out, lo_w, lo_lse = ([b[n] for b in baselines] for n in range(3))
    lo_grads = None if r64_grads is None else [[b[3][n] for b in baselines] for n in range(3)]
    if tuple(out.shape) != tuple(r64_out.shape) or out.dtype != call.dtype:
        return [
            (
                "wrong",
                (f"output shape/dtype {tuple(out.shape)} {out.dtype}, expected {tuple(r64_out.shape)} {call.dtype}"),
            )
        ]
    if nan_in(out, weights, lse, *(grads or ())):
        problems.append(
            (
                "nan",
                "NaN in "
                + ", ".join(name for name, t in (("output", out), ("weights", weights), ("lse", lse)) if nan_in(t))
                + (" or gradients" if nan_in(*(grads or ())) else ""),
            )
        )
    # fully masked rows: exactly 0 output, weights and gradient, LSE -inf
    dead = call.dead
    if dead.any():
        if not (out[dead] == 0).all():
            problems.append(("wrong", f"fully masked rows: output {out[dead].flatten()[:4].tolist()}, expected 0"))
        if weights is not None:
            dead_sel = select_weights(dead[..., None], call.selection)[..., 0]
            if weights.shape[:-1] == dead_sel.shape and not (weights[dead_sel] == 0).all():
                problems.append(("wrong", "fully masked rows: weights not exactly 0"))
        if lse is not None and not (lse[dead] == -math.inf).all():
            problems.append(("wrong", f"fully masked rows: lse {lse[dead].flatten()[:4].tolist()}, expected -inf"))
        if grads is not None and not (grads[0][dead] == 0).all():
            problems.append(("wrong", "fully masked rows: gradient of q not exactly 0"))
    live = ~dead
    within_rule("output", out, r64_out, lo_out, problems, where=live[..., None])
    if weights is not None:
        if weights.shape != r64_w.shape:
            problems.append(("wrong", f"weights shape {tuple(weights.shape)}, expected {tuple(r64_w.shape)}"))
        else:
            within_rule("weights", weights, r64_w, lo_w, problems)
    if lse is not None:
        within_rule("lse", lse, r64_lse, lo_lse, problems, where=live)
    if grads is not None:
        for name, g, g64, glo in zip(("dq", "dk", "dv"), grads, r64_grads, lo_grads, strict=True):
            within_rule(f"gradient {name}", g, g64, glo, problems)
    # asking for weights / the LSE, or passing dropout with training=False, never changes the output
    if call.return_weights is not False or call.return_lse or call.dropout:
        try:
            with tiny_blocks():
                plain = multihead.attention_result(*call.inputs(), **call.kwargs(backend, plain=True)).output.detach()
        except Exception as error:  # noqa: BLE001
            problems.append(("crash", f"the plain call raised {type(error).__name__}: {error}"))
        else:
            if backend != "auto":
                if not torch.equal(plain, out) and not (plain.isnan().any() or out.isnan().any()):
                    diff = (plain.double() - out.double()).abs().max().item()
                    problems.append(("wrong", f"return_weights/return_lse/dropout changed the output by {diff:.3g}"))
            else:
                within_rule("output without weights", plain, r64_out, lo_out, problems, where=live[..., None])
    return problems


def oracle_problems(call: Call, ref64) -> list[tuple[str, str]]:
    """The float64 oracle against the textbook computation made here (mask semantics included)."""
    out, weights, lse, _ = ref64
    problems = []
    if nan_in(out, weights, lse):
        return [("nan", "the float64 reference returns NaN")]
    scale_v = max(1.0, call.text_out.abs().max().item())
    error = (out - call.text_out).abs().max().item()
    if error > 1e-5 * scale_v:
        problems.append(("wrong", f"float64 reference off the textbook by {error:.3g}"))
    if weights is not None:
        expected = select_weights(call.text_w, call.selection)
        if weights.shape != expected.shape:
            problems.append(("wrong", f"weights shape {tuple(weights.shape)}, expected {tuple(expected.shape)}"))
        elif (weights - expected).abs().max().item() > 1e-5:
            problems.append(("wrong", "float64 reference weights off the textbook"))
    if lse is not None:
        live = ~call.dead
        if (
            not torch.equal(lse == -math.inf, ~live)
            or ((lse[live] - call.text_lse[live]).abs().max().item() if live.any() else 0.0) > 1e-5 * scale_v
        ):
            problems.append(("wrong", "float64 reference LSE off the textbook"))
    return problems


def run_all_backends(call: Call, tally, test: str) -> list[str]:
    """Record one case per backend (and one for the oracle); returns the failure lines.

    The rule's low-precision baseline ref_lowp is, tensor by tensor, whichever is further from ref64 of the
    reference backend run in the call's dtype (the brief's and DESIGN.md's ref_lowp) and the textbook computed in
    the call's dtype without upcast (FlashAttention's ``upcast=False`` baseline, the project's tests/support.py
    ``textbook_lowp``, since the reference upcasts half types). A backend fails only when it is off by more than
    twice both; entries where a baseline overflows count as no error of it.
    """
    failures = []
    try:
        ref64 = call.run("reference", torch.float64)
        reference_lowp = call.run("reference")
    except Exception as error:  # noqa: BLE001
        detail = f"reference raised {type(error).__name__}: {error} | {call.describe()}"
        tally.record(test, "crash", detail)
        return [detail]
    baselines = (reference_lowp, call.textbook_lowp())
    for backend in ["oracle", *backends_or_auto()]:
        problems = (
            oracle_problems(call, ref64) if backend == "oracle" else check_backend(call, backend, ref64, baselines)
        )
        outcome = max((p[0] for p in problems), key=SEVERITY.index, default="ok")
        detail = f"{backend}: " + "; ".join(f"[{o}] {d}" for o, d in problems) + f" | {call.describe()}"
        tally.record(test, outcome, detail if problems else "")
        if problems:
            failures.append(detail)
    return failures


# --------------------------------------------------------------------------- valid calls


def test_attention_matches_oracle(tally, request):
    """Every backend on random valid calls: serve-or-refuse, the rule, dead rows, weights never change the output."""

    @given(data=st.data())
    def case(data):
        shape = data.draw(shapes(), label="shape")
        dtype = data.draw(dtypes, label="dtype")
        spec = data.draw(mask_specs(shape), label="mask")
        seed = data.draw(seeds, label="seed")
        call = Call(
            shape,
            dtype,
            spec,
            *make_inputs(shape, dtype, seed),
            seed=seed,
            scale=data.draw(st.sampled_from((None, 0.3, 1.7, -0.8)), label="scale"),
            return_weights=data.draw(st.one_of(st.booleans(), selections(shape.h, shape.i)), label="weights"),
            return_lse=data.draw(st.booleans(), label="return_lse"),
            grad=data.draw(st.booleans(), label="grad"),
            dropout=data.draw(st.sampled_from((0.0, 0.0, 0.4)), label="dropout (training=False)"),
        )
        findings.add(*run_all_backends(call, tally, request.node.name))

    findings = Findings()
    case()
    findings.check()


def test_weight_selection_matches_oracle(tally, request):
    """Every call asks for a WeightSelection (heads as a list, queries as a list or a slice with a step): the
    selected weights are the oracle's rows and heads, on every backend, and the output is unchanged."""

    @given(data=st.data())
    def case(data):
        shape = data.draw(shapes(), label="shape")
        dtype = data.draw(st.sampled_from((torch.float32, torch.float64)), label="dtype")
        spec = data.draw(mask_specs(shape, max_terms=2), label="mask")
        seed = data.draw(seeds, label="seed")
        selection = data.draw(selections(shape.h, shape.i), label="selection")
        call = Call(
            shape,
            dtype,
            spec,
            *make_inputs(shape, dtype, seed),
            seed=seed,
            return_weights=selection,
            grad=data.draw(st.booleans(), label="grad"),
        )
        findings.add(*run_all_backends(call, tally, request.node.name))

    findings = Findings()
    case()
    findings.check()


def test_stepped_query_selection_under_masks(tally, request):
    """WeightSelection(queries=slice with a step) under every kind of mask, on every backend: the oracle's rows."""
    q, k, v = make_inputs(Shape(2, 4, 2, 5, 7, 3, 4), torch.float32, 3)
    findings = Findings()
    for mask in (
        None,
        multihead.masks.causal(),
        multihead.masks.window(1, 1),
        multihead.masks.padding([3, 7]),
        multihead.masks.causal("top_left") & multihead.masks.alibi(multihead.masks.alibi_slopes(4)),
    ):
        for queries in (slice(None, None, 2), slice(1, None, 3), slice(0, 5, 4)):
            selection = multihead.WeightSelection(heads=[3, 0], queries=queries)
            expected = multihead.attention_result(
                q.double(), k.double(), v.double(), mask=mask, backend="reference", return_weights=True
            ).weights[:, [3, 0]][:, :, queries]
            for backend in backends_or_auto():
                where = f"{backend} mask={mask!r} queries={queries}"
                try:
                    weights = multihead.attention_result(
                        q, k, v, mask=mask, backend=backend, return_weights=selection
                    ).weights
                except Exception as error:  # noqa: BLE001 - a valid call: any error is a defect
                    tally.record(request.node.name, "crash", f"{where}: {type(error).__name__}: {error}")
                    findings.add(f"[crash] {where}: {type(error).__name__}: {error}")
                    continue
                error = (weights.double() - expected).abs().max().item() if weights.shape == expected.shape else None
                ok = error is not None and error < 1e-5
                tally.record(request.node.name, "ok" if ok else "wrong", "" if ok else where)
                if not ok:
                    findings.add(f"[wrong] {where}: weights {tuple(weights.shape)} off the oracle's by {error}")
    findings.check()


def test_bfloat16_gradient_through_peaked_weights(tally, request):
    """Found by the long fuzz run: bfloat16, one query over 3 keys with a peaked softmax (0.998), gradients through
    the returned weights: every backend within the rule (materialized backpropagated through its bfloat16 weights)."""
    shape = Shape(1, 1, 1, 1, 3, 6, 8, True)
    call = Call(
        shape,
        torch.bfloat16,
        MaskSpec(),
        *make_inputs(shape, torch.bfloat16, 0),
        seed=0,
        scale=1.7,
        return_weights=True,
        grad=True,
    )
    findings = Findings()
    findings.add(*run_all_backends(call, tally, request.node.name))
    findings.check()


@st.composite
def dead_row_terms(draw, shape: Shape) -> Term:
    """A mask term that leaves some query rows with no key at all."""
    kind = draw(st.sampled_from(("lengths", "allowed", "bias", "causal")))
    if kind == "lengths":  # some batch elements have no real key
        lengths = draw(st.lists(st.integers(0, shape.j), min_size=shape.b, max_size=shape.b))
        lengths[draw(st.integers(0, shape.b - 1))] = 0
        return Term("lengths", {"keys": torch.tensor(lengths)})
    if kind == "causal" and shape.i > shape.j:  # bottom-right: the first i - j rows see nothing
        return Term("causal", {"align": "bottom_right"})
    rows = torch.tensor(draw(st.lists(st.booleans(), min_size=shape.i, max_size=shape.i)))
    rows[draw(st.integers(0, shape.i - 1))] = False
    if kind == "bias":
        return Term(
            "bias",
            {"tensor": torch.where(rows, 0.0, -math.inf)[:, None].expand(shape.i, shape.j).contiguous()},
            draw(st.booleans()),
        )
    return Term("allowed", {"tensor": rows[:, None].expand(shape.i, shape.j).contiguous()}, draw(st.booleans()))


HUGE = {torch.float16: 200.0, torch.bfloat16: 1e20, torch.float32: 1e20, torch.float64: 1e20}


def test_fully_masked_rows_with_huge_magnitudes(tally, request):
    """q on fully masked rows and k on keys nobody sees ~ 1e20 (200 in float16, whose products overflow):
    dead rows stay exactly 0 with LSE -inf, no NaN anywhere, live rows within the rule, on every backend."""

    @given(data=st.data())
    def case(data):
        shape = data.draw(shapes(), label="shape")
        dtype = data.draw(dtypes, label="dtype")
        extra = data.draw(mask_specs(shape, max_terms=1), label="other mask")
        spec = MaskSpec((data.draw(dead_row_terms(shape), label="dead rows"), *extra.terms), extra.causal)
        seed = data.draw(seeds, label="seed")
        q, k, v = (t.clone() for t in make_inputs(shape, torch.float64, seed))
        huge = HUGE[dtype]
        keep, bias = spec.dense(shape)
        keep = keep & (bias > -math.inf)  # (b, h, i, j)
        dead_rows = ~keep.any(-1)  # (b, h, i)
        unseen = ~keep.any(-2)  # (b, h, j): keys no query of the head may see
        unseen_kv = unseen.view(shape.b, shape.g, shape.h // shape.g, shape.j).all(2)  # (b, g, j)
        qb, kb = batched(q, shape), batched(k, shape)
        qb[dead_rows] = qb[dead_rows].sign() * huge
        kb[unseen_kv] = kb[unseen_kv].sign() * huge
        q, k, v = (t.to(dtype) for t in (q, k, v))
        call = Call(
            shape,
            dtype,
            spec,
            q,
            k,
            v,
            seed=seed,
            return_weights=data.draw(st.booleans(), label="weights"),
            return_lse=data.draw(st.booleans(), label="return_lse"),
            grad=data.draw(st.booleans(), label="grad"),
        )
        findings.add(*run_all_backends(call, tally, request.node.name))

    findings = Findings()
    case()
    findings.check()


# --------------------------------------------------------------------------- the oracle in low precision


def oracle_bound(q, k, v, scale, dtype) -> tuple[float, float]:
    """What a reference computing in float32 (scale first, one rounding of the result) can be off by:
    output and weights bounds, from dtype's rounding of the result and float32's error on the scores."""
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    q64, k64 = q.double(), k.double()
    r = q.shape[-3] // k.shape[-3]
    k64 = k64.repeat_interleave(r, dim=-3)
    s = (q64.abs() @ k64.abs().transpose(-2, -1)).max().item() * abs(scale)  # sum_n |q_n k_n| * |scale|
    score_error = 8 * eps32 * s
    weights_bound = 2 * eps + score_error + 1e-5
    return v.double().abs().max().item() * weights_bound + 1e-5, weights_bound


def test_low_precision_oracle_is_robust(tally, request):
    """The reference in float16/bfloat16 is the most robust path: finite and within float32's reach of the
    float64 reference even where q k^T overflows the input dtype (inputs x 10, x 100)."""

    @given(data=st.data())
    def case(data):
        test = request.node.name
        shape = data.draw(shapes(), label="shape")
        dtype = data.draw(st.sampled_from((torch.float16, torch.bfloat16)), label="dtype")
        magnitude = data.draw(st.sampled_from((1.0, 10.0, 100.0)), label="magnitude")
        spec = data.draw(mask_specs(shape, max_terms=2), label="mask")
        q, k, v = make_inputs(shape, dtype, data.draw(seeds, label="seed"), magnitude)
        v = v / magnitude  # values of ordinary size: the bound below is relative to them
        scale = 1.0 / math.sqrt(shape.d)
        kwargs = {"mask": spec.build(), "causal": spec.causal, "backend": "reference", "return_weights": True}
        ref64 = multihead.attention_result(q.double(), k.double(), v.double(), **kwargs)
        detail = f"shape={shape} dtype={dtype} magnitude={magnitude} mask={spec}"
        try:
            lowp = multihead.attention_result(q, k, v, **kwargs)
        except Exception as error:  # noqa: BLE001
            tally.record(test, "crash", f"{type(error).__name__}: {error}")
            findings.add(f"reference in {dtype} raised {type(error).__name__}: {error}: {detail}")
            return
        out_bound, w_bound = oracle_bound(q, k, v, scale, dtype)
        if nan_in(lowp.output, lowp.weights):
            tally.record(test, "nan", detail)
            findings.add(f"reference in {dtype} gives NaN where float64 gives none: {detail}")
            return
        out_error = (lowp.output.double() - ref64.output).abs().max().item()
        w_error = (lowp.weights.double() - ref64.weights).abs().max().item()
        if out_error > out_bound or w_error > w_bound:
            tally.record(
                test,
                "wrong",
                f"output off by {out_error:.3g} (bound {out_bound:.3g}), weights by "
                f"{w_error:.3g} (bound {w_bound:.3g}): {detail}",
            )
            findings.add(
                f"reference in {dtype}: output off the float64 reference by {out_error:.3g} > "
                f"{out_bound:.3g} or weights by {w_error:.3g} > {w_bound:.3g}: {detail}"
            )
            return
        tally.record(test, "ok")

    findings = Findings()
    case()
    findings.check()


def test_float16_score_that_overflows_only_unscaled(tally, request):
    """q k^T = -80000 overflows float16, q k^T / sqrt(2) = -56569 does not: one key, so the output is v = 1
    on every backend (the issue: the reference gave 0)."""
    q = torch.full((1, 1, 1, 2), 200.0, dtype=torch.float16)
    k = torch.full((1, 1, 1, 2), -200.0, dtype=torch.float16)
    v = torch.ones(1, 1, 1, 3, dtype=torch.float16)
    failures = []
    for backend in backends_or_auto():
        for return_weights in (False, True):
            try:
                result = multihead.attention_result(q, k, v, backend=backend, return_weights=return_weights)
            except Exception as error:  # noqa: BLE001
                tally.record(request.node.name, "crash", f"{backend}: {type(error).__name__}: {error}")
                failures.append(f"{backend}: {type(error).__name__}: {error}")
                continue
            out = result.output
            ok = torch.equal(out.float(), torch.ones(1, 1, 1, 3))
            outcome = "ok" if ok else ("nan" if out.isnan().any() else "wrong")
            tally.record(request.node.name, outcome, f"{backend} weights={return_weights}: {out.flatten().tolist()}")
            if not ok:
                failures.append(
                    f"{backend} (return_weights={return_weights}): output {out.flatten().tolist()}, expected [1, 1, 1]"
                )
    assert not failures, "\n".join(failures)


def test_huge_keys_on_padded_batch(tally, request):
    """The issue's sdpa case, on every backend and dtype: q, k ~ 1e20 (200 in float16) for a batch element whose
    keys are all padding: its output is exactly 0, the other element's is the oracle's, no NaN."""
    findings = Findings()
    for dtype in DTYPES:
        for backend in backends_or_auto():
            for j in (1, 4):
                q, k, v = make_inputs(Shape(2, 2, 1, 3, j, 4, 5), torch.float64, j)
                q[0], k[0] = HUGE[dtype], HUGE[dtype]
                q, k, v = (t.to(dtype) for t in (q, k, v))
                mask = multihead.masks.padding(torch.tensor([0, j]))
                where = f"{backend} {dtype} j={j}"
                try:
                    out = multihead.attention(q, k, v, mask=mask, backend=backend)
                except Exception as error:  # noqa: BLE001
                    tally.record(request.node.name, "crash", f"{where}: {type(error).__name__}: {error}")
                    findings.add(f"{where}: raised {type(error).__name__}: {error}")
                    continue
                ref64 = multihead.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
                problems = []
                if out.isnan().any():
                    problems.append(("nan", f"NaN in the output: {out[0].flatten()[:4].tolist()}"))
                if not (out[0] == 0).all():
                    problems.append(("wrong", "the padded batch element's output is not exactly 0"))
                error = (out[1].double() - ref64[1]).abs().max().item()
                if error > 4 * torch.finfo(dtype).eps * v.double().abs().max().item() + 1e-5:
                    problems.append(("wrong", f"the real batch element is off by {error:.3g}"))
                outcome = max((p[0] for p in problems), key=SEVERITY.index, default="ok")
                tally.record(request.node.name, outcome, f"{where}: {problems}" if problems else "")
                if problems:
                    findings.add(f"{where}: {problems}")
    findings.check()
