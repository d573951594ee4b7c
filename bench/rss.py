"""Peak RSS of the processes a bench watches (psutil, sampled in a thread)."""

from __future__ import annotations

import threading
from contextlib import suppress

import psutil


class RssSampler:
    """Peak RSS of the CLI processes it is told about and of the web server's worker
    processes (the server's descendants; the master process itself when it has none)."""

    def __init__(self, server_pid: int, every: float = 0.02) -> None:
        self.server = psutil.Process(server_pid)
        self.every = every
        self.cli: psutil.Process | None = None
        self.cli_peak = 0
        self.web_peak = 0
        self.web_pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def sample(self) -> None:
        cli = self.cli
        if cli is not None:
            with suppress(psutil.Error):
                self.cli_peak = max(self.cli_peak, cli.memory_info().rss)
        try:
            workers = self.server.children(recursive=True) or [self.server]
        except psutil.Error:
            return
        for proc in workers:
            try:
                rss = proc.memory_info().rss
            except psutil.Error:
                continue
            self.web_pids.add(proc.pid)
            self.web_peak = max(self.web_peak, rss)
