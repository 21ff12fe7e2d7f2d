"""KVCache on its own: exact validation before anything is written, and staged appends that count only once
committed. Sizes are pairwise distinct (b=2, g=3, d=4, e=5) so a swapped axis cannot pass."""

from __future__ import annotations

import pytest
import torch

from multihead import KVCache
from support import is_input_error

B, G, D, E = 2, 3, 4, 5


def new_cache(device: torch.device | str = "cpu", **kwargs) -> KVCache:
    return KVCache(B, 9, G, D, E, dtype=torch.float64, device=device, **kwargs)


def keys_values(n: int, seed: int = 0, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """keys (b, g, n, d) and values (b, g, n, e), drawn on the CPU and moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, G, n, D, generator=gen, dtype=torch.float64, device="cpu").to(device),
        torch.randn(B, G, n, E, generator=gen, dtype=torch.float64, device="cpu").to(device),
    )


def snapshot(cache: KVCache) -> tuple:
    return len(cache), cache.seen, cache.keys.clone(), cache.values.clone()


def assert_unchanged(cache: KVCache, before: tuple) -> None:
    assert (len(cache), cache.seen) == before[:2]
    assert torch.equal(cache.keys, before[2]) and torch.equal(cache.values, before[3])


K3, V3 = keys_values(3)
BAD_APPENDS = [
    ((K3[:1], V3[:1]), ValueError, "keys: expected shape (b, g, n, d) = (2, 3, n, 4)"),  # batch 1: no broadcast
    ((K3[:, :1], V3[:, :1]), ValueError, "keys: expected shape (b, g, n, d)"),  # one head
    ((K3[:, :, :0], V3[:, :, :0]), ValueError, "with n >= 1"),  # no token
    ((K3[0], V3[0]), ValueError, "keys: expected shape (b, g, n, d)"),  # 3-D
    ((K3.float(), V3.float()), TypeError, "keys: expected dtype torch.float64 (the dtype of the cache)"),  # no cast
    ((K3, V3.float()), TypeError, "values: expected dtype torch.float64"),
    ((K3, V3[:, :, :2]), ValueError, "values: expected n = 3 new tokens (from keys)"),  # raised before keys land
    ((K3, V3[..., :4]), ValueError, "values: expected shape (b, g, n, e) = (2, 3, n, 5)"),
    ((K3.tolist(), V3), TypeError, "keys: expected a torch.Tensor"),
    ((K3, None), TypeError, "values: expected a torch.Tensor"),
    ((K3.to("meta"), V3.to("meta")), ValueError, "keys: expected a tensor on cpu"),
]


@pytest.mark.parametrize("window", [None, 4], ids=["plain", "window"])
@pytest.mark.parametrize("index", range(len(BAD_APPENDS)))
@pytest.mark.portable
def test_bad_appends_raise_before_anything_is_written(index, window, device):
    (keys, values), kind, fragment = BAD_APPENDS[index]
    keys, values = (
        t.to(device) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t for t in (keys, values)
    )
    fragment = fragment.replace("on cpu", f"on {device}")
    cache = new_cache(device, window=window)
    cache.append(*keys_values(2, seed=1, device=device))
    before = snapshot(cache)
    with pytest.raises(kind) as excinfo:
        cache.append(keys, values)
    message = str(excinfo.value)
    assert is_input_error(excinfo.value, kind) and fragment in message and "Fix:" in message, message
    assert_unchanged(cache, before)


@pytest.mark.portable
def test_a_full_cache_refuses_more_and_keeps_what_it_holds(device):
    cache = new_cache(device)
    cache.append(*keys_values(8, device=device))
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"cache: expected room for 3 more token\(s\) \(max_len = 9\)"):
        cache.append(*keys_values(3, device=device))
    assert_unchanged(cache, before)


@pytest.mark.parametrize("window", [None, 4], ids=["plain", "window"])
@pytest.mark.portable
def test_a_staged_append_counts_only_once_committed(window, device):
    cache, reference = new_cache(device, window=window), new_cache(device, window=window)
    first, second = keys_values(3, seed=1, device=device), keys_values(2, seed=2, device=device)
    cache.append(*first)
    reference.append(*first)
    held = len(cache), cache.seen, cache.keys[:, :, : len(cache)].clone(), cache.values[:, :, : len(cache)].clone()
    pending = cache.stage(*second)
    # what to attend over already includes the new tokens; what the cache holds does not
    assert pending.keys.shape == (B, G, 5, D) and pending.values.shape == (B, G, 5, E)
    assert (len(cache), cache.seen) == held[:2]
    assert torch.equal(cache.keys[:, :, : len(cache)], held[2]) and torch.equal(
        cache.values[:, :, : len(cache)], held[3]
    )
    pending.commit()
    expected_keys, expected_values = reference.append(*second)
    assert torch.equal(pending.keys, expected_keys) and torch.equal(pending.values, expected_values)
    assert (len(cache), cache.seen) == (len(reference), reference.seen) == (4 if window else 5, 5)
    with pytest.raises(RuntimeError, match="already committed"):
        pending.commit()


@pytest.mark.portable
def test_a_stale_stage_cannot_be_committed(device):
    cache = new_cache(device)
    pending = cache.stage(*keys_values(2, device=device))
    cache.append(*keys_values(1, seed=3, device=device))
    with pytest.raises(RuntimeError, match="the cache changed between stage"):
        pending.commit()
    assert (len(cache), cache.seen) == (1, 1)


BAD_CONSTRUCTION = [
    (dict(dtype="float32"), TypeError, "dtype: expected a torch.dtype"),
    (dict(dtype=torch.int64), ValueError, "dtype: expected a real floating dtype"),
    (dict(dtype=torch.complex64), ValueError, "dtype: expected a real floating dtype"),
    (dict(device="nope"), ValueError, "device: expected a device this torch can use"),
    (dict(device=1.5), TypeError, "device: expected a torch.device"),
    (dict(max_len=2**40), ValueError, "max_len: expected the cache's storage to fit"),
]


@pytest.mark.parametrize(("kwargs", "kind", "fragment"), BAD_CONSTRUCTION)
def test_bad_construction_raises_clearly(kwargs, kind, fragment):
    arguments = dict(batch_size=B, max_len=9, num_kv_heads=G, head_dim=D) | kwargs
    with pytest.raises(kind) as excinfo:
        KVCache(**arguments)
    assert is_input_error(excinfo.value, kind) and fragment in str(excinfo.value), str(excinfo.value)


@pytest.mark.portable
def test_a_window_cache_holds_the_last_keys_only(device):
    cache = new_cache(device, window=4)
    keys, values = keys_values(7, device=device)
    cache.append(keys[:, :, :5], values[:, :, :5])
    cache.append(keys[:, :, 5:], values[:, :, 5:])
    assert (len(cache), cache.seen) == (4, 7)
    assert torch.equal(cache.keys, keys[:, :, 3:]) and torch.equal(cache.values, values[:, :, 3:])
