"""``backend="auto"``'s dispatch policy: what the choice of a backend rests on, per kind of device.

A choice is a pure function of the call's description (:class:`multihead.backends.AttentionCall`: its device kind,
dtype, sizes, mask structure and what is asked) and of the policy, in this order:

1. **Capabilities**: what each backend serves (``Capabilities.reasons``), then the policy's rules for the device
   type: on ``fused_first`` devices (CUDA) a backend that loops over blocks in Python (``python_block_loop``) is
   passed over wherever a fused kernel serves the call.
2. **The work** each serving backend really does (:mod:`multihead.backends.costs`: the blocks it computes, a dense
   mask it builds, the weights asked for).
3. **Relative speeds** of the device kind: a static table per kind (:data:`multihead.backends.rates.RATES_BY_KIND`),
   the same on every machine of the kind. A kind with no table of its own uses the nearest one, and ``explain``
   says which.

The default policy, :data:`STATIC`, reads nothing outside the package: no calibration file, no environment. Measured
rates are opt-in: ``multihead.machine.measured_policy()`` builds a policy from this machine's
``multihead bench --calibrate`` result, and :func:`autotune` times the serving backends once per call signature and
device and keeps the winner (as ``torch.backends.cudnn.benchmark`` does). Install a policy for a block with
:func:`use_policy`, or for the process with :func:`set_policy`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from multihead._errors import bad_argument, describe
from multihead.backends.rates import RATES_BY_KIND, KernelRates, unmeasured

__all__ = [
    "DeviceKind",
    "DispatchPolicy",
    "STATIC",
    "autotune",
    "cpu_flags",
    "current_policy",
    "device_kind",
    "set_policy",
    "use_policy",
]


@dataclass(frozen=True)
class DeviceKind:
    """A kind of device, what auto's static choices are keyed on: every machine of a kind chooses alike.

    ``type``: torch's device type ("cpu", "cuda"). ``name``: the kind, "cpu-avx2", "cpu-avx512",
    "cpu-avx512-bf16" (bf16 matrix units), "cuda-sm90" (compute capability 9.0). ``model``: the device's model where
    known, for explain (never part of a decision).
    """

    type: str
    name: str
    model: str = ""

    def __str__(self) -> str:
        return f"{self.name} ({self.model})" if self.model else self.name


def _cpuinfo_fields() -> dict[str, str]:
    """The first value of each field of /proc/cpuinfo ({} off Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as lines:
            for line in lines:
                name, colon, value = line.partition(":")
                if colon:
                    fields.setdefault(name.strip(), value.strip())
    except OSError:
        return {}
    return fields


@functools.cache
def cpu_flags() -> tuple[str, frozenset[str]]:
    """(model name, flags) of this machine's CPU, read once from /proc/cpuinfo (("", {}) off Linux)."""
    info = _cpuinfo_fields()
    model = info.get("model name") or info.get("Model") or ""
    return model, frozenset((info.get("flags") or info.get("Features") or "").split())


BF16_UNIT_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def _detect_cpu_kind() -> DeviceKind:
    # the instruction set ATen's kernels run (ATEN_CPU_CAPABILITY can lower it): what the kernels' speed follows
    isa = torch.backends.cpu.get_cpu_capability().lower()
    model, flags = cpu_flags()
    name = f"cpu-{isa}" + ("-bf16" if isa == "avx512" and flags & BF16_UNIT_FLAGS else "")
    return DeviceKind("cpu", name, model)


def _detect_cuda_kind(index: int) -> DeviceKind:
    major, minor = torch.cuda.get_device_capability(index)  # cached by torch: no device sync
    return DeviceKind("cuda", f"cuda-sm{major}{minor}", torch.cuda.get_device_name(index))


_KINDS: dict[tuple[str, int | None], DeviceKind] = {}  # detected once per device, read by every eager call
# what a traced graph plans a device as: its type alone (the type's nearest table), built here so that tracing
# neither reads files or the driver nor guards on what eager calls have detected (each would cost a recompile)
_TRACED_KINDS = {name: DeviceKind(name, name) for name in ("cpu", "cuda", "meta", "mps", "xpu")}


def device_kind(device: torch.device) -> DeviceKind:
    """The kind of ``device``, detected once per device (the CPU's instruction set and flags, a GPU's capability).
    Inside a graph torch.compile traces, the device's type alone (see ``_TRACED_KINDS``): under tracing auto compares
    no estimates, and a half call's CPU precision follows the type's table."""
    if torch.compiler.is_compiling():
        return _TRACED_KINDS.get(device.type) or DeviceKind(device.type, device.type)
    key = (device.type, device.index)
    known = _KINDS.get(key)
    if known is not None:
        return known
    if device.type == "cpu":
        kind = _detect_cpu_kind()
    elif device.type == "cuda":
        kind = _detect_cuda_kind(torch.cuda.current_device() if device.index is None else device.index)
    else:
        kind = DeviceKind(device.type, device.type)
    _KINDS[key] = kind
    return kind


# The table a kind without one of its own uses: the nearest measured or published kind of its device type
NEAREST_KIND = MappingProxyType({"cpu": "cpu-avx2", "cuda": "cuda-sm80"})


@dataclass(frozen=True)
class DispatchPolicy:
    """What auto's choice rests on (see the module's docstring).

    ``name``: shown by explain ("static", "measured", ...). ``rates``: a table per device kind name; a kind without
    one uses ``nearest[device type]``'s (or none: the priority order decides). ``assume``: device type -> the kind to
    plan for instead of the one detected (to see what auto would pick on another machine, and in tests, which must
    choose alike on every CPU). ``fused_first``: device types on which a backend with ``python_block_loop`` is
    passed over wherever a ``fused`` one serves. ``autotune``: time the serving backends once per call signature
    and device and keep the fastest (:func:`autotune`).
    """

    name: str = "static"
    rates: Mapping[str, KernelRates] = field(default_factory=lambda: MappingProxyType(dict(RATES_BY_KIND)))
    nearest: Mapping[str, str] = field(default_factory=lambda: NEAREST_KIND)
    assume: Mapping[str, DeviceKind] = field(default_factory=lambda: MappingProxyType({}))
    fused_first: frozenset[str] = frozenset({"cuda"})
    autotune: bool = False
    # plain-dict copies that auto reads: torch.compile cannot read a mappingproxy in a graph that has mutated any
    # dict before it (a transformers model's forward does), and auto runs inside such graphs
    _lookup: dict[str, dict] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tables: dict[str, dict] = {
            "rates": dict(self.rates),
            "nearest": dict(self.nearest),
            "assume": dict(self.assume),
        }
        for name, table in tables.items():  # read-only views of copies: a caller's later edits do not leak in
            object.__setattr__(self, name, MappingProxyType(table))
        object.__setattr__(self, "_lookup", tables)

    def kind_of(self, device: torch.device) -> DeviceKind:
        """The kind auto plans ``device`` as: the assumed one for its type, else the detected one."""
        return self._lookup["assume"].get(device.type) or device_kind(device)

    def table_for(self, kind: DeviceKind) -> tuple[str, KernelRates]:
        """(the table's kind name, the table) ``kind``'s estimates use."""
        rates = self._lookup["rates"]
        if kind.name in rates:
            return kind.name, rates[kind.name]
        nearest = self._lookup["nearest"].get(kind.type)
        if nearest is not None and nearest in rates:
            return nearest, rates[nearest]
        return "none", unmeasured(kind.name)

    def rates_for(self, kind: DeviceKind) -> KernelRates:
        return self.table_for(kind)[1]

    def describe(self, kind: DeviceKind) -> str:
        """One line for explain: the policy, the kind, and where its numbers come from."""
        table, rates = self.table_for(kind)
        borrowed = "" if table in (kind.name, "none") else f" (no table for {kind.name}: the nearest kind's, {table})"
        tuned = "; autotune on (measured winners override the estimates)" if self.autotune else ""
        return f"policy {self.name}: device kind {kind}; rates{borrowed}: {rates.source}{tuned}"

    def with_rates(self, rates: KernelRates, *, kind: str | None = None, name: str | None = None) -> DispatchPolicy:
        """This policy with ``rates`` as ``kind``'s table (None: the table of every kind that has one or borrows
        its device type's nearest; a device type with neither keeps no rates)."""
        if not isinstance(rates, KernelRates):
            raise bad_argument(
                "rates", "a multihead.backends.rates.KernelRates", describe(rates), "build one", kind=TypeError
            )
        if kind is None:
            tables = {table: rates for table in {*self.rates, *self.nearest.values()}}
        else:
            tables = {**self.rates, kind: rates}
        return dataclasses.replace(self, rates=MappingProxyType(tables), name=name or self.name)

    def assuming(self, *kinds: DeviceKind) -> DispatchPolicy:
        """This policy planning every device of each kind's type as that kind."""
        return dataclasses.replace(self, assume=MappingProxyType({**self.assume, **{k.type: k for k in kinds}}))


STATIC = DispatchPolicy()  # the default: static tables by kind, nothing read from the machine's files

_process_policy: DispatchPolicy = STATIC
_scoped_policy: contextvars.ContextVar[DispatchPolicy | None] = contextvars.ContextVar("policy", default=None)


def _checked(policy: object) -> DispatchPolicy:
    if not isinstance(policy, DispatchPolicy):
        raise bad_argument(
            "policy",
            "a multihead.backends.policy.DispatchPolicy",
            describe(policy),
            "pass policy.STATIC, or one built from it (with_rates, assuming, machine.measured_policy())",
            kind=TypeError,
        )
    return policy


def current_policy() -> DispatchPolicy:
    """The policy auto decides with here: the innermost :func:`use_policy`, else the process's (:func:`set_policy`).
    Inside a graph torch.compile traces, the process's: reading a context variable breaks the graph."""
    if torch.compiler.is_compiling():
        return _process_policy
    scoped = _scoped_policy.get()
    return _process_policy if scoped is None else scoped


def set_policy(policy: DispatchPolicy) -> None:
    """Decide with ``policy`` from now on, in every thread (``STATIC`` restores the default)."""
    global _process_policy
    _process_policy = _checked(policy)


@contextlib.contextmanager
def use_policy(policy: DispatchPolicy) -> Iterator[DispatchPolicy]:
    """Within the block (this thread or task only), decide with ``policy``."""
    token = _scoped_policy.set(_checked(policy))
    try:
        yield policy
    finally:
        _scoped_policy.reset(token)


@contextlib.contextmanager
def autotune(enabled: bool = True) -> Iterator[DispatchPolicy]:
    """Within the block, auto times the backends that serve a call once per call signature and device (forward, and
    backward when the call needs gradients) and runs the fastest from then on; calls with dropout are left to the
    estimates (timing them would draw random numbers). Winners are kept for the process
    (:func:`forget_tuned` clears them)."""
    if not isinstance(enabled, bool):
        raise bad_argument("enabled", "True or False", describe(enabled), "pass autotune(True)", kind=TypeError)
    with use_policy(dataclasses.replace(current_policy(), autotune=enabled)) as policy:
        yield policy


# ------------------------------------------------------------------------------------------------------ autotune
# (device identity, call signature) -> the backend that was fastest; shared by threads
_tuned: dict[Hashable, str] = {}
_tuned_lock = threading.Lock()


def device_identity(device: torch.device) -> tuple:
    """What a measured winner is valid for: the CPU's model, flags and torch's threads, or the GPU's name and
    capability; with torch's (and CUDA's) version."""
    if device.type == "cpu":
        model, flags = cpu_flags()
        return ("cpu", model, flags, torch.get_num_threads(), torch.__version__)
    kind = device_kind(device)
    return (device.type, kind.name, kind.model, torch.__version__, torch.version.cuda)


def tuned_winner(key: Hashable) -> str | None:
    with _tuned_lock:
        return _tuned.get(key)


def tune(key: Hashable, seconds_of: Mapping[str, Callable[[], float]]) -> str:
    """The fastest of ``seconds_of`` (backend name -> a call timing it once, in seconds), measured once for ``key``:
    each is timed three times, interleaved, after a warm-up round; the smallest median wins (ties: the first)."""
    known = tuned_winner(key)
    if known is not None:
        return known
    names = list(seconds_of)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(4):
        for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
            elapsed = seconds_of[name]()
            if round_index:  # round 0 warms up
                times[name].append(elapsed)
    winner = min(names, key=lambda name: sorted(times[name])[len(times[name]) // 2])
    with _tuned_lock:
        return _tuned.setdefault(key, winner)


def forget_tuned() -> None:
    """Forget every measured winner (they are measured again on next use under :func:`autotune`)."""
    with _tuned_lock:
        _tuned.clear()
