"""The backend registry: kernels with one signature, looked up by name, chosen with reasons.

Every backend is a function

    fn(q, k, v, *, mask, scale, dropout, need_weights, need_lse) -> BackendOutput

with q (b, h, i, d), k (b, g, j, d), v (b, g, j, e), ``mask`` a bound
:class:`multihead.masks.BoundMask`, ``dropout`` the probability actually applied
(0.0 outside training), and returns output (b, h, i, e), plus weights (b, h, i, j)
when ``need_weights`` and the log-sum-exp (b, h, i) when ``need_lse``.

A paged call (``attention(..., pages=PageTable(...))``, :mod:`multihead.backends.paged`) has page pools for k and
v. A backend whose capabilities say ``paged`` reads them in place and is called with ``pages=`` (the table and
the call's causal flag) as well; any other backend serves it on each sequence's keys gathered in order, with the
table's mask (``PageTable.keeps``), and auto ranks it after the paged ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from multihead._errors import bad_argument
from multihead.backends._blocks import transforms_active
from multihead.backends.call import AttentionCall
from multihead.backends.costs import Estimate, call_kind
from multihead.backends.policy import current_policy


class BackendOutput(NamedTuple):
    output: torch.Tensor  # (b, h, i, e)
    weights: torch.Tensor | None = None  # (b, h, i, j)
    lse: torch.Tensor | None = None  # (b, h, i)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; :meth:`reasons` lists what it lacks for a call."""

    dtypes: frozenset[torch.dtype] | None = None  # None: every floating dtype
    device_types: frozenset[str] | None = None  # None: every device
    lse: bool = False  # returns the log-sum-exp
    weights: bool = False  # returns all weights itself (one materialised pass)
    dropout: bool = False
    # under dropout returns the weights it applied when asked (need_weights), though it returns none otherwise:
    # the call then keeps it, so asking for the weights never changes which weights were dropped
    dropout_weights: bool = False
    backward: bool = True
    bias_grad: bool = False  # gradient with respect to an additive bias
    # whole-tensor ops only, so torch.compile traces one graph for every length; the blocked kernels' Python
    # loops over blocks and heads unroll for one length instead, and auto passes them over while compiling
    compiles_dynamic: bool = True
    check: Callable[[AttentionCall], list[str]] | None = None  # backend-specific limits
    # calls it can serve but auto should not give it (measurably slower than another backend here);
    # naming the backend explicitly still runs it
    auto_skip: Callable[[AttentionCall], list[str]] | None = None
    # applies a mask's logit soft-cap (masks.softcap) to the scores; False by default, so that a backend
    # registered before soft-capping existed refuses it rather than silently dropping it
    softcap: bool = False
    # its predicted time for a call it serves (backends.costs): auto runs the cheapest of the serving backends that
    # estimate; a backend without one is chosen by priority alone
    estimate: Callable[[AttentionCall], Estimate | None] | None = None
    # runs as a Python loop over blocks (a handful of small kernels per block): on devices where launching a kernel
    # costs more than a block's work (the policy's ``fused_first``: CUDA), auto passes it over wherever a fused
    # backend serves the call
    python_block_loop: bool = False
    # runs the call as one fused kernel (torch's SDPA, compiled FlexAttention)
    fused: bool = False
    # reads keys and values in a page pool through a block table (and is called with pages=); the others serve a
    # paged call on gathered keys
    paged: bool = False
    # learned attention sinks (backends.sinks): the call folds them in from the LSE this backend returns, which it
    # must differentiate (a gradient on the LSE); False by default, so a backend registered before sinks refuses them
    sinks: bool = False
    # serves learned sinks itself instead: it is called with sinks= (the (h,) or (b, h, i) logits) and returns the
    # output (and any weights and LSE) over the keys and the sink, differentiable in the sinks
    takes_sinks: bool = False

    def reasons(self, call: AttentionCall, *, for_auto: bool = False) -> list[str]:
        missing = []
        if self.dtypes is not None and call.dtype not in self.dtypes:
            missing.append(f"dtype {call.dtype} (supports {sorted(str(d) for d in self.dtypes)})")
        if self.device_types is not None and call.device.type not in self.device_types:
            missing.append(f"device {call.device.type} (supports {sorted(self.device_types)})")
        if call.need_lse and not self.lse:
            missing.append("return_lse (it does not compute the log-sum-exp)")
        if call.dropout > 0 and not self.dropout:
            missing.append("dropout")
        applied = self.weights or (self.dropout_weights and not transforms_active())
        if call.dropout > 0 and call.weights != "none" and not applied:
            missing.append("returning the weights it applied under dropout (it never materialises them)")
        if call.requires_grad and not self.backward:
            missing.append("backward (inputs require grad)")
        if call.requires_grad and call.mask.bias_requires_grad and not self.bias_grad:
            missing.append("gradient with respect to an additive bias that requires grad")
        if call.sinks and not (self.sinks or self.takes_sinks):
            missing.append("learned attention sinks (it returns no differentiable log-sum-exp to fold them into)")
        if call.mask.softcap is not None and not self.softcap:
            missing.append("logit soft-capping (it applies no transform to the scores)")
        if self.check is not None:
            missing.extend(self.check(call))
        if for_auto and self.auto_skip is not None:
            missing.extend(self.auto_skip(call))
        if for_auto and not self.compiles_dynamic and torch.compiler.is_compiling():
            missing.append(
                "torch.compile tracing (its Python block loops would pin the sequence length; "
                "name the backend to compile it anyway)"
            )
        return missing


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable[..., BackendOutput]
    capabilities: Capabilities
    priority: int  # lower runs first under backend="auto"


@dataclass
class Explanation:
    """Which backend ``auto`` (or the named one) serves a call, and why the others do not; ``estimates`` holds
    the predicted time of each serving backend that estimates its cost (when auto compared them)."""

    chosen: str | None
    rejected: dict[str, list[str]] = field(default_factory=dict)
    estimates: dict[str, Estimate] = field(default_factory=dict)
    policy: str = ""  # the policy, the device kind and where its rates come from (auto only)
    notes: list[str] = field(default_factory=list)  # what the user should know of the choice (a slow path)

    def __str__(self) -> str:
        chosen = f"chosen: {self.chosen}"
        if self.chosen in self.estimates:
            chosen += f" ({self.estimates[self.chosen]})"
        lines = [chosen]
        for name, why in self.rejected.items():
            lines.append(f"  {name}: " + "; ".join(why))
        lines.extend(f"note: {note}" for note in self.notes)
        if self.policy:
            lines.append(self.policy)
        return "\n".join(lines)


# Below this many (query, key) pairs one block holds the whole call: no kernel skips anything, and comparing
# estimates would cost more than it could save; auto keeps the priority order
ESTIMATE_MIN_PAIRS = 256 * 256


def _serving(call: AttentionCall, for_auto: bool) -> tuple[list[Backend], dict[str, list[str]]]:
    """The backends that serve ``call`` in auto's order, and what each other one lacks; for auto, after the
    policy's rules (:func:`_fused_first`)."""
    serving, missing = [], {}
    for candidate in _auto_order(call):
        reasons = candidate.capabilities.reasons(call, for_auto=for_auto)
        if reasons:
            missing[candidate.name] = reasons
        else:
            serving.append(candidate)
    if for_auto:
        serving = _fused_first(call, serving, missing)
    return serving, missing


def _fused_first(call: AttentionCall, serving: list[Backend], missing: dict[str, list[str]]) -> list[Backend]:
    """The policy's rule: on its ``fused_first`` device types, a backend looping over blocks in Python is passed
    over (its reason added to ``missing``) wherever a fused one serves the call."""
    policy, device_type = current_policy(), call.device.type
    # a fused kernel serves a paged call only on a copy of every sequence's cache: the paged kernel is not passed over
    fused = [backend for backend in serving if backend.capabilities.fused and backend.capabilities.paged == call.paged]
    if device_type not in policy.fused_first or not fused:
        return serving
    kept = []
    for backend in serving:
        if backend.capabilities.python_block_loop:
            missing[backend.name] = [
                f"a Python loop over blocks (several small kernels per block), and {fused[0].name!r} serves this call "
                f"as a fused kernel on {device_type} (rule of policy {policy.name})"
            ]
        else:
            kept.append(backend)
    return kept


def serving_for_auto(call: AttentionCall) -> list[Backend]:
    """The backends auto may run for ``call``, in its order (after capabilities and the policy's rules)."""
    return _serving(call, for_auto=True)[0]


def _compares(call: AttentionCall, first: Backend) -> bool:
    """Whether auto compares estimates for ``call`` whose first serving backend is ``first``: not when it has no
    estimate, when every weight is asked for (the backend writing them ranks first), while tracing (sizes are
    symbols: comparing them would pin a compiled graph to one length), or for a call of one block."""
    if first.capabilities.estimate is None or call.weights == "all" or torch.compiler.is_compiling():
        return False
    return call.q_len * call.k_len >= ESTIMATE_MIN_PAIRS


def _cheapest(call: AttentionCall, serving: list[Backend]) -> tuple[Backend, dict[str, Estimate]]:
    """Auto's pick among the serving backends: the first by priority, unless it and others estimate their cost
    (and the call is big enough to matter): then the cheapest of those."""
    first = serving[0]
    if not _compares(call, first):
        return first, {}
    estimates = {}
    for candidate in serving:
        if candidate.capabilities.estimate is not None:
            estimate = candidate.capabilities.estimate(call)
            if estimate is not None:
                estimates[candidate.name] = estimate
    if first.name not in estimates:
        return first, estimates
    best = min(estimates, key=lambda name: estimates[name].seconds)  # ties: the first by priority
    return _REGISTRY[best], estimates


_REGISTRY: dict[str, Backend] = {}
_changes = 0  # how many times what a backend answers auto has changed (registered, removed, compiled, failed)


def changed() -> None:
    """Say that a backend's answers to a call may have changed (a kernel compiled or failed to): what auto decided
    for earlier calls is decided again (:func:`epoch`)."""
    global _changes
    _changes += 1


def epoch() -> tuple[int, int]:
    """What auto's decisions were made under: the registry itself and how often its backends' answers changed.
    A decision kept under another epoch is not used (``multihead.functional``'s plans)."""
    return id(_REGISTRY), _changes


def register(
    name: str,
    fn: Callable[..., BackendOutput],
    capabilities: Capabilities,
    *,
    priority: int = 50,
    replace: bool = False,
) -> None:
    """Add a backend under ``name``; ``priority`` orders ``auto`` (lower first)."""
    if not isinstance(name, str):
        raise bad_argument("name", "a string", repr(name), "name the backend with a str", kind=TypeError)
    if not name or name == "auto":
        raise bad_argument("name", "a non-empty string other than 'auto'", repr(name), "choose another name")
    if not callable(fn):
        raise bad_argument(
            "fn",
            "a callable fn(q, k, v, *, mask, scale, dropout, need_weights, need_lse)",
            repr(fn),
            "pass the kernel function",
            kind=TypeError,
        )
    if name in _REGISTRY and not replace:
        raise bad_argument("name", "a name not yet registered", repr(name), "pass replace=True to override it")
    if not isinstance(capabilities, Capabilities):
        raise bad_argument(
            "capabilities",
            "a multihead.backends.Capabilities",
            type(capabilities).__name__,
            "describe the backend with Capabilities(...)",
            kind=TypeError,
        )
    _REGISTRY[name] = Backend(name, fn, capabilities, priority)
    changed()


def unregister(name: str) -> None:
    """Remove a backend added with :func:`register`."""
    _REGISTRY.pop(get_backend(name).name)
    changed()


def available_backends() -> list[str]:
    """Registered backend names, in the order ``auto`` considers them."""
    return [b.name for b in sorted(_REGISTRY.values(), key=lambda b: b.priority)]


def get_backend(name: str) -> Backend:
    if name not in _REGISTRY:
        raise bad_argument(
            "backend",
            f"'auto' or one of {available_backends()}",
            repr(name),
            "pick a registered name, or register your own with multihead.backends.register",
        )
    return _REGISTRY[name]


def _auto_order(call: AttentionCall) -> list[Backend]:
    by_priority = sorted(_REGISTRY.values(), key=lambda b: b.priority)
    if call.paged:  # the backends reading the pages in place before those that would gather every sequence's keys
        by_priority = sorted(by_priority, key=lambda b: not b.capabilities.paged)
    if call.weights == "all":
        # with every weight asked for, one materialised pass beats a fused kernel plus recomputing them
        return sorted(by_priority, key=lambda b: not b.capabilities.weights)
    return by_priority


def _kept_without_weights(call: AttentionCall, backend: str) -> Backend | None:
    """Under dropout asking for the weights must not change the output: auto chooses as for the call without them,
    and keeps that backend where it returns the weights it applies (None where there is nothing to keep: no dropout,
    no weights, a named backend, or a choice that cannot return them, such as SDPA, whose kernel draws torch's own
    dropout stream and returns no weights: the cheapest backend that can serves the call, with its own stream)."""
    if backend != "auto" or call.dropout == 0 or call.weights == "none":
        return None
    unweighted = choose(replace(call, weights="none"), backend)
    return None if unweighted.capabilities.reasons(call, for_auto=True) else unweighted


def explain_call(call: AttentionCall, backend: str) -> Explanation:
    """The backend that serves ``call`` and, for each other one, why not."""
    if backend != "auto":
        named = get_backend(backend)
        lacks = named.capabilities.reasons(call)
        return Explanation(None if lacks else named.name, {named.name: lacks} if lacks else {})
    kept = _kept_without_weights(call, backend)
    if kept is not None:
        explanation = explain_call(replace(call, weights="none"), backend)
        explanation.notes.append(
            f"chosen as for the call without its weights ({kept.name!r} returns the weights it applies under dropout), "
            "so that asking for them does not change which weights were dropped"
        )
        return explanation
    serving, missing = _serving(call, for_auto=True)
    policy = current_policy().describe(call_kind(call))
    if not serving:
        return Explanation(None, missing, policy=policy)
    chosen, estimates = _cheapest(call, serving)
    explanation = Explanation(chosen.name, {}, estimates, policy)
    if chosen.capabilities.python_block_loop and call.device.type in current_policy().fused_first:
        explanation.notes.append(
            f"no fused kernel serves this call on {call.device.type}, so {chosen.name!r} runs it as a Python loop over "
            "blocks (several small kernels per block: far slower than a fused kernel); the reasons of the others "
            "say what to drop to reach one"
        )
    for candidate in _auto_order(call):
        name = candidate.name
        if name in missing:
            explanation.rejected[name] = missing[name]
        elif name == chosen.name:
            continue
        elif call.paged and not candidate.capabilities.paged:
            explanation.rejected[name] = [
                f"could serve on gathered keys (a copy of every sequence's cache), but {chosen.name!r} reads the pages "
                "in place"
            ]
        elif call.weights == "all" and not candidate.capabilities.weights:
            explanation.rejected[name] = [
                f"could serve, but it does not return weights itself and {chosen.name!r} writes all of them in one pass"
            ]
        elif name in estimates and chosen.name in estimates:
            explanation.rejected[name] = [
                f"could serve, {estimates[name]}; {chosen.name!r} is cheaper ({estimates[chosen.name].seconds:.3g} s)"
            ]
        else:
            explanation.rejected[name] = [f"could serve, but {chosen.name!r} ranks first"]
    return explanation


def choose(call: AttentionCall, backend: str) -> Backend:
    """The backend to run, or a ValueError naming what the requested one lacks.

    Under auto, the cheapest serving backend by their estimates (:func:`_cheapest`); the full explanation is built
    only to report failure. Under dropout, a call with weights keeps the choice of the call without them where it
    can (:func:`_kept_without_weights`).
    """
    kept = _kept_without_weights(call, backend)
    if kept is not None:
        return kept
    if backend == "auto" and call.device.type in current_policy().fused_first:
        serving = _serving(call, for_auto=True)[0]
        if serving:
            return _cheapest(call, serving)[0]
    elif backend == "auto":  # no rule to apply: the first that serves, unless estimates are compared
        order = _auto_order(call)
        for index, candidate in enumerate(order):
            if candidate.capabilities.reasons(call, for_auto=True):
                continue
            if not _compares(call, candidate):  # the hot path: the first that serves, nothing else looked at
                return candidate
            rest = [other for other in order[index + 1 :] if not other.capabilities.reasons(call, for_auto=True)]
            return _cheapest(call, [candidate, *rest])[0]
    elif not get_backend(backend).capabilities.reasons(call):
        return get_backend(backend)
    explanation = explain_call(call, backend)
    if explanation.chosen is None:
        why = "; ".join(f"{n} lacks {', '.join(r)}" for n, r in explanation.rejected.items())
        fix = "use backend='auto'" if backend != "auto" else "drop the unsupported option"
        raise bad_argument("backend", f"a backend that supports this call ({backend!r} requested)", f"none: {why}", fix)
    return _REGISTRY[explanation.chosen]
