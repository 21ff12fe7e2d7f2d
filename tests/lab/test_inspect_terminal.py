"""multihead.lab.inspect.terminal: the rich view of an Inspection (role grid, where the token attends, strongest links),
fitted to the console's width in one orientation (rows heads, columns layers); golden snapshots at 80 and 120
columns (regenerate them with MULTIHEAD_UPDATE_SNAPSHOTS=1)."""

from __future__ import annotations

import dataclasses
import fcntl
import io
import os
import re
import struct
import termios
from pathlib import Path

import pytest
import torch
from rich.console import Console

from multihead.lab.inspect.inspection import Inspection
from multihead.lab.inspect.stats import weight_stats
from multihead.lab.inspect.terminal import (
    MIN_TOKEN_CHARS,
    MIN_WIDTH,
    PIPED_WIDTH,
    attention_table,
    attention_tables,
    make_console,
    near_duplicates_line,
    print_inspection,
    report_width,
    role_grid,
    role_grids,
    strongest_links,
)
from support_inspect import HEADS, LAYERS, TOKENS, synthetic_inspection

SNAPSHOTS = Path(__file__).parents[1] / "snapshots"
UPDATE = os.environ.get("MULTIHEAD_UPDATE_SNAPSHOTS") == "1"


def rendered(renderable, width: int = 100) -> list[str]:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def printed(inspection: Inspection, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    print_inspection(inspection, console)
    return console.export_text()


def joined(lines: list[str]) -> str:
    """The lines as one text, with wrapped titles joined again."""
    return " ".join(" ".join(lines).split())


# --------------------------------------------------------------------------- a 6 x 12 inspection for snapshots

GRID_TOKENS = ["[CLS]", "the", "river", "##bank", "was", "full", "of", "money", "and", "mud", ".", "[SEP]"]


def grid_inspection(layers: int = 6, heads: int = 12, tokens: list[str] | None = None) -> Inspection:
    """A deterministic inspection of ``layers`` x ``heads`` (MiniLM's shape by default), no model run: heads cycle
    through a previous-token head, a [CLS] sink, a next-token head, a period head and a [SEP] sink, each mixed
    with seeded noise in a share from 0.3 (a weak, low-confidence label) to 0.95, so the grid shows several
    roles and confidences, and the token table several pieces and weights."""
    tokens = GRID_TOKENS if tokens is None else tokens
    n = len(tokens)
    generator = torch.Generator().manual_seed(13)
    noise = (2.0 * torch.randn(layers, heads, n, n, generator=generator, dtype=torch.float64)).softmax(-1)
    eye = torch.eye(n, dtype=torch.float64)

    def sink(key: int) -> torch.Tensor:  # every query's weight on one key
        return torch.zeros(n, n, dtype=torch.float64).index_fill_(1, torch.tensor([key]), 1.0)

    patterns = [
        eye.roll(-1, dims=1),  # row i -> key i - 1 (row 0 -> the last)
        sink(0),  # [CLS]
        eye.roll(1, dims=1),  # row i -> key i + 1
        sink(tokens.index(".")),
        sink(n - 1),  # [SEP]
    ]
    weights = noise.clone()  # (layers, heads, i, j)
    for layer in range(layers):
        for head in range(heads):
            pattern = patterns[(layer * heads + head) % len(patterns)]
            share = 0.3 + 0.65 * ((layer + head) % 4) / 3  # 0.3 .. 0.95 of the row on the pattern
            weights[layer, head] = share * pattern + (1 - share) * noise[layer, head]
    weights = weights.float()
    layer_ids, head_ids = list(range(layers)), list(range(heads))
    stats = weight_stats(
        [weights[row][None] for row in range(layers)], [tokens], layers=layer_ids, heads=head_ids, source="this text"
    )
    return Inspection(
        model_name="grid-6x12",
        text="The riverbank was full of money and mud.",
        tokens=list(tokens),
        layers=layer_ids,
        heads=head_ids,
        weights=weights,
        stats=stats,
        role_stats=stats,
        corpus=None,
        token=tokens.index("money"),
    )


def tables_in(text: str) -> list[tuple[list[int], list[int]]]:
    """(layers in the header, heads in the rows) of every table of a rendered report."""
    found: list[tuple[list[int], list[int]]] = []
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["head"] and "layer" in words:
            found.append(([int(n) for n in re.findall(r"layer (\d+)", line)], []))
        elif found and words and re.fullmatch(r"h\d+", words[0]):
            found[-1][1].append(int(words[0][1:]))
    return found


def assert_fits(text: str, width: int) -> None:
    lines = text.splitlines()
    too_wide = [line for line in lines if len(line) > width]
    assert not too_wide, too_wide
    assert "…" not in text  # rich's ellipsis: nothing was cut to fit


def assert_every_table_whole(text: str, layers: list[int], heads: list[int], tables: int = 2) -> None:
    """``tables`` tables (role grid and token table), each with all ``layers`` as columns and ``heads`` as rows."""
    found = tables_in(text)
    assert len(found) == tables, found
    for table_layers, table_heads in found:
        assert table_layers == layers and table_heads == heads


@pytest.mark.parametrize("width", [80, 120])
def test_the_report_matches_its_snapshot(width):
    text = printed(grid_inspection(), width)
    assert_fits(text, width)
    assert_every_table_whole(text, list(range(6)), list(range(12)))
    text = "".join(line.rstrip() + "\n" for line in text.splitlines())  # rich pads table rows with blanks
    path = SNAPSHOTS / f"inspect_terminal_{width}.txt"
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"the report at {width} columns changed; MULTIHEAD_UPDATE_SNAPSHOTS=1 updates it"


def test_the_snapshots_differ_where_the_width_does():
    """At 120 columns "##bank" is whole; at 80 the token table shortens it to fit six layers."""
    narrow, wide = (printed(grid_inspection(), width) for width in (80, 120))
    token_table = narrow.split("Where 'money'")[1]
    assert "##ba~" in token_table and "##bank" not in token_table
    assert "##bank" in wide.split("Where 'money'")[1] and "~" not in wide


@pytest.mark.parametrize("width", [80, 81, 95, 100, 120, 200])
def test_every_width_from_80_fits_with_all_layers_and_heads(width):
    text = printed(grid_inspection(), width)
    assert_fits(text, width)
    assert_every_table_whole(text, list(range(6)), list(range(12)))


@pytest.mark.parametrize("width", [80, 100, 260])
def test_twelve_layers_are_split_into_groups_that_fit(width):
    """BERT-base's 12 layers do not fit 80 columns side by side: neighbouring layers make a table each, every
    table has all heads, and together they have every layer once; a wide enough console takes them all at once."""
    text = printed(grid_inspection(layers=12), width)
    assert_fits(text, width)
    found = tables_in(text)
    roles, tokens = text.split("Where 'money'")
    for part in (roles, tokens):
        part_tables = tables_in(part)
        assert [layer for layers, _ in part_tables for layer in layers] == list(range(12))
        assert all(heads == list(range(12)) for _, heads in part_tables)
    assert len(found) > 2 if width < 260 else len(found) == 2  # split at 80 and 100, one table each at 260


def test_a_narrow_console_gets_fewer_layers_per_table_and_nothing_cut():
    text = printed(grid_inspection(heads=2), MIN_WIDTH)
    assert_fits(text, MIN_WIDTH)
    for part in text.split("Where 'money'"):
        found = tables_in(part)
        assert len(found) > 1 and [layer for layers, _ in found for layer in layers] == list(range(6))


def test_minilm_at_80_columns_fits_with_every_layer_and_head(minilm_inspection):
    text = printed(minilm_inspection, 80)
    assert_fits(text, 80)
    assert_every_table_whole(text, list(range(6)), list(range(12)))
    assert re.search(r"\b\d{1,3}%", text.split("Where 'bank'")[1])  # percentages, whole


@pytest.fixture(scope="module")
def minilm_inspection():
    from multihead.lab.inspect.inspection import inspect_text
    from multihead.lab.models import load_minilm

    model, _ = load_minilm()
    return inspect_text(model, "The bank was full of money.")


# --------------------------------------------------------------------------- the tables


def grid_rows(lines: list[str]) -> list[list[str]]:
    """The rows of a rendered role grid, split into cells (cells are two or more blanks apart; a label and its
    strength one)."""
    return [
        re.split(r"\s{2,}", line.strip()) for line in lines if line.split() and re.fullmatch(r"h\d+", line.split()[0])
    ]


def cell(role) -> str:
    """What the grid shows of a role: its label and strength, and "?" when the label is a low-confidence guess."""
    return f"{role.label} {role.strength:.0%}" + ("?" if role.confidence == "low" else "")


def test_role_grid_has_a_row_per_head_and_a_label_with_its_strength_per_layer():
    inspection = synthetic_inspection()
    lines = rendered(role_grid(inspection))
    header = next(line for line in lines if line.lstrip().startswith("head "))
    assert header.split() == ["head", *(word for layer in LAYERS for word in ("layer", str(layer)))]
    roles = inspection.role_stats.roles()
    expected = [[f"h{head}", *(cell(roles[r][c]) for r in range(len(LAYERS)))] for c, head in enumerate(HEADS)]
    assert grid_rows(lines) == expected
    assert grid_rows(lines)[0][1] == "prev 100%"  # the synthetic previous-token head: every token
    assert grid_rows(lines)[2][2] == "[CLS] 100%"  # the synthetic [CLS] head: all its weight


def test_role_grid_of_some_layers():
    inspection = synthetic_inspection()
    roles = inspection.role_stats.roles()
    expected = [[f"h{head}", cell(roles[1][c])] for c, head in enumerate(HEADS)]
    assert grid_rows(rendered(role_grid(inspection, [5]))) == expected


def test_low_confidence_labels_end_in_a_question_mark():
    roles = grid_inspection().role_stats.roles()
    confidences = {role.confidence for row in roles for role in row}
    assert "low" in confidences and confidences - {"low"}  # the snapshot inspection has both kinds
    text = "\n".join(rendered(role_grid(grid_inspection()), 200))
    for row in roles:
        for role in row:
            assert cell(role) in text
    assert text.count("?") == sum(role.confidence == "low" for row in roles for role in row)


def test_attention_table_shows_each_heads_top_keys_of_the_selected_token():
    inspection = synthetic_inspection(token=4)  # "full"
    lines = rendered(attention_table(inspection, top=2))
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


def test_long_word_pieces_are_shortened_only_as_much_as_the_width_needs():
    tokens = ["[CLS]", "antidisestablishment", "bank", "[SEP]"]
    inspection = synthetic_inspection(tokens=tokens, text="antidisestablishment bank", token=2)
    assert "antidisesta~" in "\n".join(rendered(attention_table(inspection)))  # 12 characters at most
    assert "antidi~" in "\n".join(rendered(attention_table(inspection, token_chars=7)))
    narrow = attention_tables(grid_inspection(tokens=[*GRID_TOKENS[:-1], "antidisestablishment", "[SEP]"]), 80)
    assert len(narrow) == 1  # shortened to fit six layers in 80 columns, down to MIN_TOKEN_CHARS
    text = "\n".join(rendered(narrow[0], 80))
    assert "antidisestablishment" not in text and max(map(len, text.splitlines())) <= 80
    shortened = re.findall(r"anti\S*~", text)
    assert shortened and all(MIN_TOKEN_CHARS <= len(piece) < 12 for piece in shortened)


def test_role_grids_and_attention_tables_page_only_when_needed():
    inspection = grid_inspection(layers=12)
    assert len(role_grids(inspection, 300)) == 1 and len(attention_tables(inspection, 300)) == 1
    assert len(role_grids(inspection, 80)) == 2
    paged = attention_tables(inspection, 80)
    assert len(paged) >= 2 and all(max(map(len, rendered(table, 500))) <= 80 for table in paged)


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


def test_print_inspection_header_roles_and_links():
    inspection = synthetic_inspection(corpus=True)
    text = printed(inspection, 100)
    lines = text.splitlines()
    assert lines[0] == "all-MiniLM-L6-v2: 2 layers x 3 heads on 9 tokens"
    assert lines[1] == " ".join(TOKENS)
    assert max(len(line) for line in lines) <= 100
    assert "Head roles (from bundled corpus (150 sentences))" in text  # roles from the corpus
    assert "Where 'bank' (token 2) attends: top 2 per head" in text
    assert "Strongest links from 'bank' to another word: the 100% (L2 H0)" in text


def test_print_inspection_defaults_to_stdout_at_the_report_width(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    print_inspection(grid_inspection())
    out = capsys.readouterr().out
    assert out.startswith("grid-6x12: 6 layers x 12 heads")
    assert_fits(out, 80)
    assert_every_table_whole(out, list(range(6)), list(range(12)))


# --------------------------------------------------------------------------- the width


class Piped(io.StringIO):
    def isatty(self) -> bool:
        return False


@pytest.fixture
def terminal():
    """A pseudo-terminal of 132 x 40 (its writing end, as a file)."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 132, 0, 0))
    stream = os.fdopen(follower, "w")
    yield stream
    stream.close()
    os.close(leader)


def test_a_terminal_gets_its_own_width_even_beyond_100(terminal):
    assert report_width(terminal, environ={}) == 132
    assert report_width(terminal, environ={"COLUMNS": "90"}) == 132  # the terminal knows best


def test_piped_output_is_100_columns_or_columns(terminal):
    assert report_width(Piped(), environ={}, others=[]) == PIPED_WIDTH
    assert report_width(Piped(), environ={"COLUMNS": "120"}, others=[]) == 120
    for junk in ("", "wide", "-5", "0", "999999"):
        assert report_width(Piped(), environ={"COLUMNS": junk}, others=[]) == PIPED_WIDTH
    assert report_width(Piped(), environ={"COLUMNS": "10"}, others=[]) == MIN_WIDTH


def test_piped_output_is_never_wider_than_the_users_terminal(terminal):
    """`multihead inspect | less` in a 132-column terminal: COLUMNS=200 is cut to 132, the default 100 kept."""
    assert report_width(Piped(), environ={"COLUMNS": "200"}, others=[terminal]) == 132
    assert report_width(Piped(), environ={}, others=[Piped(), terminal]) == PIPED_WIDTH


def test_make_console_uses_the_report_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "87")
    monkeypatch.setattr("sys.stdout", Piped())
    monkeypatch.setattr("sys.stderr", Piped())
    monkeypatch.setattr("sys.stdin", Piped())
    assert make_console().width == 87


def test_the_near_duplicate_heads_are_named_closest_first():
    inspection = grid_inspection()
    pairs = inspection.similarity.near_duplicates()
    line = near_duplicates_line(inspection, shown=3)
    (a, b, divergence), *_ = pairs
    assert line.startswith("Near-duplicate heads (under 0.05 bits apart on this text): ")
    assert f"L{a[0]}H{a[1]} & L{b[0]}H{b[1]} ({divergence:.3f})" in line
    assert line.endswith(f"and {len(pairs) - 3} more pairs")
    distinct = dataclasses.replace(inspection.similarity, threshold=0.0)  # no pair is under 0 bits: the line says so
    apart = dataclasses.replace(inspection, role_stats=dataclasses.replace(inspection.role_stats, similarity=distinct))
    assert near_duplicates_line(apart).endswith(": none")
