"""Fuzz the command line: random subcommands, options and values, random and damaged files.

Every case runs ``multihead.cli.main(argv)`` in-process and is recorded in the tally:

    ok             exit 0, or exit 2 with exactly one stderr line "multihead <cmd>: error: <arg>: expected
                   ..., got .... Fix: ..." (a user's mistake, said clearly)
    poor_message   exit 2 with one error line that lacks that form
    crash          an exception escaping main(), a traceback on stderr, another exit status, or an
                   error that is not one line

Files are drawn as specs (a missing path, a folder, random bytes, random text, JSON of the wrong shape,
a valid file with one damage) and written into a fresh folder per case. Models are a tiny random
checkpoint (2 layers x 2 heads, 8 wide, the real tokenizer) in both folder formats, or a copy of one
with a damage: a truncated or garbage model.safetensors, tensors dropped, added, reshaped or NaN, a
config.json or multihead_config.json with a field removed or replaced, a corrupt tokenizer.json.

Nothing here may start a real benchmark run or measure the machine: ``multihead.lab.bench.run`` is replaced by
one tiny run's results, and calibration by fixed rates.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from multihead._errors import InputError
from multihead.cli import main
from multihead.cost import MachineRates
from multihead.lab.models import load_minilm
from multihead.machine import save_calibration
from test_cli_errors import write_tiny_checkpoints

MESSAGE_FORM = re.compile(r"^\S.*: expected .+, got .+\. Fix: .+")
RATES = MachineRates(
    {"float32": 50.0, "bfloat16": 20.0, "float16": 20.0, "float64": 25.0},
    bandwidth_gbs=5.0,
    threads=2,
    measured_at="fuzz",
)
VALID_CORPUS = "The cat sat on the mat.\nRain fell all night.\n# a comment\n\nWe sat on the river bank.\n"
VALID_CONLLU = "\n".join(
    [
        "# text = The dog barks.",
        "1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_",
        "2\tdog\tdog\tNOUN\tNN\t_\t3\tnsubj\t_\t_",
        "3\tbarks\tbark\tVERB\tVBZ\t_\t0\troot\t_\t_",
        "4\t.\t.\tPUNCT\t.\t_\t3\tpunct\t_\t_",
        "",
        "1\tCats\tcat\tNOUN\tNNS\t_\t2\tnsubj\t_\t_",
        "2\tsleep\tsleep\tVERB\tVBP\t_\t0\troot\t_\t_",
        "",
    ]
)
VALID_IMPORTANCE = {"scores": [[0.1, 0.2], [0.05, None]], "metric": "fuzz"}
VALID_SYNTAX = {"per_head_best": [[0.5, 0.25], [0.75, 1.0]]}


# --------------------------------------------------------------------------------------- running a case


def run_cli(argv: list[str]) -> tuple[str, str]:
    """(outcome, detail) of ``main(argv)``: see the module docstring."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except BaseException as error:  # anything escaping main() is a crash, whatever it is
        frames = traceback.extract_tb(error.__traceback__)
        where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
        return "crash", f"{argv!r}: {type(error).__name__}: {str(error)[:300]}{where}"
    text = err.getvalue()
    if "Traceback" in text:
        return "crash", f"{argv!r}: a traceback on stderr: {text[-300:]}"
    if code == 0:
        return "ok", ""
    lines = text.splitlines()
    if code != 2 or len(lines) != 1 or not text.endswith("\n"):
        return "crash", f"{argv!r}: exit {code} with stderr {text[:300]!r}"
    match = re.match(r"multihead(?: (inspect|cost|bench|heads))?: error: (.*)", lines[0])
    if match is None:
        return "poor_message", f"{argv!r}: {lines[0]}"
    if not MESSAGE_FORM.match(match.group(2)):
        return "poor_message", f"{argv!r}: {lines[0]}"
    return "ok", ""


def judge(tally, test: str, argv: list[str]) -> None:
    outcome, detail = run_cli(argv)
    tally.record(test, outcome, detail)
    assert outcome == "ok", detail


# --------------------------------------------------------------------------------------- the workspace


@dataclass
class Workspace:
    """Where a case writes its files: the module's tiny checkpoints, and one fresh folder per case."""

    root: Path
    tiny: dict[str, Path]

    def fresh(self) -> Path:
        return Path(tempfile.mkdtemp(dir=self.root))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Tiny checkpoints built once, a fixed calibration cache, calibration replaced by fixed rates, the benchmark
    run replaced by one tiny run's results, the
    working folder moved here (default --out folders land in it), and one torch thread (tiny models gain
    nothing from threads, and other tests may share the cores)."""
    from multihead import machine
    from multihead.lab import bench

    root = tmp_path_factory.mktemp("fuzz-cli")
    patch = pytest.MonkeyPatch()
    threads = torch.get_num_threads()
    try:
        patch.chdir(root)
        patch.setenv("MULTIHEAD_CACHE", str(root / "cache"))
        save_calibration(RATES)
        patch.setattr(machine, "calibrate", lambda *args, **kwargs: RATES)
        tiny = bench.run(
            quick=True, only=[bench.Case("attention", 4, False, "forward", "float32")], rounds=1, block_s=0
        )
        patch.setattr(bench, "run", lambda **kwargs: tiny)
        torch.set_num_threads(1)
        yield Workspace(root, write_tiny_checkpoints(root / "tiny"))
    finally:
        torch.set_num_threads(threads)
        patch.undo()


# --------------------------------------------------------------------------------------- file specs


def mostly(valid, defect, weight: int = 5):
    """``valid`` about ``weight`` times in ``weight + 1``, else ``defect``: a case then carries about one
    defect among its options, so the run goes past the first check into the code behind it.
    (st.one_of would not do: it treats repeated branches as one.)"""
    return st.sampled_from([True] * weight + [False]).flatmap(lambda fine: valid if fine else defect)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def damaged_json(draw, valid: object) -> bytes:
    """``valid`` JSON with one damage: a value replaced or removed, the whole replaced, the text cut or spoiled."""
    action = draw(st.sampled_from(["replace", "replace", "remove", "whole", "cut", "bytes", "nan"]))
    data = json.loads(json.dumps(valid))
    paths: list[list] = []

    def walk(node, path):
        paths.append(path)
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in children:
            walk(child, [*path, key])

    walk(data, [])
    path = draw(st.sampled_from(paths))
    if action in ("replace", "remove", "nan") and path:
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        if action == "remove":
            del parent[path[-1]]
        else:
            parent[path[-1]] = float("nan") if action == "nan" else draw(JSON_VALUES)
    elif action == "whole":
        data = draw(JSON_VALUES)
    text = json.dumps(data).encode()
    if action == "cut":
        text = text[: draw(st.integers(0, max(len(text) - 1, 0)))]
    elif action == "bytes":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.binary(min_size=1, max_size=8)) + text[at:]
    return text


def file_content(valid_text: str | None = None, valid_json: object = None):
    """Bytes of an input file: mostly the valid one given, else random bytes, text or JSON, or it damaged."""
    defects = [
        st.binary(max_size=64),
        st.text(max_size=64).map(str.encode),
        JSON_VALUES.map(lambda value: json.dumps(value).encode()),
    ]
    valid = st.nothing()
    if valid_text is not None:
        encoded = valid_text.encode()
        valid = st.just(encoded)
        defects += [
            st.integers(0, len(encoded)).map(lambda cut: encoded[:cut]),
            st.binary(min_size=1, max_size=4).map(lambda junk: junk + encoded),
            st.just(valid_text.encode("utf-16")),
        ]
    if valid_json is not None:
        valid = st.just(json.dumps(valid_json).encode())
        defects += [damaged_json(valid_json)] * 4
    return mostly(valid, st.one_of(defects), weight=2)


@dataclass(frozen=True)
class InputFile:
    """A file the user names: where it is ("file", "missing", "folder", "under_file", "special") and its bytes."""

    kind: str
    content: bytes = b""

    def make(self, folder: Path, name: str) -> str:
        path = folder / name
        if self.kind == "file":
            path.write_bytes(self.content)
        elif self.kind == "folder":
            path.mkdir()
        elif self.kind == "under_file":
            path.write_bytes(self.content)
            path = path / "inside.txt"
        elif self.kind == "special":
            return "/dev/null" if self.content == b"null" else "/proc/self/status"
        return str(path)


def input_files(valid_text: str | None = None, valid_json: object = None):
    """A file spec: mostly a file (its content from :func:`file_content`), else one of the ways it is not one."""
    return mostly(
        file_content(valid_text, valid_json).map(lambda data: InputFile("file", data)),
        st.sampled_from(
            [
                InputFile("missing"),
                InputFile("folder"),
                InputFile("under_file", b"x"),
                InputFile("special", b"null"),
                InputFile("special"),
            ]
        ),
        weight=4,
    )


OUTPUT_DEFECTS = ("file", "under_file", "proc", "sys", "dev", "dev_null", "empty", "dot_file")
OUTPUT_KINDS = mostly(st.sampled_from(("new", "existing", "nested")), st.sampled_from(OUTPUT_DEFECTS))


def make_output(kind: str, folder: Path, name: str = "out") -> str:
    """A path for --out: a folder to create or reuse, or one of the ways it cannot be one."""
    path = folder / name
    if kind == "existing":
        path.mkdir()
    elif kind == "nested":
        path = path / "a" / "b"
    elif kind == "file":
        path.write_text("a file")
    elif kind == "under_file":
        path.write_text("a file")
        path = path / "sub"
    elif kind in ("proc", "sys", "dev"):
        return f"/{kind}/multihead-fuzz-{name}"
    elif kind == "dev_null":
        return "/dev/null"
    elif kind == "empty":
        return ""
    elif kind == "dot_file":
        return str(folder / "name.png")
    return str(path)


# --------------------------------------------------------------------------------------- model specs

WEIGHT_DAMAGES = (
    "truncate",
    "overwrite_header",
    "overwrite_any",
    "garbage",
    "empty",
    "drop",
    "add",
    "reshape",
    "nan",
    "int",
)
JSON_DAMAGES = ("config", "config", "config_list", "config_bytes")
TOKENIZER_DAMAGES = ("tokenizer_cut", "tokenizer_bytes", "tokenizer_json", "tokenizer_field")
FILE_REMOVALS = ("remove_config", "remove_weights", "remove_tokenizer")


DAMAGED_HALF_THE_TIME = st.booleans()  # model_folders' default (a strategy is immutable: one serves every call)


@st.composite
def model_folders(draw, workspace: Workspace, folder: Path, damaged=DAMAGED_HALF_THE_TIME) -> str:
    """A --model folder: one of the tiny checkpoints, or (when ``damaged`` draws True) a copy with one or two
    damages."""
    base = draw(st.sampled_from(["hf", "hf", "saved"]))
    if not draw(damaged):
        return str(workspace.tiny[base])
    damages = draw(
        st.lists(
            st.sampled_from(WEIGHT_DAMAGES + JSON_DAMAGES + TOKENIZER_DAMAGES + FILE_REMOVALS), min_size=1, max_size=2
        )
    )
    target = folder / "model"
    shutil.copytree(workspace.tiny[base], target)
    config = target / ("config.json" if base == "hf" else "multihead_config.json")
    for damage in damages:
        _damage(draw, damage, target, config)
    return str(target)


def _damage(draw, damage: str, target: Path, config: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights, tokenizer = target / "model.safetensors", target / "tokenizer.json"
    if damage == "none" or not weights.exists() or not config.exists() or not tokenizer.exists():
        return
    data = weights.read_bytes()
    header = min(8 + int.from_bytes(data[:8], "little"), len(data))  # a first damage may have spoiled it
    if damage == "truncate":
        weights.write_bytes(data[: draw(st.integers(0, max(len(data) - 1, 0)))])
    elif damage in ("overwrite_header", "overwrite_any"):
        at = draw(st.integers(0, max((header if damage == "overwrite_header" else len(data)) - 1, 0)))
        junk = draw(st.binary(min_size=1, max_size=8))
        weights.write_bytes(data[:at] + junk + data[at + len(junk) :])
    elif damage == "garbage":
        weights.write_bytes(draw(st.binary(max_size=64)))
    elif damage == "empty":
        weights.write_bytes(b"")
    elif damage in ("drop", "add", "reshape", "nan", "int"):
        try:
            tensors = load_file(str(weights))
        except Exception:  # a first damage left no file to edit: this one adds nothing
            return
        name = draw(st.sampled_from(sorted(tensors)))
        if damage == "drop":
            del tensors[name]
        elif damage == "add":
            tensors[
                draw(
                    st.sampled_from(
                        [name + "_extra", "encoder.layer.9.output.dense.weight", "pooler.x", "something.else"]
                    )
                )
            ] = torch.zeros(draw(st.integers(1, 3)))
        elif damage == "reshape":
            tensors[name] = torch.zeros(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
        elif damage == "nan" and tensors[name].is_floating_point():
            tensors[name] = tensors[name].clone().fill_(draw(st.sampled_from([float("nan"), float("inf")])))
        elif damage == "int":
            tensors[name] = tensors[name].to(draw(st.sampled_from([torch.int32, torch.int8, torch.bool])))
        save_file(tensors, str(weights))
    elif damage in ("config", "config_list"):
        try:
            valid = json.loads(config.read_text())
        except ValueError:  # a first damage spoiled it already
            return
        config.write_bytes(draw(damaged_json(valid)) if damage == "config" else json.dumps([valid]).encode())
    elif damage == "config_bytes":
        config.write_bytes(draw(st.binary(max_size=32)))
    elif damage == "tokenizer_cut":
        text = tokenizer.read_bytes()
        tokenizer.write_bytes(text[: draw(st.integers(0, max(len(text) - 1, 0)))])
    elif damage == "tokenizer_bytes":
        tokenizer.write_bytes(draw(st.binary(max_size=64)))
    elif damage == "tokenizer_json":
        tokenizer.write_text(json.dumps(draw(JSON_VALUES)))
    elif damage == "tokenizer_field":
        try:
            data = json.loads(tokenizer.read_text())
        except ValueError:  # a first damage spoiled it already
            return
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            return
        section = draw(
            st.sampled_from(
                [
                    "model",
                    "normalizer",
                    "pre_tokenizer",
                    "post_processor",
                    "decoder",
                    "added_tokens",
                    "truncation",
                    "padding",
                ]
            )
        )
        if section == "model" and draw(st.booleans()):
            key = draw(st.sampled_from(["type", "unk_token", "vocab", "continuing_subword_prefix"]))
            data["model"][key] = draw(JSON_VALUES)
        else:
            data[section] = draw(JSON_VALUES)
        tokenizer.write_text(json.dumps(data))
    else:
        {"remove_config": config, "remove_weights": weights, "remove_tokenizer": tokenizer}[damage].unlink()


# --------------------------------------------------------------------------------------- option values

NUMBERS = st.one_of(st.integers(-3, 12), st.sampled_from([0, -1, 2**31, 10**12, 99999999999]))
INDEX_SPECS = mostly(
    st.sampled_from([None, None, "0", "1", "0,1", "0-1", "1,0", " 0 , 1 "]),
    st.one_of(
        st.lists(
            st.one_of(NUMBERS.map(str), st.tuples(NUMBERS, NUMBERS).map(lambda p: f"{p[0]}-{p[1]}")),
            min_size=1,
            max_size=3,
        ).map(",".join),
        st.sampled_from(
            ["", ",", "0-", "-", "0,,1", "a-b", "1-0", "0-99999999999", "9" * 5000, "٣", "0x1", "-1", "0,0", "2"]
        ),
        st.text(max_size=6),
    ),
)
# what argv can carry: any bytes, decoded as Python decodes argv (not UTF-8 -> lone surrogates)
ARGV_BYTES = st.binary(max_size=12).map(lambda raw: raw.decode("utf-8", "surrogateescape"))
TEXTS = mostly(
    st.sampled_from([None, "The bank was full of money.", "Rain fell. The river rose.", "ü ∑ 😀"]),
    st.one_of(st.sampled_from(["", "   ", "word " * 70, "x\x00y", "\n\n"]), st.text(max_size=30), ARGV_BYTES),
)
FORMATS = mostly(
    st.lists(st.sampled_from(["terminal", "html", "json", "png"]), min_size=1, max_size=2, unique=True).map(",".join),
    st.sampled_from(["", "pdf", "terminal,pdf", ",", "json,json"]),
)


def option(name: str, values) -> st.SearchStrategy[list[str]]:
    """``[name, value]`` or nothing."""
    return st.one_of(st.just([]), values.map(lambda value: [name, str(value)]))


def switch(name: str) -> st.SearchStrategy[list[str]]:
    return st.sampled_from([[], [name]])


# --------------------------------------------------------------------------------------- the tests


def test_fuzz_inspect(workspace, tally, request):
    """``multihead inspect`` with random text, heads, token, corpus, scores, output and a (damaged) model."""

    @given(data=st.data())
    def case(data):
        folder = workspace.fresh()
        argv = ["inspect"]
        text = data.draw(TEXTS)
        if text is not None:
            argv.append(text)
        argv += [
            "--model",
            data.draw(model_folders(workspace, folder, damaged=mostly(st.just(False), st.just(True), 3))),
        ]
        for name in ("--layers", "--heads"):
            spec = data.draw(INDEX_SPECS)
            if spec is not None:
                argv.append(f"{name}={spec}")
        argv += data.draw(
            option(
                "--token",
                mostly(st.sampled_from(["bank", "money", "river", "Rain", "[CLS]", "1"]), st.text(max_size=5), 3),
            )
        )
        argv += ["--format", data.draw(FORMATS)]
        argv += ["--out", make_output(data.draw(OUTPUT_KINDS), folder)]
        argv += data.draw(switch("--truncate"))
        corpus = data.draw(st.one_of(st.none(), input_files(VALID_CORPUS)))
        if corpus is not None:
            argv += ["--corpus", corpus.make(folder, "corpus.txt")]
        scores = data.draw(st.sampled_from(["none", "none", "folder", "folder", "missing", "file"]))
        if scores != "none":
            scores_dir = folder / "scores"
            if scores == "folder":
                scores_dir.mkdir()
                for name, valid in (("importance.json", VALID_IMPORTANCE), ("syntax.json", VALID_SYNTAX)):
                    spec = data.draw(st.one_of(st.none(), input_files(valid_json=valid)))
                    if spec is not None:
                        spec.make(scores_dir, name)
            elif scores == "file":
                scores_dir.write_text("{}")
            argv += ["--scores", str(scores_dir)]
        judge(tally, request.node.name, argv)

    case()


def test_fuzz_inspect_text(workspace, tally, request):
    """Any text argv can carry (any bytes, lone surrogates for those that are not UTF-8), everything else valid:
    the text alone decides between a report and one clean line."""

    @given(text=st.one_of(ARGV_BYTES, st.text(max_size=30)).filter(lambda t: not t.startswith("-")))
    def case(text):
        folder = workspace.fresh()
        judge(
            tally,
            request.node.name,
            [
                "inspect",
                text,
                "--model",
                str(workspace.tiny["hf"]),
                "--format",
                "json",
                "--out",
                str(folder / "report"),
            ],
        )

    case()


CALIBRATION = {
    "matmul_gflops": {"float32": 50.0, "bfloat16": 9.0},
    "bandwidth_gbs": 5.0,
    "threads": 2,
    "measured_at": "x",
}


def test_fuzz_cost(workspace, tally, request):
    """``multihead cost`` with random sizes, dtypes, modes, --plot paths and a damaged calibration cache."""

    @given(data=st.data())
    def case(data):
        folder = workspace.fresh()
        bad_size = st.one_of(st.sampled_from([0, -1, -8, 2**40, 10**30, "x", "", "1.5", "8e2"]), st.text(max_size=3))
        heads = data.draw(st.sampled_from([1, 2, 4, 8]))
        argv = ["cost"]
        for name, valid in (
            ("--embed-dim", heads * data.draw(st.integers(1, 16))),
            ("--heads", heads),
            ("--seq", data.draw(st.integers(1, 4096))),
        ):
            argv += data.draw(
                mostly(
                    st.just([name, str(valid)]),
                    st.one_of(st.just([]), bad_size.map(lambda value, name=name: [name, str(value)])),
                    weight=8,
                )
            )
        extras = {
            "--kv-seq": st.integers(1, 512),
            "--kv-heads": st.sampled_from([1, heads]),
            "--head-dim": st.integers(1, 64),
            "--value-head-dim": st.integers(1, 64),
            "--batch": st.integers(1, 8),
            "--decode-cache": st.integers(0, 4096),
            "--kdim": st.integers(1, 64),
            "--vdim": st.integers(1, 64),
            "--out-dim": st.integers(1, 64),
        }
        for name in data.draw(st.lists(st.sampled_from(sorted(extras)), max_size=2, unique=True)):
            argv += [name, str(data.draw(mostly(extras[name], bad_size, weight=3)))]
        argv += data.draw(
            option(
                "--dtype",
                mostly(
                    st.sampled_from(["float32", "bfloat16", "float16", "float64"]),
                    st.sampled_from(["int8", "torch.float32", "", "FLOAT32"]),
                    3,
                ),
            )
        )
        for name in ("--causal", "--backward", "--need-weights", "--json", "--no-bias"):
            argv += data.draw(switch(name))
        if data.draw(st.booleans()):
            where = data.draw(
                mostly(
                    st.sampled_from(["plot_png", "plot_pdf", "plot_svg", "plot_nested"]),
                    st.sampled_from(OUTPUT_DEFECTS + ("plot_xyz", "plot_bare")),
                    weight=3,
                )
            )
            suffix = {
                "plot_png": ".png",
                "plot_pdf": ".pdf",
                "plot_svg": ".svg",
                "plot_nested": ".png",
                "plot_xyz": ".xyz",
                "plot_bare": "",
            }
            if where in suffix:
                inner = "new/deeper" if where == "plot_nested" else "plots"
                argv += ["--plot", str(folder / inner / f"cost{suffix[where]}")]
            else:
                argv += ["--plot", make_output(where, folder, "cost.png")]
        cache = data.draw(st.one_of(st.none(), file_content(valid_json=CALIBRATION)))
        with pytest.MonkeyPatch.context() as patch:
            if cache is not None:  # this case's own calibration cache, maybe damaged
                patch.setenv("MULTIHEAD_CACHE", str(folder / "cache"))
                (folder / "cache").mkdir()
                (folder / "cache" / "calibration.json").write_bytes(cache)
            judge(tally, request.node.name, argv)

    case()


def test_fuzz_bench(workspace, tally, request):
    """``multihead bench`` with random --dtype, --out and --calibrate (the run itself is one canned tiny result)."""

    @given(data=st.data())
    def case(data):
        folder = workspace.fresh()
        argv = ["bench", "--out", make_output(data.draw(OUTPUT_KINDS), folder)]
        argv += data.draw(switch("--quick")) + data.draw(switch("--calibrate"))
        dtypes = mostly(st.sampled_from(["float32", "bfloat16"]), st.sampled_from(["int8", "", "FLOAT32"]), 3)
        for _ in range(data.draw(st.integers(0, 2))):
            argv += ["--dtype", data.draw(dtypes)]
        judge(tally, request.node.name, argv)

    case()


def test_fuzz_heads(workspace, tally, request):
    """``multihead heads importance|prune|syntax`` with random corpora, treebanks, plans, scores and models."""

    @given(data=st.data())
    def case(data):
        folder = workspace.fresh()
        mode = data.draw(st.sampled_from(["importance", "prune", "prune", "syntax", "syntax"]))
        argv = [
            "heads",
            mode,
            "--model",
            data.draw(model_folders(workspace, folder, damaged=mostly(st.just(False), st.just(True), 3))),
            "--out",
            make_output(data.draw(OUTPUT_KINDS), folder),
        ]
        if mode in ("importance", "prune"):  # always a corpus: the bundled one takes seconds per case
            argv += ["--corpus", data.draw(input_files(VALID_CORPUS)).make(folder, "corpus.txt")]
            argv += data.draw(option("--how", st.sampled_from(["zero", "mean", "uniform"])))
        if mode == "prune":
            # --fraction measures a pruning curve (a second or more): --remove is the common case here
            plan = data.draw(mostly(st.just("remove"), st.sampled_from(["fraction", "both", "neither"]), 3))
            if plan in ("remove", "both"):
                argv += [
                    "--remove",
                    data.draw(
                        mostly(
                            st.sampled_from(["0:1", "1:0;0:1", "1:1", " 0 : 0 "]),
                            st.one_of(
                                st.sampled_from(
                                    ["0:0,1", "0:1,1", "5:0", "0:-1", ";;", "0:", ":1", "zero", "0:99999999999"]
                                ),
                                st.text(max_size=8),
                            ),
                            2,
                        )
                    ),
                ]
            if plan in ("fraction", "both"):
                argv += [
                    "--fraction",
                    str(data.draw(mostly(st.sampled_from([0.0, 0.5]), st.sampled_from([1.0, -0.1, float("nan")]), 2))),
                ]
                spec = data.draw(input_files(valid_json=VALID_IMPORTANCE))
                argv += ["--importance", spec.make(folder, "importance.json")]
        if mode == "syntax":  # always few sentences: the whole bundled treebank takes seconds per case
            argv += ["--max-sentences", str(data.draw(mostly(st.sampled_from([1, 3, 10]), st.sampled_from([0, -2]))))]
            treebank = data.draw(st.one_of(st.none(), input_files(VALID_CONLLU)))
            if treebank is not None:
                argv += ["--treebank", treebank.make(folder, "treebank.conllu")]
            argv += data.draw(
                option(
                    "--relations",
                    mostly(st.sampled_from(["det", "nsubj,det"]), st.sampled_from(["", ",", "nope", "det,det"]), 2),
                )
            )
        judge(tally, request.node.name, argv)

    case()


def test_fuzz_model_folders(workspace, tally, request):
    """Damaged model folders through the CLI and through the Python API (the loader raises the InputError)."""

    @given(data=st.data())
    def case(data):
        folder = workspace.fresh()
        model = data.draw(model_folders(workspace, folder))
        judge(tally, request.node.name, ["inspect", "--model", model, "--format", "terminal", "--layers", "0"])
        try:
            load_minilm(model)
        except InputError as error:
            outcome = tally.rejection(request.node.name, error)
            assert outcome == "ok", str(error)
        except Exception as error:  # any other exception from the loader is a crash
            tally.record(request.node.name, "crash", f"load_minilm: {type(error).__name__}: {error}")
            raise
        else:
            tally.record(request.node.name, "ok")

    case()


ARGV_TOKENS = [
    "inspect",
    "cost",
    "heads",
    "importance",
    "prune",
    "syntax",
    "--layers",
    "--heads",
    "--format",
    "--out",
    "--model",
    "--corpus",
    "--scores",
    "--token",
    "--embed-dim",
    "--seq",
    "--plot",
    "--json",
    "--remove",
    "--fraction",
    "--dtype",
    "--help",
    "-h",
    "--",
    "-",
    "0",
    "-1",
    "1.5",
    "x",
    "",
    "=",
    "--json=1",
    "--embed-dim=8",
    "--heads=2",
    "--seq=4",
    "--bogus",
    "--emb",
    "--fr",
    "bench",
]


def test_fuzz_argv_tokens(workspace, tally, request):
    """Random token lists: argparse's own mistakes must come out in the house form as well."""

    @given(tokens=st.lists(st.one_of(st.sampled_from(ARGV_TOKENS), st.text(max_size=5), ARGV_BYTES), max_size=6))
    def case(tokens):
        argv = list(tokens)
        if "bench" in argv:  # the workspace's bench run is canned; its reports go to the workspace
            argv += ["--out", str(workspace.root / "bench")]
        if any(t in argv for t in ("heads", "importance", "prune", "syntax")) and "--model" not in argv:
            argv += ["--model", str(workspace.root / "no-model")]  # never the real model on the bundled data
        if argv and argv[0] == "inspect":
            argv += ["--model", str(workspace.tiny["hf"]), "--format", "terminal"]
        judge(tally, request.node.name, argv)

    case()
