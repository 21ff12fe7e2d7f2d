"""The report without JavaScript (issue 31, row 2): an untrusted notebook's output (JupyterLab's sanitizer
rules applied: tests/jupyter_sanitizer.py) and a page with JavaScript off, both opened in Debian's chromium
with JavaScript disabled, show the static view on top (how to get the interactive report, the heads grid
as inline images, the roles) and no empty skeleton; with JavaScript the interactive report replaces it."""

from __future__ import annotations

import contextlib
import io
import zlib

import pytest
import torch

from jupyter_sanitizer import sanitized
from multihead.lab.inspect import inspect_text
from multihead.lab.inspect.colours import MASKED_RGB, weight_rgb
from multihead.lab.inspect.html import render_fragment
from multihead.lab.inspect.static import NO_SCRIPT_NOTE, THUMBNAIL_PIXELS, thumbnail_png
from multihead.lab.models import load_minilm
from test_inspect_html import browser  # noqa: F401 (the fixture: Debian's chromium, once per module)

TEXT = "The bank was full of money."


@pytest.fixture(scope="module")
def inspection():
    model, _ = load_minilm()
    return inspect_text(model, TEXT)


def decode_png(data: bytes) -> torch.Tensor:
    """(h, w, 3) uint8 of an 8-bit RGB PNG with unfiltered rows (what thumbnail_png writes)."""
    stream = io.BytesIO(data)
    assert stream.read(8) == b"\x89PNG\r\n\x1a\n"
    width = height = 0
    pixels = b""
    while True:
        length = int.from_bytes(stream.read(4), "big")
        kind, body = stream.read(4), stream.read(length)
        stream.read(4)  # the CRC
        if kind == b"IHDR":
            width, height = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
            assert body[8:10] == bytes([8, 2])
        elif kind == b"IDAT":
            pixels += body
        elif kind == b"IEND":
            break
    rows = torch.frombuffer(bytearray(zlib.decompress(pixels)), dtype=torch.uint8).reshape(height, 1 + 3 * width)
    assert rows[:, 0].eq(0).all()  # no filter
    return rows[:, 1:].reshape(height, width, 3)


def test_a_thumbnail_draws_each_weight_on_the_reports_colour_scale():
    weights = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    masked = torch.ones(3, 3, dtype=torch.bool).triu(1)
    image = decode_png(thumbnail_png(weights, masked))
    block = THUMBNAIL_PIXELS // 3
    assert image.shape == (3 * block, 3 * block, 3)
    for i in range(3):
        for j in range(3):
            expected = MASKED_RGB if masked[i, j] else weight_rgb(float(weights[i, j]))
            assert tuple(image[i * block, j * block].tolist()) == expected, (i, j)
    long = decode_png(thumbnail_png(torch.full((300, 120), 1 / 120)))
    assert long.shape == (THUMBNAIL_PIXELS, THUMBNAIL_PIXELS, 3)  # a long text's cells are averaged into blocks


@contextlib.contextmanager
def page_without_javascript(browser, markup: str):  # noqa: F811 (the fixture)
    context = browser.new_context(java_script_enabled=False, viewport={"width": 1200, "height": 900})
    try:
        page = context.new_page()
        page.set_content(f"<!DOCTYPE html><html><body>{markup}</body></html>")
        yield page
    finally:
        context.close()


@pytest.mark.parametrize("shown_as", ["untrusted notebook", "page with JavaScript off"])
def test_without_javascript_the_static_view_is_on_top_and_no_skeleton_shows(shown_as, browser, inspection):  # noqa: F811
    fragment = render_fragment(inspection)
    markup = sanitized(fragment) if shown_as == "untrusted notebook" else fragment
    if shown_as == "untrusted notebook":
        assert "<script" not in markup and "<style" not in markup and "<template" not in markup
    with page_without_javascript(browser, markup) as page:
        report = page.locator(".mh-report")
        note = report.locator("p").first
        assert note.text_content() == NO_SCRIPT_NOTE and note.is_visible()
        assert note.bounding_box()["y"] - report.bounding_box()["y"] < 5  # the first line of the report
        # every head a loaded thumbnail over its role, labelled by layer and head
        images = report.locator("img")
        assert images.count() == 6 * 12
        sizes = [image.bounding_box() for image in images.all()]
        assert all(size is not None and size["width"] >= 30 and size["height"] >= 30 for size in sizes)
        assert (
            images.nth(2 * 6 + 0).get_attribute("alt") == f"layer 0 head 2: {inspection.role_stats.roles()[0][2].text}"
        )
        assert "prev 100%" in report.text_content()  # layer 0 head 2's role, in the grid
        # the interactive markup is there but hidden: no dead select, button or empty canvas shows
        for selector in ("select", "button", "canvas", "#head-stats", "header"):
            assert all(not element.is_visible() for element in report.locator(selector).all()), selector
        height = report.bounding_box()["height"]
        grid = report.locator(".mh-static table").bounding_box()
        assert height < grid["y"] + grid["height"] + 60 - report.bounding_box()["y"]  # nothing below the view


def test_with_javascript_the_interactive_report_replaces_the_static_view(browser, inspection):  # noqa: F811
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    try:
        page.set_content(f"<!DOCTYPE html><html><body>{render_fragment(inspection)}</body></html>")
        report = page.locator(".mh-report")
        assert report.locator("#layer-select").is_visible()  # drawn in the shadow root
        assert not page.locator(".mh-static").is_visible()  # light DOM: not rendered under a shadow root
    finally:
        page.close()
