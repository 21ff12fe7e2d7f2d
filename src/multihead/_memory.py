"""Large fresh CPU tensors on transparent huge pages: the first write without a page fault per 4 KiB.

A kernel that writes a large new tensor once (the materialised backend's (b, h, i, j) weights) pays for
its first touch: the kernel maps every 4 KiB page on its first write, one fault each. For the 192 MiB of
weights of 12 heads at n = 2048 that is 49k faults, about 75 ms on this project's 2-core machine, more
than the softmax over the same tensor; filling it took 100 ms against 25 ms with 2 MiB pages
(BENCHMARKS.md). Linux maps 2 MiB pages where a region is advised ``MADV_HUGEPAGE`` and transparent huge
pages are in "madvise" mode, which is the default of many distributions and this machine's. torch's own
allocator does the same only when ``THP_MEM_ALLOC_ENABLE=1`` is set before its first allocation, which a
library cannot arrange for its users.

The advice changes how pages are mapped, never what the tensor holds; when it cannot be given (another
OS, THP off or "always", a tensor without real storage) the tensor is the plain ``torch.empty`` one.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
HUGE_PAGE_BYTES = 2 << 20
# glibc serves every allocation this large from a mapping of its own (32 MiB is the ceiling of its dynamic
# mmap threshold on 64-bit systems), so the advice covers no other allocation and ends with the tensor
MIN_ADVISED_BYTES = 32 << 20
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise when advising huge pages has an effect here, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        mode = THP_MODE_FILE.read_text()
    except OSError:
        return None
    if "[madvise]" not in mode:  # "[always]": every large mapping gets them anyway; "[never]": none can
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for 2 MiB pages over the whole huge pages inside ``t``'s untouched storage; True when asked.

    Only for a tensor that was just allocated and not yet written: pages already mapped stay 4 KiB.
    """
    nbytes = t.untyped_storage().nbytes() if t.device.type == "cpu" else 0
    if nbytes < MIN_ADVISED_BYTES or torch.compiler.is_compiling() or (madvise := _madvise()) is None:
        return False
    try:
        start = t.untyped_storage().data_ptr()
    except RuntimeError:  # fake or meta storage (tracing, export): there are no pages
        return False
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = (start + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return last > first and madvise(first, last - first, MADV_HUGEPAGE) == 0


def empty_written_once(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape)`` for a large tensor about to be written in full: on huge pages where possible."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t
