"""Refuse sizes that cannot fit, before allocating: one rule for every size a caller controls.

A size is refused when the bytes it needs exceed the memory of the device it would live on (the
physical memory for the CPU, the card's memory for CUDA). Sizes on the meta device are never
refused (nothing is allocated there). The arithmetic is on Python ints, so sizes of 2**40 or more
are refused at once instead of overflowing, allocating for a minute, or filling a list.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from multihead._errors import bad_argument

__all__ = ["device_memory", "check_fits", "format_bytes"]


def device_memory(device: torch.device | str | None) -> int | None:
    """Total bytes of memory of ``device`` (None: the CPU), or None when there is no limit to apply (meta)."""
    if not isinstance(device, torch.device):
        device = torch.device("cpu") if device is None else torch.device(device)
    return _memory_of(device)


@functools.lru_cache(maxsize=None)
def _memory_of(device: torch.device) -> int | None:
    if device.type == "meta":
        return None
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # a platform without sysconf: no limit we can state
        return None


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; huge values stay readable ('8.0 TiB', '2^70 bytes')."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")
    if n < 1024:
        return f"{n} bytes"
    power = min(int(math.log(n, 1024)), len(units) - 1)
    if n >= 1024 ** len(units):
        return f"2^{n.bit_length() - 1} bytes"
    return f"{n / 1024**power:.1f} {units[power]}"


def check_fits(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str | None,
    fix: str,
    *,
    what: str = "a tensor",
) -> None:
    """Raise a ValueError naming ``name`` if ``what`` of ``shape`` and ``dtype`` cannot fit in the device's memory.

    Skipped while torch.compile traces: sizes there are symbolic, and the check is for eager calls.
    """
    if torch.compiler.is_compiling():
        return
    nbytes = math.prod(int(n) for n in shape) * dtype.itemsize
    limit = device_memory(device)
    if limit is not None and nbytes > limit:
        where = "this machine's memory" if device is None or torch.device(device).type == "cpu" else f"{device}"
        raise bad_argument(
            name,
            f"{what} to fit in {where} ({format_bytes(limit)})",
            f"shape {tuple(shape)} needing {format_bytes(nbytes)}",
            fix,
        )
