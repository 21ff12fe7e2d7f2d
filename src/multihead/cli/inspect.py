"""`multihead inspect`: a text through a model, its heads' weights, roles and statistics, in reports."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multihead._console import make_console
from multihead._errors import bad_argument, items_renamed
from multihead._figures import print_written  # "wrote <path> (<size>)"; one line for a figure left out
from multihead._limits import format_bytes
from multihead._userfiles import from_option, from_options, output_folder, spelled_as_options
from multihead.cli._shared import (
    BUNDLED,
    MODEL_HELP,
    add_format_option,
    add_threads_option,
    parse_indices,
    parse_token,
    progress_bar,
)

if TYPE_CHECKING:  # the lab loads when a command runs, not when the CLI starts
    import torch

    from multihead.lab.inspect.inspection import Inspection
    from multihead.lab.inspect.saved import SavedModelExtras
    from multihead.lab.models.contract import TextEncoder

DEFAULT_TEXT = "The bank was full of money."


# Past this size, inspect notes that report.html may be slow to open (a 512-token MiniLM report is about 4 MB)
HTML_SIZE_NOTE = 20 << 20


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="see what every attention head of a real model does on a text",
        description="Load all-MiniLM-L6-v2 (or --model PATH) onto multihead's layer, run TEXT through it, "
        "label every head's role and show where a token attends.",
    )
    parser.add_argument(
        "text",
        nargs="?",
        help=f'the text (default: "{DEFAULT_TEXT}"; for a `multihead train` checkpoint, an input of its task)',
    )
    parser.add_argument("--model", metavar="PATH", help=MODEL_HELP)
    parser.add_argument("--layers", metavar="LIST", help="layers to show, e.g. 0,2-4 (default: all)")
    parser.add_argument(
        "--heads",
        metavar="LIST",
        help="heads to show, by their numbers in the checkpoint (a pruned model's heads keep theirs), "
        "e.g. 0,5,11 (default: all)",
    )
    parser.add_argument(
        "--part",
        metavar="PART",
        help="which attention to show: self (a one-stack model such as BERT, GPT-2, Llama), or encoder, decoder "
        "or cross (an encoder-decoder such as BART: cross goes from the decoder input to the source text); "
        "default: the model's first (for a `multihead train` checkpoint, the part its probes measured)",
    )
    parser.add_argument(
        "--token",
        metavar="WORD|INDEX|WORD:N",
        help="the token to follow: a word of the text (its first occurrence; case does not matter), a token index "
        "counting from 0 (for BERT-style models 0 is [CLS]), or WORD:N for the Nth occurrence of the word, "
        "counting from 1 (bank:2); a number that is a word of the text is picked with WORD:N (--token 3:1). "
        "Default: the first content word",
    )
    parser.add_argument(
        "--corpus",
        nargs="?",
        const=BUNDLED,
        metavar="FILE",
        help="also measure every head over a corpus (one text per line) and label roles from it; "
        "--corpus alone uses the bundled corpus",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default="multihead-report",
        help="where the html/png/json reports go (default: multihead-report)",
    )
    add_format_option(parser, "terminal,html,json,png")
    parser.add_argument(
        "--truncate", action="store_true", help="cut texts over the model's position limit (512 for all-MiniLM-L6-v2)"
    )
    parser.add_argument(
        "--scores",
        metavar="DIR",
        help="a `multihead heads` output folder: its importance.json "
        "and syntax.json become per-head columns of the HTML report, and each head's best syntactic relation "
        "(from syntax.json) is weighed into its role",
    )
    parser.add_argument(
        "--long",
        metavar="FILE",
        help="read a long text from FILE instead (any length: past the model's positions it is read in windows "
        "sliding by half) and profile every head in O(n) memory: distance bands, sink share, entropy, heavy "
        "hitters, a pooled map of the whole text, and the sink, heavy-hitter, long-range and local roles; "
        "long.html, long.png and long.json as --format asks",
    )
    parser.add_argument(
        "--browse",
        nargs="?",
        const=BUNDLED,
        metavar="CORPUS",
        help="browse every head over a corpus instead (a text file, one document per line, or a folder of .txt "
        "files; --browse alone reads the bundled UD English sentences): each head's top contexts by each measure "
        "(the largest weight off the special pieces, its output's norm, its entropy low and high, its "
        "previous-token and prefix-matching weight) and their distributions, in memory that does not grow with "
        "the corpus; browse.html, browse.png and browse.json as --format asks",
    )
    parser.add_argument(
        "--top-k", type=int, metavar="N", help="with --browse: contexts kept per head and measure (default 8)"
    )
    add_threads_option(parser)
    parser.set_defaults(run=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    if args.long is not None and args.browse is not None:
        raise bad_argument("--browse", "no --long beside it", f"--long {args.long}", "leave out one of them")
    if args.long is not None and args.top_k is not None:
        raise bad_argument("--top-k", "--browse beside it, not --long", f"--long {args.long}", "leave out --top-k")
    if args.long is not None:
        return run_long(args)
    if args.browse is not None:
        return run_browse(args)
    if args.top_k is not None:
        raise bad_argument(
            "--top-k",
            "--browse beside it (it sets the contexts --browse keeps)",
            "no --browse",
            "add --browse CORPUS, or leave out --top-k",
        )

    from multihead.integrations import load_text_model
    from multihead.lab.inspect.headreport import read_scores_folder
    from multihead.lab.inspect.inspection import bundled_corpus, read_corpus_lines
    from multihead.lab.inspect.recording import head_numbers
    from multihead.lab.inspect.write import check_formats, write_reports

    with from_option("--format"):
        formats = check_formats(args.format)
    parse_indices("layers", args.layers)  # their form now, before the model loads; their range once it has
    parse_indices("heads", args.heads)
    token = parse_token(args.token)
    console = make_console()
    if args.text is not None and not args.text.strip():
        raise bad_argument("text", "a non-empty text", repr(args.text), 'pass e.g. "The bank was full of money."')
    if any(name != "terminal" for name in formats):
        output_folder("--out", args.out, create=False)  # checked now; made when the reports are written
    corpus, corpus_source, corpus_lines = None, None, []
    if args.corpus == BUNDLED:
        corpus = bundled_corpus()
        corpus_source = f"bundled corpus ({len(corpus)} sentences)"
    elif args.corpus is not None:
        corpus_lines = read_corpus_lines(args.corpus, argument="--corpus")
        corpus = [text for _, text in corpus_lines]
        corpus_source = f"{args.corpus} ({len(corpus)} texts)"
    with from_option("--model"):
        model = load_text_model(args.model)
    # heads by their checkpoint numbers, which a pruned model's heads keep (a head pruned from every chosen layer
    # is refused by inspect_text)
    numbers, checkpoint_heads = head_numbers(model)
    layers = parse_indices("layers", args.layers, len(numbers))
    heads = parse_indices("heads", args.heads, checkpoint_heads)
    scores = read_scores_folder(args.scores, model, argument="--scores") if args.scores is not None else None
    with (
        progress_bar(console, shown=corpus is not None) as progress,
        from_option("--token", names=("token",)),
        from_option("--heads", names=("heads",)),
        from_option("--part", names=("part",)),
        # a corpus text is its file's line; the bundled corpus's are the package's own (no line to name)
        items_renamed("corpus", lambda index: f"--corpus line {corpus_lines[index][0]}" if corpus_lines else "corpus"),
        spelled_as_options({"truncate": "--truncate"}),
    ):
        task = progress.add_task("corpus statistics", total=len(corpus or ()))
        inspection, saved, detected = inspect_model(
            model,
            args.model,
            text=args.text,
            part=args.part,
            layers=layers,
            heads=heads,
            token=token,
            corpus=corpus,
            corpus_source=corpus_source,
            truncate=args.truncate,
            progress=lambda done: progress.update(task, completed=done),
            relations=None if scores is None else scores.relations,  # each head's relation, into its role
        )
    # the --scores columns, the probes' and the detectors' measures, beside them, as columns of the HTML report
    columns: dict[str, list[list[float | None]]] = {**(scores.columns if scores else {}), **saved.probe_columns()}
    columns |= {f"{name} (detector)": values.tolist() for name, values in (detected or {}).items()}
    extra_columns = inspection.head_columns(columns) if columns else None
    paths = write_reports(inspection, args.out, formats, console=console, extra_columns=extra_columns, argument="--out")
    print_written(console, paths)  # with the one note of a figure left out
    for name, path in paths.items():
        size = path.stat().st_size
        if name == "html" and size > HTML_SIZE_NOTE:  # a browser or a notebook cell slows down past it
            console.print(
                f"note: report.html is {format_bytes(size)}, over {format_bytes(HTML_SIZE_NOTE)}: a browser may be "
                "slow to open it. Record fewer heads (--layers, --heads) or a shorter text",
                soft_wrap=True,
                markup=False,
                highlight=False,
            )
    return 0


def inspect_model(
    model: TextEncoder, folder: str | Path | None, *, text: str | None = None, part: str | None = None, **options: Any
) -> tuple[Inspection, SavedModelExtras, dict[str, torch.Tensor] | None]:
    """What ``multihead inspect --model FOLDER`` shows of ``model``, loaded from ``folder`` (None: the bundled
    model): :func:`~multihead.lab.inspect.inspect_text` of ``text`` (default: an input of the task a ``multihead
    train`` checkpoint learned, else :data:`DEFAULT_TEXT`), its roles weighing the probes the checkpoint saved and,
    of a causal model, the head detectors' scores. The one path from a checkpoint to its heads' roles:
    ``multihead train`` labels the heads of its table with it. ``options``: inspect_text's other arguments.

    Returns (the inspection, the folder's :class:`~multihead.lab.inspect.SavedModelExtras`, the detectors'
    behaviours or None for a model that is not causal).
    """
    from multihead.lab.circuits import detector_behaviours
    from multihead.lab.inspect.behaviours import BEHAVIOURS_FILE
    from multihead.lab.inspect.inspection import inspect_text
    from multihead.lab.inspect.saved import saved_model_extras

    # a `multihead train` checkpoint's part, probes and task: its behaviours.json came with --model
    with from_options({BEHAVIOURS_FILE: f"--model {BEHAVIOURS_FILE}"}), from_options({"part": "--part"}):
        saved = saved_model_extras(folder, model, part)
    # a causal LM's heads scored by the head detectors, as roles; the checkpoint's own probes, where it saved them,
    # measured the same behaviour on its task and take their place
    detected = detector_behaviours(model)
    behaviours = {**(detected or {}), **(saved.behaviours or {})} or None
    text = text if text is not None else saved.task_text or DEFAULT_TEXT
    inspection = inspect_text(model, text, part=saved.part, behaviours=behaviours, **options)
    return inspection, saved, detected


def _own_text_formats(option: str, args: argparse.Namespace) -> list[str]:
    """The checked --format of ``option`` (--long, --browse), which reads its own text: a one-text option beside it
    is refused by name, and the --out folder is checked before the model loads."""
    from multihead.lab.inspect.write import check_formats

    for name, value in (("text", args.text), ("--token", args.token), ("--corpus", args.corpus)):
        if value is not None:
            raise bad_argument(option, f"no {name} beside it", f"{name} {value}", f"leave out {name}")
    if args.scores is not None or args.truncate:
        given = "--scores" if args.scores is not None else "--truncate"
        raise bad_argument(option, f"no {given} beside it", given, f"leave out {given}")
    with from_option("--format"):
        formats = check_formats(args.format)
    if any(name != "terminal" for name in formats):
        output_folder("--out", args.out, create=False)
    return formats


def run_browse(args: argparse.Namespace) -> int:
    """`multihead inspect --browse [CORPUS]`: every head's top contexts and measures over the corpus."""
    from multihead.integrations import load_text_model
    from multihead.lab.inspect.browse import browse_corpus, bundled_documents, read_documents
    from multihead.lab.inspect.browse_report import head_roles, print_browse, write_browse

    formats = _own_text_formats("--browse", args)
    if args.browse == BUNDLED:
        documents: Any = bundled_documents()
        total = len(documents)
    else:
        total = sum(1 for _ in read_documents(args.browse, argument="--browse"))  # for the bar's ETA
        documents = read_documents(args.browse, argument="--browse")
    with from_option("--model"):
        model = load_text_model(args.model)
    console = make_console()
    with (
        progress_bar(console) as progress,
        from_options({"layers": "--layers", "heads": "--heads", "part": "--part", "top_k": "--top-k"}),
    ):
        task = progress.add_task("documents", total=total)
        found = browse_corpus(
            model,
            documents,
            part=args.part,
            layers=parse_indices("layers", args.layers),
            heads=parse_indices("heads", args.heads),
            top_k=8 if args.top_k is None else args.top_k,
            progress=lambda done, _: progress.update(task, completed=done),
        )
    # the heads' roles on the grid and the cards, labelled as inspect labels them, from the bundled corpus
    roles = head_roles(model, sorted({h.layer for h in found.heads}), sorted({h.head for h in found.heads}))
    if "terminal" in formats:
        print_browse(console, found)
    print_written(console, write_browse(found, args.out, formats, argument="--out", roles=roles))
    return 0


def run_long(args: argparse.Namespace) -> int:
    """`multihead inspect --long FILE`: each head's profile over the file's text."""

    from multihead._userfiles import read_text
    from multihead.integrations import load_text_model
    from multihead.lab.inspect.long import inspect_long
    from multihead.lab.inspect.long_report import print_long, write_long

    formats = _own_text_formats("--long", args)
    text = read_text("--long", args.long, what="a UTF-8 text file", fix="pass --long FILE, a text file")
    with from_option("--model"):
        model = load_text_model(args.model)
    console = make_console()
    with (
        progress_bar(console) as progress,
        from_options({"text": "--long", "layers": "--layers", "heads": "--heads", "part": "--part"}),
    ):
        task = progress.add_task("windows", total=None)
        found = inspect_long(
            model,
            text,
            part=args.part,
            layers=parse_indices("layers", args.layers),
            heads=parse_indices("heads", args.heads),
            progress=lambda done, total: progress.update(task, completed=done, total=total),
        )
    if "terminal" in formats:
        print_long(console, found)
    print_written(console, write_long(found, args.out, formats, argument="--out"))  # png without matplotlib: a note
    return 0
