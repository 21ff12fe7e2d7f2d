"""The ``multihead`` command: one module per command (:mod:`~multihead.cli.inspect`, :mod:`~multihead.cli.cost`,
:mod:`~multihead.cli.bench`, :mod:`~multihead.cli.heads`, :mod:`~multihead.cli.train`), each parsing its options and
calling the library's public functions; this one builds the parser and runs a command, a user's mistake in one line.

multihead inspect "The bank was full of money." --token bank --corpus --out report

Each command imports what it runs inside its own functions, so one command does not load the others' modules (a
usage mistake is answered without them); at the top, the command modules import only the core's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from multihead._errors import InputError
from multihead._figures import print_written
from multihead._limits import format_bytes
from multihead._stdout import discard_stdout
from multihead._userfiles import in_plain_words
from multihead.cli import bench, circuits, cost, heads, inspect, train
from multihead.cli._shared import (
    MODEL_HELP,
    OneLineParser,
    one_line,
    package_version,
    parse_dtype,
    parse_indices,
    parse_token,
    torch_threads,
    usage_error,
)
from multihead.cli.cost import COST_OPTIONS
from multihead.cli.train import training_progress
from multihead.lab.extra import lab_missing_error, lab_module_of

__all__ = [
    "COST_OPTIONS",
    "MODEL_HELP",
    "build_parser",
    "format_bytes",
    "main",
    "one_line",
    "package_version",
    "parse_dtype",
    "parse_indices",
    "parse_token",
    "print_written",
    "training_progress",
    "usage_error",
]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="multihead", description="Multi-head attention you can see into.")
    parser.add_argument(
        "--version",
        action="version",
        version=f"multihead {package_version()}",
        help="print multihead's version and exit",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    inspect.add_parser(subparsers)
    cost.add_parser(subparsers)
    bench.add_parser(subparsers)
    heads.add_parser(subparsers)
    train.add_parser(subparsers)
    circuits.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``multihead`` console script; returns the exit status.

    A mistake in the user's input (an :class:`~multihead._errors.InputError`: a bad option, a file
    that cannot be used) is one line on stderr and exit status 2. Any other exception is a bug in
    multihead and propagates with its traceback.

    A command that runs models runs with its ``--threads`` (torch.set_num_threads), and torch's count is put back
    when it ends, however it ends.

    A reader of stdout that stops reading (``multihead inspect | head``, quitting ``less``) ends the command
    quietly, with exit status 0 and no message: the reports on stdout went where the reader wanted them, the
    files are written (the consoles go quiet and the command carries on; a plain ``print`` that meets the
    closed pipe ends it here, with stdout sent to the null device so nothing fails again at exit).
    """
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else list(argv)):  # bare `multihead`: what it can do, not an error
        parser.print_help()
        return 0
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0), or a usage mistake argparse already printed as one line (2)
        return exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 2
    try:
        if getattr(args, "mode_options", None) is not None:  # options of one mode, given in another: refused first
            args.mode_options.check(args)
        with torch_threads(getattr(args, "threads", None)):  # a command that runs models has --threads
            return args.run(args)
    except InputError as error:  # it says what to do: no traceback
        print(f"multihead {args.command}: error: {one_line(str(in_plain_words(error)))}", file=sys.stderr)
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
