"""Nothing lost on failure: a failed call leaves caches, tables and modules exactly as they were.

``test_failed_calls_leave_decoding_state_unchanged`` decodes token by token with a ``MultiHeadAttention``
and a ``KVCache`` (plain or window cache, rotary on or off, grouped heads, any backend) and, before random
steps, makes calls that must fail: a mask of the wrong shape or type, a mask for another batch or head
count, a backend that cannot serve the call (a bias that needs a gradient, dropout on a backend without
it), a capture whose query selection is out of range, an input of the wrong dtype, batch or size, bad
rotary positions, too many tokens for the cache. After each failure ``len(cache)``, ``cache.seen``, the
keys and values the cache holds (its first ``len(cache)`` slots), the layer's parameters and buffers and
its rotary tables are exactly as before; the retried good step gives the output of an uninterrupted run
(bitwise, or within 1e-6).

``test_failed_appends_leave_cache_unchanged`` does the same for ``KVCache.append`` directly, and checks
every good append against a model of the cache written here.

``test_failed_paged_calls_leave_the_pool_and_tables_unchanged`` does it for the paged cache: sequences added,
decoded together and freed at random, failing calls in between (a batch that does not match its sequences, a
mask, weights, freed or repeated sequences, a wrong dtype, more tokens than free pages, the kernel raising after
the keys were written); the free pages, tables, lengths and held keys stay as they were, and every good call
equals each sequence's own contiguous cache.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import Findings, seeds

import multihead
from multihead import KVCache, MultiHeadAttention, masks
from multihead._errors import InputError
from multihead.lab.inspect import capture

# --------------------------------------------------------------------------- snapshots


def snapshot(layer: MultiHeadAttention | None, cache: KVCache) -> dict:
    n = len(cache)
    state = {
        "len": n,
        "seen": cache.seen,
        "keys": cache.keys[:, :, :n].clone(),
        "values": cache.values[:, :, :n].clone(),
    }
    if layer is not None:
        state["parameters"] = {name: t.detach().clone() for name, t in layer.named_parameters()}
        state["buffers"] = {name: t.detach().clone() for name, t in layer.named_buffers()}  # rotary tables
        state["options"] = (layer.training, layer.backend, layer.dropout)
    return state


def differences(before: dict, after: dict) -> list[str]:
    """What changed between two snapshots, in words."""
    changed = []
    for key in ("len", "seen", "options"):
        if key in before and before[key] != after[key]:
            changed.append(f"{key} {before[key]} -> {after[key]}")
    for key in ("keys", "values"):
        if before[key].shape != after[key].shape or not torch.equal(before[key], after[key]):
            changed.append(f"stored {key} changed")
    for group in ("parameters", "buffers"):
        if group not in before:
            continue
        for name in sorted(set(before[group]) | set(after[group])):
            old, new = before[group].get(name), after[group].get(name)
            if old is None or new is None:
                changed.append(f"{group[:-1]} {name} {'appeared' if old is None else 'disappeared'}")
            elif old.shape != new.shape:
                # shapes may differ in ndim too: zip stops at the shorter, and `common` is only read when ndims agree
                common = tuple(slice(0, min(a, b)) for a, b in zip(old.shape, new.shape, strict=False))
                same = old.ndim == new.ndim and torch.equal(old[common], new[common])
                changed.append(
                    f"{group[:-1]} {name} shape {tuple(old.shape)} -> {tuple(new.shape)}"
                    + (" (old entries unchanged)" if same else "")
                )
            elif old.dtype != new.dtype or not torch.equal(old, new):
                changed.append(f"{group[:-1]} {name} changed")
    return changed


# --------------------------------------------------------------------------- failing calls


def failure_kinds(setup: dict) -> list[str]:
    kinds = [
        "mask of the wrong key length",
        "mask 'causal' (a string)",
        "int64 tensor mask",
        "padding for another batch",
        "alibi for another head count",
        "bias needing a gradient on a backend without bias gradients",
        "dropout on a backend without dropout",
        "capture of queries out of range",
        "float32 input to a float64 layer",
        "input of another batch",
        "input of another feature size",
        "need_weights='yes'",
        "more tokens than the cache has room for",
        "value without key",
    ]
    if setup["rotary"]:
        kinds += ["positions of the wrong shape", "negative positions", "float positions", "key with rotary"]
    return kinds


def failing_call(kind: str, layer: MultiHeadAttention, cache: KVCache, x: torch.Tensor, causal: bool):
    """Make a call that must raise; returns a callable and a cleanup (undoes what the test itself set)."""
    b, n, E = x.shape
    h = layer.num_heads

    def call(**kwargs):
        merged = {"cache": cache, "causal": causal, **kwargs}
        return lambda: layer(merged.pop("query", x), *merged.pop("args", ()), **merged)

    def restore_options(saved=(layer.training, layer.backend, layer.dropout)):
        layer.train(saved[0])
        layer.backend, layer.dropout = saved[1], saved[2]

    def nothing() -> None:  # the cleanup of a call that set nothing up
        pass

    if kind == "mask of the wrong key length":
        return call(mask=torch.ones(1, 1, 1, 97, dtype=torch.bool)), nothing
    if kind == "mask 'causal' (a string)":
        return call(mask="causal"), nothing
    if kind == "int64 tensor mask":
        return call(mask=torch.ones(1, 1, 1, 1, dtype=torch.long)), nothing
    if kind == "padding for another batch":
        return call(mask=masks.padding(torch.ones(b + 1, dtype=torch.long))), nothing
    if kind == "alibi for another head count":
        return call(mask=masks.alibi(masks.alibi_slopes(h + 1))), nothing
    if kind.startswith("bias needing a gradient"):

        def run():
            layer.backend = "tiled"  # lacks gradients with respect to an additive bias
            with torch.enable_grad():
                bias = masks.bias(torch.zeros(1, 1, 1, 1, requires_grad=True))
                return layer(x, cache=cache, causal=causal, mask=bias)

        return run, restore_options
    if kind == "dropout on a backend without dropout":

        def run():
            layer.backend, layer.dropout = "materialized", 0.5
            layer.train()
            return layer(x, cache=cache, causal=causal)

        return run, restore_options
    if kind == "capture of queries out of range":

        def run():
            with capture(layer, queries=[n + 2]):
                return layer(x, cache=cache, causal=causal)

        return run, nothing
    if kind == "float32 input to a float64 layer":
        return call(query=x.double()), nothing
    if kind == "input of another batch":
        return call(query=torch.cat([x, x[:1]])), nothing
    if kind == "input of another feature size":
        return call(query=torch.cat([x, x[..., :1]], -1)), nothing
    if kind == "need_weights='yes'":
        return call(need_weights="yes"), nothing
    if kind == "more tokens than the cache has room for":
        room = cache.max_len - cache.seen
        return call(query=torch.randn(b, room + 1, E)), nothing
    if kind == "value without key":
        return call(value=x), nothing
    if kind == "positions of the wrong shape":
        return call(positions=torch.arange(n + 1) + cache.seen), nothing
    if kind == "negative positions":
        return call(positions=torch.arange(n) - 10), nothing
    if kind == "float positions":
        return call(positions=torch.arange(n, dtype=torch.float32) + cache.seen), nothing
    if kind == "key with rotary":
        return call(args=(x,)), nothing
    raise AssertionError(kind)


@st.composite
def decode_setups(draw) -> dict:
    g = draw(st.sampled_from((1, 2)))
    h = g * draw(st.sampled_from((1, 2, 3)))
    d = draw(st.sampled_from((2, 4)))  # even: rotary
    setup = {
        "embed_dim": draw(st.sampled_from((5, 7))),
        "num_heads": h,
        "num_kv_heads": g,
        "head_dim": d,
        "value_head_dim": draw(st.sampled_from((3, 5))),
        "rotary": draw(st.booleans()),
        "backend": draw(st.sampled_from(("auto", "reference", "tiled", "sdpa", "materialized"))),
    }
    setup["window"] = draw(st.sampled_from((None, None, 2, 3, 5)))
    setup["batch"] = draw(st.sampled_from((1, 2, 3)))
    setup["causal"] = draw(st.sampled_from((True, True, False)))
    setup["steps"] = draw(st.lists(st.sampled_from((1, 1, 1, 2, 3)), min_size=2, max_size=6))  # prefill, then decode
    setup["max_len"] = sum(setup["steps"]) + draw(st.integers(0, 2))
    setup["seed"] = draw(seeds)
    kinds = failure_kinds(setup)
    setup["failures"] = [draw(st.lists(st.sampled_from(kinds), max_size=2)) for _ in setup["steps"]]
    return setup


def _layer(setup: dict) -> MultiHeadAttention:
    torch.manual_seed(setup["seed"])
    config = {
        k: setup[k]
        for k in ("embed_dim", "num_heads", "num_kv_heads", "head_dim", "value_head_dim", "rotary", "backend")
    }
    layer = MultiHeadAttention(**config)
    with torch.no_grad():  # biases too, so a wrong offset anywhere shows
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return layer.eval()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (torch.equal(a, b) or (a - b).abs().max().item() <= 1e-6)


def test_failed_calls_leave_decoding_state_unchanged(tally, request):
    """Decode with random failing calls in between: state exactly as before each failure, outputs as uninterrupted."""
    test = request.node.name

    @given(setup=decode_setups())
    def case(setup):
        layer = _layer(setup)
        reference_layer = copy.deepcopy(layer)
        b, E = setup["batch"], setup["embed_dim"]
        cache = layer.new_cache(b, setup["max_len"], window=setup["window"])
        reference_cache = reference_layer.new_cache(b, setup["max_len"], window=setup["window"])
        gen = torch.Generator().manual_seed(setup["seed"] + 7)
        problems = []
        for step, (n, kinds) in enumerate(zip(setup["steps"], setup["failures"], strict=True)):
            x = torch.randn(b, n, E, generator=gen)
            with torch.no_grad():
                expected = reference_layer(x, cache=reference_cache, causal=setup["causal"])[0]
            diverged = False
            for kind in kinds:
                before = snapshot(layer, cache)
                run, cleanup = failing_call(kind, layer, cache, x, setup["causal"])
                error = None
                try:
                    with torch.no_grad():
                        run()
                except Exception as raised:  # noqa: BLE001
                    error = raised
                finally:
                    cleanup()
                changed = differences(before, snapshot(layer, cache))
                where = f"step {step} ({n} token(s), {before['len']} cached): {kind}"
                if error is None:
                    tally.record(test, "bad_input_accepted", where)
                    problems.append(f"[bad_input_accepted] {where}")
                    diverged = True  # the runs have diverged: nothing more to compare
                    break
                if changed:
                    tally.record(test, "state_corrupted", f"{where}: {changed}")
                    problems.append(
                        f"[state_corrupted] {where}: {'; '.join(changed)} (raised {type(error).__name__}: {error})"
                    )
                    continue
                outcome = tally.rejection(test, error)
                if outcome != "ok":
                    problems.append(f"[{outcome}] {where}: {type(error).__name__}: {error}")
            if diverged:
                break
            try:
                with torch.no_grad():
                    out = layer(x, cache=cache, causal=setup["causal"])[0]
            except Exception as error:  # noqa: BLE001
                tally.record(test, "crash", f"step {step}: the good call raised {type(error).__name__}: {error}")
                problems.append(f"[crash] step {step}: the good call raised {type(error).__name__}: {error}")
                break
            if close(out, expected):
                tally.record(test, "ok")
            else:
                diff = (out - expected).abs().max().item() if out.shape == expected.shape else "shape"
                tally.record(test, "wrong", f"step {step} after {kinds}: off by {diff}")
                problems.append(f"[wrong] step {step} (after {kinds}): output off the uninterrupted run by {diff}")
        findings.add(*(f"{problem} | setup: {setup}" for problem in problems))

    findings = Findings()
    case()
    findings.check()


# --------------------------------------------------------------------------- KVCache.append


def bad_appends(b, g, d, e, dtype, room):
    """(label, keys, values) that append must refuse, for a cache (b, g, ., d) / (., e) of dtype."""
    k, v = torch.randn(b, g, 2, d, dtype=dtype), torch.randn(b, g, 2, e, dtype=dtype)
    other = torch.float64 if dtype == torch.float32 else torch.float32
    cases = [
        ("values of length 1 (keys 2)", k, v[:, :, :1]),
        ("values of length 3 (keys 2)", k, torch.cat([v, v[:, :, :1]], 2)),
        ("keys 3-D", k[0], v),
        ("values 3-D", k, v[0]),
        (f"values {other}", k, v.to(other)),
        (f"keys {other}", k.to(other), v),
        ("keys a list", k.tolist(), v),
        ("values None", k, None),
        ("keys int64", k.long(), v),
        (f"keys head dim {d + 1}", torch.randn(b, g, 2, d + 1, dtype=dtype), v),
        (
            f"{room + 1} tokens, room for {room}",
            torch.randn(b, g, room + 1, d, dtype=dtype),
            torch.randn(b, g, room + 1, e, dtype=dtype),
        ),
    ]
    if b > 1:
        cases += [("values of batch 1", k, v[:1]), ("keys of batch 1", k[:1], v)]
    if g > 1:
        cases += [("values of one head", k, v[:, :1]), ("keys of one head", k[:, :1], v)]
    return cases


def test_failed_appends_leave_cache_unchanged(tally, request):
    """Appends interleaved with bad ones: each bad one raises an InputError and changes nothing; good ones
    return what a cache modelled here holds."""
    test = request.node.name

    @given(
        b=st.sampled_from((1, 2, 3)),
        g=st.sampled_from((1, 2, 3)),
        d=st.sampled_from((2, 4)),
        e=st.sampled_from((3, 5)),
        window=st.sampled_from((None, 1, 2, 4)),
        dtype=st.sampled_from((torch.float32, torch.float64)),
        plan=st.lists(st.tuples(st.sampled_from((1, 2, 3)), st.integers(0, 99)), min_size=1, max_size=5),
        seed=seeds,
    )
    def case(b, g, d, e, window, dtype, plan, seed):
        max_len = sum(n for n, _ in plan)
        cache = KVCache(b, max_len, g, d, e, window=window, dtype=dtype)
        gen = torch.Generator().manual_seed(seed)
        held_k, held_v = torch.empty(b, g, 0, d, dtype=dtype), torch.empty(b, g, 0, e, dtype=dtype)
        problems = []
        for n, pick in plan:
            room = max_len - cache.seen
            cases = bad_appends(b, g, d, e, dtype, room)
            label, bad_k, bad_v = cases[pick % len(cases)]
            before = snapshot(None, cache)
            error = None
            try:
                cache.append(bad_k, bad_v)
            except Exception as raised:  # noqa: BLE001
                error = raised
            changed = differences(before, snapshot(None, cache))
            where = f"{label} (b={b}, g={g}, d={d}, e={e}, window={window}, {before['len']} held)"
            if error is None:
                tally.record(test, "bad_input_accepted", where)
                problems.append(f"[bad_input_accepted] {where}")
                break
            if changed:
                tally.record(test, "state_corrupted", f"{where}: {changed}")
                problems.append(f"[state_corrupted] {where}: {'; '.join(changed)} ({type(error).__name__}: {error})")
                break
            outcome = tally.rejection(test, error)
            if outcome != "ok":
                problems.append(f"[{outcome}] {where}: {type(error).__name__}: {error}")
            # the good append
            k = torch.randn(b, g, n, d, generator=gen, dtype=torch.float64).to(dtype)
            v = torch.randn(b, g, n, e, generator=gen, dtype=torch.float64).to(dtype)
            seen = cache.seen
            try:
                keys, values = cache.append(k, v)
            except Exception as raised:  # noqa: BLE001
                tally.record(test, "crash", f"good append raised {type(raised).__name__}: {raised}")
                problems.append(f"[crash] a good append of {n} raised {type(raised).__name__}: {raised}")
                break
            attend_k, attend_v = torch.cat([held_k, k], 2), torch.cat([held_v, v], 2)
            keep = attend_k.shape[2] if window is None else min(window, attend_k.shape[2])
            held_k, held_v = attend_k[:, :, -keep:], attend_v[:, :, -keep:]
            right = (
                torch.equal(keys, attend_k)
                and torch.equal(values, attend_v)
                and len(cache) == keep
                and cache.seen == seen + n
                and torch.equal(cache.keys[:, :, :keep], held_k)
                and torch.equal(cache.values[:, :, :keep], held_v)
            )
            tally.record(test, "ok" if right else "wrong", "" if right else f"append of {n} after {label}")
            if not right:
                problems.append(
                    f"[wrong] the good append of {n} after {label}: returned or held keys differ "
                    f"from the model (len {len(cache)} vs {keep}, seen {cache.seen} vs {seen + n})"
                )
                break
        findings.add(*problems)

    findings = Findings()
    case()
    findings.check()


def test_failed_append_through_layer_leaves_cache_unchanged(tally, request):
    """A layer call whose attention fails after the keys were projected: the cache is as before (the issue's
    first example: a wrong mask shape on a decode step advanced len(cache) and seen). Only the cache is compared
    here; the fuzz test above compares the layer's tables too."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(6, 3, num_kv_heads=1, rotary=True).eval()
    cache = layer.new_cache(2, 8)
    x = torch.randn(2, 5, 6)
    with torch.no_grad():
        layer(x[:, :3], causal=True, cache=cache)
        before = snapshot(None, cache)
        error = None
        try:
            layer(x[:, 3:4], causal=True, cache=cache, mask=torch.ones(2, 1, 1, 9, dtype=torch.bool))
        except Exception as raised:  # noqa: BLE001
            error = raised
        changed = differences(before, snapshot(None, cache))
        fresh = layer.new_cache(2, 8)
        layer(x[:, :3], causal=True, cache=fresh)
        expected = layer(x[:, 3:4], causal=True, cache=fresh)[0]
        out = layer(x[:, 3:4], causal=True, cache=cache)[0]
    test = request.node.name
    if error is None:
        tally.record(test, "bad_input_accepted", "mask of key length 9")
    elif changed:
        tally.record(test, "state_corrupted", str(changed))
    else:
        tally.rejection(test, error)
    assert isinstance(error, InputError), f"expected an InputError, got {error!r}"
    assert not changed, f"the failed call changed {changed}"
    assert close(out, expected), f"retry off by {(out - expected).abs().max().item()}"


def test_attention_failure_changes_no_input(tally, request):
    """``attention`` that raises (a mask of the wrong shape, a backend that cannot serve) leaves q, k, v and the
    mask tensors untouched."""
    test = request.node.name

    # what each backend does not serve: sdpa returns no LSE, materialized has no dropout
    unserved = {"sdpa": {"return_lse": True}, "materialized": {"dropout": 0.3, "training": True}}

    @given(seed=seeds, backend=st.sampled_from(sorted(unserved)))
    def case(seed, backend):
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (
            torch.randn(2, 4, 3, 5, generator=gen),
            torch.randn(2, 2, 6, 5, generator=gen),
            torch.randn(2, 2, 6, 7, generator=gen),
        )
        bias = torch.randn(2, 1, 3, 6, generator=gen)
        saved = [t.clone() for t in (q, k, v, bias)]
        error = None
        try:
            multihead.attention_result(q, k, v, mask=masks.bias(bias), backend=backend, **unserved[backend])
        except Exception as raised:  # noqa: BLE001
            error = raised
        unchanged = all(torch.equal(a, b) for a, b in zip(saved, (q, k, v, bias), strict=True))
        if error is None:
            tally.record(test, "bad_input_accepted", f"{backend} with {unserved[backend]}")
        elif not unchanged:
            tally.record(test, "state_corrupted", f"{backend}: an input tensor changed")
        else:
            tally.rejection(test, error)
        if not (isinstance(error, InputError) and unchanged):
            findings.add(f"{backend}: raised {error!r}, inputs unchanged: {unchanged}")

    findings = Findings()
    case()
    findings.check()


# --------------------------------------------------------------------------- the paged cache


def paged_snapshot(cache) -> tuple:
    """What counts in a paged cache: its free pages, every sequence's table, length and position, and the keys and
    values its tables hold."""
    held = []
    for handle in cache.sequences:
        pages, length = cache.pages(handle), cache.length(handle)
        keys = cache.keys[pages].transpose(1, 2).reshape(-1, cache.num_kv_heads, cache.head_dim)[:length]
        values = cache.values[pages].transpose(1, 2).reshape(-1, cache.num_kv_heads, cache.value_head_dim)[:length]
        held.append((handle, tuple(pages), length, cache.seen(handle), keys.clone(), values.clone()))
    return tuple(cache._free), held


def paged_unchanged(before: tuple, after: tuple) -> bool:
    return (
        before[0] == after[0]
        and len(before[1]) == len(after[1])
        and all(
            a[:4] == b[:4] and torch.equal(a[4], b[4]) and torch.equal(a[5], b[5])
            for a, b in zip(before[1], after[1], strict=True)
        )
    )


PAGED_FAILURES = (
    "a row more than sequences",
    "a mask",
    "a freed sequence",
    "a sequence twice",
    "float32 input to a float64 layer",
    "more tokens than free pages",
    "the kernel failing",
)


def paged_failing_call(kind, layer, cache, handles, freed, x, page_size):
    """The call of ``kind`` (:data:`PAGED_FAILURES`) on the sequences ``handles``, which must fail."""
    batch = cache.batch(handles)
    calls = {
        "a row more than sequences": lambda: layer(torch.cat([x, x[:1]]), causal=True, cache=batch),
        "a mask": lambda: layer(x, causal=True, cache=batch, mask=masks.causal()),
        "a freed sequence": lambda: cache.batch([*handles, *(freed or [10**6])]),
        "a sequence twice": lambda: cache.batch([handles[0], *handles]),
        "float32 input to a float64 layer": lambda: layer(x.float(), causal=True, cache=batch),
        "more tokens than free pages": lambda: layer(
            torch.randn(len(handles), cache.num_pages * page_size + 1, 8, dtype=torch.float64), causal=True, cache=batch
        ),
        "the kernel failing": lambda: layer(x, causal=True, cache=batch),
    }
    return calls[kind]


def test_failed_paged_calls_leave_the_pool_and_tables_unchanged(tally, request, monkeypatch):
    """Sequences added, decoded together and freed, with failing calls in between: after each failure the free
    pages, every block table, length and held key are as before, and every good call gives what each sequence's
    own contiguous cache gives."""
    import multihead.backends.paged

    test = request.node.name
    real_kernel = multihead.backends.paged._paged_kernel

    @given(
        page_size=st.sampled_from((1, 2, 3, 5)),
        window=st.sampled_from((None, None, 3)),
        rotary=st.booleans(),
        plan=st.lists(
            st.tuples(st.sampled_from(("add", "decode", "decode", "free")), st.integers(1, 4), st.integers(0, 99)),
            min_size=2,
            max_size=10,
        ),
        failures=st.lists(st.sampled_from(PAGED_FAILURES), min_size=1, max_size=6),
        seed=seeds,
    )
    def case(page_size, window, rotary, plan, failures, seed):
        torch.manual_seed(seed)
        layer = MultiHeadAttention(8, 4, num_kv_heads=2, rotary=rotary, dtype=torch.float64).eval()
        cache = layer.new_paged_cache(num_pages=40, page_size=page_size, window=window)
        contiguous: dict[int, KVCache] = {}
        freed: list[int] = []
        gen = torch.Generator().manual_seed(seed + 1)
        problems: list[str] = []
        for step, (action, n, pick) in enumerate(plan):
            if contiguous and failures:
                kind = failures.pop(0)
                handles = list(contiguous)
                x = torch.randn(len(handles), 1, 8, generator=gen, dtype=torch.float64)
                call = paged_failing_call(kind, layer, cache, handles, freed, x, page_size)

                def broken(*args, **kwargs):
                    raise RuntimeError("the kernel failed")

                if kind == "the kernel failing":
                    monkeypatch.setattr(multihead.backends.paged, "_paged_kernel", broken)
                before = paged_snapshot(cache)
                error = None
                try:
                    with torch.no_grad():
                        call()
                except Exception as raised:  # noqa: BLE001
                    error = raised
                finally:
                    monkeypatch.setattr(multihead.backends.paged, "_paged_kernel", real_kernel)
                where = f"step {step}: {kind} (page {page_size}, window {window}, {len(handles)} sequences)"
                if error is None:
                    tally.record(test, "bad_input_accepted", where)
                    problems.append(f"[bad_input_accepted] {where}")
                    break
                if not paged_unchanged(before, paged_snapshot(cache)):
                    tally.record(test, "state_corrupted", where)
                    problems.append(f"[state_corrupted] {where} ({type(error).__name__}: {error})")
                    break
                if kind != "the kernel failing":
                    outcome = tally.rejection(test, error)
                    if outcome != "ok":
                        problems.append(f"[{outcome}] {where}: {type(error).__name__}: {error}")
            with torch.no_grad():
                if action == "add":
                    handle = cache.add()
                    contiguous[handle] = layer.new_cache(1, 64, window=window)
                    x = torch.randn(1, n, 8, generator=gen, dtype=torch.float64)
                    got = layer(x, causal=True, cache=cache.batch([handle]))[0]
                    expected = [layer(x, causal=True, cache=contiguous[handle])[0]]
                elif action == "decode" and contiguous:
                    handles = list(contiguous)
                    x = torch.randn(len(handles), 1, 8, generator=gen, dtype=torch.float64)
                    got = layer(x, causal=True, cache=cache.batch(handles))[0]
                    expected = [layer(x[r : r + 1], causal=True, cache=contiguous[h])[0] for r, h in enumerate(handles)]
                elif action == "free" and contiguous:
                    handle = list(contiguous)[pick % len(contiguous)]
                    cache.free(handle)
                    del contiguous[handle]
                    freed.append(handle)
                    continue
                else:
                    continue
            right = close(got, torch.cat(expected))
            tally.record(test, "ok" if right else "wrong", "" if right else f"step {step}: {action}")
            if not right:
                problems.append(f"[wrong] step {step}: {action} differs from the contiguous caches")
                break
        findings.add(*problems)

    findings = Findings()
    case()
    findings.check()
