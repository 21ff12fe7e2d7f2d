"""The ``multihead`` command: parses arguments, calls the library, prints. User mistakes get one line.

multihead inspect "The bank was full of money." --token bank --corpus --out report
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# Each command imports what it runs inside its own function, so one command does not load the others' modules
# (a usage mistake is answered without them). These imports point down the layers like any other; the ones here
# are the core's (a command of the lab without its extra is one line, from main).
from multihead._console import make_console
from multihead._errors import InputError, bad_argument
from multihead._figures import print_written, skipped_note  # "wrote <path>"; one line for a figure left out
from multihead._lab import lab_missing_error, lab_module_of
from multihead._limits import format_bytes
from multihead._stdout import discard_stdout
from multihead._userfiles import from_option, from_options, output_file, output_folder

DEFAULT_TEXT = "The bank was full of money."
# Past this size, inspect notes that report.html may be slow to open (a 512-token MiniLM report is about 4 MB)
HTML_SIZE_NOTE = 20 << 20
BUNDLED = "bundled"
# Without a model to check against, index lists may name up to this many layers or heads: more than any
# model has, and few enough that expanding a range costs nothing.
MAX_INDICES = 1 << 16
_INDEX_PART = re.compile(r"([0-9]+)(?:\s*-\s*([0-9]+))?")


# What --model accepts (integrations.load_text_model decides): said the same way by every command that has it.
MODEL_HELP = (
    "a local checkpoint folder (default: the bundled all-MiniLM-L6-v2). A BERT-style checkpoint (config.json "
    'with model_type "bert", model.safetensors, tokenizer.json) or a folder saved by `multihead heads prune` '
    "runs on multihead's own encoder; a checkpoint of any other Hugging Face model_type (GPT-2, Llama, Mistral, "
    "BART, T5, ...; config.json, weights and tokenizer files) runs through transformers on multihead's kernel, "
    "with the hf extra: pip install 'multihead[hf]'"
)


def package_version() -> str:
    """multihead's version from the installed package's metadata (the source's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("multihead")
    except PackageNotFoundError:  # run from a source tree without installing it
        from multihead import __version__

        return __version__


def parse_indices(name: str, spec: str | None, count: int | None = None) -> list[int] | None:
    """'0,2,5-7' -> [0, 2, 5, 6, 7] for ``--<name>``; None -> None (all).

    Refused with an error naming ``--<name>``: anything but whole numbers and ranges a-b (a <= b),
    negative indices (they do not mean "from the end" here), an index listed twice, and an index
    >= ``count`` (the model's layers or heads; without it, >= MAX_INDICES). Every bound is checked
    before a range is expanded, so ``0-99999999999`` is an error, not a memory exhaustion.
    """
    if spec is None:
        return None
    option, what = f"--{name}", name.removesuffix("s")
    limit = MAX_INDICES if count is None else count
    if count is None:  # only the form is known to be wrong: the model's size is checked once it is loaded
        valid, fix = f"{what} indices from 0 (at most {limit - 1})", f"pick {what}s of the model, counting from 0"
    else:
        valid, fix = f"{what} indices in 0..{limit - 1}", f"the model has {limit} {what}s: pick indices below {limit}"
    ranges: list[tuple[int, int]] = []
    for part in spec.split(","):
        text = part.strip()
        match = _INDEX_PART.fullmatch(text)
        if match is None:
            if re.fullmatch(r"-\s*[0-9]+", text):
                raise bad_argument(option, valid, text, f"negative indices are not accepted; {fix}")
            raise bad_argument(option, "indices like 0,2,5-7", repr(spec), f"pass e.g. {option} 0,3")
        bounds = [match.group(1), match.group(2) or match.group(1)]
        for number in bounds:
            # digits are counted first: Python refuses int() of a few thousand digits
            digits = number.lstrip("0") or "0"
            if len(digits) > len(str(limit)) or int(digits) >= limit:
                raise bad_argument(option, valid, number if len(number) <= 20 else number[:17] + "...", fix)
        low, high = (int(number.lstrip("0") or "0") for number in bounds)
        if high < low:
            raise bad_argument(option, "ranges a-b with a <= b", repr(text), f"write it as {high}-{low}")
        ranges.append((low, high))
    indices: list[int] = []
    seen: set[int] = set()
    for low, high in ranges:  # at most limit + 1 steps: the first repeat stops it
        for index in range(low, high + 1):
            if index in seen:
                raise bad_argument(option, f"each {what} once", f"{index} twice in {spec!r}", f"list every {what} once")
            seen.add(index)
            indices.append(index)
    return indices


_OCCURRENCE = re.compile(r"(?P<word>.+):\s*(?P<nth>[0-9]+)", flags=re.DOTALL)
_TOKEN_FORMS = "a word of the text, a token index from 0, or WORD:N (the Nth occurrence of the word)"


def parse_token(spec: str | None) -> str | int | tuple[str, int] | None:
    """``--token``'s value: None (the default token); ``"3"`` -> 3, a token index; ``"bank:2"`` -> ("bank", 2),
    the second occurrence of the word; anything else -> the word, as given.

    Refused with an error naming ``--token``: a negative index, an occurrence 0, and numbers too long to be
    an index or an occurrence (they would not fit any text).
    """
    if spec is None:
        return None
    text = spec.strip()
    if re.fullmatch(r"-\s*[0-9]+", text):
        raise bad_argument(
            "--token", _TOKEN_FORMS, repr(spec), "token indices count from 0 at the start of the text, not from the end"
        )
    occurrence = _OCCURRENCE.fullmatch(text)
    if occurrence is None:
        return _token_number(text, spec) if text.isdigit() and text.isascii() else text
    word, nth = occurrence["word"].strip(), _token_number(occurrence["nth"], spec)
    if nth == 0:
        raise bad_argument("--token", "an occurrence counted from 1", repr(spec), f"pass {word}:1 for the first")
    return word, nth


def _token_number(digits: str, spec: str) -> int:
    """An index or occurrence of ``--token`` (refused past 9 digits: no text is that long, and Python's int()
    refuses a few thousand digits)."""
    if len(digits.lstrip("0")) > 9:
        raise bad_argument("--token", f"{_TOKEN_FORMS}, within the text", repr(spec), "pick a token of the text")
    return int(digits)


# The short names of dtypes people type (PyTorch's own aliases and the usual fp/bf ones), for every --dtype.
DTYPE_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
}
DTYPE_HELP = "float32, bfloat16, float16 or float64 (or fp32, bf16, fp16, fp64, half, float, double)"


def parse_dtype(spec: str, option: str = "--dtype") -> str:
    """A --dtype value as the name multihead.cost.DTYPES uses: 'fp16', 'half', 'torch.float16', 'Float16' ->
    'float16'. The one parser of every command that takes a dtype; anything else is refused naming ``option``."""
    from multihead.cost import DTYPES

    key = spec.strip().lower().removeprefix("torch.")
    name = DTYPE_ALIASES.get(key, key)
    if name not in DTYPES:
        raise bad_argument(
            option,
            f"one of {', '.join(DTYPES)} (or {', '.join(DTYPE_ALIASES)})",
            repr(spec),
            f"pass e.g. {option} float32 or {option} bf16",
        )
    return name


def _inspect_parser(subparsers) -> None:
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
    parser.add_argument(
        "--format",
        default="terminal,html",
        metavar="LIST",
        help="any of terminal,html,png,json, comma-separated (default: terminal,html)",
    )
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
    parser.set_defaults(run=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from multihead.inspect.report import bundled_corpus, inspect_text, read_corpus
    from multihead.inspect.write import check_formats, write_reports
    from multihead.integrations import load_text_model

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
    corpus, corpus_source = None, None
    if args.corpus == BUNDLED:
        corpus = bundled_corpus()
        corpus_source = f"bundled corpus ({len(corpus)} sentences)"
    elif args.corpus is not None:
        corpus = read_corpus(args.corpus, argument="--corpus")
        corpus_source = f"{args.corpus} ({len(corpus)} texts)"
    with from_option("--model"):
        model = load_text_model(args.model)
    layers, heads = _chosen_heads(model, args.layers, args.heads)
    part, behaviours = _saved_behaviours(args.model, model, args.part)
    text = args.text if args.text is not None else _task_text(args.model) or DEFAULT_TEXT
    columns, relations = None, None
    if args.scores:
        from multihead.inspect.headreport import report_relations

        columns = _report_columns(args.scores, model)
        relations = report_relations(args.scores, argument="--scores")  # each head's relation, into its role
    with (
        Progress(console=console, transient=True, disable=corpus is None or not console.is_terminal) as progress,
        from_option("--token", names=("token",)),
        from_option("--heads", names=("heads",)),
        from_option("--part", names=("part",)),
    ):
        task = progress.add_task("corpus statistics", total=len(corpus or ()))
        inspection = inspect_text(
            model,
            text,
            layers=layers,
            heads=heads,
            part=part,
            token=token,
            corpus=corpus,
            corpus_source=corpus_source,
            truncate=args.truncate,
            progress=lambda done: progress.update(task, completed=done),
            relations=relations,
            behaviours=behaviours,
        )
    if behaviours is not None:  # the probes' measures as columns of the HTML report, beside any --scores
        columns = {**(columns or {}), **{f"{name} (probe)": values.tolist() for name, values in behaviours.items()}}
    extra_columns = None
    if columns is not None:  # the scores of the heads shown, by layer and checkpoint head number
        extra_columns = {
            name: [[values[layer][head] for head in inspection.heads] for layer in inspection.layers]
            for name, values in columns.items()
        }
    paths = write_reports(inspection, args.out, formats, console=console, extra_columns=extra_columns, argument="--out")
    for name, path in paths.items():
        size = path.stat().st_size
        console.print(f"{name} report: {path.resolve()} ({format_bytes(size)})", soft_wrap=True, markup=False)
        if name == "html" and size > HTML_SIZE_NOTE:  # a browser or a notebook cell slows down past it
            console.print(
                f"note: report.html is {format_bytes(size)}, over {format_bytes(HTML_SIZE_NOTE)}: a browser may be "
                "slow to open it. Record fewer heads (--layers, --heads) or a shorter text",
                soft_wrap=True,
                markup=False,
                highlight=False,
            )
    note = skipped_note(paths.skipped.values())  # png without matplotlib: the other reports, and this line
    if note is not None:
        console.print(note, soft_wrap=True, markup=False, highlight=False)
    return 0


def _task_text(folder: str | None) -> str | None:
    """An input of the task a `multihead train` checkpoint in ``folder`` learned (None for any other model)."""
    from multihead.inspect.behaviours import read_task
    from multihead.train.tasks import example_text

    saved = None if folder is None else read_task(folder)
    return None if saved is None else example_text(*saved)


def _saved_behaviours(folder: str | None, model, part: str | None):
    """The part to show and the behaviour probes saved in the --model folder (``multihead train`` writes them) for
    it, as {name: (layers, heads)} (None when the folder has none for that part). Without --part, a checkpoint
    shows the part its probes measured (an encoder-decoder of ``train reverse``: its cross-attention)."""
    from multihead.capture import part_sites
    from multihead.inspect.behaviours import read_behaviours

    saved = None
    if folder is not None:
        with from_option("--model"):
            saved = read_behaviours(folder)
    if saved is None:
        return part, None
    if part is None and len(saved) == 1:
        part = next(iter(saved))
    with from_option("--part", names=("part",)):
        chosen, _ = part_sites(model, part)
    return part, saved.get(chosen)


def _chosen_heads(model, layers_spec: str | None, heads_spec: str | None) -> tuple[list[int] | None, list[int] | None]:
    """--layers and --heads checked against the model's sizes: heads by their checkpoint numbers, which a pruned
    model's heads keep (a head pruned from every chosen layer is refused by inspect_text)."""
    from multihead.inspect.recording import head_numbers

    numbers, total = head_numbers(model)
    return parse_indices("layers", layers_spec, len(numbers)), parse_indices("heads", heads_spec, total)


def _cost_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "cost",
        help="parameters, FLOPs and bytes of an attention layer, exactly, and its roofline here",
        description="Count what one call of a multi-head attention layer costs: parameters, FLOPs by term, "
        "memory, the n x n crossover, and (after `multihead bench --calibrate`) the roofline bound.",
    )
    parser.add_argument("--embed-dim", type=int, required=True, help="D, the query feature size")
    parser.add_argument("--heads", type=int, required=True, help="h, the query heads")
    parser.add_argument("--seq", type=int, required=True, help="i, the query length (decode: new tokens)")
    parser.add_argument("--kv-seq", type=int, help="j, the key length for cross-attention (default: --seq)")
    parser.add_argument("--kv-heads", type=int, help="g, key/value heads (default: --heads)")
    parser.add_argument("--kdim", type=int, help="key input size (default: embed dim)")
    parser.add_argument("--vdim", type=int, help="value input size (default: embed dim)")
    parser.add_argument("--head-dim", type=int, help="d per head (default: embed dim / heads)")
    parser.add_argument("--value-head-dim", type=int, help="e per head (default: head dim)")
    parser.add_argument("--out-dim", type=int, help="output size (default: embed dim)")
    parser.add_argument("--no-bias", action="store_true", help="projections without biases")
    parser.add_argument("--batch", type=int, default=1, help="b (default 1)")
    parser.add_argument("--dtype", default="float32", help=DTYPE_HELP + " (default float32)")
    parser.add_argument("--causal", action="store_true", help="causal mask")
    parser.add_argument("--backward", action="store_true", help="a training step: forward and backward")
    parser.add_argument("--decode-cache", type=int, metavar="L", help="one decode step with L cached tokens")
    parser.add_argument("--need-weights", action="store_true", help="the (b, h, i, j) weights are returned")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--plot", metavar="FILE.png", help="draw FLOPs and memory against n")
    ranks = parser.add_argument_group("across ranks (multihead.parallel): per-rank FLOPs, memory and bytes sent")
    ranks.add_argument("--tp", type=int, default=1, metavar="P", help="split the heads over P ranks (shard_heads)")
    ranks.add_argument("--cp", type=int, default=1, metavar="P", help="split the sequence over P ranks")
    ranks.add_argument("--cp-method", choices=("ring", "ulysses"), default="ring", help="how --cp attends (ring)")
    ranks.add_argument(
        "--link-gbs", type=float, metavar="GB/S", help="bandwidth between ranks, per direction (NVLink 4: 450)"
    )
    ranks.add_argument(
        "--tp-link-gbs",
        type=float,
        metavar="GB/S",
        help="the --tp group's bandwidth when it differs (default: --link-gbs)",
    )
    ranks.add_argument("--gflops", type=float, help="a rank's compute rate for the time (default: this machine's)")
    ranks.add_argument("--memory-gbs", type=float, help="a rank's memory bandwidth (default: this machine's)")
    parser.set_defaults(run=run_cost)


PLOT_SUFFIXES = (".png", ".pdf", ".svg")  # formats matplotlib writes everywhere, named by --plot's suffix


# multihead.cost's arguments as `multihead cost` spells them: its errors name the options the user typed.
COST_OPTIONS = {
    "embed_dim": "--embed-dim",
    "num_heads": "--heads",
    "num_kv_heads": "--kv-heads",
    "kdim": "--kdim",
    "vdim": "--vdim",
    "head_dim": "--head-dim",
    "value_head_dim": "--value-head-dim",
    "out_dim": "--out-dim",
    "seq": "--seq",
    "kv_seq": "--kv-seq",
    "batch": "--batch",
    "dtype": "--dtype",
    "cache_len": "--decode-cache",
    "tp": "--tp",
    "cp": "--cp",
}


def run_cost(args: argparse.Namespace) -> int:
    with from_options(COST_OPTIONS):
        return _run_cost(args)


def _run_cost(args: argparse.Namespace) -> int:
    import json

    from multihead._figures import Written, draw_figure
    from multihead.cost import LayerShape, estimate
    from multihead.cost_report import cost_json, parallel_json, plot_cost, print_cost, print_parallel
    from multihead.machine import read_calibration

    args.dtype = parse_dtype(args.dtype)
    if args.backward and args.decode_cache is not None:
        raise bad_argument(
            "--decode-cache",
            "no --backward (a decode step is inference)",
            "both",
            "drop one of --backward and --decode-cache",
        )
    shape = LayerShape(
        args.embed_dim,
        args.heads,
        num_kv_heads=args.kv_heads,
        kdim=args.kdim,
        vdim=args.vdim,
        head_dim=args.head_dim,
        value_head_dim=args.value_head_dim,
        out_dim=args.out_dim,
        bias=not args.no_bias,
    )
    mode = "decode" if args.decode_cache is not None else "forward+backward" if args.backward else "forward"
    report = estimate(
        shape,
        seq=args.seq,
        kv_seq=args.kv_seq,
        batch=args.batch,
        causal=args.causal,
        dtype=args.dtype,
        mode=mode,
        cache_len=args.decode_cache,
        need_weights=args.need_weights,
    )
    plot_path = None
    if args.plot is not None:
        if args.kv_seq is not None or mode == "decode":
            raise bad_argument(
                "--plot",
                "a self-attention forward or training configuration",
                "cross-attention or decode",
                "drop --kv-seq / --decode-cache to plot against n",
            )
        plot_path = output_file("--plot", args.plot, suffixes=PLOT_SUFFIXES, fix="pass e.g. --plot cost.png")
    rates, note = read_calibration()
    if note:  # a damaged cache is not the user's argument: say it was ignored, and go on without it
        print(f"multihead cost: note: {note}", file=sys.stderr)
    split = _parallel_split(args, shape, mode) if args.tp > 1 or args.cp > 1 else None
    if split is None and any(v is not None for v in (args.link_gbs, args.tp_link_gbs, args.gflops, args.memory_gbs)):
        raise bad_argument(
            "--link-gbs",
            "--tp or --cp above 1 with --link-gbs, --gflops, --memory-gbs",
            "one rank",
            "add e.g. --cp 8",
        )
    plotted = Written()  # the --plot figure; without matplotlib, left out and named in one line
    if plot_path is not None:
        draw_figure(
            plotted,
            "plot",
            plot_path,
            lambda path: plot_cost(
                shape,
                path,
                seq=args.seq,
                batch=args.batch,
                dtype=report.dtype,
                mode=mode,
                causal=args.causal,
                argument="--plot",
            ),
        )
    skipped = skipped_note(plotted.skipped.values())
    if args.json:
        data = cost_json(report, rates)
        if split is not None:
            data["parallel"] = parallel_json(split[0], split[1])
        print(json.dumps(data, indent=1))
        if skipped is not None:
            print(skipped, file=sys.stderr)  # stdout stays the JSON
    else:
        console = make_console()
        print_cost(report, rates, console)
        if split is not None:
            print_parallel(split[0], split[1], console, rates_source=split[2])
        if "plot" in plotted:
            console.print(f"plot: {plotted['plot'].resolve()}", soft_wrap=True)
        if skipped is not None:
            console.print(skipped, soft_wrap=True, markup=False, highlight=False)
    return 0


def _parallel_split(args: argparse.Namespace, shape, mode: str):
    """(ParallelCost, ParallelTime or None, where the rates come from) for --tp/--cp; the rates are --gflops and
    --memory-gbs where given, else this machine's calibration."""
    from multihead.cost import MachineRates
    from multihead.cost_parallel import parallel_cost, parallel_time
    from multihead.machine import read_calibration

    if args.decode_cache is not None or args.kv_seq is not None or args.need_weights:
        raise bad_argument(
            "--tp/--cp",
            "self-attention forward or training (the parallel layers serve no decode, cross-attention or weights)",
            "--decode-cache, --kv-seq or --need-weights",
            "drop those options, or --tp/--cp",
        )
    for name, value in (
        ("--gflops", args.gflops),
        ("--memory-gbs", args.memory_gbs),
        ("--link-gbs", args.link_gbs),
        ("--tp-link-gbs", args.tp_link_gbs),
    ):
        if value is not None and not value > 0:
            raise bad_argument(name, "a positive rate", value, f"pass e.g. {name} 450")
    cost = parallel_cost(
        shape,
        seq=args.seq,
        batch=args.batch,
        causal=args.causal,
        dtype=args.dtype,
        mode=mode,
        tp=args.tp,
        cp=args.cp,
        cp_method=args.cp_method,
    )
    if args.link_gbs is None:
        if args.tp_link_gbs is not None:
            raise bad_argument("--tp-link-gbs", "--link-gbs as well", "--tp-link-gbs alone", "add --link-gbs")
        return cost, None, None
    calibrated, _ = read_calibration()
    if (args.gflops is None or args.memory_gbs is None) and calibrated is None:
        raise bad_argument(
            "--link-gbs",
            "a rank's compute rate and memory bandwidth: --gflops and --memory-gbs, or this machine's calibration",
            "neither",
            "pass --gflops and --memory-gbs (e.g. 989000 and 3350 for an H100 in bfloat16), or run "
            "`multihead bench --calibrate`",
        )
    gflops = dict(calibrated.matmul_gflops) if calibrated is not None else {}
    if args.gflops is not None:
        gflops = {cost.report.dtype: args.gflops}
    bandwidth = args.memory_gbs if args.memory_gbs is not None else calibrated.bandwidth_gbs  # type: ignore[union-attr]
    given = args.gflops is not None or args.memory_gbs is not None
    rates = MachineRates(gflops, bandwidth, threads=0)
    source = "the rates given" if given else "this machine's calibration"
    return cost, parallel_time(cost, rates, args.link_gbs, tp_link_gbs=args.tp_link_gbs), source


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (exit 2) in the house form, not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(usage_error(message, self.prog))}\n")


# argparse's own messages, recast as "<option>: expected ..., got ..." (argparse's words are kept after it).
# Each pattern names the option (or "arguments") and gives what was expected and what came.
_ARGPARSE_MESSAGES = [
    (
        r"argument (?P<option>[^:]+): invalid choice: (?P<got>.+?) \(choose from (?P<choices>.+)\)",
        lambda m: (f"one of {m['choices']}", m["got"]),
    ),
    (
        r"argument (?P<option>[^:]+): invalid (?P<kind>\w+) value: (?P<got>.+)",
        lambda m: ({"int": "a whole number", "float": "a number"}.get(m["kind"], f"a {m['kind']} value"), m["got"]),
    ),
    (r"argument (?P<option>[^:]+): expected one argument", lambda m: ("a value after it", "none")),
    (r"argument (?P<option>[^:]+): expected (?P<count>.+?) arguments?", lambda m: (f"{m['count']} values", "fewer")),
    (
        r"argument (?P<option>[^:]+): ignored explicit argument (?P<got>.+)",
        lambda m: ("no value (it is a switch)", m["got"]),
    ),
    (
        r"argument (?P<option>[^:]+): not allowed with argument (?P<other>.+)",
        lambda m: (f"not both {m['option']} and {m['other']}", "both"),
    ),
    (
        r"the following arguments are required: (?P<option>[^,]+)(?P<rest>.*)",
        lambda m: ("a value (it is required" + (f"; so are{m['rest'].lstrip(',')}" if m["rest"] else "") + ")", "none"),
    ),
    (r"unrecognized arguments: (?P<got>.+)", lambda m: ("only the arguments --help lists", repr(m["got"]))),
    (
        r"ambiguous option: (?P<option>\S+) could match (?P<choices>.+)",
        lambda m: (f"one of {m['choices']} in full", repr(m["option"])),
    ),
]


def usage_error(message: str, prog: str) -> str:
    """argparse's ``message`` in the house form: ``<option>: expected ..., got ... (argparse's words). Fix: ...``."""
    fix = f"see `{prog} --help`"
    for pattern, recast in _ARGPARSE_MESSAGES:
        match = re.fullmatch(pattern, message, flags=re.DOTALL)
        if match is not None:
            expected, got = recast(match)
            subject = match.groupdict().get("option") or "arguments"
            return f"{subject}: expected {expected}, got {got} ({message}). Fix: {fix}"
    return f"arguments: expected what --help lists, got {message!r}. Fix: {fix}"


def _bench_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="time multihead against torch SDPA, torch.nn.MultiheadAttention and the textbook code, here",
        description="Time multihead (the attention function and the layer) against torch SDPA, "
        "torch.nn.MultiheadAttention and the textbook code on this machine, interleaved with "
        "torch.utils.benchmark; print each time with its spread, our time over each peer's, and the share "
        "of this machine's roofline bound reached; write bench.json (bench_quick.json with --quick; and a PNG "
        "beside it with matplotlib).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (n up to 1024) and 5 rounds: 3 minutes on a busy 2-core machine, calibration included "
        "(the full run adds n = 2048)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's matmul rate and bandwidth again (cached for `multihead cost`); alone, only that",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        help=DTYPE_HELP + "; default float32: the comparison's dtype and the one calibrated (repeatable)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default="multihead-bench",
        help="where bench.json and bench.png go (bench_quick.json and bench_quick.png with --quick; "
        "default %(default)s)",
    )
    parser.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from multihead import bench
    from multihead._userfiles import writing
    from multihead.bench_report import print_report
    from multihead.machine import calibrate, calibration_path, identity, save_calibration

    console = make_console()
    dtypes = list(dict.fromkeys(parse_dtype(spec) for spec in args.dtype or ["float32"]))
    if args.calibrate and not args.quick:
        cache = calibration_path()
        fix = "set MULTIHEAD_CACHE to a folder you can write to"
        output_folder("MULTIHEAD_CACHE", cache.parent, fix=fix)
        with console.status("calibrating: matmul rate, bandwidth, and each backend's rate for auto"):
            rates = calibrate(dtypes, kernels=True)
        with writing("MULTIHEAD_CACHE", cache, fix=fix):
            path = save_calibration(rates)
        kernel = rates.details.get("kernel_rates", {}).get("gflops", {})
        backends = ", ".join(
            f"{name} {by_key['forward float32']:.1f}" for name, by_key in kernel.items() if "forward float32" in by_key
        )
        console.print(
            f"calibrated {identity().describe()}: "
            + ", ".join(f"{k} matmul {v:.1f} GFLOP/s" for k, v in rates.matmul_gflops.items())
            + f", bandwidth {rates.bandwidth_gbs:.1f} GB/s"
            + (f"; backends (float32 forward, GFLOP/s): {backends}" if backends else "")
            + f"; saved to {path}"
            + (
                "; auto uses these rates only where you opt in: "
                "multihead.backends.set_policy(multihead.machine.measured_policy())"
                if backends
                else ""
            ),
            soft_wrap=True,
        )
        return 0
    out_dir = output_folder("--out", args.out, create=False)  # before minutes of measuring, not after
    with console.status("starting") as status:
        results = bench.run(
            quick=args.quick, dtypes=dtypes, recalibrate=args.calibrate, say=lambda line: status.update(line)
        )
    with writing("--out", out_dir):
        written = bench.write_reports(results, out_dir)
    print_report(results, console)
    print_written(console, written)
    return 0


def _heads_parser(subparsers) -> None:
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
    from rich.progress import Progress

    from multihead._userfiles import writing
    from multihead.inspect import headreport
    from multihead.inspect.recording import head_numbers
    from multihead.inspect.report import bundled_corpus, read_corpus
    from multihead.integrations import load_text_model
    from multihead.models import Encoder

    console = make_console()
    plan = None
    if args.mode == "prune":
        if (args.fraction is None) == (args.remove is None):
            raise bad_argument(
                "--fraction", "either --fraction F or --remove L:H,...", "both or neither", "pass e.g. --fraction 0.3"
            )
        if args.fraction is not None and not 0.0 <= args.fraction < 1.0:
            raise bad_argument(
                "--fraction", "a fraction of all heads in [0, 1)", args.fraction, "pass e.g. --fraction 0.3"
            )
        if args.remove is not None:
            plan = _parse_removal(args.remove)
    out_dir = output_folder("--out", args.out, create=False)  # checked now; made when a file is written
    if args.mode == "syntax":
        return run_syntax(args, console, out_dir)
    if args.mode == "importance" and args.model is not None:
        from multihead.inspect.behaviours import read_task

        with from_option("--model"):
            trained = read_task(args.model)
        if trained is not None:  # a `multihead train` checkpoint: its heads' cost to its own task
            return _task_importance(args, console, out_dir, *trained)
    texts = read_corpus(args.corpus, argument="--corpus") if args.corpus else bundled_corpus()
    if len(texts) < 2:  # embedding fidelity compares each text's nearest neighbour
        raise bad_argument(
            "--corpus", "at least two texts, one per line", f"{len(texts)} in {args.corpus!r}", "add texts to the file"
        )
    source = args.corpus or f"bundled corpus ({len(texts)} sentences)"
    with from_option("--model"):
        model = load_text_model(args.model)
    numbers, checkpoint_heads = head_numbers(model)  # scores are by layer and the checkpoint's head numbers
    counts = [len(heads) for heads in numbers]
    if args.mode == "prune" and not isinstance(model, Encoder):
        raise bad_argument(
            "--model",
            "a model on multihead's own layer, whose heads can be removed (all-MiniLM-L6-v2, a BERT-style checkpoint)",
            f"{model.name}, a transformers checkpoint",
            "rank its heads with `multihead heads importance --model ...` (ablation: nothing is removed)",
        )
    if plan is not None:
        assert isinstance(model, Encoder)  # refused above otherwise
        with from_option("--remove"):
            model.prune_heads(plan)
        model_dir = output_folder("--out", out_dir / "model")
        with writing("--out", model_dir):
            path = model.save(model_dir)
        removed = sum(counts) - sum(len(heads) for heads in head_numbers(model)[0])
        console.print(f"pruned {removed} heads; model saved to {path.resolve()} (load it with --model)", soft_wrap=True)
        return 0
    from multihead.inspect.importance import ablation_importance, pruning_curve

    if args.mode == "prune" and args.importance:
        scores = headreport.load_importance(
            args.importance, argument="--importance", shape=(len(counts), checkpoint_heads)
        )
    else:
        with Progress(console=console, transient=True, disable=not console.is_terminal) as bar:
            task = bar.add_task("ablating heads", total=None)
            importance = ablation_importance(
                model, texts, how=args.how, progress=lambda done, total: bar.update(task, completed=done, total=total)
            )
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
    fractions = sorted({0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, round(args.fraction, 4)})
    with Progress(console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("pruning curve", total=len(fractions))
        curve = pruning_curve(
            model, texts, scores, fractions=fractions, progress=lambda done, total: bar.update(task, completed=done)
        )
    console.print(headreport.curve_table(curve))
    best = headreport.heads_at_fidelity(curve)
    if best is not None:
        console.print(
            f"at mean cosine >= 0.99: {best['heads_removed']} of {sum(counts)} heads removed "
            f"(fraction {best['fraction']:.2f}), attention {headreport.speed_words(best)}",
            soft_wrap=True,
        )
    chosen = next(row for row in curve if row["fraction"] == round(args.fraction, 4))
    prune_plan: dict[int, list[int]] = {}
    for layer, head in chosen["removed"]:  # checkpoint head numbers, as Encoder.prune_heads takes them
        prune_plan.setdefault(layer, []).append(head)
    assert isinstance(model, Encoder)  # prune on another model was refused before any work
    model.prune_heads(prune_plan)
    model_dir = output_folder("--out", out_dir / "model")
    with writing("--out", model_dir):
        model_path = model.save(model_dir)
    paths = headreport.write_curve(curve, out_dir)
    console.print(
        f"pruned {chosen['heads_removed']} heads (fraction {args.fraction}): mean cosine "
        f"{chosen['cosine']:.4f}; model saved to {model_path.resolve()}",
        soft_wrap=True,
    )
    headreport.print_written(console, paths)
    return 0


def _task_importance(args: argparse.Namespace, console, out_dir: Path, task: str, settings) -> int:
    from multihead.inspect import headreport
    from multihead.integrations import load_text_model
    from multihead.train.checkpoints import task_importance

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
    from multihead.inspect import headreport

    return headreport.run_syntax_command(args, console, out_dir)


def _report_columns(folder: str, model) -> dict[str, list[list[float | None]]]:
    """The --scores folder's per-head columns, (layers, checkpoint heads) of this model's size (null: pruned)."""
    from multihead.inspect.headreport import report_columns
    from multihead.inspect.recording import head_numbers

    numbers, total = head_numbers(model)
    return report_columns(folder, argument="--scores", shape=(len(numbers), total))


def _train_parser(subparsers) -> None:
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
    parser.add_argument("--out", metavar="DIR", default="multihead-train", help="where the run goes")
    parser.set_defaults(run=run_train)


def _train_settings(task: str, args: argparse.Namespace):
    """The task's settings with the options given; an error about a field names the option the user typed."""
    import dataclasses

    from multihead.train.induction import InductionSettings
    from multihead.train.reverse import ReverseSettings

    given = {
        "steps": args.steps,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "hidden": args.hidden,
        "lr": args.lr,
        "seed": args.seed,
    }
    # the fields each option sets: the encoder-decoder's --layers sets both of its stacks
    fields: dict[str, tuple[str, ...]] = {name: (name,) for name in given}
    if task == "reverse":
        fields["layers"] = ("encoder_layers", "decoder_layers")
    chosen = {field: value for name, value in given.items() if value is not None for field in fields[name]}
    defaults = InductionSettings() if task == "induction" else ReverseSettings()
    try:
        return dataclasses.replace(defaults, **chosen)
    except InputError as error:  # the settings name their fields; the user typed the options
        option = next((option for option, names in fields.items() if error.argument in names), None)
        if option is None:
            raise
        raise error.about(f"--{option.replace('_', '-')}") from None


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
    from multihead.train.induction import run_induction
    from multihead.train.reverse import run_reverse

    settings = _train_settings("reverse" if args.task == "reverse" else "induction", args)
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

        run = run_induction(settings, on_log=show) if induction else run_reverse(settings, on_log=show)
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
            f"(unablated {final['loss']:.3f}). role: multihead.inspect.roles on these probes."
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
            f"{final['loss']:.4f}). role: multihead.inspect.roles on these probes."
        )
    console.print(_probe_table(run, induction))
    console.print(note, markup=False)  # prose: wrapped at the console's width between words
    paths = run.save(out)
    print_written(console, paths)
    console.print(f"inspect it: multihead inspect --model {paths['model']}", soft_wrap=True, markup=False)
    return 0


def _train_symmetry(settings, out: Path) -> int:
    """`multihead train symmetry`: the induction settings' decoder trained from one initialisation twice, as
    drawn and with identical heads; the heads' mean pairwise divergence over training, in a table and a PNG."""
    import json

    from rich import box
    from rich.status import Status
    from rich.table import Table

    from multihead._figures import Written, draw_figure
    from multihead._userfiles import writing
    from multihead.train.symmetry import plot_symmetry, symmetry_experiment

    console = make_console()
    with Status("training twice: random heads, then identical heads", console=console):
        result = symmetry_experiment(
            settings.model_config(),
            steps=settings.steps,
            seed=settings.seed,
            half_length=settings.half_length,
            min_half_length=settings.min_half_length,
            vocab_size=settings.vocab_size,
            batch=settings.batch,
            lr=settings.lr,
            log_every=settings.log_every,
        )
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="mean pairwise JSD between a layer's heads (bits)")
    table.add_column("step", justify="right")
    for name in ("random", "identical"):
        for layer in range(settings.layers):
            table.add_column(f"{name} L{layer}", justify="right")
    table.add_column("loss random / identical", justify="right")
    random_history, identical_history = result["random"]["history"], result["identical"]["history"]
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
    stayed = "stayed bitwise identical" if result["identical_stayed_identical"] else "drifted apart (rounding)"
    start, end = (max(entry["divergence_mean"]) for entry in (random_history[0], random_history[-1]))
    console.print(
        f"identical heads {stayed} at every log; random heads: {start:.3f} bits apart at step 0 and {end:.3f} at "
        f"step {random_history[-1]['step']} (the layer furthest apart)",
        soft_wrap=True,
    )
    out.mkdir(parents=True, exist_ok=True)
    written = Written(json=out / "symmetry.json")
    with writing("--out", written["json"]):
        written["json"].write_text(json.dumps(result, indent=1))
    draw_figure(written, "png", out / "symmetry.png", lambda path: plot_symmetry(result, path))
    print_written(console, written)
    return 0


def _probe_table(run, induction: bool):
    """One row per head a run measured (an induction run's every head, a reverse run's cross-attention heads):
    its probe scores, its ablated loss and the role the probes give it."""
    from rich import box
    from rich.table import Table

    from multihead.inspect.roles import label_head

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
            # the probe signals alone: without text statistics the role is the probes' verdict
            role = label_head({"best_offset": -1.0, **measures}, {"probe": 1.0})
            label = role.short if role.confidence != "low" else "-"
            if induction:
                previous = float(final["previous_token"][layer, head])
                if previous >= 0.4 and role.label not in ("induction", "prefix"):
                    label = f"prev {previous:.0%}"
                cells = [previous, measures["prefix_matching"], measures["copying"]]
            else:
                cells = [measures["alignment"]]
            table.add_row(
                f"L{layer}H{head}",
                *(f"{value:.0%}" for value in cells),
                f"{float(final['ablated_loss'][layer, head]):.4f}",
                label,
            )
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="multihead", description="Multi-head attention you can see into.")
    parser.add_argument(
        "--version",
        action="version",
        version=f"multihead {package_version()}",
        help="print multihead's version and exit",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    _inspect_parser(subparsers)
    _cost_parser(subparsers)
    _bench_parser(subparsers)
    _heads_parser(subparsers)
    _train_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``multihead`` console script; returns the exit status.

    A mistake in the user's input (an :class:`~multihead._errors.InputError`: a bad option, a file
    that cannot be used) is one line on stderr and exit status 2. Any other exception is a bug in
    multihead and propagates with its traceback.

    A reader of stdout that stops reading (``multihead inspect | head``, quitting ``less``) ends the command
    quietly, with exit status 0 and no message: the reports on stdout went where the reader wanted them, the
    files are written (the consoles go quiet and the command carries on; a plain ``print`` that meets the
    closed pipe ends it here, with stdout sent to the null device so nothing fails again at exit).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0), or a usage mistake argparse already printed as one line (2)
        return exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 2
    try:
        return args.run(args)
    except InputError as error:  # it says what to do: no traceback
        print(f"multihead {args.command}: error: {one_line(str(error))}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:  # a package of the lab extra, missing: one line naming the extra
        missing = lab_module_of(error)
        if missing is None:
            raise
        print(f"multihead {args.command}: error: {lab_missing_error('this command', [missing])}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader of stdout has gone: not an error (see above)
        discard_stdout()
        return 0


def one_line(message: str) -> str:
    """``message`` on a single line (a quoted text or file line may carry line breaks)."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


if __name__ == "__main__":
    sys.exit(main())
