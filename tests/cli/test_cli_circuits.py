"""`multihead circuits patch`: a `multihead train` checkpoint and a transformers GPT-2 folder, the JSON's layers x
heads scores equal to multihead.lab.circuits run in Python on the same ids, and every mistake one line."""

from __future__ import annotations

import json

import pytest
import torch

import hf_checkpoints
from multihead.cli import main
from multihead.integrations import load_causal_lm
from multihead.lab.circuits import activation_patching, attribution_patching
from multihead.lab.train.induction import InductionSettings, run_induction
from test_cli_errors import assert_one_line
from test_inspect_page import parsed

CLEAN = "b c d e f g h b c d e f g"
CORRUPT = "k l m n o p q b c d e f g"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small induction decoder trained for a few steps, saved as `multihead train` saves it."""
    folder = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    run_induction(InductionSettings(layers=2, heads=2, steps=40, log_every=20, probe_size=8)).save(folder)
    return folder / "model"


@pytest.mark.parametrize("method", ["exact", "attribution"])
def test_patch_writes_the_scores_python_gives(checkpoint, method, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["circuits", "patch", "--model", str(checkpoint), "--clean", CLEAN, "--corrupt", CORRUPT]
    argv += ["--answer", "h", "--wrong", "p", "--method", method, "--format", "terminal,json,html", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "share of the logit difference restored" in printed and "wrote" in printed
    data = json.loads((out / "patching.json").read_text())
    lm = load_causal_lm(checkpoint)
    answer, wrong = lm.next_token(CLEAN, "h"), lm.next_token(CLEAN, "p")
    sweep = activation_patching if method == "exact" else attribution_patching
    expected = sweep(lm.model, lm.ids(CLEAN), lm.ids(CORRUPT), answer=answer, wrong=wrong)
    assert data["method"] == method and data["what"] == "z" and data["by"] == "head"
    assert data["answer"] == "h" and data["clean"] == CLEAN
    assert torch.tensor(data["heads"], dtype=torch.float64).shape == (2, 2)
    torch.testing.assert_close(torch.tensor(data["heads"], dtype=torch.float64), expected.scores, rtol=0, atol=1e-6)
    page = (out / "patching.html").read_text(encoding="ascii")
    written = [float(cell["data-value"]) for cell in parsed(page).cells]
    assert written == pytest.approx([v for row in data["heads"] for v in row], abs=1e-6)  # the JSON's 6 places
    assert CORRUPT in page and ("activation patching" if method == "exact" else "attribution patching") in page


def test_patch_by_position_on_a_transformers_gpt2(tmp_path, capsys):
    folder = hf_checkpoints.save("gpt2", tmp_path / "gpt2")
    clean, corrupt = "The bank was full of money", "The river was full of money"
    out = tmp_path / "out"
    argv = ["circuits", "patch", "--model", str(folder), "--clean", clean, "--corrupt", corrupt, "--answer", " bank"]
    argv += ["--wrong", " river", "--by", "position", "--what", "v", "--format", "json,html", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "patching.json").read_text())
    lm = load_causal_lm(folder)
    answer, wrong = lm.next_token(clean, " bank"), lm.next_token(clean, " river")
    expected = activation_patching(
        lm.model, lm.ids(clean), lm.ids(corrupt), answer=answer, wrong=wrong, what="v", by="position"
    )
    assert "positions" in data and "heads" not in data
    torch.testing.assert_close(torch.tensor(data["positions"], dtype=torch.float64), expected.scores, atol=1e-6, rtol=0)
    tokens = [lm.piece(int(token)) for token in lm.ids(clean)[0].tolist()]
    assert data["tokens"] == tokens
    cells = parsed((out / "patching.html").read_text(encoding="ascii")).cells
    assert [cell["title"].split(": ")[0] for cell in cells[: len(tokens)]] == [
        f"layer 0, position {index} ({token})" for index, token in enumerate(tokens)
    ]


@pytest.mark.parametrize(
    "change, option, fragment",
    [
        ({"--corrupt": "k l m"}, "--corrupt", "a prompt of as many tokens as --clean"),
        ({"--answer": "h i"}, "--answer", "one token that follows the prompt"),
        ({"--wrong": "zz"}, "--wrong", "one token that follows the prompt"),
        ({"--clean": "b c x"}, "--clean", "symbols of the model's vocabulary"),
        ({"--answer": "h", "--wrong": "h"}, "--wrong", "a token other than the answer"),
        ({"--format": "pdf"}, "--format", "one or more of terminal, html, json, png"),
        ({"--corrupt": CLEAN}, "--corrupt", "a prompt whose logit difference differs"),
    ],
)
def test_mistakes_are_one_line(checkpoint, change, option, fragment, tmp_path, capsys):
    options = {"--model": str(checkpoint), "--clean": CLEAN, "--corrupt": CORRUPT, "--answer": "h", "--wrong": "p"}
    options |= {"--out": str(tmp_path / "out"), **change}
    argv = ["circuits", "patch", *(item for pair in options.items() for item in pair)]
    assert_one_line(capsys, argv, "circuits", option, fragment)


@pytest.mark.parametrize("kind", ["bert", "bart", "reverse"])
def test_an_encoder_or_encoder_decoder_is_refused_in_one_line(kind, tmp_path, capsys):
    if kind == "reverse":  # a `multihead train reverse` checkpoint: our own encoder-decoder
        from multihead.lab.train.reverse import ReverseSettings, run_reverse

        folder = run_reverse(ReverseSettings(steps=2, log_every=1, probe_size=4)).save(tmp_path / "run")["model"]
    else:
        folder = hf_checkpoints.save(kind, tmp_path / kind)
    capsys.readouterr()  # what saving the checkpoint printed
    argv = ["circuits", "patch", "--model", str(folder), "--clean", "a b", "--corrupt", "a c", "--answer", "b"]
    assert_one_line(capsys, [*argv, "--wrong", "c"], "circuits", "--model", "a causal language model folder")


def test_dla_lens_and_detect_write_what_python_gives(checkpoint, tmp_path, capsys):
    from multihead.lab.circuits import detect_heads, direct_logit_attribution, logit_lens, repeated_random_tokens

    lm = load_causal_lm(checkpoint)
    out = tmp_path / "out"
    base = ["--model", str(checkpoint), "--out", str(out), "--format", "terminal,json,html"]
    assert main(["circuits", "dla", *base, "--text", CLEAN, "--answer", "h", "--wrong", "p"]) == 0
    assert main(["circuits", "lens", *base, "--text", CLEAN, "--answer", "h", "--wrong", "p", "--top", "3"]) == 0
    assert main(["circuits", "detect", *base, "--half-length", "6", "--batch", "2", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "direct logit attribution" in printed and "logit lens" in printed and "sink heads" in printed
    answer, wrong = lm.next_token(CLEAN, "h"), lm.next_token(CLEAN, "p")
    dla = json.loads((out / "dla.json").read_text())
    expected = direct_logit_attribution(lm.model, lm.ids(CLEAN), answer=answer, wrong=wrong)
    torch.testing.assert_close(
        torch.tensor(dla["heads"], dtype=torch.float64), expected.heads.double(), rtol=0, atol=1e-6
    )
    assert dla["explained"] == pytest.approx(dla["logit_difference"], abs=1e-5)
    lens = json.loads((out / "lens.json").read_text())
    read = logit_lens(lm.model, lm.ids(CLEAN), top=3, answer=answer, wrong=wrong)
    assert lens["rows"] == ["embedding", "layer 0", "layer 1"]
    assert lens["top"] == [[lm.piece(int(token)) for token in row[0]] for row in read.top]
    assert lens["differences"] == pytest.approx(read.differences.tolist(), abs=1e-6)
    detect = json.loads((out / "detect.json").read_text())
    ids = repeated_random_tokens(lm.model.config.vocab_size, 6, batch=2, seed=3, bos=lm.bos_id, low=1)
    found = detect_heads(lm.model, ids)
    torch.testing.assert_close(torch.tensor(detect["induction"]), found.induction.float(), rtol=0, atol=1e-6)
    assert detect["sink_heads"] == [list(pair) for pair in found.sink_heads()]
    assert detect["roles"] == found.named_heads()
    # the pages: dla's heads grid and its layers table, the lens table, a grid per detector and the sink share
    dla_page = parsed((out / "dla.html").read_text(encoding="ascii"))
    assert [float(cell["data-value"]) for cell in dla_page.cells] == pytest.approx(
        [v for row in dla["heads"] for v in row], abs=1e-6
    )
    assert [row[0]["text"] for row in dla_page.rows] == ["layer 0", "layer 1"]
    lens_rows = parsed((out / "lens.html").read_text(encoding="ascii")).rows
    assert [row[0]["text"] for row in lens_rows] == lens["rows"]
    assert [float(row[2]["text"]) for row in lens_rows] == pytest.approx(lens["differences"], abs=5e-4)
    detect_cells = parsed((out / "detect.html").read_text(encoding="ascii")).cells
    grids = [detect[name] for name in ("previous_token", "duplicate_token", "induction", "sink")]
    assert [float(cell["data-value"]) for cell in detect_cells] == pytest.approx(
        [v for grid in grids for row in grid for v in row], abs=1e-6
    )


def test_lens_writes_a_png_of_its_table_as_the_other_modes_write_theirs(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["circuits", "lens", "--model", str(checkpoint), "--text", CLEAN, "--answer", "h", "--wrong", "p"]
    assert main([*argv, "--format", "png", "--out", str(out)]) == 0
    assert sorted(path.name for path in out.iterdir()) == ["lens.png"]
    assert (out / "lens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {(out / 'lens.png').resolve()}" in capsys.readouterr().out
    for mode in ("patch", "dla", "lens", "detect"):  # every mode's --format lists png
        assert main(["circuits", mode, "--help"]) == 0
        assert "any of terminal,html,json,png" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "argv, option, fragment",
    [
        (["lens", "--text", CLEAN, "--answer", "h"], "--wrong", "given with --answer"),
        (["lens", "--text", CLEAN, "--format", "pdf"], "--format", "one or more of terminal, html, json, png"),
        (["lens", "--text", CLEAN, "--top", "0"], "--top", "a whole number in [1,"),
        (["dla", "--text", CLEAN, "--answer", "h h", "--wrong", "p"], "--answer", "one token"),
        (["detect", "--half-length", "0"], "--half-length", "a positive whole number"),
    ],
)
def test_other_modes_mistakes_are_one_line(checkpoint, argv, option, fragment, tmp_path, capsys):
    command = ["circuits", argv[0], "--model", str(checkpoint), "--out", str(tmp_path / "out"), *argv[1:]]
    assert_one_line(capsys, command, "circuits", option, fragment)


def test_patch_with_receivers_is_path_patching(checkpoint, tmp_path, capsys):
    from multihead.lab.circuits import path_patching

    out = tmp_path / "out"
    argv = ["circuits", "patch", "--model", str(checkpoint), "--clean", CLEAN, "--corrupt", CORRUPT, "--answer", "h"]
    argv += ["--wrong", "p", "--receivers", "1:0,1:1", "--what", "k", "--format", "json", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "patching.json").read_text())
    lm = load_causal_lm(checkpoint)
    answer, wrong = lm.next_token(CLEAN, "h"), lm.next_token(CLEAN, "p")
    expected = path_patching(
        lm.model, lm.ids(CLEAN), lm.ids(CORRUPT), answer=answer, wrong=wrong, receivers=[(1, 0), (1, 1)], what="k"
    )
    assert data["method"] == "path" and data["receivers"] == [[1, 0], [1, 1]]
    assert data["heads"][1] == [None, None]  # the receivers' layer sends nothing
    torch.testing.assert_close(
        torch.tensor(data["heads"][0], dtype=torch.float64), expected.scores[0], rtol=0, atol=1e-6
    )


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--receivers", "1:0", "--what", "z"], "--what q, k or v, by head, exact"),
        (["--receivers", "1-0", "--what", "k"], "LAYER:HEAD pairs separated by commas"),
        (["--receivers", "0:0", "--what", "k"], "heads after layer 0"),
        (["--receivers", "1:7", "--what", "k"], "heads of the model's 2 layers"),
    ],
)
def test_bad_receivers_are_one_line(checkpoint, extra, fragment, tmp_path, capsys):
    argv = ["circuits", "patch", "--model", str(checkpoint), "--clean", CLEAN, "--corrupt", CORRUPT, "--answer", "h"]
    assert_one_line(
        capsys, [*argv, "--wrong", "p", "--out", str(tmp_path / "o"), *extra], "circuits", "--receivers", fragment
    )


def test_a_model_type_without_a_causal_lm_head_is_refused(tmp_path):
    import transformers

    config = transformers.DistilBertConfig(vocab_size=120, dim=24, n_layers=1, n_heads=2, hidden_dim=32)
    transformers.DistilBertModel(config).save_pretrained(tmp_path / "distilbert")
    hf_checkpoints.tokenizer("wordpiece").save_pretrained(tmp_path / "distilbert")
    with pytest.raises(
        ValueError, match="model: expected a model_type with a causal LM head, got model_type 'distilbert'"
    ):
        load_causal_lm(tmp_path / "distilbert")
