"""What every command shares: the option parsers (indices, tokens, dtypes), --model's help, --threads, the
options that belong to one mode of a command (:func:`mode_options`), and argparse's mistakes said in one line."""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from multihead._errors import bad_argument

# Without a model to check against, index lists may name up to this many layers or heads: more than any
# model has, and few enough that expanding a range costs nothing.
MAX_INDICES = 1 << 16


_INDEX_PART = re.compile(r"([0-9]+)(?:\s*-\s*([0-9]+))?")


BUNDLED = "bundled"


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


def one_line(message: str) -> str:
    """``message`` on a single line (a quoted text or file line may carry line breaks)."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


# --------------------------------------------------------------------------- --threads


def add_threads_option(parser: argparse.ArgumentParser, *, default: int | None = None) -> None:
    """``--threads N`` on a command that runs models: :func:`multihead.cli.main` runs the command with
    ``torch.set_num_threads(N)`` and puts torch's count back after it (:func:`torch_threads`). ``default``: the
    command's count when the option is not given (None: torch's own, untouched)."""
    told = "torch's, one per core" if default is None else f"{default}"
    parser.add_argument(
        "--threads",
        type=int,
        default=default,
        metavar="N",
        help=f"the CPU threads torch computes with, from 1 to this machine's CPUs (default: {told}); on a busy "
        "machine 1 is often the fastest",
    )


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it, else os.cpu_count())."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """The block with ``torch.set_num_threads(threads)``, torch's count from before put back after it (also when it
    raises); None leaves torch's count as it is. ``threads`` is checked first: a whole number from 1 to
    :func:`usable_cpus` (more threads than CPUs only wait for each other), else an error naming ``--threads``."""
    if threads is None:
        yield
        return
    cpus = usable_cpus()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= cpus:
        raise bad_argument(
            "--threads",
            f"a whole number from 1 to {cpus} (the CPUs this process may use)",
            repr(threads),
            "pass e.g. --threads 1",
        )
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- options of one mode


@dataclass(frozen=True)
class ModeOptions:
    """Which modes of a command each of its mode-bound options belongs to (see :func:`mode_options`)."""

    command: str  # "heads", as the user types it
    mode_of: Callable[[argparse.Namespace], str]  # the mode a parsed call is in ("importance")
    modes: Mapping[str, tuple[str, ...]]  # option -> the modes it applies to: {"--max-sentences": ("syntax",)}
    dests: Mapping[str, str]  # option -> its attribute on the parsed namespace
    defaults: Mapping[str, object]  # option -> its value when not given

    def check(self, args: argparse.Namespace) -> None:
        """An option given in a mode it does not belong to is one error naming it and its modes, before anything
        runs (a silently ignored --max-sentences made `heads importance` run for minutes)."""
        mode = self.mode_of(args)
        for option, modes in self.modes.items():
            value = getattr(args, self.dests[option])
            if mode in modes or value == self.defaults[option]:
                continue
            shown = option if value is True else f"{option} {value}"
            belongs = " or ".join(f"`multihead {self.command} {name}`" for name in modes)
            raise bad_argument(
                option,
                f"an option of {belongs}",
                f"`multihead {self.command} {mode} {shown}`",
                f"leave out {option} (it applies to {' and '.join(modes)} only)",
            )


def mode_options(
    parser: argparse.ArgumentParser,
    command: str,
    mode_of: Callable[[argparse.Namespace], str],
    modes: Mapping[str, tuple[str, ...]],
) -> None:
    """Declare, once per command, the modes each of ``modes``' options applies to; :func:`multihead.cli.main`
    refuses an option given in another mode (any value but its default) before the command runs. ``mode_of``
    reads the mode from the parsed options (``lambda args: args.mode``)."""
    actions = {option: parser._option_string_actions[option] for option in modes}  # argparse's own index
    parser.set_defaults(
        mode_options=ModeOptions(
            command,
            mode_of,
            dict(modes),
            {option: action.dest for option, action in actions.items()},
            {option: action.default for option, action in actions.items()},
        )
    )


# --------------------------------------------------------------------------- progress


def progress_bar(console, *, shown: bool = True):
    """The bar every command shows while it works: on a terminal only (piped output gets no bar, and no blank
    line where one was), gone when the work is done; ``shown=False`` for work too short to need one."""
    from rich.progress import Progress

    return Progress(console=console, transient=True, disable=not shown or not console.is_terminal)


# --------------------------------------------------------------------------- --format

# What every command that writes reports shows when --format is not given: the terminal and the HTML page (JSON
# and PNG on request), one default for inspect, inspect --long and circuits alike.
DEFAULT_FORMATS = "terminal,html"


def add_format_option(parser: argparse.ArgumentParser, formats: str) -> None:
    """``--format LIST`` among ``formats`` ("terminal,html,json,png"), its default :data:`DEFAULT_FORMATS`."""
    parser.add_argument(
        "--format",
        default=DEFAULT_FORMATS,
        metavar="LIST",
        help=f"any of {formats}, comma-separated (default {DEFAULT_FORMATS})",
    )
