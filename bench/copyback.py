"""Copy-back speed against `cp -a` and `rsync -a` on the same trees, in the same run.

Run with `make bench` (or `.venv/bin/python bench/copyback.py`). Not part of the test suite;
no database is needed: it times the default backend (`LocalDirectoryCopyback`) alone.

1. Full copy: a tree of --files files (default 50,000, sizes 100 B to 16 KiB, about 400 MB,
   in 200 x 7 directories) copied by `cp -a` and by the backend (incremental off) into empty
   destinations, alternately, --rounds times (default 3); the medians' ratio is the backend's
   files per second over `cp -a`'s. Target >= 0.5.
2. Incremental copy: a tree of --incremental-files files (default 100,000) whose previous state
   is already at both destinations; each round changes a different --changed fraction of the
   files (default 1%), then `rsync -a` brings one destination up to date and the backend
   (incremental on) the other. Target: the backend's median time <= rsync's (ratio >= 1.0).

The trees live in a scratch directory on /dev/shm (a tmpfs) when it has room, so that both
tools are timed on what they do rather than on this machine's disk writeback (on the VM's disk,
400 MB copies one after another are throttled to the disk's speed, whichever tool runs);
--dir puts them elsewhere (e.g. the filesystem the workspaces live on).

Options: --files N, --incremental-files N, --changed F, --rounds N, --threads N (default: the
CPUs, at most 8, as the backend's own default),
--dir DIR (where the scratch directory is made; removed at the end), --quick.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# mkdtemp makes a private directory in it: the shared location itself is not trusted.
SHM = Path("/dev/shm")  # noqa: S108
sys.path.insert(0, str(ROOT))

from recovery.adapters.copyback import (  # noqa: E402 - after the path setup
    LocalDirectoryCopyback,
    copyback_discards_wait,
    default_threads,
)


def log(message: str) -> None:
    print(message, flush=True)


def make_tree(root: Path, files: int, seed: int, tops: int = 200) -> list[Path]:
    """`files` files of 100 B to 16 KiB in `tops` x 7 directories."""
    rnd = random.Random(seed)
    paths = []
    for i in range(files):
        directory = root / f"d{i % tops:03d}" / f"e{i % 7}"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"f{i:06d}.txt"
        path.write_bytes(rnd.randbytes(rnd.randint(100, 16_000)))
        paths.append(path)
    return paths


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def backend_copy(backend: LocalDirectoryCopyback, source: Path, destination: Path) -> None:
    backend.copy_back(
        run_id=uuid.uuid4(), source=str(source), destination=str(destination), check=lambda: None
    )


def full_copy(scratch: Path, files: int, rounds: int, threads: int) -> float:
    source = scratch / "full-src"
    log(f"full copy: writing {files:,} files")
    make_tree(source, files, seed=1)
    subprocess.run(["sync"], check=False)
    backend = LocalDirectoryCopyback(threads=threads, incremental=False)
    cp_times, ours = [], []
    for n in range(rounds):
        target, mine = scratch / f"cp-{n}", scratch / f"ours-{n}"
        cp_times.append(timed(lambda t=target: subprocess.run(["cp", "-a", source, t], check=True)))
        ours.append(timed(lambda m=mine: backend_copy(backend, source, m)))
        log(f"  round {n + 1}: cp -a {cp_times[-1]:.2f} s, backend {ours[-1]:.2f} s")
        shutil.rmtree(target)
        shutil.rmtree(mine)
    cp_median, ours_median = statistics.median(cp_times), statistics.median(ours)
    log(
        f"  cp -a {files / cp_median:,.0f} files/s, backend {files / ours_median:,.0f} files/s"
        f" ({threads} threads)"
    )
    shutil.rmtree(source)
    return cp_median / ours_median


def incremental_copy(scratch: Path, files: int, changed: float, rounds: int, threads: int) -> float:
    source = scratch / "inc-src"
    log(f"incremental copy: writing {files:,} files")
    paths = make_tree(source, files, seed=2)
    ours_dest, rsync_dest = scratch / "inc-ours", scratch / "inc-rsync"
    backend = LocalDirectoryCopyback(threads=threads, incremental=True)
    backend_copy(LocalDirectoryCopyback(threads=threads, incremental=False), source, ours_dest)
    subprocess.run(["cp", "-a", source, rsync_dest], check=True)
    copyback_discards_wait()
    subprocess.run(["sync"], check=False)
    rnd = random.Random(3)
    per_round = max(1, int(files * changed))
    rsync_times, ours = [], []
    for n in range(rounds):
        for path in rnd.sample(paths, per_round):
            with path.open("ab") as handle:
                handle.write(b"changed\n")
        rsync_times.append(
            timed(
                lambda: subprocess.run(
                    ["rsync", "-a", "--delete", f"{source}/", f"{rsync_dest}/"], check=True
                )
            )
        )
        ours.append(timed(lambda: backend_copy(backend, source, ours_dest)))
        copyback_discards_wait()  # the replaced tree's deletion is not timed, nor overlapped
        log(
            f"  round {n + 1}: {per_round:,} changed, rsync -a {rsync_times[-1]:.2f} s,"
            f" backend {ours[-1]:.2f} s"
        )
    # Where the time goes: an atomic swap needs a complete new tree, one directory entry per
    # file; `cp -al` builds just that (hard links, in C) and is the floor of this design.
    linked = scratch / "inc-cp-al"
    floor = timed(lambda: subprocess.run(["cp", "-al", ours_dest, linked], check=True))
    log(
        f"  floor of an atomic incremental copy (cp -al of the previous tree): {floor:.2f} s;"
        f" rsync -a writes in place: {statistics.median(rsync_times):.2f} s"
    )
    for path in (source, ours_dest, rsync_dest, linked):
        shutil.rmtree(path)
    return statistics.median(rsync_times) / statistics.median(ours)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=None)
    parser.add_argument("--incremental-files", type=int, default=None)
    parser.add_argument("--changed", type=float, default=0.01)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    files = args.files or (2_000 if args.quick else 50_000)
    inc_files = args.incremental_files or (4_000 if args.quick else 100_000)
    for tool in ("cp", "rsync"):
        if shutil.which(tool) is None:
            log(f"{tool} is not installed: it is the baseline of this bench")
            return 1
    where = args.dir
    if where is None and SHM.is_dir():
        needed = (files + inc_files * 3) * 9_000  # the trees' bytes, with room to spare
        if shutil.disk_usage(SHM).free > 2 * needed:
            where = SHM
    scratch = Path(tempfile.mkdtemp(prefix="paperclip-bench-copyback-", dir=where))
    log(f"scratch directory: {scratch}")
    try:
        full = full_copy(scratch, files, args.rounds, args.threads)
        incremental = incremental_copy(scratch, inc_files, args.changed, args.rounds, args.threads)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log("")
    verdict = "MET   " if full >= 0.5 else "MISSED"
    log(f"{verdict} full copy-back vs cp -a: ratio {full:.2f} (>= 0.5)")
    log(
        f"{'MET   ' if incremental >= 1.0 else 'MISSED'} incremental copy-back vs rsync -a "
        f"({args.changed:.0%} changed): ratio {incremental:.2f} (>= 1.0)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
