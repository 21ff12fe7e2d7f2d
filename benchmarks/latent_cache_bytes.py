"""Bytes per token per layer: the MLA latent cache against a standard KV cache of the same model, measured.

For each model, one multihead.LatentAttention layer at the model's real sizes (random weights) decodes a short
sequence (a prompt, then single tokens, on the absorbed call) into its LatentCache; a multihead.KVCache of the
same layer's heads (h heads, keys of qk_head_dim = dn + r, values of v_head_dim) takes, step by step, the per-head
keys and values the plain call makes of the same tokens. The bytes are the held tensors' nbytes after the decode,
divided by the tokens held: cache.latent + cache.rope_keys against kv.keys[:, :, :L] + kv.values[:, :, :L].

Usage:
    python benchmarks/latent_cache_bytes.py [--dtype bfloat16] [--prompt 6] [--steps 4]

Sizes: DeepSeek-V3 from transformers' DeepseekV3Config defaults (deepseek-ai/DeepSeek-V3's config.json). Kimi K2:
moonshotai/Kimi-K2-Instruct's config.json as third-party copies of it quote it (64 heads and otherwise
DeepSeek-V3's attention sizes; the file itself was not read here). Rotary scaling (both models' yarn) changes no
cache size, and this layer runs plain rotary; the bytes do not depend on it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

import torch

import multihead
from multihead.machine import identity

MODELS = {
    "DeepSeek-V3": dict(hidden_size=7168, num_heads=128, layers=61),
    "Kimi K2": dict(hidden_size=7168, num_heads=64, layers=61),
}
# the attention sizes both share
MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def machine() -> str:
    """lscpu's model name (else /proc/cpuinfo's, through multihead.machine), with torch's threads and version."""
    name = None
    if shutil.which("lscpu"):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), None)
    return f"{name or identity().cpu}; {identity().describe()}"


def per_head_keys_values(layer: multihead.LatentAttention, latent: torch.Tensor, rope_keys: torch.Tensor):
    """What the plain call attends over for these tokens: keys (b, h, n, dn + r), values (b, h, n, e)."""
    b, n, _ = latent.shape
    h, dn, e = layer.num_heads, layer.qk_nope_head_dim, layer.v_head_dim
    kv = layer.kv_b_proj(latent).view(b, n, h, dn + e).transpose(1, 2)  # (b, h, n, dn + e)
    k_nope, values = kv.split([dn, e], dim=-1)
    keys = torch.cat((k_nope, rope_keys[:, None].expand(b, h, n, layer.qk_rope_head_dim)), dim=-1)
    return keys.contiguous(), values.contiguous()


def measure(name: str, sizes: dict, dtype: torch.dtype, prompt: int, steps: int) -> dict:
    """Decode prompt + steps tokens through one layer; the bytes each cache holds per token."""
    torch.manual_seed(0)
    layer = multihead.LatentAttention(sizes["hidden_size"], sizes["num_heads"], **MLA, dtype=dtype).eval()
    total = prompt + steps
    cache = layer.new_cache(batch_size=1, max_len=total)
    kv = multihead.KVCache(
        1, total, layer.num_heads, layer.qk_head_dim, layer.v_head_dim, dtype=dtype
    )  # the standard cache of the same heads: (b, h, L, dn + r) keys, (b, h, L, e) values
    x = torch.randn(1, total, sizes["hidden_size"], dtype=dtype)
    outputs = []
    with torch.no_grad():
        for start, size in [(0, prompt)] + [(prompt + s, 1) for s in range(steps)]:
            before = len(cache)
            outputs.append(layer(x[:, start : start + size], causal=True, cache=cache, absorb=True)[0])
            kv.append(*per_head_keys_values(layer, cache.latent[:, before:], cache.rope_keys[:, before:]))
        full = layer(x, causal=True, absorb=False)[0]  # the plain call over the whole sequence, no cache
    held = len(cache)
    latent_bytes = cache.latent.nbytes + cache.rope_keys.nbytes
    standard_bytes = kv.keys[:, :, :held].nbytes + kv.values[:, :, :held].nbytes
    drift = (torch.cat(outputs, dim=1).float() - full.float()).abs().max().item() / full.float().abs().max().item()
    return {
        "model": name,
        "heads": layer.num_heads,
        "tokens": held,
        "mla": latent_bytes // held,
        "standard": standard_bytes // held,
        "mla_storage": cache.storage.nbytes // total,
        "layers": sizes["layers"],
        "drift": drift,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--prompt", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"machine: {machine()}")
    print(f"cache dtype: {args.dtype}; batch 1; a {args.prompt}-token prompt then {args.steps} single-token steps")
    print(
        f"{'model':<12} {'h':>4} {'tokens':>6} {'MLA B/token/layer':>18} {'standard KV':>12} {'ratio':>7} "
        f"{'MLA all layers':>15} {'KV all layers':>14} {'decode vs full':>15}"
    )
    for name, sizes in MODELS.items():
        row = measure(name, sizes, dtype, args.prompt, args.steps)
        assert row["mla"] == row["mla_storage"], row  # the held views and the allocation agree per token
        print(
            f"{row['model']:<12} {row['heads']:>4} {row['tokens']:>6} {row['mla']:>18,} {row['standard']:>12,} "
            f"{row['standard'] / row['mla']:>6.1f}x {row['mla'] * row['layers']:>15,} "
            f"{row['standard'] * row['layers']:>14,} {row['drift']:>15.1e}"
        )
    print(
        "MLA: per token c + r = 512 + 64 numbers, whatever h; standard: h (dn + r + e) = h x 320. "
        "'all layers': x 61 layers (bytes per token). 'decode vs full': max |cached absorbed decode - plain full "
        "forward| / max |output|, in the cache dtype."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
