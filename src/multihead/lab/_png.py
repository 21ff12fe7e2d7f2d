"""PNG files from pixels, with no imaging library: the reports' inline pictures (``<img src="data:...">``)."""

from __future__ import annotations

import base64
import struct
import zlib

import torch

__all__ = ["png_bytes", "png_data_uri"]


def png_bytes(pixels: torch.Tensor) -> bytes:
    """(h, w, 3) uint8 RGB -> a PNG file's bytes (8-bit truecolour, no filter: the rows compress well)."""
    height, width, _ = pixels.shape
    rows = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), pixels.cpu().reshape(height, width * 3)], dim=1)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.contiguous().numpy().tobytes(), 9))
        + chunk(b"IEND", b"")
    )


def png_data_uri(pixels: torch.Tensor) -> str:
    """(h, w, 3) uint8 RGB as a ``data:image/png;base64,...`` address (ASCII), for an inline ``<img>``."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(pixels)).decode("ascii")
