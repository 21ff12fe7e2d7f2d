"""Typed masks under sequence parallelism (issue 48, item 4): ring and Ulysses attention with padding (key lengths
of the whole sequence, or a (b, n/P) validity shard), documents (a (b, n/P) shard of indices, or the whole packed
row's cu_seqlens), ALiBi on global positions ((h,) and (b, h) slopes, learned ones too), each with a causal mask
and with a window, all of them with soft-capping, and with learned sinks.

Each rank builds the whole problem from one seed (on the CPU, then moved: the same values on every device), runs
the parallel call on its shard, and compares its shard of the output and of dq, dk, dv (and the summed gradient
of replicated sinks and slopes) with ``multihead.attention`` on the whole sequence in one process. One
``run_ranks`` per world size runs every case, both methods and both layouts; the parent asserts the errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

import multihead
from distributed import rank_device, run_ranks, skip_unless_ranks_run
from multihead import masks
from multihead.parallel import sequence
from multihead.parallel.sequence import ring_attention, ulysses_attention, zigzag_shard
from support import is_input_error

B, H, N, D, E = 2, 12, 24, 4, 3  # N divides by 2P for P = 2, 3, 4; P divides H = 12
KV_HEADS = {2: 6, 3: 6, 4: 4}  # GQA that Ulysses splits at every P: g/P or one kv head a rank
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
ID_BASE = 2**40  # document indices no float type but float64 holds exactly: a lossy exchange merges documents
METHODS = {"ring": ring_attention, "ulysses": ulysses_attention}
LAYOUTS = ("contiguous", "zigzag")


def shard(x: torch.Tensor, layout: str, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    return zigzag_shard(x, rank, world, dim) if layout == "zigzag" else torch.chunk(x, world, dim)[rank]


def documents_ids() -> torch.Tensor:
    """(B, N) indices: row 0 four documents (5, 9, 3, 7 positions: boundaries inside shards, and documents over
    two ranks' shards); row 1 a document interrupted by another, the same index on both sides of it."""
    row0 = torch.repeat_interleave(torch.arange(4), torch.tensor([5, 9, 3, 7]))
    row1 = torch.tensor([7] * 11 + [3] * 2 + [7] * 11)
    return torch.stack([row0, row1]) + ID_BASE


CU_SEQLENS = torch.tensor([0, 5, 14, 17, 24])  # one packed row (batch 1)


def cases() -> list[dict]:
    """Every case: the whole-sequence mask, and how a rank builds its own from its shard (``local``)."""
    gen = torch.Generator().manual_seed(5)
    valid = torch.rand(B, N, generator=gen) < 0.75
    other = torch.rand(B, N, generator=gen) < 0.8
    other[1, 12:] = False  # key_padding and padding(valid) apply together
    lengths = torch.tensor([17, 5])  # key 5 onwards padded in row 1: whole shards of it padded
    ids = documents_ids()
    slopes_h = masks.alibi_slopes(H).double()
    slopes_bh = (torch.rand(B, H, generator=gen, dtype=torch.float64) + 0.1) * 0.5
    packed = masks.documents(cu_seqlens=CU_SEQLENS)

    def same(mask):  # a mask on global positions: every rank passes it as it is
        return lambda sharded: mask

    bases = {
        "padding lengths": (B, masks.padding(lengths), same(masks.padding(lengths)), None),
        "padding python lengths": (B, masks.padding([3, 20]), same(masks.padding([3, 20])), None),
        "padding valid": (B, masks.padding(valid), lambda s: masks.padding(s(valid, 1)), None),
        "padding valid & key_padding": (B, masks.padding(valid & other), lambda s: masks.padding(s(valid, 1)), other),
        "documents ids": (B, masks.documents(ids), lambda s: masks.documents(s(ids, 1)), None),
        "documents cu_seqlens": (1, packed, same(packed), None),
        "alibi (h,)": (B, masks.alibi(slopes_h), same(masks.alibi(slopes_h)), None),
        "alibi (b, h)": (B, masks.alibi(slopes_bh), same(masks.alibi(slopes_bh)), None),
    }
    found = []
    for name, (batch, full, local, key_padding) in bases.items():
        found.append(dict(name=f"{name} causal", batch=batch, causal=True, full=full, local=local, kp=key_padding))
        window = masks.window(5, 3)
        found.append(
            dict(
                name=f"{name} window",
                batch=batch,
                causal=False,
                full=full & window,
                local=lambda s, local=local, window=window: local(s) & window,
                kp=key_padding,
            )
        )
    together = masks.alibi(slopes_bh) & masks.softcap(2.0) & masks.documents(ids) & masks.padding(lengths)
    for name, causal, extra in (("together causal", True, None), ("together window sinks", False, masks.window(4, 2))):
        full = together if extra is None else together & extra

        def local(s, extra=extra):
            mask = masks.alibi(slopes_bh) & masks.softcap(2.0) & masks.documents(s(ids, 1)) & masks.padding(lengths)
            return mask if extra is None else mask & extra

        found.append(dict(name=name, batch=B, causal=causal, full=full, local=local, kp=None, sinks="sinks" in name))
    # learned slopes: their gradient is each rank's rows' share, summed over the ranks (a replicated parameter's)
    found.append(dict(name="learned alibi causal documents", batch=B, causal=True, learned=slopes_bh, ids=ids))
    found.append(dict(name="learned alibi (h,) window", batch=B, causal=False, learned=slopes_h, window=(3, 3)))
    return found


def compare(case: dict, dtype: torch.dtype, method: str, layout: str, rank: int, world: int) -> float:
    """Largest |parallel - one process| over this rank's shard of the output and of every gradient."""
    g = KV_HEADS[world]
    batch = case["batch"]
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(batch, n, N, dim, generator=gen, dtype=torch.float64) for n, dim in ((H, D), (g, D), (g, E)))
    grad = torch.randn(batch, H, N, E, generator=gen, dtype=torch.float64)
    sinks = torch.randn(H, generator=gen, dtype=torch.float64) if case.get("sinks") else None
    device = rank_device()
    q, k, v, grad = (t.to(device=device, dtype=dtype) for t in (q, k, v, grad))

    def sharded(x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        return shard(x.to(device), layout, rank, world, dim)

    learned = case.get("learned")
    leaves: list[torch.Tensor] = []  # replicated parameters: sinks, slopes
    full_leaves: list[torch.Tensor] = []
    if sinks is not None:
        full_leaves.append(sinks.to(device=device, dtype=dtype).requires_grad_())
        leaves.append(full_leaves[-1].detach().clone().requires_grad_())
    if learned is not None:
        full_leaves.append(learned.to(device=device, dtype=dtype).clone().requires_grad_())  # the case's own: untouched
        leaves.append(full_leaves[-1].detach().clone().requires_grad_())
        slope_full, slope_local = full_leaves[-1], leaves[-1]
        ids = case.get("ids")
        full_mask = masks.alibi(slope_full)
        local_mask = masks.alibi(slope_local)
        if ids is not None:
            full_mask = full_mask & masks.documents(ids)
            local_mask = local_mask & masks.documents(sharded(ids, 1))
        if "window" in case:
            full_mask = full_mask & masks.window(*case["window"])
            local_mask = local_mask & masks.window(*case["window"])
        key_padding = None
    else:
        full_mask = case["full"]
        local_mask = case["local"](lambda x, dim: sharded(x, dim))
        key_padding = None if case["kp"] is None else sharded(case["kp"], 1)
    sink_full = full_leaves[0] if sinks is not None else None
    sink_local = leaves[0] if sinks is not None else None

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = multihead.attention(*full, causal=case["causal"], mask=full_mask, sinks=sink_full)
    ref.backward(grad)
    local = [sharded(t).detach().requires_grad_() for t in (q, k, v)]
    out = METHODS[method](
        *local, causal=case["causal"], mask=local_mask, key_padding=key_padding, layout=layout, sinks=sink_local
    )
    out.backward(sharded(grad))
    diffs = [(out - sharded(ref)).abs().max()]
    diffs += [(t.grad - sharded(f.grad)).abs().max() for t, f in zip(local, full, strict=True)]
    for mine, theirs in zip(leaves, full_leaves, strict=True):
        total = mine.grad.clone()
        dist.all_reduce(total)  # every rank's share of a replicated parameter's gradient
        diffs.append((total - theirs.grad).abs().max())
    return float(torch.stack(diffs).max().detach())


def refusals(rank: int, world: int) -> dict[str, tuple[bool, str]]:
    """Each refused call's (is it our input error of the expected kind, its message); every one is raised on
    every rank before any collective."""
    device = rank_device()
    m = N // world
    q, k, v = (torch.randn(B, n, m, D, device=device, dtype=torch.float64) for n in (H, 6, 6))
    positions = torch.zeros(1, m, dtype=torch.long, device=device)
    calls = {
        "bias": (ValueError, masks.bias(torch.zeros(B, 1, m, N, device=device))),
        "allowed": (ValueError, masks.causal() & masks.allowed(torch.ones(m, N, dtype=torch.bool, device=device))),
        "custom": (ValueError, masks.custom(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)),
        "aligned alibi": (ValueError, masks.aligned_alibi(torch.ones(1, H, 1, device=device), positions)),
        "selected": (ValueError, masks.selected(torch.zeros(B, m, 2, dtype=torch.long, device=device))),
        "plain tensor": (TypeError, torch.ones(m, N, dtype=torch.bool, device=device)),
        "unsharded valid": (ValueError, masks.padding(torch.ones(B, N, dtype=torch.bool))),
        "unsharded ids": (ValueError, masks.documents(torch.zeros(B, N, dtype=torch.long))),
        "lengths past n": (ValueError, masks.padding([N + 1, 3])),
        "shard's cu_seqlens": (ValueError, masks.documents(cu_seqlens=[0, m])),  # on one packed row, below
        "cu_seqlens of batch 2": (ValueError, masks.documents(cu_seqlens=[0, 5, N])),
        "alibi of other heads": (ValueError, masks.alibi(masks.alibi_slopes(H // world))),
    }
    found = {}
    for method, fn in METHODS.items():
        for key, (kind, mask) in calls.items():
            rows = 1 if key == "shard's cu_seqlens" else B
            try:
                fn(q[:rows], k[:rows], v[:rows], mask=mask)
            except (ValueError, TypeError) as error:
                found[f"{method} {key}"] = (is_input_error(error, kind), str(error))
            else:
                found[f"{method} {key}"] = (False, "no error")
    return found


def ring_bytes(rank: int, world: int) -> dict[str, int]:
    """Bytes the ring sends (forward, backward) with a key validity and documents, counted at its point-to-point
    exchange, and the docstring's S (K and V), T (validity) and I (int64 indices) for this rank's float32 shard."""
    m = N // world
    q, k, v = (torch.randn(B, n, m, D, device=rank_device()).requires_grad_() for n in (H, 4, 4))
    ids = torch.zeros(B, m, dtype=torch.long, device=rank_device())
    mask = masks.documents(ids) & masks.padding([N, N - 3])
    sent: list[int] = []
    original = sequence._exchange

    def counting(send, *args, **kwargs):
        sent.append(send.numel() * send.element_size())
        return original(send, *args, **kwargs)

    sequence._exchange = counting
    try:
        out = ring_attention(q, k, v, causal=True, mask=mask, layout="zigzag")
        forward = sum(sent)
        sent.clear()
        out.sum().backward()
    finally:
        sequence._exchange = original
    return {"forward": forward, "backward": sum(sent), "S": 2 * B * 4 * m * D * 4, "T": B * m * 4, "I": 8 * B * m}


def check_rank(rank: int, world: int) -> dict:
    errors: dict[str, float] = {}
    for case in cases():
        # float32: the cases whose tensors a lossy exchange would break (document indices past 2**24) and the mix
        dtypes = [torch.float64]
        if case["name"] in ("documents ids causal", "together causal", "together window sinks"):
            dtypes.append(torch.float32)
        for dtype in dtypes:
            for method in METHODS:
                for layout in LAYOUTS:
                    key = f"{str(dtype)[6:]} {method} {layout} {case['name']}"
                    errors[key] = compare(case, dtype, method, layout, rank, world)
    report = {"errors": errors, "refusals": refusals(rank, world) if world == 2 else {}}
    report["bytes"] = ring_bytes(rank, world)
    return report


def check_world(world: int, device: torch.device) -> list[dict]:
    skip_unless_ranks_run(device, world)
    reports = run_ranks(check_rank, world, device=device)
    for rank, report in enumerate(reports):
        errors = report["errors"]
        assert len(errors) == 2 * 2 * (len(cases()) + 3), sorted(errors)
        bad = {
            key: err
            for key, err in errors.items()
            if not err <= TOLERANCE[torch.float32 if key.startswith("float32") else torch.float64]
        }
        assert not bad, f"rank {rank} of {world}: {bad}"
        # the ring's sends: the validity as 0/1 in k's dtype and the document indices as int64 bytes go with K/V
        sent = report["bytes"]
        kv, extra = sent["S"], sent["T"] + sent["I"]
        assert sent["forward"] == (world - 1) * (kv + extra), sent
        assert sent["backward"] == (world - 1) * (kv + extra) + world * kv, sent
    return reports


@pytest.mark.portable
def test_masks_on_2_ranks_and_refusals(device):
    reports = check_world(2, device)
    refused = reports[0]["refusals"]
    fragments = {
        "bias": ("bias(shape=", "mask", "cannot be split"),
        "allowed": ("allowed(shape=", "cannot be split"),
        "custom": ("custom(mask_mod=",),
        "aligned alibi": ("alibi(heads=", "masks.alibi(slopes)"),
        "selected": ("selected(shape=",),
        "plain tensor": ("mask", "typed mask"),
        "unsharded valid": ("padding(valid)", f"({B}, {N // 2})", f"({B}, {N})"),
        "unsharded ids": ("documents(ids)", f"({B}, {N // 2})", "sharded like q and k"),
        "lengths past n": ("padding(lengths)", f"[0, {N}]"),
        "shard's cu_seqlens": ("documents(cu_seqlens)", f"n = {N}"),
        "cu_seqlens of batch 2": ("documents(cu_seqlens)", "batch 1"),
        "alibi of other heads": ("alibi(slopes)", f"({H},)"),
    }
    assert len(refused) == 2 * len(fragments)
    for method in METHODS:
        for key, expected in fragments.items():
            ours, message = refused[f"{method} {key}"]
            assert ours, (method, key, message)
            for fragment in expected:
                assert fragment in message, (method, key, fragment, message)


@pytest.mark.portable
@pytest.mark.parametrize("world", [3, 4])
def test_masks_on_3_and_4_ranks(world, device):
    check_world(world, device)


def test_no_value_is_read_on_the_host(tmp_path):
    """Under FakeTensorMode (shapes, no values: any read of one raises), on a one-rank group: the masks' tensors
    are sharded, exchanged and evaluated by ops alone, forward and backward, as a CUDA tensor must be (a read would
    wait for the device). The harness is checked to catch a read."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with FakeTensorMode():
            ids = torch.randint(0, 3, (2, 8))
            with pytest.raises(DataDependentOutputException):
                bool(ids.any())  # the harness catches a read
            lengths, valid = torch.randint(0, 9, (2,)), torch.rand(2, 8) < 0.5
            bounds = torch.arange(0, 9, 4)  # made by an op: FakeTensorMode would remember a literal's values
            for fn in METHODS.values():
                for batch, documents in ((2, masks.documents(ids)), (1, masks.documents(cu_seqlens=bounds))):
                    q = torch.randn(batch, 4, 8, 3, requires_grad=True)
                    k, v = (torch.randn(batch, 2, 8, 3, requires_grad=True) for _ in range(2))
                    slopes = torch.rand(batch, 4, requires_grad=True)
                    mask = documents & masks.padding(lengths[:batch]) & masks.padding(valid[:batch])
                    mask = mask & masks.alibi(slopes) & masks.window(3, 1) & masks.softcap(2.0)
                    fn(q, k, v, mask=mask, layout="zigzag").sum().backward()
                    assert slopes.grad is not None and q.grad is not None
    finally:
        dist.destroy_process_group()
