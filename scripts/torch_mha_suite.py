"""Run PyTorch's own MultiheadAttention tests against multihead.compat and print a per-test table.

PyTorch's ``test/nn/test_multihead_attention.py`` is not in the torch wheel and none of its code
lives in this repository: get a copy of the file that matches your torch, then

    python scripts/torch_mha_suite.py path/to/test_multihead_attention.py

(it needs ``expecttest`` and ``numpy``, which torch's test helpers import). Each test runs twice:

    module      torch.nn.MultiheadAttention is multihead.compat.MultiheadAttention (also the name the
                test file imports, and the one torch.nn.TransformerEncoderLayer builds)
    +functional ... and torch.nn.functional.multi_head_attention_forward is
                multihead.compat.multi_head_attention_forward

A test that fails for a documented reason (docs/compat.md) is shown as "documented" with the reason.
The exit status is 0 when every other test passed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import re
import sys
import unittest
import warnings
from pathlib import Path
from unittest import mock

import torch

from multihead import compat

# Failures with a documented reason (docs/compat.md): (test name prefix, runs it applies to, a regex the
# error must match, the reason). A failure that does not match its regex is not excused.
DOCUMENTED = [
    (
        "test_multihead_self_attn_two_masks_fast_path_mock",
        ("module", "+functional"),
        r"False is not true",
        "mocks torch._native_multi_head_attention (torch's BetterTransformer fast path) and asserts it was called; "
        "the drop-in never calls torch's fused kernels, it runs multihead's",
    ),
    (
        "test_multihead_attn_fast_path_query_and_bias_have_different_dtypes",
        ("module", "+functional"),
        r"in_proj_bias: expected dtype torch.float64, like the other parameters, got torch.float16",
        "an in_proj_bias of another dtype than the other parameters: only torch's fast path accepts it (its own "
        "slow path fails in F.linear); the drop-in refuses it with a DtypeError naming in_proj_bias",
    ),
    (
        "test_multihead_attention_average_attn_weights",
        ("+functional",),
        r"nan location mismatch",
        "a query whose keys are all masked (its random attn_mask masks every key): torch and the numpy reference give "
        "NaN, multihead gives 0 by design",
    ),
]


class _Recorder(unittest.TestResult):
    """Outcome and a one-line reason per test id."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, tuple[str, str]] = {}

    @staticmethod
    def _id(test) -> str:
        return test.id().split(".", 1)[-1]  # Class.test_name, without the module's (per-run) name

    def addSuccess(self, test):
        self.outcomes[self._id(test)] = ("pass", "")

    def _failed(self, test, err, outcome):
        error = err[1]
        self.outcomes[self._id(test)] = (outcome, f"{type(error).__name__}: {str(error).strip()}")

    def addFailure(self, test, err):
        self._failed(test, err, "FAIL")

    def addError(self, test, err):
        self._failed(test, err, "ERROR")

    def addSkip(self, test, reason):
        self.outcomes[self._id(test)] = ("skip", reason[:160])

    def addExpectedFailure(self, test, err):
        self.outcomes[self._id(test)] = ("xfail", "")

    def addUnexpectedSuccess(self, test):
        self.outcomes[self._id(test)] = ("pass", "unexpected success")


def run(path: Path, functional: bool) -> dict[str, tuple[str, str]]:
    """Import the test file under the patches and run every test in it."""
    name = f"_torch_mha_suite_{'functional' if functional else 'module'}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.nn.MultiheadAttention", compat.MultiheadAttention))
        stack.enter_context(mock.patch("torch.nn.modules.transformer.MultiheadAttention", compat.MultiheadAttention))
        if functional:
            stack.enter_context(
                mock.patch("torch.nn.functional.multi_head_attention_forward", compat.multi_head_attention_forward)
            )
        sys.modules[name] = module
        spec.loader.exec_module(module)  # the file does `from torch.nn import MultiheadAttention`: patched above
        assert module.MultiheadAttention is compat.MultiheadAttention
        suite = unittest.defaultTestLoader.loadTestsFromModule(module)
        result = _Recorder()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            suite.run(result)
    return result.outcomes


def _documented(test_id: str, run_name: str, error: str) -> str | None:
    method = test_id.rsplit(".", 1)[-1]
    return next(
        (
            why
            for name, runs, pattern, why in DOCUMENTED
            if method.startswith(name) and run_name in runs and re.search(pattern, error)
        ),
        None,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file", type=Path, help="PyTorch's test/nn/test_multihead_attention.py")
    args = parser.parse_args(argv)
    if not args.test_file.is_file():
        parser.error(f"test_file: expected an existing file, got {str(args.test_file)!r}")
    columns = {"module": run(args.test_file, functional=False), "+functional": run(args.test_file, functional=True)}
    tests = sorted(set().union(*columns.values()))
    width = max(len(t) for t in tests)
    print(f"torch {torch.__version__}; {args.test_file}\n")
    print(f"{'test':<{width}}  {'module':<10}  {'+functional':<11}  reason")
    tally: dict[str, int] = {}
    for test in tests:
        cells, reasons = [], []
        for run_name, outcomes in columns.items():
            outcome, reason = outcomes.get(test, ("absent", ""))
            why = _documented(test, run_name, reason) if outcome in ("FAIL", "ERROR") else None
            if why:
                outcome, reason = "documented", why
            reason = (reason.splitlines() or [""])[0][:200]
            tally[outcome] = tally.get(outcome, 0) + 1
            cells.append(outcome)
            if reason and reason not in reasons:
                reasons.append(reason)
        print(f"{test:<{width}}  {cells[0]:<10}  {cells[1]:<11}  {' | '.join(reasons)}")
    unexplained = tally.get("FAIL", 0) + tally.get("ERROR", 0)
    print(
        f"\n{len(tests)} tests x 2 runs: "
        + ", ".join(f"{n} {c}" for c, n in sorted(tally.items()))
        + f"; {unexplained} failures not documented"
    )
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
