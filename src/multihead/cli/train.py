"""`multihead train`: small models trained from scratch on a synthetic task, their heads measured."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from multihead._console import make_console
from multihead._errors import InputError, bad_argument
from multihead._figures import print_written  # "wrote <path>"; one line for a figure left out
from multihead._userfiles import from_options, output_folder
from multihead.cli._shared import add_threads_option, mode_options


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a small transformer on a synthetic task and watch its heads specialise",
        description="Train a small model built from multihead's layer on a synthetic task generated on the fly, "
        "with a progress bar; measure every head over training and prove what it does by ablation. induction: a "
        "decoder on repeated random segments (Olsson et al. 2022: a previous-token head, then induction heads); "
        "reverse: an encoder-decoder that writes its source backwards (its cross-attention heads learn the "
        "alignment). "
        "Writes OUT/model (open it with `multihead inspect --model OUT/model`), OUT/log.json and, with "
        "matplotlib, OUT/curves.png.",
    )
    parser.add_argument(
        "task",
        choices=("induction", "reverse", "symmetry"),
        help="the synthetic task; symmetry trains the induction decoder twice from one initialisation, once with "
        "every head of a layer made identical, and follows how far apart the heads' attention is",
    )
    parser.add_argument("--steps", type=int, help="optimizer updates (default: induction 3000, reverse 800)")
    parser.add_argument(
        "--layers",
        type=int,
        help="blocks (induction: default 2, and 1 is the paper's control; reverse: of each stack, default 1)",
    )
    parser.add_argument("--heads", type=int, help="query heads per layer (default 4)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads per layer (default: --heads; fewer is GQA)")
    parser.add_argument("--hidden", type=int, help="residual width (default 64)")
    parser.add_argument("--lr", type=float, help="AdamW learning rate (default: induction 1e-3, reverse 3e-3)")
    parser.add_argument("--seed", type=int, help="seeds the initialisation and the batches (default 0)")
    parser.add_argument(
        "--half-length",
        type=int,
        help="induction and symmetry: the longest repeated segment L (sequences of 2L + 1 tokens; default 12); "
        "training repeats 4 to L tokens, or L alone below 4",
    )
    parser.add_argument(
        "--from",
        dest="start",
        metavar="DIR",
        help="induction: go on training the decoder of an earlier run (its OUT/model), e.g. at a longer "
        "--half-length (rotary positions carry over to any length); the model options then come from it",
    )
    parser.add_argument("--out", metavar="DIR", default="multihead-train", help="where the run goes")
    # one thread: these models are too small to gain from more, and a busy machine's second thread makes every op
    # wait (docs/train.md: 300 steps took 7-11 s on one thread and 34-90 s on two, interleaved)
    add_threads_option(parser, default=1)
    mode_options(
        parser, "train", lambda args: args.task, {"--half-length": ("induction", "symmetry"), "--from": ("induction",)}
    )
    parser.set_defaults(run=run_train)


def _train_settings(task: str, args: argparse.Namespace):
    """The task's settings with the options given; an error about a field names the option the user typed."""
    import dataclasses

    from multihead.lab.train.induction import InductionSettings
    from multihead.lab.train.reverse import ReverseSettings

    given = {
        "steps": args.steps,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "hidden": args.hidden,
        "lr": args.lr,
        "seed": args.seed,
        "half_length": args.half_length,
    }
    # the fields each option sets: the encoder-decoder's --layers sets both of its stacks
    fields: dict[str, tuple[str, ...]] = {name: (name,) for name in given}
    if task == "reverse":  # (--half-length, of the repeats, is refused for it by mode_options)
        fields["layers"] = ("encoder_layers", "decoder_layers")
    chosen = {field: value for name, value in given.items() if value is not None for field in fields[name]}
    defaults = InductionSettings() if task == "induction" else ReverseSettings()
    shortest = getattr(defaults, "min_half_length", None)  # induction's shortest training repeat
    if args.half_length is not None and shortest is not None and args.half_length < shortest:
        chosen["min_half_length"] = None  # shorter than the shortest repeat: every sequence repeats L tokens
    try:
        return dataclasses.replace(defaults, **chosen)
    except InputError as error:  # the settings name their fields; the user typed the options
        option = next((option for option, names in fields.items() if error.argument in names), None)
        if option is None:
            raise
        raise error.about(f"--{option.replace('_', '-')}") from None


def _starting_decoder(args: argparse.Namespace, settings):
    """The decoder ``--from`` names (None without it), checked against the task before any training: an induction
    run's, with no model option beside it (the checkpoint sets the model)."""
    if args.start is None:  # (given for another task than induction, mode_options refused it)
        return None
    given = [f"--{name.replace('_', '-')}" for name in ("layers", "heads", "kv_heads", "hidden") if getattr(args, name)]
    if given:
        raise bad_argument(
            "--from", f"no {', '.join(given)} beside it", args.start, "drop them: the checkpoint sets the model"
        )
    from multihead.lab.models.decoder import load_decoder
    from multihead.lab.train.induction import config_for_task

    try:
        model = load_decoder(args.start)
        config_for_task(model, settings)
    except InputError as error:
        raise error.about("--from") from None
    return model.train()


def training_progress(console):
    """The training bar: description, bar, steps and time left on one line, the run's latest scores on a line
    of their own below, cut with "…" at the console's width. On one line, the scores took the bar's and the
    ETA's room at 80 columns."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class TwoLines(Progress):
        def get_renderables(self):
            yield self.make_tasks_table(self.tasks)
            for task in self.tasks:
                yield Text(str(task.fields.get("status", "")), no_wrap=True, overflow="ellipsis")

    return TwoLines(
        TextColumn("{task.description}"),
        BarColumn(bar_width=None),
        TextColumn("{task.completed}/{task.total} steps"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def run_train(args: argparse.Namespace) -> int:
    from multihead.lab.train.induction import run_induction
    from multihead.lab.train.reverse import run_reverse

    settings = _train_settings("reverse" if args.task == "reverse" else "induction", args)
    start = _starting_decoder(args, settings)
    out = output_folder("--out", args.out, create=False)  # checked now; written after training
    if args.task == "symmetry":
        return _train_symmetry(settings, out)
    console = make_console()
    induction = args.task == "induction"
    tokens_per_step = settings.batch * (2 * settings.half_length + 1 if induction else 2 * settings.length)
    with training_progress(console) as bar:
        task = bar.add_task(f"training ({args.task})", total=settings.steps, status="")
        started = [time.perf_counter(), 0]

        def show(step: int, scores) -> None:
            now = time.perf_counter()
            rate = (step - started[1]) * tokens_per_step / max(now - started[0], 1e-9)
            started[:] = [now, step]
            if induction:
                status = (
                    f"repeated-token loss {scores['repeated_token_loss']:.3f} · "
                    f"induction {float(scores['induction'][-1].max()):.2f}"
                )
            else:
                status = f"loss {scores['probe_loss']:.3f} · alignment {float(scores['alignment'].max()):.2f}"
            bar.update(task, completed=step, status=f"{status} · {rate:,.0f} tokens/s")

        run = run_induction(settings, on_log=show, model=start) if induction else run_reverse(settings, on_log=show)
    final = run.final
    kind = "attention-only " if not settings.mlp else ""
    if induction:
        console.print(
            f"trained a {settings.layers}-layer, {settings.heads}-head {kind}decoder for {settings.steps} steps: "
            f"repeated-token loss {final['loss']:.3f} (chance {final['chance']:.3f}), in-context learning score "
            f"{final['in_context_learning']:+.3f} nats",
        )
        note = (
            "prev: attention from t to t - 1. induction: attention from a repeated token to the token after its "
            "earlier occurrence (prefix matching, TransformerLens' induction score). copies: predictions at repeated "
            "tokens the head's own logits get right. ablated: repeated-token loss with the head zeroed "
            f"(unablated {final['loss']:.3f}). {_ROLE_NOTE}"
        )
    else:
        console.print(
            f"trained a {settings.encoder_layers}+{settings.decoder_layers}-layer, {settings.heads}-head {kind}"
            f"encoder-decoder for {settings.steps} steps: loss {final['loss']:.4f}, held-out sequences reversed "
            f"exactly {final['exact_match']:.0%}",
        )
        note = (
            "aligned: target positions whose largest cross-attention weight falls on the source token they reverse "
            f"(chance {1 / settings.length:.0%}). ablated: loss with the head zeroed (unablated "
            f"{final['loss']:.4f}). {_ROLE_NOTE}"
        )
    paths = run.save(out)  # first: the roles are those inspect gives the saved checkpoint
    console.print(_probe_table(run, induction, _checkpoint_roles(paths["model"])))
    console.print(note, markup=False)  # prose: wrapped at the console's width between words
    print_written(console, paths)
    console.print(f"inspect it: multihead inspect --model {paths['model']}", soft_wrap=True, markup=False)
    return 0


def _train_symmetry(settings, out: Path) -> int:
    """`multihead train symmetry`: :func:`multihead.lab.train.symmetry.run_symmetry`, the heads' mean pairwise
    divergence over training in a table; symmetry.json and symmetry.png written."""
    from rich import box
    from rich.status import Status

    from multihead._titled_table import TitledTable
    from multihead.lab.train.symmetry import run_symmetry

    console = make_console()
    with Status("training twice: random heads, then identical heads", console=console):
        run = run_symmetry(settings)
    table = TitledTable(box=box.SIMPLE_HEAD, pad_edge=False, title="mean pairwise JSD between a layer's heads (bits)")
    table.add_column("step", justify="right")
    for name in ("random", "identical"):
        for layer in range(settings.layers):
            table.add_column(f"{name} L{layer}", justify="right")
    table.add_column("loss random / identical", justify="right")
    random_history, identical_history = run.result["random"]["history"], run.result["identical"]["history"]
    shown = sorted({0, len(random_history) - 1, *range(0, len(random_history), max(1, len(random_history) // 8))})
    for index in shown:
        random_entry, identical_entry = random_history[index], identical_history[index]
        table.add_row(
            str(random_entry["step"]),
            *(f"{value:.3f}" for value in random_entry["divergence_mean"]),
            *(f"{value:.3f}" for value in identical_entry["divergence_mean"]),
            f"{random_entry['repeated_loss']:.3f} / {identical_entry['repeated_loss']:.3f}",
        )
    console.print(table)
    stayed = "stayed bitwise identical" if run.stayed_identical else "drifted apart (rounding)"
    start, end = (max(entry["divergence_mean"]) for entry in (random_history[0], random_history[-1]))
    console.print(
        f"identical heads {stayed} at every log; random heads: {start:.3f} bits apart at step 0 and {end:.3f} at "
        f"step {random_history[-1]['step']} (the layer furthest apart)",
        soft_wrap=True,
    )
    with from_options({"folder": "--out"}):
        print_written(console, run.save(out))
    return 0


# the roles of the table: inspect's, on the saved checkpoint (one rule, one threshold, one label per head)
_ROLE_NOTE = (
    "role: what `multihead inspect --model OUT/model` labels the head (multihead.lab.inspect.roles on an input of "
    "the task and these probes, with the head detectors of a decoder; ?: low confidence)."
)


def _checkpoint_roles(folder: Path) -> dict[tuple[int, int], str]:
    """Each head's role as ``multihead inspect --model FOLDER`` labels it (its role grid's cell), by (layer,
    head): the saved checkpoint read back through :func:`multihead.cli.inspect.inspect_model`, inspect's own path."""
    from multihead.cli.inspect import inspect_model
    from multihead.integrations import load_text_model

    inspection, _, _ = inspect_model(load_text_model(folder), folder)
    roles = inspection.role_stats.roles()  # roles[row][col]
    return {
        (layer, head): roles[row][col].cell
        for row, layer in enumerate(inspection.layers)
        for col, head in enumerate(inspection.heads)
    }


def _probe_table(run, induction: bool, roles: dict[tuple[int, int], str]):
    """One row per head a run measured (an induction run's every head, a reverse run's cross-attention heads):
    its probe scores, its ablated loss and ``roles[layer, head]``, the role inspect gives it."""
    from rich import box
    from rich.table import Table

    final = run.final
    columns = ("prev", "induction", "copies") if induction else ("aligned",)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("head", *columns, "ablated", "role"):
        table.add_column(name, justify="left" if name in ("head", "role") else "right")
    behaviours = run.behaviours()
    layers, heads = final["ablated_loss"].shape
    for layer in range(layers):
        for head in range(heads):
            measures = {name: float(values[layer, head]) for name, values in behaviours.items()}
            if induction:
                previous = float(final["previous_token"][layer, head])
                cells = [previous, measures["prefix_matching"], measures["copying"]]
            else:
                cells = [measures["alignment"]]
            table.add_row(
                f"L{layer}H{head}",
                *(f"{value:.0%}" for value in cells),
                f"{float(final['ablated_loss'][layer, head]):.4f}",
                roles[layer, head],
            )
    return table
