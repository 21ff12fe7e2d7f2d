"""The dispatch policy (multihead.backends.policy): auto's choice is a pure function of the call's description and
the policy, keyed by device kind, static unless the user opts into measured rates or autotune; explain shows what
it rests on. Calls on CUDA are described here on the CPU (the kind is part of the description)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

import multihead
from multihead import masks
from multihead.backends import policy, registry
from multihead.backends.policy import DeviceKind
from multihead.backends.rates import CPU_AVX2_RATES, CPU_AVX512_BF16_RATES, CUDA_SM90_RATES, KernelRates
from multihead.masks import AttentionShape, bind_mask

H100 = DeviceKind("cuda", "cuda-sm90", "NVIDIA H100 80GB HBM3")
A_NEWER_GPU = DeviceKind("cuda", "cuda-sm120", "a GPU no table names")
AVX2 = DeviceKind("cpu", "cpu-avx2")
AVX512_BF16 = DeviceKind("cpu", "cpu-avx512-bf16")
AVX512 = DeviceKind("cpu", "cpu-avx512")  # no bf16 units: no table of its own


def described(
    kind: DeviceKind,
    mask=None,
    *,
    causal=False,
    n=4096,
    b=1,
    h=8,
    g=8,
    d=128,
    dtype=torch.bfloat16,
    requires_grad=True,
    need_lse=False,
    weights="none",
    dropout=0.0,
) -> registry.AttentionCall:
    """The description of a call on a device of ``kind``, built without that device: the mask is bound on the CPU
    (a decision reads its structure, never its data's device)."""
    bound = bind_mask(mask, causal, AttentionShape(b, h, n, n, torch.device("cpu")))
    device = torch.device(kind.type)
    return registry.AttentionCall(
        b, h, g, n, n, d, d, dtype, device, bound, dropout, weights, need_lse, requires_grad, kind=kind
    )


def test_the_cpu_kind_follows_the_instruction_set_torch_runs_and_the_bf16_units(monkeypatch):
    detect = policy._detect_cpu_kind  # the detection device_kind runs once per device
    monkeypatch.setattr(policy, "cpu_flags", lambda: ("A CPU", frozenset({"avx2", "avx512f", "avx512_bf16"})))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert detect() == DeviceKind("cpu", "cpu-avx512-bf16", "A CPU")
    # ATEN_CPU_CAPABILITY=avx2 on the same machine: ATen's kernels run AVX2, and so does the plan
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert detect().name == "cpu-avx2"
    monkeypatch.setattr(policy, "cpu_flags", lambda: ("", frozenset({"avx512f"})))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert detect().name == "cpu-avx512"
    assert policy.device_kind(torch.device("cpu")).type == "cpu"  # this machine's, whatever it is
    assert policy.device_kind(torch.device("meta")) == DeviceKind("meta", "meta")


def test_a_kind_without_a_table_uses_the_nearest_and_explain_names_it():
    static = policy.STATIC
    assert static.table_for(AVX2) == ("cpu-avx2", CPU_AVX2_RATES)
    assert static.table_for(AVX512) == ("cpu-avx2", CPU_AVX2_RATES)
    assert static.table_for(AVX512_BF16) == ("cpu-avx512-bf16", CPU_AVX512_BF16_RATES)
    assert static.table_for(H100) == ("cuda-sm90", CUDA_SM90_RATES)
    assert static.table_for(A_NEWER_GPU)[0] == "cuda-sm80"
    table, rates = static.table_for(DeviceKind("xpu", "xpu"))
    assert table == "none" and rates.gflops == {}  # no guess: the priority order decides
    line = static.describe(AVX512)
    assert "device kind cpu-avx512" in line and "no table for cpu-avx512: the nearest kind's, cpu-avx2" in line
    assert "measured" in static.describe(AVX2) and "published figures" in static.describe(H100)


@pytest.mark.parametrize("kind", [AVX2, AVX512, AVX512_BF16, H100, A_NEWER_GPU])
def test_the_choice_is_a_function_of_the_description_not_of_the_machine(kind):
    """The same description gives the same choice and estimates whatever kind the policy would detect or assume
    for this machine's devices: nothing but the call and the policy's tables enters."""
    calls = [
        described(kind, causal=True),
        described(kind, masks.window(256), causal=True, n=2048),
        described(kind, masks.alibi(masks.alibi_slopes(8)), causal=True, n=1024, dtype=torch.float32),
    ]
    answers = []
    for planned in (policy.STATIC, policy.STATIC.assuming(AVX512_BF16), policy.STATIC.assuming(H100)):
        with policy.use_policy(planned):
            answers.append([str(registry.explain_call(call, "auto")) for call in calls])
    assert answers[0] == answers[1] == answers[2]


def test_on_cuda_a_half_call_with_gradients_runs_a_fused_kernel_in_its_own_dtype():
    """The issue's first case: on the CPU tables, bf16 with gradients was computed in float32 (SDPA's CPU bf16
    backward is slow) or by tiled's Python loop; on CUDA neither."""
    for mask, causal in ((None, True), (masks.window(512), True), (masks.alibi(masks.alibi_slopes(8)), True)):
        explanation = registry.explain_call(described(H100, mask, causal=causal), "auto")
        assert explanation.chosen == "sdpa", explanation
        assert explanation.estimates["sdpa"].computes_in is None  # bf16 on the tensor cores, no upcast
        for looped in ("tiled", "materialized"):
            assert "Python loop over blocks" in " ".join(explanation.rejected[looped])
            assert "fused kernel on cuda" in " ".join(explanation.rejected[looped])
        assert "device kind cuda-sm90" in str(explanation)
    # the same bf16 causal call on a CPU kind is computed in float32 by SDPA, on the AVX2 kind and on one with bf16
    # units alike (where its bf16 backward measured 1.7x faster than float32): torch's CPU bf16 backward misses
    # FlashAttention's tolerance rule (costs.HALF_BACKWARD_INACCURATE_ON_CPU), and accuracy comes first
    for cpu_kind in (AVX2, AVX512_BF16):
        on_cpu = registry.explain_call(described(cpu_kind, causal=True), "auto")
        assert on_cpu.estimates["sdpa"].computes_in == torch.float32
    assert registry.choose(described(H100, causal=True), "auto").name == "sdpa"


def test_what_no_fused_kernel_serves_on_cuda_says_so():
    """return_lse: SDPA returns none, flex is not compiled yet; tiled serves it, and explain says it is slow."""
    explanation = registry.explain_call(described(H100, causal=True, need_lse=True), "auto")
    assert explanation.chosen == "tiled"
    text = str(explanation)
    assert "note: no fused kernel serves this call on cuda" in text and "return_lse" in text
    # on a CPU the loop is the block kernel it is: no note
    assert "note:" not in str(registry.explain_call(described(AVX2, causal=True, need_lse=True), "auto"))


def test_every_weight_on_cuda_comes_from_whole_tensor_operations():
    """With every weight asked for, the CPU plan runs the materialised kernel (one pass writing them); on CUDA its
    row-block loop gives way to a pass of whole-tensor operations."""
    assert registry.explain_call(described(AVX2, causal=True, n=512, weights="all"), "auto").chosen == "materialized"
    on_gpu = registry.explain_call(described(H100, causal=True, n=512, weights="all"), "auto")
    assert not registry.get_backend(on_gpu.chosen).capabilities.python_block_loop
    assert "Python loop over blocks" in " ".join(on_gpu.rejected["materialized"])


def test_with_rates_replaces_one_kinds_table_or_every_kinds():
    custom = KernelRates({"sdpa": {"forward float32": 1.0}}, mask_gbs=1.0, source="custom")
    one = policy.STATIC.with_rates(custom, kind="cuda-sm90", name="mine")
    assert one.name == "mine" and one.rates_for(H100) is custom and one.rates_for(AVX2) is CPU_AVX2_RATES
    every = policy.STATIC.with_rates(custom)
    assert all(every.rates_for(kind) is custom for kind in (H100, AVX2, AVX512_BF16, A_NEWER_GPU))
    assert policy.STATIC.rates_for(H100) is CUDA_SM90_RATES  # the static policy itself is unchanged
    with pytest.raises(TypeError, match=r"rates: expected a multihead.backends.rates.KernelRates, got .*dict"):
        policy.STATIC.with_rates({"sdpa": {}})


def test_policies_are_installed_per_block_or_per_process_and_checked():
    suite = policy.current_policy()
    planned = suite.assuming(H100)
    seen_in_thread = []
    with policy.use_policy(planned):
        assert policy.current_policy() is planned
        thread = threading.Thread(target=lambda: seen_in_thread.append(policy.current_policy()))
        thread.start()
        thread.join()
    assert policy.current_policy() is suite
    assert seen_in_thread == [suite]  # a block's policy is its own thread's
    with pytest.raises(
        TypeError, match=r"policy: expected a multihead.backends.policy.DispatchPolicy, got str 'static'"
    ):
        policy.set_policy("static")
    with pytest.raises(TypeError, match="policy: expected"):
        with policy.use_policy(None):
            pass
    assert policy.current_policy() is suite
    with pytest.raises(TypeError, match=r"enabled: expected True or False"):
        with policy.autotune("yes"):
            pass


def test_tune_keeps_the_fastest_median_once_per_key():
    policy.forget_tuned()
    clock = {"a": iter([9.0, 3.0, 3.0, 3.0]), "b": iter([1.0, 2.0, 2.0, 100.0])}  # b: median 2 (its warm-up ignored)
    timers = {name: (lambda name=name: next(clock[name])) for name in clock}
    assert policy.tune(("key",), timers) == "b"
    assert policy.tune(("key",), {"a": lambda: 0.0}) == "b"  # kept: not timed again
    policy.forget_tuned()
    assert policy.tune(("key",), {"a": lambda: 0.0}) == "a"
    policy.forget_tuned()


def test_autotune_runs_the_measured_winner_and_times_each_serving_backend(monkeypatch):
    """Under autotune, attention times every serving backend on copies of the inputs (forward and backward) and
    runs the winner; the call's result is the winner's."""
    policy.forget_tuned()
    timed: dict[str, float] = {}

    def fastest_is_reference(key, timers):
        for name, timer in timers.items():
            timed[name] = timer()
        return "reference"

    monkeypatch.setattr(policy, "tune", fastest_is_reference)
    ran: list[str] = []
    reference = registry.get_backend("reference")

    def spy(*args, **kwargs):
        ran.append("reference")
        return reference.fn(*args, **kwargs)

    monkeypatch.setitem(registry._REGISTRY, "reference", dataclasses.replace(reference, fn=spy))
    q, k, v = (torch.randn(1, 2, 300, 8, requires_grad=True) for _ in range(3))
    with policy.autotune():
        assert policy.current_policy().autotune
        out = multihead.attention(q, k, v, causal=True)
    assert {"sdpa", "tiled", "reference"} <= set(timed) and all(seconds > 0 for seconds in timed.values())
    assert ran and ran[-1] == "reference" and q.grad is None  # timing ran on copies
    expected = multihead.attention(q, k, v, causal=True, backend="reference")
    torch.testing.assert_close(out, expected)
    # outside the block, and for a call with dropout, nothing is timed
    timed.clear()
    multihead.attention(q, k, v, causal=True)
    with policy.autotune():
        multihead.attention(q, k, v, causal=True, dropout=0.1, training=True)
        assert "autotune on" in str(multihead.explain(q, k, v, causal=True))
    assert timed == {}


def test_the_signature_autotune_keys_on_is_the_calls_structure():
    shape = AttentionShape(2, 4, 16, 16, torch.device("cpu"))
    window = bind_mask(masks.window(4), True, shape)
    assert window.signature() == bind_mask(masks.window(4), True, shape).signature()
    assert window.signature() != bind_mask(masks.window(5), True, shape).signature()
    padded = bind_mask(masks.padding(torch.tensor([16, 9])), False, shape)
    assert padded.signature() == bind_mask(masks.padding(torch.tensor([3, 16])), False, shape).signature()
    capped = bind_mask(masks.softcap(30.0), False, shape)
    assert capped.signature() != bind_mask(masks.softcap(20.0), False, shape).signature()
    hash(window.signature())  # a dict key


def test_a_repeated_call_reuses_its_plan_until_what_it_rests_on_changes(monkeypatch):
    """A call with no mask keeps its plan (bound mask, description, backend) per signature: the next identical call
    neither validates nor dispatches again; registering a backend, another policy, other options or sizes decide
    afresh."""
    from multihead import functional

    chosen: list[str] = []
    real_choose = registry.choose

    def counting_choose(call, backend):
        picked = real_choose(call, backend)
        chosen.append(picked.name)
        return picked

    monkeypatch.setattr(registry, "choose", counting_choose)
    functional._PLANS.clear()
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    first = multihead.attention(q, k, v, causal=True)
    torch.testing.assert_close(multihead.attention(q, k, v, causal=True), first)
    assert chosen == ["sdpa"]  # decided once
    multihead.attention(q, k, v)  # causal=False: another signature
    multihead.attention(q[:, :, :3], k, v, causal=True)  # other sizes
    assert len(chosen) == 3
    # a backend registered in front is seen by the next call
    reference = registry.get_backend("reference")
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return reference.fn(*args, **kwargs)

    registry.register("front", spy, reference.capabilities, priority=0)
    try:
        torch.testing.assert_close(multihead.attention(q, k, v, causal=True), first)
        assert chosen[-1] == "front" and calls == [1]
    finally:
        registry.unregister("front")
    multihead.attention(q, k, v, causal=True)
    assert chosen[-1] == "sdpa"
    # another policy decides afresh, and so does a plain option given as another type (never the plan of 1.0)
    count = len(chosen)
    with policy.use_policy(policy.current_policy().assuming(AVX512_BF16)):
        multihead.attention(q, k, v, causal=True)
    assert len(chosen) == count + 1
    multihead.attention(q, k, v, causal=True, scale=1.0)
    with pytest.raises(TypeError, match="scale: expected a real number"):
        multihead.attention(q, k, v, causal=True, scale=True)
    # an unbatched call keeps its own plan and its shape
    assert multihead.attention(q[0], k[0], v[0], causal=True).shape == (2, 5, 8)
    assert multihead.attention(q[0], k[0], v[0], causal=True).shape == (2, 5, 8)
    functional._PLANS.clear()
