"""KV cache for prefill and incremental decoding.

Keys and values are stored per key/value head g (not per query head h: a
grouped-query layer caches h/g times less) in preallocated storage
(b, g, max_len, d) and (b, g, max_len, e). Keys are stored after rotary
embedding, at their absolute positions, so nothing is re-rotated later.

A window cache (``window=W``) keeps only the last W keys: a query at position p
attends keys p - W + 1 ... p, so after each step the W most recent keys are all
a later query can need. Its storage is (b, g, W, d) whatever the total length.
"""

from __future__ import annotations

import torch

from multihead._errors import bad_argument, positive_int


class KVCache:
    """Preallocated keys (b, g, max_len, d) and values (b, g, max_len, e) for one attention layer.

    Build it with ``layer.new_cache(batch_size, max_len)``, then call
    ``layer(x, causal=True, cache=cache)`` once for the prompt and once per new
    token (or several): each call appends x's keys/values and attends over all
    cached so far.

    Example:
        >>> cache = KVCache(batch_size=2, max_len=16, num_kv_heads=2, head_dim=8)
        >>> keys, values = cache.append(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))
        >>> keys.shape, len(cache), cache.seen
        (torch.Size([2, 2, 5, 8]), 5, 5)
    """

    def __init__(self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 value_head_dim: int | None = None, *, window: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        self.batch_size = positive_int("batch_size", batch_size)
        self.max_len = positive_int("max_len", max_len)
        self.num_kv_heads = positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = positive_int("head_dim", head_dim)
        self.value_head_dim = positive_int("value_head_dim", head_dim if value_head_dim is None else value_head_dim)
        self.window = None if window is None else positive_int("window", window)
        capacity = self.max_len if self.window is None else min(self.window, self.max_len)
        self.keys = torch.zeros(batch_size, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch_size, num_kv_heads, capacity, self.value_head_dim, dtype=dtype,
                                  device=device)
        self._stored = 0  # keys held now (at most the capacity)
        self.seen = 0  # tokens appended since the last reset: the next token's absolute position

    def __len__(self) -> int:
        """Number of keys held now (for a window cache, at most the window)."""
        return self._stored

    def reset(self) -> None:
        """Forget everything; the storage is kept for reuse."""
        self._stored = 0
        self.seen = 0

    def check_compatible(self, batch_size: int, num_kv_heads: int, head_dim: int, value_head_dim: int,
                         dtype: torch.dtype, device: torch.device) -> None:
        """Raise if keys/values of these sizes cannot go into this cache."""
        for name, want, got in (("batch size", self.batch_size, batch_size),
                                ("key/value heads g", self.num_kv_heads, num_kv_heads),
                                ("head dim d", self.head_dim, head_dim),
                                ("value head dim e", self.value_head_dim, value_head_dim)):
            if want != got:
                raise bad_argument("cache", f"a cache for {name} = {got} (this call's)", f"one for {want}",
                                   "build the cache with layer.new_cache(batch_size, max_len) for this layer "
                                   "and batch")
        if dtype != self.keys.dtype or device != self.keys.device:
            raise bad_argument("cache", f"a cache of {dtype} on {device}",
                               f"one of {self.keys.dtype} on {self.keys.device}",
                               "build the cache with layer.new_cache after moving or casting the layer")

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add keys (b, g, n, d) and values (b, g, n, e); return everything to attend over.

        Returns keys (b, g, L, d) and values (b, g, L, e): views of the storage, L = len(cache)
        after the append; for a window cache, the previous min(W, seen) keys and the n new ones.
        """
        b, g, n, d = keys.shape
        self.check_compatible(b, g, d, values.shape[-1], keys.dtype, keys.device)
        if self.seen + n > self.max_len:
            raise bad_argument("cache", f"room for {n} more token(s) (max_len = {self.max_len})",
                               f"{self.seen} already appended", "build the cache with a larger max_len, "
                               "or call cache.reset() to start a new sequence")
        if self.window is None:
            self.keys[:, :, self._stored:self._stored + n] = keys
            self.values[:, :, self._stored:self._stored + n] = values
            self._stored += n
            self.seen += n
            return self.keys[:, :, :self._stored], self.values[:, :, :self._stored]
        # window: attend over the kept keys and the new ones, then keep the last W of them
        all_keys = torch.cat([self.keys[:, :, :self._stored], keys], dim=2)  # (b, g, stored + n, d)
        all_values = torch.cat([self.values[:, :, :self._stored], values], dim=2)  # (b, g, stored + n, e)
        keep = min(all_keys.shape[2], self.keys.shape[2])
        self.keys[:, :, :keep] = all_keys[:, :, -keep:]
        self.values[:, :, :keep] = all_values[:, :, -keep:]
        self._stored = keep
        self.seen += n
        return all_keys, all_values
