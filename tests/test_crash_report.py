"""``harness.crash_report``'s recognition of Deep Lake's known crash inside ``Future.__await__``: the one
crash ``make test`` answers by running the suite once more (``harness/run_suite.sh``). Anything else that
kills a worker, even in Deep Lake's module, fails the run."""

from __future__ import annotations

from harness.crash_report import known_deeplake_await_crash

HEAD = "tests/test_x.py ..F\nFatal Python error: Segmentation fault\n\n"


def thread(*frames: str) -> str:
    return (
        "Current thread 0x00007f53655ff6c0 (most recent call first):\n"
        + "".join(f'  File "{f}\n' for f in frames)
        + '\nThread 0x00007f53615f76c0 (most recent call first):\n  File "/x/threading.py", line 331 in wait\n'
    )


def test_the_await_in_deeplake_source_read_is_recognised() -> None:
    log = HEAD + thread(
        '/w/asyncload/sources/deeplake.py", line 387 in read',
        '/w/tests/conftest.py", line 188 in read',
        '/w/asyncload/runtime/loop.py", line 288 in main',
    )
    assert known_deeplake_await_crash(log)


def test_the_faulting_thread_is_found_among_the_others() -> None:
    other = 'Thread 0x1 (most recent call first):\n  File "/x/concurrent/futures/thread.py", line 81 in _worker\n\n'
    log = HEAD + other + thread('/w/asyncload/sources/deeplake.py", line 387 in read')
    assert known_deeplake_await_crash(log)


def test_any_other_crash_is_not() -> None:
    assert not known_deeplake_await_crash("1 failed, 600 passed\n")
    assert not known_deeplake_await_crash(HEAD + thread('/w/asyncload/engine/pipeline.py", line 3 in run'))
    assert not known_deeplake_await_crash(HEAD + thread('/w/asyncload/sources/deeplake.py", line 200 in _open'))
    assert not known_deeplake_await_crash(
        HEAD.replace("Segmentation fault", "Aborted") + thread('/w/asyncload/sources/deeplake.py", line 387 in read')
    )
