"""Sequence parallelism (multihead.parallel.sequence) on gloo ranks against one process's attention, in float64.

Each rank builds the whole problem from one seed, runs the parallel function on its shard, and compares its shard
of the output and of dq, dk, dv with single-process ``multihead.attention`` on the full sequence. Collectives are
counted with torch's CommDebugMode for Ulysses (it sees the gloo all-to-alls) and with a wrapper round the ring's
point-to-point exchange (CommDebugMode does not see send/recv), calls and bytes. The bytes autograd saves in the
ring's forward are summed with saved_tensors_hooks: the rank's own shards only, never the whole sequence's K/V.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import multihead
from distributed import RankFailed, rank_device, run_ranks, skip_unless_ranks_run
from multihead import masks
from multihead.parallel import sequence
from multihead.parallel.sequence import (
    SequenceParallelAttention,
    ring_attention,
    ulysses_attention,
    zigzag_shard,
    zigzag_unshard,
)
from support import is_input_error, textbook_lowp

B, N, D, E = 2, 24, 3, 5  # n divides by 2P for P = 1, 2, 4; m = n/P is 24, 12, 6
TOL = 1e-10

MASKS = {  # name -> (causal, typed mask, with key padding)
    "none": (False, None, False),
    "causal": (True, None, False),
    "causal window": (True, masks.window(4, 0), False),
    "symmetric window": (False, masks.window(3, 2), False),
    "padding": (False, None, True),
    "causal padding softcap": (True, masks.softcap(2.5), True),
}


def shard(x: torch.Tensor, layout: str, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    if layout == "zigzag":
        return zigzag_shard(x, rank, world, dim)
    return torch.chunk(x, world, dim)[rank]


def problem(h: int, g: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, N, D, generator=gen, dtype=torch.float64, device="cpu")
    k = torch.randn(B, g, N, D, generator=gen, dtype=torch.float64, device="cpu")
    v = torch.randn(B, g, N, E, generator=gen, dtype=torch.float64, device="cpu")
    grad = torch.randn(B, h, N, E, generator=gen, dtype=torch.float64, device="cpu")
    valid = torch.rand(B, N, generator=gen, device="cpu") < 0.7
    valid[1] = False  # a batch row with every key padded: output and gradients 0
    return tuple(t.to(rank_device()) for t in (q, k, v, grad, valid))  # drawn on the CPU: the same on every device


def compare(fn, h: int, g: int, layout: str, mask_name: str, rank: int, world: int, seed: int) -> float:
    """Largest |parallel - single process| over this rank's shard of the output, dq, dk and dv."""
    causal, mask, with_padding = MASKS[mask_name]
    q, k, v, grad, valid = problem(h, g, seed)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    terms = [t for t in (mask, masks.padding(valid) if with_padding else None) if t is not None]
    full_mask = None if not terms else terms[0] if len(terms) == 1 else terms[0] & terms[1]
    ref = multihead.attention(*full, causal=causal, mask=full_mask)
    ref.backward(grad)

    local = [shard(t, layout, rank, world).detach().requires_grad_() for t in (q, k, v)]
    key_padding = shard(valid, layout, rank, world, dim=1) if with_padding else None
    out = fn(*local, causal=causal, mask=mask, key_padding=key_padding, layout=layout)
    out.backward(shard(grad, layout, rank, world))
    errors = [(out - shard(ref, layout, rank, world)).abs().max()]
    errors += [(t.grad - shard(f.grad, layout, rank, world)).abs().max() for t, f in zip(local, full, strict=True)]
    return float(torch.stack(errors).max().detach())


def low_precision_errors(rank: int, world: int) -> dict[str, tuple[float, float]]:
    """Causal zigzag ring attention in bfloat16 and float16: (our error, the textbook-in-that-dtype's error) against
    float64, for this rank's output, dq, dk and dv (the DESIGN.md tolerance rule: ours <= 2 x the textbook's)."""
    found = {}
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, grad, _ = problem(4, 2, seed=11)
        exact = [t.clone().requires_grad_() for t in (q, k, v)]
        multihead.attention(*exact, causal=True).backward(grad)
        low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        textbook, _, _ = textbook_lowp(low[0], *(t.repeat_interleave(2, dim=1) for t in low[1:]), causal=True)
        textbook.backward(grad.to(dtype))
        ours = [shard(t.to(dtype), "zigzag", rank, world).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*ours, causal=True, layout="zigzag")
        out.backward(shard(grad.to(dtype), "zigzag", rank, world))
        with torch.no_grad():
            ref_out = multihead.attention(q, k, v, causal=True)
        for name, mine, lowp, ref in zip(
            ("output", "dq", "dk", "dv"),
            (out, *(t.grad for t in ours)),
            (textbook, *(t.grad for t in low)),
            (ref_out, *(t.grad for t in exact)),
            strict=True,
        ):
            ref_shard = shard(ref.detach(), "zigzag", rank, world)
            found[f"{dtype} {name}"] = (
                float((mine.detach().double() - ref_shard).abs().max()),
                float((shard(lowp.detach(), "zigzag", rank, world).double() - ref_shard).abs().max()),
            )
    return found


def check_rank(rank: int, world: int) -> dict:
    """Every comparison, collective count and refusal one world size runs; returned for the parent to assert."""
    report: dict = {"errors": {}, "counts": {}, "refusals": {}}
    report["low precision"] = low_precision_errors(rank, world) if world > 1 else {}
    heads = {"ulysses": [(4, 4), (4, 2), (4, 1)], "ring": [(6, 6), (6, 2), (6, 1)]}  # MHA, GQA, MQA
    functions = {"ulysses": ulysses_attention, "ring": ring_attention}
    for name, fn in functions.items():
        for h, g in heads[name] if world > 1 else heads[name][:1]:
            for layout in ("contiguous", "zigzag") if world < 4 or (h, g) == heads[name][0] else ("zigzag",):
                # every mask on MHA at P = 2 and on zigzag at P = 4; one mixing them elsewhere (the run stays short)
                every_mask = (h, g) == heads[name][0] and (world == 2 or (world == 4 and layout == "zigzag"))
                for mask_name in MASKS if every_mask else ("causal padding softcap",):
                    key = f"{name} h={h} g={g} {layout} {mask_name}"
                    report["errors"][key] = compare(fn, h, g, layout, mask_name, rank, world, seed=h + g)

    # Ulysses: all-to-alls seen by CommDebugMode, forward and backward
    q, k, v, grad, _ = problem(4, 2, 0)
    local = [shard(t, "contiguous", rank, world).requires_grad_() for t in (q, k, v)]
    with CommDebugMode() as comm:
        out = ulysses_attention(*local, causal=True)
    report["counts"]["ulysses forward"] = comm.get_total_counts()
    with CommDebugMode() as comm:
        out.backward(shard(grad, "contiguous", rank, world))
    report["counts"]["ulysses backward"] = comm.get_total_counts()

    # Ring: point-to-point exchanges (calls and bytes) counted by a wrapper; kernel calls per rank show the zigzag
    # balance; the bytes autograd saves in the forward (each storage once) show the O(n/P) training memory
    exchanges, sent, kernels = [], [], []
    original_exchange, original_attention = sequence._exchange, sequence.attention_result

    def counting_exchange(send, *args, **kwargs):
        exchanges.append(1)
        sent.append(send.numel() * send.element_size())
        return original_exchange(send, *args, **kwargs)

    def counting_attention(*args, **kwargs):
        kernels.append(1)
        return original_attention(*args, **kwargs)

    saved: dict[int, int] = {}  # storage address -> bytes, of the tensors autograd saves

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    sequence._exchange, sequence.attention_result = counting_exchange, counting_attention
    try:
        for layout in ("contiguous", "zigzag"):
            q, k, v, grad, _ = problem(6, 2, 0)
            local = [shard(t, layout, rank, world).clone().requires_grad_() for t in (q, k, v)]
            exchanges.clear(), sent.clear(), kernels.clear(), saved.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = ring_attention(*local, causal=True, layout=layout)
            counts = report["counts"]
            counts[f"ring {layout} forward sends"], counts[f"ring {layout} forward bytes"] = len(exchanges), sum(sent)
            counts[f"ring {layout} kernels"] = len(kernels)
            counts[f"ring {layout} saved bytes"] = sum(saved.values())
            exchanges.clear(), sent.clear()
            out.backward(shard(grad, layout, rank, world))
            counts[f"ring {layout} backward sends"], counts[f"ring {layout} backward bytes"] = len(exchanges), sum(sent)
        # this rank's K and V bytes (one ring buffer), and its q, k, v and output bytes (what one shard holds)
        report["counts"]["kv bytes"] = sum(t.numel() * t.element_size() for t in local[1:])
        report["counts"]["shard bytes"] = sum(t.numel() * t.element_size() for t in (*local, out))
    finally:
        sequence._exchange, sequence.attention_result = original_exchange, original_attention

    # the layer: projections local, attention across ranks; weight gradients summed over the ranks
    for method in ("ring", "ulysses"):
        for layout in ("contiguous", "zigzag"):
            torch.manual_seed(3)
            layer = multihead.MultiHeadAttention(
                7, 4, num_kv_heads=2, head_dim=6, rotary=True, dtype=torch.float64, device="cpu"
            )
            layer = layer.to(rank_device())  # initialised on the CPU: the same weights on every device
            x = torch.randn(B, N, 7, dtype=torch.float64, device="cpu").to(rank_device()).requires_grad_()
            grad = torch.randn(B, N, 7, dtype=torch.float64, device="cpu").to(rank_device())
            ref, _ = layer(x, causal=True)
            ref.backward(grad)
            ref_grads = [p.grad.clone() for p in layer.parameters()]
            layer.zero_grad()
            x_local = shard(x.detach(), layout, rank, world, dim=1).requires_grad_()
            out = SequenceParallelAttention(layer, method=method, layout=layout)(x_local, causal=True)
            out.backward(shard(grad, layout, rank, world, dim=1))
            errors = [(out - shard(ref, layout, rank, world, dim=1)).abs().max()]
            errors.append((x_local.grad - shard(x.grad, layout, rank, world, dim=1)).abs().max())
            for p, ref_grad in zip(layer.parameters(), ref_grads, strict=True):
                torch.distributed.all_reduce(p.grad)
                errors.append((p.grad - ref_grad).abs().max())
            report["errors"][f"layer {method} {layout}"] = float(torch.stack(errors).max().detach())

    if world > 1:  # refusals that depend on P; raised on every rank before any collective
        q, k, v, _, _ = problem(3, 3, 0)
        local = [shard(t, "contiguous", rank, world) for t in (q, k, v)]
        for key, call in {
            "ulysses heads": lambda: ulysses_attention(*local),
            "ulysses kv heads": lambda: ulysses_attention(local[0][:, :2].repeat(1, 3, 1, 1), *local[1:]),
            # ALiBi with positions given per query row: not the split's global ones (masks.alibi is served)
            "aligned alibi": lambda: ring_attention(
                *local,
                mask=masks.aligned_alibi(
                    torch.ones(1, 3, 1, device=rank_device()),
                    torch.zeros(1, N // world, dtype=torch.long, device=rank_device()),
                ),
            ),
            "bias": lambda: ring_attention(*local, mask=masks.bias(torch.zeros(N // world, N, device=rank_device()))),
            "odd zigzag": lambda: ring_attention(*(t[:, :, :5] for t in local), layout="zigzag"),
        }.items():
            try:
                call()
            except (ValueError, TypeError) as error:
                report["refusals"][key] = (is_input_error(error, ValueError), str(error))
            else:
                report["refusals"][key] = (False, "no error")
    return report


def check_world(world: int, device: torch.device) -> list[dict]:
    """Every rank's report for P ranks, asserted: gloo on the CPU; on --device cuda, NCCL with a GPU a rank
    (skipped where there are fewer GPUs than ranks)."""
    skip_unless_ranks_run(device, world)
    reports = run_ranks(check_rank, world, device=device)
    for rank, report in enumerate(reports):
        bad = {key: err for key, err in report["errors"].items() if not err <= TOL}
        assert not bad, f"rank {rank} of {world}: {bad}"
        # half precision: blocks computed and merged in float32 on the CPU, within the tolerance rule
        over = {
            key: (ours, lowp) for key, (ours, lowp) in report["low precision"].items() if not ours <= 2 * lowp + 1e-5
        }
        assert not over, f"rank {rank} of {world}: {over}"
        assert len(report["low precision"]) == (8 if world > 1 else 0)
        counts = report["counts"]
        assert counts["ulysses forward"] == 4, counts  # q, k, v to head shards; the output back
        assert counts["ulysses backward"] == 4, counts  # the same four, transposed
        kv_bytes, shard_bytes = counts["kv bytes"], counts["shard bytes"]
        for layout in ("contiguous", "zigzag"):
            # forward: K/V to rank + 1 at each of P - 1 steps; backward: the same P - 1, and the dK/dV
            # accumulator of each block P times (to the next rank at every step, the last to the block's owner)
            assert counts[f"ring {layout} forward sends"] == world - 1, counts
            assert counts[f"ring {layout} forward bytes"] == (world - 1) * kv_bytes, counts
            assert counts[f"ring {layout} backward sends"] == (2 * world - 1 if world > 1 else 0), counts
            assert counts[f"ring {layout} backward bytes"] == (2 * world - 1 if world > 1 else 0) * kv_bytes, counts
            # autograd keeps this rank's q, k, v, output and LSE only, never the K/V blocks of other ranks
            # (keeping them, as autograd through the ring would, is P x kv_bytes more and fails this at P = 4)
            assert counts[f"ring {layout} saved bytes"] <= 1.25 * shard_bytes, (counts, shard_bytes)
        # causal: zigzag gives every rank 3 + 2 (P - 1) blocks; contiguous gives rank r r + 1 blocks
        assert counts["ring zigzag kernels"] == 3 + 2 * (world - 1)
        assert counts["ring contiguous kernels"] == rank + 1
    return reports


@pytest.mark.portable
def test_world_1(device):
    check_world(1, device)


@pytest.mark.portable
def test_world_2_and_refusals(device):
    reports = check_world(2, device)
    refusals = reports[0]["refusals"]
    for key, fragments in {
        "ulysses heads": ("h = 3", "g = 3", "P = 2"),
        "ulysses kv heads": ("h = 6", "g = 3", "P = 2"),
        "aligned alibi": ("mask", "alibi(heads=3", "masks.alibi(slopes)"),
        "bias": ("mask", "bias(shape=", "cannot be split"),
        "odd zigzag": ("n/P = 5", "2P"),
    }.items():
        is_ours, message = refusals[key]
        assert is_ours, (key, message)
        for fragment in fragments:
            assert fragment in message, (key, fragment, message)


@pytest.mark.portable
def test_world_4(device):
    check_world(4, device)


def test_zigzag_round_trip_and_uneven_length():
    x = torch.arange(2 * 3 * 16).reshape(2, 3, 16)
    shards = [zigzag_shard(x, r, 4, dim=2) for r in range(4)]
    assert shards[1][0, 0].tolist() == [2, 3, 12, 13]  # chunks 1 and 6 of 8
    assert torch.equal(zigzag_unshard(shards, dim=2), x)
    with pytest.raises(ValueError, match=r"n = 10") as info:
        zigzag_shard(x[:, :, :10], 0, 4, dim=2)
    assert "2 * P = 8" in str(info.value) and "pad the sequence to 16" in str(info.value)
    assert is_input_error(info.value, ValueError)


def test_needs_a_process_group():
    q = torch.randn(1, 2, 4, 3)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)


def refuse_on_rank_1(rank: int, world: int) -> None:
    q = torch.randn(1, 2 if rank == 0 else 3, 4, 3)
    ulysses_attention(q, q[:, :1], q[:, :1])  # rank 1 refuses h = 3; rank 0 waits in the all-to-all


def test_a_rank_that_raises_fails_the_run():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed first[\s\S]*h = 3"):
        run_ranks(refuse_on_rank_1, 2, timeout_s=3)
    assert time.monotonic() - start < 30


def test_a_one_dimensional_device_mesh_is_its_group(tmp_path):
    """ring_attention, ulysses_attention and the layer take a 1-D DeviceMesh (one rank, in this process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
        q, k, v, _, _ = problem(4, 2, 0)
        expected = multihead.attention(q, k, v, causal=True)
        for fn in (ring_attention, ulysses_attention):
            assert (fn(q, k, v, mesh, causal=True) - expected).abs().max() <= TOL
        with pytest.raises(TypeError, match="group: expected a torch.distributed ProcessGroup"):
            ring_attention(q, k, v, "world")  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()
