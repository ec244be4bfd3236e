# asyncload: `make run` (the main job on the embedded default) and `make test` (the test suite).
# Both create .venv on first use; torch is pinned to the CPU build that CI installs (constraints.txt).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: install run run-local wheelhouse gpu-check test test-slow docs soak bench bench-pinned bench-large bench-large-data bench-augment netem-deps scaling train train-photos s3 lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c constraints.txt torch
	-$(PIP) uninstall -y asyncload 2>/dev/null  # the distribution's name before it became torch-asyncload
	$(PIP) install -c constraints.txt -e '.[test]'
	-npm install --prefix $(VENV)/azurite --no-audit --no-fund --loglevel=error azurite@3.37.0 || echo "npm unavailable: the Azure tests will skip"
	touch $@

run: install  ## a dataset on a local S3 server behind ~40 ms of emulated latency: synchronous vs asyncload; about 15 s once .venv exists, about 70 s the first time
	-@$(MAKE) --no-print-directory netem-deps
	$(PY) benchmarks/suites/demo.py

# The wheels a GPU node without internet needs (those it lacks of asyncload's runtime dependencies, and
# asyncload's own; the check extra and a setuptools for torch, for make gpu-check), for the node's Python
# and platform, checked to install from the folder alone: docs/guides/air-gapped-gpu.md.
WHEEL_PYTHON ?= 3.12
WHEEL_PLATFORM ?= manylinux2014_x86_64
WHEEL_HAS ?= configs/gpu_node_has.txt
WHEEL_DIR ?= wheelhouse
WHEEL_LIMIT_MIB ?= 64
wheelhouse: install  ## the offline wheelhouse for a GPU node (WHEEL_PYTHON, WHEEL_PLATFORM, WHEEL_HAS, WHEEL_DIR, WHEEL_LIMIT_MIB)
	$(PY) harness/wheelhouse.py --python $(WHEEL_PYTHON) --platform $(WHEEL_PLATFORM) --has $(WHEEL_HAS) --out $(WHEEL_DIR) --limit-mib $(WHEEL_LIMIT_MIB)

# Needs nothing the wheelhouse does not bring (and no install target: on the node there is no index).
gpu-check:  ## the prepared GPU run (under 8 min): CUDA tests, decode="cuda" pairs/s, processes=4, U-Net step rate; CPU parts only without CUDA (GPU_CHECK_ARGS=--quick: a dry run)
	$(or $(wildcard $(PY)),python3) benchmarks/suites/gpu_check.py $(GPU_CHECK_ARGS)

run-local: install  ## the same comparison on a local dataset (no server, no latency)
	$(PY) -m asyncload demo

# -n 3: three pytest-xdist workers, since most of the suite waits (on servers, stalls, child processes);
# loadgroup sends the tests marked xdist_group("process_storms") to one worker, first, one after another.
# --max-worker-restart=0: a worker that dies (a native crash) fails the run (with a replacement worker, xdist
# 3.6's loadgroup scheduler can wait for ever at the end: pytest-xdist #1378). The suite runs once, never again.
test: install  ## the test suite in 3 workers, once (slow long runs: test-slow); a native crash fails it, naming its test, with its core's backtraces; no core is left behind
	@bash harness/run_suite.sh $(PY)

# Strict: a warning, a broken cross-reference or link, or a public name (asyncload.__all__) without an API page
# fails. -E: read every page again, so that a warning is never hidden by an earlier build's cache.
# tests/test_site.py runs the same build, and runs the examples the pages mark <!-- run -->.
SPHINXOPTS ?= -W --keep-going -n -E
docs: install  ## the documentation site (docs/: guides, API reference from the docstrings, architecture, benchmarks) into docs/_build/html
	$(PY) -m sphinx $(SPHINXOPTS) -b html docs docs/_build/html
	@echo "open docs/_build/html/index.html"

test-slow: install  ## long runs: 100,000+ samples, flat memory, no leaked threads, fds or processes; fresh processes reading whole photo epochs with the defaults, locally and on SeaweedFS, with no crash
	$(PY) -m pytest -m slow

soak: install  ## 30 min of a training loop over SeaweedFS (both sources; defaults, processes=2, DataLoader workers) under seeded random faults (SIGSTOP 2-60 s, kill and restart, 503 and reset bursts, SIGKILLed readers and workers): every epoch exactly once or a named error then a retried epoch that is; RSS curve; nothing leaked; summary in benchmarks/results/soak/
	$(PY) -m benchmarks.suites.soak --minutes $(or $(SOAK_MINUTES),30) --seed $(or $(SOAK_SEED),1)

bench: install  ## asyncload against the plain readers and SPDL: JPEG and PNG photos at 50 ms (packet-level as root, else a TCP proxy) and on local disk, ~10 min on 2 cores
	$(PIP) install -c constraints.txt -e '.[bench]'
	$(MAKE) --no-print-directory netem-deps
	$(PY) benchmarks/suites/wan.py --config configs/bench_wan.yaml

bench-pinned: install  ## make bench with the server and the delay line on one core and each reader on the other (the same CPU for every reader), into benchmarks/results/wan/pinned
	$(PIP) install -c constraints.txt -e '.[bench]'
	$(MAKE) --no-print-directory netem-deps
	$(PY) benchmarks/suites/wan.py --config configs/bench_wan.yaml --set pin_cores=true --set out=benchmarks/results/wan/pinned

bench-large: install  ## the WAN suite's sweep: 0/20/50/100 ms, both orders, the DataLoader peers (~1 h on 2 cores)
	$(PIP) install -c constraints.txt -e '.[bench]'
	$(MAKE) --no-print-directory netem-deps
	$(PY) benchmarks/suites/wan.py --config configs/bench_wan_large.yaml

bench-large-data: install  ## a 3.25 GB dataset (100,000 photo rows) against the 4,000-row one, 0 and 50 ms: bytes received per stored byte, samples/s, RSS, full shuffle vs blocks vs Deep Lake's disk cache (~45 min on 2 cores; the data is made once, ~2 min)
	$(PIP) install -c constraints.txt -e '.[bench]'
	$(MAKE) --no-print-directory netem-deps
	$(PY) benchmarks/suites/wan.py --config configs/bench_large_data.yaml
	$(PY) -m benchmarks.reports.large benchmarks/results/large
	$(PY) benchmarks/suites/shuffle_quality.py --out benchmarks/results/large

bench-augment: install  ## random-resized-crop input: built-in augment vs Pillow transforms vs a hand-written reader, 0 and 50 ms, and 2048x2048 RSS (~10 min on 2 cores)
	$(PIP) install -c constraints.txt -e '.[bench]'
	$(MAKE) --no-print-directory netem-deps
	$(PY) benchmarks/suites/augment.py --config configs/bench_augment.yaml

netem-deps:  ## as root, the Debian packages packet-level latency needs (else the benchmarks use the TCP proxy)
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! { command -v gcc && command -v ip && command -v iptables && test -f /usr/include/libnetfilter_queue/libnetfilter_queue.h; } >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 iptables libnetfilter-queue-dev gcc libc6-dev; fi

scaling: install  ## samples/s against worker processes 1..N, asyncload vs DataLoader persistent workers, local and at 50 ms RTT (--small on 2 cores, ~15 min)
	$(PIP) install -c constraints.txt -e '.[bench]'
	-@$(MAKE) --no-print-directory netem-deps
	$(PY) benchmarks/suites/scaling.py --rtt-ms 50 $(if $(filter 1 2,$(shell nproc)),--small,)

train: install  ## the compact U-Net on the synthetic dataset (torchrun works too: see docs/guides/training-loops.md)
	$(PY) -m asyncload.train --config train_unet

train-photos: install  ## the U-Net on photos of many sizes (JPEG + PNG masks, made on first use): random crops, mIoU, ~2 min on 2 cores
	$(PY) -m asyncload.train --config train_unet_photos --set checkpoint=null

s3: install  ## a SeaweedFS S3 server on a free port in the foreground (Ctrl-C stops it)
	$(PY) -m harness.seaweed --data data/seaweed

lint: install
	$(PIP) install ruff
	$(PY) -m ruff check asyncload tests benchmarks
	$(PY) -m ruff format --check asyncload tests benchmarks

clean:
	rm -rf $(VENV) data .pytest_cache docs/_build docs/api/generated
