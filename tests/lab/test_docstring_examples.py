"""The runnable examples in the docstrings of the layer, compat, model and inspect modules run as written
(the text model contract's, which needs more globals, in tests/lab/test_models.py)."""

from __future__ import annotations

import doctest

import pytest
import torch

import multihead
from multihead import compat, cost, layer
from multihead.lab.inspect import capture, report, stats, syntax
from multihead.lab.models import loading


@pytest.mark.parametrize(
    "module", [loading, capture, stats, report, cost, syntax, compat, layer], ids=lambda m: m.__name__
)
def test_docstring_examples(module):
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    examples = 0
    for test in finder.find(module, globs={"multihead": multihead, "torch": torch}):
        examples += len(test.examples)
        runner.run(test)
    assert examples > 0, f"{module.__name__} has no docstring example"
    assert runner.failures == 0, f"{runner.failures} docstring example(s) of {module.__name__} failed"
