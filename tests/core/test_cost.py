"""multihead.cost: exact counts checked against FlopCounterMode, the peak against measured memory, the textbook's
examples, the per-kernel buffers and the roofline."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from multihead import MultiHeadAttention
from multihead.cost import (
    KERNEL_BUFFERS,
    AttentionSizes,
    LayerShape,
    MachineRates,
    _attended_pairs,
    attention_kernel_cost,
    bound,
    crossover,
    estimate,
    roofline,
)
from multihead.machine import measure_peak_bytes

MIB = 2**20

# (layer options, batch, query length, key length or None for self-attention)
FLOP_GRID = [
    (dict(embed_dim=24, num_heads=4), 2, 7, None),
    (dict(embed_dim=24, num_heads=6, num_kv_heads=2), 3, 5, None),
    (dict(embed_dim=20, num_heads=4, num_kv_heads=1, head_dim=7, value_head_dim=3, out_dim=11), 2, 9, None),
    (dict(embed_dim=16, num_heads=2, kdim=10, vdim=6, bias=False), 3, 4, 11),
    (dict(embed_dim=30, num_heads=5, out_dim=13), 1, 13, None),
]


def run_layer(layer: MultiHeadAttention, b: int, i: int, j: int | None, *, grad_input: bool):
    query = torch.randn(b, i, layer.embed_dim, dtype=torch.float64, requires_grad=grad_input)
    if j is None:
        return layer(query)[0]
    key = torch.randn(b, j, layer.kdim, dtype=torch.float64, requires_grad=grad_input)
    value = torch.randn(b, j, layer.vdim, dtype=torch.float64, requires_grad=grad_input)
    return layer(query, key, value)[0]


@pytest.mark.parametrize("options, b, i, j", FLOP_GRID)
@pytest.mark.parametrize("causal", [False, True])
def test_matmul_flops_equal_flop_counter_mode(options, b, i, j, causal):
    """Forward and backward matmul FLOPs equal FlopCounterMode's on the real layer (reference backend,
    whose plain bmm FlopCounterMode sees; SDPA's CPU kernel is invisible to it)."""
    if causal and j is not None:
        causal = False  # causal is for self-attention here
    layer = MultiHeadAttention(**options, backend="reference", dtype=torch.float64)
    for grad_input in (True, False):
        with FlopCounterMode(display=False) as forward_count:
            out = (
                run_layer(layer, b, i, j, grad_input=grad_input)
                if not causal
                else layer(
                    torch.randn(b, i, layer.embed_dim, dtype=torch.float64, requires_grad=grad_input), causal=True
                )[0]
            )
        with FlopCounterMode(display=False) as backward_count:
            out.sum().backward()
        report = estimate(
            LayerShape.of(layer),
            seq=i,
            kv_seq=j,
            batch=b,
            causal=causal,
            dtype="float64",
            mode="forward+backward",
            input_requires_grad=grad_input,
        )
        forward_matmuls = sum(v for term, v in report.flops.items() if term != "softmax")
        backward_matmuls = sum(v for term, v in report.backward_flops.items() if term != "softmax")
        assert forward_count.get_total_flops() == forward_matmuls
        assert backward_count.get_total_flops() == backward_matmuls
        assert report.matmul_flops == forward_matmuls + backward_matmuls


def test_decode_step_flops_equal_flop_counter_mode():
    layer = MultiHeadAttention(24, 6, num_kv_heads=3, backend="reference", dtype=torch.float64)
    cache = layer.new_cache(2, 20)
    with torch.no_grad():
        layer(torch.randn(2, 9, 24, dtype=torch.float64), cache=cache, causal=True)  # 9 tokens cached
        with FlopCounterMode(display=False) as count:
            layer(torch.randn(2, 1, 24, dtype=torch.float64), cache=cache, causal=True)
    report = estimate(LayerShape.of(layer), seq=1, batch=2, mode="decode", cache_len=9, dtype="float64")
    assert report.k_len == 10
    assert count.get_total_flops() == report.matmul_flops
    assert report.bytes.kv_cache == 2 * 3 * 10 * (4 + 4) * 8  # b g j (d + e) x 8 bytes
    assert cache.keys.element_size() * cache.keys[:, :, :10].numel() * 2 == report.bytes.kv_cache


def test_textbook_examples():
    # d = 512, h = 8: 4 d^2 = 1,048,576 weights, whatever the number of heads
    for heads in (1, 8, 64):
        assert estimate(LayerShape(512, heads), seq=10).params.weights == 1_048_576
    assert estimate(LayerShape(512, 8), seq=10).params.biases == 4 * 512
    # d = 768, h = 12, n = 128: per-head Q, K, V of 128 x 64, a 128 x 128 score matrix per head
    shapes = estimate(LayerShape(768, 12), seq=128).shapes
    assert shapes["q"] == (1, 12, 128, 64) and shapes["k"] == (1, 12, 128, 64)
    assert shapes["scores"] == (1, 12, 128, 128) and shapes["concatenated"] == (1, 128, 768)
    # n = 2048, d = 4096, h = 32: projections 4 x 2 n d^2, Q K^T and weights x V 2 n^2 d each
    report = estimate(LayerShape(4096, 32, bias=False), seq=2048)
    n, d = 2048, 4096
    assert report.flops["Q/K/V projections"] + report.flops["output projection"] == 8 * n * d**2 == 274_877_906_944
    assert report.flops["Q K^T"] == report.flops["weights x V"] == 2 * n**2 * d == 34_359_738_368
    assert report.dominant == "Q/K/V projections"  # n < 2d: the projections dominate
    # 8 heads x 32 sequences x 128 tokens of float32 weights: 16.8 MB
    weights = estimate(LayerShape(512, 8), seq=128, batch=32, need_weights=True).bytes.attention_weights
    assert weights == 8 * 32 * 128 * 128 * 4 == 16_777_216


def test_crossover_is_where_the_n_squared_terms_catch_up():
    shape = LayerShape(512, 8)
    n_star = crossover(shape)
    assert 2 * 512 * 0.9 < n_star < 2 * 512  # about 2d for the classic layer (softmax moves it a little)

    def quadratic(n):
        f = estimate(shape, seq=n).flops
        return f["Q K^T"] + f["softmax"] + f["weights x V"] - f["Q/K/V projections"] - f["output projection"]

    assert quadratic(int(n_star)) < 0 < quadratic(int(n_star) + 1)
    assert estimate(shape, seq=256).dominant == "Q/K/V projections"
    assert estimate(shape, seq=4096).dominant == "Q K^T"


@pytest.mark.parametrize("i, j", [(5, 5), (3, 8), (8, 3), (1, 9), (9, 1), (6, 6)])
def test_attended_pairs_match_the_causal_mask(i, j):
    mask = torch.ones(i, j, dtype=torch.bool).tril(j - i)  # bottom-right aligned
    assert _attended_pairs(i, j, True) == int(mask.sum())
    assert estimate(LayerShape(8, 2), seq=i, kv_seq=j, causal=True).attended_fraction == int(mask.sum()) / (i * j)


MEMORY_GRID = [
    dict(embed_dim=256, num_heads=8, batch=4, seq=512),
    dict(embed_dim=256, num_heads=8, num_kv_heads=2, batch=4, seq=512),
    dict(embed_dim=384, num_heads=12, batch=2, seq=256),
    dict(embed_dim=128, num_heads=4, num_kv_heads=1, batch=3, seq=700),
    dict(embed_dim=192, num_heads=6, num_kv_heads=3, batch=5, seq=300),
]


@pytest.mark.parametrize("config", MEMORY_GRID, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize(
    "mode, need_weights, causal",
    [("forward", False, False), ("forward", False, True), ("forward", True, False), ("forward+backward", False, True)],
)
def test_predicted_peak_memory_within_10_percent_of_measured(config, mode, need_weights, causal):
    options = {k: v for k, v in config.items() if k not in ("batch", "seq")}
    layer = MultiHeadAttention(**options)
    x = torch.randn(config["batch"], config["seq"], layer.embed_dim, requires_grad=mode != "forward")

    def step():
        if mode == "forward":
            with torch.no_grad():
                layer(x, causal=causal, need_weights=need_weights)
        else:
            layer(x, causal=causal, need_weights=need_weights)[0].sum().backward()

    step()  # warm-up: one-time buffers are not the layer's cost
    layer.zero_grad(set_to_none=True)
    x.grad = None
    measured = measure_peak_bytes(step)
    predicted = estimate(
        LayerShape.of(layer),
        seq=config["seq"],
        batch=config["batch"],
        causal=causal,
        mode=mode,
        need_weights=need_weights,
    ).bytes.peak
    assert abs(predicted / measured - 1) <= 0.10, (predicted / MIB, measured / MIB)


def test_each_kernel_names_its_own_buffers():
    """The kernel-specific part of the peak lives in KERNEL_BUFFERS, one entry per kernel the layer runs."""
    sizes = AttentionSizes(b=2, h=6, g=3, i=5, j=7, d=4, e=3, itemsize=4)
    assert sizes.lse == 2 * 6 * 5 * 4 and sizes.head_outputs == 2 * 6 * 5 * 3 * 4
    assert sizes.key_sized == 2 * 3 * 7 * 4 * 4 and sizes.weights == 2 * 6 * 5 * 7 * 4
    sdpa, materialized = KERNEL_BUFFERS["sdpa"](sizes), KERNEL_BUFFERS["materialized"](sizes)
    assert (sdpa.forward, sdpa.recorded, sdpa.saved, sdpa.backward) == (
        sizes.lse,
        sizes.lse,
        sizes.lse,
        sizes.key_sized,
    )
    assert (materialized.forward, materialized.recorded, materialized.saved, materialized.backward) == (
        sizes.head_outputs,
        sizes.lse,
        sizes.lse + sizes.head_outputs,
        sizes.key_sized + sizes.weights,
    )
    # a forward whose peak is at the end: everything kept, plus the kernel's forward buffers
    shape = LayerShape(24, 6, num_kv_heads=3, kdim=5, vdim=9)  # no fused QKV: no stacked weight
    plain = estimate(shape, seq=5, kv_seq=7, batch=2)
    weights = estimate(shape, seq=5, kv_seq=7, batch=2, need_weights=True)
    layer_sizes = AttentionSizes(b=2, h=6, g=3, i=5, j=7, d=4, e=4, itemsize=4)
    assert plain.bytes.peak == plain.bytes.activations + layer_sizes.lse
    assert weights.bytes.peak == weights.bytes.activations + layer_sizes.head_outputs


def test_attention_kernel_cost_counts_the_attention_alone():
    flops, traffic = attention_kernel_cost(batch=2, heads=3, q_len=5, k_len=7, head_dim=4)
    assert flops == 2 * 3 * 5 * 7 * (2 * 4 + 5 + 2 * 4)  # Q K^T, softmax, weights x V per score
    assert traffic == (2 * 3 * 5 * 4 + 2 * 3 * 7 * 8 + 2 * 3 * 5 * 4) * 4  # q, k and v, the output; float32
    causal, _ = attention_kernel_cost(batch=2, heads=3, q_len=5, k_len=5, head_dim=4, causal=True)
    assert causal == 2 * 3 * 15 * (2 * 4 + 5 + 2 * 4)  # 15 of the 25 pairs are attended
    trained, _ = attention_kernel_cost(batch=1, heads=1, q_len=2, k_len=2, head_dim=4, mode="forward+backward")
    assert trained == 4 * (2 * 4 + 5 + 2 * 4) + 4 * (4 * 4 + 4 + 4 * 4)


def test_roofline_picks_the_binding_resource():
    rates = MachineRates({"float32": 100.0}, bandwidth_gbs=10.0, threads=2)
    big = estimate(LayerShape(1024, 16), seq=2048)  # many FLOPs per byte
    limit = roofline(big, rates)
    assert limit.bound_by == "compute" and limit.bound_s == pytest.approx(big.total_flops / 100e9)
    assert limit.ridge_point == pytest.approx(10.0)
    decode = estimate(LayerShape(1024, 16), seq=1, mode="decode", cache_len=4096)  # reads the whole cache
    assert roofline(decode, rates).bound_by == "memory"
    assert bound(1e9, 1.0, "float32", rates).compute_s == pytest.approx(1e9 / 100e9)
    with pytest.raises(ValueError, match="dtype: expected one of the calibrated dtypes"):
        roofline(estimate(LayerShape(64, 4), seq=8, dtype="bfloat16"), rates)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: LayerShape(0, 4), ValueError, "embed_dim: expected a positive int, got 0"),
        (lambda: LayerShape(64, -2), ValueError, "num_heads: expected a positive int, got -2"),
        (lambda: LayerShape(64, 5), ValueError, "num_heads: expected a divisor of embed_dim = 64, got 5"),
        (
            lambda: LayerShape(64, 8, num_kv_heads=3),
            ValueError,
            r"num_kv_heads: expected a divisor of num_heads = 8, "
            r"got 3\. Fix: use one of \[1, 2, 4, 8\]",
        ),
        (lambda: LayerShape(64, 8, head_dim=2.5), TypeError, "head_dim: expected a positive int"),
        (lambda: estimate(LayerShape(64, 8), seq=0), ValueError, "seq: expected a positive int, got 0"),
        (lambda: estimate(LayerShape(64, 8), seq=4, dtype="int8"), ValueError, "dtype: expected one of float32"),
        (lambda: estimate(LayerShape(64, 8), seq=4, mode="train"), ValueError, "mode: expected one of forward"),
        (lambda: estimate(LayerShape(64, 8), seq=1, mode="decode"), ValueError, "cache_len: expected the number"),
        (lambda: estimate(LayerShape(64, 8), seq=4, cache_len=5), ValueError, "cache_len: expected None outside"),
        (lambda: estimate((64, 8), seq=4), TypeError, "shape: expected a multihead.cost.LayerShape"),
    ],
)
def test_bad_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_half_precision_work_is_bounded_by_the_faster_of_its_rate_and_float32():
    rates = MachineRates({"float32": 150.0, "bfloat16": 1.3}, bandwidth_gbs=25.0, threads=2)
    report = estimate(LayerShape(768, 12), seq=512, dtype="bfloat16")
    bound_bf16 = roofline(report, rates)
    assert bound_bf16.compute_s == pytest.approx(report.needed_flops / 150e9)  # not the 1.3 GFLOP/s bf16 matmul
    faster = MachineRates({"float32": 150.0, "bfloat16": 600.0}, bandwidth_gbs=25.0, threads=2)
    assert roofline(report, faster).compute_s == pytest.approx(report.needed_flops / 600e9)


@pytest.mark.parametrize(
    "options",
    [
        dict(output_gate="elementwise"),
        dict(output_gate="headwise"),
        dict(qk_norm=True),
        dict(sinks=True),
        dict(output_gate="elementwise", qk_norm=True, sinks=True, rotary=True, rotary_dim=2),
    ],
    ids=["elementwise-gate", "headwise-gate", "qk-norm", "sinks", "all"],
)
def test_the_layer_options_are_counted_as_the_layer_holds_and_runs_them(options):
    """Parameters equal the layer's own, and the matmul FLOPs torch counts (the gate's rows are W^Q's); on the
    reference backend, whose products torch's counter sees one by one."""
    sizes = dict(num_kv_heads=2, head_dim=6, value_head_dim=4, dtype=torch.float64, backend="reference")
    layer = MultiHeadAttention(24, 4, **sizes, **options)
    report = estimate(LayerShape.of(layer), seq=9, batch=2, dtype="float64")
    assert report.params.total == sum(p.numel() for p in layer.parameters())
    with torch.no_grad(), FlopCounterMode(display=False) as count:
        layer(torch.randn(2, 9, 24, dtype=torch.float64))
    assert count.get_total_flops() == report.matmul_flops
