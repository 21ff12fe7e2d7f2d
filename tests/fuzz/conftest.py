"""The fuzz suite: hypothesis over the public API, the cache, compat vs torch, masks and the CLI.

Budgets: ``make test`` runs every fuzz test with a small, seeded budget (the "ci" profile: the
same examples on every run, so CI is deterministic); ``make fuzz`` runs the "long" profile
(MULTIHEAD_FUZZ=long: many more examples, a fresh random seed each run, printed by hypothesis).
MULTIHEAD_FUZZ_EXAMPLES overrides the number of examples of either profile.

Every case a fuzz test tries is recorded in the ``tally`` fixture under one outcome:

    ok                  a valid call whose result is right (or a bad input rejected clearly)
    crash               an exception that is not multihead's input error (a raw torch or Python error)
    poor_message        an input error whose message lacks the "<arg>: expected ..., got .... Fix: ..." form
    nan                 NaN or inf in a result where the oracle has none
    wrong               a result off the float64 oracle by more than the documented tolerance
    bad_input_accepted  a bad input that raised nothing
    state_corrupted     a failed call that changed a cache, table or module

The session writes the counts to ``fuzz-tally.json`` (in MULTIHEAD_FUZZ_TALLY's folder, default the
test-artifacts/) and prints them: these are the figures the issue's closing note asks for. Tests assert
on their own cases; the tally only counts.
"""

from __future__ import annotations

import collections
import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from multihead._errors import InputError

OUTCOMES = ("ok", "crash", "poor_message", "nan", "wrong", "bad_input_accepted", "state_corrupted")
MESSAGE_FORM = re.compile(r"^\S.*: expected .+, got .+\. Fix: .+", re.DOTALL)

_EXAMPLES = os.environ.get("MULTIHEAD_FUZZ_EXAMPLES")
settings.register_profile(
    "ci",
    max_examples=int(_EXAMPLES or 25),
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile(
    "long",
    max_examples=int(_EXAMPLES or 2000),
    derandomize=False,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.load_profile("long" if os.environ.get("MULTIHEAD_FUZZ") == "long" else "ci")


class Tally:
    """Counts of outcomes per fuzz test; see the module docstring for the outcomes."""

    def __init__(self) -> None:
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.examples: dict[str, list[str]] = collections.defaultdict(list)  # first few non-ok cases per outcome

    def record(self, test: str, outcome: str, detail: str = "") -> str:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; one of {OUTCOMES}")
        self.counts[test][outcome] += 1
        if outcome != "ok" and len(self.examples[outcome]) < 20:
            self.examples[outcome].append(f"{test}: {detail}")
        return outcome

    def rejection(self, test: str, error: BaseException | None) -> str:
        """Record how a bad input was handled: raised ``error`` (None: accepted)."""
        if error is None:
            return self.record(test, "bad_input_accepted")
        if not isinstance(error, InputError):
            return self.record(test, "crash", f"{type(error).__name__}: {error}")
        if not MESSAGE_FORM.match(str(error)):
            return self.record(test, "poor_message", str(error))
        return self.record(test, "ok")

    def totals(self) -> collections.Counter:
        total: collections.Counter = collections.Counter()
        for counts in self.counts.values():
            total.update(counts)
        return total


_TALLY = Tally()


@pytest.fixture
def tally(request) -> Tally:
    """Record every case under one outcome: ``tally.record(request.node.name, outcome)`` or ``tally.rejection``."""
    return _TALLY


def pytest_sessionfinish(session, exitstatus) -> None:
    if not _TALLY.counts:
        return
    totals = _TALLY.totals()
    summary = {
        "cases": sum(totals.values()),
        **{outcome: totals.get(outcome, 0) for outcome in OUTCOMES},
        "per_test": {test: dict(counts) for test, counts in sorted(_TALLY.counts.items())},
        "examples": dict(_TALLY.examples),
    }
    folder = Path(os.environ.get("MULTIHEAD_FUZZ_TALLY", Path(__file__).resolve().parents[2] / "test-artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fuzz-tally.json").write_text(json.dumps(summary, indent=1))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            "fuzz tally: " + ", ".join(f"{outcome} {summary[outcome]}" for outcome in ("cases", *OUTCOMES))
        )
