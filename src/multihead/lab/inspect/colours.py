"""The colour scales of the reports: one for attention weights, one for the pages' numbers (signed or not).

**Attention weights**, shared by the HTML page (which receives it as data) and the PNG.

Weights in [0, 1] map through their square root onto a light-to-dark blue ramp, so the small weights that
make up most of a broad head stay visible next to a sink's 0.9. Both reports label the scale the same way:
"attention weight (square-root scale)" with ticks at 0, 0.05, 0.25, 0.5 and 1.

**The pages' numbers** (:mod:`multihead.lab.inspect.page`: what `multihead circuits` draws, a share of the logit
difference restored, a head's direct logit attribution, a detector's score; and `inspect --long`'s mean weights
and entropy): :func:`value_scale` picks the scale once from the numbers' sign, and the HTML page, its PNG and the
terminal take colours, ends and printed numbers from the :class:`ValueScale` it returns.

- Some negative: ColorBrewer's diverging RdBu ramp (:data:`SCORE_STOPS`), blue for negative through near white
  at 0 to red for positive, linear over [-bound, bound] (:func:`score_rgb`, :func:`score_colormap`); the
  numbers are printed signed ("+0.53").
- None negative: the sequential ramp of :data:`SEQUENTIAL_STOPS` (ColorBrewer's Blues, the weight ramp's
  colours), near white at 0 to dark blue at the bound, linear over [0, bound]; the numbers are printed
  unsigned ("0.98"). A diverging scale would spend half its colours on values that cannot occur.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
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
    "SEQUENTIAL_STOPS",
    "ValueScale",
    "value_scale",
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


# ColorBrewer's Blues, from 0 (near white) to the bound (dark blue), linear in the value: the sequential scale of
# numbers none of which is negative.
SEQUENTIAL_STOPS: tuple[tuple[int, int, int], ...] = WEIGHT_STOPS
_LIGHT_TEXT_FROM = 0.6  # a value whose |value| / bound is at least this sits on a dark colour: its text is light


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
    return _colormap("multihead-scores", SCORE_STOPS)


def _colormap(name: str, stops: tuple[tuple[int, int, int], ...]) -> Any:
    """Evenly spaced ``stops`` as a matplotlib colormap, interpolated linearly as :func:`_on_ramp` does."""
    from matplotlib.colors import LinearSegmentedColormap

    return LinearSegmentedColormap.from_list(name, [tuple(c / 255 for c in rgb) for rgb in stops])


@dataclass(frozen=True)
class ValueScale:
    """The colour scale of a set of numbers and how they are printed (make one with :func:`value_scale`):
    ``signed`` (some number is negative) is diverging over [-bound, bound] on :data:`SCORE_STOPS`, its numbers
    printed with their sign; otherwise sequential over [0, bound] on :data:`SEQUENTIAL_STOPS`, its numbers
    unsigned. ``bound`` > 0."""

    signed: bool
    bound: float

    @property
    def low(self) -> float:
        """The value of the scale's first colour: -bound, or 0 for a sequential scale."""
        return -self.bound if self.signed else 0.0

    @property
    def high(self) -> float:
        """The value of the scale's last colour: the bound."""
        return self.bound

    @property
    def stops(self) -> tuple[tuple[int, int, int], ...]:
        """The scale's colours, evenly spaced from :attr:`low` to :attr:`high`."""
        return SCORE_STOPS if self.signed else SEQUENTIAL_STOPS

    def rgb(self, value: float) -> tuple[int, int, int]:
        """The (r, g, b) of ``value`` (clamped to [low, high])."""
        if self.signed:
            return score_rgb(value, self.bound)
        return _on_ramp(SEQUENTIAL_STOPS, value / self.bound)

    def dark(self, value: float) -> bool:
        """Whether ``value``'s colour is dark enough that text on it is drawn light."""
        return abs(value) / self.bound >= _LIGHT_TEXT_FROM

    def number(self, value: float, digits: int) -> str:
        """``value`` to ``digits`` decimals: signed ("+0.53") on a diverging scale, unsigned ("0.53") else."""
        return f"{value:+.{digits}f}" if self.signed else f"{value:.{digits}f}"

    def colormap(self) -> Any:
        """The scale as a matplotlib colormap, for ``imshow(..., vmin=scale.low, vmax=scale.high)``."""
        return score_colormap() if self.signed else _colormap("multihead-sequential", SEQUENTIAL_STOPS)


def value_scale(values: torch.Tensor | Sequence[float], bound: float | None = None) -> ValueScale:
    """The one choice of scale for ``values`` (any shape; NaN and infinities are left out): diverging when one is
    negative, else sequential from 0; over ``bound`` (None: the largest magnitude, 1 when there is none), at
    least 1e-9."""
    numbers = torch.as_tensor(values, dtype=torch.float64).detach().cpu().flatten()
    finite = numbers[numbers.isfinite()]
    signed = bool((finite < 0).any())
    if bound is None:
        bound = float(finite.abs().max()) if finite.numel() else 1.0
    return ValueScale(signed=signed, bound=max(float(bound), 1e-9))


def weight_rgb_pixels(weights: torch.Tensor) -> torch.Tensor:
    """:func:`weight_rgb` of every weight at once: (...) weights -> (..., 3) uint8 (the static view's thumbnails)."""
    stops = torch.tensor(WEIGHT_STOPS, dtype=torch.float32)  # (s, 3)
    position = weights.float().clamp(0, 1).sqrt() * (len(WEIGHT_STOPS) - 1)
    index = position.floor().clamp(max=len(WEIGHT_STOPS) - 2).long()
    fraction = (position - index).unsqueeze(-1)
    return (stops[index] + fraction * (stops[index + 1] - stops[index])).round().to(torch.uint8)
