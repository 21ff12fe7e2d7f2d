"""multihead.inspect.terminal: the rich view of an Inspection (role grid, where the token attends, strongest links)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from multihead.inspect.terminal import (
    MAX_WIDTH,
    attention_table,
    make_console,
    print_inspection,
    role_grid,
    strongest_links,
)
from support_inspect import HEADS, LAYERS, TOKENS, synthetic_inspection


def rendered(renderable, width: int = MAX_WIDTH) -> list[str]:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def joined(lines: list[str]) -> str:
    """The lines as one text, with wrapped titles joined again."""
    return " ".join(" ".join(lines).split())


def test_role_grid_has_a_row_per_layer_and_a_label_per_head():
    inspection = synthetic_inspection()
    lines = rendered(role_grid(inspection))
    assert "Head roles (from this text)" in joined(lines)
    header = next(line for line in lines if line.lstrip().startswith("L "))
    assert header.split() == ["L", *(f"h{head}" for head in HEADS)]
    rows = [line.split() for line in lines if line.split() and line.split()[0] in map(str, LAYERS)]
    roles = inspection.role_stats.roles()
    assert rows == [[str(layer), *(role.label for role in roles[r])] for r, layer in enumerate(LAYERS)]
    assert rows[0][1] == "prev" and rows[1][3] == "[CLS]"  # the synthetic previous-token and [CLS] heads


def test_attention_table_shows_each_heads_top_keys_of_the_selected_token():
    inspection = synthetic_inspection(token=4)  # "full"
    lines = rendered(attention_table(inspection, top=2))
    assert "Where 'full' (token 4) attends: top 2 per head" in joined(lines)
    body = lines[lines.index(next(line for line in lines if line.lstrip().startswith("head"))) + 2 :]
    assert len(body) == 2 * len(HEADS)  # two lines per head
    for h, head in enumerate(HEADS):
        for k in range(2):
            cells = body[2 * h + k].split()
            if k == 0:
                assert cells.pop(0) == f"h{head}"
            for layer, (piece, percent) in zip(LAYERS, zip(cells[::2], cells[1::2], strict=True), strict=True):
                expected_piece, _, weight = inspection.top_attended(layer, head, k=2)[k]
                assert (piece, percent) == (expected_piece, f"{weight:.0%}")


def test_long_word_pieces_are_shortened_to_fit():
    tokens = ["[CLS]", "antidisestablishment", "bank", "[SEP]"]
    inspection = synthetic_inspection(tokens=tokens, text="antidisestablishment bank", token=2)
    text = "\n".join(rendered(attention_table(inspection)))
    assert "antidis~" in text and "antidisestablishment" not in text


def test_strongest_links_skip_the_token_itself_and_the_special_tokens():
    inspection = synthetic_inspection()
    links = strongest_links(inspection, count=4)
    assert len(links) == 4
    assert links == sorted(links, key=lambda link: -link[3])
    assert links[0][:3] == (2, 0, "the") and links[0][3] == pytest.approx(1.0)  # the previous-token head
    for layer, head, piece, weight in links:
        row = inspection.head_weights(layer, head)[inspection.token]
        others = [j for j, p in enumerate(TOKENS) if j != inspection.token and p not in ("[CLS]", "[SEP]")]
        assert weight == pytest.approx(max(float(row[j]) for j in others))
        assert piece in {TOKENS[j] for j in others if float(row[j]) == pytest.approx(weight)}
    assert all(piece not in ("[CLS]", "[SEP]", "bank") for _, _, piece, _ in strongest_links(inspection, count=99))


def test_print_inspection_fits_100_columns():
    inspection = synthetic_inspection(corpus=True)
    console = Console(width=MAX_WIDTH, file=io.StringIO(), record=True, color_system=None)
    print_inspection(inspection, console)
    text = console.export_text()
    lines = text.splitlines()
    assert lines[0] == "all-MiniLM-L6-v2: 2 layers x 3 heads on 9 tokens"
    assert lines[1] == " ".join(TOKENS)
    assert max(len(line) for line in lines) <= MAX_WIDTH
    assert "bundled corpus" in text  # roles from the corpus
    assert "Strongest links from 'bank' to another word: the 100% (L2 H0)" in text


def test_print_inspection_defaults_to_stdout(capsys):
    print_inspection(synthetic_inspection())
    out = capsys.readouterr().out
    assert out.startswith("all-MiniLM-L6-v2: 2 layers x 3 heads") and max(map(len, out.splitlines())) <= MAX_WIDTH


def test_make_console_is_at_most_100_columns_wide():
    assert make_console().width <= MAX_WIDTH
