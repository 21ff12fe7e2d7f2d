"""`multihead circuits`: which heads of a causal LM carry an answer (activation, attribution and path patching)."""

from __future__ import annotations

import argparse

from multihead._console import make_console
from multihead._errors import bad_argument
from multihead._figures import print_written
from multihead._userfiles import from_option, from_options, output_folder

WHATS = ("z", "pattern", "q", "k", "v")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "circuits",
        help="which heads of a causal LM carry an answer: activation, attribution and path patching",
        description="Run a clean and a corrupted prompt through a causal LM on multihead's kernel (a `multihead "
        "train` checkpoint, or a transformers causal LM folder) and patch each head's activation from the clean "
        "run into the corrupted one: the share of logit(answer) - logit(wrong) at the last position it restores.",
    )
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    patch = modes.add_parser(
        "patch",
        help="patch each head (or each layer at each position) from the clean run into the corrupted one",
        description="Clean and corrupt must tokenise to the same length, and --answer and --wrong each add one "
        "token after the clean prompt (as written, or after a space).",
    )
    patch.add_argument(
        "--model",
        metavar="DIR",
        required=True,
        help="a causal LM folder (a `multihead train` checkpoint, or a transformers *ForCausalLM save)",
    )
    patch.add_argument("--clean", metavar="TEXT", required=True, help="the prompt the model answers")
    patch.add_argument("--corrupt", metavar="TEXT", required=True, help="the same prompt with its evidence changed")
    patch.add_argument("--answer", metavar="TOKEN", required=True, help="the token the clean prompt leads to")
    patch.add_argument("--wrong", metavar="TOKEN", required=True, help="the token it competes with")
    patch.add_argument("--what", choices=WHATS, default="z", help="the activation patched (default z, the output)")
    patch.add_argument(
        "--by",
        choices=("head", "position"),
        default="head",
        help="one head, or a layer's every head at one position (default head)",
    )
    patch.add_argument(
        "--method",
        choices=("exact", "attribution"),
        default="exact",
        help="exact patching, or its first-order estimate from one backward (default exact)",
    )
    patch.add_argument(
        "--format", default="terminal,json", metavar="LIST", help="any of terminal,json,png (default terminal,json)"
    )
    patch.add_argument(
        "--out",
        metavar="DIR",
        default="multihead-circuits",
        help="where patching.json and patching.png go (default multihead-circuits)",
    )
    patch.set_defaults(run=run_patch)


# the library's argument names as `multihead circuits patch` spells them
PATCH_OPTIONS = {
    "clean_ids": "--clean",
    "corrupt_ids": "--corrupt",
    "answer": "--answer",
    "wrong": "--wrong",
    "what": "--what",
    "by": "--by",
}


def run_patch(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from multihead.circuits import activation_patching, attribution_patching
    from multihead.circuits.report import check_formats, print_patching, write_patching
    from multihead.integrations import load_causal_lm

    with from_option("--format", names=("format",)):
        formats = check_formats(args.format)
    if any(name != "terminal" for name in formats):
        output_folder("--out", args.out, create=False)  # checked now; made when the files are written
    with from_option("--model"):
        lm = load_causal_lm(args.model)
    with from_options({"text": "--clean"}):
        clean_ids = lm.ids(args.clean)
    with from_options({"text": "--corrupt"}):
        corrupt_ids = lm.ids(args.corrupt)
    if clean_ids.shape != corrupt_ids.shape:
        raise bad_argument(
            "--corrupt",
            f"a prompt of as many tokens as --clean ({clean_ids.shape[1]}): patching swaps them position by position",
            f"{corrupt_ids.shape[1]} tokens",
            "change the evidence word for word, keeping the length",
        )
    with from_options({"continuation": "--answer"}):
        answer = lm.next_token(args.clean, args.answer)
    with from_options({"continuation": "--wrong"}):
        wrong = lm.next_token(args.clean, args.wrong)
    console = make_console()
    with (
        Progress(console=console, transient=True, disable=not console.is_terminal) as bar,
        from_options(PATCH_OPTIONS),
    ):
        if args.method == "exact":
            task = bar.add_task("patching", total=None)
            result = activation_patching(
                lm.model,
                clean_ids,
                corrupt_ids,
                answer=answer,
                wrong=wrong,
                what=args.what,
                by=args.by,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
        else:
            result = attribution_patching(
                lm.model, clean_ids, corrupt_ids, answer=answer, wrong=wrong, what=args.what, by=args.by
            )
    if "terminal" in formats:
        print_patching(console, result)
    prompts = {
        "model": lm.name,
        "clean": args.clean,
        "corrupt": args.corrupt,
        "answer": args.answer,
        "wrong": args.wrong,
    }
    print_written(console, write_patching(result, args.out, formats, prompts=prompts, argument="--out"))
    return 0
