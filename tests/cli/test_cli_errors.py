"""The command line never prints a traceback for a user's mistake, and never hides a bug behind one line.

Every case runs ``multihead.cli.main`` in-process on a tiny random checkpoint (2 layers x 2 heads,
8 wide, the real tokenizer), so the table stays fast. A user's mistake must give exit status 2 and
exactly one stderr line ``multihead <command>: error: <option>...: expected ..., got .... Fix: ...``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from multihead._errors import InputError
from multihead.cli import main, parse_indices
from multihead.cost import MachineRates
from multihead.lab.models import Encoder, EncoderConfig, load_minilm
from multihead.lab.models.loading import Tokenizer, find_model_dir
from multihead.machine import save_calibration

HOUSE_FORM = re.compile(r"^\S.*: expected .+, got .+\. Fix: .+")


def write_tiny_checkpoints(folder: Path) -> dict[str, Path]:
    """Two valid model folders of tiny random encoders (2 layers x 2 heads, 8 wide, the real tokenizer): "hf"
    (a BertModel saved by transformers' save_pretrained, as a downloaded checkpoint) and "saved"
    (multihead_config.json, as Encoder.save / heads prune write)."""
    from transformers import BertConfig, BertModel

    real = find_model_dir()
    torch.manual_seed(0)
    config = EncoderConfig(hidden_size=8, num_layers=2, num_heads=2, intermediate_size=16, max_positions=64)
    model = Encoder(config)
    model.tokenizer = Tokenizer(real / "tokenizer.json", max_length=config.max_positions)
    saved = model.save(folder / "saved")
    hf = folder / "hf"
    hf_config = json.loads((real / "config.json").read_text())
    hf_config.update(
        hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16, max_position_embeddings=64
    )
    BertModel(BertConfig(**hf_config)).save_pretrained(hf)
    shutil.copy(real / "tokenizer.json", hf / "tokenizer.json")
    return {"hf": hf, "saved": saved}


def broken_copy(source: Path, target: Path, damage) -> Path:
    """A copy of the model folder ``source`` at ``target`` with ``damage(target)`` applied."""
    shutil.copytree(source, target)
    damage(target)
    return target


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def drop_json_key(path: Path, key: str) -> None:
    data = json.loads(path.read_text())
    del data[key]
    path.write_text(json.dumps(data))


def edit_weights(path: Path, change) -> None:
    """Rewrite model.safetensors with ``change(tensors)`` applied to its dict of tensors."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    return write_tiny_checkpoints(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True)
def calibration_cache(tmp_path, monkeypatch):
    """A calibration cache of our own, so no case measures this machine (and none touches ~/.cache)."""
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    save_calibration(MachineRates({"float32": 50.0}, bandwidth_gbs=5.0, threads=2, measured_at="test"))


def assert_one_line(capsys, argv: list[str], command: str, option: str, fragment: str = "") -> str:
    """main(argv) exits 2 with one house-form stderr line naming ``option`` (and ``fragment``)."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err, err
    prefix = f"multihead {command}: error: " if command else "multihead: error: "
    assert err.startswith(prefix), err
    message = err[len(prefix) :].rstrip("\n")
    assert HOUSE_FORM.match(message), message
    assert option in message and fragment in message, message
    return message


# ------------------------------------------------------------------------------- output folders


def _a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    return path


OUTPUT_CASES = {
    "inspect --out is a file": (
        lambda t, f: ["inspect", "--model", str(t["hf"]), "--format", "json", "--out", str(f)],
        "inspect",
        "--out",
        "which is a file",
    ),
    "inspect --out under a file": (
        lambda t, f: ["inspect", "--model", str(t["hf"]), "--format", "html", "--out", str(f / "report")],
        "inspect",
        "--out",
        "a file",
    ),
    "inspect --out in /proc": (
        lambda t, f: ["inspect", "--model", str(t["hf"]), "--format", "json", "--out", "/proc/multihead-report"],
        "inspect",
        "--out",
        "virtual file system",
    ),
    "inspect --out is /proc itself": (
        lambda t, f: ["inspect", "--model", str(t["hf"]), "--format", "png", "--out", "/proc"],
        "inspect",
        "--out",
        "virtual file system",
    ),
    "cost --plot under a file": (
        lambda t, f: ["cost", "--embed-dim", "8", "--heads", "2", "--seq", "4", "--plot", str(f / "cost.png")],
        "cost",
        "--plot",
        "a file",
    ),
    "cost --plot in /sys": (
        lambda t, f: ["cost", "--embed-dim", "8", "--heads", "2", "--seq", "4", "--plot", "/sys/cost.png"],
        "cost",
        "--plot",
        "virtual file system",
    ),
    "cost --plot is a folder": (
        lambda t, f: [
            "cost",
            "--embed-dim",
            "8",
            "--heads",
            "2",
            "--seq",
            "4",
            "--plot",
            str(f.parent / "a-folder.png"),
        ],
        "cost",
        "--plot",
        "not a regular file",
    ),
    "cost --plot of unknown format": (
        lambda t, f: ["cost", "--embed-dim", "8", "--heads", "2", "--seq", "4", "--plot", str(f.parent / "cost.xyz")],
        "cost",
        "--plot",
        ".png",
    ),
    "heads importance --out is a file": (
        lambda t, f: ["heads", "importance", "--model", str(t["hf"]), "--out", str(f)],
        "heads",
        "--out",
        "which is a file",
    ),
    "heads syntax --out under a file": (
        lambda t, f: ["heads", "syntax", "--model", str(t["hf"]), "--out", str(f / "x" / "y")],
        "heads",
        "--out",
        "a file",
    ),
    "heads prune --out in /dev": (
        lambda t, f: ["heads", "prune", "--remove", "0:1", "--model", str(t["hf"]), "--out", "/dev/multihead-heads"],
        "heads",
        "--out",
        "virtual file system",
    ),
    "bench --out is a file": (lambda t, f: ["bench", "--quick", "--out", str(f)], "bench", "--out", "which is a file"),
}


@pytest.mark.parametrize("case", OUTPUT_CASES)
def test_output_paths_that_cannot_be_written(case, tiny, tmp_path, capsys):
    argv, command, option, fragment = OUTPUT_CASES[case]
    (tmp_path / "a-folder.png").mkdir()
    assert_one_line(capsys, argv(tiny, _a_file(tmp_path)), command, option, fragment)


def test_unwritable_out_folder(tiny, tmp_path, monkeypatch, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)  # read and enter, no writing
    if os.geteuid() == 0:  # root ignores permission bits: make the OS answer as it would to anyone else
        real_open, real_mkdir = os.open, os.mkdir

        def refuse_inside(real):
            def call(path, *args, **kwargs):
                if Path(path).parent == locked:
                    raise PermissionError(13, "Permission denied", str(path))
                return real(path, *args, **kwargs)

            return call

        monkeypatch.setattr(os, "open", refuse_inside(real_open))
        monkeypatch.setattr(os, "mkdir", refuse_inside(real_mkdir))
    try:
        message = assert_one_line(
            capsys,
            ["inspect", "--model", str(tiny["hf"]), "--format", "json", "--out", str(locked)],
            "inspect",
            "--out",
            "Permission denied",
        )
        assert "files cannot be created" in message
        message = assert_one_line(
            capsys,
            ["heads", "importance", "--model", str(tiny["hf"]), "--out", str(locked / "new")],
            "heads",
            "--out",
            "Permission denied",
        )
        assert "cannot be created" in message
    finally:
        locked.chmod(0o700)


def test_a_refused_command_leaves_no_output_folder(tiny, tmp_path, capsys):
    """--out is checked before the work (a probe file, removed) but made only when a file is written."""
    out = tmp_path / "new" / "report"
    assert_one_line(
        capsys,
        ["inspect", "--model", str(tiny["hf"]), "--format", "json", "--layers", "7", "--out", str(out)],
        "inspect",
        "--layers",
    )
    assert_one_line(
        capsys,
        ["heads", "prune", "--remove", "0:0,1", "--model", str(tiny["hf"]), "--out", str(out)],
        "heads",
        "--remove",
    )
    assert not (tmp_path / "new").exists()
    assert main(["inspect", "--model", str(tiny["hf"]), "--format", "json", "--out", str(out)]) == 0
    assert [path.name for path in out.iterdir()] == ["inspect.json"]  # and no probe file left in it


# ------------------------------------------------------------------------------- --model folders


def _truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


MODEL_CASES = {
    "truncated weights": ("hf", _truncate, "model.safetensors", "cannot be read"),
    "empty weights": (
        "hf",
        lambda d: (d / "model.safetensors").write_bytes(b""),
        "model.safetensors",
        "cannot be read",
    ),
    "garbage weights": (
        "hf",
        lambda d: (d / "model.safetensors").write_bytes(bytes(range(256)) * 8),
        "model.safetensors",
        "cannot be read",
    ),
    "weights missing a tensor": (
        "hf",
        lambda d: edit_weights(d / "model.safetensors", lambda t: t.pop("encoder.layer.1.output.dense.weight")),
        "model.safetensors",
        "missing ['blocks.1.feed_forward_out.weight']",
    ),
    "weights with an unexpected tensor": (
        "hf",
        lambda d: edit_weights(
            d / "model.safetensors", lambda t: t.update({"encoder.layer.7.output.dense.weight": torch.zeros(2)})
        ),
        "model.safetensors",
        "unexpected ['blocks.7.",
    ),
    "weights with NaN": (
        "hf",
        lambda d: edit_weights(d / "model.safetensors", lambda t: t["embeddings.LayerNorm.weight"].fill_(float("nan"))),
        "model.safetensors",
        "finite weights",
    ),
    "integer weights": (
        "hf",
        lambda d: edit_weights(
            d / "model.safetensors",
            lambda t: t.update({"embeddings.LayerNorm.bias": torch.zeros(8, dtype=torch.int32)}),
        ),
        "model.safetensors",
        "floating-point",
    ),
    "config.json a list": ("hf", lambda d: (d / "config.json").write_text("[1, 2]"), "config.json", "got a list"),
    "config.json empty": ("hf", lambda d: (d / "config.json").write_text(""), "config.json", "not valid JSON"),
    "config.json not UTF-8": (
        "hf",
        lambda d: (d / "config.json").write_bytes(b'{"hidden_size": "\xff"}'),
        "config.json",
        "not UTF-8",
    ),
    "config.json missing a key": (
        "hf",
        lambda d: drop_json_key(d / "config.json", "num_attention_heads"),
        "config.json",
        '"num_attention_heads"',
    ),
    # another model_type goes to transformers, which must not fill the parameters it lacks with random values
    "config.json of another architecture": (
        "hf",
        lambda d: edit_json(d / "config.json", model_type="gpt2"),
        "model",
        "expected weights for every parameter of the gpt2 model config.json describes, of its shape, got 28 missing",
    ),
    "config.json size of the wrong type": (
        "hf",
        lambda d: edit_json(d / "config.json", hidden_size="8"),
        "config.json",
        '["hidden_size"] is a positive integer',
    ),
    "config.json sizes disagree with the weights": (
        "hf",
        lambda d: edit_json(d / "config.json", intermediate_size=32),
        "model.safetensors",
        "of shape (32, 8)",
    ),
    "config.json with more layers than the weights": (
        "hf",
        lambda d: edit_json(d / "config.json", num_hidden_layers=10**12),
        "model.safetensors",
        "missing ['blocks.2.",
    ),
    "config.json heads that do not divide": (
        "hf",
        lambda d: edit_json(d / "config.json", num_attention_heads=3),
        "config.json",
        "divisible",
    ),
    "config.json huge vocabulary": (
        "hf",
        lambda d: edit_json(d / "config.json", vocab_size=10**15),
        "model.safetensors",
        "word_embeddings.weight",
    ),
    "tokenizer.json corrupt": (
        "hf",
        lambda d: (d / "tokenizer.json").write_text('{"model": 1'),
        "tokenizer.json",
        "cannot be read",
    ),
    "tokenizer.json missing": ("hf", lambda d: (d / "tokenizer.json").unlink(), "model:", "without tokenizer.json"),
    "saved config a list": (
        "saved",
        lambda d: (d / "multihead_config.json").write_text("[]"),
        "multihead_config.json",
        "got a list",
    ),
    "saved config head ids out of range": (
        "saved",
        lambda d: edit_json(d / "multihead_config.json", head_ids=[[0, 1], [0, 5]]),
        "multihead_config.json",
        "head_ids[1]",
    ),
    "saved config head ids for the wrong weights": (
        "saved",
        lambda d: edit_json(d / "multihead_config.json", head_ids=[[0], [0, 1]]),
        "model.safetensors",
        "of shape (4, 8)",
    ),
    "saved config of another format": (
        "saved",
        lambda d: edit_json(d / "multihead_config.json", format="other"),
        "multihead_config.json",
        "multihead-encoder",
    ),
}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_broken_model_folders(case, tiny, tmp_path, capsys):
    kind, damage, fragment, detail = MODEL_CASES[case]
    folder = broken_copy(tiny[kind], tmp_path / "model", damage)
    message = assert_one_line(
        capsys, ["inspect", "--model", str(folder), "--format", "terminal"], "inspect", "--model", fragment
    )
    assert detail in message
    # the Python API raises the same clear error from the loader
    with pytest.raises(InputError, match=re.escape(fragment)):
        load_minilm(folder)


def test_model_that_is_not_a_folder(tmp_path, capsys):
    assert_one_line(
        capsys,
        ["inspect", "--model", str(_a_file(tmp_path)), "--format", "terminal"],
        "inspect",
        "--model",
        "not a folder",
    )
    assert_one_line(
        capsys,
        ["heads", "syntax", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o")],
        "heads",
        "--model",
        "does not exist",
    )


def test_load_minilm_raises_the_input_error(tiny, tmp_path):
    folder = broken_copy(tiny["hf"], tmp_path / "model", lambda d: (d / "model.safetensors").write_bytes(b"\0" * 9))
    with pytest.raises(ValueError) as excinfo:  # catchable the plain way too
        load_minilm(folder)
    assert isinstance(excinfo.value, InputError)
    assert HOUSE_FORM.match(str(excinfo.value)) and "model.safetensors" in str(excinfo.value)
    with pytest.raises(FileNotFoundError) as missing:
        load_minilm(tmp_path / "nowhere")
    assert isinstance(missing.value, InputError)


def test_valid_tiny_folders_load_and_a_pruned_save_loads_back(tiny, tmp_path, capsys):
    for kind in ("hf", "saved"):
        model, _ = load_minilm(tiny[kind])
        assert [layer.num_heads for layer in model.attention_layers] == [2, 2]
    out = tmp_path / "heads"
    assert main(["heads", "prune", "--remove", "1:0", "--model", str(tiny["hf"]), "--out", str(out)]) == 0
    assert "pruned 1 heads" in capsys.readouterr().out
    pruned, _ = load_minilm(out / "model")
    assert pruned.head_ids == [[0, 1], [1]]
    # a pruned model's heads keep their checkpoint numbers (layer 1 has head 1 only); the head pruned shows so
    assert main(["inspect", "--model", str(out / "model"), "--format", "terminal"]) == 0
    assert "pruned" in capsys.readouterr().out
    assert_one_line(
        capsys,
        ["inspect", "--model", str(out / "model"), "--layers", "1", "--heads", "0", "--format", "terminal"],
        "inspect",
        "--heads",
        "got 0, pruned from layer 1",
    )
    assert (
        main(
            [
                "inspect",
                "--model",
                str(out / "model"),
                "--heads",
                "0",
                "--format",
                "json",
                "--out",
                str(tmp_path / "report"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "report" / "inspect.json").read_text())["heads"] == [0]


# ------------------------------------------------------------------------------- files the user hands in


def _files(tmp_path: Path) -> dict[str, Path]:
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("Der Bär schläft.\nZwei Sätze.\n".encode("latin-1"))
    scores = tmp_path / "scores"
    scores.mkdir()
    return {"latin1": binary, "folder": tmp_path, "scores": scores, "missing": tmp_path / "missing.txt"}


FILE_CASES = {
    "inspect --corpus not UTF-8": (
        lambda t, f: ["inspect", "--model", str(t["hf"]), "--format", "terminal", "--corpus", str(f["latin1"])],
        "inspect",
        "--corpus",
        "not UTF-8",
    ),
    "inspect --corpus a folder": (
        lambda t, f: ["inspect", "--model", str(t["hf"]), "--format", "terminal", "--corpus", str(f["folder"])],
        "inspect",
        "--corpus",
        "a folder",
    ),
    "heads importance --corpus not UTF-8": (
        lambda t, f: [
            "heads",
            "importance",
            "--model",
            str(t["hf"]),
            "--corpus",
            str(f["latin1"]),
            "--out",
            str(f["folder"] / "o"),
        ],
        "heads",
        "--corpus",
        "not UTF-8",
    ),
    "heads importance --corpus missing": (
        lambda t, f: [
            "heads",
            "importance",
            "--model",
            str(t["hf"]),
            "--corpus",
            str(f["missing"]),
            "--out",
            str(f["folder"] / "o"),
        ],
        "heads",
        "--corpus",
        "does not exist",
    ),
    "heads syntax --treebank not UTF-8": (
        lambda t, f: [
            "heads",
            "syntax",
            "--model",
            str(t["hf"]),
            "--treebank",
            str(f["latin1"]),
            "--out",
            str(f["folder"] / "o"),
        ],
        "heads",
        "--treebank",
        "not UTF-8",
    ),
    "heads syntax --treebank a folder": (
        lambda t, f: [
            "heads",
            "syntax",
            "--model",
            str(t["hf"]),
            "--treebank",
            str(f["folder"]),
            "--out",
            str(f["folder"] / "o"),
        ],
        "heads",
        "--treebank",
        "a folder",
    ),
}


@pytest.mark.parametrize("case", FILE_CASES)
def test_unreadable_input_files(case, tiny, tmp_path, capsys):
    argv, command, option, fragment = FILE_CASES[case]
    assert_one_line(capsys, argv(tiny, _files(tmp_path)), command, option, fragment)


SCORES_CASES = {
    "importance.json not JSON": ("importance.json", "{scores: [[1]]", "not valid JSON"),
    "importance.json a list": ("importance.json", "[[0.1, 0.2]]", "got a list"),
    "importance.json without scores": ("importance.json", '{"score": []}', 'the key "scores"'),
    "importance.json ragged": ("importance.json", '{"scores": [[0.1, 0.2], [0.3]]}', "rectangular"),
    "importance.json of another model": ("importance.json", '{"scores": [[0.1, 0.2, 0.3]]}', "2 layers x 2 heads"),
    "importance.json with text scores": ("importance.json", '{"scores": [["a", "b"], [1, 2]]}', '"a"'),
    "importance.json not UTF-8": ("importance.json", b'{"scores": "\xff"}', "not UTF-8"),
    "importance.json nested too deeply": ("importance.json", "[" * 100_000, "nested too deeply"),
    "syntax.json with shares above 1": ("syntax.json", '{"per_head_best": [[2, 0], [0, 0]]}', "share in [0, 1]"),
}


@pytest.mark.parametrize("case", SCORES_CASES)
def test_corrupt_scores(case, tiny, tmp_path, capsys):
    name, content, fragment = SCORES_CASES[case]
    folder = tmp_path / "scores"
    folder.mkdir()
    (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    assert_one_line(
        capsys,
        ["inspect", "--model", str(tiny["hf"]), "--format", "terminal", "--scores", str(folder)],
        "inspect",
        "--scores",
        fragment,
    )
    assert_one_line(
        capsys,
        [
            "heads",
            "prune",
            "--fraction",
            "0.5",
            "--importance",
            str(folder / name),
            "--model",
            str(tiny["hf"]),
            "--out",
            str(tmp_path / "o"),
        ],
        "heads",
        "--importance",
    )


def test_scores_folder_without_scores(tiny, tmp_path, capsys):
    assert_one_line(
        capsys,
        ["inspect", "--model", str(tiny["hf"]), "--format", "terminal", "--scores", str(tmp_path)],
        "inspect",
        "--scores",
        "importance.json or syntax.json",
    )


def test_cost_plot_of_a_layer_too_small_for_the_default_range(tmp_path, capsys):
    """Found by the CLI fuzz: a crossover below n = 16 left no lengths to draw (a matplotlib ValueError)."""
    plot = tmp_path / "cost.png"
    assert main(["cost", "--embed-dim", "1", "--heads", "1", "--seq", "1", "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and capsys.readouterr().err == ""


def test_a_corrupt_calibration_cache_is_ignored_with_a_note(tmp_path, capsys):
    (tmp_path / "cache" / "calibration.json").write_text('{"matmul_gflops": {"float32": "fast"}')
    assert main(["cost", "--embed-dim", "8", "--heads", "2", "--seq", "4", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["shape"]["embed_dim"] == 8  # stdout stays valid JSON
    assert (
        captured.err.startswith("multihead cost: note: ignored the calibration cache")
        and captured.err.count("\n") == 1
        and "multihead bench --calibrate" in captured.err
    )
    (tmp_path / "cache" / "calibration.json").write_text(
        '{"matmul_gflops": {"float32": -1}, "bandwidth_gbs": 5, "threads": 2}'
    )
    assert main(["cost", "--embed-dim", "8", "--heads", "2", "--seq", "4"]) == 0
    assert "positive finite number" in capsys.readouterr().err


# ------------------------------------------------------------------------------- --layers / --heads / --remove


INDEX_CASES = {
    "--layers=-1": (["--layers=-1"], "--layers", "got -1"),
    "--heads=-1": (["--heads=-1"], "--heads", "got -1"),
    "--heads listed twice": (["--heads", "0,0"], "--heads", "0 twice"),
    "--layers range overlapping an index": (["--layers", "0-1,1"], "--layers", "1 twice"),
    "--layers huge range": (["--layers", "0-99999999999"], "--layers", "got 99999999999"),
    "--layers thousands of digits": (["--layers", "7" * 5000], "--layers", "got 777"),
    "--layers past the tiny model": (["--layers", "2"], "--layers", "layer indices in 0..1, got 2"),
    "--heads past the tiny model": (["--heads", "0-2"], "--heads", "head indices in 0..1, got 2"),
    "--layers backwards range": (["--layers", "1-0"], "--layers", "a <= b"),
    "--heads not numbers": (["--heads", "one"], "--heads", "indices like 0,2,5-7"),
    "--layers empty": (["--layers", ""], "--layers", "indices like"),
}


@pytest.mark.parametrize("case", INDEX_CASES)
def test_index_lists(case, tiny, capsys):
    extra, option, fragment = INDEX_CASES[case]
    assert_one_line(
        capsys, ["inspect", "--model", str(tiny["hf"]), "--format", "terminal", *extra], "inspect", option, fragment
    )


def test_parse_indices_checks_bounds_before_expanding():
    assert parse_indices("layers", "0,2,5-7", 8) == [0, 2, 5, 6, 7]
    assert parse_indices("heads", " 3 , 0-1 ", 4) == [3, 0, 1]
    with pytest.raises(InputError, match=r"--layers: expected layer indices in 0\.\.5, got 6"):
        parse_indices("layers", "0-6", 6)
    with pytest.raises(InputError, match=r"--heads: expected head indices from 0 \(at most 65535\), got 10000000000"):
        parse_indices("heads", "0-10000000000")  # no model yet: refused by the form, nothing expanded


REMOVE_CASES = {
    "no colon": ("zero", "LAYER:HEAD"),
    "negative head": ("0:-1", "LAYER:HEAD"),
    "a head twice": ("0:1,1", "twice"),
    "a layer the model lacks": ("5:0", "layer indices in 0..1"),
    "every head of a layer": ("0:0,1", "fewer than all 2 heads"),
    "only separators": (";;", "at least one head"),
}


@pytest.mark.parametrize("case", REMOVE_CASES)
def test_remove_lists(case, tiny, tmp_path, capsys):
    spec, fragment = REMOVE_CASES[case]
    assert_one_line(
        capsys,
        ["heads", "prune", "--remove", spec, "--model", str(tiny["hf"]), "--out", str(tmp_path / "o")],
        "heads",
        "--remove",
        fragment,
    )


LIBRARY_ERROR_CASES = {
    "--format unknown": (["inspect", "--format", "pdf"], "inspect", "--format: expected one or more of"),
    "--token not in the text": (["inspect", "--token", "river"], "inspect", "--token: expected a word of the text"),
    "--relations not in the treebank": (
        ["heads", "syntax", "--max-sentences", "3", "--relations", "frobnicate"],
        "heads",
        "--relations: expected relations present",
    ),
    "--treebank without a sentence": (
        ["heads", "syntax", "--treebank", "{comments}"],
        "heads",
        "--treebank: expected at least one sentence",
    ),
    "--corpus of one text": (
        ["heads", "importance", "--corpus", "{one_line}"],
        "heads",
        "--corpus: expected at least two texts",
    ),
}


@pytest.mark.parametrize("case", LIBRARY_ERROR_CASES)
def test_library_errors_name_the_option(case, tiny, tmp_path, capsys):
    """The library names its own arguments ("token: ..."); the command line says which option it was."""
    argv, command, fragment = LIBRARY_ERROR_CASES[case]
    (tmp_path / "comments.conllu").write_text("# sent_id = 1\n# text = nothing here\n\n")
    (tmp_path / "one.txt").write_text("Just one sentence.\n")
    argv = [arg.format(comments=tmp_path / "comments.conllu", one_line=tmp_path / "one.txt") for arg in argv]
    argv += ["--model", str(tiny["hf"])] + (
        ["--format", "terminal"] if command == "inspect" and "--format" not in argv else ["--out", str(tmp_path / "o")]
    )
    assert_one_line(capsys, argv, command, fragment.split(":")[0], fragment)


# ------------------------------------------------------------------------------- argparse's own mistakes


ARGPARSE_CASES = {
    "not an int": (
        ["cost", "--embed-dim", "x", "--heads", "2", "--seq", "4"],
        "cost",
        "--embed-dim",
        "invalid int value: 'x'",
    ),
    "required option missing": (["cost", "--heads", "2", "--seq", "4"], "cost", "--embed-dim", "required"),
    "unknown command": (["frobnicate"], "", "COMMAND", "invalid choice"),
    "unknown mode": (["heads", "rank"], "heads", "mode", "'rank'"),
    "option without its value": (["inspect", "--layers"], "inspect", "--layers", "expected one argument"),
    "a switch given a value": (
        ["cost", "--embed-dim", "8", "--heads", "2", "--seq", "4", "--json=yes"],
        "cost",
        "--json",
        "ignored explicit argument",
    ),
    "unrecognized option": (
        ["cost", "--embed-dim", "8", "--heads", "2", "--seq", "4", "--bogus"],
        "",
        "arguments",
        "--bogus",
    ),
    "a line break in an argument (found by the fuzz)": (["inspect", "inspect", "\r"], "", "arguments", "'\\r'"),
}


@pytest.mark.parametrize("case", ARGPARSE_CASES)
def test_usage_mistakes_are_one_line_in_the_house_form(case, capsys):
    argv, command, option, fragment = ARGPARSE_CASES[case]
    assert_one_line(capsys, argv, command, option, fragment)


def test_help_exits_zero(capsys):
    assert main(["cost", "--help"]) == 0
    assert "--embed-dim" in capsys.readouterr().out


# ------------------------------------------------------------------------------- bugs stay bugs


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("a bug"),
        TypeError("unsupported operand"),
        ValueError("plain"),
        KeyError("missing"),
        FileNotFoundError(2, "No such file", "/internal"),
    ],
)
def test_a_bug_is_not_swallowed(error, monkeypatch, capsys):
    import multihead.cost

    def broken_estimate(*args, **kwargs):
        raise error

    monkeypatch.setattr(multihead.cost, "estimate", broken_estimate)
    with pytest.raises(type(error)) as excinfo:
        main(["cost", "--embed-dim", "8", "--heads", "2", "--seq", "4"])
    assert excinfo.value is error
    assert "error:" not in capsys.readouterr().err


def test_a_bug_in_the_loader_is_not_swallowed(tiny, monkeypatch):
    import multihead.lab.models.loading as loading

    def broken_check(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'shape'")

    monkeypatch.setattr(loading, "_check_weights", broken_check)
    with pytest.raises(AttributeError):
        main(["inspect", "--model", str(tiny["hf"]), "--format", "terminal"])


def test_a_text_of_bytes_that_are_not_utf8_is_one_line(tiny, tmp_path, capsys):
    """Bytes that are not UTF-8 reach Python's argv as lone surrogates, which the tokenizer cannot take."""
    text = b"the bank \x85 money".decode("utf-8", "surrogateescape")
    message = assert_one_line(
        capsys,
        ["inspect", text, "--model", str(tiny["hf"]), "--format", "json", "--out", str(tmp_path / "out")],
        "inspect",
        "text",
        "not UTF-8",
    )
    assert "valid Unicode text" in message
