"""Fuzz multihead.compat.MultiheadAttention against torch.nn.MultiheadAttention holding the same weights.

``test_compat_matches_torch`` draws a module (embed_dim / num_heads, bias, add_bias_kv, add_zero_attn,
kdim / vdim, batch_first), inputs (batched or not, self- or cross-attention, pairwise sizes up to 6),
masks torch's way (bool or float attn_mask, 2-D or 3-D per head; bool or float key_padding_mask;
is_causal with a causal mask), need_weights, average_attn_weights, train/eval mode (dropout 0) and a
dtype (float32 or float64). Torch in float64 is the truth; ours runs in the drawn dtype and passes when
``|ours - truth| <= 2 |torch_in_that_dtype - truth| + tiny`` (DESIGN.md's rule; float64 is the same rule
against itself), for the output, the weights and the gradients of the inputs and every parameter.

Rows whose keys are all masked (torch: NaN; multihead: 0, by design) are compared where torch is not NaN
only; there, ours must be finite, its weights exactly 0, and a query row masked in every head must give
exactly ``out_proj(0)``. Gradients are compared when torch's output has no NaN.

``test_compat_rejects_bad_input`` draws a valid call and one defect (shapes from torch's own error table,
dtypes, flags, masks, constructor options, the functional form): each must raise multihead's InputError
in "<arg>: expected ..., got .... Fix: ..." form, shape and dtype errors also catchable as torch's
AssertionError, and leave the module unchanged.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from torch import nn

from multihead import compat
from multihead._errors import InputError

HEADS = [(4, 1), (4, 2), (6, 3), (8, 2), (8, 4), (9, 3), (10, 5), (12, 4)]  # (embed_dim, num_heads)
TINY = {torch.float64: 1e-10, torch.float32: 1e-5}
ATTN_KINDS = ("none", "bool2", "float2", "bool3", "float3", "causal")
PAD_KINDS = ("none", "bool", "float")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (see tests/conftest.py)


@dataclass(frozen=True)
class Config:
    embed_dim: int
    num_heads: int
    bias: bool
    add_bias_kv: bool
    add_zero_attn: bool
    kdim: int | None
    vdim: int | None
    batch_first: bool
    batched: bool
    self_attention: bool
    batch: int
    q_len: int
    k_len: int
    attn: str
    padding: str
    is_causal: bool
    need_weights: bool
    average: bool
    training: bool
    dtype: torch.dtype
    seed: int

    @property
    def key_dim(self) -> int:
        return self.embed_dim if self.kdim is None else self.kdim

    @property
    def value_dim(self) -> int:
        return self.embed_dim if self.vdim is None else self.vdim

    @property
    def extra_keys(self) -> int:
        return int(self.add_bias_kv) + int(self.add_zero_attn)

    def module_kwargs(self) -> dict:
        return dict(
            bias=self.bias,
            add_bias_kv=self.add_bias_kv,
            add_zero_attn=self.add_zero_attn,
            kdim=self.kdim,
            vdim=self.vdim,
            batch_first=self.batch_first,
        )


@st.composite
def configs(draw) -> Config:
    embed_dim, num_heads = draw(st.sampled_from(HEADS))
    self_attention = draw(st.booleans())
    kdim = vdim = None
    if not self_attention:
        kdim = draw(st.sampled_from([None, 3, 5, embed_dim]))
        vdim = draw(st.sampled_from([None, 3, 7, embed_dim]))
    batched = draw(st.booleans())
    q_len = draw(st.integers(1, 6))
    k_len = q_len if self_attention else draw(st.integers(1, 6))
    attn = draw(st.sampled_from(ATTN_KINDS))
    return Config(
        embed_dim,
        num_heads,
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.booleans()),
        kdim,
        vdim,
        draw(st.booleans()),
        batched,
        self_attention,
        draw(st.integers(1, 3)) if batched else 1,
        q_len,
        k_len,
        attn,
        draw(st.sampled_from(PAD_KINDS)),
        attn == "causal" and draw(st.booleans()),
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.sampled_from([torch.float32, torch.float64])),
        draw(st.integers(0, 2**31 - 1)),
    )


def _seq(c: Config, length: int, features: int, gen: torch.Generator) -> torch.Tensor:
    shape = (
        ((c.batch, length, features) if c.batch_first else (length, c.batch, features))
        if c.batched
        else (length, features)
    )
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _masks(c: Config, gen: torch.Generator):
    """(key_padding_mask, attn_mask) in torch's convention, float64 when float; and the keys each (n, head,
    query) may attend, (N, h, L, S + extra keys), computed here from the masks alone."""
    n, h, L, S = c.batch, c.num_heads, c.q_len, c.k_len
    allowed = torch.ones(n, h, L, S, dtype=torch.bool)

    def float_mask(shape):
        values = 2 * torch.rand(shape, generator=gen, dtype=torch.float64) - 1
        return values.masked_fill(torch.rand(shape, generator=gen) < 0.3, -math.inf)

    attn = None
    if c.attn in ("bool2", "bool3"):
        attn = torch.rand((L, S) if c.attn == "bool2" else (n * h, L, S), generator=gen) < 0.3
    elif c.attn in ("float2", "float3"):
        attn = float_mask((L, S) if c.attn == "float2" else (n * h, L, S))
    elif c.attn == "causal":  # top-left, as torch's is_causal hint means
        causal = torch.ones(L, S, dtype=torch.bool).triu(1)
        attn = (
            causal
            if torch.rand((), generator=gen) < 0.5
            else torch.zeros(L, S, dtype=torch.float64).masked_fill(causal, -math.inf)
        )
    if attn is not None:
        blocked = attn if attn.dtype == torch.bool else attn == -math.inf
        allowed &= ~(blocked if blocked.dim() == 2 else blocked.view(n, h, L, S))
    padding = None
    if c.padding != "none":
        padding = torch.rand(n, S, generator=gen) < 0.3 if c.padding == "bool" else float_mask((n, S))
        blocked = padding if padding.dtype == torch.bool else padding == -math.inf
        allowed &= ~blocked[:, None, None, :]
        if not c.batched:
            padding = padding[0]  # (S,)
    if attn is not None and not c.batched and attn.dim() == 3:
        attn = attn.view(h, L, S)  # unbatched: (num_heads, L, S)
    allowed = torch.cat([allowed, torch.ones(n, h, L, c.extra_keys, dtype=torch.bool)], dim=-1)
    return padding, attn, allowed


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or not t.is_floating_point() else t.to(dtype)


def _run(module: nn.Module, c: Config, inputs, padding, attn, is_causal: bool, dtype: torch.dtype, seed: int):
    """(out, weights, grads of inputs + parameters) of a random linear loss, in ``dtype``."""
    leaves = [t.to(dtype).requires_grad_(True) for t in inputs]
    qkv = leaves * 3 if c.self_attention else leaves
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when the two masks' dtypes differ, then converts
        out, weights = module(
            *qkv,
            key_padding_mask=_cast(padding, dtype),
            need_weights=c.need_weights,
            attn_mask=_cast(attn, dtype),
            average_attn_weights=c.average,
            is_causal=is_causal,
        )
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)).sum()
    if weights is not None:
        clean = weights.nan_to_num(0.0)
        loss = loss + (clean * torch.randn(weights.shape, generator=gen, dtype=torch.float64).to(dtype)).sum()
    grads = torch.autograd.grad(loss, leaves + list(module.parameters()))
    return out.detach(), None if weights is None else weights.detach(), [g.detach() for g in grads]


def _modules(c: Config):
    """torch's module with random float64 parameters (the truth), a copy in the drawn dtype, and ours holding
    the same state in the drawn dtype."""
    truth = nn.MultiheadAttention(c.embed_dim, c.num_heads, dtype=torch.float64, **c.module_kwargs())
    gen = torch.Generator().manual_seed(c.seed)
    with torch.no_grad():
        for p in truth.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    lowp = nn.MultiheadAttention(c.embed_dim, c.num_heads, dtype=c.dtype, **c.module_kwargs())
    lowp.load_state_dict(truth.state_dict())
    ours = compat.MultiheadAttention(c.embed_dim, c.num_heads, dtype=c.dtype, **c.module_kwargs())
    ours.load_state_dict(truth.state_dict())
    for m in (truth, lowp, ours):
        m.train(c.training)
    return truth, lowp, ours


def _within_rule(ours: torch.Tensor, lowp: torch.Tensor, truth: torch.Tensor, keep: torch.Tensor, dtype) -> str | None:
    """None when max|ours - truth| <= 2 max|lowp - truth| + tiny over ``keep``; else why not."""
    if not keep.any():
        return None
    truth = truth[keep]
    error = (ours[keep].double() - truth).abs().max().item()
    bound = 2 * (lowp[keep].double() - truth).abs().max().item() + TINY[dtype] * max(1.0, truth.abs().max().item())
    return None if error <= bound else f"max error {error:.3g} > bound {bound:.3g}"


def compare(c: Config) -> tuple[str, str]:
    """(outcome, detail) of one drawn case."""
    gen = torch.Generator().manual_seed(c.seed)
    inputs = [_seq(c, c.q_len, c.embed_dim, gen)]
    if not c.self_attention:
        inputs += [_seq(c, c.k_len, c.key_dim, gen), _seq(c, c.k_len, c.value_dim, gen)]
    padding, attn, allowed = _masks(c, gen)
    # torch quirk (docs/compat.md): with is_causal, need_weights=False and no key_padding_mask, torch drops
    # attn_mask and asks SDPA for causal over the keys *after* bias_k / the zero key; it is asked without
    # the hint then, which is the result it gives with need_weights=True
    torch_causal = c.is_causal and not (not c.need_weights and padding is None and c.extra_keys)
    truth_m, lowp_m, ours_m = _modules(c)
    truth = _run(truth_m, c, inputs, padding, attn, torch_causal, torch.float64, c.seed)
    lowp = _run(lowp_m, c, inputs, padding, attn, torch_causal, c.dtype, c.seed)
    try:
        ours = _run(ours_m, c, inputs, padding, attn, c.is_causal, c.dtype, c.seed)
    except InputError as error:
        return "crash", f"a valid call rejected: {type(error).__name__}: {error}"
    except Exception as error:  # noqa: BLE001 - any other error is a crash, recorded with its type
        return "crash", f"{type(error).__name__}: {error}"
    (out_t, w_t, g_t), (out_l, w_l, g_l), (out_o, w_o, g_o) = truth, lowp, ours
    if (
        not out_o.isfinite().all()
        or (w_o is not None and not w_o.isfinite().all())
        or not all(g.isfinite().all() for g in g_o)
    ):
        return "nan", "NaN or inf in ours"
    if (w_o is None) != (w_t is None) or out_o.shape != out_t.shape or (w_o is not None and w_o.shape != w_t.shape):
        return "wrong", f"shapes {tuple(out_o.shape)} vs torch {tuple(out_t.shape)}"
    nan_out = out_t.isnan()
    why = _within_rule(out_o, out_l, out_t, ~nan_out, c.dtype)
    if why:
        return "wrong", f"output: {why}"
    # a query masked in every head gives out_proj(0): exactly the bias (or 0)
    empty_rows = ~allowed.any(-1).any(1)  # (N, L): no head has a key
    if empty_rows.any():
        rows = out_o if not c.batched else (out_o if c.batch_first else out_o.transpose(0, 1))
        rows = rows.reshape(c.batch, c.q_len, c.embed_dim)[empty_rows]
        bias = ours_m.out_proj.bias.detach() if c.bias else torch.zeros(c.embed_dim, dtype=c.dtype)
        if not torch.equal(rows, bias.expand_as(rows)):
            return "wrong", "a query with no key in any head is not out_proj(0)"
    if w_o is not None:
        nan_w = w_t.isnan()
        why = _within_rule(w_o, w_l, w_t, ~nan_w, c.dtype)
        if why:
            return "wrong", f"weights: {why}"
        full = ~allowed.any(-1)  # (N, h, L): this head's row has no key
        per_head = w_o.reshape(c.batch, -1, c.q_len, w_o.shape[-1])
        if not c.average and not (per_head[full] == 0).all():
            return "wrong", "weights of a fully masked row are not exactly 0"
        if c.average and not (per_head[full.all(1)[:, None].expand(-1, per_head.shape[1], -1)] == 0).all():
            return "wrong", "averaged weights of a row masked in every head are not exactly 0"
    if not nan_out.any():
        for n, (grad_o, grad_l, grad_t) in enumerate(zip(g_o, g_l, g_t, strict=True)):
            why = _within_rule(grad_o, grad_l, grad_t, torch.ones_like(grad_t, dtype=torch.bool), c.dtype)
            if why:
                return "wrong", f"gradient {n}: {why}"
    return "ok", ""


def test_compat_matches_torch(tally, request):
    @given(c=configs())
    def case(c: Config):
        note(repr(c))
        outcome, detail = compare(c)
        tally.record(request.node.name, outcome, f"{c}: {detail}")
        assert outcome == "ok", f"[{outcome}] {detail}"

    case()


# --------------------------------------------------------------------------- bad inputs


def _bad_calls(c: Config, gen: torch.Generator):
    """(label, module to watch or None, call, extra classes the error must also be) for one base config."""
    E, h = c.embed_dim, c.num_heads
    m = compat.MultiheadAttention(E, h, batch_first=c.batch_first, kdim=c.kdim, vdim=c.vdim)
    q = _seq(c, c.q_len, E, gen).float()
    k, v = _seq(c, c.k_len, c.key_dim, gen).float(), _seq(c, c.k_len, c.value_dim, gen).float()
    batched, n = c.batched, c.batch
    shape_error = (ValueError, AssertionError)
    dtype_error = (TypeError, AssertionError)
    other_dims = (lambda t: t[0]) if batched else (lambda t: t[None])
    pad = torch.zeros((n, c.k_len) if batched else (c.k_len,), dtype=torch.bool)
    yield "key dims", m, lambda: m(q, other_dims(k), v), shape_error
    yield "value dims", m, lambda: m(q, k, other_dims(v)), shape_error
    yield "query 1-D", m, lambda: m(q.reshape(-1), k, v), shape_error
    yield "query 4-D", m, lambda: m(q[None, None] if not batched else q[None], k, v), shape_error
    yield "padding dims", m, lambda: m(q, k, v, key_padding_mask=other_dims(pad) if batched else pad[None]), shape_error
    yield (
        "padding shape",
        m,
        lambda: m(
            q, k, v, key_padding_mask=torch.zeros((n, c.k_len + 1) if batched else (c.k_len + 1,), dtype=torch.bool)
        ),
        shape_error,
    )
    yield "attn 1-D", m, lambda: m(q, k, v, attn_mask=torch.zeros(c.k_len, dtype=torch.bool)), shape_error
    yield (
        "attn 2-D shape",
        m,
        lambda: m(q, k, v, attn_mask=torch.zeros(c.q_len + 1, c.k_len, dtype=torch.bool)),
        shape_error,
    )
    yield "attn 3-D heads", m, lambda: m(q, k, v, attn_mask=torch.zeros(n * h + 1, c.q_len, c.k_len)), shape_error
    yield "attn int", m, lambda: m(q, k, v, attn_mask=torch.zeros(c.q_len, c.k_len, dtype=torch.int64)), dtype_error
    yield "padding int", m, lambda: m(q, k, v, key_padding_mask=pad.int()), dtype_error
    yield "query float64", m, lambda: m(q.double(), k.double(), v.double()), dtype_error
    yield "key float64", m, lambda: m(q, k.double(), v), dtype_error
    yield "query int", m, lambda: m(q.long(), k.long(), v.long()), dtype_error
    yield "embed dim", m, lambda: m(torch.cat([q, q[..., :1]], -1), k, v), shape_error
    yield "key features", m, lambda: m(q, torch.cat([k, k[..., :1]], -1), v), shape_error
    yield "value length", m, lambda: m(q, k, torch.cat([v, v], dim=1 if batched and c.batch_first else 0)), shape_error
    if batched:
        axis = 0 if c.batch_first else 1
        yield "key batch", m, lambda: m(q, torch.cat([k, k], dim=axis), torch.cat([v, v], dim=axis)), shape_error
    yield "need_weights str", m, lambda: m(q, k, v, need_weights="no"), (TypeError,)
    yield "average int", m, lambda: m(q, k, v, average_attn_weights=1), (TypeError,)
    yield "is_causal None", m, lambda: m(q, k, v, is_causal=None), (TypeError,)
    yield "is_causal alone", m, lambda: m(q, k, v, is_causal=True), (ValueError, AssertionError, RuntimeError)
    yield "query list", m, lambda: m(q.tolist(), k, v), (TypeError,)
    yield "mask list", m, lambda: m(q, k, v, attn_mask=[[0.0]]), (TypeError,)
    yield "kdim -1", None, lambda: compat.MultiheadAttention(E, h, kdim=-1), (ValueError,)
    yield "kdim str", None, lambda: compat.MultiheadAttention(E, h, kdim=str(E)), (TypeError,)
    yield "vdim 0", None, lambda: compat.MultiheadAttention(E, h, vdim=0), (ValueError,)
    yield (
        "heads not dividing",
        None,
        lambda: (
            compat.MultiheadAttention(E + 1, h + 1) if (E + 1) % (h + 1) else compat.MultiheadAttention(E + 1, h + 2)
        ),
        shape_error,
    )
    yield "dropout 1", None, lambda: compat.MultiheadAttention(E, h, dropout=1.0), (ValueError,)
    yield "dtype int64", None, lambda: compat.MultiheadAttention(E, h, dtype=torch.int64), (ValueError,)
    yield "dtype complex", None, lambda: compat.MultiheadAttention(E, h, dtype=torch.complex64), (ValueError,)
    yield "dtype str", None, lambda: compat.MultiheadAttention(E, h, dtype="float32"), (TypeError,)
    yield "device nope", None, lambda: compat.MultiheadAttention(E, h, device="nope"), (ValueError,)
    yield "bias str", None, lambda: compat.MultiheadAttention(E, h, bias="no"), (TypeError,)
    yield "to_torch str", None, lambda: compat.to_torch("x"), (TypeError,)
    if batched and not c.batch_first:
        w = m.in_proj_weight if m.in_proj_weight is not None else None
        if w is not None:
            args = dict(
                embed_dim_to_check=E,
                num_heads=h,
                in_proj_weight=w,
                in_proj_bias=m.in_proj_bias,
                bias_k=None,
                bias_v=None,
                add_zero_attn=False,
                dropout_p=0.0,
                out_proj_weight=m.out_proj.weight,
                out_proj_bias=m.out_proj.bias,
            )
            head_dim = E // h
            yield (
                "static_k rows",
                m,
                lambda: compat.multi_head_attention_forward(
                    q, k, v, **args, static_k=torch.randn(n * h + 1, c.k_len, head_dim)
                ),
                shape_error,
            )
            yield (
                "in_proj_weight shape",
                m,
                lambda: compat.multi_head_attention_forward(q, k, v, **dict(args, in_proj_weight=w[:E])),
                shape_error,
            )


def test_compat_rejects_bad_input(tally, request):
    test = request.node.name

    @given(c=configs(), pick=st.integers(0, 10**6))
    def case(c: Config, pick: int):
        calls = list(_bad_calls(c, torch.Generator().manual_seed(c.seed)))
        label, module, call, also = calls[pick % len(calls)]
        note(f"{c}: {label}")
        before = None if module is None else {k: t.clone() for k, t in module.state_dict().items()}
        error = None
        try:
            call()
        except Exception as raised:  # noqa: BLE001 - classified below
            error = raised
        detail = f"{label}: {type(error).__name__}: {error}"
        changed = module is not None and (
            list(module.state_dict()) != list(before)
            or not all(torch.equal(t, before[k]) for k, t in module.state_dict().items())
        )
        if changed:
            outcome = tally.record(test, "state_corrupted", detail)
        elif error is not None and isinstance(error, InputError) and not isinstance(error, also):
            outcome = tally.record(test, "poor_message", f"{detail} (not also {also})")
        else:
            outcome = tally.rejection(test, error)
        assert outcome == "ok", f"[{outcome}] {detail}"

    case()
