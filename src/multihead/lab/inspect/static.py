"""The report without JavaScript: what an untrusted notebook, or a browser with JavaScript off, still shows.

A notebook run by ``nbconvert --execute``, or received from someone, is not trusted: Jupyter runs none of its
scripts and passes its HTML outputs through a sanitizer that drops ``<script>``, ``<style>`` and
``<template>`` (keeping the template's markup as bare elements) and keeps inline ``style`` attributes and
``<img>`` with a ``data:`` source (JupyterLab 4.6 drops a bare ``hidden``: sanitize-html counts it among the
attributes that need a value). So every report fragment opens with this static view, built only from those:
one line on top saying how to get the interactive report, one line of facts, and the heads grid, each head a
thumbnail of its weights (an inline PNG, every query row by every key column, on the reports' one colour
scale) over its role. The interactive markup sits in an element hidden by its inline style (and by
``hidden="hidden"``, which the sanitizer keeps too), so a sanitized page does not show it as an empty
skeleton; with JavaScript the report draws into a shadow root, which hides this view.

    static_view(inspection)      # the HTML (a str); html.render_fragment puts it first in every fragment
"""

from __future__ import annotations

import html

import torch
import torch.nn.functional as F

from multihead.lab._png import png_bytes, png_data_uri
from multihead.lab._words import counted
from multihead.lab.inspect.colours import MASKED_RGB, weight_rgb_pixels
from multihead.lab.inspect.inspection import Inspection
from multihead.lab.inspect.notebook import head_grid_html
from multihead.lab.inspect.stats import PRUNED

__all__ = ["static_view", "thumbnail_png", "thumbnail_pixels", "NO_SCRIPT_NOTE", "THUMBNAIL_PIXELS"]

THUMBNAIL_PIXELS = 40  # a thumbnail's longer side, at most (a short text's cells are blown up to near it)
NO_SCRIPT_NOTE = (
    "Static view: the interactive report needs JavaScript, which this page does not run. In Jupyter, trust the "
    "notebook (File > Trust Notebook, or jupyter trust NOTEBOOK.ipynb) and run the cell again; or open the "
    "report.html that multihead inspect --out writes in a browser."
)
_LINE = "margin:2px 0;font:13px/1.4 system-ui,sans-serif;text-align:left;"


def thumbnail_pixels(weights: torch.Tensor, masked: torch.Tensor | None = None) -> torch.Tensor:
    """(h, w, 3) uint8: the picture of one head's (i, j) weights, queries down and keys across, at most
    :data:`THUMBNAIL_PIXELS` a side: a long text's cells are averaged into blocks, a short one's drawn as squares
    of several pixels.
    ``masked``: (i, j) bool, keys a causal query cannot see (drawn grey where a whole block is masked)."""
    i, j = weights.shape
    size = (min(i, THUMBNAIL_PIXELS), min(j, THUMBNAIL_PIXELS))
    weights = weights.detach().float().cpu()  # a PNG is written on the host, whatever device recorded them
    pooled = F.adaptive_avg_pool2d(weights[None, None], size)[0, 0]  # (h, w)
    pixels = weight_rgb_pixels(pooled)
    if masked is not None:
        hidden = F.adaptive_avg_pool2d(masked.float().cpu()[None, None], size)[0, 0] == 1.0
        pixels[hidden] = torch.tensor(MASKED_RGB, dtype=torch.uint8)
    scale = max(1, THUMBNAIL_PIXELS // max(size))
    return pixels.repeat_interleave(scale, dim=0).repeat_interleave(scale, dim=1)


def thumbnail_png(weights: torch.Tensor, masked: torch.Tensor | None = None) -> bytes:
    """:func:`thumbnail_pixels` as a PNG file's bytes."""
    return png_bytes(thumbnail_pixels(weights, masked))


def static_view(inspection: Inspection) -> str:
    """The report as HTML that needs no script and no stylesheet (see the module docstring)."""
    roles = inspection.role_stats.roles()
    masked = inspection.masked
    facts = [
        f"multihead inspect: {inspection.model_name}",
        *inspection.notes,
        counted(len(inspection.tokens), "token"),
        f"{counted(len(inspection.layers), 'layer')} x {counted(len(inspection.heads), 'head')}",
        f"roles from {inspection.role_stats.roles_source}",
    ]

    def image(row: int, col: int) -> str:
        return png_data_uri(thumbnail_pixels(inspection.weights[row, col], masked))

    grid = head_grid_html(
        "Heads: each one's weights (rows = queries, columns = keys) and its role",
        inspection.layers,
        inspection.heads,
        lambda row, col: None if roles[row][col].label == PRUNED else roles[row][col].text,
        images=image,
        note="role: the strongest signal (multihead.lab.inspect.roles); darker = more attention (square-root scale)",
    )
    return (
        f'<p style="{_LINE}font-weight:600">{html.escape(NO_SCRIPT_NOTE)}</p>\n'
        f'<p style="{_LINE}color:#656d76">{html.escape(" · ".join(facts))}</p>\n{grid}'
    )
