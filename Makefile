# asyncload: `make run` (the main job on the embedded default) and `make test` (the test suite).
# Both create .venv on first use; torch is pinned to the CPU build that CI installs (constraints.txt).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: install run test test-slow lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c constraints.txt torch
	$(PIP) install -c constraints.txt -e '.[test]'
	touch $@

run: install  ## make a small synthetic dataset, load it through asyncload, print throughput
	$(PY) -m asyncload demo

test: install  ## the test suite (the slow long-run tests are in test-slow)
	$(PY) -m pytest

test-slow: install
	$(PY) -m pytest -m slow

lint: install
	$(PIP) install ruff
	$(PY) -m ruff check asyncload tests benchmarks
	$(PY) -m ruff format --check asyncload tests benchmarks

clean:
	rm -rf $(VENV) data .pytest_cache
