# asyncload: `make run` (the main job on the embedded default) and `make test` (the test suite).
# Both create .venv on first use; torch is pinned to the CPU build that CI installs (constraints.txt).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: install run test test-slow bench bench-large train s3 lint clean

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

test-slow: install  ## long runs: 100,000+ samples, flat memory, no leaked threads, fds or processes
	$(PY) -m pytest -m slow

bench: install  ## the benchmark suite (SeaweedFS + emulated latency), under 10 minutes on 2 cores
	$(PIP) install -c constraints.txt '.[bench]'
	$(PY) benchmarks/suite.py --config configs/bench.yaml

bench-large: install  ## the same on a bigger machine: more rows, latencies, repetitions, processes
	$(PIP) install -c constraints.txt '.[bench]'
	$(PY) benchmarks/suite.py --config configs/bench_large.yaml

train: install  ## the compact U-Net on the synthetic dataset (torchrun works too: see README)
	$(PY) -m asyncload.train --config configs/train_unet.yaml

s3: install  ## a SeaweedFS S3 server on a free port in the foreground (Ctrl-C stops it)
	$(PY) -m asyncload.testing.seaweed --data data/seaweed

lint: install
	$(PIP) install ruff
	$(PY) -m ruff check asyncload tests benchmarks
	$(PY) -m ruff format --check asyncload tests benchmarks

clean:
	rm -rf $(VENV) data .pytest_cache
