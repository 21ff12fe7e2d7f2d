"""The report inside a real JupyterLab (issue 47, rows 2 and 3), driven in Debian's chromium through Playwright.

A JupyterLab server (the test extra's, from the lock) runs on a free port of 127.0.0.1 with its config, data and
runtime folders and HOME in a temporary folder, a known token, no kernel started, no news or update check. It serves
two notebook files written here, whose one output is an inspection's report (``render_fragment``, what
``Inspection._repr_html_`` returns):

* **untrusted** (no signature): JupyterLab runs no script and passes the output through its sanitizer (its own
  allow-lists, applied by sanitize-html: a bare ``hidden`` is dropped, inline ``style`` kept). Only the static
  view may show: no element of the interactive markup is visible and the output is the static view's height.
* **trusted** (signed with the notebook secret of the server's data folder), in a 1280 px window with the file
  browser open: an ~850 px output area in a window wider than any viewport breakpoint. The report reflows on its
  own width: the head view's labels inside its card, the attention bars not squeezed, every head of the grid
  visible without scrolling.

Screenshots land in test-artifacts/ (docs/images/jupyterlab-*.png are copies, shown in docs/report.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from nbformat.sign import NotebookNotary

from multihead.lab.inspect import inspect_text
from multihead.lab.inspect.html import render_fragment
from multihead.lab.inspect.static import NO_SCRIPT_NOTE
from multihead.lab.models import load_minilm
from test_inspect_html import ARTIFACTS, browser  # noqa: F401 (the fixture: Debian's chromium, once per module)
from test_inspect_html_page import assert_fits

pytestmark = pytest.mark.timeout(90)  # the server, two notebooks and a browser: about 20 s on 2 cores

TEXT = "The bank was full of money."
TOKEN = "multihead-test-token"
# A laptop's window with JupyterLab's file browser open: the notebook's output area is about 850 px wide, while the
# window is wider than any breakpoint a stylesheet would put on the viewport.
WINDOW = {"width": 1280, "height": 900}
OUTPUT = ".jp-OutputArea-output"
START_SECONDS = 30


@dataclass
class Lab:
    url: str
    log: Path

    def open(self, browser, name: str):  # noqa: F811 (the fixture)
        """A new page of WINDOW's size showing notebook ``name``, once its output holds a report."""
        page = browser.new_page(viewport=WINDOW)
        # reset: a fresh workspace, not the last page's (which would reopen the other notebook beside this one)
        page.goto(f"{self.url}/lab/tree/{name}?reset&token={TOKEN}")
        try:
            page.wait_for_selector(f"{OUTPUT} .mh-report", timeout=30_000)
        except Exception:
            page.close()
            pytest.fail(f"JupyterLab showed no report output for {name}; its log:\n{self.log.read_text()[-3000:]}")
        assert page.locator(OUTPUT).count() == 1  # the one output of the one notebook open
        return page


@pytest.fixture(scope="module")
def fragment():
    model, _ = load_minilm()
    return render_fragment(inspect_text(model, TEXT, token="bank"))


def write_notebook(path: Path, fragment: str, notary: NotebookNotary | None = None) -> None:
    """A one-cell notebook whose output is the report, as Jupyter saves an executed ``inspection`` cell."""
    notebook = nbformat.v4.new_notebook(
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    )
    cell = nbformat.v4.new_code_cell("inspection", execution_count=1)
    cell.outputs = [
        nbformat.v4.new_output(
            "execute_result", {"text/html": fragment, "text/plain": "Inspection(...)"}, execution_count=1
        )
    ]
    notebook.cells = [cell]
    if notary is not None:
        notary.sign(notebook)
    nbformat.write(notebook, path)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory, fragment):
    root = tmp_path_factory.mktemp("jupyterlab")
    folders = {name: root / name for name in ("home", "config", "data", "runtime", "ipython", "notebooks")}
    for folder in folders.values():
        folder.mkdir()
    env = dict(
        os.environ,
        HOME=str(folders["home"]),
        JUPYTER_CONFIG_DIR=str(folders["config"]),
        JUPYTER_DATA_DIR=str(folders["data"]),
        JUPYTER_RUNTIME_DIR=str(folders["runtime"]),
        IPYTHONDIR=str(folders["ipython"]),
        JUPYTER_PLATFORM_DIRS="1",
    )
    env.pop("JUPYTER_PATH", None)
    env.pop("JUPYTER_CONFIG_PATH", None)
    # the trusted copy is signed with the secret of the server's own data folder (what `jupyter trust` does)
    write_notebook(folders["notebooks"] / "untrusted.ipynb", fragment)
    write_notebook(folders["notebooks"] / "trusted.ipynb", fragment, NotebookNotary(data_dir=str(folders["data"])))
    port = free_port()
    log = root / "server.log"
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--ServerApp.root_dir={folders['notebooks']}",
        f"--IdentityProvider.token={TOKEN}",
        "--ServerApp.allow_root=True",  # a container's tests may run as root
        "--LabApp.notebook_starts_kernel=False",  # the outputs are in the file: no kernel to start or clean up
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",  # never asks PyPI
    ]
    with open(log, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_SECONDS
        while True:
            if server.poll() is not None:
                pytest.fail(f"jupyter lab exited ({server.returncode}):\n{log.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2) as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                pytest.fail(f"jupyter lab did not answer in {START_SECONDS} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield Lab(url, log)
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)
        with contextlib.suppress(ProcessLookupError):  # anything the server started, in its own session
            os.killpg(server.pid, signal.SIGKILL)


def screenshot(page, name: str, until: str | None = None) -> None:
    """The report's output into test-artifacts/``name``: the window made as tall as the notebook needs (its width,
    and so the layout, unchanged), then the output from its top to its bottom or, with ``until``, to the bottom of
    the card holding that element of the report."""
    output = page.locator(OUTPUT)
    height = output.evaluate("(output) => Math.ceil(output.getBoundingClientRect().height)")
    page.set_viewport_size({"width": page.viewport_size["width"], "height": height + 400})
    page.wait_for_timeout(300)  # JupyterLab lays the taller window out
    clip = output.bounding_box()
    if until is not None:
        card = output.locator(f".mh-report {until}").evaluate("(node) => node.closest('.card').getBoundingClientRect()")
        clip["height"] = card["bottom"] + 8 - clip["y"]
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), clip=clip)


# What an untrusted output shows, measured in the page: the output's height, the static view's, and every element
# of the report outside the static view that the browser draws (it must be none).
UNTRUSTED_LAYOUT = """(selector) => {
  const output = document.querySelector(selector), report = output.querySelector('.mh-report');
  const top = report.getBoundingClientRect().top, view = report.querySelector('.mh-static');
  const drawn = [...report.querySelectorAll('*')].filter((node) => !view.contains(node) &&
    node.checkVisibility() && node.getClientRects().length > 0);
  return {
    output: output.getBoundingClientRect().height,
    report: report.getBoundingClientRect().height,
    view: view.getBoundingClientRect().bottom - top,
    shadow: report.shadowRoot !== null,
    drawn: drawn.map((node) => node.tagName.toLowerCase() + (node.id ? '#' + node.id : '') +
      (node.dataset.jupyterId ? '#' + node.dataset.jupyterId : '') + (node.className ? '.' + node.className : '')),
  };
}"""


def test_an_untrusted_notebook_shows_only_the_static_view(browser, lab):  # noqa: F811 (the fixture)
    page = lab.open(browser, "untrusted.ipynb")
    try:
        layout = page.evaluate(UNTRUSTED_LAYOUT, OUTPUT)
        assert not layout["shadow"]  # no script ran: the sanitized output is what shows
        report = page.locator(f"{OUTPUT} .mh-report")
        assert report.locator("p").first.text_content() == NO_SCRIPT_NOTE
        assert report.locator(".mh-static img").count() == 6 * 12
        assert layout["drawn"] == [], f"interactive markup drawn in an untrusted notebook: {layout['drawn'][:12]}"
        # the output is the static view and nothing under it (the skeleton added ~1,250 px)
        assert layout["report"] <= layout["view"] + 4, layout
        assert layout["output"] <= layout["view"] + 40, layout
        screenshot(page, "jupyterlab-untrusted.png")
    finally:
        page.close()


def test_a_trusted_report_in_a_narrow_output_area_reflows_on_its_own_width(browser, lab):  # noqa: F811
    page = lab.open(browser, "trusted.ipynb")
    try:
        page.wait_for_selector(f"{OUTPUT} .mh-report #head-grid canvas.heatmap", timeout=30_000)  # drawn: trusted
        report = page.locator(f"{OUTPUT} .mh-report")
        width = page.locator(OUTPUT).evaluate("(output) => output.getBoundingClientRect().width")
        assert 760 <= width <= 900, width  # the case of the issue: an ~800 px output area in a 1280 px window
        assert_fits(report, tokens=9, heads=6 * 12)  # head view labels, bars, every head of the grid
        screenshot(page, "jupyterlab-narrow.png", until="#head-grid")
    finally:
        page.close()
