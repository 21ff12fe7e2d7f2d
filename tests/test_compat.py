"""multihead.compat.MultiheadAttention against torch.nn.MultiheadAttention itself, and the weight converters.

The oracle here is torch's own module, built in float64 with random (non-zero) parameters whose
state_dict is loaded unchanged into the drop-in. A seeded grid covers every constructor option and
every forward argument; fully masked rows (the one intended difference: 0 where torch gives NaN),
dropout, a swap inside user modules, from_torch/to_torch and a table of bad inputs are tested apart.

Sizes are pairwise distinct within a case (batch N, query length L, key length S, heads, head dim,
embed_dim, kdim, vdim) so that a swapped axis cannot pass.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, fields

import pytest
import torch

from conftest import is_input_error
import torch.nn.functional as F
from torch import nn

from multihead import MultiHeadAttention, compat
from multihead.compat import from_torch, to_torch

F64 = torch.float64
OUT_ATOL = 1e-12  # outputs and weights, float64
GRAD_ATOL = 1e-10  # gradients, float64
# torch warns (and then converts) when key_padding_mask and attn_mask have different dtypes; the grid does that
MISMATCHED_MASKS = "ignore:Support for mismatched key_padding_mask and attn_mask:UserWarning"


def randomize_(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter (biases, bias_k/bias_v included) drawn at random: zero biases would test nothing."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=gen, dtype=F64))
    return module


def torch_and_compat(seed: int, *args, **kwargs) -> tuple[nn.MultiheadAttention, compat.MultiheadAttention]:
    """torch's module (random float64 parameters) and the drop-in holding its state_dict, both in eval mode."""
    theirs = randomize_(nn.MultiheadAttention(*args, **kwargs, dtype=F64), seed)
    ours = compat.MultiheadAttention(*args, **kwargs, dtype=F64)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    report = ours.load_state_dict(theirs.state_dict())
    assert not report.missing_keys and not report.unexpected_keys, report
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    return theirs.eval(), ours.eval()


def loss_of(out: torch.Tensor, weights: torch.Tensor | None, seed: int) -> torch.Tensor:
    """A random linear function of the output (and of the weights when returned)."""
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=F64)).sum()
    if weights is not None:
        loss = loss + (weights * torch.randn(weights.shape, generator=gen, dtype=F64)).sum()
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
        parts = [f"c{self.index:02d}", f"E{self.embed_dim}h{self.num_heads}",
                 "bf" if self.batch_first else "sf", f"N{self.batch}" if self.batched else "unbatched",
                 "self" if self.self_attention else "cross", f"L{self.q_len}S{self.k_len}"]
        parts += [name for name, on in (("nobias", not self.bias), ("biaskv", self.add_bias_kv),
                                         ("zeroattn", self.add_zero_attn)) if on]
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
        cases.append(Case(
            index=index, embed_dim=embed_dim, num_heads=num_heads, bias=rng.random() < 0.7,
            add_bias_kv=rng.random() < 0.3, add_zero_attn=rng.random() < 0.3, kdim=kdim, vdim=vdim,
            batch_first=rng.random() < 0.5, batched=batched, self_attention=self_attention, batch=batch,
            q_len=q_len, k_len=k_len, key_padding=rng.choice(PADDING_KINDS), attn=attn,
            is_causal=attn.startswith("causal") and rng.random() < 0.75, need_weights=rng.random() < 0.7,
            average=rng.random() < 0.5))
    return cases


CASES = make_cases()


def case_masks(case: Case, gen: torch.Generator) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(key_padding_mask, attn_mask) in torch's convention (bool True = masked out, float added).

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
    key_padding = {"none": None, "bool": lambda: bool_mask(*padding_shape),
                   "float": lambda: float_mask(*padding_shape)}[case.key_padding]
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
    return key_padding, attn_mask


def case_inputs(case: Case, gen: torch.Generator) -> list[torch.Tensor]:
    """The distinct leaf tensors: [x] for self-attention, [query, key, value] otherwise."""
    def seq(length, features):
        if not case.batched:
            shape = (length, features)
        elif case.batch_first:
            shape = (case.batch, length, features)
        else:
            shape = (length, case.batch, features)
        return torch.randn(shape, generator=gen, dtype=F64)

    if case.self_attention:
        return [seq(case.q_len, case.embed_dim)]
    return [seq(case.q_len, case.embed_dim), seq(case.k_len, case.key_dim), seq(case.k_len, case.value_dim)]


def torch_drops_the_extra_keys(case: Case) -> bool:
    """torch quirk: with is_causal=True, need_weights=False and no key_padding_mask, torch drops attn_mask
    and asks SDPA for a top-left causal mask over the keys *after* appending bias_k / the zero key, so
    earlier queries no longer see those keys, and torch's output then depends on need_weights. The
    drop-in honours attn_mask (torch's need_weights=True result); torch is then asked with is_causal=False."""
    return case.is_causal and not case.need_weights and case.key_padding == "none" and (
        case.add_bias_kv or case.add_zero_attn)


def run_case(module: nn.Module, case: Case, inputs: list[torch.Tensor], key_padding, attn_mask, is_causal):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    qkv = leaves * 3 if case.self_attention else leaves  # self-attention: the same tensor three times
    out, weights = module(*qkv, key_padding_mask=key_padding, need_weights=case.need_weights, attn_mask=attn_mask,
                          average_attn_weights=case.average, is_causal=is_causal)
    grads = torch.autograd.grad(loss_of(out, weights, seed=case.index),
                                leaves + [p for _, p in module.named_parameters()])
    names = [f"input{n}" for n in range(len(leaves))] + [name for name, _ in module.named_parameters()]
    return out, weights, dict(zip(names, grads))


def test_grid_covers_every_option():
    seen = {f.name: {getattr(c, f.name) for c in CASES} for f in fields(Case)}
    for name in ("bias", "add_bias_kv", "add_zero_attn", "batch_first", "batched", "self_attention", "is_causal",
                 "need_weights", "average"):
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


@pytest.mark.filterwarnings(MISMATCHED_MASKS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_torch_forward_and_backward(case: Case):
    theirs, ours = torch_and_compat(case.index, case.embed_dim, case.num_heads, dropout=0.0, bias=case.bias,
                                    add_bias_kv=case.add_bias_kv, add_zero_attn=case.add_zero_attn, kdim=case.kdim,
                                    vdim=case.vdim, batch_first=case.batch_first)
    gen = torch.Generator().manual_seed(10_000 + case.index)
    inputs = case_inputs(case, gen)
    key_padding, attn_mask = case_masks(case, gen)

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


def _qkv(seed, *, batch=N, q_len=L, k_len=S):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(length, batch, E, generator=gen, dtype=F64) for length in (q_len, k_len, k_len)]


def _cotangents(seed, out_shape, weights_shape):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out_shape, generator=gen, dtype=F64),
            torch.randn(weights_shape, generator=gen, dtype=F64))


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
    return out, weights, dict(zip(names, grads))


@pytest.mark.parametrize("padding_dtype", [torch.bool, F64], ids=["bool", "float-inf"])
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "noweights"])
def test_padding_every_key_of_a_batch_element(padding_dtype, need_weights):
    """Batch element 1 has every key padded: torch gives NaN; ours gives out_proj(0) = out_proj.bias,
    weights 0 and gradient 0 there, and elsewhere exactly what torch computes without that element."""
    theirs, ours = _fully_masked_pair()
    qkv = _qkv(1)
    padded = torch.zeros(N, S, dtype=torch.bool)
    padded[0, 2] = padded[2, 4:] = True
    padded[1] = True  # every key of batch element 1
    key_padding = padded if padding_dtype == torch.bool else torch.zeros(N, S, dtype=F64).masked_fill(padded,
                                                                                                      -math.inf)
    kwargs = dict(key_padding_mask=key_padding, need_weights=need_weights, average_attn_weights=False)
    torch_out, _ = theirs(*qkv, **kwargs)
    assert not torch_out[:, [0, 2]].isnan().any()

    cot = _cotangents(3, (L, N, E), (N, H, L, S))
    out, weights, grads = _forward_and_grads(ours, qkv, cot, **kwargs)
    assert out.isfinite().all()
    if need_weights:  # torch's explicit-softmax path: NaN
        assert torch_out[:, 1].isnan().all()
    else:  # torch's SDPA path (need_weights=False) already gives out_proj(0) here: the same as ours
        assert_close(out, torch_out, OUT_ATOL, "output, torch's SDPA path")
    assert_close(out[:, 1], ours.out_proj.bias.expand(L, E), OUT_ATOL, "fully masked rows = out_proj(0)")
    keep = [0, 2]
    sub = dict(kwargs, key_padding_mask=key_padding[keep])
    expected, expected_w, expected_grads = _forward_and_grads(theirs, [t[:, keep] for t in qkv],
                                                              (cot[0][:, keep], cot[1][keep]), **sub)
    assert_close(out[:, keep], expected, OUT_ATOL, "output of the other batch elements")
    if need_weights:
        assert weights.isfinite().all()
        assert_close(weights[1], torch.zeros(H, L, S, dtype=F64), 0.0, "weights of the fully masked rows")
        assert_close(weights[keep], expected_w, OUT_ATOL, "weights of the other batch elements")
    for name in ("query", "key", "value"):
        assert grads[name].isfinite().all(), name
        assert_close(grads[name][:, 1], torch.zeros(grads[name][:, 1].shape, dtype=F64), 0.0, f"grad {name} at 1")
        assert_close(grads[name][:, keep], expected_grads[name], GRAD_ATOL, f"grad {name}")
    # the parameters see the other elements' gradient, plus d loss / d out_proj.bias from the masked rows
    masked_rows_cotangent = cot[0][:, 1].sum(0)  # (E,): d loss / d out_proj.bias from batch element 1
    for name, _ in ours.named_parameters():
        assert grads[name].isfinite().all(), name
        want = expected_grads[name] + (masked_rows_cotangent if name == "out_proj.bias" else 0)
        assert_close(grads[name], want, GRAD_ATOL, f"grad {name}")


@pytest.mark.parametrize("mask_dtype", [torch.bool, F64], ids=["bool", "float-inf"])
@pytest.mark.parametrize("average", [True, False], ids=["avg", "perhead"])
def test_attn_mask_row_with_every_key_masked(mask_dtype, average):
    """Query 2 may attend no key: out_proj.bias and weights 0 there for every batch element; the other
    queries equal torch run on them alone."""
    theirs, ours = _fully_masked_pair(seed=8, batch_first=True)
    qkv = [t.transpose(0, 1).contiguous() for t in _qkv(2)]  # (N, seq, E)
    masked = torch.zeros(L, S, dtype=torch.bool)
    masked[0, :3] = masked[4, 5] = True
    masked[2] = True
    attn_mask = masked if mask_dtype == torch.bool else torch.zeros(L, S, dtype=F64).masked_fill(masked, -math.inf)
    kwargs = dict(attn_mask=attn_mask, average_attn_weights=average)
    assert theirs(*qkv, **kwargs)[0][:, 2].isnan().all()

    cot = _cotangents(3, (N, L, E), (N, L, S) if average else (N, H, L, S))
    out, weights, grads = _forward_and_grads(ours, qkv, cot, **kwargs)
    assert out.isfinite().all() and weights.isfinite().all()
    assert_close(out[:, 2], ours.out_proj.bias.expand(N, E), OUT_ATOL, "fully masked rows = out_proj(0)")
    assert (weights[..., 2, :] == 0).all()
    rows = [0, 1, 3, 4]
    sub = dict(kwargs, attn_mask=attn_mask[rows])
    expected, expected_w, expected_grads = _forward_and_grads(theirs, [qkv[0][:, rows], qkv[1], qkv[2]],
                                                              (cot[0][:, rows], cot[1][..., rows, :]), **sub)
    assert_close(out[:, rows], expected, OUT_ATOL, "output of the other rows")
    assert_close(weights[..., rows, :], expected_w, OUT_ATOL, "weights of the other rows")
    assert_close(grads["query"][:, 2], torch.zeros(N, E, dtype=F64), 0.0, "grad query at the masked row")
    assert_close(grads["query"][:, rows], expected_grads["query"], GRAD_ATOL, "grad query")
    masked_rows_cotangent = cot[0][:, 2].sum(0)  # (E,): d loss / d out_proj.bias from query 2
    for name in ["key", "value"] + [n for n, _ in ours.named_parameters()]:
        assert grads[name].isfinite().all(), name
        want = expected_grads[name] + (masked_rows_cotangent if name == "out_proj.bias" else 0)
        assert_close(grads[name], want, GRAD_ATOL, f"grad {name}")


def test_one_head_fully_masked_through_a_3d_attn_mask():
    """A (N * num_heads, L, S) mask that masks every key of one (batch, head, query): that head
    contributes 0 before out_proj; torch's whole output row is NaN. Ours equals the head-by-head
    formula from torch's per-head weights with the NaN head taken as 0."""
    theirs, ours = _fully_masked_pair(seed=9)
    query, key, value = _qkv(4)
    masked = torch.zeros(N * H, L, S, dtype=torch.bool)
    masked[1 * H + 2, 3] = True  # batch element 1, head 2, query 3: every key
    masked[0, 1, :4] = True
    out, weights, grads = _forward_and_grads(ours, [query, key, value], _cotangents(3, (L, N, E), (N, H, L, S)),
                                             attn_mask=masked,
                                             average_attn_weights=False)
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


def test_unbatched_fully_masked_padding():
    theirs, ours = _fully_masked_pair(seed=10)
    query, key, value = (t[:, 0] for t in _qkv(5))  # (seq, E)
    key_padding = torch.ones(S, dtype=torch.bool)
    assert theirs(query, key, value, key_padding_mask=key_padding)[0].isnan().all()
    out, weights, grads = _forward_and_grads(ours, [query, key, value], _cotangents(3, (L, E), (L, S)),
                                             key_padding_mask=key_padding)
    assert_close(out, ours.out_proj.bias.expand(L, E), OUT_ATOL, "out_proj(0)")
    assert (weights == 0).all() and weights.shape == (L, S)
    for name, grad in grads.items():
        assert grad.isfinite().all(), name
        if name in ("query", "key", "value"):
            assert (grad == 0).all(), name


def test_bias_kv_and_zero_attn_rescue_fully_padded_rows_like_torch():
    """With add_bias_kv / add_zero_attn the extra key is never padded, so no row is empty: torch is finite."""
    for kwargs in (dict(add_bias_kv=True), dict(add_zero_attn=True)):
        theirs, ours = _fully_masked_pair(seed=11, **kwargs)
        qkv = _qkv(6)
        key_padding = torch.zeros(N, S, dtype=torch.bool)
        key_padding[2] = True
        expected, expected_w = theirs(*qkv, key_padding_mask=key_padding)
        assert expected.isfinite().all()
        out, weights = ours(*qkv, key_padding_mask=key_padding)
        assert_close(out, expected, OUT_ATOL, f"output {kwargs}")
        assert_close(weights, expected_w, OUT_ATOL, f"weights {kwargs}")


@pytest.mark.parametrize("options", [dict(add_bias_kv=True), dict(add_zero_attn=True)], ids=["bias_kv", "zero_attn"])
def test_is_causal_hint_never_drops_the_extra_keys(options):
    """is_causal=True with a causal attn_mask: the output does not depend on need_weights, and equals torch's
    result where torch honours the mask (need_weights=True). torch's need_weights=False path drops the mask,
    so its extra bias_k / zero key is hidden from earlier queries (see torch_drops_the_extra_keys)."""
    theirs, ours = torch_and_compat(19, E, H, batch_first=True, **options)
    x = _qkv(19, batch=2, q_len=L, k_len=L)[0].transpose(0, 1)  # (2, L, E)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    with torch.no_grad():
        expected, _ = theirs(x, x, x, attn_mask=causal, is_causal=True, need_weights=True)
        for need_weights in (True, False):
            out, _ = ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)
            assert_close(out, expected, OUT_ATOL, f"need_weights={need_weights}")


# --------------------------------------------------------------------------- dropout


def test_dropout_train_versus_eval():
    p = 0.4
    theirs, ours = torch_and_compat(12, E, 3, dropout=p, kdim=7, vdim=9)
    gen = torch.Generator().manual_seed(12)
    query = torch.randn(L, N, E, generator=gen, dtype=F64)
    key, value = torch.randn(S, N, 7, generator=gen, dtype=F64), torch.randn(S, N, 9, generator=gen, dtype=F64)
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
        assert not torch.allclose(weights.sum(-1), torch.ones(N, 3, L, dtype=F64)), name
        # ... each is 0 or the eval weight / (1 - p) ...
        scaled = eval_w / (1 - p)
        assert ((weights == 0) | ((weights - scaled).abs() <= 1e-12)).all(), name
        assert (weights == 0).any() and (weights != 0).any(), name
        # ... and the output is out_proj(weights @ V W^V), computed from them (both modules hold these weights)
        v = F.linear(value, ours.v_proj_weight, ours.in_proj_bias.chunk(3)[2]).view(S, N, 3, E // 3).permute(1, 2, 0, 3)
        heads = (weights @ v).permute(2, 0, 1, 3).reshape(L, N, E)  # (L, N, E)
        assert_close(first, ours.out_proj(heads), OUT_ATOL, f"{name}: output from the returned weights")
        module.eval()


def test_dropout_weights_average_to_the_eval_weights():
    """Over many independent draws (one batch of copies), the mean post-dropout weight approaches the eval
    weight: each is w / (1 - p) with probability 1 - p, so the mean of n has std w sqrt(p / ((1 - p) n))."""
    p, copies = 0.3, 4000
    theirs, ours = torch_and_compat(13, E, 3, dropout=p, batch_first=True)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, L, E, generator=gen, dtype=F64)
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

    def __init__(self, mha_cls, embed_dim: int = 12, num_heads: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(embed_dim, dtype=F64)
        self.attn = mha_cls(embed_dim, num_heads, batch_first=True, dtype=F64)
        self.ff = nn.Sequential(nn.Linear(embed_dim, 20, dtype=F64), nn.GELU(), nn.Linear(20, embed_dim, dtype=F64))

    def forward(self, x, padding=None):
        h = self.norm(x)
        a, _ = self.attn(h, h, h, key_padding_mask=padding, need_weights=False)
        x = x + a
        return x + self.ff(x)


def test_swapping_the_class_in_a_user_module():
    theirs = randomize_(TinyBlock(nn.MultiheadAttention), 14).eval()
    ours = TinyBlock(compat.MultiheadAttention).eval()
    report = ours.load_state_dict(theirs.state_dict())
    assert not report.missing_keys and not report.unexpected_keys
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(3, 7, 12, generator=gen, dtype=F64)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, 5:] = padding[2, 0] = True
    for pad in (None, padding):
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        outs = [m(xi, pad) for m, xi in zip((theirs, ours), xs)]
        assert_close(outs[1], outs[0], OUT_ATOL, "block output")
        grads = [torch.autograd.grad(loss_of(o, None, 5), [xi] + list(m.parameters()))
                 for o, xi, m in zip(outs, xs, (theirs, ours))]
        for n, (g_o, g_t) in enumerate(zip(grads[1], grads[0])):
            assert_close(g_o, g_t, GRAD_ATOL, f"block grad {n}")
        with torch.no_grad():  # no autograd: torch may take its native fast path; still the same numbers
            assert_close(ours(x, pad), theirs(x, pad), OUT_ATOL, "block output without grad")


def test_swapping_self_attn_inside_torch_transformer_encoder_layer():
    layer = nn.TransformerEncoderLayer(12, 4, dim_feedforward=20, dropout=0.0, batch_first=True, dtype=F64)
    randomize_(layer, 15).eval()
    swapped = copy.deepcopy(layer)
    swapped.self_attn = compat.MultiheadAttention(12, 4, batch_first=True, dtype=F64)
    swapped.self_attn.load_state_dict(layer.self_attn.state_dict())
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(2, 7, 12, generator=gen, dtype=F64)
    causal = nn.Transformer.generate_square_subsequent_mask(7, dtype=F64)
    padding = torch.zeros(2, 7, dtype=torch.bool)
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


@pytest.mark.parametrize("name", list(CONVERTER_CONFIGS))
def test_from_torch_matches_torch_on_batch_first_inputs(name):
    config = dict(CONVERTER_CONFIGS[name])
    batch_first = config.pop("batch_first", True)
    module = randomize_(nn.MultiheadAttention(E, 3, batch_first=batch_first, **config, dtype=F64), 16).eval()
    layer = MultiHeadAttention.from_torch(module).eval()
    assert isinstance(layer, MultiHeadAttention) and layer.out_proj.weight.dtype == F64
    gen = torch.Generator().manual_seed(16)
    query = torch.randn(N, L, E, generator=gen, dtype=F64)  # (N, L, E): the layer is batch first
    key = torch.randn(N, S, module.kdim, generator=gen, dtype=F64)
    value = torch.randn(N, S, module.vdim, generator=gen, dtype=F64)
    padding = torch.zeros(N, S, dtype=torch.bool)
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


@pytest.mark.parametrize("name", list(CONVERTER_CONFIGS))
def test_to_torch_round_trip_gives_back_the_same_state(name):
    config = dict(CONVERTER_CONFIGS[name])
    batch_first = config.pop("batch_first", True)
    module = randomize_(nn.MultiheadAttention(E, 3, dropout=0.25, batch_first=batch_first, **config, dtype=F64), 17)
    back = MultiHeadAttention.from_torch(module).to_torch()
    assert isinstance(back, nn.MultiheadAttention) and back.batch_first
    assert (back.embed_dim, back.num_heads, back.kdim, back.vdim, back.dropout) == (E, 3, module.kdim,
                                                                                      module.vdim, 0.25)
    original, returned = module.state_dict(), back.state_dict()
    assert set(returned) == set(original)
    for key, value in original.items():
        assert returned[key].dtype == F64 and torch.equal(returned[key], value), key
    # and the other way round: layer -> torch -> layer
    layer = MultiHeadAttention(E, 3, **config, dtype=F64)
    again = to_torch(layer)
    assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(),
                                                  from_torch(again).state_dict().values()))
    assert set(from_torch(again).state_dict()) == set(layer.state_dict())


def test_from_torch_accepts_the_compat_module():
    _, ours = torch_and_compat(18, E, 3, kdim=7, vdim=9, batch_first=True)
    layer = from_torch(ours)
    gen = torch.Generator().manual_seed(18)
    q, k, v = (torch.randn(N, n, d, generator=gen, dtype=F64) for n, d in ((L, E), (S, 7), (S, 9)))
    assert_close(layer(q, k, v)[0], ours(q, k, v)[0], OUT_ATOL, "output")


def _assert_clear_error(excinfo, kind, fragments):
    message = str(excinfo.value)
    assert is_input_error(excinfo.value, kind), message
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


@pytest.mark.parametrize("options,fragment", [
    (dict(num_kv_heads=1), "num_kv_heads = 1 != num_heads"),
    (dict(rotary=True), "rotary embedding"),
    (dict(out_dim=7), "out_dim = 7 != embed_dim"),
    (dict(head_dim=5), "head sizes other than embed_dim / num_heads"),
    (dict(value_head_dim=2), "head sizes other than embed_dim / num_heads"),
], ids=["mqa", "rotary", "out_dim", "head_dim", "value_head_dim"])
def test_to_torch_rejects_what_torch_cannot_express(options, fragment):
    layer = MultiHeadAttention(E, 3, **options)  # head dim 4
    with pytest.raises(ValueError) as excinfo:
        layer.to_torch()
    _assert_clear_error(excinfo, ValueError, ["layer: expected a configuration", fragment])


# --------------------------------------------------------------------------- bad inputs


def bad_compat_calls():
    mha = compat.MultiheadAttention(12, 4)
    x = torch.randn(5, 3, 12)  # (L, N, E)
    memory = torch.randn(7, 3, 12)  # (S, N, E)
    return [
        (lambda: compat.MultiheadAttention(10, 4), ValueError, "num_heads: expected a divisor of embed_dim = 10"),
        (lambda: compat.MultiheadAttention(12, 4, dropout=1.0), ValueError,
         "dropout: expected a probability in [0, 1)"),
        (lambda: mha(x, x, x, is_causal=True), ValueError, "attn_mask: expected a causal attn_mask"),
        (lambda: mha(x, memory, memory, attn_mask=torch.zeros(5, 5, dtype=torch.bool)), ValueError,
         "attn_mask: expected shape (L, S) = (5, 7) or (N * num_heads, L, S) = (12, 5, 7)"),
        (lambda: mha(x, memory, memory, attn_mask=torch.zeros(3, 5, 7, dtype=torch.bool)), ValueError,
         "attn_mask: expected shape (L, S) = (5, 7)"),
        (lambda: mha(x, memory, memory, key_padding_mask=torch.zeros(7, 3, dtype=torch.bool)), ValueError,
         "key_padding_mask: expected shape (N, S) = (3, 7)"),
        (lambda: mha(x, memory, memory, attn_mask=torch.zeros(5, 7, dtype=torch.long)), TypeError,
         "attn_mask: expected a bool or floating tensor"),
        (lambda: mha(x, memory, memory, key_padding_mask=torch.zeros(3, 7, dtype=torch.int32)), TypeError,
         "key_padding_mask: expected a bool or floating tensor"),
        (lambda: mha(x[None], x[None], x[None]), ValueError, "query: expected shape (L, N, E)"),
        (lambda: mha(x, torch.randn(7, 2, 12), torch.randn(7, 2, 12)), ValueError, "key: expected (seq, N = 3, 12)"),
        (lambda: mha(x, memory, torch.randn(6, 3, 12)), ValueError, "value: expected length S = 7"),
        (lambda: mha(x, torch.randn(7, 3, 11), memory), ValueError, "key: expected (seq, N = 3, 12)"),
    ]


@pytest.mark.parametrize("index", range(len(bad_compat_calls())))
def test_bad_compat_input_raises_clearly(index):
    call, kind, fragment = bad_compat_calls()[index]
    with pytest.raises(kind) as excinfo:
        call()
    _assert_clear_error(excinfo, kind, [fragment])
