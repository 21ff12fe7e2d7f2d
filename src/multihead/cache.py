"""KV cache for prefill and incremental decoding.

Keys and values are stored per key/value head g (not per query head h: a
grouped-query layer caches h/g times less) in preallocated storage
(b, g, max_len, d) and (b, g, max_len, e). Keys are stored after rotary
embedding, at their absolute positions, so nothing is re-rotated later.

A window cache (``window=W``) keeps only the last W keys: a query at position p
attends keys p - W + 1 ... p, so after each step the W most recent keys are all
a later query can need. Its storage is (b, g, W, d) whatever the total length.

Nothing is lost on failure: :meth:`KVCache.stage` validates and prepares an append
without changing what the cache holds, and :meth:`PendingAppend.commit` makes it
count. The layer commits only after its whole call succeeded, so a call that raises
(a bad mask, a backend that cannot serve it, ...) leaves ``len(cache)``, ``seen`` and
every stored key and value as they were. (A plain cache stages the new keys in its
free slots past ``len(cache)``, which hold nothing yet.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from multihead._errors import bad_argument, floating_dtype, positive_int, usable_device
from multihead._inputs import matching, tensor_argument
from multihead._limits import check_fits


def checked_layout(
    num_kv_heads: object, head_dim: object, value_head_dim: object, window: object, dtype: object, device: object
) -> tuple[int, int, int, int | None, torch.dtype, torch.device | None]:
    """A KV cache's layout, each argument checked and named: (g, d, e, window or None, dtype, device or None for
    torch's default); ``e`` defaults to ``d``. What a contiguous cache and a paged pool both take."""
    heads = positive_int("num_kv_heads", num_kv_heads)
    dim = positive_int("head_dim", head_dim)
    value_dim = positive_int("value_head_dim", dim if value_head_dim is None else value_head_dim)
    kept = None if window is None else positive_int("window", window)
    return (
        heads,
        dim,
        value_dim,
        kept,
        floating_dtype("dtype", dtype, allow_none=False),
        usable_device("device", device),
    )


def check_fitting(
    what: str,
    sizes: tuple[tuple[str, int, int], ...],
    storage: tuple[torch.dtype, torch.device],
    call: tuple[torch.dtype, torch.device],
    size_fix: str,
    storage_fix: str,
) -> None:
    """Raise, naming ``cache``, unless a call's sizes ((name, the cache's, the call's) each) and its dtype and
    device (``call``) are the cache's (``storage``): what a KV cache and a paged cache's batch both check."""
    for name, want, got in sizes:
        if want != got:
            raise bad_argument("cache", f"{what} for {name} = {got} (this call's)", f"one for {want}", size_fix)
    if call != storage:
        raise bad_argument(
            "cache", f"{what} of {call[0]} on {call[1]}", f"one of {storage[0]} on {storage[1]}", storage_fix
        )


@dataclass
class PendingAppend:
    """An append prepared by :meth:`KVCache.stage`: what to attend over now, and how to make it count.

    keys (b, g, L, d) and values (b, g, L, e) are every key/value the new queries attend over.
    """

    keys: torch.Tensor
    values: torch.Tensor
    cache: KVCache
    new: int  # tokens appended
    stored_before: int
    seen_before: int
    committed: bool = False

    def commit(self) -> None:
        """Make the append count: the cache now holds the new keys and values."""
        self.cache._commit(self)


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

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        value_head_dim: int | None = None,
        *,
        window: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        self.batch_size = positive_int("batch_size", batch_size)
        self.max_len = positive_int("max_len", max_len)
        self.num_kv_heads, self.head_dim, self.value_head_dim, self.window, dtype, device = checked_layout(
            num_kv_heads, head_dim, value_head_dim, window, dtype, device
        )
        capacity = self.max_len if self.window is None else min(self.window, self.max_len)
        check_fits(
            "max_len",
            (self.batch_size, self.num_kv_heads, capacity, self.head_dim + self.value_head_dim),
            dtype,
            device,
            "use a smaller max_len (or window) or batch_size",
            what="the cache's storage",
        )
        self.keys = torch.zeros(batch_size, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch_size, num_kv_heads, capacity, self.value_head_dim, dtype=dtype, device=device)
        self._stored = 0  # keys held now (at most the capacity)
        self.seen = 0  # tokens appended since the last reset: the next token's absolute position

    def __len__(self) -> int:
        """Number of keys held now (for a window cache, at most the window)."""
        return self._stored

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return (
            f"KVCache(batch_size={self.batch_size}, max_len={self.max_len}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, value_head_dim={self.value_head_dim}{window}, held={len(self)}, "
            f"seen={self.seen})"
        )

    def reset(self) -> None:
        """Forget everything; the storage is kept for reuse."""
        self._stored = 0
        self.seen = 0

    def check_compatible(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        value_head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Raise if keys/values of these sizes cannot go into this cache."""
        check_fitting(
            "a cache",
            (
                ("batch size", self.batch_size, batch_size),
                ("key/value heads g", self.num_kv_heads, num_kv_heads),
                ("head dim d", self.head_dim, head_dim),
                ("value head dim e", self.value_head_dim, value_head_dim),
            ),
            (self.keys.dtype, self.keys.device),
            (dtype, torch.device(device)),
            "build the cache with layer.new_cache(batch_size, max_len) for this layer and batch",
            "build the cache with layer.new_cache after moving or casting the layer",
        )

    def check_room(self, new_tokens: int) -> None:
        """Raise if ``new_tokens`` more tokens would exceed max_len."""
        if self.seen + new_tokens > self.max_len:
            raise bad_argument(
                "cache",
                f"room for {new_tokens} more token(s) (max_len = {self.max_len})",
                f"{self.seen} already appended",
                "build the cache with a larger max_len, or call cache.reset() to start a new sequence",
            )

    def _check_new(self, keys: object, values: object) -> int:
        """Validate keys (b, g, n, d) and values (b, g, n, e) exactly (no broadcast, no cast); returns n."""
        new_keys = self._check_one("keys", keys, "d", self.head_dim)
        new_values = self._check_one("values", values, "e", self.value_head_dim)
        if new_values.shape[2] != new_keys.shape[2]:
            raise bad_argument(
                "values",
                f"n = {new_keys.shape[2]} new tokens (from keys)",
                new_values.shape[2],
                "give keys and values the same number of new tokens",
            )
        return new_keys.shape[2]

    def _check_one(self, name: str, t: object, last_axis: str, last: int) -> torch.Tensor:
        """Validate one of keys (b, g, n, d) or values (b, g, n, e): type, dtype, device and shape."""
        layout = f"(b, g, n, {last_axis}) = ({self.batch_size}, {self.num_kv_heads}, n, {last})"
        t = tensor_argument(name, t, fix=f"pass {name} as a tensor {layout}")
        matching(
            name, t, self.keys, "the cache", fix=f"convert with {name}.to(cache.keys), or build the cache to match"
        )
        if (
            t.ndim != 4
            or tuple(t.shape[:2]) != (self.batch_size, self.num_kv_heads)
            or t.shape[3] != last
            or t.shape[2] < 1
        ):
            raise bad_argument(
                name,
                f"shape {layout} with n >= 1",
                f"shape {tuple(t.shape)}",
                "give every batch row and key/value head, one entry per new token",
            )
        return t

    def stage(self, keys: torch.Tensor, values: torch.Tensor) -> PendingAppend:
        """Validate and prepare appending keys (b, g, n, d) and values (b, g, n, e); nothing counts until
        :meth:`PendingAppend.commit`. ``len(self)``, ``seen`` and the keys held are unchanged here.

        The pending append's keys (b, g, L, d) and values (b, g, L, e) are everything to attend over:
        L = len(cache) + n, or for a window cache the kept min(W, seen) keys and the n new ones.
        """
        n = self._check_new(keys, values)
        self.check_room(n)
        stored = self._stored
        if self.window is None:
            # the free slots past len(self) hold nothing yet: writing there changes nothing that counts
            self.keys[:, :, stored : stored + n] = keys
            self.values[:, :, stored : stored + n] = values
            all_keys, all_values = self.keys[:, :, : stored + n], self.values[:, :, : stored + n]
        else:  # attend over the kept keys and the new ones; commit keeps the last W of them
            all_keys = torch.cat([self.keys[:, :, :stored], keys], dim=2)  # (b, g, stored + n, d)
            all_values = torch.cat([self.values[:, :, :stored], values], dim=2)  # (b, g, stored + n, e)
        return PendingAppend(all_keys, all_values, self, n, stored, self.seen)

    def _commit(self, pending: PendingAppend) -> None:
        if pending.committed:
            raise RuntimeError("this cache append was already committed")
        if (self._stored, self.seen) != (pending.stored_before, pending.seen_before):
            raise RuntimeError(
                "the cache changed between stage() and commit(): another append or reset came in between; stage again"
            )
        if self.window is None:
            self._stored += pending.new
        else:
            keep = min(pending.keys.shape[2], self.keys.shape[2])
            self.keys[:, :, :keep] = pending.keys[:, :, -keep:]
            self.values[:, :, :keep] = pending.values[:, :, -keep:]
            self._stored = keep
        self.seen += pending.new
        pending.committed = True

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add keys (b, g, n, d) and values (b, g, n, e) now; return everything to attend over.

        Returns keys (b, g, L, d) and values (b, g, L, e): L = len(cache) after the append; for a
        window cache, the previous min(W, seen) keys and the n new ones. Invalid keys or values
        raise before anything is written.
        """
        pending = self.stage(keys, values)
        pending.commit()
        return pending.keys, pending.values
