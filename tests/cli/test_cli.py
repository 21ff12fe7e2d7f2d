"""The `multihead inspect` command: its outputs agree with the library, and user mistakes get one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from multihead._userfiles import cli_spelling
from multihead.cli import COST_OPTIONS, main, parse_dtype, parse_indices, parse_token
from multihead.lab.inspect import capture
from multihead.lab.inspect.inspection import pick_token
from multihead.lab.models import load_minilm

TEXT = "The bank was full of money."


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()


@pytest.mark.parametrize("columns", ["80", "120"])
def test_terminal_report_fits_the_width_and_shows_roles_and_the_token(columns, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", columns)  # output that is not a terminal is COLUMNS wide
    assert main(["inspect", TEXT, "--format", "terminal"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= int(columns) and "…" not in out
    assert "Head roles (from this text)" in out
    assert "Where 'bank' (token 2) attends" in out  # the default token: the first content word
    headers = [line.split() for line in lines if line.split()[:1] == ["head"]]
    assert headers == [["head", *(word for layer in range(6) for word in ("layer", str(layer)))]] * 2
    grid = out.split("Head roles")[1].split("Where")[0].splitlines()
    rows = [re.split(r"\s{2,}", line.strip()) for line in grid if line.split()[:1] in (["h0"], ["h2"], ["h11"])]
    assert len(rows) == 3 and all(len(row) == 7 for row in rows)  # head + 6 role labels, each with its strength
    assert rows[1][1] == "prev 100%"  # layer 0 head 2 of all-MiniLM-L6-v2 attends to the previous token
    assert "Strongest links from 'bank'" in out


def test_json_report_matches_a_direct_capture(tmp_path, minilm):
    model, tokenizer = minilm
    assert (
        main(
            [
                "inspect",
                TEXT,
                "--format",
                "json",
                "--layers",
                "1,4-5",
                "--heads",
                "0,7",
                "--token",
                "money",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "inspect.json").read_text())
    assert report["layers"] == [1, 4, 5] and report["heads"] == [0, 7]
    assert report["tokens"] == tokenizer.tokenize(TEXT) and report["token"] == 6
    with torch.no_grad(), capture(model, layers=[1, 4, 5], heads=[0, 7]) as rec:
        model.encode(TEXT)
    for row, layer in enumerate([1, 4, 5]):
        for col, head in enumerate([0, 7]):
            captured = rec.weights(layer, head)[0]  # (n, n)
            reported = torch.tensor(report["weights"][row][col], dtype=torch.float32)
            torch.testing.assert_close(reported, captured, atol=1e-6, rtol=0)
            top = report["top_attended"][row][col]
            assert [entry["index"] for entry in top] == captured[6].topk(3).indices.tolist()
            assert report["most_attended"][row][col] == captured.argmax(dim=-1).tolist()
    assert report["corpus_stats"] is None and report["roles_from"] == "this text"
    assert len(report["roles"]) == 3 and len(report["roles"][0]) == 2


def test_corpus_file_gives_corpus_statistics_and_roles(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("# a comment line\nThe cat sat on the mat.\n\nRain fell all night, and the river rose.\n")
    assert main(["inspect", TEXT, "--corpus", str(corpus), "--format", "json,html", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "inspect.json").read_text())
    assert report["corpus_stats"]["texts"] == 2
    assert report["roles_from"].endswith("(2 texts)")
    html = (tmp_path / "report.html").read_text()
    assert 'id="report-data"' in html and "corpus.txt (2 texts)" in html


def test_piped_output_has_no_progress_bar_remains(tmp_path, capsys):
    """Output to a pipe or a file gets no progress bar, nor the blank line a finished one leaves."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The cat sat on the mat.\nRain fell all night.\n")
    assert main(["inspect", TEXT, "--corpus", str(corpus), "--format", "terminal"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("all-MiniLM-L6-v2: 6 layers x 12 heads") and "corpus statistics" not in out


def test_png_report_is_an_image(tmp_path):
    assert main(["inspect", TEXT, "--format", "png", "--layers", "0", "--out", str(tmp_path)]) == 0
    data = (tmp_path / "heads.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "   "], "text: expected a non-empty text"),
        (
            ["inspect", TEXT, "--token", "river"],
            "token: expected a word of the text, got 'river'. Fix: pick one of its tokens: [CLS] the bank",
        ),
        (["inspect", TEXT, "--layers", "6"], "layers: expected layer indices in 0..5, got 6"),
        (["inspect", TEXT, "--heads", "12"], "heads: expected head indices in 0..11, got 12"),
        (["inspect", TEXT, "--layers", "a-b"], "--layers: expected indices like 0,2,5-7, got 'a-b'"),
        (["inspect", TEXT, "--format", "pdf"], "format: expected one or more of terminal, html, png, json, got pdf"),
        (["inspect", TEXT, "--model", "/nonexistent/model"], "model: expected an existing model directory"),
        (["inspect", TEXT, "--corpus", "/nonexistent/corpus.txt"], "corpus: expected a text file"),
        (
            ["inspect", "word " * 600, "--format", "terminal"],
            "text: expected at most 512 tokens (the model's 512 "
            "positions), got 602 tokens. Fix: shorten the text, or "
            "truncate it (--truncate)",
        ),
    ],
)
def test_user_mistakes_get_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("multihead inspect: error: ")
    assert message in captured.err
    assert "Traceback" not in captured.err


def test_truncate_cuts_long_texts_to_the_model_limit(tmp_path):
    assert (
        main(
            [
                "inspect",
                "word " * 600,
                "--truncate",
                "--format",
                "json",
                "--layers",
                "0",
                "--heads",
                "0",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "inspect.json").read_text())
    assert len(report["tokens"]) == 512 and report["tokens"][-1] == "[SEP]"


def test_console_script_runs_without_a_traceback():
    result = subprocess.run([sys.executable, "-m", "multihead.cli", "inspect", ""], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "multihead inspect: error: text: expected a non-empty text, got ''. "
        'Fix: pass e.g. "The bank was full of money."'
    )


def test_index_lists_and_token_choice():
    assert parse_indices("layers", "0,2,5-7") == [0, 2, 5, 6, 7]
    assert parse_indices("layers", None) is None
    tokens = ["[CLS]", "the", "photo", "##syn", "##thesis", "of", "it", ".", "[SEP]"]
    assert pick_token(tokens, None) == 2  # the first content word, as its first piece
    assert pick_token(tokens, "Photosynthesis") == 2  # a whole word re-joined from its pieces
    assert pick_token(tokens, "##syn") == 3
    assert pick_token(tokens, 7) == 7
    with pytest.raises(ValueError, match=r"token: expected a token index in 0\.\.8, got 9"):
        pick_token(tokens, 9)


def test_most_attended_token_for_every_token(minilm):
    from multihead.lab.inspect import inspect_text

    model, _ = minilm
    inspection = inspect_text(model, TEXT, layers=[0], heads=[2])
    pairs = inspection.most_attended(0, 2)
    assert [query for query, _, _ in pairs] == inspection.tokens
    # layer 0 head 2 is the previous-token head: every word piece attends most to the one before it
    assert [key for _, key, _ in pairs[1:]] == inspection.tokens[:-1]
    assert all(weight > 0.9 for _, _, weight in pairs[1:])


# --------------------------------------------------------------------------- --token: a word, an index, an occurrence


def chosen_token(text: str, spec: str, out) -> tuple[int, list[str]]:
    """The token `multihead inspect TEXT --token SPEC` follows: its index and the text's pieces (from inspect.json)."""
    argv = ["inspect", text, "--token", spec, "--format", "json", "--layers", "0", "--heads", "2", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "inspect.json").read_text())
    return report["token"], report["tokens"]


@pytest.mark.parametrize(
    "text, spec, index",
    [
        (TEXT, "3", 3),  # an index: tokens[3] is "was", not a word "3"
        (TEXT, "0", 0),  # [CLS]
        (TEXT, "money", 6),  # a word, as before
        (TEXT, "MONEY:1", 6),  # the first occurrence, any case
        ("The bank by the river bank was full.", "bank", 2),
        ("The bank by the river bank was full.", "bank:2", 6),
        ("The bank by the river bank was full.", " bank : 2 ", 6),
        ("I have 3 dogs and 3 cats.", "3:1", 3),  # a number word, by occurrence
        ("I have 3 dogs and 3 cats.", "3:2", 6),
        ("I have 3 dogs and 3 cats.", "3", 3),  # an index (here also the first "3")
        ("I have 3 dogs and 3 cats.", "6", 6),
        ("The riverbank met another riverbank.", "riverbank:2", 6),  # a whole word of two pieces
        ("The riverbank met another riverbank.", "##bank:2", 7),  # a piece
    ],
)
def test_token_by_word_index_and_occurrence(text, spec, index, tmp_path):
    token, tokens = chosen_token(text, spec, tmp_path)
    assert token == index, tokens


def test_the_followed_token_is_the_one_shown(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    text = "The bank by the river bank was full."
    assert main(["inspect", text, "--token", "bank:2", "--format", "terminal"]) == 0
    assert "Where 'bank' (token 6) attends" in capsys.readouterr().out
    assert main(["inspect", text, "--token", "5", "--format", "terminal"]) == 0
    assert "Where 'river' (token 5) attends" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text, spec, message",
    [
        (
            "The bank by the river bank was full.",
            "bank:3",
            "--token: expected an occurrence 1..2 of 'bank', got 3. Fix: 'bank' occurs 2 times in the text: "
            "pass --token bank:2 or a lower occurrence, or a token index 0..10",
        ),
        (TEXT, "money:2", "--token: expected an occurrence 1..1 of 'money', got 2. Fix: 'money' occurs once"),
        (TEXT, "bank:0", "--token: expected an occurrence counted from 1, got 'bank:0'. Fix: pass bank:1"),
        (TEXT, "river:1", "--token: expected a word of the text, got 'river'. Fix: pick one of its tokens: [CLS] the"),
        (TEXT, "9", "--token: expected a token index in 0..8, got 9"),
        (TEXT, "-1", "--token: expected a word of the text, a token index from 0, or WORD:N"),
        (TEXT, "9" * 5000, "--token: expected a word of the text, a token index from 0, or WORD:N"),
        (TEXT, "bank:" + "9" * 5000, "--token: expected a word of the text, a token index from 0, or WORD:N"),
    ],
)
def test_token_mistakes_get_one_line(text, spec, message, capsys):
    assert main(["inspect", text, "--token", spec, "--format", "terminal"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("multihead inspect: error: ") and "Traceback" not in err
    assert message in err


def test_a_missing_occurrence_is_refused_before_corpus_statistics(monkeypatch, capsys):
    from multihead.lab.inspect import inspection

    def never(*args, **kwargs):
        raise AssertionError("corpus statistics measured before --token was checked")

    monkeypatch.setattr(inspection, "head_stats", never)
    assert main(["inspect", TEXT, "--token", "bank:2", "--corpus", "--format", "terminal"]) == 2
    assert "--token: expected an occurrence 1..1 of 'bank', got 2" in capsys.readouterr().err


def test_parse_token():
    assert parse_token(None) is None
    assert parse_token("bank") == "bank"
    assert parse_token("12") == 12 and parse_token("007") == 7
    assert parse_token("bank:2") == ("bank", 2) and parse_token("3:1") == ("3", 1)
    assert parse_token("::2") == (":", 2)  # the second colon
    assert parse_token(":") == ":" and parse_token("12:30pm") == "12:30pm"
    assert parse_token("٣") == "٣"  # a digit of another script is a word, not an index
    for bad in ("-3", "bank:0", "1" * 10):
        with pytest.raises(ValueError, match="--token: expected"):
            parse_token(bad)


def test_token_help_explains_every_form(capsys):
    assert main(["inspect", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "a token index counting from 0" in help_text and "WORD:N for the Nth occurrence" in help_text
    assert "(--token 3:1)" in help_text


# --------------------------------------------------------------------------- multihead cost


def test_cost_json_matches_the_library():
    from multihead.cost import LayerShape, crossover, estimate

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "multihead.cli",
            "cost",
            "--embed-dim",
            "512",
            "--heads",
            "8",
            "--seq",
            "2048",
            "--kv-heads",
            "2",
            "--batch",
            "3",
            "--causal",
            "--backward",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(result.stdout)
    expected = estimate(LayerShape(512, 8, num_kv_heads=2), seq=2048, batch=3, causal=True, mode="forward+backward")
    assert report["flops"] == expected.flops and report["backward_flops"] == expected.backward_flops
    assert report["bytes"]["peak"] == expected.bytes.peak
    assert report["params"]["weights"] == 512 * 512 * 2 + 512 * 128 * 2
    assert report["dominant"] == "Q K^T"
    # grouped K/V heads make the projections cheaper, so the n x n terms catch up sooner than 2 x 512
    assert report["crossover_n"] == crossover(LayerShape(512, 8, num_kv_heads=2)) and 600 < report["crossover_n"] < 650


def test_cost_tables_and_plot(tmp_path, capsys):
    plot = tmp_path / "cost.png"
    assert main(["cost", "--embed-dim", "768", "--heads", "12", "--seq", "128", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "parameters: 2,362,368 (2,359,296 weights + 3,072 biases" in out
    assert "dominant term: Q/K/V projections" in out
    assert "at j = 128 they take 8% of the FLOPs and the projections 92%" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["cost", "--embed-dim", "64", "--heads", "4", "--seq", "1", "--decode-cache", "4095"]) == 0
    assert "KV cache (4096 tokens)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--embed-dim", "0", "--heads", "8", "--seq", "4"],
            "--embed-dim: expected a positive whole number, got 0. Fix: pass --embed-dim >= 1",
        ),
        (["--embed-dim", "512", "--heads", "-8", "--seq", "4"], "--heads: expected a positive whole number, got -8"),
        (["--embed-dim", "512", "--heads", "7", "--seq", "4"], "--heads: expected a divisor of --embed-dim = 512"),
        (["--embed-dim", "512", "--heads", "8", "--kv-heads", "3", "--seq", "4"], "--kv-heads: expected a divisor"),
        (["--embed-dim", "512", "--heads", "8", "--seq", "0"], "--seq: expected a positive whole number, got 0"),
        (["--embed-dim", "512", "--heads", "8", "--seq", "4", "--dtype", "int4"], "--dtype: expected one of float32"),
        (
            ["--embed-dim", "512", "--heads", "8", "--seq", "4", "--backward", "--decode-cache", "3"],
            "--decode-cache: expected no --backward",
        ),
        (["--embed-dim", "x", "--heads", "8", "--seq", "4"], "argument --embed-dim: invalid int value: 'x'"),
        (["--heads", "8", "--seq", "4"], "the following arguments are required: --embed-dim"),
    ],
)
def test_cost_mistakes_get_one_line(argv, message, capsys):
    code = None
    try:
        code = main(["cost", *argv])
    except SystemExit as exit_:  # argparse's own errors exit from inside parse_args
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert not re.search(r"\b[a-z_]+=", err), err  # the options as typed, not the library's keyword arguments


@pytest.mark.parametrize(
    "spelled, name",
    [
        ("fp16", "float16"),
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("half", "float16"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("torch.float64", "float64"),
        ("float16", "float16"),
    ],
)
def test_cost_takes_the_usual_dtype_names(spelled, name, capsys):
    assert main(["cost", "--embed-dim", "64", "--heads", "4", "--seq", "8", "--dtype", spelled, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == name


def test_every_dtype_option_goes_through_one_parser(capsys):
    assert parse_dtype("bf16") == "bfloat16" and parse_dtype(" Half ") == "float16"
    with pytest.raises(ValueError, match=r"^--dtype: expected one of float32, .*got 'int8'\. Fix: pass e.g\. --dtype"):
        parse_dtype("int8")
    assert main(["bench", "--calibrate", "--dtype", "fp8"]) == 2  # refused before any measuring
    assert "--dtype: expected one of float32" in capsys.readouterr().err


def test_library_errors_reach_the_command_line_in_its_spelling(tmp_path, capsys):
    assert main(["inspect", "--part", "encoder", "--format", "json", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "multihead inspect: error: --part: expected one of the model's parts ['self'], got 'encoder'. "
        "Fix: pass e.g. --part self\n"
    )
    respelled = cli_spelling("pass e.g. heads=[0, 1]; or dtype='float32' for embed_dim", COST_OPTIONS)
    assert respelled == "pass e.g. heads=[0, 1]; or --dtype float32 for --embed-dim"  # heads is not a cost option
    assert cli_spelling('pass part="cross"', {"part": "--part"}) == "pass --part cross"
    assert cli_spelling("or truncate it (truncate=True)", {"truncate": "--truncate"}) == "or truncate it (--truncate)"


def test_errors_are_renamed_from_their_fields_never_from_their_message():
    """An error keeps argument, expected, got and fix as fields; the command line builds its own words from them
    (it used to take the message apart by its prefix, so another library's "heads: ..." was renamed too)."""
    from multihead._errors import InputError, bad_argument
    from multihead._userfiles import from_option, from_options

    error = bad_argument("part", "one of ['self']", "'encoder'", 'pass e.g. part="self"')
    assert (error.argument, error.expected, error.got, error.fix) == ("part", "one of ['self']", "'encoder'", error.fix)
    with pytest.raises(ValueError) as raised, from_options({"part": "--part"}):
        raise error
    assert str(raised.value) == "--part: expected one of ['self'], got 'encoder'. Fix: pass e.g. --part self"
    assert type(raised.value) is type(error) and raised.value.argument == "--part"
    elsewhere = InputError("part: a message from another library")  # no fields: not ours to take apart
    with pytest.raises(InputError) as raised, from_options({"part": "--part"}):
        raise elsewhere
    assert raised.value is elsewhere
    with pytest.raises(ValueError, match=r"^--model config\.json: expected a file"), from_option("--model"):
        raise bad_argument("config.json", "a file", "a folder", "pass the checkpoint folder")
    import pickle

    assert pickle.loads(pickle.dumps(error)).fix == 'pass e.g. part="self"'  # the fields cross processes


# --------------------------------------------------------------------------- multihead heads


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("The bank was full of money.\nWe sat on the river bank.\nIt rained all night in Dunmere.\n")
    return path


def test_heads_importance_then_prune_then_inspect_columns(small_corpus, tmp_path, capsys):
    out = tmp_path / "heads"
    assert main(["heads", "importance", "--corpus", str(small_corpus), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Ablation importance over" in printed and "most important: L" in printed
    saved = json.loads((out / "importance.json").read_text())
    assert len(saved["scores"]) == 6 and len(saved["scores"][0]) == 12
    assert saved["ranking"][0]["score"] == max(max(row) for row in saved["scores"])
    assert (
        main(
            [
                "heads",
                "prune",
                "--fraction",
                "0.25",
                "--importance",
                str(out),
                "--corpus",
                str(small_corpus),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "Pruning curve" in printed and "pruned 18 heads (fraction 0.25)" in printed
    curve = json.loads((out / "pruning.json").read_text())
    assert [row["heads_removed"] for row in curve][:3] == [0, 7, 14]
    pruned, _ = load_minilm(out / "model")
    assert sum(len(ids) for ids in pruned.head_ids) == 72 - 18
    # the report gains the importance column for the heads shown
    assert (
        main(
            [
                "inspect",
                TEXT,
                "--format",
                "html",
                "--layers",
                "5",
                "--heads",
                "0,3",
                "--scores",
                str(out),
                "--out",
                str(tmp_path / "report"),
            ]
        )
        == 0
    )
    html = (tmp_path / "report" / "report.html").read_text()
    expected = [round(saved["scores"][5][h] * 1000, 3) for h in (0, 3)]
    assert '"importance (1 - cos) x 1000":[[' + ",".join(repr(v) for v in expected) + "]]" in html


def test_inspect_scores_weigh_a_heads_syntactic_relation_into_its_role(tmp_path):
    """A syntax.json in which L2H8 finds nsubj for 95% of dependents (the best offset: 10%) names that head."""
    grid = [[0.05] * 12 for _ in range(6)]
    grid[2][8] = 0.95
    syntax = {
        "layers": list(range(6)),
        "heads": list(range(12)),
        "relations": ["nsubj"],
        "counts": {"nsubj": 50},
        "baseline": {"nsubj": {"offset": 1, "score": 0.1}},
        "dependent_to_head": {"nsubj": grid},
        "head_to_dependent": {"nsubj": [[0.0] * 12 for _ in range(6)]},
        "per_head_best": grid,
    }
    (tmp_path / "scores").mkdir()
    (tmp_path / "scores" / "syntax.json").write_text(json.dumps(syntax))
    out = tmp_path / "report"
    assert main(["inspect", TEXT, "--scores", str(tmp_path / "scores"), "--format", "json", "--out", str(out)]) == 0
    roles = json.loads((out / "inspect.json").read_text())["roles"]
    assert roles[2][8]["label"] == "nsubj" and roles[2][8]["relation"]["score"] == 0.95
    assert roles[2][8]["confidence"] == "high"
    # only heads that beat the offset baseline carry a relation
    assert [(r, c) for r, row in enumerate(roles) for c, role in enumerate(row) if role["relation"]] == [(2, 8)]
    assert roles[0][2]["label"] == "prev"  # 5% of nsubj does not outweigh a previous-token head


@pytest.mark.parametrize(
    "argv, message",
    [
        (["heads", "prune", "--fraction", "1.0"], "--fraction: expected a fraction of all heads in [0, 1), got 1.0"),
        (["heads", "prune", "--fraction", "-0.1"], "--fraction: expected a fraction of all heads in [0, 1)"),
        (["heads", "prune"], "--fraction: expected either --fraction F or --remove L:H,..., got both or neither"),
        (["heads", "prune", "--remove", "0:0,1,2,3,4,5,6,7,8,9,10,11"], "heads[0]: expected fewer than all 12 heads"),
        (["heads", "prune", "--remove", "zero"], "--remove: expected LAYER:HEAD,HEAD;LAYER:HEAD"),
        (
            ["heads", "prune", "--fraction", "0.2", "--importance", "/nonexistent"],
            "--importance: expected an importance.json",
        ),
        (["heads", "importance", "--corpus", "/nonexistent.txt"], "corpus: expected a text file"),
        (["inspect", TEXT, "--scores", "/nonexistent"], "--scores: expected a folder written by"),
    ],
)
def test_heads_mistakes_get_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


def test_a_corpus_line_over_the_models_positions_is_named_by_its_line_in_cli_spelling(tmp_path, capsys):
    """Issue 47, row 8: the 22nd line of the file (after 20 texts, two batches of corpus statistics, and a blank
    line) is `--corpus line 22`, and the fix names --truncate, not truncate=True."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join([f"sentence number {n}." for n in range(20)] + ["", "word " * 600]), "utf-8")
    assert main(["inspect", TEXT, "--corpus", str(corpus), "--format", "terminal"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "error: --corpus line 22: expected at most 512 tokens (the model's 512 positions), got 602 tokens" in err
    assert err.rstrip().endswith("Fix: shorten the text, or truncate it (--truncate)") and "=True" not in err
    assert main(["inspect", "word " * 600, "--format", "terminal"]) == 2
    err = capsys.readouterr().err
    assert "error: text: expected at most 512 tokens" in err and err.rstrip().endswith("(--truncate)"), err


def test_head_stats_names_a_long_text_by_the_callers_number(minilm):
    """The library's own numbering: texts[21] of the list given, whatever batch and blank texts came before."""
    from multihead.lab.inspect.stats import head_stats

    texts = [f"sentence number {n}." for n in range(20)] + ["  ", "word " * 600]
    with pytest.raises(ValueError, match=r"^texts\[21\]: expected at most 512 tokens.*\(truncate=True\)$"):
        head_stats(minilm[0], texts, batch_size=16)


def test_prune_names_the_kind_of_model_it_got(tmp_path, capsys):
    """Issue 47, row 6: a `multihead train` checkpoint is named as one, not as a transformers checkpoint."""
    run = tmp_path / "run"
    tiny = ["--steps", "2", "--layers", "1", "--heads", "2", "--hidden", "16", "--out", str(run)]
    assert main(["train", "induction", *tiny]) == 0
    capsys.readouterr()
    assert main(["heads", "prune", "--fraction", "0.5", "--model", str(run / "model")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a decoder saved by Decoder.save (a multihead train checkpoint)" in err, err
    assert "transformers" not in err


def test_heads_syntax_table_and_files(tmp_path, capsys):
    assert main(["heads", "syntax", "--max-sentences", "60", "--relations", "det,case", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "Syntactic heads on UD English EWT dev (60 sentences)" in printed
    saved = json.loads((tmp_path / "syntax.json").read_text())
    assert saved["relations"] == ["det", "case"] and len(saved["per_head_best"]) == 6
    best = {row["relation"]: row for row in saved["best"]}
    assert best["det"]["score"] == max(
        max(max(r) for r in saved["dependent_to_head"]["det"]), max(max(r) for r in saved["head_to_dependent"]["det"])
    )
    assert (tmp_path / "syntax.png").read_bytes()[:4] == b"\x89PNG"


def test_heads_syntax_on_two_sentences_names_the_relations_it_left_out(tmp_path, capsys):
    assert main(["heads", "syntax", "--max-sentences", "2", "--out", str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "left out (no sentence of the 2 has them): advmod, aux, nmod:poss" in out
    assert json.loads((tmp_path / "syntax.json").read_text())["left_out"] == ["advmod", "aux", "nmod:poss"]


@pytest.mark.parametrize(
    "treebank, relations, message",
    [
        (None, "det,frobnicate", "relations: expected relations present in the sentences"),
        (
            "1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_\n2\tdog\tdog\tNOUN\n",
            None,
            "line 2: expected 10 tab-separated fields",
        ),
    ],
)
def test_heads_syntax_mistakes(treebank, relations, message, tmp_path, capsys):
    argv = ["heads", "syntax", "--max-sentences", "5", "--out", str(tmp_path)]
    if treebank is not None:
        (tmp_path / "bad.conllu").write_text(treebank)
        argv += ["--treebank", str(tmp_path / "bad.conllu")]
    if relations is not None:
        argv += ["--relations", relations]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


def test_written_paths_print_as_plain_text(tmp_path):
    from rich.console import Console

    from multihead.cli import print_written

    folder = tmp_path / "[bold]results[/bold]"
    folder.mkdir(parents=True)  # "[/bold]" is a folder inside "[bold]results["
    (folder / "bench.json").write_text("{}", encoding="utf-8")
    console = Console(record=True, width=400)
    print_written(console, [folder / "bench.json"])
    assert console.export_text().strip() == f"wrote {(folder / 'bench.json').resolve()} (2 bytes)"
