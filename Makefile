# slinfer: `make run` starts the local stack, `make test` runs the tests.
# Both create .venv (Python 3.11) and install the project on first use; the install re-runs
# only when pyproject.toml changes.

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.slinfer-installed
ARGS        ?=
PYTEST_ARGS ?=
PIP_ARGS    ?=

.PHONY: run test install clean distclean help

help:
	@echo "make run [ARGS='--port 8000 --nodes 1 --data-dir .data']  start the local stack (slinfer up)"
	@echo "make test [PYTEST_ARGS='-k launcher']                     run the test suite"
	@echo "make install                                               create .venv and install"
	@echo "make clean / make distclean                                remove caches and .data / also .venv"

run: $(STAMP)
	$(BIN)/slinfer up $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

install: $(STAMP)

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=/path/to/python3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install $(PIP_ARGS) -e ".[dev]"
	touch $@

clean:
	rm -rf .data .pytest_cache .hypothesis .ruff_cache build dist *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
