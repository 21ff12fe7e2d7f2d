# `make test` and `make demo` work on a fresh machine: they create .venv, install the pinned CPU torch
# (torch==2.13.0; an unpinned torch would pull CUDA wheels) and the package, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
TORCH_PIN := torch==2.13.0

.PHONY: install test bench-kernel bench-layer demo clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

test: install
	$(PY) -m pytest -q tests

bench-kernel: install
	$(PY) benchmarks/kernel.py

bench-layer: install
	$(PY) benchmarks/layer.py

demo: install
	@echo "make demo will run 'multihead inspect' on all-MiniLM-L6-v2 once the inspect command lands (issue 4)."
	$(PY) -c "import multihead, torch; q = torch.randn(2, 8, 5, 16); k = v = torch.randn(2, 2, 7, 16); print(multihead.explain(q, k, v, causal=True)); print(multihead.attention(q, k, v, causal=True).shape)"

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
