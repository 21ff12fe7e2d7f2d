"""MultiHeadAttention's options against the transformers attention modules that ship them, the same weights copied in:
Qwen3Attention (qk_norm), Qwen3NextAttention (output_gate, partial rotary, and its (1 + w) norms), GptOssAttention
(sinks). Tiny modules built from in-memory configs (nothing downloaded); forward and gradients, in float64 and
float32.

transformers computes its rotary angles in float32 whatever the dtype: in float64 they are computed here with its
formula in float64 (checked against its module's). Qwen's eager softmax is float32 too: float64 runs Qwen3 and
Qwen3-Next on "sdpa", which keeps float64. Their RMSNorm stays float32 whatever the dtype, so a float64 comparison with
them is as tight as float32 rounding of the norm allows; gpt-oss (no norm) is compared to 1e-12. The tolerances below
are a few times the differences measured.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers  # the test extra installs it; the package itself never needs it
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

from multihead import MultiHeadAttention
from multihead.positional import RotaryEmbedding

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # in-memory configs only, never the hub

pytestmark = pytest.mark.portable

# hidden 20, h = 6 query heads over g = 3 key/value heads of d = 8 (Qwen3-Next and gpt-oss have d = e)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, THETA = 20, 6, 3, 8, 500.0
BATCH, LENGTH = 2, 7
# (atol, rtol) for outputs and gradients. Largest differences measured on the CPU, over outputs, input and parameter
# gradients: float64 2.2e-6 (Qwen3-Next's gradients; its float32 norm) and 1.4e-14 (gpt-oss), float32 7.9e-6
TOLERANCE = {torch.float64: (1e-5, 1e-6), torch.float32: (3e-5, 1e-5)}
EXACT = {torch.float64: (1e-12, 0.0), torch.float32: TOLERANCE[torch.float32]}  # no float32 step inside theirs
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
SIZES = dict(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, hidden_size=HIDDEN)


def implementation(dtype: torch.dtype) -> str:
    """Qwen's eager attention takes its softmax in float32; its sdpa stays in float64."""
    return "sdpa" if dtype == torch.float64 else "eager"


def drawn(module: torch.nn.Module, seed: int) -> None:
    """Every parameter of ``module`` drawn (norm weights and sinks away from their initial ones or zeros)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            scale = 0.5 if name.endswith(("norm.weight", "sinks")) else 0.3
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * scale)


def hidden(dtype, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, LENGTH, HIDDEN, generator=generator, dtype=torch.float64).to(device, dtype)


def causal_bias(dtype, device) -> torch.Tensor:
    """transformers' additive causal mask (b, 1, i, j): 0 where a query may attend, the dtype's minimum elsewhere."""
    allowed = torch.ones(LENGTH, LENGTH, dtype=torch.bool, device=device).tril()
    bias = torch.zeros(LENGTH, LENGTH, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return bias.expand(BATCH, 1, LENGTH, LENGTH)


def position_embeddings(rotary: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin) ``rotary`` (a transformers rotary module) gives for positions 0 .. LENGTH - 1; in float64 for
    float64 x: its own formula (base^(-2m/dim) over its dim, which is rotary_dim when partial) evaluated in float64,
    checked against what the module computes in float32, so that a float64 comparison is not limited by it."""
    positions = torch.arange(LENGTH, device=x.device).expand(BATCH, LENGTH)
    cos, sin = rotary(x, positions)  # (b, i, dim) or gpt-oss's (b, i, dim/2), computed in float32
    if x.dtype != torch.float64:
        return cos, sin
    dim = 2 * rotary.inv_freq.numel()
    base = rotary.config.rope_parameters["rope_theta"]
    inverse = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim)  # (dim/2,)
    torch.testing.assert_close(rotary.inv_freq.double(), inverse, rtol=1e-6, atol=0)
    angles = positions.to(torch.float64)[..., None] * inverse  # (b, i, dim/2)
    if cos.shape[-1] == dim:  # rotate-half tables repeat the angles for both halves
        angles = torch.cat((angles, angles), dim=-1)
    torch.testing.assert_close((angles.cos(), angles.sin()), (cos, sin), rtol=0, atol=1e-6)
    return angles.cos(), angles.sin()


def run_theirs(module, rotary, x, **options):
    embeddings = position_embeddings(rotary, x)
    return module(x, position_embeddings=embeddings, attention_mask=causal_bias(x.dtype, x.device), **options)[0]


def copy_projections(ours: MultiHeadAttention, theirs: torch.nn.Module, *, q_rows: int | None = None) -> None:
    """Their q/k/v/o projections into ours; with ``q_rows``, only each head's first q_rows rows of q_proj (both lay
    W^Q out per head: a head's d query rows, then its gate rows)."""
    with torch.no_grad():
        for mine, name in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj")):
            target, source = getattr(ours, mine), getattr(theirs, name)
            weight = source.weight
            if name == "q_proj" and q_rows is not None:
                weight = weight.view(HEADS, -1, HIDDEN)[:, :q_rows].reshape(-1, HIDDEN)  # (h * q_rows, hidden)
            target.weight.copy_(weight)
            if source.bias is not None:
                target.bias.copy_(source.bias)


def forward_and_backward(ours, theirs, rotary, dtype, device):
    """Both outputs on the same input, then their gradients for one random cotangent: (ours, theirs, grads of
    ours by name, grads of theirs by name, input grads)."""
    x_ours = hidden(dtype, device).requires_grad_(True)
    x_theirs = hidden(dtype, device).requires_grad_(True)
    got, _ = ours(x_ours, causal=True)
    expected = run_theirs(theirs, rotary, x_theirs)
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    cotangent = cotangent.to(device, dtype)
    (got * cotangent).sum().backward()
    (expected * cotangent).sum().backward()
    ours_grads = {name: p.grad for name, p in ours.named_parameters()}
    theirs_grads = {name: p.grad for name, p in theirs.named_parameters()}
    return got, expected, ours_grads, theirs_grads, (x_ours.grad, x_theirs.grad)


def assert_close(got, expected, dtype, what, tolerance=TOLERANCE):
    atol, rtol = tolerance[dtype]
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def assert_same_projection_grads(ours_grads, theirs_grads, dtype, *, skip_q=False, tolerance=TOLERANCE):
    names = (("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj"))
    pairs = names if skip_q else (("q_proj", "q_proj"), *names)
    for mine, name in pairs:
        for kind in ("weight", "bias"):
            if f"{name}.{kind}" in theirs_grads:
                got, expected = ours_grads[f"{mine}.{kind}"], theirs_grads[f"{name}.{kind}"]
                assert_close(got, expected, dtype, f"{mine}.{kind}", tolerance)


# --------------------------------------------------------------------------- qk_norm: Qwen3Attention


def qwen3(dtype, device, eps=1e-6):
    config = transformers.Qwen3Config(
        **SIZES, rms_norm_eps=eps, rope_parameters={"rope_type": "default", "rope_theta": THETA}
    )
    config._attn_implementation = implementation(dtype)
    theirs = Qwen3Attention(config, layer_idx=0)
    drawn(theirs, seed=0)
    theirs = theirs.to(device, dtype)
    ours = MultiHeadAttention(
        HIDDEN,
        HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        bias=False,
        rotary=RotaryEmbedding(HEAD_DIM, base=THETA),
        qk_norm=True,
        qk_norm_eps=eps,
        device=device,
        dtype=dtype,
    )
    copy_projections(ours, theirs)
    with torch.no_grad():  # the same convention: weight * x_normed, weights initialised to ones
        ours.q_norm.weight.copy_(theirs.q_norm.weight)
        ours.k_norm.weight.copy_(theirs.k_norm.weight)
    return ours, theirs, Qwen3RotaryEmbedding(config).to(device)


@DTYPES
@pytest.mark.parametrize("eps", [1e-6, 0.5], ids=["default eps", "large eps"])
def test_qk_norm_equals_qwen3_attention(dtype, eps, device):
    ours, theirs, rotary = qwen3(dtype, device, eps)
    got, expected, ours_grads, theirs_grads, inputs = forward_and_backward(ours, theirs, rotary, dtype, device)
    assert_close(got, expected, dtype, "output")
    assert_close(*inputs, dtype, "input gradient")
    assert_same_projection_grads(ours_grads, theirs_grads, dtype)
    for name in ("q_norm.weight", "k_norm.weight"):
        assert_close(ours_grads[name], theirs_grads[name], dtype, name)
    ours.q_norm = ours.k_norm = None  # the test can fail: without the norms, another output
    assert (ours(hidden(dtype, device), causal=True)[0] - expected).abs().max() > 1e-2


# --------------------------------------------------------------------------- output gate, partial rotary: Qwen3-Next


def qwen3_next(dtype, device, *, factor, gate="elementwise"):
    """Qwen3-Next's full attention (its q_norm/k_norm, sigmoid gate and partial rotary), and our layer with its weights:
    its (1 + w) norm weights load as w + 1; a headwise gate is compared with Qwen3-Next's gate rows all set to the
    head's one row."""
    config = transformers.Qwen3NextConfig(
        **SIZES, rope_parameters={"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": factor}
    )
    config._attn_implementation = implementation(dtype)
    theirs = Qwen3NextAttention(config, layer_idx=3)
    drawn(theirs, seed=0)
    rotary_dim = int(HEAD_DIM * factor)
    ours = MultiHeadAttention(
        HIDDEN,
        HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        bias=False,
        rotary=True,
        rotary_dim=rotary_dim,
        qk_norm=True,
        output_gate=gate,
        dtype=torch.float64,
    )
    ours.rotary = RotaryEmbedding(rotary_dim, base=THETA)
    with torch.no_grad():
        if gate == "headwise":  # (h, 2d, hidden): each head's d gate rows made one, repeated: one gate per head
            rows = theirs.q_proj.weight.view(HEADS, 2 * HEAD_DIM, HIDDEN)
            rows[:, HEAD_DIM:] = rows[:, HEAD_DIM : HEAD_DIM + 1].clone()
        copy_projections(ours, theirs, q_rows=HEAD_DIM + 1 if gate == "headwise" else None)
        ours.q_norm.weight.copy_(theirs.q_norm.weight + 1)  # Qwen3-Next's x_normed * (1 + w)
        ours.k_norm.weight.copy_(theirs.k_norm.weight + 1)
    return ours.to(device, dtype), theirs.to(device, dtype), Qwen3NextRotaryEmbedding(config).to(device)


@DTYPES
@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0], ids=["rotary_dim 2", "rotary_dim 4", "full rotary"])
def test_elementwise_gate_and_partial_rotary_equal_qwen3_next_attention(dtype, factor, device):
    ours, theirs, rotary = qwen3_next(dtype, device, factor=factor)
    assert ours.rotary_dim == int(HEAD_DIM * factor) and ours.q_proj.weight.shape == theirs.q_proj.weight.shape
    got, expected, ours_grads, theirs_grads, inputs = forward_and_backward(ours, theirs, rotary, dtype, device)
    assert_close(got, expected, dtype, "output")
    assert_close(*inputs, dtype, "input gradient")
    assert_same_projection_grads(ours_grads, theirs_grads, dtype)
    for name in ("q_norm.weight", "k_norm.weight"):  # d(1 + w) = dw
        assert_close(ours_grads[name], theirs_grads[name], dtype, name)


@DTYPES
def test_headwise_gate_equals_qwen3_next_with_one_gate_row_per_head(dtype, device):
    ours, theirs, rotary = qwen3_next(dtype, device, factor=0.5, gate="headwise")
    assert ours.q_proj.weight.shape == (HEADS * (HEAD_DIM + 1), HIDDEN)
    got, expected, ours_grads, theirs_grads, inputs = forward_and_backward(ours, theirs, rotary, dtype, device)
    assert_close(got, expected, dtype, "output")
    assert_close(*inputs, dtype, "input gradient")
    assert_same_projection_grads(ours_grads, theirs_grads, dtype, skip_q=True)
    theirs_q = theirs_grads["q_proj.weight"].view(HEADS, 2 * HEAD_DIM, HIDDEN)
    ours_q = ours_grads["q_proj.weight"].view(HEADS, HEAD_DIM + 1, HIDDEN)
    assert_close(ours_q[:, :HEAD_DIM], theirs_q[:, :HEAD_DIM], dtype, "query rows")
    # the one gate row feeds all d of theirs: its gradient is the sum of theirs
    assert_close(ours_q[:, HEAD_DIM], theirs_q[:, HEAD_DIM:].sum(1), dtype, "gate rows")


@pytest.mark.parametrize("changed", ["full rotary", "gate layout", "no gate"])
def test_the_qwen3_next_comparison_can_fail(changed, device):
    """A layer that rotated every dim, read q and gate as two halves of q_proj (not per head), or had no gate
    would not pass the comparison above."""
    dtype = torch.float64
    ours, theirs, rotary = qwen3_next(dtype, device, factor=0.5)
    x = hidden(dtype, device)
    expected = run_theirs(theirs, rotary, x)
    if changed == "full rotary":
        ours.rotary = RotaryEmbedding(HEAD_DIM, base=THETA)
    elif changed == "gate layout":
        with torch.no_grad():
            rows = ours.q_proj.weight.view(HEADS, 2, HEAD_DIM, HIDDEN).transpose(0, 1).reshape(-1, HIDDEN)
            ours.q_proj.weight.copy_(rows)  # all query rows first, then all gate rows
    else:  # the same weights without the gate rows
        state = ours.state_dict()
        state["q_proj.weight"] = (
            state["q_proj.weight"].view(HEADS, 2 * HEAD_DIM, HIDDEN)[:, :HEAD_DIM].reshape(-1, HIDDEN)
        )
        ours = MultiHeadAttention(**{**ours.config(), "output_gate": None}, device=device, dtype=dtype)
        ours.rotary = RotaryEmbedding(ours.rotary_dim, base=THETA)
        ours.load_state_dict(state)
    assert (ours(x, causal=True)[0] - expected).abs().max() > 1e-2


# --------------------------------------------------------------------------- sinks: GptOssAttention


def gpt_oss(dtype, device):
    config = transformers.GptOssConfig(
        **SIZES,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
    )
    config._attn_implementation = "eager"  # gpt-oss's own sink softmax, in the input's dtype
    theirs = GptOssAttention(config, layer_idx=0)
    drawn(theirs, seed=0)
    theirs = theirs.to(device, dtype)
    ours = MultiHeadAttention(
        HIDDEN,
        HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rotary=RotaryEmbedding(HEAD_DIM, base=THETA),
        sinks=True,
        device=device,
        dtype=dtype,
    )
    copy_projections(ours, theirs)
    with torch.no_grad():
        ours.sinks.copy_(theirs.sinks)
    return ours, theirs, GptOssRotaryEmbedding(config).to(device)


@DTYPES
def test_sinks_equal_gpt_oss_attention(dtype, device):
    ours, theirs, rotary = gpt_oss(dtype, device)
    got, expected, ours_grads, theirs_grads, inputs = forward_and_backward(ours, theirs, rotary, dtype, device)
    assert_close(got, expected, dtype, "output", EXACT)
    assert_close(*inputs, dtype, "input gradient", EXACT)
    assert_same_projection_grads(ours_grads, theirs_grads, dtype, tolerance=EXACT)
    assert_close(ours_grads["sinks"], theirs_grads["sinks"], dtype, "sinks", EXACT)
    assert ours_grads["sinks"].abs().min() > 0
    with torch.no_grad():  # the test can fail: without the sinks, another output
        ours.sinks.fill_(-1e4)
        assert (ours(hidden(dtype, device), causal=True)[0] - expected).abs().max() > 1e-2


@DTYPES
def test_sink_weights_equal_gpt_oss_eager_weights(dtype, device):
    ours, theirs, rotary = gpt_oss(dtype, device)
    x = hidden(dtype, device)
    with torch.no_grad():
        embeddings = position_embeddings(rotary, x)
        _, expected = theirs(x, position_embeddings=embeddings, attention_mask=causal_bias(dtype, device))
        _, got = ours(x, causal=True, need_weights=True)
    assert_close(got, expected, dtype, "weights", EXACT)
    assert (got.sum(-1) < 1).all()
