"""multihead.lab.inspect.browse_corpus: every head's top contexts and measure distributions over a corpus, against a
brute-force search over the same corpus with the weights and outputs captured whole (each measure written out
from its definition, piece by piece), on MiniLM and on a causal transformers GPT-2 read in windows; the measures
against attention_stats on a window; a head ablated to zero; bad arguments."""

from __future__ import annotations

import math

import pytest
import torch

import hf_checkpoints
from multihead.capture import capture
from multihead.integrations import load_text_model
from multihead.lab.inspect import bundled_corpus
from multihead.lab.inspect.browse import MEASURES, browse_corpus, read_documents, window_measures
from multihead.lab.inspect.browse import _Window as Window
from multihead.lab.inspect.browse_report import MAIN_MEASURE, head_roles, render_browser
from multihead.lab.inspect.long import special_ends
from multihead.lab.models import load_minilm
from support import is_input_error
from test_inspect_html import browser, page_opener  # noqa: F401 (browser: the module's chromium fixture)


def brute_force(model, documents, layers, window, context):
    """{(layer, head): {measure: [(score, document, position, pieces, query, weights), ...]}} over every measured
    query, in rank order (score, then document and position), and the model's own pieces: each document split as
    browse_corpus documents, each window's weights captured whole."""
    tokenizer = model.tokenizer
    found: dict = {}
    for index, text in enumerate(documents):
        batch = tokenizer.batch([text], max_length=10**9)
        ids, tokens = batch.input_ids[0], batch.pieces[0].tokens
        lead, trail = special_ends(batch.pieces[0].word_ids)
        body = list(range(lead, len(ids) - trail))
        size = window - lead - trail
        # the windows: stretches of `size` body pieces sliding by half; a piece is measured in the first holding it
        starts = sorted(set(range(0, max(1, len(body) - size), max(1, size // 2))) | {max(0, len(body) - size)})
        measured = set()
        for start in starts:
            stretch = body[start : start + size]
            places = list(range(lead)) + stretch + list(range(len(ids) - trail, len(ids)))
            window_ids = ids[places]
            with torch.no_grad(), capture(model, layers=layers, outputs=True) as rec:
                model(window_ids[None])
            for layer in layers:
                weights, outputs = rec.weights(layer)[0].double(), rec.outputs(layer)[0].double()
                for head in range(weights.shape[0]):
                    for row, place in enumerate(places):
                        if place not in stretch or place in measured:
                            continue
                        w = weights[head, row].tolist()
                        n = len(w)
                        sinks = set(range(lead)) | set(range(n - trail, n))
                        values = {
                            "max-off-sink": max(w[j] for j in range(n) if j not in sinks),
                            "output-norm": math.sqrt(sum(x * x for x in outputs[head, row].tolist())),
                            "entropy-low": -sum(x * math.log(x) for x in w if x > 0),
                            "previous-token": w[row - 1] if row > 0 else 0.0,
                            "prefix-matching": sum(
                                w[j] for j in range(1, n) if j - 1 != row and window_ids[j - 1] == window_ids[row]
                            ),
                        }
                        values["entropy-high"] = values["entropy-low"]
                        first, stop = max(0, row - context), min(n, row + context + 1)
                        where = [tokens[p] for p in places[first:stop]], row - first, w[first:stop]
                        for measure, value in values.items():
                            found.setdefault((layer, head), {}).setdefault(measure, []).append(
                                (value, index, place, *where)
                            )
            measured |= set(stretch)
    for per_measure in found.values():
        for measure, entries in per_measure.items():
            sign = 1 if measure == "entropy-low" else -1
            entries.sort(key=lambda entry: (sign * entry[0], entry[1], entry[2]))
    return found


def assert_matches(browse, expected, top_k, atol=1e-5):
    # atol: float32 models, whose batched (padded) calls round apart from one text alone by about 1e-6
    assert len(browse.heads) == len(expected)
    for (layer, head), per_measure in expected.items():
        got = browse.head(layer, head)
        for measure in MEASURES:
            want = per_measure[measure]
            top = got.top[measure]
            assert len(top) == min(top_k, len(want)), (layer, head, measure)
            for context, (score, document, position, pieces, query, weights) in zip(top, want, strict=False):
                where = (layer, head, measure)
                assert context.score == pytest.approx(score, abs=atol), where
                # a near tie may rank either way; otherwise the very context
                if not any(abs(other[0] - score) < atol and other[1:3] != (document, position) for other in want):
                    assert (context.document, context.position) == (document, position), where
                    assert context.pieces == pieces and context.query == query, where
                    assert context.weights == pytest.approx(weights, abs=atol), where
            values = [entry[0] for entry in want]
            histogram = got.histograms[measure]
            assert histogram.total == len(values)
            assert got.mean[measure] == pytest.approx(sum(values) / len(values), abs=atol)
            edges = histogram.edges
            inside = [
                sum(edges[b] <= v < edges[b + 1] or (b == len(edges) - 2 and v == edges[-1]) for v in values)
                for b in range(len(edges) - 1)
            ]
            # a value within rounding of an edge may fall either side of it
            assert sum(abs(a - b) for a, b in zip(histogram.counts, inside, strict=True)) <= 2 * sum(
                any(abs(v - edge) < atol for edge in edges) for v in values
            ), (layer, head, measure)


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()[0]


CORPUS = [*bundled_corpus()[:10], "the cat sat on the mat and the cat sat on the hat"]


def test_minilm_top_contexts_and_distributions_equal_a_brute_force_search(minilm):
    browse = browse_corpus(minilm, CORPUS, layers=[0, 3], top_k=5, context=3)
    assert browse.documents == len(CORPUS) and not browse.causal
    expected = brute_force(minilm, CORPUS, [0, 3], minilm.tokenizer.max_length, context=3)
    assert browse.queries == len(expected[(0, 0)]["output-norm"])
    assert_matches(browse, expected, top_k=5)
    # the repeated phrase: some head's top prefix-matching context sits in it
    assert any(head.top["prefix-matching"][0].document == len(CORPUS) - 1 for head in browse.heads)


def test_a_causal_gpt2_read_in_windows_equals_a_brute_force_search(tmp_path):
    model = load_text_model(hf_checkpoints.save("gpt2", tmp_path / "gpt2"))
    documents = [" ".join(["the bank was full of money and the river ran by it"] * 3), "a short one", "the end"]
    browse = browse_corpus(model, documents, top_k=4, context=2, window=12)
    assert browse.causal
    expected = brute_force(model, documents, [0, 1], 12, context=2)
    pieces = sum(len(model.tokenizer.batch([d], max_length=10**9).input_ids[0]) for d in documents)
    assert browse.queries == pieces  # GPT-2 has no special pieces: each piece measured once, in its first window
    assert_matches(browse, expected, top_k=4)


def test_the_measures_equal_attention_stats_on_a_window(minilm):
    """A window's entropy equals attention_stats' entropy, and its weight on the piece before is its distance-1
    band's but for the piece after."""
    text = CORPUS[-1]
    batch = minilm.tokenizer.batch([text], max_length=10**9)
    ids = batch.input_ids[0]
    with torch.no_grad(), capture(minilm, layers=[2], outputs=True, stats=True) as rec:
        minilm(ids[None])
    rows = list(range(1, len(ids) - 1))
    found = Window(0, ids, torch.arange(len(ids)), batch.pieces[0].tokens, 1, 1, rows)
    values = window_measures(found, rec.weights(2)[0].double(), rec.outputs(2)[0].double())
    stats = rec.stats(2)
    torch.testing.assert_close(
        values[:, MEASURES.index("entropy-high")], stats.entropy[0, :, rows].double(), atol=1e-5, rtol=0
    )
    # the distance-1 band holds both neighbours in an encoder: the piece before, and the one after the query
    after = rec.weights(2)[0, :, rows, [row + 1 for row in rows]].double()
    neighbours = values[:, MEASURES.index("previous-token")] + after
    torch.testing.assert_close(neighbours, stats.bands[0, :, rows, 1].double(), atol=1e-5, rtol=0)


def test_a_head_ablated_to_zero_shows_no_output(minilm):
    layer = minilm.attention_layers[1]
    layer.ablate_heads([4], how="zero")
    try:
        browse = browse_corpus(minilm, CORPUS[:4], layers=[1], top_k=2)
    finally:
        layer.restore_heads()
    ablated = browse.head(1, 4)
    assert ablated.top["output-norm"][0].score == 0.0 and ablated.mean["output-norm"] == 0.0
    assert ablated.histograms["output-norm"].below == browse.queries  # every norm below the first edge (1e-3)
    assert browse.head(1, 3).mean["output-norm"] > 0.1


def test_documents_stream_from_a_file_or_a_folder(tmp_path, minilm):
    lines = tmp_path / "corpus.txt"
    lines.write_text("The bank was full.\n\n   \nThe river ran by.\n", encoding="utf-8")
    assert list(read_documents(lines)) == ["The bank was full.", "The river ran by."]
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "b.txt").write_text("Second.", encoding="utf-8")
    (folder / "a.txt").write_text("First one.\nstill first.", encoding="utf-8")
    assert list(read_documents(folder)) == ["First one.\nstill first.", "Second."]
    seen = []
    browse = browse_corpus(
        minilm, read_documents(lines), layers=[0], progress=lambda done, total: seen.append((done, total))
    )
    assert browse.documents == 2 and seen == [(1, None), (2, None)]
    seen.clear()
    browse_corpus(minilm, ["One.", "Two."], layers=[0], progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 2), (2, 2)]


@pytest.mark.parametrize(
    "arguments, kind, fragment",
    [
        ({"documents": "one string"}, TypeError, "documents"),
        ({"documents": []}, ValueError, "at least one document"),
        ({"documents": ["fine", ""]}, ValueError, "document 1"),
        ({"top_k": 0}, ValueError, "top_k"),
        ({"context": -1}, ValueError, "context"),
        ({"window": 2}, ValueError, "window"),
        ({"layers": [9]}, ValueError, "layers"),
    ],
)
def test_bad_arguments_are_named(minilm, arguments, kind, fragment):
    call = {"documents": ["The bank was full."], **arguments}
    with pytest.raises((ValueError, TypeError), match=fragment) as raised:
        browse_corpus(minilm, call.pop("documents"), **call)
    assert is_input_error(raised.value, kind)


def test_a_missing_corpus_is_named(tmp_path):
    with pytest.raises(ValueError, match="corpus") as raised:
        list(read_documents(tmp_path / "nothing.txt"))
    assert is_input_error(raised.value, ValueError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="with none"):
        list(read_documents(tmp_path / "empty"))


def test_the_command_writes_what_python_gives(tmp_path, capsys, minilm):
    import json

    from multihead.cli import main

    source = tmp_path / "corpus.txt"
    source.write_text("\n".join(CORPUS[:6]) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    argv = ["inspect", "--browse", str(source), "--layers", "0,5", "--heads", "1,2", "--top-k", "3"]
    assert main([*argv, "--format", "terminal,json,html", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "max-off-sink: the mean over every query" in printed and "browse.json (" in printed
    expected = browse_corpus(minilm, CORPUS[:6], layers=[0, 5], heads=[1, 2], top_k=3).to_dict()
    written = json.loads((out / "browse.json").read_text())
    assert written == json.loads(json.dumps(expected))
    assert written["documents"] == 6 and [(h["layer"], h["head"]) for h in written["heads"]] == [
        (0, 1),
        (0, 2),
        (5, 1),
        (5, 2),
    ]
    page = (out / "browse.html").read_text(encoding="ascii")
    assert [f'id="L{h["layer"]}H{h["head"]}"' in page for h in written["heads"]] == [True] * 4  # a card each
    # each head's role, as inspect labels it from the bundled corpus, in its grid cell and on its card
    roles = head_roles(minilm, [0, 5], [1, 2])
    assert sorted(roles) == [(0, 1), (0, 2), (5, 1), (5, 2)]
    for (layer, head), role in roles.items():
        assert f'title="L{layer}H{head} ({role}): max-off-sink' in page
        assert f"<h2>layer {layer}, head {head}: {role}</h2>" in page
    best = written["heads"][0]["top"]["max-off-sink"][0]
    assert f"<<{best['pieces'][best['query']]}>>" in printed  # the terminal marks the query in its context


@pytest.mark.parametrize(
    "extra, option, fragment",
    [
        (["a text"], "--browse", "no text beside it"),
        (["--corpus"], "--browse", "no --corpus beside it"),
        (["--long", "x.txt"], "--browse", "no --long beside it"),
        (["--top-k", "0"], "--top-k", "a positive whole number, got 0"),
    ],
)
def test_the_commands_mistakes_are_one_line(extra, option, fragment, tmp_path, capsys):
    from test_cli_errors import assert_one_line

    source = tmp_path / "corpus.txt"
    source.write_text("The bank was full of money.\n", encoding="utf-8")
    argv = ["inspect", "--browse", str(source), "--out", str(tmp_path / "out"), *extra]
    assert_one_line(capsys, argv, "inspect", option, fragment)


@pytest.mark.parametrize("argv", [["inspect", "--top-k", "3"], ["inspect", "--long", "x.txt", "--top-k", "3"]])
def test_top_k_without_browse_is_refused(argv, capsys):
    from test_cli_errors import assert_one_line

    assert_one_line(capsys, argv, "inspect", "--top-k", "--browse beside it")


def test_a_missing_corpus_is_one_line(tmp_path, capsys):
    from test_cli_errors import assert_one_line

    assert_one_line(capsys, ["inspect", "--browse", str(tmp_path / "absent.txt")], "inspect", "--browse", "not found")


def test_the_sample_is_every_query_in_order_when_it_holds_them_all(minilm):
    browse = browse_corpus(minilm, CORPUS[:3], layers=[0], samples=10_000)
    expected = []
    for index, text in enumerate(CORPUS[:3]):
        batch = minilm.tokenizer.batch([text], max_length=10**9)
        tokens = batch.pieces[0].tokens
        expected += [(index, position, tokens[position]) for position in range(1, len(tokens) - 1)]
    assert browse.samples == expected and browse.queries == len(expected)
    assert browse_corpus(minilm, CORPUS[:3], layers=[0], samples=10_000).samples == expected  # seeded
    none = browse_corpus(minilm, CORPUS[:3], layers=[0], samples=0)
    assert none.samples == [] and none.heads[0].projections == {} and "projections" in none.to_dict()["heads"][0]


def test_the_projections_are_the_sampled_pieces_vectors_on_their_principal_axes(minilm):
    """A sample of 12 of the corpus's queries: each head's queries and keys there (captured from the document run
    alone) on their two principal axes, as numpy's SVD finds them (each axis up to its sign); values and outputs
    likewise."""
    import numpy

    browse = browse_corpus(minilm, CORPUS[:6], layers=[2], heads=[0, 7], samples=12)
    assert len(browse.samples) == 12 and len(set(browse.samples)) == 12
    vectors = {name: [] for name in ("q", "k", "v", "outputs")}
    for document, position, piece in browse.samples:
        batch = minilm.tokenizer.batch([CORPUS[document]], max_length=10**9)
        assert batch.pieces[0].tokens[position] == piece
        with torch.no_grad(), capture(minilm, layers=[2], heads=[0, 7], qkv=True, outputs=True) as rec:
            minilm(batch.input_ids)
        for name in vectors:
            vectors[name].append(getattr(rec, name)(2)[0, :, position].double())
    for column, head in enumerate(browse.heads):
        spaces = {
            "queries and keys": torch.cat([torch.stack(vectors["q"])[:, column], torch.stack(vectors["k"])[:, column]]),
            "values": torch.stack(vectors["v"])[:, column],
            "outputs": torch.stack(vectors["outputs"])[:, column],
        }
        for name, points in spaces.items():
            centred = (points - points.mean(0)).numpy()
            _, _, vh = numpy.linalg.svd(centred, full_matrices=False)
            want = torch.from_numpy(centred @ vh[:2].T)
            got = head.projections[name]
            assert got.shape == want.shape, name
            for axis in range(2):
                sign = 1.0 if (got[:, axis] * want[:, axis]).sum() >= 0 else -1.0
                torch.testing.assert_close(got[:, axis], sign * want[:, axis], atol=2e-4, rtol=0, msg=name)


def test_the_browser_page_opens_offline_with_every_card_and_works_with_scripts_off(minilm, browser, tmp_path):  # noqa: F811
    """browse.html in Debian's chromium: a card per head, each with every measure's top contexts (the query
    outlined, its title its weight, as browse_corpus kept them) and its projections; the grid's cells link to the
    cards; the script shows one card at a time and switches the grid's measure; with scripts off every card is
    there. Nothing is fetched but the file itself, and no error is logged."""
    browse = browse_corpus(minilm, CORPUS[:5], layers=[0, 4], heads=[0, 3, 9], top_k=3, samples=20)
    html = render_browser(browse)
    assert html.isascii()
    with page_opener(browser, tmp_path) as open_:
        page = open_(html)
        ids = page.locator("section.head").evaluate_all("cards => cards.map(card => card.id)")
        assert ids == ["L0H0", "L0H3", "L0H9", "L4H0", "L4H3", "L4H9"]
        assert page.locator("section.head:not([hidden])").count() == 1  # the script shows one
        links = page.locator(f'div.grid[data-measure="{MAIN_MEASURE}"] td a')
        assert links.count() == 6
        links.nth(4).click()
        visible = page.locator("section.head:not([hidden])")
        assert visible.count() == 1 and visible.get_attribute("id") == "L4H3"
        card = browse.head(4, 3)
        for measure in MEASURES:
            rows = visible.locator(f'div.measure[data-measure="{measure}"] ol.contexts li')
            assert rows.count() == len(card.top[measure]) == 3
            first = card.top[measure][0]
            query = rows.nth(0).locator("span.piece.query")
            assert query.count() == 1 and query.text_content() == first.pieces[first.query]
            assert query.get_attribute("title") == f"weight {first.weights[first.query]:.3f}"
        plots = visible.locator(".plots svg")
        assert plots.count() == 3
        assert plots.nth(0).locator("rect").count() == 20 and plots.nth(0).locator("circle").count() == 20
        page.select_option("#measure", "previous-token")
        shown = page.locator("div.grid:not([hidden])")
        assert shown.count() == 1 and shown.get_attribute("data-measure") == "previous-token"
    context = browser.new_context(java_script_enabled=False)
    try:
        path = tmp_path / "static.html"
        path.write_text(html, encoding="ascii")
        static = context.new_page()
        static.goto(path.as_uri())
        assert static.locator("section.head:not([hidden])").count() == 6  # every card, no script
        assert static.locator("#pick").is_hidden()  # the measure menu needs the script
    finally:
        context.close()


def test_a_batch_stops_short_of_the_weight_budget_with_the_same_results(minilm, monkeypatch):
    """With a budget below one window's weights, every window runs alone: the same measures (to float32's rounding
    of padded and unpadded calls), the same sample."""
    import multihead.lab.inspect.browse as browse_module

    batched = browse_corpus(minilm, CORPUS[:6], layers=[1], top_k=3, samples=8)
    calls = []
    real_flush = browse_module._WindowReader.flush

    def counted(self):
        calls.append(len(self.pending))
        return real_flush(self)

    monkeypatch.setattr(browse_module, "WEIGHT_BUDGET", 1)
    monkeypatch.setattr(browse_module._WindowReader, "flush", counted)
    alone = browse_corpus(minilm, CORPUS[:6], layers=[1], top_k=3, samples=8)
    assert max(calls) == 1 and alone.samples == batched.samples and alone.queries == batched.queries
    for one, other in zip(alone.heads, batched.heads, strict=True):
        for measure in MEASURES:
            assert [c.score for c in one.top[measure]] == pytest.approx([c.score for c in other.top[measure]], abs=1e-5)
