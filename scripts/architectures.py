"""The architectures of the installed transformers on attn_implementation="multihead", each built tiny from its own
config's defaults (tests/hf_tiny.py) and run on 12 random token ids beside its own eager attention.

    python scripts/architectures.py                 # every architecture: writes docs/architectures.md
    python scripts/architectures.py gpt_oss llama   # some: prints their rows

A row says what happened: "equal" (logits or last hidden states within 1e-4 of eager, float32), "differs" (the
largest difference), "refused" (multihead's error naming what it does not serve), "fails" (ours raised where eager
ran: a defect), or why the comparison did not run (the tiny config does not build, is too large for the sweep's
memory limit, or eager itself needs more than token ids: images, audio). Each model runs in a fork of its own.
tests/lab/test_architecture_table.py re-runs rows of the table and checks it lists every architecture whose
modeling code calls the attention function.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import resource
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import transformers  # noqa: E402

import multihead.integrations.transformers as integration  # noqa: E402
from hf_tiny import VOCAB, first_output, tiny_model  # noqa: E402

TABLE = ROOT / "docs" / "architectures.md"
TOLERANCE = 1e-4
LENGTH = 12


@dataclass(frozen=True)
class Row:
    model_type: str
    status: str  # equal, differs, refused, fails, not built, too large, eager needs more
    detail: str

    def line(self) -> str:
        return f"| `{self.model_type}` | {self.status} | {self.detail} |"


def attention_architectures() -> list[str]:
    """The model types whose modeling code looks up transformers' attention function (the ones we can serve)."""
    found = []
    for path in sorted((Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        source = path.read_text()
        if "ALL_ATTENTION_FUNCTIONS" in source:
            found.append(path.parent.name)
    known = set(transformers.CONFIG_MAPPING.keys())
    return sorted(name for name in dict.fromkeys(found) if name in known)


def _first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0].replace("|", "/")  # a "|" would split the table row
    return (text[:150] + "...") if len(text) > 150 else text


def compare(model_type: str, device: torch.device | str = "cpu") -> Row:
    """``model_type`` built tiny on ``device``, its eager attention beside ours on (2, LENGTH) random token ids."""
    try:
        theirs = tiny_model(model_type).to(device)
    except Exception as error:  # the tiny config is not one its model builds: not a statement about attention
        return Row(model_type, "not built", _first_line(error))
    ids = torch.randint(3, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1)).to(device)
    batch = {"input_ids": ids}
    if getattr(theirs.config, "is_encoder_decoder", False):  # the decoder reads a target of its own
        batch["decoder_input_ids"] = ids[:, :5]
    try:
        theirs.set_attn_implementation("eager")
        ours = copy.deepcopy(theirs)
        with torch.no_grad():
            expected = first_output(theirs, **batch)
    except Exception as error:
        return Row(model_type, "eager needs more", _first_line(error))
    try:
        ours.set_attn_implementation(integration.IMPLEMENTATION)
        with torch.no_grad():
            got = first_output(ours, **batch)
    except ValueError as error:
        if "attn_implementation='multihead'" in str(error):
            return Row(model_type, "refused", _first_line(error))
        return Row(model_type, "fails", _first_line(error))
    except Exception as error:
        return Row(model_type, "fails", _first_line(error))
    difference = float((got.float() - expected.float()).abs().max())
    status = "equal" if difference <= TOLERANCE else "differs"
    return Row(model_type, status, f"{difference:.2g}")


def _compare_within_limit(model_type: str) -> Row:
    """compare() in a process of its own (a fork of the sweep's), its address space limited: a model whose config
    is not shrunk enough is reported as too large, the same wherever it comes in the sweep, and what one model
    leaves allocated is gone before the next."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = compare(model_type)
    if any(sign in row.detail for sign in OUT_OF_MEMORY):
        return Row(model_type, "too large", f"over {MEMORY_LIMIT_BYTES // 2**30} GiB: {row.detail}")
    return row


def rows(model_types: list[str], processes: int) -> list[Row]:
    """The rows of ``model_types`` in their order, each run in a fresh fork, ``processes`` at a time."""
    context = multiprocessing.get_context("fork")
    found = []
    with context.Pool(processes, maxtasksperchild=1) as pool:
        for number, row in enumerate(pool.imap(_compare_within_limit, model_types), 1):
            print(f"[{number}/{len(model_types)}] {row.line()[:100]}", file=sys.stderr, flush=True)
            found.append(row)
    return found


def table(found: list[Row]) -> str:
    summary = ", ".join(f"{count} {status}" for status, count in Counter(row.status for row in found).most_common())
    lines = [
        '# Architectures on `attn_implementation="multihead"`',
        "",
        f"Made by `python scripts/architectures.py` with transformers {transformers.__version__} and torch "
        f"{torch.__version__}: every model type whose modeling code calls transformers' attention function, built "
        f"tiny from its config's defaults (`tests/hf_tiny.py`) and run in float32 on {LENGTH} random token ids beside "
        f"its own eager attention. `tests/lab/test_architecture_table.py` checks the list and re-runs rows.",
        "",
        f"{len(found)} architectures: {summary}.",
        "",
        "- **equal**: logits (or last hidden states) within 1e-4 of eager; the figure is the largest difference.",
        "- **differs**: the largest difference, over 1e-4.",
        "- **refused**: multihead's error, naming what the kernel does not serve.",
        "- **fails**: ours raised where eager ran (a defect to fix).",
        "- **not built**: the tiny config does not build its model (nothing about attention).",
        f"- **too large**: the tiny config leaves some part unshrunk: over {MEMORY_LIMIT_BYTES // 2**30} GiB.",
        "- **eager needs more**: eager itself does not run on token ids alone (images, audio, decoder inputs).",
        "",
        "| architecture | result | detail |",
        "|---|---|---|",
        *(row.line() for row in found),
        "",
    ]
    return "\n".join(lines)


# Some configs' defaults are not shrunk by the tiny sizes (a vision tower's own fields): such a model is refused by
# the allocator (reported as "too large") rather than taking the machine's memory; two such processes at a time
# stay within this machine kind's 24 GiB
MEMORY_LIMIT_BYTES = 10 * 2**30
OUT_OF_MEMORY = ("MemoryError", "can't allocate memory")
PROCESSES = 2


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)  # before any fork: each process runs one model on one thread
    processes = min(len(os.sched_getaffinity(0)), PROCESSES)
    if argv:
        for row in rows(argv, processes):
            print(row.line())
        return 0
    start = time.perf_counter()
    found = rows(attention_architectures(), processes)
    TABLE.write_text(table(found))
    print(f"{TABLE}: {len(found)} architectures in {time.perf_counter() - start:.0f} s on {processes} processes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
