"""Every kind of mask under head parallelism: a layer with h = 8 query heads and g = 4 key/value heads sharded on 2
and 4 gloo ranks, each rank given the whole layer's mask (ALiBi slopes for all 8 heads, tensors with a head axis
of 8, a custom function reading global head numbers), equals the whole layer: output, input gradient and the
gathered q_proj weight gradient, in float64 (1e-10) and float32 (1e-5). A mask built for a rank's own heads is
refused on that rank, naming the fix."""

from __future__ import annotations

import pytest
import torch

import multihead
from distributed import rank_device, run_ranks, skip_unless_ranks_run
from multihead import masks
from multihead.parallel.heads import gather_head_weights, shard_heads

B, N, EMBED, H, G, D = 2, 8, 16, 8, 4, 4
BOUNDS = {torch.float64: 1e-10, torch.float32: 1e-5}


def head_pattern(b, h, q, kv):  # a different mask on every global head: a rank reading local numbers differs
    return (kv <= q) & ((kv >= q - h) | (h == 7))


def cases(dtype: torch.dtype) -> dict[str, tuple[masks.Mask | None, bool, dict, int]]:
    """name -> (mask, causal, layer options, batch rows): the whole layer's mask, built on the rank's device."""
    device = rank_device()
    gen = torch.Generator().manual_seed(3)
    valid = torch.rand(B, N, generator=gen) < 0.7
    valid[:, 0] = True  # every row keeps a key
    bias = torch.randn(B, H, N, N, generator=gen, dtype=dtype).to(device)
    keep = torch.rand(B, H, N, N, generator=gen) < 0.6
    keep[..., 0] = True
    slopes = torch.rand(B, H, generator=gen, dtype=dtype).to(device)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1, 1, 1]], device=device)
    return {
        "causal": (None, True, {}, B),
        "window": (masks.window(3, 0), False, {}, B),
        "padding lengths": (masks.padding(torch.tensor([N, 5], device=device)), True, {}, B),
        "padding valid": (masks.padding(valid.to(device)), False, {}, B),
        "documents ids": (masks.documents(ids), True, {}, B),
        "documents cu_seqlens": (masks.documents(cu_seqlens=[0, 3, 7, 8]), False, {}, 1),
        "alibi (h,)": (masks.alibi(masks.alibi_slopes(H).to(device, dtype)), True, {}, B),
        "alibi (b, h)": (masks.alibi(slopes), False, {}, B),
        "bias (b, h, i, j)": (masks.bias(bias), False, {}, B),
        "allowed (b, h, i, j)": (masks.allowed(keep.to(device)), False, {}, B),
        "softcap": (masks.softcap(0.5), True, {}, B),
        "custom mask_mod reading h": (masks.custom(head_pattern), False, {}, B),
        "learned sinks": (None, True, {"sinks": True}, B),
        "combination": (
            masks.alibi(masks.alibi_slopes(H).to(device, dtype))
            & masks.bias(bias)
            & masks.custom(head_pattern)
            & masks.softcap(2.0),
            True,
            {"sinks": True},
            B,
        ),
    }


def build(dtype: torch.dtype, options: dict) -> multihead.MultiHeadAttention:
    torch.manual_seed(5)
    layer = multihead.MultiHeadAttention(EMBED, H, num_kv_heads=G, head_dim=D, dtype=dtype, **options)
    if layer.sinks is not None:  # away from their initial zeros, and different on every head
        with torch.no_grad():
            layer.sinks.copy_(torch.linspace(-1.0, 2.0, H, dtype=dtype))
    return layer.to(rank_device())


def errors(rank: int, world: int) -> dict[str, object]:
    found: dict[str, object] = {}
    for dtype in BOUNDS:
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(B, N, EMBED, generator=gen, dtype=dtype).to(rank_device())
        grad = torch.randn(B, N, EMBED, generator=gen, dtype=dtype).to(rank_device())
        for name, (mask, causal, options, rows) in cases(dtype).items():
            full = build(dtype, options)
            sharded = shard_heads(full)
            mine, whole = x[:rows].clone().requires_grad_(), x[:rows].clone().requires_grad_()
            out, _ = sharded(mine, mask=mask, causal=causal)
            ref, _ = full(whole, mask=mask, causal=causal)
            out.backward(grad[:rows])
            ref.backward(grad[:rows])
            q_grad = gather_head_weights(sharded.q_proj.weight.grad, dim=0)
            measured = [(out - ref).abs().max(), (mine.grad - whole.grad).abs().max()]
            measured.append((q_grad - full.q_proj.weight.grad).abs().max())
            found[f"{name} {dtype}"] = float(torch.stack(measured).max().detach())
    # slopes for this rank's own heads (what callers built before the cut): refused, saying what to pass instead
    sharded = shard_heads(build(torch.float64, {}))
    local = masks.alibi(masks.alibi_slopes(H // world).to(rank_device(), torch.float64))
    x = torch.zeros(B, N, EMBED, dtype=torch.float64, device=rank_device())
    try:
        sharded(x, mask=local)
        found["local slopes"] = "accepted"
    except ValueError as error:
        found["local slopes"] = str(error)
    return found


@pytest.mark.portable
@pytest.mark.parametrize("world", [2, 4])
def test_every_mask_on_head_shards_equals_the_whole_layer(world, device):
    skip_unless_ranks_run(device, world)
    for rank, found in enumerate(run_ranks(errors, world, device=device)):
        message = found.pop("local slopes")
        assert f"got shape ({H // world},), {H // world} along the head axis" in message, message
        assert f"pass the slopes of all {H} query heads of the layer, e.g. alibi_slopes({H})" in message, message
        assert len(found) == 2 * len(cases(torch.float64)), found.keys()
        for name, error in found.items():
            bound = BOUNDS[torch.float64 if name.endswith("float64") else torch.float32]
            assert error < bound, (rank, name, error)
