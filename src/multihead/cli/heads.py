"""`multihead heads`: which heads matter (importance), removing them (prune), syntactic heads (syntax)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from multihead._console import make_console
from multihead._errors import bad_argument
from multihead._figures import print_written  # "wrote <path>"; one line for a figure left out
from multihead._userfiles import from_option, from_options, output_folder
from multihead.cli._shared import (
    MODEL_HELP,
    add_threads_option,
    mode_options,
    progress_bar,
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "heads",
        help="which heads matter: importance, pruning, syntactic heads",
        description="Score a model's heads by ablation (embedding fidelity over a corpus; for a `multihead train` "
        "checkpoint, its task's loss), prune the least important ones and measure fidelity and speed, or find "
        "syntactic heads on UD English EWT.",
    )
    parser.add_argument("mode", choices=("importance", "prune", "syntax"))
    parser.add_argument(
        "--model",
        metavar="PATH",
        help=MODEL_HELP + "; prune needs a model on multihead's own encoder (importance and syntax take any)",
    )
    parser.add_argument("--corpus", metavar="FILE", help="texts, one per line (default: the bundled corpus)")
    parser.add_argument(
        "--how",
        choices=("zero", "uniform", "mean"),
        default="zero",
        help="importance: how a head is ablated (default zero)",
    )
    parser.add_argument(
        "--importance",
        metavar="PATH",
        help="prune: an importance.json (or its folder) to use instead of measuring it again",
    )
    parser.add_argument("--fraction", type=float, help="prune: the fraction of all heads to remove, in [0, 1)")
    parser.add_argument("--remove", metavar="L:H,H;L:H", help="prune: remove these heads instead, e.g. '0:1,5;3:2'")
    parser.add_argument(
        "--relations",
        metavar="LIST",
        help="syntax: relations, comma-separated (default: nsubj, "
        "obj, det, amod, advmod, aux, case, nmod:poss, compound, mark)",
    )
    parser.add_argument(
        "--treebank", metavar="FILE", help="syntax: a CoNLL-U file (default: the bundled UD English EWT dev split)"
    )
    parser.add_argument("--max-sentences", type=int, metavar="N", help="syntax: use the first N sentences")
    parser.add_argument(
        "--out",
        metavar="DIR",
        default="multihead-heads",
        help="where JSON, PNG and the pruned model go (default: multihead-heads)",
    )
    add_threads_option(parser)
    importance = ("importance", "prune")  # prune measures the importance it prunes by, unless --importance is given
    mode_options(
        parser,
        "heads",
        lambda args: args.mode,
        {
            "--corpus": importance,
            "--how": importance,
            "--importance": ("prune",),
            "--fraction": ("prune",),
            "--remove": ("prune",),
            "--relations": ("syntax",),
            "--treebank": ("syntax",),
            "--max-sentences": ("syntax",),
        },
    )
    parser.set_defaults(run=run_heads)


def _parse_removal(spec: str) -> dict[int, list[int]]:
    """'0:1,5;3:2' -> {0: [1, 5], 3: [2]}."""
    plan: dict[int, list[int]] = {}
    form = "LAYER:HEAD,HEAD;LAYER:HEAD, e.g. '0:1,5;3:2'"
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        match = re.fullmatch(r"([0-9]{1,9})\s*:\s*([0-9]{1,9}(?:\s*,\s*[0-9]{1,9})*)", part)
        if match is None:
            raise bad_argument(
                "--remove", form, repr(spec), "separate layers with ';' and heads with ',' (whole numbers from 0)"
            )
        heads = plan.setdefault(int(match.group(1)), [])
        for head in (int(h) for h in match.group(2).split(",")):
            if head in heads:
                raise bad_argument(
                    "--remove",
                    f"each head of a layer once, {form}",
                    f"head {head} of layer {match.group(1)} twice in {spec!r}",
                    "list every head once",
                )
            heads.append(head)
    if not plan:
        raise bad_argument("--remove", form, repr(spec), "name at least one head to remove")
    return plan


def run_heads(args: argparse.Namespace) -> int:
    from multihead.integrations import load_text_model
    from multihead.lab.inspect import headreport
    from multihead.lab.inspect.recording import head_numbers
    from multihead.lab.models import Encoder

    console = make_console()
    plan = _removal_plan(args)
    out_dir = output_folder("--out", args.out, create=False)  # checked now; made when a file is written
    if args.mode == "syntax":
        return run_syntax(args, console, out_dir)
    if args.mode == "importance" and args.model is not None:
        from multihead.lab.inspect.behaviours import read_task

        with from_option("--model"):
            trained = read_task(args.model)
        if trained is not None:  # a `multihead train` checkpoint: its heads' cost to its own task
            return _task_importance(args, console, out_dir, *trained)
    texts, source = _corpus_texts(args)
    with from_option("--model"):
        model = load_text_model(args.model)
    numbers, checkpoint_heads = head_numbers(model)  # scores are by layer and the checkpoint's head numbers
    counts = [len(heads) for heads in numbers]
    if args.mode == "prune" and not isinstance(model, Encoder):
        raise bad_argument(
            "--model",
            "a model on multihead's own layer, whose heads can be removed (all-MiniLM-L6-v2, a BERT-style checkpoint)",
            f"{model.name}, {model.described_as}",
            "rank its heads with `multihead heads importance --model ...` (ablation: nothing is removed)",
        )
    if plan is not None:
        assert isinstance(model, Encoder)  # refused above otherwise
        return _remove_listed_heads(console, model, plan, out_dir, sum(counts))
    if args.mode == "prune" and args.importance:
        scores = headreport.load_importance(
            args.importance, argument="--importance", shape=(len(counts), checkpoint_heads)
        )
    else:
        importance = _measure_importance(args, console, model, texts)
        paths = headreport.write_importance(importance, out_dir, source=source)
        scores = importance.scores
        if args.mode == "importance":
            console.print(
                headreport.importance_table(
                    scores,
                    f"Ablation importance over {source}: (1 - mean cosine) {headreport.IMPORTANCE_UNIT} when the "
                    f"head is {args.how}-ablated",
                    kept=numbers,
                )
            )
            console.print(f"most important: {headreport.ranked_line(importance)}", soft_wrap=True)
            headreport.print_written(console, paths)
            return 0
    assert isinstance(model, Encoder)  # prune on another model was refused before any work
    return _prune_by_fraction(args, console, model, texts, scores, out_dir, sum(counts))


def _removal_plan(args: argparse.Namespace) -> dict[int, list[int]] | None:
    """`heads prune`'s --fraction or --remove, checked now, before any measuring: the heads --remove names
    ({layer: heads}), or None (--fraction, or another mode)."""
    from multihead.lab.inspect.importance import check_prune_fraction

    plan = None
    if args.mode == "prune":
        if (args.fraction is None) == (args.remove is None):
            raise bad_argument(
                "--fraction", "either --fraction F or --remove L:H,...", "both or neither", "pass e.g. --fraction 0.3"
            )
        if args.fraction is not None:  # checked now, before any measuring
            with from_options(PRUNE_OPTIONS):
                check_prune_fraction(args.fraction)
        if args.remove is not None:
            plan = _parse_removal(args.remove)
    return plan


def _corpus_texts(args: argparse.Namespace) -> tuple[list[str], str]:
    """The texts of --corpus (default: the bundled corpus), at least two, and how the reports name them."""
    from multihead.lab.inspect.inspection import bundled_corpus, read_corpus

    texts = read_corpus(args.corpus, argument="--corpus") if args.corpus is not None else bundled_corpus()
    if len(texts) < 2:  # embedding fidelity compares each text's nearest neighbour
        raise bad_argument(
            "--corpus", "at least two texts, one per line", f"{len(texts)} in {args.corpus!r}", "add texts to the file"
        )
    return texts, f"bundled corpus ({len(texts)} sentences)" if args.corpus is None else args.corpus


def _remove_listed_heads(console, model, plan: dict[int, list[int]], out_dir: Path, heads: int) -> int:
    """`heads prune --remove`: the ``plan``'s heads removed from ``model`` (an Encoder of ``heads`` heads in all),
    which is saved to ``out_dir``/model."""
    from multihead._userfiles import writing
    from multihead.lab.inspect.recording import head_numbers

    with from_option("--remove"):
        model.prune_heads(plan)
    model_dir = output_folder("--out", out_dir / "model")
    with writing("--out", model_dir):
        path = model.save(model_dir)
    removed = heads - sum(len(kept) for kept in head_numbers(model)[0])
    console.print(f"pruned {removed} heads; model saved to {path.resolve()} (load it with --model)", soft_wrap=True)
    return 0


def _measure_importance(args: argparse.Namespace, console, model, texts: list[str]):
    """Every head's ablation importance over ``texts`` (ablated as --how says), a progress bar on a terminal."""

    from multihead.lab.inspect.importance import ablation_importance

    with progress_bar(console) as bar:
        task = bar.add_task("ablating heads", total=None)
        return ablation_importance(
            model, texts, how=args.how, progress=lambda done, total: bar.update(task, completed=done, total=total)
        )


def _prune_by_fraction(
    args: argparse.Namespace, console, model, texts: list[str], scores, out_dir: Path, heads: int
) -> int:
    """`heads prune --fraction`: the least important heads of ``model`` (an Encoder of ``heads`` heads in all; by
    the (layers, heads) ``scores``) removed a step at a time, the fidelity and speed curve printed and written,
    and the model pruned by --fraction saved to ``out_dir``/model."""

    from multihead._userfiles import writing
    from multihead.lab.inspect import headreport
    from multihead.lab.inspect.importance import prune_by_importance

    with progress_bar(console) as bar, from_options(PRUNE_OPTIONS):
        task = bar.add_task("pruning curve", total=None)
        pruned = prune_by_importance(
            model,
            texts,
            scores,
            args.fraction,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    console.print(headreport.curve_table(pruned.curve))
    best = headreport.heads_at_fidelity(pruned.curve)
    if best is not None:
        console.print(
            f"at mean cosine >= 0.99: {best['heads_removed']} of {heads} heads removed "
            f"(fraction {best['fraction']:.2f}), attention {headreport.speed_words(best)}",
            soft_wrap=True,
        )
    model_dir = output_folder("--out", out_dir / "model")
    with writing("--out", model_dir):
        model_path = model.save(model_dir)
    paths = headreport.write_curve(pruned.curve, out_dir)
    console.print(
        f"pruned {pruned.chosen['heads_removed']} heads (fraction {args.fraction}): mean cosine "
        f"{pruned.chosen['cosine']:.4f}; model saved to {model_path.resolve()}",
        soft_wrap=True,
    )
    headreport.print_written(console, paths)
    return 0


def _task_importance(args: argparse.Namespace, console, out_dir: Path, task: str, settings) -> int:
    from multihead.integrations import load_text_model
    from multihead.lab.inspect import headreport
    from multihead.lab.train.checkpoints import task_importance

    with from_option("--model"):
        model = load_text_model(args.model)
        importance, part = task_importance(model, task, settings)
    paths = headreport.write_importance(importance, out_dir, source=f"the {task} probe of {args.model}")
    where = "" if part == "self" else f" ({part}-attention layers)"
    console.print(f"Ablation importance{where}: {importance.metric}", soft_wrap=True, markup=False)
    console.print(headreport.importance_table(importance.scores, f"loss increase {headreport.IMPORTANCE_UNIT}"))
    console.print(f"most important: {headreport.ranked_line(importance)}", soft_wrap=True)
    headreport.print_written(console, paths)
    return 0


def run_syntax(args: argparse.Namespace, console, out_dir: Path) -> int:
    """`multihead heads syntax`: every head scored on the treebank by
    :func:`multihead.lab.inspect.syntax.syntax_scores`, the table printed, JSON and PNG written."""

    from multihead.integrations import load_text_model
    from multihead.lab.inspect.headreport import syntax_table, write_syntax
    from multihead.lab.inspect.syntax import bundled_treebank, read_conllu, syntax_scores

    # not given: the default relations the sentences have (syntax_scores names those left out)
    relations = None if args.relations is None else [r.strip() for r in args.relations.split(",") if r.strip()]
    with from_option("--treebank"):
        given = args.treebank is not None
        sentences = read_conllu(Path(args.treebank), argument="--treebank") if given else bundled_treebank()
    with from_option("--model"):
        model = load_text_model(args.model)
    shown = len(sentences) if args.max_sentences is None else max(0, min(len(sentences), args.max_sentences))
    with progress_bar(console) as bar, from_options(SYNTAX_OPTIONS):
        task = bar.add_task("sentences", total=shown)
        scores = syntax_scores(
            model,
            sentences,
            relations=relations,
            max_sentences=args.max_sentences,
            progress=lambda done: bar.update(task, completed=done),
        )
    scores.source = "UD English EWT dev" if args.treebank is None else args.treebank
    console.print(syntax_table(scores))
    print_written(console, write_syntax(scores, out_dir))
    return 0


# syntax_scores' arguments as `multihead heads syntax` spells them
SYNTAX_OPTIONS = {"relations": "--relations", "sentences": "--treebank", "max_sentences": "--max-sentences"}


# prune_by_importance's arguments as `multihead heads prune` spells them
PRUNE_OPTIONS = {"fraction": "--fraction", "texts": "--corpus", "scores": "--importance"}
