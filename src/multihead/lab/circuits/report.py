"""What `multihead circuits` prints and writes: each command's result as one :class:`~multihead.lab.inspect.page.Page`,
shown in the terminal, written as an HTML page and a PNG, beside its data as JSON.

    page = patching_page(result, facts={"model": "gpt2", "clean": ..., ...}, columns=tokens)
    print_page(console, page)                                   # the terminal's tables
    written = write_report(data, "patching", out_dir, ["json", "html", "png"], page)

One page, four formats, drawn by :mod:`multihead.lab.inspect.page` (``print_page``, ``write_report`` and
``plot_grids`` come from there): the terminal prints each grid as a table (a row per layer, the larger half by
magnitude in bold) and each table; ``<name>.html`` is the page; ``<name>.png`` draws the page's grids as heatmaps
on the same colour scale, or, for the logit lens, which has no grid, its table, shaded as in the page (with
matplotlib; left out without it); ``<name>.json`` holds ``data``.
``patching.json`` holds the result
(:meth:`~multihead.lab.circuits.PatchingResult.to_dict`) with its scores under ``"heads"`` (by head) or
``"positions"`` (by position) — layers x heads, or layers x positions, of the normalised logit difference
recovered, (patched - corrupt) / (clean - corrupt), at the last position; null where a layer has no such head —
and the prompts it was run with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from multihead._errors import bad_argument
from multihead.lab.circuits.detectors import DETECTORS, SINK_THRESHOLD, HeadDetection
from multihead.lab.circuits.lens import LogitAttribution
from multihead.lab.circuits.patching import PatchingResult
from multihead.lab.inspect.page import Grid, Page, Table, plot_grids, print_page, write_report

__all__ = [
    "FORMATS",
    "check_formats",
    "patching_page",
    "patching_data",
    "dla_page",
    "lens_page",
    "detect_page",
    "print_page",
    "plot_grids",
    "write_report",
]

FORMATS = ("terminal", "html", "json", "png")
METHODS = {"exact": "activation patching", "attribution": "attribution patching", "path": "path patching"}
# Below this |clean - corrupt| (in nats: the two runs' odds of answer over wrong differ by under 10%) a share divides
# by a difference that one head's noise can match: the shares are printed with a note that they cannot be read.
SMALL_DIFFERENCE = 0.1
WHATS = {"z": "output z", "pattern": "pattern", "q": "queries", "k": "keys", "v": "values"}
DETECTOR_TITLES = {
    "previous_token": "previous-token score (attention from each token to the one before it)",
    "duplicate_token": "duplicate-token score (attention to earlier copies of the same token)",
    "induction": "induction score (attention to the token after an earlier copy of the current one)",
    "sink": f"first-token share (a sink head above {SINK_THRESHOLD}, Gu et al. 2024)",
}


def check_formats(formats: str | Sequence[str], allowed: Sequence[str] = FORMATS) -> list[str]:
    """``formats`` ("terminal,json" or a list) as a list of ``allowed`` formats, or a ValueError naming ``format``."""
    names = [name.strip() for name in formats.split(",")] if isinstance(formats, str) else list(formats)
    names = [name for name in names if name]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise bad_argument(
            "format", f"one or more of {', '.join(allowed)}", repr(formats), "pass e.g. --format terminal,json"
        )
    return list(dict.fromkeys(names))


def patching_page(
    result: PatchingResult, facts: Mapping[str, str] | None = None, *, columns: Sequence[str] | None = None
) -> Page:
    """The page of a patching sweep: one grid (layers x heads, or layers x positions labelled ``columns``)."""
    what = WHATS[result.what]
    if result.method == "path":
        title = f"path patching into the receivers' {what}: each earlier head as a sender"
    else:
        title = f"{METHODS[result.method]} of each {result.by}'s {what}"
    title += f": share of the logit difference restored (clean {result.clean:.3f}, corrupt {result.corrupt:.3f})"
    grid = Grid(
        title,
        result.scores,
        across=result.by,
        label="share of the logit difference restored",
        columns=columns if result.by == "position" else None,
    )
    notes = [
        "(patched - corrupt) / (clean - corrupt) at the last position: 1 restores the clean answer, 0 does nothing"
    ]
    gap = abs(result.clean - result.corrupt)
    if gap < SMALL_DIFFERENCE:
        notes.append(
            f"note: clean - corrupt is only {gap:.3g} nats (under {SMALL_DIFFERENCE}): the shares divide by it, so "
            "they are too noisy to read. Fix: corrupt the part of the prompt the answer depends on, or choose an "
            "answer and a wrong token the model tells apart"
        )
    return Page(f"multihead circuits: {METHODS[result.method]}", dict(facts or {}), grids=[grid], notes=notes)


def patching_data(result: PatchingResult, facts: Mapping[str, object] | None = None) -> dict:
    """``patching.json``: the result with its scores under "heads" or "positions", and ``facts``."""
    data = result.to_dict()
    scores = data.pop("scores")
    data["heads" if result.by == "head" else "positions"] = scores
    return data | dict(facts or {})


def dla_page(found: LogitAttribution, answer: str, wrong: str, facts: Mapping[str, str] | None = None) -> Page:
    """The page of a direct logit attribution: the heads' grid and a table of the layers' totals."""
    title = (
        f"direct logit attribution at the last position: each head's share of logit({answer!r}) - "
        f"logit({wrong!r}) = {found.difference:.3f}"
    )
    layers = Table(
        "each attention layer's direct effect (its heads and its output bias)",
        ("layer", "direct effect"),
        [(f"layer {layer}", float(value)) for layer, value in enumerate(found.layers.tolist())],
    )
    notes = [
        f"the residual's parts through the final norm, linearised at the residual, sum to {found.explained:.3f}; "
        f"the model's logit difference is {found.difference:.3f}"
    ]
    grid = Grid(title, found.heads, label="direct effect on the logit difference")
    return Page("multihead circuits: direct logit attribution", dict(facts or {}), [grid], [layers], notes)


def lens_page(
    rows: Sequence[str], top: Sequence[Sequence[str]], differences, facts: Mapping[str, str] | None = None
) -> Page:
    """The page of the logit lens: a row per residual read, its likeliest tokens and (when given) the logit
    difference there."""
    header = ["after", "likeliest tokens", *(["answer - wrong"] if differences is not None else [])]
    table_rows = []
    for index, (row, tokens) in enumerate(zip(rows, top, strict=True)):
        cells: list[str | float] = [row, " ".join(repr(token) for token in tokens)]
        if differences is not None:
            cells.append(float(differences[index]))
        table_rows.append(cells)
    table = Table("logit lens at the last position: the likeliest tokens read after each layer", header, table_rows)
    return Page("multihead circuits: logit lens", dict(facts or {}), tables=[table])


def detect_page(found: HeadDetection, sequences: int, facts: Mapping[str, str] | None = None) -> Page:
    """The page of the head detectors: a grid per detector and the sink share, each on [0, 1]."""
    grids = [
        Grid(
            f"{DETECTOR_TITLES[name]}, on {sequences} repeated random sequences",
            getattr(found, name),
            bound=1.0,
            label="score" if name != "sink" else "share of attention on the first token",
        )
        for name in (*DETECTORS, "sink")
    ]
    note = f"sink heads (share above {SINK_THRESHOLD}): {found.sink_heads() or 'none'}"
    named = found.named_heads()
    roles = Table(
        "the heads the detectors name: their role in multihead inspect (a score at or above the role's threshold)",
        ("head", "role", "score"),
        [(f"L{entry['layer']} H{entry['head']}", entry["role"], entry["score"]) for entry in named],
    )
    notes = [note] + ([] if named else ["no head reaches a detector's threshold"])
    return Page("multihead circuits: head detectors", dict(facts or {}), grids, [roles] if named else [], notes)
