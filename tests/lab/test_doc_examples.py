"""Every fenced ```python block of README.md, ARCHITECTURE.md and docs/*.md runs alone, as written (issue 47, row 14).

A reader copies one block into a fresh interpreter, so each block here runs in a process of its own, in a fresh
namespace, with an empty folder of the test as its working directory and its HOME, offline (HF_HUB_OFFLINE): it
must define every tensor and object it uses, and finish without an exception within ``BLOCK_TIMEOUT`` seconds.

The convention for a block that cannot run in a test: the line right before its fence is
``<!-- not run: REASON -->`` (an HTML comment, invisible on the rendered page), REASON saying what it needs (the
ranks of a torch.distributed group, a GPU, ...). Such a block is still compiled, so it is valid Python, and the
marker is refused anywhere but right before a ```python fence. Keep them few: a block a small local model or a few
random tensors can feed runs.

Shell blocks (```sh, ```bash) and ```text output are not run: they install environments, train for minutes or
start torchrun; the CLI tests cover the commands. A block spelled ```py, ```python3 or ```pycon is refused, so
that no Python block escapes the run by its fence's spelling.

How, cheaply: one runner process imports torch, multihead (its lab wings) and transformers' model code, which every
block's own imports would load the same way (each is reached lazily from its package, and none of them registers
anything), then forks one child per block. A block's ``import`` binds its names as in a fresh interpreter and loads
whatever else it names (``multihead.integrations.transformers``, which registers ``attn_implementation="multihead"``,
is loaded only by the blocks that import it); only the seconds of importing them are shared. The runner computes
nothing before it forks (no torch op has started a thread pool), as torch's DataLoader forks its workers after the
same imports.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_TIMEOUT = 180  # seconds, one block; the slowest (README's head_stats over the bundled corpus) takes ~25 s

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:(?P<reason>.*?)-->\s*$")
NOT_RUN_ANYWHERE = re.compile(r"<!--\s*not run\b")
OTHER_PYTHON_SPELLINGS = {"py", "python3", "pycon", "ipython", "python-repl"}


@dataclass(frozen=True)
class Block:
    document: str  # relative to the repository root
    line: int  # the fence's line, from 1
    source: str  # the block's lines, the fence's indentation removed
    not_run: str | None  # the marker's reason, or None: the block runs

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"

    def padded(self) -> str:
        """The source preceded by blank lines, so that a traceback's line numbers are the document's."""
        return "\n" * self.line + self.source + "\n"


@dataclass(frozen=True)
class Fence:
    document: str
    line: int
    info: str
    source: str
    marker: str | None  # the whole line before the fence when it is a not-run marker


def fences(document: Path) -> list[Fence]:
    """Every fenced block of ``document`` (CommonMark's rule: a closing fence is the opening's character, at least
    as many, and nothing else on its line), with its info string and the not-run marker before it, if any."""
    name = str(document.relative_to(ROOT))
    lines = document.read_text(encoding="utf-8").splitlines()
    found, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence, info = len(opening["indent"]), opening["fence"], opening["info"].strip()
        start, body = index, []
        index += 1
        while index < len(lines):
            text = lines[index].strip()
            if text and set(text) == {fence[0]} and len(text) >= len(fence):
                break
            line = lines[index]
            body.append(line[indent:] if not line[:indent].strip() else line.lstrip())
            index += 1
        before = lines[start - 1] if start else ""
        found.append(Fence(name, start + 1, info, "\n".join(body), before if NOT_RUN.match(before) else None))
        index += 1
    return found


def python_blocks() -> list[Block]:
    blocks = []
    for document in DOCUMENTS:
        for fence in fences(document):
            if fence.info.split()[:1] == ["python"]:
                marker = NOT_RUN.match(fence.marker) if fence.marker else None
                reason = marker["reason"].strip() if marker else None
                blocks.append(Block(fence.document, fence.line, fence.source, reason))
    return blocks


BLOCKS = python_blocks()
RUNNABLE = [block for block in BLOCKS if block.not_run is None]
NOT_RUN_BLOCKS = [block for block in BLOCKS if block.not_run is not None]

# The runner: preload (see the module docstring), then one forked child per block, each in its own folder with its
# output in files there; prints one JSON line {block id: {"rc": exit status or null after the timeout, ...}}.
RUNNER = r"""
import json, os, signal, sys, time, traceback
import torch, multihead, multihead.lab.models, multihead.lab.inspect, multihead.lab.circuits
import transformers, transformers.modeling_utils

blocks, timeout = json.loads(sys.stdin.read()), float(sys.argv[1])
results = {}
for block in blocks:
    folder = block["folder"]
    os.makedirs(os.path.join(folder, "home"))
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: the block alone, in a fresh namespace, in its folder
        status = 1
        try:
            os.chdir(folder)
            os.environ["HOME"] = os.path.join(folder, "home")
            for stream, name in ((1, "stdout.txt"), (2, "stderr.txt")):
                os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), stream)
            sys.argv = [block["filename"]]
            code = compile(block["source"], block["filename"], "exec")
            exec(code, {"__name__": "__main__", "__file__": block["filename"]})
            status = 0
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException as error:
            traceback.print_exception(type(error), error, error.__traceback__.tb_next)  # from the block's frame
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(status)
    start, rc = time.monotonic(), None
    while time.monotonic() - start < timeout:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    results[block["id"]] = {"rc": rc, "seconds": round(time.monotonic() - start, 1)}
print(json.dumps(results))
"""


def isolated_environment(home: Path) -> dict[str, str]:
    """The test's own environment with HOME and every cache in ``home`` and the hub offline."""
    env = dict(os.environ)
    for pointer_out_of_home in ("MULTIHEAD_CACHE", "HF_HOME", "HF_HUB_CACHE", "MPLCONFIGDIR", "PYTHONSTARTUP"):
        env.pop(pointer_out_of_home, None)
    env.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_CONFIG_HOME=str(home / ".config"),
        TORCHINDUCTOR_CACHE_DIR=str(home / "torchinductor"),
        TRITON_CACHE_DIR=str(home / "triton"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def selected_blocks(session: pytest.Session) -> list[Block]:
    """The runnable blocks whose test this session runs (``-k`` keeps the runner to them)."""
    chosen = {
        item.callspec.params["block"].id
        for item in session.items
        if item.originalname == "test_python_block_runs_alone" and hasattr(item, "callspec")
    }
    return [block for block in RUNNABLE if block.id in chosen]


@pytest.fixture(scope="module")
def block_runs(request, tmp_path_factory):
    """{block id: (exit status or None on a timeout, seconds, the block's stdout and stderr)}, every selected
    block run once by the runner."""
    base = tmp_path_factory.mktemp("doc-examples")
    blocks = selected_blocks(request.session)
    jobs = []
    for number, block in enumerate(blocks):
        folder = base / f"block-{number:02d}"
        filename = block.document.replace("/", "-")  # a traceback names README.md, line N of the document
        jobs.append({"id": block.id, "folder": str(folder), "filename": filename, "source": block.padded()})
    runner = subprocess.run(
        [sys.executable, "-c", RUNNER, str(BLOCK_TIMEOUT)],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        cwd=base,
        env=isolated_environment(base / "runner-home"),
        timeout=BLOCK_TIMEOUT * len(jobs) + 120,
    )
    assert runner.returncode == 0, f"the runner failed:\n{runner.stderr[-4000:]}"
    results = json.loads(runner.stdout.splitlines()[-1])
    runs = {}
    for job in jobs:
        folder = Path(job["folder"])
        output = {name: (folder / f"{name}.txt").read_text(errors="replace") for name in ("stdout", "stderr")}
        runs[job["id"]] = (results[job["id"]]["rc"], results[job["id"]]["seconds"], output)
    return runs


@pytest.mark.timeout(1200)  # the first test runs every selected block (about 90 s on two busy cores)
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda block: block.id)
def test_python_block_runs_alone(block, block_runs):
    rc, seconds, output = block_runs[block.id]
    assert rc is not None, f"{block.id} ran past {BLOCK_TIMEOUT} s:\n{output['stderr'][-3000:]}"
    assert rc == 0, (
        f"{block.id} failed run alone (exit status {rc}, {seconds} s); define what it uses in the block, or mark "
        f"it <!-- not run: REASON --> if it cannot run in a test:\n{output['stderr'][-3000:]}"
    )


def test_a_block_not_run_compiles_says_why_and_is_rare():
    for block in NOT_RUN_BLOCKS:
        assert len(block.not_run.split()) >= 3, f"{block.id}: the not-run marker must say what the block needs"
        compile(block.padded(), block.document, "exec")  # a SyntaxError names the document's line
    assert len(NOT_RUN_BLOCKS) <= 3, [f"{block.id}: {block.not_run}" for block in NOT_RUN_BLOCKS]


def test_the_documents_have_python_blocks():
    assert len(BLOCKS) >= 30, f"the scan found {len(BLOCKS)} python blocks"


def test_a_not_run_marker_sits_right_before_a_python_fence():
    misplaced = []
    for document in DOCUMENTS:
        lines = document.read_text(encoding="utf-8").splitlines()
        marked = {fence.line - 1 for fence in fences(document) if fence.marker and fence.info.split()[:1] == ["python"]}
        for number, line in enumerate(lines, start=1):
            if NOT_RUN_ANYWHERE.search(line) and (number not in marked or not NOT_RUN.match(line)):
                misplaced.append(f"{document.relative_to(ROOT)}:{number}: {line.strip()}")
    assert misplaced == []


def test_python_blocks_are_fenced_as_python():
    spelled_otherwise = [
        f"{fence.document}:{fence.line}: ```{fence.info}"
        for document in DOCUMENTS
        for fence in fences(document)
        if fence.info.split()[:1] and fence.info.split()[0].lower() in OTHER_PYTHON_SPELLINGS
    ]
    assert spelled_otherwise == [], "fence Python as ```python, which this test runs"


def test_the_scan_reads_indented_fences_and_markers(tmp_path, monkeypatch):
    """The parser on a document written for it: a block in a list item, a marked block, a longer fence."""
    document = tmp_path / "doc.md"
    document.write_text(
        "- an item:\n\n  ```python\n  x = 1\n  ```\n\n<!-- not run: needs the ranks of a group -->\n"
        "```python\ny = x\n```\n\n````python\nz = '```'\n````\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = fences(document)
    assert [(fence.line, fence.source, fence.marker is not None) for fence in found] == [
        (3, "x = 1", False),
        (8, "y = x", True),
        (12, "z = '```'", False),
    ]
