"""The store as the workdir sees it (`Store`, `ClientStore` over the API, its `Limits`) and
what every transfer shares: progress lines and jobs run on a few threads at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import IO, Any, Protocol

from paperclip_client.cas import BatchFrame

PROGRESS_EVERY = 2.0
# Blobs up to this size go in batch uploads (when the server's batch limit allows).
SMALL_BLOB = 1024 * 1024

type Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Limits:
    max_blob_bytes: int
    max_batch_bytes: int
    max_batch_blobs: int
    max_find_missing: int = 10_000


class Store(Protocol):
    """What the workdir needs of the content-addressed store (`ClientStore` over the API)."""

    def limits(self) -> Limits: ...
    def find_missing(self, names: Sequence[str]) -> list[str]: ...
    def put(self, name: str, stream: IO[bytes], size: int) -> None: ...
    def put_batch(self, frames: Sequence[BatchFrame]) -> None: ...
    def get(self, name: str, dest: IO[bytes]) -> int: ...
    def get_batch(self, names: Sequence[str]) -> dict[str, bytes]: ...


class ClientStore:
    """The store of the client's company, over the API."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._limits: Limits | None = None

    def limits(self) -> Limits:
        if self._limits is None:
            c = self.client.cas_config()
            self._limits = Limits(
                max_blob_bytes=c.max_blob_bytes,
                max_batch_bytes=c.max_batch_bytes,
                max_batch_blobs=c.max_batch_blobs,
                max_find_missing=c.max_find_missing or 10_000,
            )
        return self._limits

    def find_missing(self, names: Sequence[str]) -> list[str]:
        result: list[str] = self.client.cas_find_missing(
            names, batch=self.limits().max_find_missing
        )
        return result

    def put(self, name: str, stream: IO[bytes], size: int) -> None:
        self.client.cas_put(name, stream, size)

    def put_batch(self, frames: Sequence[BatchFrame]) -> None:
        self.client.cas_put_batch(frames)

    def get(self, name: str, dest: IO[bytes]) -> int:
        return int(self.client.cas_get(name, dest))

    def get_batch(self, names: Sequence[str]) -> dict[str, bytes]:
        result: dict[str, bytes] = self.client.cas_get_batch(names)
        return result


class Progress:
    """`say("<what>: <done>/<total> bytes")` at most every 2 s while a transfer runs (`add`
    may be called from several threads)."""

    def __init__(self, say: Say, what: str, total: int, every: float = PROGRESS_EVERY) -> None:
        self.say, self.what, self.total, self.every = say, what, total, every
        self.done = 0
        self._next = time.monotonic() + every
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        with self._lock:
            self.done += count
            now = time.monotonic()
            if now >= self._next:
                self._next = now + self.every
                self.say(f"{self.what}: {self.done}/{self.total} bytes")


def run_parallel(jobs: Iterable[Callable[[], None]], threads: int) -> None:
    """Run `jobs` on up to `threads` threads (in the caller's when 1), taking the next ones
    from the iterator only as earlier ones finish; the first failure cancels the jobs not
    started, waits for the running ones and is raised."""
    if threads <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="paperclip-transfer") as pool:
        pending: set[Future[None]] = set()
        try:
            for job in jobs:
                pending.add(pool.submit(job))
                while len(pending) >= 2 * threads:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()
        except BaseException:
            for future in pending:
                future.cancel()
            raise
