"""multihead.lab.inspect.write: every renderer of an Inspection, to files (html, png, json) or the terminal."""

from __future__ import annotations

import io
import json
import sys

import pytest
from rich.console import Console

from multihead.lab.inspect.html import render_html
from multihead.lab.inspect.write import FILES, FORMATS, check_formats, report, write_reports
from support_inspect import synthetic_inspection


@pytest.mark.parametrize(
    "formats, expected",
    [
        ("terminal,html", ["terminal", "html"]),
        (" json , png ", ["json", "png"]),
        (["html", "json"], ["html", "json"]),
        ("html,,", ["html"]),
    ],
)
def test_check_formats_accepts_lists_and_comma_separated_text(formats, expected):
    assert check_formats(formats) == expected


@pytest.mark.parametrize(
    "formats, got",
    [("pdf", "got pdf"), ("html,svg,txt", "got svg, txt"), ("", "got none"), ([], "got none"), (" , ", "got none")],
)
def test_check_formats_refuses_unknown_or_no_formats(formats, got):
    with pytest.raises(ValueError, match=rf"format: expected one or more of terminal, html, png, json, {got}\. Fix:"):
        check_formats(formats)


def test_png_without_matplotlib_is_left_out_and_the_others_written(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert check_formats("html,png,json") == ["html", "png", "json"]  # accepted: only the figure is skipped
    paths = write_reports(synthetic_inspection(), tmp_path, ["html", "png", "json"])
    assert paths == {"html": tmp_path / "report.html", "json": tmp_path / "inspect.json"}
    assert paths.skipped == {"png": tmp_path / "heads.png"} and not (tmp_path / "heads.png").exists()
    assert all(path.is_file() for path in paths.values())


def test_every_format_written_from_one_inspection(tmp_path):
    inspection = synthetic_inspection(corpus=True)
    console = Console(width=100, file=io.StringIO(), record=True, color_system=None)
    extra = {"importance": [[1.0, 2.0, None], [4.0, 5.0, 6.0]]}
    paths = write_reports(inspection, tmp_path / "out", FORMATS, console=console, extra_columns=extra)
    assert paths == {name: tmp_path / "out" / FILES[name] for name in ("html", "png", "json")}
    assert json.loads(paths["json"].read_text(encoding="utf-8")) == json.loads(json.dumps(inspection.to_dict()))
    assert paths["html"].read_text(encoding="utf-8") == render_html(inspection, extra)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert console.export_text().startswith("all-MiniLM-L6-v2: 2 layers x 3 heads on 9 tokens")


def test_terminal_alone_makes_no_folder(tmp_path, capsys):
    assert write_reports(synthetic_inspection(), tmp_path / "never", ["terminal"]) == {}
    assert not (tmp_path / "never").exists()
    assert "Strongest links from 'bank'" in capsys.readouterr().out


def test_an_unwritable_place_names_the_argument(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=r"^--out: expected .*folder"):
        write_reports(synthetic_inspection(), blocker, ["json"], argument="--out")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "inspect.json").mkdir()  # a folder where the file should go
    with pytest.raises(ValueError, match=r"^out_dir: expected a folder multihead can write its files in"):
        write_reports(synthetic_inspection(), tmp_path / "out", ["json"])


def test_formats_are_checked_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="format: expected one or more of"):
        write_reports(synthetic_inspection(), tmp_path / "out", ["json", "pdf"])
    assert not (tmp_path / "out").exists()


def test_report_inspects_and_writes(tmp_path):
    from multihead.lab.models import load_minilm

    model, _ = load_minilm()
    paths = report(model, "The bank was full of money.", out_dir=tmp_path, formats=["json"], layers=[0], heads=[2])
    data = json.loads(paths["json"].read_text())
    assert (data["layers"], data["heads"], data["token"]) == ([0], [2], 2)
    assert data["roles"][0][0]["label"] == "prev"  # layer 0 head 2 of all-MiniLM-L6-v2
    with pytest.raises(ValueError, match="format: expected one or more of"):
        report(model, "The bank was full of money.", out_dir=tmp_path / "x", formats=["gif"])
    assert not (tmp_path / "x").exists()
