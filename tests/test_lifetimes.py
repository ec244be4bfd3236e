"""Threads and processes end when they should: epoch end, break, close, GC, errors, interpreter exit.

Loaders here read with ``processes=0``: the tests watch the engine in this process (its loop thread, the
source's own counters), which is what a Deep Lake reader process runs too."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import time

import pytest

from asyncload import AsyncLoader, DeepLakeSource
from asyncload.errors import LoaderClosedError

from .conftest import loop_threads, wait_no_loop_threads
from .sources import DelayedSource

pytestmark = pytest.mark.timeout(60)


def test_break_out_of_a_for_loop_stops_the_thread(seg_url) -> None:
    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=4, concurrency=64, processes=0)
    for n, _ in enumerate(loader):
        if n == 2:
            break
    wait_no_loop_threads()


def test_close_mid_epoch_with_reads_in_flight(seg_url) -> None:
    src = DelayedSource(seg_url, lambda idx: 0.2)
    loader = AsyncLoader(src, batch_size=4, concurrency=32, processes=0)
    it = iter(loader)
    next(it)
    assert src.in_flight > 0
    it.close()
    assert src.in_flight == 0  # in-flight reads were cancelled (this source allows it) or awaited, none left
    wait_no_loop_threads()
    with pytest.raises(LoaderClosedError, match="was closed while this epoch was being read"):
        next(it)  # stopped, not finished: never StopIteration


def test_close_after_the_last_batch_was_issued_is_prompt(seg_url) -> None:
    """Regression: stop() drained the producer's end markers and close() waited its full timeout."""
    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=16, shutdown_timeout=30, processes=0)
    it = iter(loader)
    for _ in range(len(loader) - 1):
        next(it)
    t0 = time.perf_counter()
    it.close()
    assert time.perf_counter() - t0 < 2.0
    wait_no_loop_threads(2.0)


def test_garbage_collected_iterator_stops_the_thread(seg_url) -> None:
    it = iter(AsyncLoader(DeepLakeSource(seg_url), batch_size=4, processes=0))
    next(it)
    assert loop_threads()
    del it
    gc.collect()
    wait_no_loop_threads()


def test_context_manager_and_new_epoch_close_the_previous_one(seg_url) -> None:
    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=4, processes=0)
    first = iter(loader)
    next(first)
    second = iter(loader)  # a loader runs one epoch at a time
    with pytest.raises(LoaderClosedError):  # the first was stopped, not finished
        next(first)
    with second:
        assert next(second)["index"].tolist() == [0, 1, 2, 3]
    wait_no_loop_threads()


def test_an_error_stops_the_thread(seg_url) -> None:
    def boom(sample):
        if sample["index"] == 37:
            raise ValueError("bad pixel")
        return sample

    with pytest.raises(ValueError, match="bad pixel"):
        list(AsyncLoader(DeepLakeSource(seg_url), batch_size=8, transform=boom, processes=0))
    wait_no_loop_threads()


def test_close_interrupted_by_ctrl_c_can_be_finished_by_a_second_close(seg_url) -> None:
    """Regression: a KeyboardInterrupt while close() waited for reads left the loop thread running and
    later close() calls (the exit hook's too) returned at once."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    src = DelayedSource(seg_url, lambda idx: 1.0)
    src.cancel_safe = False  # reads that close() must wait for, as Deep Lake's (cancelled ones would not be)
    it = iter(AsyncLoader(src, batch_size=4, concurrency=8, processes=0))
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with pytest.raises(LoaderClosedError):
            # the first next() waits ~1 s for a batch; the alarm fires during close() below instead
            signal.setitimer(signal.ITIMER_REAL, 1.5)
            next(it)
            with pytest.raises(KeyboardInterrupt):
                it.close()
            assert loop_threads()  # interrupted: not stopped yet
            it.close()
            next(it)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    wait_no_loop_threads()


@pytest.mark.parametrize("lands", ["before", "after"])
def test_ctrl_c_while_an_epoch_hands_its_pipeline_to_the_loop_leaves_no_unawaited_coroutine(
    seg_url, monkeypatch, lands
) -> None:
    """A Ctrl-C landing inside ``LoopThread.submit``, before or after the loop was handed the pipeline's
    coroutine (where CPython raised it once in ~500 runs of the Ctrl-C suite), raises KeyboardInterrupt
    and nothing else: no "coroutine 'Pipeline.run' was never awaited" at exit, no pipeline left running;
    the loader reads a whole epoch afterwards."""
    import asyncio
    import warnings

    real = asyncio.run_coroutine_threadsafe

    def interrupted(coro, loop):
        if lands == "after":
            real(coro, loop)
        raise KeyboardInterrupt

    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=8, processes=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", interrupted)
        it = iter(loader)
        with pytest.raises(KeyboardInterrupt):
            next(it)
        monkeypatch.undo()
        it.close()
        del it
        gc.collect()
    assert not [str(w.message) for w in seen if "never awaited" in str(w.message)]
    wait_no_loop_threads()
    assert sorted(i for b in loader for i in b["index"].tolist()) == list(range(len(loader.source)))
    wait_no_loop_threads()


@pytest.mark.timeout(60)
def test_exit_stops_run_stage_by_stage_whatever_the_registration_order() -> None:
    """Interpreter exit runs every pending stop once, epochs' work first and store handles last; a stop
    already run (``close()``) or whose owner was collected does not run again."""
    code = textwrap.dedent(
        """
        import gc
        import functools
        from asyncload.runtime.loop import ExitOrder, on_exit

        say = functools.partial(print, flush=True)

        class Owner:
            pass

        keep = []
        for stage in (ExitOrder.STORES, ExitOrder.WORKERS, ExitOrder.LOOPS, ExitOrder.WORK):
            owner = Owner()
            keep.append(owner)
            on_exit(owner, stage, say, stage.name)
        closed = Owner()
        keep.append(closed)
        on_exit(closed, ExitOrder.WORK, say, "closed-twice")()
        gone = Owner()
        on_exit(gone, ExitOrder.WORK, say, "collected")
        del gone
        gc.collect()
        print("main done", flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:-1] == [
        "closed-twice",
        "collected",
        "main done",
        "WORK",
        "LOOPS",
        "WORKERS",
        "STORES",
    ]


@pytest.mark.timeout(30)
def test_an_epoch_stopped_from_its_own_loop_thread_still_stops_that_thread(seg_url) -> None:
    """A garbage-collection pass can run an epoch's finaliser on the epoch's own loop thread, which cannot
    wait for itself: the stop must still happen (on another thread), not leave the loop running."""
    import asyncio

    it = iter(AsyncLoader(DeepLakeSource(seg_url), batch_size=8, concurrency=4, processes=0))
    next(it)
    run = it._run  # what the epoch's finaliser stops

    async def stop_here() -> None:
        run.stop()

    asyncio.run_coroutine_threadsafe(stop_here(), run.lt.loop).result(5)
    wait_no_loop_threads()
    assert run.stopped


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_a_read_completed_after_its_waiter_was_cancelled_is_not_reported_but_other_errors_are(kind, caplog) -> None:
    """Loop shutdown cancels what is left; a store thread that completes such a read afterwards makes
    ``set_result`` raise in a callback. That is dropped (it printed after a Ctrl-C traceback, once in 100
    runs); any other callback error still reaches asyncio's handler."""
    import asyncio
    import logging

    from asyncload.runtime.loop import _late_completion, _new_event_loop

    loop = _new_event_loop(kind)
    loop.set_exception_handler(_late_completion)

    async def main() -> None:
        fut = loop.create_future()
        fut.cancel()
        loop.call_soon(fut.set_result, b"bytes")
        loop.call_soon(lambda: 1 / 0)
        await asyncio.sleep(0.05)

    with caplog.at_level(logging.DEBUG):
        loop.run_until_complete(main())
    loop.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "ZeroDivisionError" in (errors[0].exc_text or str(errors[0].exc_info))
    assert any("completed after its waiter was cancelled" in r.getMessage() for r in caplog.records)
