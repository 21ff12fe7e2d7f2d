"""multihead.lab.inspect.inspect_long: a text longer than the model's positions, read in sliding windows, each head's
profile equal to the same means of the weights the model applies in those windows (captured whole here, written
out in the test), on MiniLM and a transformers GPT-2 (causal)."""

from __future__ import annotations

import math

import pytest
import torch

import hf_checkpoints
from multihead.capture import capture
from multihead.integrations import load_text_model
from multihead.lab.inspect import bundled_corpus, inspect_long
from multihead.lab.inspect.colours import MASKED_RGB, weight_rgb_pixels
from multihead.lab.inspect.long import LONG_ROLES, HeadProfile, windows_of
from multihead.lab.models import load_minilm
from multihead.streamed_stats import DISTANCE_BANDS
from support import is_input_error
from test_inspect_page import parsed, png_pixels


def test_windows_slide_by_half_and_cover_the_body():
    assert windows_of(10, 4) == [(0, 4), (2, 6), (4, 8), (6, 10)]
    assert windows_of(11, 4) == [(0, 4), (2, 6), (4, 8), (6, 10), (7, 11)]  # the last one ends at the end
    assert windows_of(3, 4) == [(0, 3)]
    for body, size in [(100, 7), (513, 510), (2522, 510)]:
        stretches = windows_of(body, size)
        assert all(stop - start == size for start, stop in stretches)
        assert stretches[0][0] == 0 and stretches[-1][1] == body
        assert all(b[0] <= a[1] for a, b in zip(stretches, stretches[1:], strict=False))  # no piece left out


def expected_profiles(model, ids, lead: int, trail: int, size: int, layers: list[int], cell: int, causal: bool) -> dict:
    """Per (layer, head): the mean bands, first-piece weight and entropy over the pieces each window measures,
    the shares each piece receives, and the text's weights (each from the window that measures its query; 0 where
    no window holds the pair) max- and mean-pooled over cells of ``cell`` pieces, from the whole weights of each
    window; and the cells some window holds a pair of ("reachable"; causal: the piece at or before the query)."""
    body = len(ids) - lead - trail
    stretches = windows_of(body, size - lead - trail)
    measured: set[int] = set()
    sums: dict = {}
    text = torch.zeros(len(ids), len(ids), dtype=torch.float64)  # one head's weights over the text, refilled
    seen = torch.zeros(len(ids), len(ids), dtype=torch.bool)
    for index, (start, stop) in enumerate(stretches):
        window = torch.cat([ids[:lead], ids[lead + start : lead + stop], ids[len(ids) - trail :]])
        # the window's rows: leading specials (first window only), new body pieces, trailing specials (last only)
        rows = [r for r in range(lead) if index == 0]
        rows += [lead + p - start for p in range(start, stop) if p not in measured]
        measured.update(range(start, stop))
        rows += [lead + stop - start + t for t in range(trail) if index == len(stretches) - 1]
        places = [*range(lead), *(lead + p for p in range(start, stop)), *(len(ids) - trail + t for t in range(trail))]
        with torch.no_grad(), capture(model, layers=layers) as rec:
            model(window[None])
        n = len(window)
        where = torch.tensor(places)
        visible = torch.ones(n, n, dtype=torch.bool)
        seen[where[rows, None], where[None, :]] |= (visible.tril() if causal else visible)[rows]
        distance = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs()
        for layer in layers:
            weights = rec.weights(layer)[0].double()  # (heads, n, n)
            for head in range(weights.shape[0]):
                w = weights[head][rows]
                bands = []
                for low, high in zip(DISTANCE_BANDS, [*DISTANCE_BANDS[1:], math.inf], strict=True):
                    bands.append((w * ((distance[rows] >= low) & (distance[rows] < high))).sum(-1))
                entropy = -(w * torch.where(w > 0, w.log(), torch.zeros_like(w))).sum(-1)
                entry = sums.setdefault(
                    (layer, head),
                    {
                        "bands": [],
                        "sink": [],
                        "entropy": [],
                        "received": torch.zeros(len(ids)),
                        "text": text.clone(),
                        "heavy": 0.0,
                    },
                )
                entry["text"][where[rows, None], where[None, :]] = w
                entry["received"][places] += w.sum(0).float()  # the window's columns, from its measured rows
                entry["heavy"] += float(w.sum(0)[lead : n - trail].topk(8).values.sum())
                entry["bands"].append(torch.stack(bands, -1))
                entry["sink"].append(w[:, 0])
                entry["entropy"].append(entropy)
    assert measured == set(range(body))

    def pooled(matrix: torch.Tensor, reduce: str) -> torch.Tensor:
        side = -(-len(ids) // cell)
        cells = torch.zeros(side, side, dtype=matrix.dtype)
        for r in range(side):
            for c in range(side):
                block = matrix[r * cell : (r + 1) * cell, c * cell : (c + 1) * cell]
                cells[r, c] = block.amax() if reduce == "max" else block.double().mean()
        return cells

    reachable = pooled(seen, "max").bool()
    return {
        key: {
            "bands": torch.cat(v["bands"]).mean(0),
            "sink": float(torch.cat(v["sink"]).mean()),
            "entropy": float(torch.cat(v["entropy"]).mean()),
            "count": len(torch.cat(v["sink"])),
            "shares": v["received"] / len(ids),
            "heavy_share": v["heavy"] / len(ids),
            "maps": {"max": pooled(v["text"], "max"), "mean": pooled(v["text"], "mean")},
            "reachable": reachable,
        }
        for key, v in sums.items()
    }


def assert_profiles(found, expected, atol):
    assert [(p.layer, p.head) for p in found.heads] == sorted(expected)
    for profile in found.heads:
        want = expected[(profile.layer, profile.head)]
        torch.testing.assert_close(torch.tensor(profile.bands, dtype=torch.float64), want["bands"], rtol=0, atol=atol)
        assert profile.sink == pytest.approx(want["sink"], abs=atol)
        assert profile.entropy == pytest.approx(want["entropy"], abs=atol * 10)
        top = want["shares"].topk(len(profile.heavy_hitters))
        assert [h["share"] for h in profile.heavy_hitters] == pytest.approx(top.values.tolist(), abs=atol)
        # each named piece holds the share given (a near tie may order two pieces either way)
        assert [float(want["shares"][h["position"]]) for h in profile.heavy_hitters] == pytest.approx(
            [h["share"] for h in profile.heavy_hitters], abs=atol
        )
        assert profile.heavy_share == pytest.approx(want["heavy_share"], abs=atol)
        torch.testing.assert_close(profile.pooled_map, want["maps"][found.pool], rtol=0, atol=atol)
        assert torch.equal(found.reachable, want["reachable"])


def test_minilm_in_windows_equals_the_windows_weights():
    model, tokenizer = load_minilm()
    text = " ".join(bundled_corpus()[:12])
    batch = tokenizer.batch([text], max_length=10**9)
    ids = batch.input_ids[0]
    assert len(ids) > 2 * 48  # several windows
    found = inspect_long(model, text, layers=[0, 3], window=48, map_side=16)
    assert found.pieces == batch.pieces[0].tokens and not found.causal and len(found.windows) > 2
    cell = -(-len(ids) // 16)
    assert found.pieces_per_cell == cell and found.heads[0].pooled_map.shape == (-(-len(ids) // cell),) * 2
    assert_profiles(found, expected_profiles(model, ids, 1, 1, 48, [0, 3], cell, causal=False), atol=1e-5)
    assert not found.reachable.all()  # windows of 48 leave the corners far from the diagonal unseen
    data = found.to_dict()
    assert data["pieces"] == len(ids) and data["bands"] == ["0", "1", "2-8", "9-64", "65-512", "513+"]
    assert len(data["heads"]) == 24 and all(len(h["entropy_profile"]) <= 128 for h in data["heads"])


def test_a_causal_gpt2_past_its_positions(tmp_path):
    model = load_text_model(hf_checkpoints.save("gpt2", tmp_path / "gpt2"))
    text = " ".join(["the bank was full of money and the river ran by it"] * 12)
    ids = model.tokenizer.batch([text], max_length=10**9).input_ids[0]
    limit = model.tokenizer.max_length
    assert len(ids) > 2 * limit
    found = inspect_long(model, text, map_side=20, pool="mean")
    assert found.causal and found.windows[0] == (0, limit) and found.pool == "mean"
    cell = -(-len(ids) // 20)
    assert_profiles(found, expected_profiles(model, ids, 0, 0, limit, [0, 1], cell, causal=True), atol=1e-5)
    assert not found.reachable[0, 1:].any()  # causal: the first stretch's queries see nothing of later ones


def test_the_roles_take_the_first_threshold_reached():
    base = {"layer": 0, "head": 0, "entropy": 1.0, "entropy_profile": [1.0]}
    sink = HeadProfile(bands=[0.6, 0.0, 0.0, 0.1, 0.0, 0.3], sink=0.45, **base)
    assert sink.role == "sink"  # also local (0.6) and long-range (0.3): sink comes first
    assert HeadProfile(bands=[0.2, 0.2, 0.2, 0.2, 0.0, 0.2], sink=0.1, **base).role == "long-range"
    assert HeadProfile(bands=[0.1, 0.3, 0.2, 0.4, 0.0, 0.0], sink=0.1, **base).role == "local"
    assert HeadProfile(bands=[0.1, 0.1, 0.1, 0.7, 0.0, 0.0], sink=0.1, **base).role is None
    # a fifth of the weight on the window's eight heaviest pieces: heavy-hitter, before long-range and local
    hitter = HeadProfile(bands=[0.6, 0.0, 0.0, 0.1, 0.0, 0.3], sink=0.1, heavy_share=0.2, **base)
    assert hitter.role == "heavy-hitter"
    assert HeadProfile(bands=[0.6, 0.0, 0.0, 0.1, 0.0, 0.3], sink=0.3, heavy_share=0.9, **base).role == "sink"
    assert [r.name for r in LONG_ROLES] == ["sink", "heavy-hitter", "long-range", "local"]


def test_the_maps_shade_by_the_square_root_and_mark_what_no_window_saw():
    from multihead.lab.inspect.long import LongInspection
    from multihead.lab.inspect.long_report import SHADES, map_pixels, shaded_map

    cells = torch.zeros(16, 16, dtype=torch.float64)
    cells[0, 0], cells[15, 15], cells[15, 0] = 1.0, 1 / 16, 1 / 4  # square roots 1, 1/4 and 1/2
    base = {"layer": 0, "head": 0, "bands": [0.0] * 6, "sink": 0.0, "entropy": 0.0, "entropy_profile": [0.0]}
    profile = HeadProfile(**base, pooled_map=cells)
    seen = torch.ones(16, 16).tril().bool()
    found = LongInspection("m", "self", True, ["a"] * 16, [(0, 16)], [profile], "max", 1, seen)
    lines = shaded_map(found, profile)  # 8 rows of two cells, 16 columns of one: the max of each pair of rows
    assert len(lines) == 8 and all(len(line) == 16 for line in lines)
    assert lines[0] == SHADES[4] + SHADES[0] + " " * 14  # row 0 sees key 0, row 1 keys 0 and 1
    assert lines[7] == SHADES[2] + SHADES[0] * 14 + SHADES[1]
    mean = LongInspection("m", "self", True, ["a"] * 16, [(0, 16)], [profile], "mean", 1, seen)
    # the means of each pair of rows over the largest cell: 1/8 (square root 0.35: the second shade), 1/32
    assert shaded_map(mean, profile)[7] == SHADES[2] + SHADES[0] * 14 + SHADES[1]
    pixels = map_pixels(found, profile)  # the page's tile: a pixel a cell, grey after the query
    assert (pixels[~seen] == torch.tensor(MASKED_RGB, dtype=torch.uint8)).all()
    assert torch.equal(pixels[seen], weight_rgb_pixels(cells)[seen])


@pytest.mark.parametrize(
    "arguments, kind, fragment",
    [
        ({"text": "  "}, ValueError, "text: expected a non-empty text"),
        ({"window": 513}, ValueError, "window: expected an int in [2, 512]"),
        ({"window": 2}, ValueError, "window: expected more than the 2 special pieces"),
        ({"layers": [6]}, ValueError, "layers: expected layer indices in 0..5"),
        ({"map_side": 0}, ValueError, "map_side"),
        ({"pool": "median"}, ValueError, "pool: expected one of ['max', 'mean']"),
    ],
)
def test_bad_arguments_are_named(arguments, kind, fragment):
    model, _ = load_minilm()
    with pytest.raises(kind) as raised:
        inspect_long(model, **{"text": "a b c", **arguments})
    assert is_input_error(raised.value, kind) and fragment in str(raised.value)


def test_the_command_writes_what_python_gives(tmp_path, capsys):
    import json

    from multihead.cli import main

    text = " ".join(bundled_corpus()[:12])
    source = tmp_path / "long.txt"
    source.write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    formats = "terminal,json,html,png"
    argv = ["inspect", "--long", str(source), "--layers", "0,5", "--heads", "1,2", "--format", formats]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "all-MiniLM-L6-v2:" in printed and "layer 5" in printed and "wrote " in printed and "long.json (" in printed
    assert " hitters  entropy " in printed and "most received" in printed  # every column whole
    model, _ = load_minilm()
    expected = inspect_long(model, text, layers=[0, 5], heads=[1, 2]).to_dict()
    written = json.loads((out / "long.json").read_text())
    assert [(h["layer"], h["head"]) for h in written["heads"]] == [(0, 1), (0, 2), (5, 1), (5, 2)]
    assert written["heads"] == expected["heads"]  # the same numbers: JSON keeps every float
    assert written["pieces"] == expected["pieces"] and written["windows"] == expected["windows"]
    # the page: a row per head of roles and shares, its distance profile's cells the JSON's bands
    page = parsed((out / "long.html").read_text(encoding="ascii"))
    assert [row[0]["text"] for row in page.rows] == ["L0 H1", "L0 H2", "L5 H1", "L5 H2"]
    assert [row[1]["text"] for row in page.rows] == [h["role"] or "" for h in written["heads"]]
    first = written["heads"][0]["heavy_hitters"][0]
    assert page.rows[0][6]["text"].startswith(f"{first['piece']}@{first['position']} {first['share']:.0%}")
    profile = [float(cell["data-value"]) for cell in page.cells[: 4 * 6]]  # the first grid: 4 heads x 6 bands
    assert profile == pytest.approx([band for h in written["heads"] for band in h["bands"]], abs=1e-12)
    assert (out / "long.png").stat().st_size > 0 and "long.png (" in printed
    # the maps: a tile per head, each the JSON's map on the weight ramp
    reachable = torch.tensor(written["map"]["reachable"], dtype=torch.bool)
    assert [image["title"].split(":")[0] for image in page.images] == [
        "layer 0, head 1",
        "layer 0, head 2",
        "layer 5, head 1",
        "layer 5, head 2",
    ]
    for image, head in zip(page.images, written["heads"], strict=True):
        pixels = png_pixels(image["src"])
        cells = torch.tensor(head["map"], dtype=torch.float64)
        assert pixels.shape == (*cells.shape, 3) and reachable.all()  # one window: every pair seen
        ramp = weight_rgb_pixels(cells)  # the map's max: weight 1 is the darkest
        assert (pixels[reachable].int() - ramp[reachable].int()).abs().max() <= 2  # the JSON's 3 digits
    assert printed.count("\u2591") > 0 and "pooled maps: queries down" in printed


@pytest.mark.parametrize(
    "extra, option, fragment",
    [
        (["a text"], "--long", "no text beside it"),
        (["--token", "bank"], "--long", "no --token beside it"),
        (["--format", "pdf"], "--format", "one or more of"),
        (["--layers", "9"], "--layers", "layer indices in 0..5"),
    ],
)
def test_the_commands_mistakes_are_one_line(extra, option, fragment, tmp_path, capsys):
    from test_cli_errors import assert_one_line

    source = tmp_path / "long.txt"
    source.write_text("The bank was full of money.", encoding="utf-8")
    argv = ["inspect", "--long", str(source), "--out", str(tmp_path / "out"), *extra]
    assert_one_line(capsys, argv, "inspect", option, fragment)


def test_a_missing_file_is_one_line(tmp_path, capsys):
    from test_cli_errors import assert_one_line

    argv = ["inspect", "--long", str(tmp_path / "absent.txt")]
    assert_one_line(capsys, argv, "inspect", "--long", "which does not exist")
