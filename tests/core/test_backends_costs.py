"""backends.costs and auto's cost-aware choice: what each backend computes for a mask, at which rate, and that
auto runs the cheapest serving backend (explain shows the estimates)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import multihead
from multihead import masks
from multihead.backend_rates import fit_rate_and_row_cost
from multihead.backends import costs, policy, registry, sdpa
from multihead.backends.costs import KernelRates, dense_mask_bytes, live_fraction
from multihead.backends.rates import CPU_AVX2_RATES, CPU_AVX512_BF16_RATES
from multihead.masks import AttentionShape, bind_mask

KIND = policy.current_policy().kind_of(torch.device("cpu"))  # as conftest plans the suite's CPU calls


def install_rates(rates: KernelRates) -> None:
    """Estimate every kind with ``rates`` from now on (conftest restores the suite's policy after each test)."""
    policy.set_policy(policy.current_policy().with_rates(rates))


def bound(mask, n: int, *, causal: bool = False, b: int = 1, h: int = 4, j: int | None = None):
    return bind_mask(mask, causal, AttentionShape(b, h, n, j or n, torch.device("cpu")))


def call_for(mask, n: int, *, causal=False, b=1, h=4, d=16, dtype=torch.float32, requires_grad=False):
    return registry.AttentionCall(
        batch=b,
        heads=h,
        kv_heads=h,
        q_len=n,
        k_len=n,
        qk_dim=d,
        v_dim=d,
        dtype=dtype,
        device=torch.device("cpu"),
        mask=bound(mask, n, causal=causal, b=b, h=h),
        dropout=0.0,
        weights="none",
        need_lse=False,
        requires_grad=requires_grad,
    )


def test_live_fraction_counts_the_blocks_a_mask_leaves():
    assert live_fraction(bound(None, 1024), 1024, 1024, 256, 256) == 1.0
    # causal over a 4 x 4 grid: the 10 blocks on or below the diagonal
    assert live_fraction(bound(None, 1024, causal=True), 1024, 1024, 256, 256) == 10 / 16
    # window(256) at n = 4096: each block row keeps its diagonal block and the one before (the first: one)
    assert live_fraction(bound(masks.window(256), 4096), 4096, 4096, 256, 256) == (2 * 16 - 1) / 256
    # past MAX_GRID blocks a side, cells of several blocks: an upper bound, still far below dense
    wide = live_fraction(bound(masks.window(256), 65536), 65536, 65536, 256, 256)
    assert (2 * 256 - 1) / 256**2 <= wide < 0.1
    # padding: keys past the batch's longest real length are dead in every row
    padded = bound(masks.padding(torch.tensor([300, 500])), 1024, b=2)
    assert live_fraction(padded, 1024, 1024, 256, 256) == 2 / 4


def test_masked_fraction_counts_the_blocks_masked_score_by_score():
    window = bound(masks.window(256), 1024, causal=True)
    # 256-blocks on a 4 x 4 grid: the diagonal blocks and those just below it are partly kept, the rest empty
    assert costs.masked_fraction(window, 1024, 1024, 256, 256) == 7 / 16
    assert live_fraction(window, 1024, 1024, 256, 256) == 7 / 16
    causal = bound(None, 1024, causal=True)
    assert costs.masked_fraction(causal, 1024, 1024, 256, 256) == 4 / 16  # only the diagonal: the rest kept whole
    # a bias (or a cap) is applied to every live block
    alibi = bound(masks.alibi(masks.alibi_slopes(4)), 1024, causal=True)
    assert costs.masked_fraction(alibi, 1024, 1024, 256, 256) == live_fraction(alibi, 1024, 1024, 256, 256) == 10 / 16
    assert costs.masked_fraction(bound(masks.softcap(30.0), 1024), 1024, 1024, 256, 256) == 1.0
    assert costs.masked_fraction(bound(None, 1024), 1024, 1024, 256, 256) == 0.0


def test_tiled_estimate_adds_the_masking_of_its_blocks(rates):
    """tiled masks each partly kept (or biased) block apart from its matrix products: forward, and again in the
    backward, at masked_gps."""
    from multihead.backends import tiled

    n = 1024
    for requires_grad, passes in ((False, 1), (True, 2)):
        call = call_for(masks.window(256), n, causal=True, requires_grad=requires_grad)
        estimate = tiled.CAPABILITIES.estimate(call)
        kernel = costs.dense_kernel_estimate(call, "tiled", fraction=7 / 16)
        assert estimate is not None and kernel is not None
        masking = passes * (7 / 16) * 4 * n * n / (FAST_BLOCKS.masked_gps * 1e9)  # b h i j scores, b = 1, h = 4
        assert estimate.seconds == pytest.approx(kernel.seconds + masking)


def test_flex_estimate_adds_its_score_mod_on_every_computed_score_for_each_bias_or_cap():
    """Flex's score_mod adds each bias (and the cap) to every score of its live blocks, at score_mod_gps a term:
    in benchmarks/dispatch.py its causal & ALiBi forward took 0.65-0.92 ns a score more than its causal one, and
    without this term its estimate put it at 0.62-0.88x its time."""
    from multihead.backends import flex

    install_rates(CPU_AVX2_RATES)  # flex has rates there
    n = 1024
    causal = call_for(None, n, causal=True)
    plain = flex.CAPABILITIES.estimate(causal)
    for mask, terms in (
        (masks.alibi(masks.alibi_slopes(4)), 1),
        (masks.alibi(masks.alibi_slopes(4)) & masks.softcap(30.0), 2),
    ):
        call = call_for(mask, n, causal=True)
        estimate = flex.CAPABILITIES.estimate(call)
        assert plain is not None and estimate is not None
        scores = live_fraction(call.mask, n, n, flex.BLOCK, flex.BLOCK) * 4 * n * n  # b = 1, h = 4
        assert estimate.seconds == pytest.approx(plain.seconds + terms * scores / (CPU_AVX2_RATES.score_mod_gps * 1e9))


def test_the_materialised_estimate_writes_its_weights_into_new_memory():
    """Its (b, h, i, j) weights are a new tensor each call, written at fresh_gbs beside its blocks' work."""
    from multihead.backends import materialized

    install_rates(CPU_AVX2_RATES)  # rates for both precisions
    n = 1024
    for dtype in (torch.float32, torch.bfloat16):
        call = call_for(None, n, dtype=dtype)
        blocks = (materialized.ROWS_PER_BLOCK, materialized.KEY_BLOCK)
        kernel = costs.block_kernel_estimate(call, "materialized", *blocks, half="as given", masks_blocks=True)
        estimate = materialized.CAPABILITIES.estimate(call)
        weights = 4 * n * n * dtype.itemsize  # b = 1, h = 4
        assert kernel is not None and estimate is not None
        assert estimate.seconds == pytest.approx(kernel.seconds + weights / (CPU_AVX2_RATES.fresh_gbs * 1e9))


def test_the_shipped_rates_prefer_flex_where_tiled_masks_many_blocks():
    """benchmarks/dispatch.py (h = 16, d = 64): compiled flex ran causal & ALiBi and causal & window(256) forward
    faster than tiled (53 against 63 ms, 34 against 47 at n = 1024; 179 against 225 at n = 4096, float32), which
    the estimates missed while they left out tiled's masking; unmasked, tiled stays ahead (64 against 84 ms)."""
    from multihead.backends import flex, tiled

    install_rates(CPU_AVX2_RATES)
    alibi = masks.alibi(masks.alibi_slopes(16))
    for mask, n in ((alibi, 1024), (masks.window(256), 1024), (masks.window(256), 4096)):
        for dtype in (torch.float32, torch.bfloat16):
            call = call_for(mask, n, causal=True, h=16, d=64, dtype=dtype)
            assert flex.CAPABILITIES.estimate(call).seconds < tiled.CAPABILITIES.estimate(call).seconds, (mask, n)
    plain = call_for(None, 1024, h=16, d=64)
    assert tiled.CAPABILITIES.estimate(plain).seconds < flex.CAPABILITIES.estimate(plain).seconds


def test_dense_mask_bytes_follow_the_terms():
    assert dense_mask_bytes(call_for(masks.window(8), 64)) == 64 * 64  # one bool (i, j)
    padding = masks.padding(torch.tensor([3, 40]))
    assert dense_mask_bytes(call_for(padding, 64, b=2)) == 2 * 64  # (b, 1, 1, j): one row serves every query
    assert dense_mask_bytes(call_for(padding & masks.window(8), 64, b=2)) == 2 * 64 * 64
    alibi = masks.alibi(masks.alibi_slopes(4))
    assert dense_mask_bytes(call_for(alibi, 64)) == 4 * 64 * 64 * 4  # float32 bias per head
    bias = masks.bias(torch.zeros(1, 1, 64, 64, dtype=torch.float64))
    assert dense_mask_bytes(call_for(bias, 64, dtype=torch.float64)) == 64 * 64 * 8


FAST_BLOCKS = KernelRates(  # a machine where the block kernel is as fast as SDPA per computed pair
    gflops={
        "sdpa": {"forward float32": 100.0, "backward float32": 100.0},
        "sdpa masked": {"forward float32": 50.0, "backward float32": 50.0},
        "tiled": {"forward float32": 100.0, "backward float32": 100.0},
        "materialized": {"forward float32": 10.0, "backward float32": 10.0},
    },
    mask_gbs=1.0,
    source="test",
)


@pytest.fixture
def rates():
    install_rates(FAST_BLOCKS)
    yield FAST_BLOCKS
    install_rates(CPU_AVX2_RATES)


def test_estimates_are_work_over_the_measured_rate(rates):
    n = 1024
    flops = 2 * (16 + 16) * 4 * n * n  # 2 (d + e) b h i j
    plain = costs.dense_kernel_estimate(call_for(None, n), "sdpa")
    assert plain is not None and plain.seconds == pytest.approx(flops / 100e9)
    trained = costs.dense_kernel_estimate(call_for(None, n, requires_grad=True), "sdpa")
    assert trained is not None and trained.seconds == pytest.approx(3.5 * flops / 100e9)  # backward 2.5 x
    window = call_for(masks.window(64), n)
    masked = costs.dense_kernel_estimate(window, "sdpa masked", mask_bytes=dense_mask_bytes(window))
    assert masked is not None
    assert masked.seconds == pytest.approx(flops / 50e9 + 4 * n * n / 1e9)  # (i, j) entries at 1 GB/s of float32
    # built once a call: the backward reads the mask its forward was given
    window = call_for(masks.window(64), n, requires_grad=True)
    masked = costs.dense_kernel_estimate(window, "sdpa masked", mask_bytes=dense_mask_bytes(window))
    assert masked is not None and masked.seconds == pytest.approx(3.5 * flops / 50e9 + 4 * n * n / 1e9)
    # a bias takes as long to build in bfloat16 as in float32: it is computed in float32 and rounded
    alibi = [call_for(masks.alibi(masks.alibi_slopes(4)), n, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)]
    assert (
        costs.dense_mask_seconds(alibi[0]) == costs.dense_mask_seconds(alibi[1]) == pytest.approx(4 * 4 * n * n / 1e9)
    )
    assert costs.dense_kernel_estimate(call_for(None, n, dtype=torch.float64), "sdpa") is None  # no rate: no guess


def test_estimates_add_a_cost_per_query_row_and_head(rates):
    """Beside its pairs a kernel pays per query row and head (forward, and backward with gradients), on every row
    whatever share of the pairs it skips."""
    n = 1024
    install_rates(dataclasses.replace(FAST_BLOCKS, row_us={"sdpa": {"forward float32": 2.0, "backward float32": 3.0}}))
    flops, rows = 2 * (16 + 16) * 4 * n * n, 4 * n  # b = 1, h = 4
    plain = costs.dense_kernel_estimate(call_for(None, n), "sdpa")
    assert plain is not None and plain.seconds == pytest.approx(flops / 100e9 + rows * 2e-6)
    trained = costs.dense_kernel_estimate(call_for(None, n, requires_grad=True), "sdpa")
    assert trained is not None and trained.seconds == pytest.approx(3.5 * flops / 100e9 + rows * 5e-6)
    skipping = costs.dense_kernel_estimate(call_for(None, n), "sdpa", fraction=0.25)
    assert skipping is not None and skipping.seconds == pytest.approx(0.25 * flops / 100e9 + rows * 2e-6)
    tiled = costs.dense_kernel_estimate(call_for(None, n), "tiled")  # no cost per row measured for it
    assert tiled is not None and tiled.seconds == pytest.approx(flops / 100e9)


def test_two_lengths_part_the_rate_from_the_cost_per_row():
    flops, rows = (1e9, 4e9), (8192, 16384)  # n and 2n: four times the pairs, twice the rows
    exact = tuple(f / 100e9 + r * 0.2e-6 for f, r in zip(flops, rows, strict=True))
    assert fit_rate_and_row_cost(flops, rows, exact) == pytest.approx((100.0, 0.2))
    # noise can tilt the line past what the calls allow: no cost per row below 0 ...
    assert fit_rate_and_row_cost(flops, rows, (0.01, 0.05)) == pytest.approx((4e9 / 0.05 / 1e9, 0.0))
    # ... nor above half of either call's time per row, and the rate is read from the longer call
    per_row = 0.012 / (2 * 16384)
    assert fit_rate_and_row_cost(flops, rows, (0.01, 0.012)) == pytest.approx(
        (4e9 / (0.012 - 16384 * per_row) / 1e9, per_row * 1e6)
    )


def test_auto_runs_a_block_skipping_kernel_where_the_mask_leaves_few_blocks(rates):
    n = 2048
    q = torch.randn(1, 4, n, 16)
    windowed = multihead.explain(q, q, q, mask=masks.window(128))
    assert windowed.chosen == "spans"
    assert set(windowed.estimates) == {"sdpa", "tiled", "spans", "materialized"}
    seconds = {name: estimate.seconds for name, estimate in windowed.estimates.items()}
    assert seconds["spans"] < seconds["tiled"] < seconds["sdpa"]
    text = str(windowed)
    assert text.startswith("chosen: spans (~") and "computes 9% of the pairs" in text  # 32-key tiles, 256-row groups
    assert "tiled: could serve" in text and "computes 23% of the pairs" in text  # (2 x 8 - 1) of 64 blocks
    assert "builds a 4.0 MiB dense mask; 'spans' is cheaper" in text
    # the same rates, no mask: SDPA's own kernel does the same work at the same rate, and ranks first
    assert multihead.explain(q, q, q).chosen == "sdpa"
    # and the call runs the chosen kernel, equal to the reference
    out = multihead.attention(q, q, q, mask=masks.window(128))
    ref = multihead.attention(q.double(), q.double(), q.double(), mask=masks.window(128), backend="reference")
    assert (out.double() - ref).abs().max() < 1e-4


def test_sdpa_reads_a_mask_of_one_row_at_its_unmasked_rate(rates):
    """A padding mask is (b, 1, 1, j): SDPA ran it at its unmasked speed, where an (i, j) mask costs it more."""
    n = 1024
    flops = 2 * (16 + 16) * 2 * 4 * n * n
    padded = sdpa._estimate(call_for(masks.padding(torch.tensor([700, 900])), n, b=2))
    assert padded is not None and padded.seconds == pytest.approx(flops / 100e9 + 4 * 2 * n / 1e9)
    windowed = sdpa._estimate(call_for(masks.window(64) & masks.padding(torch.tensor([700, 900])), n, b=2))
    assert windowed is not None and windowed.seconds == pytest.approx(flops / 50e9 + 4 * 2 * n * n / 1e9)


def test_sdpa_with_sinks_estimates_its_mask_of_every_head_and_one_more_key(rates):
    """Its sinks go in as one more key scored by a float mask column (1, h, i or 1, j + 1), and every pair is
    computed: no mask reads that mask at the unmasked rate (one row), a causal one at the masked rate, with no
    blocks skipped (torch's own causal is not used)."""
    n, h = 1024, 4
    flops = 2 * (16 + 16) * h * n * n
    plain = sdpa._estimate(dataclasses.replace(call_for(None, n, h=h), sinks=True))
    assert plain is not None and plain.dense_mask_bytes == h * (n + 1) * 4
    assert plain.seconds == pytest.approx(flops / 100e9 + 4 * h * (n + 1) / 1e9)
    causal = sdpa._estimate(dataclasses.replace(call_for(None, n, causal=True, h=h), sinks=True))
    assert causal is not None and causal.computed_fraction == 1.0 and causal.dense_mask_bytes == h * n * (n + 1) * 4
    assert causal.seconds == pytest.approx(flops / 50e9 + 4 * h * n * (n + 1) / 1e9)


@pytest.mark.parametrize("shipped", [CPU_AVX2_RATES, CPU_AVX512_BF16_RATES], ids=["avx2", "avx512-bf16"])
def test_the_shipped_rates_send_padded_training_to_spans_and_weigh_sdpa_against_tiled_by_length(shipped):
    """Padding (70% real) forward+backward at h = 16, float32. Spans runs SDPA's kernel on the real keys alone: at
    n = 1024 it took 154 ms against SDPA's 180 and tiled's 210 (the AVX-512 EPYC, interleaved, 2026-12-07). Between
    the other two: benchmarks/dispatch.py measured SDPA 117 ms against tiled's 134 at n = 1024, and 29.3 s against
    tiled's 25.8 at n = 16384; rates measured at n = 1024 alone put tiled 48% behind SDPA per pair, where it ran 19%
    behind at n = 16384."""
    install_rates(shipped)
    for n, faster_of_two in ((1024, "sdpa"), (16384, "tiled")):
        q = torch.empty(1, 16, n, 64, requires_grad=True)
        explained = multihead.explain(q, q, q, mask=masks.padding(torch.tensor([int(0.7 * n)])))
        assert explained.chosen == "spans"
        seconds = {name: explained.estimates[name].seconds for name in ("sdpa", "tiled")}
        assert min(seconds, key=seconds.__getitem__) == faster_of_two


def test_small_calls_and_backends_without_estimates_keep_the_priority_order(rates):
    q = torch.randn(1, 2, 64, 8)
    small = multihead.explain(q, q, q, mask=masks.window(4))
    assert small.chosen == "sdpa" and small.estimates == {}  # one block: nothing to skip
    calls = []

    def spy(q, k, v, **kwargs):
        calls.append(1)
        return registry.get_backend("reference").fn(q, k, v, **kwargs)

    registry.register("first", spy, registry.Capabilities(lse=True, softcap=True), priority=1)
    try:
        big = torch.randn(1, 2, 512, 8)
        assert multihead.explain(big, big, big, mask=masks.window(4)).chosen == "first"
        multihead.attention(big, big, big, mask=masks.window(4))
        assert calls == [1]
    finally:
        registry.unregister("first")


def test_auto_follows_the_installed_rates():
    q = torch.randn(1, 4, 2048, 16)
    fast_tiled = KernelRates(
        gflops={**FAST_BLOCKS.gflops, "tiled": {"forward float32": 1000.0, "backward float32": 1000.0}},
        mask_gbs=100.0,
        masked_gps=100.0,  # masking its partial blocks costs it next to nothing
        source="test",
    )
    with policy.use_policy(policy.current_policy().with_rates(fast_tiled)):
        assert multihead.explain(q, q, q, mask=masks.window(128)).chosen == "tiled"
    with policy.use_policy(policy.current_policy().with_rates(FAST_BLOCKS)):
        assert multihead.explain(q, q, q, mask=masks.window(128)).chosen == "spans"


def test_a_calibration_in_the_home_decides_nothing_until_the_user_opts_in(tmp_path, monkeypatch):
    """The issue's case: a calibration written in `multihead bench --calibrate`'s format, its rates skewed towards
    tiled, moved a causal float32 call from sdpa to tiled silently. The static policy never reads it;
    machine.measured_policy() is the opt-in, and explain names it."""
    from multihead import machine

    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    q = torch.randn(1, 4, 512, 16)
    assert multihead.explain(q, q, q, causal=True).chosen == "sdpa"
    slow = {"forward float32": 1.0, "backward float32": 1.0}
    skewed = {**FAST_BLOCKS.gflops, "sdpa": slow, "sdpa masked": slow}  # SDPA's kernel, alone or run by spans
    rates = machine.MachineRates(
        {"float32": 100.0}, 10.0, 2, details={"kernel_rates": {"gflops": skewed, "mask_gbs": 1.0, "source": "cached"}}
    )
    machine.save_calibration(rates)
    assert multihead.explain(q, q, q, causal=True).chosen == "sdpa"  # read by nobody
    measured = machine.measured_policy(base=policy.current_policy())
    assert measured.name == "measured" and measured.rates_for(KIND).gflops["sdpa"]["forward float32"] == 1.0
    with policy.use_policy(measured):
        chosen = multihead.explain(q, q, q, causal=True)
    assert chosen.chosen == "tiled" and "policy measured" in str(chosen) and "cached" in str(chosen)
    assert multihead.explain(q, q, q, causal=True).chosen == "sdpa"  # only within the block
    # a damaged calibration is refused with the fix, not read as defaults
    data = json.loads(machine.calibration_path().read_text())
    data["details"]["kernel_rates"] = {"gflops": "fast"}
    machine.calibration_path().write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"calibration: .*multihead bench --calibrate"):
        machine.measured_policy()


def half_rates(forward_half: float, backward_half: float) -> KernelRates:
    """FAST_BLOCKS with SDPA's half-precision rates set (float32: 100 GFLOP/s each way)."""
    gflops = {name: dict(by_key) for name, by_key in FAST_BLOCKS.gflops.items()}
    for label in ("sdpa", "sdpa masked"):
        gflops[label].update({"forward half": forward_half, "backward half": backward_half})
    return KernelRates(gflops, mask_gbs=1.0, source="test")


@pytest.fixture
def sdpa_dtypes(monkeypatch):
    """The dtype torch's SDPA is called with, call by call."""
    from multihead.backends import sdpa

    seen: list[torch.dtype] = []
    real = sdpa.F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        seen.append(q.dtype)
        return real(q, *args, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    yield seen
    install_rates(CPU_AVX2_RATES)


@pytest.mark.parametrize("mask", [None, "window"])
def test_sdpa_computes_a_half_call_in_the_precision_measured_faster(sdpa_dtypes, mask):
    q, k, v = (torch.randn(1, 4, 300, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    typed = masks.window(40) if mask else None
    # forward as fast in bf16 as in float32 here, backward 9x slower (this project's AVX2 machine: 11 vs 82)
    install_rates(half_rates(forward_half=100.0, backward_half=11.0))
    with torch.no_grad():
        out = multihead.attention(q, k, v, mask=typed, backend="sdpa")
    assert sdpa_dtypes == [torch.bfloat16] and out.dtype == torch.bfloat16  # a tie keeps the call's dtype
    out = multihead.attention(q, k, v, mask=typed, backend="sdpa")
    assert sdpa_dtypes[-1] == torch.float32 and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))
    reference = multihead.attention(*(t.detach().double() for t in (q, k, v)), mask=typed, backend="reference")
    assert (out.double() - reference).abs().max() <= 2**-8 * reference.abs().max()  # one bf16 rounding
    estimate = multihead.explain(q, k, v, mask=typed).estimates["sdpa"]
    assert estimate.computes_in == torch.float32 and "in float32" in str(estimate)
    # a machine whose bf16 kernel is the faster one runs a forward in bf16; with gradients float32 all the same
    # (costs.HALF_BACKWARD_INACCURATE_ON_CPU: its bf16 backward misses the tolerance rule)
    install_rates(half_rates(forward_half=300.0, backward_half=300.0))
    with torch.no_grad():
        multihead.attention(q, k, v, mask=typed, backend="sdpa")
    assert sdpa_dtypes[-1] == torch.bfloat16
    multihead.attention(q, k, v, mask=typed, backend="sdpa")
    assert sdpa_dtypes[-1] == torch.float32
    assert multihead.explain(q, k, v, mask=typed).estimates["sdpa"].computes_in == torch.float32
    frozen = [t.detach() for t in (q, k, v)]
    assert multihead.explain(*frozen, mask=typed).estimates["sdpa"].computes_in is None


def test_faster_compute_dtype_keeps_other_dtypes_devices_and_unmeasured_rates(rates):
    cpu = KIND
    install_rates(half_rates(forward_half=10.0, backward_half=10.0))
    work = {"flops": 1e9, "cast_bytes": 10**6}

    assert costs.faster_compute_dtype("sdpa", torch.bfloat16, cpu, False, **work) == torch.float32
    assert costs.faster_compute_dtype("sdpa", torch.float16, cpu, True, **work) == torch.float32
    assert costs.faster_compute_dtype("sdpa", torch.float64, cpu, False, **work) == torch.float64
    meta = policy.DeviceKind("meta", "meta")  # a device kind with no half-precision rule: keeps its dtype
    assert costs.faster_compute_dtype("sdpa", torch.bfloat16, meta, False, **work) == torch.bfloat16
    assert costs.faster_compute_dtype("tiled", torch.bfloat16, cpu, False, **work) == torch.bfloat16  # no half rate


def test_the_casts_count_in_the_precision_choice(rates):
    """float32 10% faster than bf16 (SDPA's forward here) does not pay for casting q, k, v and the output on a short
    call; on a long one (O(n^2) work against O(n) casts) it does."""
    cpu = KIND
    install_rates(half_rates(forward_half=90.0, backward_half=90.0))  # float32: 100 GFLOP/s
    # 1 GFLOP: 10.0 ms in float32, 11.1 ms in bf16; casting 1.1 ms' worth at fresh_gbs tips it, 0.9 ms' does not
    fresh = costs.kernel_rates(KIND).fresh_gbs * 1e9
    tipping, cheap = int(1.2e-3 * fresh), int(0.9e-3 * fresh)
    assert (
        costs.faster_compute_dtype("sdpa", torch.bfloat16, cpu, False, flops=1e9, cast_bytes=tipping) == torch.bfloat16
    )
    assert costs.faster_compute_dtype("sdpa", torch.bfloat16, cpu, False, flops=1e9, cast_bytes=cheap) == torch.float32
    # with the shipped rates (float32 7% faster): SDPA's causal forward at h = 16, d = 64 stays in bf16 at n = 4096,
    # float32 at 8192
    install_rates(CPU_AVX2_RATES)
    for n, expected in ((4096, None), (8192, torch.float32)):
        q = torch.randn(1, 16, n, 64, dtype=torch.bfloat16)
        assert multihead.explain(q, q, q, causal=True).estimates["sdpa"].computes_in == expected
    # and an estimate in float32 for a half call counts the casts
    call = call_for(None, 8192, causal=True, h=16, d=64, dtype=torch.bfloat16)
    fraction = sdpa.computed_fraction(call.mask)
    kernel = costs.dense_kernel_estimate(call, "sdpa", fraction=fraction, compute_dtype=torch.float32, casts=False)
    with_casts = costs.dense_kernel_estimate(call, "sdpa", fraction=fraction, compute_dtype=torch.float32)
    assert kernel is not None and with_casts is not None
    cast_s = costs.cast_bytes(1, 16, 16, 8192, 8192, 64, 64, False) / (CPU_AVX2_RATES.fresh_gbs * 1e9)
    assert with_casts.seconds == pytest.approx(kernel.seconds + cast_s)
    assert sdpa._estimate(call).seconds == pytest.approx(with_casts.seconds)


def test_cast_bytes_count_what_the_float32_path_writes():
    # forward: q, k, v in float32 and the output back in bf16; training adds dO in float32 and dq, dk, dv in bf16
    q, kv, out = 2 * 4 * 10 * 8, 2 * 2 * 12 * 8, 2 * 4 * 10 * 6  # b = 2, h = 4, g = 2, i = 10, j = 12, d = 8, e = 6
    kv_v = 2 * 2 * 12 * 6
    assert costs.cast_bytes(2, 4, 2, 10, 12, 8, 6, False) == 4 * (q + kv + kv_v) + 2 * out
    assert costs.cast_bytes(2, 4, 2, 10, 12, 8, 6, True) == 4 * (q + kv + kv_v) + 2 * out + 4 * out + 2 * (
        q + kv + kv_v
    )


def test_calibration_runs_every_kernel_in_the_dtype_it_is_given(sdpa_dtypes):
    # rates that would send a bf16 call to float32: inside native_precision the kernel's own bf16 path runs
    install_rates(half_rates(forward_half=10.0, backward_half=10.0))
    q, k, v = (torch.randn(1, 2, 300, 8, dtype=torch.bfloat16) for _ in range(3))
    with costs.native_precision():
        work = {"flops": 1e9, "cast_bytes": 0}
        assert costs.faster_compute_dtype("sdpa", torch.bfloat16, KIND, True, **work) == torch.bfloat16
        multihead.attention(q, k, v, backend="sdpa")
    multihead.attention(q, k, v, backend="sdpa")
    assert sdpa_dtypes == [torch.bfloat16, torch.float32]


def test_tiled_takes_float32_inputs_for_a_half_call_where_the_rates_say_so(monkeypatch):
    from multihead.backends import tiled

    seen: list[torch.dtype] = []
    real = tiled._TiledAttention.call

    def spy(q, *args):
        seen.append(q.dtype)
        return real(q, *args)

    monkeypatch.setattr(tiled._TiledAttention, "call", spy)
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    try:
        out = multihead.attention(q, k, v, causal=True, backend="tiled")  # the shipped rates: float32 is faster
        out.float().sum().backward()
        assert seen == [torch.float32] and out.dtype == q.grad.dtype == torch.bfloat16
        gflops = {name: dict(by_key) for name, by_key in CPU_AVX2_RATES.gflops.items()}
        gflops["tiled"].update({"forward half": 1000.0, "backward half": 1000.0})
        install_rates(KernelRates(gflops, mask_gbs=1.0, source="test"))
        multihead.attention(q, k, v, causal=True, backend="tiled")
        assert seen[-1] == torch.bfloat16
    finally:
        install_rates(CPU_AVX2_RATES)
