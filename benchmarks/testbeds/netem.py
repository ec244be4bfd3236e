"""Emulated WAN latency for the benchmarks: packet-level where the machine allows it, a TCP proxy otherwise.

Why packet-level: a TCP proxy on loopback (``harness.delayline``) delays bytes, but the
client's own TCP connection is a loopback one, so its slow start, its congestion window and the cost of
opening many fresh connections never show. Here every packet, SYN and ACK included, is held for half
the round trip in each direction, so a client's TCP behaves as on a WAN.

Topology (all of it private to this run, removed on exit)::

    client namespace  al-c-<pid>  10.201.47.1/30 ── veth ── 10.201.47.2/30  al-s-<pid>  server namespace
        benchmark readers                                                     SeaweedFS (weed mini)
        iptables INPUT -i veth → NFQUEUE 0 → nfq_delay (RTT/2)               iptables INPUT → NFQUEUE 0 → nfq_delay (RTT/2)

The delay is applied where packets *arrive* (INPUT, both namespaces), not where they leave: a packet
held in the OUTPUT hook is still charged to its sending socket, and TCP small queues then stop the sender
after a couple of packets (measured: ~2 MB/s at 50 ms instead of a window-limited stream). Once a
packet crossed the veth it is no longer the socket's, so holding it on arrival costs the sender nothing.

``nfq_delay.c`` (beside this file, compiled on first use with gcc against libnetfilter_queue) holds
packets in a FIFO with release time = arrival + delay and never serialises them, so bandwidth is not
throttled; an optional cap is an HTB qdisc on each veth. Only the two namespaces made here carry the
traffic: nothing is added to the root namespace, and nothing is routed off this machine.

Without root, network namespaces, iptables with the NFQUEUE target, or gcc and libnetfilter-queue, the
same interface falls back to ``DelayLineProcess`` on loopback, and ``emulation`` says so; every report
prints it.

    python benchmarks/testbeds/netem.py check --rtt 0 20 50 100     # the path check, JSON on stdout
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PACKET = "packet-level NFQUEUE"
PROXY = "TCP proxy fallback"
CLIENT_IP, SERVER_IP = "10.201.47.1", "10.201.47.2"
_CLONE_NEWNET = 0x40000000


class Network(Protocol):
    """What the benchmark needs from an emulated network, whichever kind it is."""

    emulation: str
    server_host: str  # the address the S3 server binds to

    def set_rtt(self, rtt_s: float) -> None: ...
    def url(self, port: int) -> str: ...
    def enter_server(self) -> None: ...
    def enter_client(self) -> None: ...
    def describe(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def _setns(path: str) -> None:
    """Move the calling thread (and every thread and process it starts later) into a network namespace."""
    fd = os.open(path, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def build_helper(out_dir: Path) -> Path:
    """Compile ``nfq_delay.c`` into ``out_dir`` unless an up-to-date binary is there."""
    src = HERE / "nfq_delay.c"
    exe = out_dir / "nfq_delay"
    if exe.exists() and exe.stat().st_mtime >= src.stat().st_mtime:
        return exe
    out_dir.mkdir(parents=True, exist_ok=True)
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc) to build nfq_delay")
    p = subprocess.run(
        [cc, "-O2", "-o", str(exe), str(src), "-lnetfilter_queue", "-lnfnetlink"], capture_output=True, text=True
    )
    if p.returncode:
        raise RuntimeError(
            f"building nfq_delay failed (is libnetfilter-queue-dev installed?): {p.stderr.strip()[-400:]}"
        )
    return exe


def _iptables() -> str:
    """iptables-legacy first: the nft backend would need the kernel's nft ``queue`` expression, which
    this kernel lacks, while the xtables NFQUEUE target is there."""
    for name in ("iptables-legacy", "iptables"):
        if path := shutil.which(name):
            return path
    raise RuntimeError("iptables is not installed")


class PacketNet:
    """Two fresh network namespaces joined by a veth pair, every arriving packet delayed by RTT/2."""

    emulation = PACKET
    server_host = SERVER_IP

    def __init__(self, helper_dir: Path, rtt_s: float = 0.0, rate_mbit: float | None = None) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("not root")
        for tool in ("ip",):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is not installed")
        self.helper = build_helper(helper_dir)
        self.iptables = _iptables()
        tag = os.getpid()
        self.ns = {"client": f"al-c-{tag}", "server": f"al-s-{tag}"}
        self.dev = {"client": f"alc{tag}"[:15], "server": f"als{tag}"[:15]}
        self.rate_mbit = rate_mbit
        self.rtt_s = rtt_s
        self._delayers: dict[str, subprocess.Popen[str]] = {}
        self._home = os.open("/proc/self/ns/net", os.O_RDONLY)  # to step back out before removing
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        _run("ip", "netns", "add", self.ns["client"])
        _run("ip", "netns", "add", self.ns["server"])
        _run("ip", "link", "add", self.dev["client"], "type", "veth", "peer", "name", self.dev["server"])
        for side, addr in (("client", CLIENT_IP), ("server", SERVER_IP)):
            ns, dev = self.ns[side], self.dev[side]
            _run("ip", "link", "set", dev, "netns", ns)
            for cmd in (f"addr add {addr}/30 dev {dev}", "link set lo up", f"link set {dev} up"):
                _run("ip", "-n", ns, *cmd.split())
            inside = ["ip", "netns", "exec", ns]
            _run(*inside, self.iptables, "-A", "INPUT", "-i", dev, "-j", "NFQUEUE", "--queue-num", "0")
            if self.rate_mbit:
                _run(*inside, *f"tc qdisc add dev {dev} root handle 1: htb default 10".split())
                _run(*inside, *f"tc class add dev {dev} parent 1: classid 1:10 htb rate {self.rate_mbit}mbit".split())
            self._delayers[side] = self._start_delayer(ns)
        self.set_rtt(self.rtt_s)

    def _start_delayer(self, ns: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            ["ip", "netns", "exec", ns, str(self.helper), "0", "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            p.wait(5)
            raise RuntimeError(f"nfq_delay did not start in {ns}: {p.stderr.read().strip() if p.stderr else ''}")
        return p

    def set_rtt(self, rtt_s: float) -> None:
        """Half the RTT on arrival in each namespace; applies to packets arriving from now on."""
        for p in self._delayers.values():
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(f"{round(rtt_s / 2 * 1e6)}\n")
            p.stdin.flush()
            p.stdout.readline()  # "delay N": applied
        self.rtt_s = rtt_s

    def url(self, port: int) -> str:
        return f"http://{SERVER_IP}:{port}"

    def enter_server(self) -> None:
        _setns(f"/run/netns/{self.ns['server']}")

    def enter_client(self) -> None:
        _setns(f"/run/netns/{self.ns['client']}")

    def describe(self) -> dict[str, Any]:
        cc = subprocess.run(
            ["ip", "netns", "exec", self.ns["server"], "sysctl", "-n", "net.ipv4.tcp_congestion_control"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return {
            "emulation": self.emulation,
            "how": "client and server in their own network namespaces joined by a veth pair; every packet delayed RTT/2 "
            "on arrival in each namespace by nfq_delay (iptables INPUT -j NFQUEUE)",
            "tcp_congestion_control": cc,
            "rate_mbit": self.rate_mbit,
            "mtu": 1500,
        }

    def close(self) -> None:
        """Stop the delayers, every process left in the namespaces, and remove the namespaces (the veth
        pair and the iptables rules go with them). Safe to call twice."""
        for p in self._delayers.values():
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    assert p.stdin is not None
                    p.stdin.close()  # EOF: the helper accepts what it holds and exits
                try:
                    p.wait(3)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._delayers.clear()
        with contextlib.suppress(OSError):
            _setns_fd(self._home)
        for ns in self.ns.values():
            if not Path(f"/run/netns/{ns}").exists():
                continue
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        with contextlib.suppress(OSError):
            os.close(self._home)
        self._home = -1


def _setns_fd(fd: int) -> None:
    if fd < 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns back to the original namespace")


class ProxyNet:
    """The fallback: the server on loopback, a ``DelayLineProcess`` in front of each port asked for."""

    emulation = PROXY
    server_host = "127.0.0.1"

    def __init__(self, why: str, rtt_s: float = 0.0) -> None:
        self.why = why
        self.rtt_s = rtt_s
        self._lines: dict[int, Any] = {}

    def url(self, port: int) -> str:
        from harness.delayline import DelayLineProcess

        if port not in self._lines:
            self._lines[port] = DelayLineProcess(("127.0.0.1", port), rtt_s=self.rtt_s)
        return self._lines[port].url

    def set_rtt(self, rtt_s: float) -> None:
        for line in self._lines.values():
            line.set_rtt(rtt_s)
        self.rtt_s = rtt_s

    def enter_server(self) -> None:
        pass

    def enter_client(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {
            "emulation": self.emulation,
            "how": "harness.delayline TCP proxy on loopback",
            "why_not_packet_level": self.why,
        }

    def close(self) -> None:
        for line in self._lines.values():
            line.stop()
        self._lines.clear()


@contextlib.contextmanager
def network(helper_dir: Path, *, rate_mbit: float | None = None, force_proxy: bool = False) -> Iterator[Network]:
    """The best emulation this machine allows; torn down on exit, on exceptions and on SIGTERM/SIGHUP
    (turned into KeyboardInterrupt so that ``finally`` blocks run)."""
    net: Network
    lock = None
    if force_proxy:
        net = ProxyNet("asked for the proxy")
    else:
        try:
            lock = _exclusive(LOCK_PATH)
            net = PacketNet(helper_dir, rate_mbit=rate_mbit)
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            why = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) and exc.stderr else str(exc)
            print(f"netem: packet-level emulation unavailable ({why}); using the {PROXY}", file=sys.stderr)
            net = ProxyNet(why)
            if lock is not None:
                lock.close()
                lock = None

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield net
    finally:
        net.close()
        if lock is not None:
            lock.close()  # releases the flock
        for s, h in old.items():
            signal.signal(s, h)


#: The namespaces use fixed addresses, so two packet-level runs on one machine would collide: the second
#: waits here for the first to finish.
LOCK_PATH = "/tmp/asyncload-netem.lock"


def _exclusive(path: str) -> Any:
    """An open file holding an exclusive ``flock`` on ``path`` (waits, saying so, while another run holds it)."""
    f = open(path, "a+")  # noqa: SIM115 - held for the whole run, closed by the caller
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"netem: another packet-level run holds {path}; waiting for it", file=sys.stderr, flush=True)
        fcntl.flock(f, fcntl.LOCK_EX)
    return f


# -- the path check ------------------------------------------------------------------------------------


def window_growth(url: str, path: str, rtt_s: float, rounds: int = 8) -> dict[str, Any]:
    """Bytes of one large GET received by the end of each RTT after the request, on a fresh connection.

    On a real path the first round trips carry ~10, 20, 40, ... segments (slow start); a path that only
    delays bytes delivers everything one RTT after the request.
    """
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "", u.port or 80, timeout=60)
    conn.connect()
    t0 = time.perf_counter()
    conn.request("GET", path)
    resp = conn.getresponse()
    got, marks = 0, []
    while chunk := resp.read1(1 << 20):
        got += len(chunk)
        marks.append((time.perf_counter() - t0, got))
    total = time.perf_counter() - t0
    conn.close()
    step = max(rtt_s, 1e-3)
    by_rtt = [max((b for t, b in marks if t <= step * (k + 1)), default=0) for k in range(rounds)]
    return {"bytes": got, "seconds": total, "mb_s": got / total / 1e6, "bytes_by_rtt": by_rtt}


def put_check_objects(server: Any, bucket: str) -> None:
    """The two objects ``check_path`` reads: a small one (round trips) and 8 MiB (window growth)."""
    server.put_object(bucket, "netcheck/small", b"x" * 100)
    server.put_object(bucket, "netcheck/large", os.urandom(8 << 20))


def check_path(url: str, bucket: str, rtt_s: float) -> dict[str, Any]:
    """RTT of a small GET, the handshake, and a large GET's growth per RTT (the filer serves objects
    unsigned at ``/buckets/<bucket>/<key>``)."""
    from harness.netcheck import measure_path

    small, large = f"/buckets/{bucket}/netcheck/small", f"/buckets/{bucket}/netcheck/large"
    path = measure_path(url, small_path=small, large_path=large, n=10, fresh=3)
    return {"rtt_set_ms": rtt_s * 1e3, **path, "growth": window_growth(url, large, rtt_s)}


@contextlib.contextmanager
def inside(enter: Callable[[], None]) -> Iterator[None]:
    """The calling thread in another namespace (``enter``) for the block, then back where it was.

    Fork or start worker processes *inside* it, never setns in the child: a library that registers
    pthread_atfork handlers (Deep Lake does) recreates its threads in the child at fork time, before any
    child code runs, so they stay in the parent's namespace. Measured: a Deep Lake reader forked from the
    server's namespace then setns'd into the client's sent its default-pool reads around the delay.
    """
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter()
        yield
    finally:
        _setns_fd(home)
        os.close(home)


def fork_call(enter: Callable[[], None], fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> Any:
    """``fn(*args)`` in a child forked inside ``enter()``'s namespace (e.g. the client's); its JSON result."""
    r, w = os.pipe()
    with inside(enter):
        pid = os.fork()
        if pid == 0:  # the child runs ``fn`` here, inside the block, and never leaves it (``os._exit``)
            code = 0
            try:
                os.close(r)
                out = json.dumps({"ok": fn(*args)})
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                out, code = json.dumps({"error": f"{type(exc).__name__}: {exc}"}), 1
            with os.fdopen(w, "w") as f:
                f.write(out)
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        deadline = time.monotonic() + timeout
        text = f.read()
    while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
        time.sleep(0.01)
    doc = json.loads(text or '{"error": "no answer"}')
    if "error" in doc:
        raise RuntimeError(doc["error"])
    return doc["ok"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["check"])
    ap.add_argument("--rtt", type=float, nargs="*", default=[0, 20, 50, 100], help="round-trip times in ms")
    ap.add_argument("--rate-mbit", type=float, default=None)
    ap.add_argument("--proxy", action="store_true", help="use the TCP proxy fallback")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from harness.seaweed import SeaweedServer

    out = []
    with network(ROOT / "data" / "netem", rate_mbit=args.rate_mbit, force_proxy=args.proxy) as net:
        net.enter_server()
        with SeaweedServer(host=net.server_host) as server:
            bucket = server.create_bucket("netcheck")
            put_check_objects(server, bucket)
            filer = net.url(int(server.filer_url.rsplit(":", 1)[1]))
            for ms in args.rtt:
                net.set_rtt(ms / 1e3)
                out.append(fork_call(net.enter_client, check_path, filer, bucket, ms / 1e3))
        print(json.dumps({"network": net.describe(), "checks": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
