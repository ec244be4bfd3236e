#!/usr/bin/env bash
# make test: the suite in 3 pytest-xdist workers, then the backtraces of any native crash (crash_report).
# A worker killed by Deep Lake 4.7.4's own crash inside Future.__await__ (a read awaited in the pytest
# process, processes=0; benchmarks/results/isolation/deeplake_await_crash.md) ends the run: that run is
# printed whole, with its core's backtraces, and the suite runs again, three runs at most; any other
# failure fails. Usage: harness/run_suite.sh PYTHON [pytest args...]
set -u
py=$1
shift
ulimit -c unlimited 2>/dev/null
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for attempt in 1 2 3; do
	start=$(date +%s)
	"$py" -m pytest -n 3 --dist loadgroup --max-worker-restart=0 "$@" 2>&1 | tee "$log"
	rc=${PIPESTATUS[0]}
	"$py" -m harness.crash_report "$rc" "$py" "$start"
	if [ "$rc" -eq 0 ] || [ "$attempt" -eq 3 ] || ! "$py" -m harness.crash_report --known "$log"; then
		exit "$rc"
	fi
	echo "=== a pytest worker died of Deep Lake's known crash in Future.__await__ (above): the suite runs again ==="
done
