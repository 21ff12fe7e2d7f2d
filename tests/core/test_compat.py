"""multihead.compat.MultiheadAttention against torch.nn.MultiheadAttention itself, and the weight converters.

The oracle here is torch's own module, built in float64 with random (non-zero) parameters whose
state_dict is loaded unchanged into the drop-in. A seeded grid covers every constructor option and
every forward argument; fully masked rows (the one intended numerical difference: 0 where torch gives
NaN), dropout, a swap inside user modules and from_torch/to_torch are tested apart. Then the contracts of
PyTorch's test/nn/test_multihead_attention.py, re-derived here: 3-D masks equal per-element 2-D masks,
bias=False, kdim/vdim layouts, empty sizes, the functional form (static_k/static_v), jagged nested
inputs, TorchScript's refusal, and a table of bad inputs whose errors read in the caller's terms, carry
torch's wording and are catchable the torch way (AssertionError) as well as ours (ValueError/TypeError).

The tests that run a module are portable: both modules, their inputs, masks and cotangents live on the --device
(random values drawn on the CPU and moved); the error tables and TorchScript stay on the CPU.

Sizes are pairwise distinct within a case (batch N, query length L, key length S, heads, head dim,
embed_dim, kdim, vdim) so that a swapped axis cannot pass.
"""

from __future__ import annotations

import copy
import math
import random
import re
from dataclasses import dataclass, fields

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multihead import MultiHeadAttention, compat
from multihead._errors import ArgumentTypeError, ArgumentValueError, InputError
from multihead.compat import from_torch, to_torch

F64 = torch.float64
OUT_ATOL = 1e-12  # outputs and weights, float64
GRAD_ATOL = 1e-10  # gradients, float64
# torch warns (and then converts) when key_padding_mask and attn_mask have different dtypes; the grid does that
MISMATCHED_MASKS = "ignore:Support for mismatched key_padding_mask and attn_mask:UserWarning"


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (see tests/conftest.py)


def randomize_(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter (biases, bias_k/bias_v included) drawn at random: zero biases would test nothing."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=gen, dtype=F64))
    return module


def torch_and_compat(
    seed: int, *args, device: torch.device | str = "cpu", **kwargs
) -> tuple[nn.MultiheadAttention, compat.MultiheadAttention]:
    """torch's module (random float64 parameters) and the drop-in holding its state_dict, both in eval mode, on
    ``device``."""
    theirs = randomize_(nn.MultiheadAttention(*args, **kwargs, dtype=F64, device=device), seed)
    ours = compat.MultiheadAttention(*args, **kwargs, dtype=F64, device=device)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    report = ours.load_state_dict(theirs.state_dict())
    assert not report.missing_keys and not report.unexpected_keys, report
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    return theirs.eval(), ours.eval()


def loss_of(out: torch.Tensor, weights: torch.Tensor | None, seed: int) -> torch.Tensor:
    """A random linear function of the output (and of the weights when returned); coefficients drawn on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=F64).to(out.device)).sum()
    if weights is not None:
        loss = loss + (weights * torch.randn(weights.shape, generator=gen, dtype=F64).to(weights.device)).sum()
    return loss


def assert_close(actual, expected, atol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- the randomized grid

HEAD_CONFIGS = [(12, 3), (12, 4), (10, 5), (8, 1)]  # (embed_dim, num_heads): head dims 4, 3, 2, 8
ATTN_KINDS = ["none", "bool2", "float2", "bool3", "float3", "causal_bool", "causal_float"]
PADDING_KINDS = ["none", "bool", "float"]
N_CASES = 96


@dataclass(frozen=True)
class Case:
    index: int
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
    batch: int  # 1 when unbatched
    q_len: int
    k_len: int
    key_padding: str
    attn: str
    is_causal: bool
    need_weights: bool
    average: bool

    @property
    def key_dim(self) -> int:
        return self.embed_dim if self.kdim is None else self.kdim

    @property
    def value_dim(self) -> int:
        return self.embed_dim if self.vdim is None else self.vdim

    def __str__(self) -> str:
        parts = [
            f"c{self.index:02d}",
            f"E{self.embed_dim}h{self.num_heads}",
            "bf" if self.batch_first else "sf",
            f"N{self.batch}" if self.batched else "unbatched",
            "self" if self.self_attention else "cross",
            f"L{self.q_len}S{self.k_len}",
        ]
        parts += [
            name
            for name, on in (("nobias", not self.bias), ("biaskv", self.add_bias_kv), ("zeroattn", self.add_zero_attn))
            if on
        ]
        if self.kdim is not None or self.vdim is not None:
            parts.append(f"k{self.kdim}v{self.vdim}")
        parts += [f"kpm-{self.key_padding}", f"attn-{self.attn}"]
        if self.is_causal:
            parts.append("is_causal")
        parts.append(("avg" if self.average else "perhead") if self.need_weights else "noweights")
        return "-".join(parts)


def make_cases(n_cases: int = N_CASES, seed: int = 20240608) -> list[Case]:
    """Options drawn independently; then sizes redrawn until they are pairwise distinct."""
    rng = random.Random(seed)
    cases = []
    for index in range(n_cases):
        embed_dim, num_heads = rng.choice(HEAD_CONFIGS)
        self_attention, batched = rng.random() < 0.4, rng.random() < 0.75
        attn = rng.choice(ATTN_KINDS)
        while True:
            if self_attention:
                kdim = vdim = rng.choice([None, embed_dim])  # explicit kdim == embed_dim is the same layout
            else:
                kdim, vdim = rng.choice([None, 7, 9, 11, 13]), rng.choice([None, 7, 9, 11, 13])
            batch = rng.choice([2, 3]) if batched else 1
            q_len = rng.randint(2, 9)
            k_len = q_len if self_attention else rng.randint(2, 9)
            sizes = [q_len, num_heads, embed_dim] + ([embed_dim // num_heads] if num_heads > 1 else [])
            sizes += [batch] if batched else []
            sizes += [] if self_attention else [k_len]
            sizes += [d for d in {kdim, vdim} if d is not None and d != embed_dim]
            if len(set(sizes)) == len(sizes):
                break
        cases.append(
            Case(
                index=index,
                embed_dim=embed_dim,
                num_heads=num_heads,
                bias=rng.random() < 0.7,
                add_bias_kv=rng.random() < 0.3,
                add_zero_attn=rng.random() < 0.3,
                kdim=kdim,
                vdim=vdim,
                batch_first=rng.random() < 0.5,
                batched=batched,
                self_attention=self_attention,
                batch=batch,
                q_len=q_len,
                k_len=k_len,
                key_padding=rng.choice(PADDING_KINDS),
                attn=attn,
                is_causal=attn.startswith("causal") and rng.random() < 0.75,
                need_weights=rng.random() < 0.7,
                average=rng.random() < 0.5,
            )
        )
    return cases


CASES = make_cases()


def case_masks(
    case: Case, gen: torch.Generator, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(key_padding_mask, attn_mask) in torch's convention (bool True = masked out, float added), drawn on the CPU
    and moved to ``device``.

    One key (key 0 under a causal mask, where the first query sees only it) is never masked, so no
    query row is fully masked; fully masked rows have their own tests.
    """
    n, h, L, S = case.batch, case.num_heads, case.q_len, case.k_len
    always = 0 if case.attn.startswith("causal") else int(torch.randint(S, (1,), generator=gen))

    def bool_mask(*shape):
        masked = torch.rand(shape, generator=gen) < 0.35
        masked[..., always] = False
        return masked

    def float_mask(*shape):
        values = 1.5 * torch.randn(shape, generator=gen, dtype=F64)  # finite values shift the scores
        values = values.masked_fill(torch.rand(shape, generator=gen) < 0.3, -math.inf)
        values[..., always] = torch.randn(shape[:-1], generator=gen, dtype=F64)
        return values

    padding_shape = (n, S) if case.batched else (S,)
    key_padding = {
        "none": None,
        "bool": lambda: bool_mask(*padding_shape),
        "float": lambda: float_mask(*padding_shape),
    }[case.key_padding]
    key_padding = key_padding() if key_padding is not None else None
    causal = torch.ones(L, S, dtype=torch.bool).triu(1)  # top-left, as torch's is_causal hint means
    attn_mask = {
        "none": lambda: None,
        "bool2": lambda: bool_mask(L, S),
        "float2": lambda: float_mask(L, S),
        "bool3": lambda: bool_mask(n * h, L, S),
        "float3": lambda: float_mask(n * h, L, S),
        "causal_bool": lambda: causal,
        "causal_float": lambda: torch.zeros(L, S, dtype=F64).masked_fill(causal, -math.inf),
    }[case.attn]()
    return tuple(None if t is None else t.to(device) for t in (key_padding, attn_mask))


def case_inputs(case: Case, gen: torch.Generator, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The distinct leaf tensors: [x] for self-attention, [query, key, value] otherwise (drawn on the CPU, on
    ``device``)."""

    def seq(length, features):
        if not case.batched:
            shape = (length, features)
        elif case.batch_first:
            shape = (case.batch, length, features)
        else:
            shape = (length, case.batch, features)
        return torch.randn(shape, generator=gen, dtype=F64).to(device)

    if case.self_attention:
        return [seq(case.q_len, case.embed_dim)]
    return [seq(case.q_len, case.embed_dim), seq(case.k_len, case.key_dim), seq(case.k_len, case.value_dim)]


def torch_drops_the_extra_keys(case: Case) -> bool:
    """torch quirk: with is_causal=True, need_weights=False and no key_padding_mask, torch drops attn_mask
    and asks SDPA for a top-left causal mask over the keys *after* appending bias_k / the zero key, so
    earlier queries no longer see those keys, and torch's output then depends on need_weights. The
    drop-in honours attn_mask (torch's need_weights=True result); torch is then asked with is_causal=False."""
    return (
        case.is_causal
        and not case.need_weights
        and case.key_padding == "none"
        and (case.add_bias_kv or case.add_zero_attn)
    )


def run_case(module: nn.Module, case: Case, inputs: list[torch.Tensor], key_padding, attn_mask, is_causal):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    qkv = leaves * 3 if case.self_attention else leaves  # self-attention: the same tensor three times
    out, weights = module(
        *qkv,
        key_padding_mask=key_padding,
        need_weights=case.need_weights,
        attn_mask=attn_mask,
        average_attn_weights=case.average,
        is_causal=is_causal,
    )
    grads = torch.autograd.grad(
        loss_of(out, weights, seed=case.index), leaves + [p for _, p in module.named_parameters()]
    )
    names = [f"input{n}" for n in range(len(leaves))] + [name for name, _ in module.named_parameters()]
    return out, weights, dict(zip(names, grads, strict=True))


def test_grid_covers_every_option():
    seen = {f.name: {getattr(c, f.name) for c in CASES} for f in fields(Case)}
    for name in (
        "bias",
        "add_bias_kv",
        "add_zero_attn",
        "batch_first",
        "batched",
        "self_attention",
        "is_causal",
        "need_weights",
        "average",
    ):
        assert seen[name] == {False, True}, name
    assert seen["key_padding"] == set(PADDING_KINDS) and seen["attn"] == set(ATTN_KINDS)
    assert {(c.embed_dim, c.num_heads) for c in CASES} == set(HEAD_CONFIGS)
    assert {None, 7, 9, 11, 13} <= seen["kdim"] and {None, 7, 9, 11, 13} <= seen["vdim"]
    assert any(c.kdim == c.embed_dim for c in CASES)  # explicit kdim = vdim = embed_dim
    assert any(c.q_len != c.k_len for c in CASES)
    pairs = {(c.batched, c.attn, c.key_padding) for c in CASES}
    assert {(False, a) for a in ("bool3", "float3")} <= {(b, a) for b, a, _ in pairs}  # (num_heads, L, S)
    assert {(False, p) for p in ("bool", "float")} <= {(b, p) for b, _, p in pairs}  # (S,) padding
    sdpa_causal = [c for c in CASES if c.is_causal and not c.need_weights and c.key_padding == "none"]
    assert any(not torch_drops_the_extra_keys(c) for c in sdpa_causal)  # torch's SDPA is_causal path
    assert any(torch_drops_the_extra_keys(c) for c in sdpa_causal)
    assert any(c.is_causal and c.q_len != c.k_len for c in CASES)


@pytest.mark.portable
@pytest.mark.filterwarnings(MISMATCHED_MASKS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_torch_forward_and_backward(case: Case, device):
    theirs, ours = torch_and_compat(
        case.index,
        case.embed_dim,
        case.num_heads,
        dropout=0.0,
        bias=case.bias,
        add_bias_kv=case.add_bias_kv,
        add_zero_attn=case.add_zero_attn,
        kdim=case.kdim,
        vdim=case.vdim,
        batch_first=case.batch_first,
        device=device,
    )
    gen = torch.Generator().manual_seed(10_000 + case.index)
    inputs = case_inputs(case, gen, device)
    key_padding, attn_mask = case_masks(case, gen, device)

    torch_causal = case.is_causal and not torch_drops_the_extra_keys(case)
    out_t, w_t, grads_t = run_case(theirs, case, inputs, key_padding, attn_mask, torch_causal)
    out_o, w_o, grads_o = run_case(ours, case, inputs, key_padding, attn_mask, case.is_causal)

    assert not out_t.isnan().any(), "test bug: torch gave NaN, a row is fully masked"
    assert_close(out_o, out_t, OUT_ATOL, "output")
    if case.need_weights:
        assert w_o is not None and w_t is not None
        assert_close(w_o, w_t, OUT_ATOL, "weights")
    else:
        assert w_o is None and w_t is None
    assert grads_o.keys() == grads_t.keys()
    for name, grad in grads_t.items():
        assert_close(grads_o[name], grad, GRAD_ATOL, f"grad {name}")


# --------------------------------------------------------------------------- fully masked rows

E, H, N, L, S = 12, 4, 3, 5, 7  # head dim 3: all distinct


def _fully_masked_pair(seed=7, **kwargs):
    return torch_and_compat(seed, E, H, **kwargs)


def _qkv(seed, *, batch=N, q_len=L, k_len=S, device="cpu"):
    """query (q_len, batch, E), key and value (k_len, batch, E): seq first, drawn on the CPU, on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(length, batch, E, generator=gen, dtype=F64).to(device) for length in (q_len, k_len, k_len)]


def _cotangents(seed, out_shape, weights_shape, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen, dtype=F64).to(device) for shape in (out_shape, weights_shape))


def _forward_and_grads(module, qkv, cotangents, **kwargs):
    """out, weights and d <out, cot_out> + <weights, cot_w> / d (query, key, value and every parameter)."""
    leaves = [t.clone().requires_grad_(True) for t in qkv]
    out, weights = module(*leaves, **kwargs)
    loss = (out * cotangents[0]).sum()
    if weights is not None:
        loss = loss + (weights * cotangents[1]).sum()
    params = [p for _, p in module.named_parameters()]
    grads = torch.autograd.grad(loss, leaves + params)
    names = ["query", "key", "value"] + [n for n, _ in module.named_parameters()]
    return out, weights, dict(zip(names, grads, strict=True))


@pytest.mark.portable
@pytest.mark.parametrize("padding_dtype", [torch.bool, F64], ids=["bool", "float-inf"])
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "noweights"])
def test_padding_every_key_of_a_batch_element(padding_dtype, need_weights, device):
    """Batch element 1 has every key padded: torch gives NaN; ours gives out_proj(0) = out_proj.bias,
    weights 0 and gradient 0 there, and elsewhere exactly what torch computes without that element."""
    theirs, ours = _fully_masked_pair(device=device)
    qkv = _qkv(1, device=device)
    padded = torch.zeros(N, S, dtype=torch.bool, device=device)
    padded[0, 2] = padded[2, 4:] = True
    padded[1] = True  # every key of batch element 1
    key_padding = (
        padded
        if padding_dtype == torch.bool
        else torch.zeros(N, S, dtype=F64, device=device).masked_fill(padded, -math.inf)
    )
    kwargs = dict(key_padding_mask=key_padding, need_weights=need_weights, average_attn_weights=False)
    torch_out, _ = theirs(*qkv, **kwargs)
    assert not torch_out[:, [0, 2]].isnan().any()

    cot = _cotangents(3, (L, N, E), (N, H, L, S), device)
    out, weights, grads = _forward_and_grads(ours, qkv, cot, **kwargs)
    assert out.isfinite().all()
    if need_weights:  # torch's explicit-softmax path: NaN
        assert torch_out[:, 1].isnan().all()
    else:  # torch's SDPA path (need_weights=False) already gives out_proj(0) here: the same as ours
        assert_close(out, torch_out, OUT_ATOL, "output, torch's SDPA path")
    assert_close(out[:, 1], ours.out_proj.bias.expand(L, E), OUT_ATOL, "fully masked rows = out_proj(0)")
    keep = [0, 2]
    sub = dict(kwargs, key_padding_mask=key_padding[keep])
    expected, expected_w, expected_grads = _forward_and_grads(
        theirs, [t[:, keep] for t in qkv], (cot[0][:, keep], cot[1][keep]), **sub
    )
    assert_close(out[:, keep], expected, OUT_ATOL, "output of the other batch elements")
    if need_weights:
        assert weights.isfinite().all()
        assert_close(
            weights[1], torch.zeros(H, L, S, dtype=F64, device=device), 0.0, "weights of the fully masked rows"
        )
        assert_close(weights[keep], expected_w, OUT_ATOL, "weights of the other batch elements")
    for name in ("query", "key", "value"):
        assert grads[name].isfinite().all(), name
        assert_close(grads[name][:, 1], torch.zeros_like(grads[name][:, 1]), 0.0, f"grad {name} at 1")
        assert_close(grads[name][:, keep], expected_grads[name], GRAD_ATOL, f"grad {name}")
    # the parameters see the other elements' gradient, plus d loss / d out_proj.bias from the masked rows
    masked_rows_cotangent = cot[0][:, 1].sum(0)  # (E,): d loss / d out_proj.bias from batch element 1
    for name, _ in ours.named_parameters():
        assert grads[name].isfinite().all(), name
        want = expected_grads[name] + (masked_rows_cotangent if name == "out_proj.bias" else 0)
        assert_close(grads[name], want, GRAD_ATOL, f"grad {name}")


@pytest.mark.portable
@pytest.mark.parametrize("mask_dtype", [torch.bool, F64], ids=["bool", "float-inf"])
@pytest.mark.parametrize("average", [True, False], ids=["avg", "perhead"])
def test_attn_mask_row_with_every_key_masked(mask_dtype, average, device):
    """Query 2 may attend no key: out_proj.bias and weights 0 there for every batch element; the other
    queries equal torch run on them alone."""
    theirs, ours = _fully_masked_pair(seed=8, batch_first=True, device=device)
    qkv = [t.transpose(0, 1).contiguous() for t in _qkv(2, device=device)]  # (N, seq, E)
    masked = torch.zeros(L, S, dtype=torch.bool, device=device)
    masked[0, :3] = masked[4, 5] = True
    masked[2] = True
    attn_mask = (
        masked
        if mask_dtype == torch.bool
        else torch.zeros(L, S, dtype=F64, device=device).masked_fill(masked, -math.inf)
    )
    kwargs = dict(attn_mask=attn_mask, average_attn_weights=average)
    assert theirs(*qkv, **kwargs)[0][:, 2].isnan().all()

    cot = _cotangents(3, (N, L, E), (N, L, S) if average else (N, H, L, S), device)
    out, weights, grads = _forward_and_grads(ours, qkv, cot, **kwargs)
    assert out.isfinite().all() and weights.isfinite().all()
    assert_close(out[:, 2], ours.out_proj.bias.expand(N, E), OUT_ATOL, "fully masked rows = out_proj(0)")
    assert (weights[..., 2, :] == 0).all()
    rows = [0, 1, 3, 4]
    sub = dict(kwargs, attn_mask=attn_mask[rows])
    expected, expected_w, expected_grads = _forward_and_grads(
        theirs, [qkv[0][:, rows], qkv[1], qkv[2]], (cot[0][:, rows], cot[1][..., rows, :]), **sub
    )
    assert_close(out[:, rows], expected, OUT_ATOL, "output of the other rows")
    assert_close(weights[..., rows, :], expected_w, OUT_ATOL, "weights of the other rows")
    assert_close(grads["query"][:, 2], torch.zeros(N, E, dtype=F64, device=device), 0.0, "grad query at the masked row")
    assert_close(grads["query"][:, rows], expected_grads["query"], GRAD_ATOL, "grad query")
    masked_rows_cotangent = cot[0][:, 2].sum(0)  # (E,): d loss / d out_proj.bias from query 2
    for name in ["key", "value"] + [n for n, _ in ours.named_parameters()]:
        assert grads[name].isfinite().all(), name
        want = expected_grads[name] + (masked_rows_cotangent if name == "out_proj.bias" else 0)
        assert_close(grads[name], want, GRAD_ATOL, f"grad {name}")


@pytest.mark.portable
def test_one_head_fully_masked_through_a_3d_attn_mask(device):
    """A (N * num_heads, L, S) mask that masks every key of one (batch, head, query): that head
    contributes 0 before out_proj; torch's whole output row is NaN. Ours equals the head-by-head
    formula from torch's per-head weights with the NaN head taken as 0."""
    theirs, ours = _fully_masked_pair(seed=9, device=device)
    query, key, value = _qkv(4, device=device)
    masked = torch.zeros(N * H, L, S, dtype=torch.bool, device=device)
    masked[1 * H + 2, 3] = True  # batch element 1, head 2, query 3: every key
    masked[0, 1, :4] = True
    out, weights, grads = _forward_and_grads(
        ours,
        [query, key, value],
        _cotangents(3, (L, N, E), (N, H, L, S), device),
        attn_mask=masked,
        average_attn_weights=False,
    )
    with torch.no_grad():
        torch_out, torch_w = theirs(query, key, value, attn_mask=masked, average_attn_weights=False)
    assert torch_out[3, 1].isnan().all() and torch_w[1, 2, 3].isnan().all()
    assert out.isfinite().all() and weights.isfinite().all()
    assert (weights[1, 2, 3] == 0).all()
    nan_free = torch_w.nan_to_num(0.0)  # (N, H, L, S)
    assert_close(weights, nan_free, OUT_ATOL, "weights")
    _, _, w_v = theirs.in_proj_weight.chunk(3)
    v = F.linear(value, w_v, theirs.in_proj_bias.chunk(3)[2]).view(S, N, H, E // H).permute(1, 2, 0, 3)  # (N,H,S,d)
    heads = (nan_free @ v).permute(2, 0, 1, 3).reshape(L, N, E)  # (L, N, E): heads concatenated
    assert_close(out, theirs.out_proj(heads).detach(), OUT_ATOL, "output")
    assert_close(out[:, [0, 2]], torch_out[:, [0, 2]], OUT_ATOL, "batch elements without a masked row")
    for name, grad in grads.items():
        assert grad.isfinite().all(), name
    averaged = ours(query, key, value, attn_mask=masked)[1]
    assert_close(averaged, nan_free.mean(1), OUT_ATOL, "averaged weights")


@pytest.mark.portable
def test_unbatched_fully_masked_padding(device):
    theirs, ours = _fully_masked_pair(seed=10, device=device)
    query, key, value = (t[:, 0] for t in _qkv(5, device=device))  # (seq, E)
    key_padding = torch.ones(S, dtype=torch.bool, device=device)
    assert theirs(query, key, value, key_padding_mask=key_padding)[0].isnan().all()
    out, weights, grads = _forward_and_grads(
        ours, [query, key, value], _cotangents(3, (L, E), (L, S), device), key_padding_mask=key_padding
    )
    assert_close(out, ours.out_proj.bias.expand(L, E), OUT_ATOL, "out_proj(0)")
    assert (weights == 0).all() and weights.shape == (L, S)
    for name, grad in grads.items():
        assert grad.isfinite().all(), name
        if name in ("query", "key", "value"):
            assert (grad == 0).all(), name


@pytest.mark.portable
def test_bias_kv_and_zero_attn_rescue_fully_padded_rows_like_torch(device):
    """With add_bias_kv / add_zero_attn the extra key is never padded, so no row is empty: torch is finite."""
    for kwargs in (dict(add_bias_kv=True), dict(add_zero_attn=True)):
        theirs, ours = _fully_masked_pair(seed=11, device=device, **kwargs)
        qkv = _qkv(6, device=device)
        key_padding = torch.zeros(N, S, dtype=torch.bool, device=device)
        key_padding[2] = True
        expected, expected_w = theirs(*qkv, key_padding_mask=key_padding)
        assert expected.isfinite().all()
        out, weights = ours(*qkv, key_padding_mask=key_padding)
        assert_close(out, expected, OUT_ATOL, f"output {kwargs}")
        assert_close(weights, expected_w, OUT_ATOL, f"weights {kwargs}")


@pytest.mark.portable
@pytest.mark.parametrize("options", [dict(add_bias_kv=True), dict(add_zero_attn=True)], ids=["bias_kv", "zero_attn"])
def test_is_causal_hint_never_drops_the_extra_keys(options, device):
    """is_causal=True with a causal attn_mask: the output does not depend on need_weights, and equals torch's
    result where torch honours the mask (need_weights=True). torch's need_weights=False path drops the mask,
    so its extra bias_k / zero key is hidden from earlier queries (see torch_drops_the_extra_keys)."""
    theirs, ours = torch_and_compat(19, E, H, batch_first=True, device=device, **options)
    x = _qkv(19, batch=2, q_len=L, k_len=L, device=device)[0].transpose(0, 1)  # (2, L, E)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64, device=device)
    with torch.no_grad():
        expected, _ = theirs(x, x, x, attn_mask=causal, is_causal=True, need_weights=True)
        for need_weights in (True, False):
            out, _ = ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)
            assert_close(out, expected, OUT_ATOL, f"need_weights={need_weights}")


# --------------------------------------------------------------------------- dropout


@pytest.mark.portable
def test_dropout_train_versus_eval(device):
    p = 0.4
    theirs, ours = torch_and_compat(12, E, 3, dropout=p, kdim=7, vdim=9, device=device)
    gen = torch.Generator().manual_seed(12)
    query, key, value = (
        torch.randn(shape, generator=gen, dtype=F64).to(device) for shape in ((L, N, E), (S, N, 7), (S, N, 9))
    )
    eval_out, eval_w = ours(query, key, value, average_attn_weights=False)
    again, _ = ours(query, key, value, average_attn_weights=False)
    assert torch.equal(eval_out, again)
    torch_out, torch_w = theirs(query, key, value, average_attn_weights=False)
    assert_close(eval_out, torch_out, OUT_ATOL, "eval output")
    assert_close(eval_w, torch_w, OUT_ATOL, "eval weights")

    for module in (theirs, ours):  # the same behaviour in training: torch's, then ours
        module.train()
        torch.manual_seed(0)
        first, weights = module(query, key, value, average_attn_weights=False)
        second, _ = module(query, key, value, average_attn_weights=False)
        name = type(module).__module__
        assert not torch.allclose(first, second), name
        # the weights returned are the ones applied, after dropout: rows no longer sum to 1 ...
        assert not torch.allclose(weights.sum(-1), torch.ones(N, 3, L, dtype=F64, device=device)), name
        # ... each is 0 or the eval weight / (1 - p) ...
        scaled = eval_w / (1 - p)
        assert ((weights == 0) | ((weights - scaled).abs() <= 1e-12)).all(), name
        assert (weights == 0).any() and (weights != 0).any(), name
        # ... and the output is out_proj(weights @ V W^V), computed from them (both modules hold these weights)
        v = F.linear(value, ours.v_proj_weight, ours.in_proj_bias.chunk(3)[2]).view(S, N, 3, E // 3).permute(1, 2, 0, 3)
        heads = (weights @ v).permute(2, 0, 1, 3).reshape(L, N, E)  # (L, N, E)
        assert_close(first, ours.out_proj(heads), OUT_ATOL, f"{name}: output from the returned weights")
        module.eval()


@pytest.mark.portable
def test_dropout_weights_average_to_the_eval_weights(device):
    """Over many independent draws (one batch of copies), the mean post-dropout weight approaches the eval
    weight: each is w / (1 - p) with probability 1 - p, so the mean of n has std w sqrt(p / ((1 - p) n))."""
    p, copies = 0.3, 4000
    theirs, ours = torch_and_compat(13, E, 3, dropout=p, batch_first=True, device=device)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, L, E, generator=gen, dtype=F64).to(device)
    with torch.no_grad():
        _, eval_w = ours(x, x, x, average_attn_weights=False)  # (2, 3, L, L)
        ours.train()
        torch.manual_seed(1)
        repeated = x.repeat(copies, 1, 1)  # (2 * copies, L, E): copy c of element n at row c * 2 + n
        _, train_w = ours(repeated, repeated, repeated, average_attn_weights=False)
    mean = train_w.view(copies, 2, 3, L, L).mean(0)
    std = eval_w * math.sqrt(p / ((1 - p) * copies))
    assert ((mean - eval_w).abs() <= 6 * std + 1e-12).all()
    # and the fraction dropped is p
    dropped = (train_w == 0).double().mean().item()
    assert abs(dropped - p) < 6 * math.sqrt(p * (1 - p) / train_w.numel())


# --------------------------------------------------------------------------- a swap inside user code


class TinyBlock(nn.Module):
    """Pre-norm attention + feed-forward, written against an ``mha_cls`` with torch's interface."""

    def __init__(self, mha_cls, embed_dim: int = 12, num_heads: int = 4, device: torch.device | str = "cpu"):
        super().__init__()
        like = dict(dtype=F64, device=device)
        self.norm = nn.LayerNorm(embed_dim, **like)
        self.attn = mha_cls(embed_dim, num_heads, batch_first=True, **like)
        self.ff = nn.Sequential(nn.Linear(embed_dim, 20, **like), nn.GELU(), nn.Linear(20, embed_dim, **like))

    def forward(self, x, padding=None):
        h = self.norm(x)
        a, _ = self.attn(h, h, h, key_padding_mask=padding, need_weights=False)
        x = x + a
        return x + self.ff(x)


@pytest.mark.portable
def test_swapping_the_class_in_a_user_module(device):
    theirs = randomize_(TinyBlock(nn.MultiheadAttention, device=device), 14).eval()
    ours = TinyBlock(compat.MultiheadAttention, device=device).eval()
    report = ours.load_state_dict(theirs.state_dict())
    assert not report.missing_keys and not report.unexpected_keys
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(3, 7, 12, generator=gen, dtype=F64).to(device)
    padding = torch.zeros(3, 7, dtype=torch.bool, device=device)
    padding[1, 5:] = padding[2, 0] = True
    for pad in (None, padding):
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        outs = [m(xi, pad) for m, xi in zip((theirs, ours), xs, strict=True)]
        assert_close(outs[1], outs[0], OUT_ATOL, "block output")
        grads = [
            torch.autograd.grad(loss_of(o, None, 5), [xi] + list(m.parameters()))
            for o, xi, m in zip(outs, xs, (theirs, ours), strict=True)
        ]
        for n, (g_o, g_t) in enumerate(zip(grads[1], grads[0], strict=True)):
            assert_close(g_o, g_t, GRAD_ATOL, f"block grad {n}")
        with torch.no_grad():  # no autograd: torch may take its native fast path; still the same numbers
            assert_close(ours(x, pad), theirs(x, pad), OUT_ATOL, "block output without grad")


@pytest.mark.portable
def test_swapping_self_attn_inside_torch_transformer_encoder_layer(device):
    layer = nn.TransformerEncoderLayer(
        12, 4, dim_feedforward=20, dropout=0.0, batch_first=True, dtype=F64, device=device
    )
    randomize_(layer, 15).eval()
    swapped = copy.deepcopy(layer)
    swapped.self_attn = compat.MultiheadAttention(12, 4, batch_first=True, dtype=F64, device=device)
    swapped.self_attn.load_state_dict(layer.self_attn.state_dict())
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(2, 7, 12, generator=gen, dtype=F64).to(device)
    causal = nn.Transformer.generate_square_subsequent_mask(7, dtype=F64, device=device)
    padding = torch.zeros(2, 7, dtype=torch.bool, device=device)
    padding[0, 6] = True
    for kwargs in (dict(), dict(src_mask=causal, is_causal=True), dict(src_key_padding_mask=padding)):
        assert_close(swapped(x, **kwargs), layer(x, **kwargs), OUT_ATOL, f"encoder layer {list(kwargs)}")


# --------------------------------------------------------------------------- converters

CONVERTER_CONFIGS = {
    "classic": dict(),
    "no_bias": dict(bias=False),
    "cross_dims": dict(kdim=7, vdim=9),
    "cross_dims_no_bias": dict(kdim=9, vdim=9, bias=False),
    "seq_first": dict(batch_first=False, kdim=7, vdim=11),
}


@pytest.mark.portable
@pytest.mark.parametrize("name", list(CONVERTER_CONFIGS))
def test_from_torch_matches_torch_on_batch_first_inputs(name, device):
    config = dict(CONVERTER_CONFIGS[name])
    batch_first = config.pop("batch_first", True)
    module = nn.MultiheadAttention(E, 3, batch_first=batch_first, **config, dtype=F64, device=device)
    module = randomize_(module, 16).eval()
    layer = MultiHeadAttention.from_torch(module).eval()
    assert isinstance(layer, MultiHeadAttention) and layer.out_proj.weight.dtype == F64
    assert layer.out_proj.weight.device == device
    gen = torch.Generator().manual_seed(16)
    query = torch.randn(N, L, E, generator=gen, dtype=F64).to(device)  # (N, L, E): the layer is batch first
    key = torch.randn(N, S, module.kdim, generator=gen, dtype=F64).to(device)
    value = torch.randn(N, S, module.vdim, generator=gen, dtype=F64).to(device)
    padding = torch.zeros(N, S, dtype=torch.bool, device=device)
    padding[0, 4:] = padding[2, 1] = True

    def torch_call(q, k, v, **kwargs):
        if batch_first:
            return module(q, k, v, **kwargs)
        out, w = module(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), **kwargs)
        return out.transpose(0, 1), w

    for pad in (None, padding):
        mask = None if pad is None else ~pad[:, None, None, :]  # ours: True = may attend, (N, 1, 1, S)
        out, weights = layer(query, key, value, mask=mask, need_weights=True)
        expected, expected_w = torch_call(query, key, value, key_padding_mask=pad, average_attn_weights=False)
        assert_close(out, expected, OUT_ATOL, "output")
        assert_close(weights, expected_w, OUT_ATOL, "per-head weights")
        _, averaged = layer(query, key, value, mask=mask, need_weights=True, average_weights=True)
        assert_close(averaged, torch_call(query, key, value, key_padding_mask=pad)[1], OUT_ATOL, "averaged")
    if module.kdim == module.vdim == E:  # the layer's fused self-attention path
        assert_close(layer(query)[0], torch_call(query, query, query)[0], OUT_ATOL, "self-attention")


@pytest.mark.portable
@pytest.mark.parametrize("name", list(CONVERTER_CONFIGS))
def test_to_torch_round_trip_gives_back_the_same_state(name, device):
    config = dict(CONVERTER_CONFIGS[name])
    batch_first = config.pop("batch_first", True)
    module = nn.MultiheadAttention(E, 3, dropout=0.25, batch_first=batch_first, **config, dtype=F64, device=device)
    module = randomize_(module, 17)
    back = MultiHeadAttention.from_torch(module).to_torch()
    assert isinstance(back, nn.MultiheadAttention) and back.batch_first
    assert back.out_proj.weight.device == device
    assert (back.embed_dim, back.num_heads, back.kdim, back.vdim, back.dropout) == (
        E,
        3,
        module.kdim,
        module.vdim,
        0.25,
    )
    original, returned = module.state_dict(), back.state_dict()
    assert set(returned) == set(original)
    for key, value in original.items():
        assert returned[key].dtype == F64 and torch.equal(returned[key], value), key
    # and the other way round: layer -> torch -> layer
    layer = MultiHeadAttention(E, 3, **config, dtype=F64, device=device)
    again = to_torch(layer)
    assert all(
        torch.equal(a, b)
        for a, b in zip(layer.state_dict().values(), from_torch(again).state_dict().values(), strict=True)
    )
    assert set(from_torch(again).state_dict()) == set(layer.state_dict())


@pytest.mark.portable
def test_from_torch_accepts_the_compat_module(device):
    _, ours = torch_and_compat(18, E, 3, kdim=7, vdim=9, batch_first=True, device=device)
    layer = from_torch(ours)
    gen = torch.Generator().manual_seed(18)
    q, k, v = (torch.randn(N, n, d, generator=gen, dtype=F64).to(device) for n, d in ((L, E), (S, 7), (S, 9)))
    assert_close(layer(q, k, v)[0], ours(q, k, v)[0], OUT_ATOL, "output")


def _assert_clear_error(excinfo, kind, fragments):
    message = str(excinfo.value)
    assert type(excinfo.value) is {ValueError: ArgumentValueError, TypeError: ArgumentTypeError}[kind], message
    for fragment in ("expected", "got", "Fix:", *fragments):
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("options", [dict(add_bias_kv=True), dict(add_zero_attn=True)], ids=["bias_kv", "zero_attn"])
@pytest.mark.parametrize("cls", [nn.MultiheadAttention, compat.MultiheadAttention], ids=["torch", "compat"])
def test_from_torch_rejects_what_the_layer_cannot_hold(options, cls):
    with pytest.raises(ValueError) as excinfo:
        MultiHeadAttention.from_torch(cls(E, 3, **options))
    _assert_clear_error(excinfo, ValueError, ["module:", next(iter(options))])


def test_from_torch_rejects_a_non_module():
    with pytest.raises(TypeError) as excinfo:
        from_torch(nn.Linear(3, 3))
    _assert_clear_error(excinfo, TypeError, ["module: expected a torch.nn.MultiheadAttention"])


@pytest.mark.parametrize(
    "options,fragment",
    [
        (dict(num_kv_heads=1), "num_kv_heads = 1 != num_heads"),
        (dict(rotary=True), "rotary embedding"),
        (dict(out_dim=7), "out_dim = 7 != embed_dim"),
        (dict(head_dim=5), "head sizes other than embed_dim / num_heads"),
        (dict(value_head_dim=2), "head sizes other than embed_dim / num_heads"),
    ],
    ids=["mqa", "rotary", "out_dim", "head_dim", "value_head_dim"],
)
def test_to_torch_rejects_what_torch_cannot_express(options, fragment):
    layer = MultiHeadAttention(E, 3, **options)  # head dim 4
    with pytest.raises(ValueError) as excinfo:
        layer.to_torch()
    _assert_clear_error(excinfo, ValueError, ["layer: expected a configuration", fragment])


# --------------------------------------------------------------------------- torch's contracts, re-derived


@pytest.mark.portable
def test_3d_attn_mask_equals_each_batch_element_with_its_own_2d_mask(device):
    """A (N * num_heads, L, S) mask built by repeating one (L, S) mask per batch element over the heads
    gives, for element n, exactly what element n alone gives with its (L, S) mask."""
    _, ours = torch_and_compat(30, E, H, batch_first=True, device=device)
    gen = torch.Generator().manual_seed(30)
    query = torch.randn(N, L, E, generator=gen, dtype=F64).to(device)
    key = torch.randn(N, S, E, generator=gen, dtype=F64).to(device)
    for kind in ("bool", "float"):
        masked = torch.rand(N, L, S, generator=gen) < 0.4
        masked[..., 3] = False  # key 3 stays visible: no row is fully masked
        masked = masked.to(device)
        per_element = (
            masked if kind == "bool" else torch.zeros(N, L, S, dtype=F64, device=device).masked_fill(masked, -math.inf)
        )
        stacked = per_element.repeat_interleave(H, dim=0)  # (N * H, L, S), n-major as torch orders it
        out, weights = ours(query, key, key, attn_mask=stacked)
        for n in range(N):
            alone, alone_w = ours(query[n : n + 1], key[n : n + 1], key[n : n + 1], attn_mask=per_element[n])
            assert_close(out[n : n + 1], alone, OUT_ATOL, f"{kind} output of element {n}")
            assert_close(weights[n : n + 1], alone_w, OUT_ATOL, f"{kind} weights of element {n}")
            assert (weights[n][masked[n]] == 0).all()


def test_bias_false_removes_every_bias_like_torch():
    theirs, ours = torch_and_compat(31, E, H, bias=False, kdim=7, vdim=9)
    assert ours.in_proj_bias is None and ours.out_proj.bias is None
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert "in_proj_bias" not in ours.state_dict() and "out_proj.bias" not in ours.state_dict()


@pytest.mark.portable
@pytest.mark.parametrize(
    "dims",
    [dict(kdim=7, vdim=9), dict(kdim=7), dict(vdim=9), dict(kdim=E, vdim=E)],
    ids=["both", "kdim", "vdim", "equal"],
)
def test_kdim_vdim_choose_the_weight_layout_like_torch(dims, device):
    theirs, ours = torch_and_compat(32, E, H, device=device, **dims)
    same = dims.get("kdim", E) == E and dims.get("vdim", E) == E
    assert ours._qkv_same_embed_dim is same is theirs._qkv_same_embed_dim
    assert (ours.kdim, ours.vdim) == (theirs.kdim, theirs.vdim)
    for name, p in theirs.named_parameters():
        assert dict(ours.named_parameters())[name].shape == p.shape, name
    assert (ours.in_proj_weight is None) is (not same)
    gen = torch.Generator().manual_seed(32)
    q = torch.randn(L, N, E, generator=gen, dtype=F64).to(device)
    k = torch.randn(S, N, ours.kdim, generator=gen, dtype=F64).to(device)
    v = torch.randn(S, N, ours.vdim, generator=gen, dtype=F64).to(device)
    assert_close(ours(q, k, v)[0], theirs(q, k, v)[0], OUT_ATOL, "output")


def test_module_looks_like_torchs():
    theirs, ours = torch_and_compat(33, E, H, add_bias_kv=True, kdim=7)
    assert repr(ours) == repr(theirs)
    assert type(ours.out_proj) is type(theirs.out_proj)  # NonDynamicallyQuantizableLinear
    for attribute in (
        "embed_dim",
        "kdim",
        "vdim",
        "num_heads",
        "head_dim",
        "dropout",
        "batch_first",
        "add_zero_attn",
        "_qkv_same_embed_dim",
    ):
        assert getattr(ours, attribute) == getattr(theirs, attribute), attribute


@pytest.mark.portable
@pytest.mark.parametrize("sizes", [(0, N, L), (S, 0, L), (S, N, 0), (0, 0, 0)], ids=["S0", "N0", "L0", "all0"])
@pytest.mark.parametrize(
    "options", [dict(), dict(add_bias_kv=True), dict(add_zero_attn=True)], ids=["plain", "bias_kv", "zero_attn"]
)
def test_empty_sizes_match_torch(sizes, options, device):
    """No keys, no batch or no queries: torch answers (a sum over no keys is 0, so the output is out_proj's
    bias); so does the drop-in, with the same shapes and gradients, instead of an error from its kernels."""
    theirs, ours = torch_and_compat(34, E, H, device=device, **options)
    k_len, batch, q_len = sizes
    gen = torch.Generator().manual_seed(34)
    query = torch.randn(q_len, batch, E, generator=gen, dtype=F64).to(device)
    key = torch.randn(k_len, batch, E, generator=gen, dtype=F64).to(device)
    padding = torch.zeros(batch, k_len, dtype=torch.bool, device=device)
    for kwargs in (dict(), dict(key_padding_mask=padding, average_attn_weights=False), dict(need_weights=False)):
        (out_t, w_t, g_t), (out_o, w_o, g_o) = (run_empty(module, query, key, kwargs) for module in (theirs, ours))
        assert_close(out_o, out_t, OUT_ATOL, f"output {kwargs}")
        assert (w_o is None) == (w_t is None) and (w_o is None or w_o.shape == w_t.shape)
        if w_o is not None:
            assert_close(w_o, w_t, OUT_ATOL, "weights")
        for name in g_t:
            assert_close(g_o[name], g_t[name], GRAD_ATOL, f"grad {name}")


def run_empty(module, query, key, kwargs):
    leaves = [query.clone().requires_grad_(True), key.clone().requires_grad_(True)]
    out, weights = module(leaves[0], leaves[1], leaves[1], **kwargs)
    loss = (out * torch.arange(out.numel(), dtype=F64, device=out.device).view(out.shape)).sum()
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(loss, leaves + list(params.values()), allow_unused=True)
    names = ["query", "key"] + list(params)
    return (
        out,
        weights,
        {
            n: torch.zeros_like(t) if g is None else g
            for n, t, g in zip(names, leaves + list(params.values()), grads, strict=True)
        },
    )


# --------------------------------------------------------------------------- the functional form


FUNCTIONAL_CASES = {
    "packed": dict(),
    "separate": dict(kdim=7, vdim=9),
    "bias_kv": dict(add_bias_kv=True),
    "zero_attn_no_bias": dict(add_zero_attn=True, bias=False),
}


def _functional_args(module, use_static: bool, gen):
    """torch's functional arguments for a module's parameters (and static keys/values when asked)."""
    args = dict(
        embed_dim_to_check=E,
        num_heads=H,
        in_proj_weight=module.in_proj_weight,
        in_proj_bias=module.in_proj_bias,
        bias_k=module.bias_k,
        bias_v=module.bias_v,
        add_zero_attn=module.add_zero_attn,
        dropout_p=0.0,
        out_proj_weight=module.out_proj.weight,
        out_proj_bias=module.out_proj.bias,
        training=False,
    )
    if not module._qkv_same_embed_dim:
        args.update(
            use_separate_proj_weight=True,
            q_proj_weight=module.q_proj_weight,
            k_proj_weight=module.k_proj_weight,
            v_proj_weight=module.v_proj_weight,
        )
    if use_static:
        device = module.out_proj.weight.device
        args.update(
            static_k=torch.randn(N * H, S, E // H, generator=gen, dtype=F64).to(device),
            static_v=torch.randn(N * H, S, E // H, generator=gen, dtype=F64).to(device),
        )
    return args


@pytest.mark.portable
@pytest.mark.filterwarnings(MISMATCHED_MASKS)
@pytest.mark.parametrize("static", [False, True], ids=["projected", "static_kv"])
@pytest.mark.parametrize("name", list(FUNCTIONAL_CASES))
def test_functional_matches_torch_functional(name, static, device):
    options = FUNCTIONAL_CASES[name]
    if static:  # torch refuses static keys/values with bias_k (see the next test); the zero key comes after them
        options = {k: v for k, v in options.items() if k != "add_bias_kv"}
    theirs, _ = torch_and_compat(35, E, H, device=device, **options)
    gen = torch.Generator().manual_seed(35)
    query = torch.randn(L, N, E, generator=gen, dtype=F64).to(device)
    key = torch.randn(S, N, theirs.kdim, generator=gen, dtype=F64).to(device)
    value = torch.randn(S, N, theirs.vdim, generator=gen, dtype=F64).to(device)
    args = _functional_args(theirs, static, gen)
    padding = torch.zeros(N, S, dtype=torch.bool)
    padding[0, 2] = padding[2, 5:] = True
    attn = torch.zeros(L, S, dtype=F64).masked_fill(torch.rand(L, S, generator=gen) < 0.3, -math.inf)
    attn[:, 1] = 0.0  # key 1 visible to every query
    padding[:, 1] = False
    padding, attn = padding.to(device), attn.to(device)
    for kwargs in (
        dict(),
        dict(key_padding_mask=padding, attn_mask=attn, average_attn_weights=False),
        dict(attn_mask=attn, need_weights=False),
    ):
        outs = []
        for fn in (F.multi_head_attention_forward, compat.multi_head_attention_forward):
            leaves = [t.clone().requires_grad_(True) for t in (query, key, value)]
            out, weights = fn(*leaves, **args, **kwargs)
            grads = torch.autograd.grad(
                loss_of(out, weights, 35), leaves + [theirs.out_proj.weight], allow_unused=True
            )  # static keys/values leave key and value unused
            outs.append((out, weights, grads))
        (out_t, w_t, g_t), (out_o, w_o, g_o) = outs
        assert_close(out_o, out_t, OUT_ATOL, f"{name} output {list(kwargs)}")
        assert (w_o is None) == (w_t is None)
        if w_t is not None:
            assert_close(w_o, w_t, OUT_ATOL, "weights")
        assert [g is None for g in g_o] == [g is None for g in g_t] == [False, static, static, False]
        for n, (a, b) in enumerate(zip(g_o, g_t, strict=True)):
            if b is not None:
                assert_close(a, b, GRAD_ATOL, f"grad {n}")


@pytest.mark.portable
def test_functional_refuses_static_kv_with_bias_kv(device):
    theirs, _ = torch_and_compat(36, E, H, add_bias_kv=True, device=device)
    gen = torch.Generator().manual_seed(36)
    x = torch.randn(L, N, E, generator=gen, dtype=F64).to(device)
    args = _functional_args(theirs, True, gen)
    for fn in (F.multi_head_attention_forward, compat.multi_head_attention_forward):
        with pytest.raises(AssertionError, match="bias cannot be added to static key."):
            fn(x, x, x, **args)


# --------------------------------------------------------------------------- nested (jagged) inputs


def _nested(lengths, features, gen, layout=torch.jagged, device="cpu"):
    """A nested (N, *, features) float64 tensor on ``device``, its sequences drawn on the CPU."""
    return torch.nested.nested_tensor(
        [torch.randn(n, features, generator=gen, dtype=F64) for n in lengths], layout=layout, device=device
    )


@pytest.mark.portable
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
@pytest.mark.parametrize(
    "options",
    [dict(), dict(kdim=7, vdim=9, add_bias_kv=True), dict(add_zero_attn=True)],
    ids=["self", "cross_bias_kv", "zero_attn"],
)
def test_nested_inputs_equal_each_sequence_alone(options, layout, device):
    """Nested (N, *, E) inputs: each sequence's output equals that sequence run alone (and torch's result for
    it); the output is nested like the query; the weights come back padded (N, L_max, S_max), 0 past each
    sequence's lengths; gradients reach the nested inputs and equal the per-sequence ones."""
    theirs, ours = torch_and_compat(37, E, H, batch_first=True, device=device, **options)
    gen = torch.Generator().manual_seed(37)
    q_lens, k_lens = [4, 6, 2], [7, 3, 5]
    query = _nested(q_lens, E, gen, layout, device).requires_grad_(True)
    key = _nested(k_lens, ours.kdim, gen, layout, device).requires_grad_(True)
    value = _nested(k_lens, ours.vdim, gen, layout, device).requires_grad_(True)
    out, weights = ours(query, key, value, average_attn_weights=False)
    assert out.is_nested and out.layout == layout
    extra = int(bool(options.get("add_bias_kv"))) + int(bool(options.get("add_zero_attn")))
    assert weights.shape == (3, H, max(q_lens), max(k_lens) + extra)
    flat = torch.cat(out.unbind())  # (sum L, E)
    cotangent = torch.randn(flat.shape, generator=gen, dtype=F64).to(device)
    grads = torch.autograd.grad((flat * cotangent).sum(), [query, key, value])
    offsets = [0, 4, 10, 12]
    for n, (q, k, v) in enumerate(zip(query.unbind(), key.unbind(), value.unbind(), strict=True)):
        leaves = [t.detach().clone().requires_grad_(True)[None] for t in (q, k, v)]  # (1, len, features)
        alone, alone_w = ours(*leaves, average_attn_weights=False)
        expected, _ = theirs(*leaves, average_attn_weights=False)
        assert_close(out.unbind()[n], alone[0], OUT_ATOL, f"sequence {n}")
        assert_close(alone, expected, OUT_ATOL, f"torch on sequence {n}")
        S_n = k_lens[n]
        padded = weights[n, :, : q_lens[n]]  # (H, L_n, S_max + extra)
        real_keys = list(range(S_n)) + list(range(max(k_lens), max(k_lens) + extra))
        assert_close(padded[..., real_keys], alone_w[0], OUT_ATOL, f"weights of sequence {n}")
        assert (weights[n, :, q_lens[n] :] == 0).all() and (padded[..., S_n : max(k_lens)] == 0).all()
        alone_grads = torch.autograd.grad((alone[0] * cotangent[offsets[n] : offsets[n + 1]]).sum(), leaves)
        for g, g_alone, name in zip(grads, alone_grads, ("query", "key", "value"), strict=True):
            assert_close(g.unbind()[n], g_alone[0], GRAD_ATOL, f"grad {name} of sequence {n}")
    with torch.no_grad():
        assert_close(torch.cat(ours(query, key, value)[0].unbind()), flat.detach(), OUT_ATOL, "no_grad")
    with torch.inference_mode():
        assert_close(
            torch.cat(ours(query, key, value, need_weights=False)[0].unbind()),
            flat.detach(),
            OUT_ATOL,
            "inference_mode",
        )


# --------------------------------------------------------------------------- inside torch's transformer modules


def _encoder_layers(seed, device="cpu"):
    """torch's TransformerEncoderLayer (random parameters) and a copy whose self_attn is the drop-in, on ``device``."""
    theirs = nn.TransformerEncoderLayer(E, H, dim_feedforward=20, dropout=0.0, batch_first=True, device=device)
    randomize_(theirs, seed).eval()
    ours = copy.deepcopy(theirs)
    ours.self_attn = compat.MultiheadAttention(E, H, batch_first=True, device=device)
    ours.self_attn.load_state_dict(theirs.self_attn.state_dict())
    return theirs.float(), ours.float()


@pytest.mark.portable
def test_torch_encoder_layer_runs_the_drop_in_even_on_its_fast_path(monkeypatch, device):
    """In eval mode without grad, torch's encoder layer takes a fused fast path (its own kernel, with the
    self_attn's weights) unless a submodule has hooks: the drop-in's no-op pre-hook keeps its forward in
    charge, so a fully padded batch element gives finite numbers where torch's path gives NaN."""
    theirs, ours = _encoder_layers(38, device)
    calls = []
    attend = compat._attend
    monkeypatch.setattr(compat, "_attend", lambda *args, **kwargs: calls.append(1) or attend(*args, **kwargs))
    gen = torch.Generator().manual_seed(38)
    x = torch.randn(N, L, E, generator=gen).to(device)
    padding = torch.zeros(N, L, dtype=torch.bool, device=device)
    padding[0, 3:] = True
    padding[2] = True  # every key of element 2
    with torch.no_grad():
        expected, got = theirs(x, src_key_padding_mask=padding), ours(x, src_key_padding_mask=padding)
    assert calls, "the drop-in's forward was bypassed"
    assert expected[2].isnan().all() and got.isfinite().all()
    torch.testing.assert_close(got[:2], expected[:2], rtol=1e-5, atol=1e-5)


@pytest.mark.portable
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
def test_torch_encoder_stack_with_its_nested_fast_path(device):
    """torch's TransformerEncoder turns padded input into a (strided) nested tensor in eval mode without grad
    and hands it to each layer: the drop-in takes it, and the result equals torch's own fast path."""
    theirs, ours = _encoder_layers(39, device)
    stacks = [nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval() for layer in (theirs, ours)]
    gen = torch.Generator().manual_seed(39)
    x = torch.randn(N, L, E, generator=gen).to(device)
    padding = torch.zeros(N, L, dtype=torch.bool, device=device)
    padding[0, 3:] = padding[1, 4:] = True
    with torch.no_grad():
        expected, got = (stack(x, src_key_padding_mask=padding) for stack in stacks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with_grad = stacks[1](x, src_key_padding_mask=padding)  # the dense path: equal where tokens are real
    torch.testing.assert_close(with_grad[~padding], expected[~padding], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- TorchScript


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_is_refused_with_the_reason_and_the_alternatives():
    """TorchScript cannot compile multihead's kernels (typed masks, backend dispatch, autograd Functions);
    torch.jit.script of the drop-in, or of any module holding it, raises one clear error."""
    encoder = nn.TransformerEncoderLayer(E, H, dim_feedforward=20, batch_first=True)
    encoder.self_attn = compat.MultiheadAttention(E, H, batch_first=True)
    for module in (compat.MultiheadAttention(E, H), encoder):
        with pytest.raises(compat.NotScriptableError) as excinfo:
            torch.jit.script(module)
        message = str(excinfo.value)
        assert MESSAGE_FORM.match(message), message
        for fragment in (
            "torch.jit.script: expected a module TorchScript can compile",
            "torch.compile",
            "torch.export",
            "torch.nn.MultiheadAttention",
        ):
            assert fragment in message
    assert issubclass(compat.NotScriptableError, RuntimeError)
    torch.jit.script(nn.MultiheadAttention(E, H))  # torch's own module still scripts: the refusal is ours alone


# --------------------------------------------------------------------------- bad inputs

MESSAGE_FORM = re.compile(r"^\S.*: expected .+, got .+\. Fix: .+", re.DOTALL)
BOTH_WAYS = {
    compat.ShapeError: (ValueError, AssertionError, RuntimeError),
    compat.CompatValueError: (ValueError, AssertionError, RuntimeError),
    compat.DtypeError: (TypeError, AssertionError, RuntimeError),
    ArgumentValueError: (ValueError,),
    ArgumentTypeError: (TypeError,),
}


@pytest.mark.portable
@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("which", ["in_proj_bias", "bias_k"])
def test_a_bias_of_lower_precision_runs_as_in_torch(which, bias_dtype, device):
    """torch's test_multihead_attn_fast_path_query_and_bias_have_different_dtypes: a double module whose in_proj_bias
    is a half Parameter runs (torch adds it to the batched product, promoting it), as a half bias_k does (appended
    by torch.cat). The drop-in raised DtypeError; it now gives torch's output, weights and gradients."""
    theirs, ours = torch_and_compat(3, E, H, batch_first=True, add_bias_kv=True, device=device)
    for module in (theirs, ours):
        setattr(module, which, nn.Parameter(getattr(module, which).detach().to(bias_dtype)))
    query = torch.randn(N, L, E, dtype=F64, generator=torch.Generator().manual_seed(4)).to(device)
    with torch.no_grad():  # torch's test: eval, no grad (its fast path declines, its slow path runs)
        expected, expected_weights = theirs(query, query, query)
        got, weights = ours(query, query, query)
    assert got.dtype == expected.dtype == F64
    assert_close(got, expected, 1e-12, "output")
    assert_close(weights, expected_weights, 1e-12, "weights")
    for module in (theirs, ours):
        out, _ = module.train()(query, query, query)
        out.sum().backward()
    grad, expected_grad = getattr(ours, which).grad, getattr(theirs, which).grad
    assert grad.dtype == expected_grad.dtype == bias_dtype
    assert_close(grad.double(), expected_grad.double(), 1e-3, f"{which}.grad")


def test_error_classes_are_catchable_the_torch_way_and_ours():
    for cls, bases in BOTH_WAYS.items():
        assert issubclass(cls, InputError) and all(issubclass(cls, base) for base in bases), cls
    assert issubclass(compat.ShapeError, ArgumentValueError) and issubclass(compat.DtypeError, ArgumentTypeError)


def _modules():
    """Fresh modules for the table: seq-first, batch-first, cross-attention (kdim 7, vdim 9), add_bias_kv."""
    return dict(
        seq=compat.MultiheadAttention(E, H),
        bf=compat.MultiheadAttention(E, H, batch_first=True),
        cross=compat.MultiheadAttention(E, H, kdim=7, vdim=9),
        bias_kv=compat.MultiheadAttention(E, H, add_bias_kv=True),
    )


x3, mem3 = torch.randn(L, N, E), torch.randn(S, N, E)  # (L, N, E), (S, N, E)
x2, mem2 = torch.randn(L, E), torch.randn(S, E)  # unbatched


def _jagged(*lengths, features=E):
    return torch.nested.nested_tensor([torch.randn(n, features) for n in lengths], layout=torch.jagged)


def _half_out_bias(m):
    """A half out_proj.bias on a float32 module: torch's output projection (addmm) refuses it, as we do."""
    m.out_proj.bias = nn.Parameter(m.out_proj.bias.detach().half())
    return m


def _functional(module, **overrides):
    args = dict(
        embed_dim_to_check=E,
        num_heads=H,
        in_proj_weight=module.in_proj_weight,
        in_proj_bias=module.in_proj_bias,
        bias_k=module.bias_k,
        bias_v=module.bias_v,
        add_zero_attn=False,
        dropout_p=0.0,
        out_proj_weight=module.out_proj.weight,
        out_proj_bias=module.out_proj.bias,
    )
    args.update(overrides)
    return compat.multi_head_attention_forward(x3, mem3, mem3, **args)


# (id, call on the fresh modules, exact class, message fragments)
BAD_CALLS = [
    # torch's shape table (test_multihead_attn_invalid_shape), with its wording inside ours
    (
        "batched-2d-key",
        lambda m: m["seq"](x3, mem2, mem3),
        compat.ShapeError,
        [
            "key: expected 3-D key and value",
            "expected `key` and `value` to be 3-D but found 2-D and 3-D tensors respectively",
        ],
    ),
    (
        "batched-2d-value",
        lambda m: m["seq"](x3, mem3, mem2),
        compat.ShapeError,
        ["value:", "expected `key` and `value` to be 3-D but found 3-D and 2-D tensors respectively"],
    ),
    (
        "batched-1d-padding",
        lambda m: m["seq"](x3, mem3, mem3, key_padding_mask=torch.zeros(S, dtype=torch.bool)),
        compat.ShapeError,
        [
            "key_padding_mask: expected a 2-D mask (N, S)",
            "expected `key_padding_mask` to be `None` or 2-D but found 1-D tensor instead",
        ],
    ),
    (
        "batched-1d-attn",
        lambda m: m["seq"](x3, mem3, mem3, attn_mask=torch.zeros(S, dtype=torch.bool)),
        compat.ShapeError,
        ["attn_mask:", "expected `attn_mask` to be `None`, 2-D or 3-D but found 1-D tensor instead"],
    ),
    (
        "unbatched-3d-key",
        lambda m: m["seq"](x2, mem3, mem2),
        compat.ShapeError,
        ["key:", "expected `key` and `value` to be 2-D but found 3-D and 2-D tensors respectively"],
    ),
    (
        "unbatched-3d-value",
        lambda m: m["seq"](x2, mem2, mem3),
        compat.ShapeError,
        ["value:", "expected `key` and `value` to be 2-D but found 2-D and 3-D tensors respectively"],
    ),
    (
        "unbatched-2d-padding",
        lambda m: m["seq"](x2, mem2, mem2, key_padding_mask=torch.zeros(1, S, dtype=torch.bool)),
        compat.ShapeError,
        ["key_padding_mask:", "expected `key_padding_mask` to be `None` or 1-D but found 2-D tensor"],
    ),
    (
        "unbatched-1d-attn",
        lambda m: m["seq"](x2, mem2, mem2, attn_mask=torch.zeros(S, dtype=torch.bool)),
        compat.ShapeError,
        ["attn_mask:", "expected `attn_mask` to be `None`, 2-D or 3-D but found 1-D tensor instead"],
    ),
    (
        "unbatched-3d-attn-heads",
        lambda m: m["seq"](x2, mem2, mem2, attn_mask=torch.zeros(H + 1, L, S, dtype=torch.bool)),
        compat.ShapeError,
        [
            "attn_mask: expected shape (L, S) = (5, 7) or (num_heads, L, S) = (4, 5, 7)",
            "Expected `attn_mask` shape to be (4, 5, 7)",
        ],
    ),
    (
        "query-4d",
        lambda m: m["seq"](x3[None], mem3, mem3),
        compat.ShapeError,
        [
            "query: expected an unbatched 2-D (L, E) or batched 3-D tensor",
            "query should be unbatched 2D or batched 3D tensor but received 4-D query tensor",
        ],
    ),
    ("query-1d", lambda m: m["seq"](x2[0], mem2[0], mem2[0]), compat.ShapeError, ["received 1-D query tensor"]),
    # sizes
    (
        "embed-dim",
        lambda m: m["seq"](x3[..., :-1], mem3, mem3),
        compat.ShapeError,
        ["query: expected (L, N, E) with E = embed_dim = 12", "was expecting embedding dimension of 12, but got 11"],
    ),
    (
        "embed-dim-batch-first",
        lambda m: m["bf"](torch.randn(N, L, E - 1), torch.randn(N, S, E), torch.randn(N, S, E)),
        compat.ShapeError,
        ["query: expected (N, L, E) with E = embed_dim = 12"],
    ),
    (
        "kdim",
        lambda m: m["cross"](x3, mem3, torch.randn(S, N, 9)),
        compat.ShapeError,
        ["key: expected last dim kdim = 7"],
    ),
    (
        "vdim",
        lambda m: m["cross"](x3, torch.randn(S, N, 7), mem3),
        compat.ShapeError,
        ["value: expected last dim vdim = 9"],
    ),
    (
        "key-batch",
        lambda m: m["seq"](x3, torch.randn(S, N + 1, E), mem3),
        compat.ShapeError,
        ["key: expected batch size N = 3 (from query) on dim 1"],
    ),
    (
        "key-batch-batch-first",
        lambda m: m["bf"](torch.randn(N, L, E), torch.randn(N + 1, S, E), torch.randn(N, S, E)),
        compat.ShapeError,
        ["key: expected batch size N = 3 (from query) on dim 0"],
    ),
    (
        "value-length",
        lambda m: m["seq"](x3, mem3, mem3[:-1]),
        compat.ShapeError,
        [
            "value: expected length S = 7 (from key), got 6",
            "key shape (7, 3, 12) does not match value shape (6, 3, 12)",
        ],
    ),
    (
        "padding-shape",
        lambda m: m["seq"](x3, mem3, mem3, key_padding_mask=torch.zeros(S, N, dtype=torch.bool)),
        compat.ShapeError,
        [
            "key_padding_mask: expected shape (N, S) = (3, 7)",
            "expecting key_padding_mask shape of (3, 7), but got torch.Size([7, 3])",
        ],
    ),
    (
        "attn-2d-shape",
        lambda m: m["seq"](x3, mem3, mem3, attn_mask=torch.zeros(L, L, dtype=torch.bool)),
        compat.ShapeError,
        [
            "attn_mask: expected shape (L, S) = (5, 7) or (N * num_heads, L, S) = (12, 5, 7)",
            "The shape of the 2D attn_mask is torch.Size([5, 5]), but should be (5, 7).",
        ],
    ),
    (
        "attn-3d-shape",
        lambda m: m["seq"](x3, mem3, mem3, attn_mask=torch.zeros(N, L, S, dtype=torch.bool)),
        compat.ShapeError,
        ["The shape of the 3D attn_mask is torch.Size([3, 5, 7]), but should be (12, 5, 7)."],
    ),
    # dtypes
    (
        "attn-long",
        lambda m: m["seq"](x3, mem3, mem3, attn_mask=torch.zeros(L, S, dtype=torch.long)),
        compat.DtypeError,
        [
            "attn_mask: expected a bool (True = masked out) or floating (added) tensor",
            "only bool and floating types of attn_mask are supported",
        ],
    ),
    (
        "padding-int",
        lambda m: m["seq"](x3, mem3, mem3, key_padding_mask=torch.zeros(N, S, dtype=torch.int32)),
        compat.DtypeError,
        ["only bool and floating types of key_padding_mask are supported"],
    ),
    (
        "query-float64",
        lambda m: m["seq"](x3.double(), mem3.double(), mem3.double()),
        compat.DtypeError,
        ["query: expected dtype torch.float32 (the dtype of the parameters)"],
    ),
    (
        "key-float64",
        lambda m: m["seq"](x3, mem3.double(), mem3),
        compat.DtypeError,
        ["key: expected dtype torch.float32 (the dtype of the query)"],
    ),
    (
        "query-int",
        lambda m: m["seq"](x3.long(), mem3.long(), mem3.long()),
        compat.DtypeError,
        ["query: expected a floating dtype"],
    ),
    (
        "query-complex",
        lambda m: m["seq"](x3.cfloat(), mem3.cfloat(), mem3.cfloat()),
        compat.DtypeError,
        ["query: expected a floating dtype"],
    ),
    (
        "parameter-dtype",
        lambda m: _half_out_bias(m["bf"])(x3, x3, x3),
        compat.DtypeError,
        ["out_proj.bias: expected dtype torch.float32 (the dtype of out_proj.weight), got torch.float16"],
    ),
    (
        "weights-too-big",
        lambda m: m["seq"](*[torch.zeros(1, 1, E).expand(2**20, 1, E)] * 3),
        ArgumentValueError,
        ["need_weights: expected the attention weights to fit", "pass need_weights=False"],
    ),
    (
        "projection-too-big",
        lambda m: m["seq"](*[torch.zeros(1, 1, E).expand(1, 2**40, E)] * 3, need_weights=False),
        ArgumentValueError,
        ["query: expected its projection to fit"],
    ),
    # flags and types
    (
        "need-weights-str",
        lambda m: m["seq"](x3, mem3, mem3, need_weights="no"),
        ArgumentTypeError,
        ["need_weights: expected True or False, got str 'no'"],
    ),
    (
        "average-int",
        lambda m: m["seq"](x3, mem3, mem3, average_attn_weights=1),
        ArgumentTypeError,
        ["average_attn_weights: expected True or False"],
    ),
    (
        "is-causal-str",
        lambda m: m["seq"](x3, mem3, mem3, is_causal="yes"),
        ArgumentTypeError,
        ["is_causal: expected True or False"],
    ),
    (
        "is-causal-alone",
        lambda m: m["seq"](x3, x3, x3, is_causal=True),
        compat.CompatValueError,
        [
            "attn_mask: expected a causal attn_mask when is_causal=True",
            "Need attn_mask if specifying the is_causal hint",
        ],
    ),
    ("query-list", lambda m: m["seq"](x3.tolist(), mem3, mem3), ArgumentTypeError, ["query: expected a torch.Tensor"]),
    (
        "attn-list",
        lambda m: m["seq"](x3, mem3, mem3, attn_mask=[[True]]),
        ArgumentTypeError,
        ["attn_mask: expected None or a tensor"],
    ),
    # nested tensors
    (
        "nested-dense-key",
        lambda m: m["bf"](_jagged(3, 4), torch.randn(2, 5, E), _jagged(5, 5)),
        compat.CompatValueError,
        ["key: expected a nested tensor (N, *, features) of the query's layout"],
    ),
    (
        "dense-nested-key",
        lambda m: m["bf"](torch.randn(2, 5, E), _jagged(5, 5), _jagged(5, 5)),
        compat.CompatValueError,
        ["key: expected a dense tensor like the others (or all three nested)"],
    ),
    (
        "nested-seq-first",
        lambda m: m["seq"](_jagged(3, 4), _jagged(3, 4), _jagged(3, 4)),
        compat.CompatValueError,
        ["query: expected batch_first=True for nested tensors"],
    ),
    (
        "nested-padding",
        lambda m: m["bf"](
            _jagged(3, 4), _jagged(3, 4), _jagged(3, 4), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)
        ),
        compat.CompatValueError,
        ["key_padding_mask: expected None with nested inputs"],
    ),
    (
        "nested-mixed-layouts",
        lambda m: m["bf"](_jagged(3, 4), *[torch.nested.nested_tensor([torch.randn(3, E), torch.randn(4, E)])] * 2),
        compat.CompatValueError,
        ["key: expected a nested tensor (N, *, features) of the query's layout (torch.jagged)"],
    ),
    (
        "nested-empty",
        lambda m: m["bf"](*[torch.nested.nested_tensor([])] * 3),
        compat.ShapeError,
        ["query should be unbatched 2D or batched 3D tensor but received 1-D query tensor"],
    ),
    (
        "nested-lengths",
        lambda m: m["bf"](_jagged(3, 4), _jagged(5, 2), _jagged(5, 3)),
        compat.ShapeError,
        ["value: expected the key's length in every sequence ([5, 2]), got [5, 3]"],
    ),
    # the constructor
    (
        "kdim-negative",
        lambda m: compat.MultiheadAttention(E, H, kdim=-1),
        ArgumentValueError,
        ["kdim: expected a positive int, got -1"],
    ),
    (
        "kdim-str",
        lambda m: compat.MultiheadAttention(E, H, kdim="4"),
        ArgumentTypeError,
        ["kdim: expected a positive int, got str '4'"],
    ),
    (
        "vdim-zero",
        lambda m: compat.MultiheadAttention(E, H, vdim=0),
        ArgumentValueError,
        ["vdim: expected a positive int"],
    ),
    (
        "embed-zero",
        lambda m: compat.MultiheadAttention(0, H),
        ArgumentValueError,
        ["embed_dim: expected a positive int"],
    ),
    (
        "heads-float",
        lambda m: compat.MultiheadAttention(E, 2.0),
        ArgumentTypeError,
        ["num_heads: expected a positive int"],
    ),
    (
        "not-divisible",
        lambda m: compat.MultiheadAttention(10, 4),
        compat.ShapeError,
        ["num_heads: expected a divisor of embed_dim = 10", "embed_dim must be divisible by num_heads"],
    ),
    (
        "dropout-one",
        lambda m: compat.MultiheadAttention(E, H, dropout=1.0),
        ArgumentValueError,
        ["dropout: expected a probability in [0, 1)"],
    ),
    ("dropout-str", lambda m: compat.MultiheadAttention(E, H, dropout="0.1"), ArgumentTypeError, ["dropout:"]),
    (
        "bias-str",
        lambda m: compat.MultiheadAttention(E, H, bias="yes"),
        ArgumentTypeError,
        ["bias: expected True or False"],
    ),
    ("batch-first-int", lambda m: compat.MultiheadAttention(E, H, batch_first=1), ArgumentTypeError, ["batch_first:"]),
    (
        "device-nope",
        lambda m: compat.MultiheadAttention(E, H, device="nope"),
        ArgumentValueError,
        ["device: expected a device this torch can use"],
    ),
    (
        "dtype-int64",
        lambda m: compat.MultiheadAttention(E, H, dtype=torch.int64),
        ArgumentValueError,
        ["dtype: expected a real floating dtype"],
    ),
    (
        "dtype-complex",
        lambda m: compat.MultiheadAttention(E, H, dtype=torch.complex64),
        ArgumentValueError,
        ["dtype: expected a real floating dtype"],
    ),
    (
        "dtype-str",
        lambda m: compat.MultiheadAttention(E, H, dtype="float32"),
        ArgumentTypeError,
        ["dtype: expected a torch.dtype"],
    ),
    (
        "too-big",
        lambda m: compat.MultiheadAttention(2**40, 1),
        ArgumentValueError,
        ["embed_dim: expected the projection weights to fit"],
    ),
    (
        "to-torch-str",
        lambda m: to_torch("x"),
        ArgumentTypeError,
        ["layer: expected a multihead.MultiHeadAttention, got str 'x'"],
    ),
    # the functional form
    (
        "static-with-bias-kv",
        lambda m: _functional(m["bias_kv"], static_k=torch.randn(N * H, S, E // H)),
        compat.CompatValueError,
        ["static_k: expected None when bias_k / bias_v are added", "bias cannot be added to static key."],
    ),
    (
        "static-size",
        lambda m: _functional(m["seq"], static_k=torch.randn(N * H + 1, S, E // H)),
        compat.ShapeError,
        [
            "static_k: expected (N * num_heads, S, head_dim) = (12, S, 3)",
            "expecting static_k.size(0) of 12, but got 13",
        ],
    ),
    (
        "separate-missing",
        lambda m: _functional(m["seq"], use_separate_proj_weight=True),
        ArgumentTypeError,
        ["q_proj_weight: expected a tensor (12, 12)"],
    ),
    (
        "bias-k-alone",
        lambda m: _functional(m["bias_kv"], bias_v=None),
        compat.CompatValueError,
        ["bias_v: expected a tensor (1, 1, E)", "bias_k is set but bias_v is None"],
    ),
    (
        "in-proj-shape",
        lambda m: _functional(m["seq"], in_proj_weight=torch.randn(E, E)),
        compat.ShapeError,
        ["in_proj_weight: expected shape (36, 12), got shape (12, 12)"],
    ),
]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
@pytest.mark.parametrize("call,kind,fragments", [row[1:] for row in BAD_CALLS], ids=[row[0] for row in BAD_CALLS])
def test_bad_input_raises_clearly_in_the_callers_terms(call, kind, fragments):
    modules = _modules()
    before = {name: copy.deepcopy(m.state_dict()) for name, m in modules.items()}
    with pytest.raises(Exception) as excinfo:
        call(modules)
    error = excinfo.value
    assert type(error) is kind, f"{type(error).__name__}: {error}"
    assert all(isinstance(error, base) for base in BOTH_WAYS[kind]), type(error).__mro__
    message = str(error)
    assert MESSAGE_FORM.match(message), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert "return_weights" not in message and "(b, h, i" not in message and "(b, g, j" not in message
    for name, m in modules.items():  # a failed call changes nothing
        if name == "bf" and "in_proj_bias" in message:
            continue  # that row swapped the parameter itself before calling
        state = m.state_dict()
        assert list(state) == list(before[name]) and all(torch.equal(state[k], before[name][k]) for k in state)
