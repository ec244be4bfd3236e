#!/usr/bin/env bash
# make test: the suite once, in 3 pytest-xdist workers. Its exit status is pytest's: nothing is run again.
# A native crash fails the run and harness/crash_report.py prints the test it killed and its core's backtraces.
# Cores: the kernel writes one into the crashing process's working directory (core_pattern "core"); each is
# moved into a private temporary directory after the run, reported from there, and removed with it, so the
# checkout and the user's directories keep none. A core is capped at CORE_CAP_MB (4 GiB; a pytest worker that
# imported torch and Deep Lake dumps ~2.3 GB). Usage: harness/run_suite.sh PYTHON [pytest args...]
set -u
py=$1
shift
cores=$(mktemp -d "${TMPDIR:-/tmp}/asyncload-cores.XXXXXX")
trap 'rm -rf "$cores"' EXIT
touch "$cores/.start"
# Bytecode first, once: where PYTHONDONTWRITEBYTECODE is set (this project's machines set it), every process the
# suite starts (reader processes, spawned workers, scripts) would otherwise compile asyncload's modules again,
# ~0.25 s of CPU each (an installed wheel's users never pay it: pip compiles at install). The interpreter still
# reads what is there; __pycache__ is ignored by git.
"$py" -m compileall -q -j 0 asyncload tests benchmarks harness >/dev/null || exit 1
ulimit -c $(( ${CORE_CAP_MB:-4096} * 1024 )) 2>/dev/null  # in 1024-byte blocks
"$py" -m pytest -n 3 --dist loadgroup --max-worker-restart=0 "$@" 2>&1 | tee "$cores/pytest.log"
rc=${PIPESTATUS[0]}
"$py" -m harness.crash_report --status "$rc" --python "$py" --since "$cores/.start" --log "$cores/pytest.log" --into "$cores"
exit "$rc"
