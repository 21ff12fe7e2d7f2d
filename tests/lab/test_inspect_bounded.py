"""Reports of long texts stay bounded (issue 31, rows 3 and 12): a 512-token text on MiniLM writes a few MB of
HTML and JSON (weights compact past DENSE_WEIGHTS_LIMIT), prints each file's size, runs under a 6 GB address
space, and its header shows the part analysed and what truncation cut."""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys

import pytest
import torch

from multihead import cli
from multihead.lab.inspect import inspect_text, similarity
from multihead.lab.inspect import inspection as inspection_module
from multihead.lab.inspect.html import render_fragment
from multihead.lab.inspect.inspection import compact_weights, weights_from_dict
from multihead.lab.models import load_minilm
from support_inspect import synthetic_inspection
from test_inspect_html import browser  # noqa: F401 (the fixture: Debian's chromium, once per module)

MB = 1_000_000


def long_text(words: int = 700) -> str:
    """A text of ``words`` words drawn from the bundled corpus: over MiniLM's 512 positions."""
    rng = random.Random(0)
    vocabulary = " ".join(inspection_module.bundled_corpus()).split()
    return " ".join(rng.choice(vocabulary) for _ in range(words))


@pytest.fixture(scope="module")
def long_inspection():
    model, _ = load_minilm()
    return inspect_text(model, long_text(), truncate=True)


def test_a_512_token_report_is_a_few_mb_with_its_size_printed(tmp_path, capsys, long_inspection):
    text = long_text()
    assert cli.main(["inspect", text, "--truncate", "--format", "html,json", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    html, data = tmp_path / "report.html", tmp_path / "inspect.json"
    assert html.stat().st_size < 10 * MB and data.stat().st_size < 10 * MB  # were 152 and 266 MB
    for path in (html, data):
        size = cli.format_bytes(path.stat().st_size)
        assert f"{path.resolve()} ({size})" in printed
    assert "note: report.html is" not in printed
    report = json.loads(data.read_text())
    weights = weights_from_dict(report["weights"])
    assert weights.shape == (6, 12, 512, 512)
    assert (weights - long_inspection.weights).abs().max() <= 1 / 510 + 1e-6  # a byte each: to within 1/510
    assert report["weights"]["encoding"] == inspection_module.COMPACT_WEIGHTS


def test_the_header_shows_the_part_analysed_and_the_cut(long_inspection):
    text = long_text()
    assert len(long_inspection.tokens) == 512 and long_inspection.truncated_from > 512
    assert text.startswith(long_inspection.text) and len(long_inspection.text) < len(text)
    last_word = long_inspection.words[0].words[-1]  # the last word read: the text shown ends with it
    assert long_inspection.text.endswith(last_word)
    note = f"truncated to 512 tokens of {long_inspection.truncated_from}: the text shown is the part analysed"
    assert note in long_inspection.notes and long_inspection.to_dict()["text"] == long_inspection.text
    model, _ = load_minilm()
    whole = inspect_text(model, "The bank was full of money.", layers=[0])
    assert whole.truncated_from is None and not any("truncated" in line for line in whole.notes)


def test_a_page_over_the_size_note_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli.inspect, "HTML_SIZE_NOTE", 1000)
    assert cli.main(["inspect", "--format", "html", "--layers", "0", "--out", str(tmp_path)]) == 0
    assert "note: report.html is" in capsys.readouterr().out


def test_the_inspection_runs_under_a_6_gb_address_space(tmp_path):
    """It crashed there: all 2,556 pairs of heads' mixtures at once took 2.7 GB (now in chunks)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    corpus = tmp_path / "corpus.txt"  # a 5,000-word line among short ones: the batch is padded to 512 pieces
    corpus.write_text("\n".join([long_text(5000), *inspection_module.bundled_corpus()[:5]]), encoding="utf-8")
    command = [sys.executable, "-m", "multihead.cli", "inspect", "--truncate", "--format", "json"]
    for extra in ([long_text()], ["--corpus", str(corpus)]):
        result = subprocess.run(
            [*command, *extra, "--out", str(tmp_path / "out")],
            preexec_fn=limit,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]


def test_pairs_in_chunks_give_the_divergence_of_all_pairs_at_once(monkeypatch):
    torch.manual_seed(0)
    weights = torch.softmax(torch.randn(2, 5, 7, 9), dim=-1)
    real_queries, real_keys = torch.ones(2, 7, dtype=torch.bool), torch.ones(2, 9, dtype=torch.bool)
    real_keys[1, 6:] = False
    results = []
    for chunk_bytes in (1 << 40, 1):  # every pair in one step; one pair a step
        monkeypatch.setattr(similarity, "PAIR_CHUNK_BYTES", chunk_bytes)
        accumulator = similarity.DivergenceAccumulator(5)
        accumulator.add(weights, real_queries, real_keys)
        results.append(accumulator.result())
    torch.testing.assert_close(results[0], results[1])


def test_compact_weights_read_back_within_a_byte_and_keep_pruned_cells_empty():
    weights = torch.rand(2, 3, 4, 5)
    weights = weights / weights.sum(-1, keepdim=True)
    present = torch.tensor([[True, False, True], [True, True, True]])
    back = weights_from_dict(json.loads(json.dumps(compact_weights(weights, present))))
    assert (back - weights).abs().max() <= 1 / 510 + 1e-6
    with pytest.raises(ValueError, match="weights: expected nested lists or the encoding"):
        weights_from_dict({"encoding": "float16"})


def test_a_page_of_compact_weights_draws_as_a_page_of_lists(browser, monkeypatch):  # noqa: F811 (the fixture)
    inspection = synthetic_inspection()
    drawn = []
    for limit in (1 << 30, 0):  # lists; compact
        monkeypatch.setattr(inspection_module, "DENSE_WEIGHTS_LIMIT", limit)
        fragment = render_fragment(inspection)
        assert ('"encoding"' in fragment) == (limit == 0)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        errors = []
        page.on("pageerror", lambda error: errors.append(str(error)))  # noqa: B023 (read before the next page)
        try:
            page.set_content(f"<!DOCTYPE html><html><body>{fragment}</body></html>")
            report = page.locator(".mh-report")
            report.locator("#attention-bars .weight-row").first.wait_for()
            keys = report.locator("#attention-bars .weight-row").evaluate_all(
                "rows => rows.map(row => row.dataset.key)"
            )
            drawn.append((keys[0], sorted(keys), report.locator("#head-summary").text_content()))
        finally:
            page.close()
        assert not errors, errors
    assert drawn[0] == drawn[1]
