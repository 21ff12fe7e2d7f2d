"""multihead's native CPU kernels (``attention.cpp``), compiled once on this machine at first use, and the reason when
they cannot be.

Why native kernels. Where torch's CPU kernels do more work than a call needs, and no torch op does less:

- :func:`causal_forward`. Torch's CPU flash kernel computes a causal call's keys in blocks of 512, so a packed
  document of up to 512 tokens costs its whole square (16 packed documents of 170-855 tokens: about 1.8x the pairs
  their masks keep). The native kernel walks the triangle in blocks of :data:`CAUSAL_BLOCK_ROWS` rows: the keys every
  row of a block sees in chunks of :data:`CAUSAL_BLOCK_KEYS`, then the block's own diagonal square, on the same BLAS
  sgemm torch's kernel calls. On this project's 2-core AVX-512 EPYC it ran those 16 documents 1.47x faster than
  torch's kernel (h = 8, g = 2, d = 64), and a causal n = 8,192 (h = 4) level with it (0.98-1.03x over block shapes).
  The spans backend runs its causal triangles' forward on it.
- :func:`paged_forward`. A decode step over a page pool: torch's kernels need each sequence's keys side by side, so
  the paged backend copied every page of every sequence into one tensor for the keys and one for the values, in
  every layer at every step. The native kernel reads the pages where they lie.

How they are built. ``torch.utils.cpp_extension`` compiles them with the machine's C++ compiler and ninja, for the
instruction set torch's own CPU kernels chose (``torch.backends.cpu.get_cpu_capability()``: AVX-512, AVX2 or plain
C++), into a folder named by a hash of the source, the flags and the torch version, so a changed source, torch or
instruction set builds afresh and never loads a stale library. The folder is ``$MULTIHEAD_NATIVE_DIR`` where set, else
``multihead/native`` under ``$XDG_CACHE_HOME`` (default ``~/.cache``). The first build takes about 15 s on 2 cores and
says so on stderr; later processes load the built library at once. Without a compiler, ninja or the headers, or with
``MULTIHEAD_NATIVE=0``, nothing is built and the callers run torch's kernels: :func:`unavailable_reason` says why, and
``explain`` shows it. ``pip install`` stays a plain Python install: nothing is compiled until a call needs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from multihead._errors import bad_argument, describe

# Query rows per block, and keys per chunk before a block's diagonal square. Measured on 2 threads (torch 2.13, h = 8,
# g = 2, d = 64 over 16 packed documents; h = 4, n = 8,192): 128 x 512 ran the documents in 33.0 ms against torch's
# 49.0 and the 8k call in 230 ms against 238; 64 x 256 32.8 and 248.5; 256 x 512 37.5 and 235.
CAUSAL_BLOCK_ROWS = 128
CAUSAL_BLOCK_KEYS = 512

ENABLE_ENV = "MULTIHEAD_NATIVE"
DIR_ENV = "MULTIHEAD_NATIVE_DIR"
_SOURCE = Path(__file__).with_name("attention.cpp")
_ON, _OFF = ("", "1", "on", "true", "yes"), ("0", "off", "false", "no")

# the instruction set torch chose -> the compiler flags that let ATen's Vectorized<float> use it
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_lock = threading.Lock()
_loaded: tuple[bool, str | None] | None = None  # (available, why not), once per process
_turned_off = False  # within use_native(False)


def enabled_by_environment() -> bool:
    """False where ``MULTIHEAD_NATIVE`` turns the native kernel off; a value it does not know is refused."""
    value = os.environ.get(ENABLE_ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise bad_argument(
        ENABLE_ENV,
        "1/on (the default: multihead's native CPU kernels where they build) or 0/off (torch's kernels instead)",
        repr(os.environ[ENABLE_ENV]),
        f"set {ENABLE_ENV}=0 or {ENABLE_ENV}=1, or unset it",
    )


def compile_flags() -> list[str]:
    """The flags ``attention.cpp`` is compiled with on this machine: optimized, OpenMP (ATen's parallel_for runs on the
    OpenMP torch loaded), and the instruction set of torch's own CPU kernels."""
    isa = torch.backends.cpu.get_cpu_capability()
    return ["-O3", "-fopenmp", *_ISA_FLAGS.get(isa, [])]


def build_folder() -> Path:
    """Where the library is built and found: ``$MULTIHEAD_NATIVE_DIR``, else multihead/native in the user's cache."""
    explicit = os.environ.get(DIR_ENV)
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "multihead" / "native"


def library_name() -> str:
    """The library's name, a hash of what it is built from: a changed source, flag or torch builds a new one."""
    digest = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(compile_flags()).encode(), torch.__version__.encode()):
        digest.update(part)
    return f"multihead_native_{digest.hexdigest()[:16]}"


def _load() -> tuple[bool, str | None]:
    if not enabled_by_environment():
        return False, f"is turned off by {ENABLE_ENV}={os.environ[ENABLE_ENV]}"
    try:
        name = library_name()
        folder = build_folder() / name
        built = folder / f"{name}.so"
        if built.exists():
            torch.ops.load_library(str(built))
        else:
            from torch.utils import cpp_extension  # imported only to build: it is slow to import

            folder.mkdir(parents=True, exist_ok=True)
            print(f"multihead: building its native CPU kernel once, into {folder} (about 15 s)", file=sys.stderr)
            cpp_extension.load(
                name=name,
                sources=[str(_SOURCE)],
                extra_cflags=compile_flags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                is_python_module=False,
                verbose=False,
            )
    except Exception as error:  # no source, compiler, ninja, headers or BLAS symbol: torch's kernel serves instead
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return False, f"could not be built or loaded ({type(error).__name__}: {first_line[:200]})"
    return True, None


def _status() -> tuple[bool, str | None]:
    global _loaded
    if _turned_off:
        return False, "is turned off by use_native(False)"
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _load()
    return _loaded


@contextlib.contextmanager
def use_native(enabled: bool) -> Iterator[None]:
    """Within the block, ``use_native(False)`` runs torch's kernel where the native one would serve (process-wide,
    as :func:`multihead.backends.use_policy`): to compare the two, or to rule the native kernel out of a result.
    ``use_native(True)`` restores the default (the native kernel where it is available)."""
    global _turned_off
    if not isinstance(enabled, bool):
        raise bad_argument(
            "enabled",
            "a bool (use_native(True) or use_native(False))",
            describe(enabled),
            "pass True or False",
            kind=TypeError,
        )
    before, _turned_off = _turned_off, not enabled
    try:
        yield
    finally:
        _turned_off = before


def available() -> bool:
    """Whether the native kernel is built and loaded in this process (building it on first use)."""
    return _status()[0]


def unavailable_reason() -> str | None:
    """Why the native kernel does not serve (None: it does)."""
    return _status()[1]


def serves_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`causal_forward` takes these: plain float32 CPU tensors, with the native kernel available."""
    return all(_plain_float32_on_cpu(t) for t in (q, k, v)) and available()


def serves_paged(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor) -> bool:
    """Whether :func:`paged_forward` takes these: real float32 CPU tensors that need no gradient (the kernel has no
    backward: a paged call that trains runs the Python path, which autograd differentiates)."""
    tensors = (q, key_pool, value_pool)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return all(_plain_float32_on_cpu(t) for t in tensors) and available()


def _dense_last(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as the kernels read them: each with a dense last dimension (copied where it is strided)."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def _plain_float32_on_cpu(t: torch.Tensor) -> bool:
    # the exact type (a tensor or a parameter): a fake tensor (tracing) or any other subclass keeps torch's kernels,
    # whose rules it has; and a type check costs a fraction of a fake-tensor check, on a path run by every layer of
    # every decode step
    return type(t) in _PLAIN and t.dtype == torch.float32 and t.device.type == "cpu"


def paged_forward(
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    pages: torch.Tensor,
    width: int,
    scale: float,
) -> torch.Tensor:
    """A decode step read where the pages lie: q (S, g, r, d) (the r queries of each key/value head together)
    against keys 0 .. width - 1 of each sequence's pages ``pages`` (S, C) (each a page of the pools, C * page >=
    width) in pools (P, g, page, d) and (P, g, page, e) -> output (S, g, r, e), float32. Every query sees every one
    of those keys."""
    q, key_pool, value_pool = _dense_last(q, key_pool, value_pool)
    return torch.ops.multihead_native.paged_forward(q, key_pool, value_pool, pages.long(), width, scale)


def causal_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention from the first key (row t sees keys 0..t), as torch's CPU flash kernel with is_causal:
    q (b, h, n, d), k (b, g, m, d), v (b, g, m, e) float32 on the CPU, m >= n, h a multiple of g -> output
    (b, h, n, e) and LSE (b, h, n), float32. Not differentiable itself: its callers' autograd Functions run the
    backward."""
    q, k, v = _dense_last(q, k, v)
    return torch.ops.multihead_native.causal_forward(q, k, v, scale, CAUSAL_BLOCK_ROWS, CAUSAL_BLOCK_KEYS)
