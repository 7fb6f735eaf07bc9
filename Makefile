# The two commands of the README: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint docs clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "asyncjobq needs Python 3.11+: set PYTHON=python3.11 (or newer)")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -U pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[embedded,dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m asyncjobq demo

# The suite on TEST_WORKERS processes at once (pytest-xdist; conftest.py gives each a server
# of its own). Most tests wait on timers and the database, so more processes than cores pay.
TEST_WORKERS ?= 4

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples docs conftest.py
	$(VENV)/bin/mypy --strict src examples

# The documentation site, offline, into site/: any Sphinx warning fails the build. -E reads
# every page again (a cached page would not repeat its warnings, nor the CLI page see cli.py).
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q --disable-pip-version-check -e '.[embedded,dev,docs]'
	@touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	rm -rf site
	$(VENV)/bin/sphinx-build -E -W --keep-going -q -b html -d $(VENV)/.doctrees docs site
	@echo "built site/index.html"

clean:
	rm -rf $(VENV) .asyncjobq .pytest_cache .mypy_cache .ruff_cache site

# Benchmarks (benchmarks/README.md): the bench extra adds matplotlib, redis-py and py-spy.
BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q --disable-pip-version-check -e '.[embedded,dev,bench]'
	@touch $(BENCH_STAMP)

.PHONY: bench bench-quick

bench: $(BENCH_STAMP)
	$(PY) -m benchmarks.run $(BENCH_ARGS)

bench-quick: $(BENCH_STAMP)
	$(PY) -m benchmarks.run --quick $(BENCH_ARGS)
