"""The CLI's own work around a run's command, with and without `paperclip-agent watch` (issue
#42): what the client does before the command (the checkout at the head: the index read) and
after it (the snapshot's scan, the upload's questions, the index and watcher state written),
each in a fresh interpreter as the CLI runs it, against an in-process store (no server: the
requests are not timed here; bench/snapshots.py times whole runs).

    .venv/bin/python bench/watch_scan.py [--files 50000] [--changed 500] [--runs 5]
        [--max-size 16000] [--tops 200] [--dir D]

The tree is bench/copyback.py's shape (sizes 100 B to 16 KiB in --tops x 7 directories) on
/dev/shm when it has room. For each mode (a full scan with no watcher; the watcher running)
and each change (none; --changed files get 8 bytes appended), --runs runs alternate; the
medians are printed with the load average.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "clients" / "python"
SHM = Path("/dev/shm")  # noqa: S108
sys.path.insert(0, str(CLIENT))

from paperclip_client import workdir  # noqa: E402 - after the path setup

SERVER, WORKSPACE = "http://bench", "ws"
KEYS = ("before", "after", "process")
ENTRY = (
    "import sys; sys.argv[0] = 'paperclip-agent'\nfrom paperclip_client.cli import entry; entry()"
)


class NamesStore:
    """A store that keeps the names it was given (the bytes are read and dropped)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def limits(self) -> workdir.Limits:
        return workdir.Limits(
            max_blob_bytes=64 * 1024 * 1024, max_batch_bytes=16 * 1024 * 1024,
            max_batch_blobs=10_000,
        )  # fmt: skip

    def find_missing(self, names: Sequence[str]) -> list[str]:
        return [n for n in names if n not in self.names]

    def put(self, name: str, stream: IO[bytes], size: int) -> None:
        stream.read(size)
        self.names.add(name)

    def put_batch(self, frames: Sequence[workdir.BatchFrame]) -> None:
        for frame in frames:
            b"".join(frame.read())
            self.names.add(frame.name)

    def get(self, name: str, dest: IO[bytes]) -> int:
        raise NotImplementedError(name)


def child(tree: Path, names_file: Path) -> None:
    """One CLI-like pass: the checkout at the head, then the snapshot and its commit."""
    started = time.perf_counter()
    names = set(json.loads(names_file.read_text())) if names_file.exists() else set()
    store = NamesStore(names)
    index = workdir.load_index(tree)
    head = index.tree if index is not None else None
    workdir.checkout(store, tree, head, server=SERVER, workspace=WORKSPACE, say=lambda _: None)
    before = time.perf_counter() - started
    said: list[str] = []
    started = time.perf_counter()
    taken = workdir.snapshot(
        store, tree, say=said.append, warn=lambda _: None,
        trust_index=(SERVER, WORKSPACE),
    )  # fmt: skip
    workdir.commit_snapshot(tree, taken, server=SERVER, workspace=WORKSPACE)
    after = time.perf_counter() - started
    names_file.write_text(json.dumps(sorted(store.names)))
    line = next((s for s in said if s.startswith(("watcher:", "full scan:"))), "")
    print(json.dumps({"before": before, "after": after, "line": line, "tree": taken.tree}))


def make_tree(root: Path, files: int, max_size: int = 16_000, tops: int = 200) -> list[Path]:
    rnd = random.Random(1)
    paths = []
    for i in range(files):
        directory = root / f"d{i % tops:03d}" / f"e{i % 7}"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"f{i:06d}.txt"
        path.write_bytes(rnd.randbytes(rnd.randint(100, max_size)))
        paths.append(path)
    return paths


def one(tree: Path, names: Path, profile: Path | None = None) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(CLIENT)}
    started = time.perf_counter()
    python = [sys.executable, "-m", "cProfile", "-o", str(profile)] if profile else [sys.executable]
    done = subprocess.run(
        [*python, __file__, "--child", str(tree), str(names)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    result: dict[str, object] = json.loads(done.stdout)
    result["process"] = time.perf_counter() - started
    return result


def start_watcher(tree: Path) -> tuple[subprocess.Popen[str], float]:
    env = {**os.environ, "PYTHONPATH": str(CLIENT)}
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", ENTRY, "watch", "--workdir", str(tree)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "directories watched" in line, line
    return proc, time.perf_counter() - started


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def touch_some(paths: list[Path], count: int, seed: int) -> None:
    for path in random.Random(seed).sample(paths, count):
        with path.open("ab") as handle:
            handle.write(b"12345678")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=50_000)
    parser.add_argument("--changed", type=int, default=500)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-size", type=int, default=16_000, help="bytes (default 16000)")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--tops", type=int, default=200, help="top-level directories (x 7)")
    parser.add_argument(
        "--profile", type=Path, default=None, help="cProfile the watched runs into PATH.<n>.prof"
    )
    parser.add_argument("--child", nargs=2, type=Path)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    base = args.dir or (SHM if shutil.disk_usage(SHM).free > 4 * 2**30 else None)
    scratch = Path(tempfile.mkdtemp(prefix="watch-scan-", dir=base))
    try:
        return run(scratch, args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(scratch: Path, args: argparse.Namespace) -> int:
    # Each pass is a fresh interpreter, as the CLI: timed with the client's bytecode written,
    # as an installed CLI has it (bench/snapshot_runs.py's compile_client says why).
    compileall.compile_dir(CLIENT / "paperclip_client", quiet=1)
    tree, names = scratch / "tree", scratch / "names.json"
    paths = make_tree(tree, args.files, args.max_size, args.tops)
    print(f"tree: {args.files} files in {scratch}; first snapshot:", one(tree, names)["after"])
    times: dict[tuple[str, str], list[dict[str, object]]] = {}
    watcher, start_s = start_watcher(tree)
    print(f"watcher: started in {start_s:.2f} s, RSS {rss_kib(watcher.pid)} KiB")
    one(tree, names)  # its first token (a full scan)
    seed = 0
    try:
        for _ in range(args.runs):
            for mode in ("watcher", "scan"):
                for change in ("none", str(args.changed)):
                    if change != "none":
                        seed += 1
                        touch_some(paths, args.changed, seed)
                    profile = None
                    if args.profile is not None and mode == "watcher" and change != "none":
                        profile = args.profile.with_suffix(f".{seed}.prof")
                    if mode == "watcher":
                        result = one(tree, names, profile)
                    else:
                        result = _no_watcher(tree, names)
                    times.setdefault((mode, change), []).append(result)
        print(f"watcher: RSS {rss_kib(watcher.pid)} KiB at the end")
    finally:
        watcher.send_signal(signal.SIGTERM)
        watcher.wait(timeout=30)
    print(f"load average {os.getloadavg()}")
    for (mode, change), rows in times.items():
        med = {k: statistics.median(float(str(r[k])) for r in rows) for k in KEYS}
        print(
            f"{mode:8} changed={change:5} before {med['before'] * 1000:6.0f} ms  after"
            f" {med['after'] * 1000:6.0f} ms  process {med['process'] * 1000:6.0f} ms  "
            f"({rows[-1]['line']})"
        )
    return 0


def _no_watcher(tree: Path, names: Path) -> dict[str, object]:
    """A run as without a watcher: its socket moved aside (the run scans in full and leaves no
    token), then put back, and the next run's full scan (taking a token again) done untimed."""
    sock = tree / ".paperclip" / "watch.sock"
    aside = tree / ".paperclip" / "watch.sock.aside"
    os.rename(sock, aside)
    try:
        return one(tree, names)
    finally:
        os.rename(aside, sock)
        one(tree, names)


if __name__ == "__main__":
    sys.exit(main())
