# `make demo` runs the main job; `make test` runs every check. Both build their own
# virtual environments, so a fresh clone needs nothing else (Python 3.11, no GPU).

PYTHON ?= python3.11
VENV ?= .venv
VENV_OLDEST ?= .venv-oldest
PIP_FLAGS ?= --disable-pip-version-check --quiet --quiet
BIN := $(VENV)/bin
BIN_OLDEST := $(VENV_OLDEST)/bin
PLUGINS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
PACKAGES := -e . $(addprefix -e ,$(PLUGINS))
PYTEST_FLAGS ?= -q
# the core suite is mostly subprocesses and tiny models: two workers use both CI cores
PYTEST_WORKERS ?= -n 2

.PHONY: all venv venv-oldest demo test lint typecheck docs unit unit-oldest clean

all: test

$(VENV)/.installed: pyproject.toml constraints.txt requirements-dev.txt docs/requirements.txt _hfpatch_autorun.py $(wildcard plugins/*/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(PIP_FLAGS) -c constraints.txt -r requirements-dev.txt -r docs/requirements.txt $(PACKAGES)
	touch $@

$(VENV_OLDEST)/.installed: pyproject.toml constraints-oldest.txt docs/requirements.txt _hfpatch_autorun.py $(wildcard plugins/*/pyproject.toml)
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(BIN_OLDEST)/python -m pip install $(PIP_FLAGS) -c constraints-oldest.txt -r docs/requirements.txt pytest pytest-xdist hypothesis hatchling ruff $(PACKAGES)
	touch $@

venv: $(VENV)/.installed
venv-oldest: $(VENV_OLDEST)/.installed

demo: venv
	$(BIN)/hfpatch demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

# The documentation site (its build and every Python snippet also run in tests/test_docs.py).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d .site

# The core suite, then each first-party pack's own suite from its directory.
unit: venv
	$(BIN)/python -m pytest $(PYTEST_FLAGS) $(PYTEST_WORKERS)
	@for plugin in $(PLUGINS); do echo "== $$plugin"; (cd $$plugin && $(CURDIR)/$(BIN)/python -m pytest $(PYTEST_FLAGS)) || exit 1; done

# The same suites against transformers 5.3.0, the oldest release hfpatch supports.
unit-oldest: venv-oldest
	$(BIN_OLDEST)/python -m pytest $(PYTEST_FLAGS) $(PYTEST_WORKERS)
	@for plugin in $(PLUGINS); do echo "== $$plugin"; (cd $$plugin && $(CURDIR)/$(BIN_OLDEST)/python -m pytest $(PYTEST_FLAGS)) || exit 1; done

test: lint typecheck docs unit unit-oldest

clean:
	rm -rf $(VENV) $(VENV_OLDEST) .site .pytest_cache .mypy_cache .ruff_cache
