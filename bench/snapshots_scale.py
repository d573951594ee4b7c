"""A later run's cost as the workspace grows: the same change on a tree and on two four times
its size, with `paperclip-agent watch` running, in the same run.

Run with `.venv/bin/python bench/snapshots.py --scale` (`make bench` runs it after the other
snapshot benches). Not part of the test suite.

The production HTTP server, a real `manage.py run_worker` and the real `paperclip-agent` CLI,
as in bench/snapshots.py. Three trees of bench/copyback.py's shape (sizes 100 B to 16 KiB in
200 x 7 directories): --files files, and four times as many in two shapes: **wider**, in the
same directories, each holding four times as many entries, and **deeper**, in four times as
many directories (800 x 7), each holding as many entries as the small tree's. A change costs
what the directories it touches hold (each is one blob, read, hashed, uploaded, compared and
written back whole, as a git tree object is), so the wider tree measures that too, and the
deeper one what grows with the workspace alone. Each tree gets its own company and
workspace, a watcher started before anything else, and a first run (untimed: it publishes the
head and gives the watcher's first token). Then each of --rounds rounds (at least 3), for each
tree in turn (the small one first in even rounds, last in odd ones):

1. a later run: the same number of files in each tree (--changed of --files: 500 for 50,000)
   get 8 bytes appended, then `paperclip-agent run -- true`, timed from the CLI's start until
   the workspace's `cwd_tree` is the head (the worker's materialization included);
2. a run that changed nothing: the CLI's whole time, before and after its command (`true`),
   and the same split for the later run (its command starts at its `started:` line).

Targets (medians over the rounds): each larger tree's later run, end to end, at most 1.5x the
smaller tree's; a run that changed nothing under 0.3 s of CLI time on each tree. Each tree's
`cwd` is compared with its workdir at the end.
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.copyback import make_tree  # noqa: E402 - after the path setup
from bench.rss import RssSampler  # noqa: E402
from bench.snapshot_runs import (  # noqa: E402
    MB,
    World,
    compile_client,
    job_seconds,
    log,
    make_world,
    prepare,
    run_cli,
    same_files,
    scan_line,
    serving,
    start_watcher,
    wait_materialized,
)

SCALE: Final = 4
TOPS: Final = 200  # top-level directories of the small tree and the wider one, 7 below each
MIN_ROUNDS: Final = 3
TARGET_GROWTH: Final = 1.5
TARGET_UNCHANGED: Final = 0.3  # seconds of CLI time


@dataclass
class Tree:
    """One tree, its workspace, and its runs' figures (seconds)."""

    files: int
    shape: str  # "", "wider" or "deeper"
    work: Path
    world: World
    paths: list[Path]
    later: list[float] = field(default_factory=list)  # end to end
    later_before: list[float] = field(default_factory=list)  # the CLI's, before its command
    later_after: list[float] = field(default_factory=list)  # and after it
    unchanged: list[float] = field(default_factory=list)  # the CLI's whole time
    unchanged_before: list[float] = field(default_factory=list)
    scans: list[str] = field(default_factory=list)  # the later runs' watcher / full scan lines
    jobs: list[str] = field(default_factory=list)  # the later runs' worker job times

    @property
    def name(self) -> str:
        return tree_name(self.files, self.shape)

    @property
    def label(self) -> str:
        return f"{self.files:,} files" + (f", {self.shape}" if self.shape else "")

    unchanged_lines: list[str] = field(default_factory=list)  # when each CLI line came


def run_scale(
    bench_url: str,
    scratch: Path,
    files: int,
    changed: float,
    rounds: int,
    server_kind: str,
    profile: Path | None = None,
) -> int:
    """With `profile`, the worker runs under cProfile into `PATH.worker.prof`, and each later
    run's CLI into `PATH.later-<tree>-<round>.prof` (`<tree>`: `tree_name`)."""
    compile_client()
    env = prepare(bench_url, scratch)
    count = max(1, int(files * changed))
    rounds = max(rounds, MIN_ROUNDS)
    worker_prefix = [sys.executable]
    if profile is not None:
        worker_prefix += ["-m", "cProfile", "-o", str(profile.with_suffix(".worker.prof"))]
    with (
        serving(server_kind, env, scratch, worker_prefix=worker_prefix) as (url, sampler),
        watching() as watchers,
    ):
        shapes = [(files, "", TOPS), (files * SCALE, "wider", TOPS)]
        shapes.append((files * SCALE, "deeper", TOPS * SCALE))
        trees = [
            first_run(url, sampler, scratch, n, size, watchers, shape=shape, tops=tops)
            for n, (size, shape, tops) in enumerate(shapes)
        ]
        for n in range(rounds):
            for tree in trees if n % 2 == 0 else trees[::-1]:
                cli_profile = None
                if profile is not None:
                    cli_profile = profile.with_suffix(f".later-{tree.name}-{n + 1}.prof")
                later_run(
                    url,
                    sampler,
                    tree,
                    count,
                    seed=100 + n,
                    worker_log=scratch / "worker.log",
                    profile=cli_profile,
                )
                unchanged_run(url, sampler, tree)
                log(
                    f"  round {n + 1}, {tree.label}: later run ({count:,} files changed)"
                    f" end to end {tree.later[-1]:.2f} s (CLI before its command"
                    f" {tree.later_before[-1]:.2f} s, after it {tree.later_after[-1]:.2f} s;"
                    f" {tree.scans[-1]}; {tree.jobs[-1]}); a run that changed nothing: CLI"
                    f" {tree.unchanged[-1]:.2f} s (before its command"
                    f" {tree.unchanged_before[-1]:.2f} s; its lines at {tree.unchanged_lines[-1]})"
                )
    for tree in trees:
        if not same_files(tree.work, tree.world.cwd):
            raise RuntimeError(f"the cwd {tree.world.cwd} differs from the workdir {tree.work}")
    return report(trees, count, rounds)


def tree_name(files: int, shape: str) -> str:
    """A tree's name in paths: its size, and its shape when it has one (`50000`,
    `200000-wider`)."""
    return f"{files}-{shape}" if shape else str(files)


@contextmanager
def watching() -> Iterator[list[subprocess.Popen[str]]]:
    """The watchers started inside, stopped on leaving."""
    watchers: list[subprocess.Popen[str]] = []
    try:
        yield watchers
    finally:
        for proc in watchers:
            proc.terminate()
            proc.wait(timeout=30)


def first_run(
    url: str, sampler: RssSampler, scratch: Path, n: int, files: int,
    watchers: list[subprocess.Popen[str]], *, shape: str, tops: int,
) -> Tree:  # fmt: skip
    name = tree_name(files, shape)
    work = scratch / f"work-{name}"
    log(f"writing {files:,} files in {tops} x 7 directories in {work} ...")
    paths = make_tree(work, files, seed=1, tops=tops)
    log(f"  {sum(p.stat().st_size for p in paths) / MB:.0f} MiB")
    world = make_world(n, scratch / f"cwd-{name}")
    watchers.append(start_watcher(work))
    started = time.perf_counter()
    first = run_cli(url, world, work, sampler, None)
    wait_materialized(world.workspace_id, first.head())
    log(f"  first run (untimed here): {time.perf_counter() - started:.2f} s end to end")
    return Tree(files, shape, work, world, paths)


def later_run(
    url: str,
    sampler: RssSampler,
    tree: Tree,
    count: int,
    seed: int,
    worker_log: Path,
    profile: Path | None = None,
) -> None:
    for path in random.Random(seed).sample(tree.paths, count):
        with path.open("ab") as handle:
            handle.write(b"changed\n")
    started = time.perf_counter()
    later = run_cli(url, tree.world, tree.work, sampler, profile)
    wait_materialized(tree.world.workspace_id, later.head())
    tree.later.append(time.perf_counter() - started)
    before = later.at("started:")
    tree.later_before.append(before)
    tree.later_after.append(later.seconds - before)
    tree.scans.append(scan_line(later))
    tree.jobs.append(job_seconds(worker_log, later.head()))


def unchanged_run(url: str, sampler: RssSampler, tree: Tree) -> None:
    run = run_cli(url, tree.world, tree.work, sampler, None)
    wait_materialized(tree.world.workspace_id, run.head())
    tree.unchanged.append(run.seconds)
    tree.unchanged_before.append(run.at("started:"))
    tree.unchanged_lines.append(
        ", ".join(f"{line.split(':')[0]} {t:.2f}" for t, line in run.lines if ":" in line)
    )


def report(trees: list[Tree], count: int, rounds: int) -> int:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    log("")
    log(f"{rounds} rounds, medians; the same {count:,} files changed in each tree")
    for tree in trees:
        log(
            f"{tree.label:>22}: later run end to end {med(tree.later):.2f} s (CLI before"
            f" its command {med(tree.later_before):.2f} s, after it"
            f" {med(tree.later_after):.2f} s); a run that changed nothing: CLI"
            f" {med(tree.unchanged):.2f} s (before its command {med(tree.unchanged_before):.2f} s)"
        )
    small, *larger = trees
    for large in larger:
        after_growth = med(large.later_after) / med(small.later_after)
        log(f"the CLI's time after the command grew {after_growth:.2f}x ({large.shape})")
    full_scans = [s for t in trees for s in t.scans if not s.startswith("watcher:")]
    if full_scans:
        log(f"NOTE: {len(full_scans)} later run(s) scanned in full: {full_scans[0]}")
    log("")
    checks = [
        *(
            (
                med(large.later) / med(small.later) <= TARGET_GROWTH,
                f"later run on {large.label} vs {small.label}, the same {count:,} files"
                f" changed, watcher running: {med(large.later):.2f} s against"
                f" {med(small.later):.2f} s, ratio {med(large.later) / med(small.later):.2f}"
                f" (<= {TARGET_GROWTH})",
            )
            for large in larger
        ),
        *(
            (
                med(tree.unchanged) < TARGET_UNCHANGED,
                f"a run that changed nothing on {tree.label}: CLI"
                f" {med(tree.unchanged):.2f} s (< {TARGET_UNCHANGED})",
            )
            for tree in trees
        ),
    ]
    for ok, text in checks:
        log(f"{'MET   ' if ok else 'MISSED'} {text}")
    return 0
