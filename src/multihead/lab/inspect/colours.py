"""The colour scales of the reports: one for attention weights, one for signed scores.

**Attention weights**, shared by the HTML page (which receives it as data) and the PNG.

Weights in [0, 1] map through their square root onto a light-to-dark blue ramp, so the small weights that
make up most of a broad head stay visible next to a sink's 0.9. Both reports label the scale the same way:
"attention weight (square-root scale)" with ticks at 0, 0.05, 0.25, 0.5 and 1.

**Signed scores** (what `multihead circuits` draws: a share of the logit difference restored, a head's direct
logit attribution, a detector's score): ColorBrewer's diverging RdBu ramp, blue for negative through near white
at 0 to red for positive, linear in the score over [-bound, bound]; the HTML page colours its cells with
:func:`score_rgb` and the PNG draws with :func:`score_colormap`, the same stops.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "WEIGHT_STOPS",
    "WEIGHT_TICKS",
    "WEIGHT_SCALE_LABEL",
    "MASKED_RGB",
    "weight_rgb",
    "weight_rgb_pixels",
    "SCORE_STOPS",
    "score_rgb",
    "score_colormap",
]

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


# ColorBrewer's 11-class RdBu, from its negative end (dark blue) through near white to its positive end (dark red).
SCORE_STOPS: tuple[tuple[int, int, int], ...] = (
    (5, 48, 97),
    (33, 102, 172),
    (67, 147, 195),
    (146, 197, 222),
    (209, 229, 240),
    (247, 247, 247),
    (253, 219, 199),
    (244, 165, 130),
    (214, 96, 77),
    (178, 24, 43),
    (103, 0, 31),
)


def _on_ramp(stops: tuple[tuple[int, int, int], ...], share: float) -> tuple[int, int, int]:
    """The colour at ``share`` (clamped to [0, 1]) along evenly spaced ``stops``, interpolated linearly."""
    position = min(1.0, max(0.0, share)) * (len(stops) - 1)
    index = min(len(stops) - 2, math.floor(position))
    fraction = position - index
    low, high = stops[index], stops[index + 1]
    r, g, b = (round(a + fraction * (z - a)) for a, z in zip(low, high, strict=True))
    return r, g, b


def weight_rgb(weight: float) -> tuple[int, int, int]:
    """The (r, g, b) of a weight (clamped to [0, 1]) on the square-root ramp of :data:`WEIGHT_STOPS`."""
    return _on_ramp(WEIGHT_STOPS, math.sqrt(min(1.0, max(0.0, weight))))


def score_rgb(score: float, bound: float) -> tuple[int, int, int]:
    """The (r, g, b) of a signed ``score`` on :data:`SCORE_STOPS` over [-bound, bound] (clamped; ``bound`` > 0)."""
    return _on_ramp(SCORE_STOPS, (score / bound + 1.0) / 2.0)


def score_colormap() -> Any:
    """:data:`SCORE_STOPS` as a matplotlib colormap (for ``imshow(..., vmin=-bound, vmax=bound)``)."""
    from matplotlib.colors import LinearSegmentedColormap

    return LinearSegmentedColormap.from_list("multihead-scores", [tuple(c / 255 for c in rgb) for rgb in SCORE_STOPS])


def weight_rgb_pixels(weights: torch.Tensor) -> torch.Tensor:
    """:func:`weight_rgb` of every weight at once: (...) weights -> (..., 3) uint8 (the static view's thumbnails)."""
    stops = torch.tensor(WEIGHT_STOPS, dtype=torch.float32)  # (s, 3)
    position = weights.float().clamp(0, 1).sqrt() * (len(WEIGHT_STOPS) - 1)
    index = position.floor().clamp(max=len(WEIGHT_STOPS) - 2).long()
    fraction = (position - index).unsqueeze(-1)
    return (stops[index] + fraction * (stops[index + 1] - stops[index])).round().to(torch.uint8)
