"""The one colour scale of attention weights, shared by the HTML page (which receives it as data) and the PNG.

Weights in [0, 1] map through their square root onto a light-to-dark blue ramp, so the small weights that
make up most of a broad head stay visible next to a sink's 0.9. Both reports label the scale the same way:
"attention weight (square-root scale)" with ticks at 0, 0.05, 0.25, 0.5 and 1.
"""

from __future__ import annotations

import math

import torch

__all__ = ["WEIGHT_STOPS", "WEIGHT_TICKS", "WEIGHT_SCALE_LABEL", "MASKED_RGB", "weight_rgb", "weight_rgb_pixels"]

# Evenly spaced stops of the ramp along sqrt(weight): 0 -> near white, 1 -> dark blue.
WEIGHT_STOPS: tuple[tuple[int, int, int], ...] = (
    (247, 251, 255),
    (198, 219, 239),
    (107, 174, 214),
    (33, 113, 181),
    (8, 48, 107),
)
WEIGHT_TICKS = (0.0, 0.05, 0.25, 0.5, 1.0)
WEIGHT_SCALE_LABEL = "attention weight (square-root scale)"
MASKED_RGB = (214, 218, 223)  # the grey of masked cells (keys a causal query cannot see), apart from weight 0


def weight_rgb(weight: float) -> tuple[int, int, int]:
    """The (r, g, b) of a weight (clamped to [0, 1]) on the square-root ramp of :data:`WEIGHT_STOPS`."""
    position = math.sqrt(min(1.0, max(0.0, weight))) * (len(WEIGHT_STOPS) - 1)
    index = min(len(WEIGHT_STOPS) - 2, math.floor(position))
    fraction = position - index
    low, high = WEIGHT_STOPS[index], WEIGHT_STOPS[index + 1]
    r, g, b = (round(a + fraction * (z - a)) for a, z in zip(low, high, strict=True))
    return r, g, b


def weight_rgb_pixels(weights: torch.Tensor) -> torch.Tensor:
    """:func:`weight_rgb` of every weight at once: (...) weights -> (..., 3) uint8 (the static view's thumbnails)."""
    stops = torch.tensor(WEIGHT_STOPS, dtype=torch.float32)  # (s, 3)
    position = weights.float().clamp(0, 1).sqrt() * (len(WEIGHT_STOPS) - 1)
    index = position.floor().clamp(max=len(WEIGHT_STOPS) - 2).long()
    fraction = (position - index).unsqueeze(-1)
    return (stops[index] + fraction * (stops[index + 1] - stops[index])).round().to(torch.uint8)
