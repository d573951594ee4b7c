"""Where copy-back's time goes against `cp -a`, `cp -al` and `rsync -a`: wall time, user and
system CPU, and system calls per file, on the same trees.

Run with `.venv/bin/python bench/copyback_breakdown.py` (not part of `make bench`, whose
bench/copyback.py gives the ratios; this explains them). Each tool runs as its own process, the
backend included (`LocalDirectoryCopyback` in a fresh Python, so its start-up is counted and
printed on its own), and its CPU time is read from the kernel's accounting of that child.
System calls are counted with `strace -f -c` when strace is installed.

1. Full copy of --files files (default 50,000, the trees of bench/copyback.py) into an empty
   destination: `cp -a`, the backend with 1 and with 2 threads; medians of --rounds (3).
2. Incremental copy of --incremental-files files (default 100,000) with 1% of them changed:
   `rsync -a` in place, `cp -al` of the previous tree (the floor of an atomic swap) and the
   backend (incremental on), which here also waits for the replaced tree's deletion.

Options: --files N, --incremental-files N, --rounds N, --dir DIR, --quick.
"""

from __future__ import annotations

import argparse
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from copyback import SHM, log, make_tree  # noqa: E402 - after the path setup

BACKEND = (
    "import sys, uuid; sys.path.insert(0, sys.argv[5]);"
    "from recovery.adapters.copyback import LocalDirectoryCopyback, copyback_discards_wait;"
    "LocalDirectoryCopyback(threads=int(sys.argv[3]), incremental=sys.argv[4] == '1').copy_back("
    "run_id=uuid.uuid4(), source=sys.argv[1], destination=sys.argv[2], check=lambda: None);"
    "copyback_discards_wait()"
)
STARTUP = "import sys; sys.path.insert(0, sys.argv[1]); import recovery.adapters.copyback"


def backend(source: Path, destination: Path, *, threads: int, incremental: bool) -> list[str]:
    flag = "1" if incremental else "0"
    arguments = [str(source), str(destination), str(threads), flag, str(ROOT)]
    return [sys.executable, "-c", BACKEND, *arguments]


def timed(command: list[str]) -> tuple[float, float, float]:
    """Wall, user and system seconds of `command` run as a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, check=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


def system_calls(command: list[str], scratch: Path, files: int, label: str) -> None:
    if shutil.which("strace") is None:
        log(f"  {label}: strace is not installed, system calls not counted")
        return
    report = scratch / "strace.txt"
    subprocess.run(["strace", "-f", "-c", "-o", str(report), *command], check=True)
    counts: dict[str, int] = {}
    for line in report.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
            try:
                counts[fields[-1]] = int(fields[3])
            except ValueError:  # a row without an error count shifts the columns
                continue
    top = sorted(counts.items(), key=lambda item: -item[1])[:8]
    log(
        f"  {label}: {sum(counts.values()) / files:.1f} system calls per file; "
        + ", ".join(f"{name} {count / files:.2f}" for name, count in top)
    )


def line(label: str, figures: tuple[float, float, float], files: int) -> None:
    wall, user, system = figures
    log(
        f"  {label:<30} wall {wall:6.2f} s  user {user:6.2f} s  system {system:6.2f} s"
        f"  ({files / wall:,.0f} files/s)"
    )


def full(scratch: Path, files: int, rounds: int) -> None:
    source = scratch / "full-src"
    log(f"full copy of {files:,} files, medians of {rounds}:")
    make_tree(source, files, seed=1)
    tools = {
        "cp -a": lambda d: ["cp", "-a", str(source), str(d)],
        "backend, 1 thread": lambda d: backend(source, d, threads=1, incremental=False),
        "backend, 2 threads": lambda d: backend(source, d, threads=2, incremental=False),
    }
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in tools}
    for number in range(rounds):
        for name, command in tools.items():
            destination = scratch / f"full-{number}"
            results[name].append(timed(command(destination)))
            shutil.rmtree(destination)
    for name, runs in results.items():
        wall, user, system = (statistics.median(column) for column in zip(*runs, strict=True))
        line(name, (wall, user, system), files)
    startup = timed([sys.executable, "-c", STARTUP, str(ROOT)])
    log(f"  (of the backend's wall time, Python start-up and imports: {startup[0]:.2f} s)")
    for name in ("cp -a", "backend, 2 threads"):
        system_calls(tools[name](scratch / "full-traced"), scratch, files, name)
        shutil.rmtree(scratch / "full-traced")
    shutil.rmtree(source)


def incremental(scratch: Path, files: int) -> None:
    source, ours, theirs = scratch / "inc-src", scratch / "inc-ours", scratch / "inc-rsync"
    log(f"incremental copy of {files:,} files, 1% changed:")
    paths = make_tree(source, files, seed=2)
    subprocess.run(backend(source, ours, threads=2, incremental=False), check=True)
    subprocess.run(["cp", "-a", str(source), str(theirs)], check=True)
    chooser = random.Random(3)

    def change() -> None:
        for path in chooser.sample(paths, max(1, files // 100)):
            with path.open("ab") as handle:
                handle.write(b"changed\n")

    change()
    line(
        "rsync -a (in place)", timed(["rsync", "-a", "--delete", f"{source}/", f"{theirs}/"]), files
    )
    line("cp -al (the floor)", timed(["cp", "-al", str(ours), str(scratch / "linked")]), files)
    shutil.rmtree(scratch / "linked")
    line(
        "backend (+ old tree's removal)",
        timed(backend(source, ours, threads=2, incremental=True)),
        files,
    )
    change()
    system_calls(backend(source, ours, threads=2, incremental=True), scratch, files, "backend")
    system_calls(["cp", "-al", str(ours), str(scratch / "linked")], scratch, files, "cp -al")
    for path in (source, ours, theirs, scratch / "linked"):
        shutil.rmtree(path, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=None)
    parser.add_argument("--incremental-files", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    files = args.files or (500 if args.quick else 50_000)
    inc_files = args.incremental_files or (1_000 if args.quick else 100_000)
    rounds = 1 if args.quick else args.rounds
    for tool in ("cp", "rsync"):
        if shutil.which(tool) is None:
            log(f"{tool} is not installed: it is a baseline of this bench")
            return 1
    base = args.dir or (SHM if SHM.is_dir() else None)
    scratch = Path(tempfile.mkdtemp(prefix="paperclip-bench-breakdown-", dir=base))
    try:
        full(scratch, files, rounds)
        incremental(scratch, inc_files)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
