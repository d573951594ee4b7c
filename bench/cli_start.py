"""The CLI's start to its first request (issue #42: under 0.1 s).

    .venv/bin/python bench/cli_start.py [--runs 15] [--quick]

`paperclip-agent run --workspace w --issue i --url http://127.0.0.1:PORT --key k.s -- true`
against a socket of this process that records when the first request's bytes arrive (the
run's first request is `GET /api/me`; the bench checks it is) and answers 401, so the CLI
stops there. Timed from just before the process is spawned to that arrival, on
`time.monotonic()` (CLOCK_MONOTONIC: one clock for every process on Linux). Two layouts:

- **installed**: a throwaway venv whose only `.pth` puts clients/python and this venv's
  site-packages on the path, and a console script written as pip writes it: the CLI as a
  user installs it, without the development venv's editable-install finders (imported by
  `site` at every start, about 10 ms, which an installed CLI never pays). MET/MISSED is this
  layout's median;
- **dev**: `.venv/bin/paperclip-agent`, the editable install, finders included.

In the same rounds, alternating with the CLI: the bare interpreter (`python -c pass`, spawn to
exit) and the floor of any Python client (`python -c` sending the request through a raw
socket, spawn to arrival), both in the installed layout; and the import alone
(`import paperclip_client.cli` timed inside the process: wall time, and CPU time, which the
load of other processes moves less). The client is
compiled first (bench/snapshot_runs.py's `compile_client`: bytecode written, as an installed
CLI has it). Prints medians and minimums of --runs rounds and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.snapshot_runs import compile_client  # noqa: E402 - after the path setup

TARGET_SECONDS = 0.1
CLIENT = ROOT / "clients" / "python"
ANSWER = (
    b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b'Content-Length: 64\r\n\r\n{"error": {"code": "invalid_agent_key", "message": "bench key."}}'
)
# pip's console-script shim (what `paperclip-agent` runs).
SHIM = """# -*- coding: utf-8 -*-
import re
import sys
from paperclip_client.cli import entry
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(entry())
"""
IMPORT_ONLY = (
    "import time; t, c = time.perf_counter(), time.process_time(); import paperclip_client.cli;"
    " print(time.perf_counter() - t, time.process_time() - c)"
)
RAW_REQUEST = (
    "import socket, sys; s = socket.create_connection(('127.0.0.1', int(sys.argv[1])));"
    " s.sendall(b'GET /api/me HTTP/1.1\\r\\nHost: bench\\r\\n\\r\\n'); s.recv(65536)"
)


class FirstRequest:
    """A listening socket that notes when each connection's first bytes arrive, and answers
    401 so that the CLI stops after its first request."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.arrivals: list[tuple[float, bytes]] = []
        self.arrived = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            with conn:
                data = conn.recv(65536)
                self.arrivals.append((time.monotonic(), data))
                self.arrived.set()
                while b"\r\n\r\n" not in data:  # the rest of the head, if it came apart
                    more = conn.recv(65536)
                    if not more:
                        break
                    data += more
                conn.sendall(ANSWER)

    def expect(self) -> None:
        self.arrivals.clear()
        self.arrived.clear()

    def first(self, timeout: float = 30.0) -> tuple[float, bytes]:
        if not self.arrived.wait(timeout):
            raise SystemExit("no request arrived")
        return self.arrivals[0]


def installed_layout(into: Path) -> tuple[Path, Path]:
    """A venv with no editable finder: clients/python and this venv's site-packages on the
    path through one plain .pth (a path line imports nothing), and pip's console script."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(into)], check=True)
    python = into / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    Path(site, "paperclip-bench.pth").write_text(f"{CLIENT}\n{ours}\n")
    script = into / "bin" / "paperclip-agent"
    script.write_text(f"#!{python}\n{SHIM}")
    script.chmod(0o755)
    return python, script


def run_cli(server: FirstRequest, argv: list[str], env: dict[str, str]) -> float:
    server.expect()
    start = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    arrival, data = server.first()
    if done.returncode != 1 or "refused the key" not in done.stderr:
        raise SystemExit(f"unexpected CLI exit {done.returncode}: {done.stderr.strip()}")
    if not data.startswith(b"GET /api/me "):
        raise SystemExit(f"the first request was not GET /api/me: {data[:60]!r}")
    return arrival - start


def spawn_to_exit(argv: list[str], env: dict[str, str]) -> float:
    start = time.monotonic()
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=60)
    return time.monotonic() - start


def spawn_to_request(server: FirstRequest, argv: list[str], env: dict[str, str]) -> float:
    server.expect()
    start = time.monotonic()
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=60)
    return server.first()[0] - start


def import_only(python: Path, env: dict[str, str], cpu: list[float]) -> float:
    """The import's wall time; its CPU time (less moved by other processes' load) into `cpu`."""
    done = subprocess.run(
        [python, "-c", IMPORT_ONLY], env=env, check=True, capture_output=True, text=True
    )
    wall, used = done.stdout.split()
    cpu.append(float(used))
    return float(wall)


def ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:6.1f} ms, min {min(values) * 1000:6.1f} ms"


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_argument("--runs", type=int, default=15, help="rounds (default 15)")
    options.add_argument("--quick", action="store_true", help="3 rounds (a smoke run)")
    args = options.parse_args()
    if args.quick:
        args.runs = 3
    compile_client()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAPERCLIP_", "COVERAGE_"))}
    # The dev venv's finder maps the package to its own checkout: this one's code first.
    dev_env = {**env, "PYTHONPATH": str(CLIENT)}
    server = FirstRequest()
    cli_args = ["run", "--workspace", "w", "--issue", "i", "--url"]
    cli_args += [f"http://127.0.0.1:{server.port}", "--key", "k.s", "--", "true"]
    dev_script = Path(sys.executable).with_name("paperclip-agent")
    load_before = os.getloadavg()
    import_cpu: list[float] = []
    with tempfile.TemporaryDirectory(prefix="cli-start-") as scratch:
        python, script = installed_layout(Path(scratch) / "venv")
        kinds: dict[str, Callable[[], float]] = {
            "installed CLI, start to first request": lambda: run_cli(
                server, [str(script), *cli_args], env
            ),
            "dev CLI (editable), start to first request": lambda: run_cli(
                server, [str(dev_script), *cli_args], dev_env
            ),
            "import paperclip_client.cli (installed)": lambda: import_only(python, env, import_cpu),
            "bare interpreter, python -c pass": lambda: spawn_to_exit(
                [str(python), "-c", "pass"], env
            ),
            "bare interpreter, raw-socket request": lambda: spawn_to_request(
                server, [str(python), "-c", RAW_REQUEST, str(server.port)], env
            ),
        }
        for kind in kinds.values():  # warm the page cache once, untimed
            kind()
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for round_ in range(args.runs):
            order = list(kinds.items())
            if round_ % 2:
                order.reverse()
            for name, kind in order:
                times[name].append(kind())
    load_after = os.getloadavg()
    print(
        f"{args.runs} rounds, load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    times["  the same import's CPU time"] = import_cpu[1:]  # the untimed warm-up's left out
    for name, values in times.items():
        print(f"{name:<46} {ms(values)}")
    cli = statistics.median(times["installed CLI, start to first request"])
    bare = statistics.median(times["bare interpreter, python -c pass"])
    more = (cli - bare) * 1000
    print(f"installed CLI over the bare interpreter: {cli / bare:.1f}x, {more:.1f} ms more")
    verdict = "MET" if cli < TARGET_SECONDS else "MISSED"
    target = TARGET_SECONDS * 1000
    print(f"{verdict}: start to first request {cli * 1000:.1f} ms (target {target:.0f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
