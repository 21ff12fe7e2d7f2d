"""The runnable examples in the docstrings of the model and inspect modules run and print what they say."""

from __future__ import annotations

import doctest

import pytest
import torch

import multihead
from multihead import cost
from multihead.inspect import capture, report, stats, syntax
from multihead.models import bert, loading


@pytest.mark.parametrize("module", [bert, loading, capture, stats, report, cost, syntax], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    examples = 0
    for test in finder.find(module, globs={"multihead": multihead, "torch": torch}):
        examples += len(test.examples)
        runner.run(test)
    assert examples > 0, f"{module.__name__} has no docstring example"
    assert runner.failures == 0, f"{runner.failures} docstring example(s) of {module.__name__} failed"
