"""The fault matrix: real S3 (SeaweedFS) behind :class:`harness.faults.FaultProxy`, read through
``ObjectStoreSource`` (and Deep Lake) with ``AsyncLoader``.

What each row proves, and why it is tested this way:

- **Transient faults are ridden out exactly once.** 500 ``InternalError``, a plain 503, 503 ``SlowDown``,
  429 + ``Retry-After``, a reset in the middle of a body, and the server down for 2 s: the epoch ends
  with every index exactly once (the multiset of ``batch["index"]``, with pixels checked against the
  originals), and the retries show in ``loader.stats()["retries"]`` and ``source.retry_stats()``. The
  proxy's own counters prove the fault really happened the configured number of times.
- **Permanent failures are clear and bounded.** Down for good, or 403 on one key: a ``ReadError`` naming
  the source URL and key, the attempts made and the last cause, within a deadline.
- **on_error="skip"** with keys that always fail (500 after the retries, 404 at once): exactly those
  samples are left out and reported in ``loader.stats()["skipped_samples"]``; every other sample once.
- **Deep Lake** on S3 through the proxy with a 503 burst: Deep Lake retries internally (measured: it
  does), so the epoch completes exactly once.
- **Stragglers** (one GET in 20 stalled 3 s): with hedged reads the epoch must not grow by 3 s per
  straggler.

The matrix (fault × outcome × samples lost/duplicated) is printed at the end of the module. For the rows
whose outcome is an error, "lost" counts the samples not delivered before the error stopped the epoch.
"""

from __future__ import annotations

import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from asyncload import AsyncLoader, DeepLakeSource, ObjectStoreSource, ReadError
from asyncload.errors import StallError
from asyncload.sources.stores.retry import RetryPolicy
from harness.faults import Fault, FaultProxy
from harness.seaweed import SeaweedServer

from .conftest import wait_no_loop_threads
from .remote_fixtures import RemoteData, read_epoch, stem
from .timing import within

OBJECTS = "/files/"  # every object GET of the files dataset (listing requests carry it only in the query)
# A policy that gives up quickly, for the permanent-failure rows (the defaults take ~20 s to give up).
IMPATIENT = RetryPolicy(max_attempts=4, base_delay=0.05, max_delay=0.2)


@dataclass
class Row:
    fault: str
    source: str
    outcome: str
    lost: int
    duplicated: int
    retries: int
    injected: int
    wall_s: float


MATRIX: list[Row] = []


@pytest.fixture(scope="module", autouse=True)
def fault_matrix(request: pytest.FixtureRequest) -> Iterator[list[Row]]:
    """Print the rows the tests recorded, once the module is done (shown without -s too)."""
    yield MATRIX
    if not MATRIX:
        return
    lines = [
        f"{'fault':<26} {'source':<11} {'outcome':<44} {'lost':>4} {'dup':>4} {'retries':>7} {'injected':>8} {'wall s':>6}"
    ]
    for r in MATRIX:
        lines.append(
            f"{r.fault:<26} {r.source:<11} {r.outcome[:44]:<44} {r.lost:>4} {r.duplicated:>4} {r.retries:>7} "
            f"{r.injected:>8} {r.wall_s:>6.1f}"
        )
    text = "\n".join(["", "fault matrix (asyncload via FaultProxy -> SeaweedFS)", *lines])
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if capture is not None:
        with capture.global_and_fixture_disabled():  # module teardown output is captured otherwise
            print(text)
    else:
        print(text)


@pytest.fixture
def proxy(remote_data: RemoteData, running_seaweed: SeaweedServer) -> Iterator[FaultProxy]:
    """A fresh proxy in front of the session's SeaweedFS S3 port (no faults until a test adds them)."""
    with FaultProxy(("127.0.0.1", running_seaweed.port)) as p:
        yield p


def proxied_creds(data: RemoteData, proxy: FaultProxy) -> dict[str, str]:
    """The server's credentials with the proxy as endpoint: requests are signed for the proxy's host."""
    return dict(data.creds(), endpoint_url=proxy.url)


def lost_and_duplicated(seen: list[int], expected: set[int]) -> tuple[int, int]:
    counts = Counter(seen)
    lost = sum(1 for i in expected if counts[i] == 0)
    dup = sum(n - 1 for i, n in counts.items() if n > 1) + sum(n for i, n in counts.items() if i not in expected)
    return lost, dup


# -- transient faults: the epoch completes exactly once ---------------------------------------------------

TRANSIENT = {
    # name: (kind, faults to inject, rule options)
    "500 InternalError burst": (Fault.HTTP_500, 40, {}),
    "503 burst (plain)": (Fault.HTTP_503, 40, {}),
    "503 SlowDown burst": (Fault.SLOW_DOWN, 40, {}),
    "429 Retry-After 0.5s": (Fault.HTTP_429, 16, {"retry_after": 0.5}),
    "reset mid-body": (Fault.RESET, 20, {}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(TRANSIENT))
def test_transient_fault_burst_epoch_is_exactly_once(remote_data: RemoteData, proxy: FaultProxy, name: str) -> None:
    kind, n, options = TRANSIENT[name]
    src = ObjectStoreSource(remote_data.files_url, creds=proxied_creds(remote_data, proxy)).open()
    # Requests 10..10+n of the epoch's object GETs fail: the burst lands mid-epoch, with reads in flight.
    rule = proxy.schedule.burst(kind, n, skip=10, match=OBJECTS, **options)
    loader = AsyncLoader(src, batch_size=16, shuffle=True, seed=1, concurrency=32)
    t0 = time.monotonic()
    seen = read_epoch(iter(loader), remote_data)
    wall = time.monotonic() - t0
    lost, dup = lost_and_duplicated(seen, set(range(remote_data.rows)))
    stats = src.retry_stats()
    MATRIX.append(Row(name, "objectstore", "epoch complete", lost, dup, stats["retries"], rule.hits, wall))
    assert sorted(seen) == list(range(remote_data.rows))
    assert rule.hits == n and proxy.counts()[kind] == n  # the fault really happened n times
    assert stats["retries"] >= n and stats["gave_up"] == 0, stats
    assert loader.stats()["retries"] == stats["retries"] > 0
    if kind is Fault.HTTP_429:
        assert wall >= 0.5  # Retry-After was honoured, not ignored
    wait_no_loop_threads()


@pytest.mark.timeout(60)
def test_server_down_for_two_seconds_mid_epoch_then_back(remote_data: RemoteData, proxy: FaultProxy) -> None:
    """Connections refused and open ones reset for 2 s; the default policy rides it out."""
    src = ObjectStoreSource(remote_data.files_url, creds=proxied_creds(remote_data, proxy)).open()
    loader = AsyncLoader(src, batch_size=8, concurrency=16, prefetch=1)  # most of the epoch still to read
    it = iter(loader)
    seen = next(it)["index"].tolist()
    t0 = time.monotonic()
    proxy.schedule.down(2.0)
    end = time.monotonic() + 1.0
    while proxy.listening and time.monotonic() < end:  # the listener closes on the proxy's loop
        time.sleep(0.005)
    assert not proxy.listening
    read_epoch(it, remote_data, seen)
    wall = time.monotonic() - t0
    lost, dup = lost_and_duplicated(seen, set(range(remote_data.rows)))
    stats = src.retry_stats()
    MATRIX.append(Row("down 2 s, then back", "objectstore", "epoch complete", lost, dup, stats["retries"], 1, wall))
    assert sorted(seen) == list(range(remote_data.rows))
    assert proxy.listening
    assert stats["retries"] > 0 and stats["gave_up"] == 0, stats
    assert loader.stats()["retries"] > 0
    assert wall >= 1.9  # the outage really held the epoch
    wait_no_loop_threads()


# -- permanent failures: a clear error within a deadline -------------------------------------------------------


def full_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@pytest.mark.timeout(60)
def test_server_down_for_good_fails_with_a_clear_error_within_a_deadline(
    remote_data: RemoteData, proxy: FaultProxy
) -> None:
    """Reads wait for a store that is away (one outage, not a retry storm) until stall_timeout, then end in
    a StallError naming the store, the wait, the rows in flight and what the last attempt met."""
    src = ObjectStoreSource(remote_data.files_url, creds=proxied_creds(remote_data, proxy), retry=IMPATIENT).open()
    loader = AsyncLoader(src, batch_size=8, concurrency=16, prefetch=1, stall_timeout=3)
    it = iter(loader)
    t0 = time.monotonic()  # before the store's last answer, from which the stall is timed (it may precede down())
    seen = next(it)["index"].tolist()
    proxy.schedule.down()  # for good
    with pytest.raises(ReadError) as info:
        read_epoch(it, remote_data, seen)
    wall = time.monotonic() - t0
    err = info.value
    text = str(err)
    MATRIX.append(
        Row("down for good", "objectstore", f"stopped: ReadError[{type(err.__cause__).__name__}]", remote_data.rows - len(seen), 0,
            src.retry_stats()["retries"], 1, wall)
    )  # fmt: skip
    assert 3.0 <= wall < within(10.0)
    assert isinstance(err, StallError) and err.waited_s >= 3.0 and err.indices
    assert remote_data.files_url in text and "stall_timeout=3 s" in text and "rows in flight" in text, text
    assert "last attempt:" in text and any(s in text for s in ("Cannot connect", "reset", "Disconnected")), text
    assert src.retry_stats()["gave_up"] == 0  # the outage spent no request's attempts
    assert remote_data.server.secret_key not in full_text(err)
    wait_no_loop_threads()


@pytest.mark.timeout(60)
def test_access_denied_on_one_key_fails_at_once_naming_the_key(remote_data: RemoteData, proxy: FaultProxy) -> None:
    src = ObjectStoreSource(remote_data.files_url, creds=proxied_creds(remote_data, proxy)).open()
    key = f"images/{stem(37)}.png"
    rule = proxy.schedule.always(Fault.HTTP_403, match=key)
    t0 = time.monotonic()
    seen: list[int] = []
    with pytest.raises(ReadError) as info:
        read_epoch(iter(AsyncLoader(src, batch_size=8, concurrency=16)), remote_data, seen)
    wall = time.monotonic() - t0
    err = info.value
    MATRIX.append(
        Row("403 AccessDenied, one key", "objectstore", "stopped: ReadError[PermissionError]",
            remote_data.rows - len(seen), 0, src.retry_stats()["retries"], rule.hits, wall)
    )  # fmt: skip
    assert wall < within(5.0)
    assert isinstance(err, PermissionError) and err.indices == [37] and err.column == "images"
    text = str(err)
    assert f"{remote_data.files_url}/{key}" in text
    assert "1 attempt " in text and "not retryable" in text and "HTTP 403 AccessDenied" in text, text
    assert rule.hits == 1 and src.retry_stats()["retries"] == 0  # a 403 is not retried
    wait_no_loop_threads()


# -- on_error="skip": the permanently failing samples are left out and reported ---------------------------


@pytest.mark.timeout(60)
def test_skip_leaves_out_keys_that_always_fail_and_reports_them(remote_data: RemoteData, proxy: FaultProxy) -> None:
    quick = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05)
    src = ObjectStoreSource(remote_data.files_url, creds=proxied_creds(remote_data, proxy), retry=quick).open()
    broken = {11: Fault.HTTP_500, 60: Fault.HTTP_404}  # 500 after every retry; 404 at once
    rules = [proxy.schedule.always(kind, match=f"masks/{stem(i)}.png") for i, kind in broken.items()]
    loader = AsyncLoader(src, batch_size=16, shuffle=True, seed=4, concurrency=32, on_error="skip")
    t0 = time.monotonic()
    seen = read_epoch(iter(loader), remote_data)
    wall = time.monotonic() - t0
    expected = set(range(remote_data.rows)) - set(broken)
    lost, dup = lost_and_duplicated(seen, expected)
    stats = loader.stats()
    MATRIX.append(
        Row("500-always + 404-always", "objectstore", f"skipped {stats['skipped']}, rest complete", lost, dup,
            stats["retries"], sum(r.hits for r in rules), wall)
    )  # fmt: skip
    assert sorted(seen) == sorted(expected)  # every other sample exactly once
    assert stats["skipped"] == 2
    reasons = dict(stats["skipped_samples"])
    assert set(reasons) == set(broken)
    assert "after 3 attempts" in reasons[11] and "HTTP 500 InternalError" in reasons[11], reasons[11]
    assert "1 attempt " in reasons[60] and "NoSuchKey" in reasons[60], reasons[60]
    assert all(f"masks/{stem(i)}.png" in reasons[i] for i in broken)
    assert rules[0].hits == 3 and rules[1].hits == 1
    wait_no_loop_threads()


# -- Deep Lake on S3 ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_deeplake_rides_out_a_503_burst(remote_data: RemoteData, proxy: FaultProxy) -> None:
    """Deep Lake retries 5xx inside its storage layer (measured: 20 consecutive 503s cost ~2 s)."""
    src = DeepLakeSource(remote_data.deeplake_url, creds=proxied_creds(remote_data, proxy)).open()
    rule = proxy.schedule.burst(Fault.HTTP_503, 20, match="/seg/")
    loader = AsyncLoader(src, batch_size=16, shuffle=True, seed=2, concurrency=32)
    t0 = time.monotonic()
    outcome = "epoch complete"
    seen: list[int] = []
    try:
        read_epoch(iter(loader), remote_data, seen)
    except ReadError as exc:  # recorded if a Deep Lake version stops retrying; the asserts then fail
        outcome = f"ReadError: {exc}"
    wall = time.monotonic() - t0
    lost, dup = lost_and_duplicated(seen, set(range(remote_data.rows)))
    MATRIX.append(
        Row(
            "503 burst",
            "deeplake",
            outcome,
            lost,
            dup,
            proxy.counts()["requests"] - proxy.counts()["forwarded"],
            rule.hits,
            wall,
        )
    )
    assert outcome == "epoch complete"
    assert sorted(seen) == list(range(remote_data.rows))
    assert rule.hits == 20
    wait_no_loop_threads()


# -- stragglers (hedged reads) ------------------------------------------------------------------------------------

STALL_S = 3.0
STALLS = 5


@pytest.mark.timeout(60)
def test_stragglers_do_not_cost_their_stall_with_hedged_reads(remote_data: RemoteData, proxy: FaultProxy) -> None:
    """Object GETs stalled 3 s (one in 20, five in all, each key at most once): the epoch must not grow
    by 3 s per straggler.

    Low concurrency and in-order delivery make stalls serialise: without hedging every straggler adds
    its full 3 s (~15 s here). With hedged reads (a second request once a read takes 3x the recent p99,
    active after 64 reads) each costs a fraction of a second; the hedged-away request still runs to its
    end before the epoch finishes, so at most one stall's tail (3 s) shows at the end. The stalls start
    after 70 reads, once hedging has the latencies it needs. The epoch is abandoned once past the bound,
    so a failing run stays short.
    """
    rows = 240  # the 96 stored rows, repeated by the manifest: enough reads for hedging to warm up
    manifest = [stem(i % remote_data.rows) for i in range(rows)]
    src = ObjectStoreSource(remote_data.files_url, creds=proxied_creds(remote_data, proxy), manifest=manifest).open()

    def make() -> AsyncLoader:
        return AsyncLoader(src, batch_size=2, concurrency=2, prefetch=1, read_mode="row")

    t0 = time.monotonic()
    baseline = [i for b in make() for i in b["index"].tolist()]
    base_s = time.monotonic() - t0
    assert sorted(baseline) == list(range(rows))
    rule = proxy.schedule.add(
        Fault.STALL, count=STALLS, skip=140, every=20, stall_s=STALL_S, match=OBJECTS, once_per_key=True
    )
    bound = base_s + 0.5 * STALL_S * STALLS  # on average under half a stall per straggler
    seen: list[int] = []
    loader = make()
    t0 = time.monotonic()
    with iter(loader) as it:
        for b in it:
            seen += b["index"].tolist()
            if time.monotonic() - t0 > bound:
                break
    wall = time.monotonic() - t0
    complete = sorted(seen) == list(range(rows))
    extra = wall - base_s
    st = loader.stats()
    lost, dup = lost_and_duplicated(seen, set(range(rows)))
    MATRIX.append(
        Row(f"stall 3 s x{rule.hits} (1 GET in 20)", "objectstore",
            f"{'complete' if complete else 'abandoned'} +{extra:.1f}s, {st.get('hedges', 0)} hedges",
            lost, dup, src.retry_count(), rule.hits, wall)
    )  # fmt: skip
    assert rule.hits == STALLS
    assert complete, f"epoch not done within {bound:.1f}s (baseline {base_s:.2f}s, {rule.hits} stragglers)"
    assert extra < 0.5 * STALL_S * rule.hits, f"+{extra:.1f}s for {rule.hits} stragglers of {STALL_S}s"
    assert st["hedges"] >= STALLS, st
