"""`multihead circuits`: which heads of a causal LM carry an answer (activation, attribution and path patching)."""

from __future__ import annotations

import argparse

from multihead._console import make_console
from multihead._errors import bad_argument
from multihead._figures import print_written
from multihead._userfiles import from_option, from_options, output_folder
from multihead.cli._shared import add_format_option, add_threads_option, progress_bar

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
    add_format_option(patch, "terminal,html,json,png")
    patch.add_argument(
        "--out",
        metavar="DIR",
        default="multihead-circuits",
        help="where patching.json and patching.png go (default multihead-circuits)",
    )
    patch.add_argument(
        "--receivers",
        metavar="L:H,L:H",
        help="path patching instead: each earlier head as a sender into these heads' --what (q, k or v) alone, "
        "e.g. 1:0,1:2",
    )
    add_threads_option(patch)
    patch.set_defaults(run=run_patch)
    for mode, help_text in (
        ("dla", "each head's direct effect on logit(answer) - logit(wrong) at the last position"),
        ("lens", "the logit lens: the likeliest next tokens read after each layer"),
    ):
        sub = modes.add_parser(mode, help=help_text, description=help_text + ".")
        sub.add_argument("--model", metavar="DIR", required=True, help="a causal LM folder (as for patch)")
        sub.add_argument("--text", metavar="TEXT", required=True, help="the prompt")
        sub.add_argument("--answer", metavar="TOKEN", required=mode == "dla", help="the token the prompt leads to")
        sub.add_argument("--wrong", metavar="TOKEN", required=mode == "dla", help="the token it competes with")
        if mode == "lens":
            sub.add_argument("--top", type=int, default=5, metavar="K", help="tokens shown per layer (default 5)")
        add_format_option(sub, "terminal,html,json,png")
        sub.add_argument("--out", metavar="DIR", default="multihead-circuits", help="where the files go")
        add_threads_option(sub)
        sub.set_defaults(run=run_dla if mode == "dla" else run_lens)
    detect = modes.add_parser(
        "detect",
        help="previous-token, duplicate-token and induction scores on repeated random tokens, and sinks",
        description="Score every head on repeated random tokens (TransformerLens' detectors) and its first-token "
        "share (Gu et al. 2024; above 0.3 a sink head).",
    )
    detect.add_argument("--model", metavar="DIR", required=True, help="a causal LM folder (as for patch)")
    detect.add_argument(
        "--half-length",
        type=int,
        metavar="N",
        help="random tokens, repeated once (default 20, or fewer where the model's positions hold fewer)",
    )
    detect.add_argument("--batch", type=int, default=4, metavar="B", help="sequences (default 4)")
    detect.add_argument("--seed", type=int, default=0, help="seeds the random tokens (default 0)")
    add_format_option(detect, "terminal,html,json,png")
    detect.add_argument("--out", metavar="DIR", default="multihead-circuits", help="where the files go")
    add_threads_option(detect)
    detect.set_defaults(run=run_detect)


# the library's argument names as `multihead circuits patch` spells them
PATCH_OPTIONS = {
    "clean_ids": "--clean",
    "corrupt_ids": "--corrupt",
    "answer": "--answer",
    "wrong": "--wrong",
    "what": "--what",
    "by": "--by",
    "receivers": "--receivers",
}


def _parse_receivers(spec: str) -> list[tuple[int, int]]:
    """'1:0,1:2' -> [(1, 0), (1, 2)]."""
    found = []
    for part in filter(None, (piece.strip() for piece in spec.split(","))):
        layer, _, head = part.partition(":")
        if not (layer.strip().isdigit() and head.strip().isdigit()):
            raise bad_argument(
                "--receivers", "LAYER:HEAD pairs separated by commas", repr(spec), "pass e.g. --receivers 1:0,1:2"
            )
        found.append((int(layer), int(head)))
    if not found:
        raise bad_argument("--receivers", "at least one LAYER:HEAD", repr(spec), "pass e.g. --receivers 1:0")
    return found


def run_patch(args: argparse.Namespace) -> int:

    from multihead.lab.circuits import activation_patching, attribution_patching, path_patching
    from multihead.lab.circuits.report import patching_data, patching_page, print_page, write_report

    receivers = None
    if args.receivers is not None:
        receivers = _parse_receivers(args.receivers)
        if args.what not in ("q", "k", "v") or args.by != "head" or args.method != "exact":
            raise bad_argument(
                "--receivers",
                "--what q, k or v, by head, exact (path patching replaces the receivers' inputs)",
                f"--what {args.what} --by {args.by} --method {args.method}",
                "pass --what k (or q, v) with --receivers",
            )
    formats, lm = _opened(args)
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
    answer, wrong = _answers(lm, args.clean, args.answer, args.wrong)
    assert answer is not None and wrong is not None  # both required by the parser
    console = make_console()
    with (
        progress_bar(console) as bar,
        from_options(PATCH_OPTIONS),
    ):
        if args.method == "attribution":  # one backward: nothing to follow
            result = attribution_patching(
                lm.model, clean_ids, corrupt_ids, answer=answer, wrong=wrong, what=args.what, by=args.by
            )
        else:
            label, sweep, how = (
                ("patching", activation_patching, {"by": args.by})
                if receivers is None
                else ("path patching", path_patching, {"receivers": receivers})
            )
            task = bar.add_task(label, total=None)
            result = sweep(
                lm.model,
                clean_ids,
                corrupt_ids,
                answer=answer,
                wrong=wrong,
                what=args.what,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
                **how,
            )
    facts = {"model": lm.name, "clean": args.clean, "corrupt": args.corrupt, "answer": args.answer}
    facts |= {"wrong": args.wrong, **({} if receivers is None else {"receivers": args.receivers})}
    tokens = [lm.piece(int(token)) for token in clean_ids[0].tolist()]
    page = patching_page(result, facts, columns=tokens)
    if "terminal" in formats:
        print_page(console, page)
    data = patching_data(result, {**facts, "tokens": tokens})
    if receivers is not None:
        data["receivers"] = [list(pair) for pair in receivers]
    print_written(console, write_report(data, "patching", args.out, formats, page, argument="--out"))
    return 0


def _opened(args: argparse.Namespace):
    """The formats checked, the output folder checked (made when written), the model loaded: (formats, lm)."""
    from multihead.integrations import load_causal_lm
    from multihead.lab.circuits.report import FORMATS, check_formats

    with from_option("--format", names=("format",)):
        formats = check_formats(args.format, FORMATS)
    if any(name != "terminal" for name in formats):
        output_folder("--out", args.out, create=False)
    with from_option("--model"):
        lm = load_causal_lm(args.model)
    return formats, lm


def _answers(lm, text: str, answer: str | None, wrong: str | None) -> tuple[int | None, int | None]:
    """The --answer and --wrong tokens after ``text``, or None where not given."""
    found: list[int | None] = []
    for option, value in (("--answer", answer), ("--wrong", wrong)):
        if value is None:
            found.append(None)
            continue
        with from_options({"continuation": option}):
            found.append(lm.next_token(text, value))
    return found[0], found[1]


def run_dla(args: argparse.Namespace) -> int:
    from multihead.lab.circuits import direct_logit_attribution
    from multihead.lab.circuits.report import dla_page, print_page, write_report

    formats, lm = _opened(args)
    with from_options({"text": "--text"}):
        ids = lm.ids(args.text)
    answer, wrong = _answers(lm, args.text, args.answer, args.wrong)
    assert answer is not None and wrong is not None  # both required by the parser
    with from_options({"answer": "--answer", "wrong": "--wrong"}):
        found = direct_logit_attribution(lm.model, ids, answer=answer, wrong=wrong)
    facts = {"model": lm.name, "text": args.text, "answer": args.answer, "wrong": args.wrong}
    page = dla_page(found, args.answer, args.wrong, facts)
    console = make_console()
    if "terminal" in formats:
        print_page(console, page)
    print_written(console, write_report(facts | found.to_dict(), "dla", args.out, formats, page, argument="--out"))
    return 0


def run_lens(args: argparse.Namespace) -> int:
    from multihead.lab.circuits import logit_lens
    from multihead.lab.circuits.report import lens_page, print_page, write_report

    formats, lm = _opened(args)
    if (args.answer is None) != (args.wrong is None):
        raise bad_argument("--wrong", "given with --answer, or neither", repr(args.wrong), "pass both or neither")
    with from_options({"text": "--text"}):
        ids = lm.ids(args.text)
    answer, wrong = _answers(lm, args.text, args.answer, args.wrong)
    with from_options({"top": "--top"}):
        lens = logit_lens(lm.model, ids, top=args.top, answer=answer, wrong=wrong)
    rows = ["embedding", *(f"layer {layer}" for layer in range(lens.logits.shape[0] - 1))]
    top = [[lm.piece(int(token)) for token in row[0]] for row in lens.top]
    facts = {"model": lm.name, "text": args.text}
    if lens.differences is not None:
        facts |= {"answer": args.answer, "wrong": args.wrong}
    page = lens_page(rows, top, lens.differences, facts)
    console = make_console()
    if "terminal" in formats:
        print_page(console, page)
    data: dict[str, object] = {**facts, "rows": rows, "top": top}
    if lens.differences is not None:
        data["differences"] = lens.differences.tolist()
    print_written(console, write_report(data, "lens", args.out, formats, page, argument="--out"))
    return 0


def run_detect(args: argparse.Namespace) -> int:
    from multihead.lab.circuits import probe_heads
    from multihead.lab.circuits.report import detect_page, print_page, write_report

    formats, lm = _opened(args)
    with from_options({"half_length": "--half-length", "batch": "--batch"}):
        found = probe_heads(lm.model, lm.tokenizer, half_length=args.half_length, batch=args.batch, seed=args.seed)
    assert found.ids is not None  # detect_heads keeps the ids it scored
    batch, length = found.ids.shape
    half_length = (length - (0 if lm.bos_id is None else 1)) // 2  # the default fits the model's positions
    facts = {"model": lm.name, "sequences": f"{batch} x {half_length} random tokens, repeated once"}
    page = detect_page(found, batch, facts)
    console = make_console()
    if "terminal" in formats:
        print_page(console, page)
    data = {"model": lm.name, "half_length": half_length, "batch": batch, "seed": args.seed}
    data |= {**found.to_dict(), "sink_heads": found.sink_heads(), "roles": found.named_heads()}
    print_written(console, write_report(data, "detect", args.out, formats, page, argument="--out"))
    return 0
