"""inspect reports every part of a model: causal decoders (GPT-2, Llama, BART's decoder) and cross-attention (BART).

Tiny checkpoints from hf_checkpoints, built once for the module and loaded with load_model. The weights recorded
for each BART part equal transformers' own eager attentions; statistics stay finite on rectangular and causal
weights; every format writes, through write_reports and the CLI; the pages load in Debian's chromium.
"""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
import transformers
from rich.console import Console

from hf_checkpoints import SENTENCES, save
from multihead.cli import main
from multihead.integrations.transformers_models import load_model
from multihead.lab.inspect.html import render_html
from multihead.lab.inspect.inspection import CAUSAL_NOTE, PART_TITLES, Inspection, inspect_text
from multihead.lab.inspect.stats import head_stats, weight_stats
from multihead.lab.inspect.terminal import print_inspection, strongest_links
from multihead.lab.inspect.write import write_reports
from support_inspect import HEADS, LAYERS, rectangular_inspection, synthetic_inspection
from test_inspect_html import browser, open_report, page_data, read_bars  # noqa: F401 (fixtures)

TEXT = "The bank was full of money."
FORMATS = ["terminal", "html", "png", "json"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: save(name, root / name) for name in ("gpt2", "llama", "bart")}


@pytest.fixture(scope="module")
def models(folders):
    return {name: load_model(folder) for name, folder in folders.items()}


def printed(inspection: Inspection) -> str:
    console = Console(file=io.StringIO(), width=100)
    print_inspection(inspection, console)
    return console.file.getvalue()


def strict_json(text: str) -> dict:
    """JSON that holds no NaN or infinity (json.loads would read them)."""

    def refuse(name: str) -> float:
        raise AssertionError(f"{name} in the JSON")

    return json.loads(text, parse_constant=refuse)


def assert_stats_finite(inspection: Inspection) -> None:
    for stats in (inspection.stats, inspection.role_stats):
        for name, values in stats.values.items():
            assert torch.isfinite(values).all(), name
        assert torch.isfinite(stats.patterns).all()
        assert ((stats.values["norm_entropy"] >= 0) & (stats.values["norm_entropy"] <= 1 + 1e-9)).all()


# --------------------------------------------------------------------------- causal models


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_decoder_only_model_is_reported_causal(name, models):
    inspection = inspect_text(models[name], TEXT, token="bank")
    n = len(inspection.tokens)
    assert (inspection.part, inspection.causal) == ("self", True)
    assert inspection.key_tokens == inspection.tokens and inspection.same_axes
    assert inspection.weights.shape == (2, 4, n, n)
    assert (inspection.weights.triu(1) == 0).all()  # masked: each token sees itself and earlier tokens only
    assert (inspection.weights[..., torch.ones(n, n, dtype=torch.bool).tril()] > 0).all()
    torch.testing.assert_close(inspection.weights.sum(-1), torch.ones(2, 4, n))
    assert_stats_finite(inspection)
    assert (inspection.stats.values["next"] == 0).all()  # nothing after the token is ever attended
    data = strict_json(json.dumps(inspection.to_dict(), allow_nan=False))
    assert (data["part"], data["causal"], data["key_tokens"]) == ("self", True, inspection.tokens)
    lines = printed(inspection).splitlines()
    assert lines[0] == f"{name}: 2 layers x 4 heads on {n} tokens" and lines[1] == CAUSAL_NOTE
    assert inspection.notes == [CAUSAL_NOTE]


def test_causal_norm_entropy_is_over_the_keys_a_query_sees():
    """A causal head spreading evenly over what it may see scores 1 (but the first token, which sees only itself)."""
    tokens = ["The", "bank", "was", "full", "."]
    n = len(tokens)
    even = torch.tril(torch.ones(n, n, dtype=torch.float64))
    even = (even / even.sum(-1, keepdim=True))[None, None]  # (1, 1, n, n)
    causal = weight_stats([even], [tokens], layers=[0], heads=[0], causal=True).stat(0, 0)
    assert causal["norm_entropy"] == pytest.approx((n - 1) / n, abs=1e-12)
    assert causal["entropy"] == pytest.approx(sum(math.log(i + 1) for i in range(n)) / n, abs=1e-12)
    plain = weight_stats([even], [tokens], layers=[0], heads=[0]).stat(0, 0)  # read as if it saw every token
    assert plain["norm_entropy"] == pytest.approx(causal["entropy"] / math.log(n), abs=1e-12)


# --------------------------------------------------------------------------- BART: encoder, decoder, cross


def test_an_encoder_decoders_parts_have_their_own_pieces_and_shapes(models):
    bart = models["bart"]
    source = bart.tokenizer.batch([TEXT]).tokens[0]
    target = ["</s>", *source[:-1]]  # BART's decoder starts with </s>, then the text shifted right
    n = len(source)
    assert inspect_text(bart, TEXT).part == "encoder"  # the default: the model's first part
    expected = {"encoder": (source, source, False), "decoder": (target, target, True), "cross": (target, source, False)}
    for part, (queries, keys, causal) in expected.items():
        inspection = inspect_text(bart, TEXT, part=part)
        assert (inspection.part, inspection.causal) == (part, causal)
        assert (inspection.tokens, inspection.key_tokens) == (queries, keys)
        assert inspection.weights.shape == (2, 4, len(queries), len(keys)) == (2, 4, n, n)
        assert_stats_finite(inspection)
        assert inspection.notes == [PART_TITLES[part]] + ([CAUSAL_NOTE] if causal else [])
        assert inspection.same_axes == (part != "cross")
    decoder = inspect_text(bart, TEXT, part="decoder").weights
    assert (decoder.triu(1) == 0).all() and (decoder[..., torch.ones(n, n, dtype=torch.bool).tril()] > 0).all()
    cross = inspect_text(bart, TEXT, part="cross", token="bank")
    assert cross.tokens[cross.token] == "bank"
    assert (cross.weights > 0).all()  # cross-attention masks nothing: every source piece is seen
    for layer in cross.layers:
        for head in cross.heads:
            assert all(0 <= index < n and piece == source[index] for piece, index, _ in cross.top_attended(layer, head))
            assert [key for _, key, _ in cross.most_attended(layer, head)] == [
                source[j] for j in cross.head_weights(layer, head).argmax(-1).tolist()
            ]


def test_every_parts_weights_are_transformers_eager_attentions(models, folders):
    """The same checkpoint run by transformers' eager attention, which shifts the source itself into the decoder's
    input when given none (BART's own shift, through its public forward)."""
    bart = models["bart"]
    eager = transformers.AutoModel.from_pretrained(folders["bart"], attn_implementation="eager").eval()
    batch = bart.tokenizer.batch([TEXT])
    with torch.no_grad():
        expected = eager(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_attentions=True)
    theirs = {
        "encoder": expected.encoder_attentions,
        "decoder": expected.decoder_attentions,
        "cross": expected.cross_attentions,
    }
    for part, attentions in theirs.items():
        inspection = inspect_text(bart, TEXT, part=part)
        want = torch.stack([layer[0] for layer in attentions]).float()  # (layers, heads, i, j)
        torch.testing.assert_close(inspection.weights, want, atol=1e-5, rtol=0)
    # the shift: the decoder start token, then the source but its last token
    shifted = [eager.config.decoder_start_token_id] + batch.input_ids[0, :-1].tolist()
    assert inspect_text(bart, TEXT, part="cross").tokens == [bart.tokenizer.piece(token_id) for token_id in shifted]


@pytest.mark.parametrize("part", ["encoder", "decoder", "cross"])
def test_head_stats_of_a_part_equal_the_inspections(part, models):
    bart = models["bart"]
    inspection = inspect_text(bart, TEXT, part=part)
    stats = head_stats(bart, TEXT, part=part)
    assert stats.tokens == len(inspection.tokens)
    for name, values in stats.values.items():
        torch.testing.assert_close(values, inspection.stats.values[name], atol=1e-12, rtol=0)
    with_corpus = inspect_text(bart, TEXT, part=part, corpus=SENTENCES)
    assert with_corpus.role_stats is with_corpus.corpus and with_corpus.corpus.texts == len(SENTENCES)
    assert_stats_finite(with_corpus)


def test_a_part_the_model_lacks_is_refused_naming_its_parts(models):
    with pytest.raises(ValueError, match=r"part: expected one of the model's parts \['encoder', 'decoder', 'cross'\]"):
        inspect_text(models["bart"], TEXT, part="self")
    with pytest.raises(ValueError, match=r"part: expected one of the model's parts \['self'\], got 'cross'"):
        head_stats(models["gpt2"], TEXT, part="cross")


# --------------------------------------------------------------------------- rectangular statistics by hand


def test_statistics_of_rectangular_weights_are_those_of_the_key_positions_and_pieces():
    """3 queries, 5 keys: [CLS]/[SEP]/punct come from the KEY pieces; prev/next/self at key positions i-1, i+1, i."""
    queries = ["[CLS]", "a", "b"]
    keys = ["[CLS]", "x", ",", "y", "[SEP]"]
    a = torch.tensor(
        [[1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5, 0.0], [0.0, 0.2, 0.0, 0.0, 0.8]], dtype=torch.float64
    )
    stats = weight_stats([a[None, None]], [queries], layers=[0], heads=[0], key_tokens=[keys])
    s = stats.stat(0, 0)

    def h(*ps):
        return -sum(p * math.log(p) for p in ps)

    entropy = (0 + h(0.5, 0.5) + h(0.2, 0.8)) / 3
    assert s["entropy"] == pytest.approx(entropy, abs=1e-12)
    assert s["norm_entropy"] == pytest.approx(entropy / math.log(5), abs=1e-12)  # n: the keys
    assert s["distance"] == pytest.approx((0 + 1.5 + (0.2 + 1.6)) / 3, abs=1e-12)
    assert s["cls"] == pytest.approx(1 / 3, abs=1e-12) and s["sep"] == pytest.approx(0.8 / 3, abs=1e-12)
    assert s["punct"] == pytest.approx(0.5 / 3, abs=1e-12)  # the "," among the keys
    assert s["self"] == pytest.approx(1 / 3, abs=1e-12)
    assert s["next"] == pytest.approx(0.5 / 3, abs=1e-12) and s["prev"] == pytest.approx(0.2 / 3, abs=1e-12)
    assert s["max_weight"] == pytest.approx((1 + 0.5 + 0.8) / 3, abs=1e-12)
    # word queries a, b: largest weights at offsets +1 and +2, a tie won by the smaller offset
    assert (s["positional"], s["best_offset"]) == (0.5, 1.0)
    # D (|i - j| <= 1) = 1.7 / 3, V (the two heaviest key columns [CLS], [SEP], off the band) = 0.8 / 3
    assert stats.roles()[0][0].pattern == "vertical+diagonal"
    assert json.loads(json.dumps(stats.as_dict(), allow_nan=False)) == stats.as_dict()


def test_a_rectangular_inspection_writes_every_format(tmp_path):
    inspection = rectangular_inspection()
    console = Console(file=io.StringIO(), width=100)
    paths = write_reports(inspection, tmp_path, FORMATS, console=console)
    assert sorted(paths) == ["html", "json", "png"]
    lines = console.file.getvalue().splitlines()
    assert lines[:4] == [
        "synthetic: 2 layers x 3 heads from 4 query tokens to 7 key tokens",
        PART_TITLES["cross"],
        "queries: </s> la banque .",
        "keys:    [CLS] the bank <b>x</b> full . [SEP]",
    ]
    assert "Where 'banque' (token 2) attends in the source text" in " ".join(console.file.getvalue().split())
    data = strict_json(paths["json"].read_text())
    assert (data["part"], data["causal"], data["key_tokens"]) == ("cross", False, inspection.key_tokens)
    assert torch.tensor(data["weights"]).shape == (2, 3, 4, 7)
    assert torch.tensor(data["most_attended"]).shape == (2, 3, 4)
    assert data["most_attended"] == inspection.weights.argmax(-1).tolist()
    cells = [cell for row in data["top_attended"] for head in row for cell in head]
    assert cells and all(cell["token"] == inspection.key_tokens[cell["index"]] for cell in cells)
    for _, _, piece, _ in strongest_links(inspection):
        assert piece in inspection.key_tokens and piece not in ("[CLS]", "[SEP]")
    view = page_data(paths["html"].read_text())["view"]
    assert view["key_special"] == [True, False, False, False, False, False, True]


def test_the_synthetic_self_attention_json_says_self_and_not_causal():
    data = synthetic_inspection().to_dict()
    assert (data["part"], data["causal"], data["key_tokens"]) == ("self", False, data["tokens"])


# --------------------------------------------------------------------------- the command line


def test_the_cli_writes_every_format_of_cross_attention(folders, tmp_path, capsys):
    out = tmp_path / "report"
    code = main(
        ["inspect", TEXT, "--model", str(folders["bart"]), "--part", "cross", "--token", "bank"]
        + ["--format", ",".join(FORMATS), "--out", str(out)]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert PART_TITLES["cross"] in text and "attends in the source text" in " ".join(text.split())
    data = strict_json((out / "inspect.json").read_text())
    assert (data["part"], data["causal"]) == ("cross", False)
    assert data["key_tokens"][0] == "<s>" and data["tokens"][0] == "</s>"
    assert (out / "report.html").is_file() and (out / "heads.png").stat().st_size > 0


def test_the_cli_reports_a_decoder_part_causal(folders, tmp_path, capsys):
    code = main(["inspect", TEXT, "--model", str(folders["bart"]), "--part", "decoder", "--format", "terminal"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == [PART_TITLES["decoder"], CAUSAL_NOTE]


@pytest.mark.parametrize(
    ("name", "part", "parts"), [("bart", "self", "['encoder', 'decoder', 'cross']"), ("gpt2", "cross", "['self']")]
)
def test_a_wrong_part_is_one_line_naming_the_models_parts(name, part, parts, folders, tmp_path, capsys):
    code = main(["inspect", TEXT, "--model", str(folders[name]), "--part", part, "--out", str(tmp_path / "r")])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and f"--part: expected one of the model's parts {parts}, got '{part}'" in lines[0]
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------- the pages in the browser


def test_the_cross_attention_page_shows_the_source_as_keys(models, open_report):  # noqa: F811 (the fixture)
    inspection = inspect_text(models["bart"], TEXT, part="cross", token="bank")
    data = inspection.to_dict()
    page = open_report(inspection)
    assert page.text_content("#report-notes") == PART_TITLES["cross"]
    assert page.text_content("#report-part") == "cross" and page.is_visible("#key-strip")
    assert page.eval_on_selector_all(".key-chip", "ks => ks.map(k => k.textContent)") == inspection.key_tokens
    for li, hi, q in [(0, 0, inspection.token), (1, 3, 0)]:
        page.select_option("#layer-select", str(inspection.layers[li]))
        page.select_option("#head-select", str(inspection.heads[hi]))
        page.click(f'.token[data-index="{q}"]')
        bars = read_bars(page)
        assert [token for _, _, token, _ in bars] == inspection.key_tokens
        for (_, weight, _, pct), expected in zip(bars, data["weights"][li][hi][q], strict=True):
            assert weight == expected and pct == f"{100 * expected:.1f}%"


def test_a_causal_page_lists_only_the_keys_a_query_sees(models, open_report):  # noqa: F811 (the fixture)
    """An early query's bar list was mostly rows of "masked": the later keys are now one line after the bars."""
    inspection = inspect_text(models["gpt2"], TEXT, token="bank")
    page = open_report(inspection)
    assert page.text_content("#report-notes") == CAUSAL_NOTE and page.is_visible("#legend-masked")
    assert page.is_hidden("#key-strip") and page.is_hidden("#report-part-meta")
    n = len(inspection.tokens)
    for q in (0, inspection.token, n - 1):
        page.click(f'.token[data-index="{q}"]')
        bars = read_bars(page)
        assert sorted(int(key) for key, _, _, _ in bars) == list(range(q + 1))  # itself and what comes before
        assert all(pct != "masked" for _, _, _, pct in bars)
        note = page.locator("#attention-bars .masked-note")
        if q < n - 1:
            later = n - 1 - q
            assert note.text_content().startswith(f"{later} later key{'s are' if later > 1 else ' is'} masked")
        else:
            assert note.count() == 0


def test_a_causal_inspection_defaults_to_its_last_content_word_and_lists_no_masked_key(models):
    inspection = inspect_text(models["gpt2"], TEXT)
    pieces = inspection.words[0]
    last_word = max(word for word in set(pieces.word_ids) - {None} if pieces.words[word].isalnum())
    last = max(index for index, word in enumerate(pieces.word_ids) if word == last_word)
    # its last piece ("oney" of "m oney") sees the whole text; the first word sees almost nothing
    assert inspection.token == last
    assert [index for _, index, _ in inspection.top_attended(0, 0, token=0, k=3)] == [0]  # query 0 sees key 0
    assert len(inspection.top_attended(0, 0, token=2, k=5)) == 3


def test_a_rectangular_page_draws_its_keys_as_columns(open_report):  # noqa: F811 (the fixture)
    inspection = rectangular_inspection()
    page = open_report(inspection)
    sizes = page.eval_on_selector_all("canvas.heatmap", "cs => cs.map(c => [c.width, c.height])")
    assert sizes == [[7, 4]] * (len(LAYERS) * len(HEADS))
    assert [token for _, _, token, _ in read_bars(page)] == inspection.key_tokens
    assert page.text_content("#report-ntokens") == "4 queries \u00b7 7 keys"
    assert page.locator("b").count() == 0  # a key piece with markup is text
    assert render_html(inspection).isascii()
