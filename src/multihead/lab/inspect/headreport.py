"""Tables, plots and files for ``multihead heads importance|prune|syntax`` (the CLI only parses and calls)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.table import Table

from multihead._errors import bad_argument
from multihead._figures import Written, draw_figure, fitted_title, print_written, pyplot, save_figure
from multihead._titled_table import TitledTable
from multihead._userfiles import (
    NON_NEGATIVE_INT,
    NUMBER,
    STRING,
    Grid,
    ListOf,
    MapOf,
    OptionalKey,
    Rule,
    existing_folder,
    output_folder,
    path_kind,
    read_json,
    writing,
)
from multihead.lab._words import counted
from multihead.lab.inspect.importance import HeadImportance
from multihead.lab.inspect.recording import head_numbers
from multihead.lab.inspect.roles import HeadRelation
from multihead.lab.inspect.syntax import (
    DIRECTIONS,
    SyntaxScores,
    relations_by_head,
)

__all__ = [
    "importance_table",
    "importance_figure",
    "ranked_line",
    "IMPORTANCE_SCALE",
    "IMPORTANCE_UNIT",
    "write_importance",
    "load_importance",
    "curve_table",
    "write_curve",
    "heads_at_fidelity",
    "report_columns",
    "report_relations",
    "ScoresFolder",
    "read_scores_folder",
    "syntax_table",
    "write_syntax",
    "print_written",
]

IMPORTANCE_FILE = "importance.json"
CURVE_FILE = "pruning.json"
SYNTAX_FILE = "syntax.json"


# Importance scores are small ((1 - cosine) of a few thousandths): every view a person reads (the terminal table,
# the "most important" line, importance.png, the HTML report's column) shows them x IMPORTANCE_SCALE and says so;
# importance.json keeps the raw scores.
IMPORTANCE_SCALE = 1000.0
IMPORTANCE_UNIT = "x 1000"


def ranked_line(importance: HeadImportance, count: int = 8) -> str:
    """The ``count`` most important heads in one line, at the table's scale: "L3H2 4.1, L0H5 2.0 (scores x 1000)"."""
    top = ", ".join(
        f"L{layer}H{head} {score * IMPORTANCE_SCALE:.1f}" for layer, head, score in importance.ranking()[:count]
    )
    return f"{top} (scores {IMPORTANCE_UNIT})"


def importance_figure(importance: HeadImportance) -> Any:
    """The matplotlib Figure of importance.png: the layer x head grid of the scores x IMPORTANCE_SCALE (as the
    terminal table shows them), its colour bar labelled so."""
    plt = pyplot("importance.png")
    figure, axis = plt.subplots(figsize=(8, 4))
    image = axis.imshow(importance.scores.numpy() * IMPORTANCE_SCALE, cmap="magma", aspect="auto")
    axis.set(xlabel="head", ylabel="layer")
    fitted_title(axis, f"head importance: {importance.metric}")
    axis.set_xticks(range(importance.scores.shape[1]))
    axis.set_yticks(range(importance.scores.shape[0]))
    figure.colorbar(image, ax=axis, label=f"score {IMPORTANCE_UNIT}")
    return figure


def importance_table(
    scores: torch.Tensor, title: str, scale: float = IMPORTANCE_SCALE, *, kept: list[list[int]] | None = None
) -> Table:
    """Rows layers, columns heads (the checkpoint's numbers): scores x ``scale`` (IMPORTANCE_SCALE, which
    ``title`` should say); "-" where not measured. ``kept``: each layer's heads (a pruned model's
    ``head_ids``); the others read "pruned"."""
    table = TitledTable(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
    table.add_column("L", justify="right", style="bold")
    for head in range(scores.shape[1]):
        table.add_column(f"h{head}", justify="right")
    top = set(torch.topk(torch.nan_to_num(scores, nan=-1.0).flatten(), k=min(5, scores.numel())).indices.tolist())
    for layer in range(scores.shape[0]):
        cells = []
        for head in range(scores.shape[1]):
            value = float(scores[layer, head])
            if kept is not None and head not in kept[layer]:
                cells.append("[dim]pruned[/dim]")
                continue
            text = "-" if value != value else f"{value * scale:.1f}"
            cells.append(f"[bold red]{text}[/bold red]" if layer * scores.shape[1] + head in top else text)
        table.add_row(str(layer), *cells)
    return table


def write_importance(importance: HeadImportance, out_dir: Path, *, source: str) -> Written:
    """importance.json and importance.png (a layer x head heatmap) in ``out_dir``."""
    data = {
        **importance.as_dict(),
        "source": source,
        "ranking": [{"layer": layer, "head": head, "score": score} for layer, head, score in importance.ranking()],
    }

    return _write_files(out_dir, IMPORTANCE_FILE, data, lambda plt: importance_figure(importance), allow_nan=False)


def _write_files(
    out_dir: Path, json_name: str, data: object, draw: Callable[[Any], Any], *, allow_nan: bool = True
) -> Written:
    """``json_name`` (``data`` as JSON) and the PNG of the same stem with the figure ``draw(pyplot)`` returns, in
    the user's --out folder (created now; a failed write names --out).

    Returns {"json": path, "png": path}; without matplotlib the PNG is left out, in the result's ``skipped``
    (:func:`print_written` prints the one line that says so).
    """
    output_folder("--out", out_dir)
    paths = Written(json=out_dir / json_name)
    text = json.dumps(data, indent=1, allow_nan=allow_nan)
    with writing("--out", paths["json"]):
        paths["json"].write_text(text)

    def save(path: Path) -> None:
        figure = draw(pyplot())
        with writing("--out", path):
            save_figure(figure, path)

    draw_figure(paths, "png", paths["json"].with_suffix(".png"), save)
    return paths


# A score is 1 - cosine (in [0, 2]) for ablation, |E[A dL/dA]| for gradient importance: bounded well below
# 1e9, so x 1000 for the report stays finite. null: a head the model did not have (pruned).
_IMPORTANCE_SCHEMA = {
    "scores": Grid(Rule("a number in [-1e9, 1e9] or null", lambda v: v is None or (NUMBER.test(v) and abs(v) <= 1e9)))
}
_SYNTAX_SCHEMA = {
    "per_head_best": OptionalKey(
        Grid(Rule("a share in [0, 1] or null", lambda v: v is None or (NUMBER.test(v) and 0 <= v <= 1)))
    )
}
_SHARE_OR_NULL = Rule("a share in [0, 1] or null", lambda v: v is None or (NUMBER.test(v) and 0 <= v <= 1))
_RELATIONS_SCHEMA = {
    "layers": ListOf(NON_NEGATIVE_INT, 1),
    "heads": ListOf(NON_NEGATIVE_INT, 1),
    "relations": ListOf(STRING),
    "counts": MapOf(NON_NEGATIVE_INT),
    "baseline": MapOf({"score": _SHARE_OR_NULL}),
    "dependent_to_head": MapOf(Grid(_SHARE_OR_NULL)),
    "head_to_dependent": MapOf(Grid(_SHARE_OR_NULL)),
}
_RUN_IMPORTANCE = "run `multihead heads importance --out DIR` first (with the same --model)"


def _check_grid_shape(argument: str, source: Path, grid: list[list], shape: tuple[int, int] | None, fix: str) -> None:
    """Per-head scores must have one row per layer and one column per head of the model they are used with."""
    if shape is not None and (len(grid), len(grid[0])) != shape:
        raise bad_argument(
            argument,
            f"scores of a model with {counted(shape[0], 'layer')} x {counted(shape[1], 'head')}",
            f"{len(grid)} x {len(grid[0])} in {str(source)!r}",
            fix,
        )


def load_importance(path: str | Path, *, argument: str = "path", shape: tuple[int, int] | None = None) -> torch.Tensor:
    """The (layers, heads) scores from an importance.json (a file, or the folder holding it).

    ``argument`` names the option in errors; ``shape``: the (layers, heads) the scores must have.
    """
    source = Path(path) / IMPORTANCE_FILE if path_kind(Path(path)) == "folder" else Path(path)
    data = read_json(
        argument,
        source,
        what="an importance.json written by `multihead heads importance`",
        schema=_IMPORTANCE_SCHEMA,
        fix=_RUN_IMPORTANCE,
    )
    _check_grid_shape(argument, source, data["scores"], shape, _RUN_IMPORTANCE)
    return torch.tensor(
        [[float("nan") if v is None else v for v in row] for row in data["scores"]], dtype=torch.float32
    )


def heads_at_fidelity(curve: list[dict], threshold: float = 0.99) -> dict | None:
    """The row of ``curve`` with the most heads removed whose mean cosine is still >= ``threshold``."""
    good = [row for row in curve if row["cosine"] >= threshold]
    return max(good, key=lambda row: row["heads_removed"]) if good else None


def speed_words(row: dict, key: str = "attention_speedup") -> str:
    """A pruning curve row's speed-up as words: "1.27x faster" or, below 1, "1.27x slower" (never "0.79x
    faster"), with the range over its paired runs and, when that range holds 1, that the change is within the
    noise."""
    ratio, (low, high) = row[key], row[f"{key}_range"]
    words = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
    noise = "; within the noise" if low < 1 < high else ""
    return f"{words} (speed-up {low:.2f}-{high:.2f}x over {counted(row['repeats'], 'paired run')}{noise})"


def _ratio_cell(row: dict, key: str) -> str:
    low, high = row[f"{key}_range"]
    return f"{row[key]:.2f} {low:.2f}-{high:.2f}"


def curve_table(curve: list[dict]) -> Table:
    table = TitledTable(
        title="Pruning curve (heads removed least important first; speed-up: the median of paired runs of the "
        "original and the pruned copy, then the lowest-highest pair)",
        box=box.SIMPLE_HEAD,
        padding=(0, 1, 0, 0),
        pad_edge=False,
    )
    # two-line headers and values never cut: the table fits 80 columns
    for name in ("heads removed\n(fraction)", "mean\ncosine", "min\ncosine", "NN\nagree", "encode\nms"):
        table.add_column(name, justify="right", no_wrap=True)
    for name in ("speed-up\nx, range", "attention\nspeed-up"):
        table.add_column(name, justify="right", no_wrap=True)
    for row in curve:
        table.add_row(
            f"{row['heads_removed']} ({row['fraction']:.2f})",
            f"{row['cosine']:.4f}",
            f"{row['min_cosine']:.4f}",
            f"{row['nn_agreement']:.2f}",
            f"{row['seconds'] * 1e3:.0f}",
            _ratio_cell(row, "speedup"),
            _ratio_cell(row, "attention_speedup"),
        )
    return table


def write_curve(curve: list[dict], out_dir: Path) -> Written:
    """pruning.json and pruning.png (fidelity and speed-up against the fraction of heads removed)."""

    def draw(plt: Any) -> Any:
        removed = [row["heads_removed"] for row in curve]
        figure, left = plt.subplots(figsize=(7, 4))
        left.plot(removed, [row["cosine"] for row in curve], "o-", label="mean cosine to the original")
        left.plot(removed, [row["nn_agreement"] for row in curve], "s--", label="nearest-neighbour agreement")
        left.axhline(0.99, color="grey", linestyle=":", label="0.99")
        left.set(xlabel="heads removed (least important first)", ylabel="embedding fidelity")
        right = left.twinx()
        right.plot(
            removed, [row["attention_speedup"] for row in curve], "^-", color="tab:red", label="attention speed-up"
        )
        right.plot(removed, [row["speedup"] for row in curve], "v-", color="tab:orange", label="encode speed-up")
        right.set_ylabel("speed-up (measured)")
        lines = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        labels = left.get_legend_handles_labels()[1] + right.get_legend_handles_labels()[1]
        left.legend(lines, labels, fontsize=7, loc="center left", framealpha=0.9)
        return figure

    return _write_files(out_dir, CURVE_FILE, curve, draw)


def report_columns(
    folder: str | Path, *, argument: str = "folder", shape: tuple[int, int] | None = None
) -> dict[str, list[list[float | None]]]:
    """Per-head columns for the inspect HTML report from a `multihead heads` output folder:
    "importance" (from importance.json) and "best syntax score" (from syntax.json), when present.

    ``argument`` names the option in errors; ``shape``: the (layers, heads) the scores must have.
    """
    fix = "run `multihead heads importance --out DIR` or `multihead heads syntax --out DIR` (with the same --model)"
    directory = existing_folder(
        argument, folder, what="a folder written by `multihead heads importance` or `syntax`", fix=fix
    )
    columns: dict[str, list[list[float | None]]] = {}
    importance = directory / IMPORTANCE_FILE
    if path_kind(importance) == "file":
        scores = load_importance(importance, argument=argument, shape=shape).tolist()
        columns[f"importance (1 - cos) {IMPORTANCE_UNIT}"] = [
            [None if v != v else round(v * IMPORTANCE_SCALE, 3) for v in row] for row in scores
        ]
    syntax = directory / SYNTAX_FILE
    if path_kind(syntax) == "file":
        data = read_json(
            argument, syntax, what="a syntax.json written by `multihead heads syntax`", schema=_SYNTAX_SCHEMA, fix=fix
        )
        if "per_head_best" in data:
            _check_grid_shape(argument, syntax, data["per_head_best"], shape, fix)
            columns["best syntax score"] = [
                [None if v is None else round(v, 4) for v in row] for row in data["per_head_best"]
            ]
    if not columns:
        raise bad_argument(argument, "a folder with importance.json or syntax.json", repr(str(folder)), fix)
    return columns


def report_relations(folder: str | Path, *, argument: str = "folder") -> dict[tuple[int, int], HeadRelation] | None:
    """The syntactic relation each head tracks best, by (layer, head), from the syntax.json of a
    `multihead heads syntax` output folder (:func:`~multihead.lab.inspect.syntax.relations_by_head`); None when the
    folder has no syntax.json. A syntax.json of the wrong shape raises, naming ``argument``."""
    fix = "run `multihead heads syntax --out DIR` (with the same --model) and pass that folder"
    directory = existing_folder(argument, folder, what="a folder written by `multihead heads syntax`", fix=fix)
    path = directory / SYNTAX_FILE
    if path_kind(path) != "file":
        return None
    what = "a syntax.json written by `multihead heads syntax`"
    data = read_json(argument, path, what=what, schema=_RELATIONS_SCHEMA, fix=fix)
    shape = (len(data["layers"]), len(data["heads"]))
    for relation in data["relations"]:
        tables = [data["counts"], data["baseline"], *(data[direction] for direction in DIRECTIONS)]
        if any(relation not in table for table in tables):
            raise bad_argument(argument, f"{what} with counts, baseline and scores for {relation!r}", str(path), fix)
        for direction in DIRECTIONS:
            _check_grid_shape(argument, path, data[direction][relation], shape, fix)
    return relations_by_head(data)


@dataclass(frozen=True)
class ScoresFolder:
    """What a `multihead heads` output folder adds to inspecting a model (:func:`read_scores_folder`).

    ``columns``: per-head columns for the HTML report, ``{name: (layers, heads)}`` nested lists over the model's
    layers and the checkpoint's head numbers (None where a head was pruned): see :func:`report_columns`; cut them
    to the heads shown with :meth:`~multihead.lab.inspect.Inspection.head_columns`. ``relations``: the syntactic
    relation each head tracks best, by (layer, head), for :func:`~multihead.lab.inspect.inspect_text`'s
    ``relations`` (None without a syntax.json): see :func:`report_relations`.
    """

    columns: dict[str, list[list[float | None]]]
    relations: dict[tuple[int, int], HeadRelation] | None


def read_scores_folder(folder: str | Path, model: torch.nn.Module, *, argument: str = "folder") -> ScoresFolder:
    """Read the scores a `multihead heads importance` or `syntax` run wrote into ``folder``, checked against
    ``model``: its importance.json and syntax.json must have a row per layer of the model's first part and a column
    per head of the checkpoint (``model.head_ids`` numbers a pruned model's heads).

    Raises ValueError naming ``argument`` (the command line passes "--scores") when the folder has neither file,
    or one of them is damaged or of another model's size.
    """
    numbers, total = head_numbers(model)  # the first part's layers, and the checkpoint's heads per layer
    columns = report_columns(folder, argument=argument, shape=(len(numbers), total))
    return ScoresFolder(columns=columns, relations=report_relations(folder, argument=argument))


def syntax_table(scores: SyntaxScores) -> Table:
    """One row per relation: dependents, the best offset baseline, the best head and its margin."""
    table = TitledTable(
        title=f"Syntactic heads on {scores.source} ({scores.sentences} sentences): the share of "
        "dependents whose most-attended word is their head (or the reverse)",
        box=box.SIMPLE_HEAD,
    )
    for name in ("relation", "dependents", "baseline", "best head", "direction", "score", "margin"):
        table.add_column(name, justify="left" if name in ("relation", "direction", "best head") else "right")
    for row in scores.table():
        if row["layer"] is None:
            table.add_row(row["relation"], "0", "", "", "", "", "")
            continue
        margin = row["margin"]
        style = "green" if margin > 0.05 else "red" if margin < 0 else ""
        table.add_row(
            row["relation"],
            str(row["count"]),
            f"{row['baseline_score']:.3f} at {row['baseline_offset']:+d}",
            f"L{row['layer']} H{row['head']}",
            "dependent -> head" if row["direction"] == "dependent_to_head" else "head -> dependent",
            f"{row['score']:.3f}",
            f"[{style}]{margin:+.3f}[/{style}]" if style else f"{margin:+.3f}",
        )
    if scores.left_out:
        table.caption = (
            f"left out (no sentence of the {scores.sentences} has them): {', '.join(scores.left_out)}; "
            "name relations with --relations"
        )
    return table


def write_syntax(scores: SyntaxScores, out_dir: Path) -> Written:
    """syntax.json (every head's shares, the best heads, per-head best; null for a pruned head) and syntax.png
    (best vs baseline)."""
    # null: a head pruned from the layer
    best = [[None if v != v else v for v in row] for row in scores.per_head_best().tolist()]
    data = {**scores.as_dict(), "per_head_best": best}
    rows = [row for row in scores.table() if row["layer"] is not None]

    def draw(plt: Any) -> Any:
        figure, axis = plt.subplots(figsize=(8, 4))
        positions = range(len(rows))
        axis.bar(
            [p - 0.2 for p in positions],
            [row["baseline_score"] for row in rows],
            width=0.4,
            label="best fixed offset",
            color="tab:grey",
        )
        axis.bar(
            [p + 0.2 for p in positions], [row["score"] for row in rows], width=0.4, label="best head", color="tab:blue"
        )
        names = [f"{row['relation']}\nL{row['layer']}H{row['head']}" for row in rows]
        axis.set_xticks(list(positions), names, fontsize=7)
        axis.set(ylabel="share of dependents", ylim=(0, 1))
        fitted_title(axis, "Syntactic heads against the offset baseline")
        axis.legend(fontsize=8)
        return figure

    return _write_files(out_dir, SYNTAX_FILE, data, draw)
