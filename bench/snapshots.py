"""Workspace snapshots end to end against `cp -a` and `rsync -a`, in the same run.

Run with `make bench` (or `.venv/bin/python bench/snapshots.py`). Not part of the test suite.

It creates a throwaway database (`paperclip_bench_snapshots`, or $PAPERCLIP_BENCH_SNAPSHOTS_DB)
on the server of $DATABASE_URL (default postgres://postgres@127.0.0.1:5432/postgres), migrates
it, measures, and drops it at the end, also on failure. The production HTTP server
(`python -m paperclip.serve`'s command line: granian, one worker per CPU, HTTP/1.1 keep-alive;
or gunicorn gthread 2 x 4 with `--server gunicorn`) serves over loopback HTTP, a real
`manage.py run_worker` publishes and materializes, and the agent is the real
`paperclip-agent run ... -- true` process. The tree is --files files (default 50,000, sizes
100 B to 16 KiB, about 400 MB, in 200 x 7 directories, as bench/copyback.py's), in a scratch
directory on /dev/shm when it has room (the workdirs, the workspace `cwd` and the server's
filesystem store alike), else --dir.

Each of --rounds rounds (default 2) uses a new company (an empty store), workspace and issue,
and runs ours alternating with a git peer (bench/snapshots_git.py: the same tree and the same
change through `git add -A`, `commit`, `push` to a bare repository and `clone` / `pull`, with
git's defaults and tuned; ours first in even rounds, last in odd ones):

1. First run: `cp -a` of the tree, three times (the first copy is the round's workdir; the
   median is the baseline: a single copy's time varies threefold on a VM); then
   `paperclip-agent run -- true` in the workdir: checkout of the empty head, snapshot and
   upload of the whole tree, fenced registration, result, the worker's finalization publishing
   the head, and the `materialize_workspace` job writing it into the `cwd`; timed from the
   CLI's start until the workspace's `cwd_tree` is the head. Targets (issue #42, ratios of
   times): cp -a's time over ours >= 0.3, git's over ours >= 2.
2. A later run: --changed (default 1%) of the files get 8 bytes appended in the workdir (at the
   head since run 1) and in a `cp -a` copy of it made beforehand; `rsync -a --delete` brings
   each of three other copies up to date (the median is the baseline) and
   `paperclip-agent run -- true` publishes the change end to end as above. Targets: rsync's
   time over ours >= 0.4, git's over ours >= 2. The bytes the CLI uploaded (its `snapshot:`
   line) against the changed files' bytes plus the new directory blobs (the client's
   `.paperclip/dirs.json` before and after): at most 1.1x. Each run's log line gives when the
   CLI's lines came (the command's start, the snapshot, the result, the commit) and the
   worker's own job times.
3. Checkout of the workdir already at the head (`paperclip_client.workdir.checkout`, the call
   the CLI makes, after its head lookup): time. Target < 0.5 s.
4. Peak RSS (psutil, sampled every 20 ms) of the CLI process and of each web worker process
   (the server's children) during the runs. Target < 200 MB each.

--watcher starts `paperclip-agent watch` on each round's workdir before its first run (untimed):
the first run then scans in full and keeps the watcher's token, the later run reads only the
directories the watcher names (its log line ends with the CLI's `watcher:` or `full scan:`
line). --files 200000 is the issue's large tree (about 1.6 GB: give --dir a disk with room
when /dev/shm has not).

Options: --files N, --changed F, --rounds N, --server production|gunicorn, --dir DIR,
--keep-db, --quick (1,000 files, 1 round: a smoke run), --cas s3 (the s3 backend against this
one in the same run: bench/snapshots_cas.py), --scale (the same change on --files files and on
four times as many, the watcher running, and a run that changed nothing:
bench/snapshots_scale.py).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# mkdtemp makes a private directory in it: the shared location itself is not trusted.
SHM = Path("/dev/shm")  # noqa: S108
sys.path.insert(0, str(ROOT))

from bench.copyback import make_tree, timed  # noqa: E402 - the same tree as the copy-back bench
from bench.rss import RssSampler  # noqa: E402
from bench.snapshots_git import (  # noqa: E402
    GitFigures,
    GitPeer,
    first_runs,
    later_runs,
    peers,
)
from bench.snapshots_git import report_lines as git_report  # noqa: E402
from tests.support.servers import (  # noqa: E402 - after the path setup
    throwaway_database,
)

DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432/postgres"

from bench.snapshot_runs import (  # noqa: E402 - the processes and worlds both benches use
    MB,
    World,
    compile_client,
    dir_blobs,
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

# --- the rounds -----------------------------------------------------------------------------


@dataclass
class Figures:
    cp: list[float] = field(default_factory=list)  # each round's median
    cp_runs: list[float] = field(default_factory=list)  # every copy timed
    rsync_runs: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    rsync: list[float] = field(default_factory=list)
    later: list[float] = field(default_factory=list)
    uploaded: list[int] = field(default_factory=list)
    allowed: list[float] = field(default_factory=list)  # changed bytes + new dir blobs
    changed_bytes: list[int] = field(default_factory=list)
    changed_dirs: list[int] = field(default_factory=list)
    checkout: list[float] = field(default_factory=list)
    cli_start: list[float] = field(default_factory=list)  # interpreter + the CLI's imports
    git: dict[str, GitFigures] = field(default_factory=dict)  # per variant (snapshots_git.py)


@dataclass(frozen=True)
class Config:
    files: int
    changed: float
    rounds: int
    profile: Path | None
    watcher: bool = False  # `paperclip-agent watch` on the workdir from before the first run


def one_round(
    n: int, url: str, source: Path, paths: list[Path], scratch: Path, config: Config,
    sampler: RssSampler, figures: Figures, worker_log: Path,
) -> None:  # fmt: skip
    world = make_world(n, scratch / f"cwd-{n}")
    r = Round(n, url, scratch, config, sampler, figures, worker_log, world, scratch / f"work-{n}")
    gits = peers(scratch, n, figures.git)
    # Ours and git's alternate: ours first in even rounds, last in odd ones.
    for line in first_runs(gits, source, lambda: first_run(r, source), ours_first=n % 2 == 0):
        log(f"  round {n + 1} {line}")
    later_run(r, source, paths, gits)
    checkout_at_head(r, paths)
    for proc in r.watchers:
        proc.terminate()
        proc.wait(timeout=30)
    for path in (r.work, world.cwd):
        shutil.rmtree(path)
    for peer in gits:
        peer.remove()


@dataclass(frozen=True)
class Round:
    """One round's setting: its world (workspace, key, cwd) and the agent's workdir."""

    n: int
    url: str
    scratch: Path
    config: Config
    sampler: RssSampler
    figures: Figures
    worker_log: Path
    world: World
    work: Path
    watchers: list[subprocess.Popen[str]] = field(default_factory=list)


def first_run(r: Round, source: Path) -> None:
    """The tree copied into the workdir (cp -a, the baseline), then a first run of the CLI that
    uploads all of it, until the worker has materialized it into the cwd."""
    n, scratch, figures, work, world = r.n, r.scratch, r.figures, r.work, r.world
    # cp -a three times (the workdir is the first copy), its median the baseline: one copy's
    # time varies threefold on a VM (a first touch of memory the guest never used is slow).
    copies = [work, scratch / f"cp-{n}-1", scratch / f"cp-{n}-2"]
    cp_times = [
        timed(lambda target=target: subprocess.run(["cp", "-a", source, target], check=True))
        for target in copies
    ]
    for extra in copies[1:]:
        shutil.rmtree(extra)
    figures.cp.append(statistics.median(cp_times))
    figures.cp_runs.extend(cp_times)
    subprocess.run(["sync"], check=False)
    if r.config.watcher:  # started untimed: it runs beside the agent, not in its runs
        r.watchers.append(start_watcher(work))
    profile = r.config.profile.with_suffix(f".first-{n}.prof") if r.config.profile else None
    started = time.perf_counter()
    first = run_cli(r.url, world, work, r.sampler, profile)
    head = first.head()
    wait_materialized(world.workspace_id, head)
    figures.first.append(time.perf_counter() - started)
    log(
        f"  round {n + 1} first run: cp -a {figures.cp[-1]:.2f} s (median of"
        f" {', '.join(f'{t:.2f}' for t in cp_times)}), end to end"
        f" {figures.first[-1]:.2f} s (CLI {first.seconds:.2f} s: command started at"
        f" {first.at('started:'):.2f} s, snapshot line at"
        f" {first.at('snapshot:'):.2f} s, result at {first.at('result:'):.2f} s, committed at"
        f" {first.at('finalization: committed'):.2f} s; {job_seconds(r.worker_log, head)}),"
        f" uploaded {first.uploaded() / MB:.0f} MiB"
    )
    if not same_files(work, world.cwd):
        raise RuntimeError(f"the cwd {world.cwd} differs from the workdir {work}")


def change_files(r: Round, source: Path, paths: list[Path]) -> tuple[list[float], list[Path], int]:
    """The same change in the workdir and in a copy rsync brings up to date (timed three
    times, as cp -a): (rsync's times, the changed files' paths in the tree, their bytes)."""
    n, scratch, work = r.n, r.scratch, r.work
    mirror = scratch / f"mirror-{n}"
    targets = [scratch / f"copy-{n}-{i}" for i in range(3)]  # rsync three times, as cp -a
    for target in (mirror, *targets):
        subprocess.run(["cp", "-a", work, target], check=True)
    rnd = random.Random(100 + n)
    chosen = rnd.sample(range(len(paths)), max(1, int(len(paths) * r.config.changed)))
    changed_bytes = 0
    rels = [paths[i].relative_to(source) for i in chosen]
    for rel in rels:
        for root in (work, mirror):
            with (root / rel).open("ab") as handle:
                handle.write(b"changed\n")
        changed_bytes += (work / rel).stat().st_size
    subprocess.run(["sync"], check=False)
    rsync_times = [
        timed(
            lambda target=target: subprocess.run(
                ["rsync", "-a", "--delete", f"{mirror}/", f"{target}/"], check=True
            )
        )
        for target in targets
    ]
    for target in (mirror, *targets):
        shutil.rmtree(target)
    return rsync_times, rels, changed_bytes


def later_run(r: Round, source: Path, paths: list[Path], gits: list[GitPeer]) -> None:
    """A later run: the same change made in the workdir and timed with rsync, then the CLI
    uploading only what changed, alternating with git's later runs of the same change."""
    before = dir_blobs(r.work)
    rsync_times, rels, changed_bytes = change_files(r, source, paths)
    r.figures.rsync.append(statistics.median(rsync_times))
    r.figures.rsync_runs.extend(rsync_times)
    ours = partial(our_later_run, r, before, rsync_times, len(rels), changed_bytes)
    for line in later_runs(gits, rels, ours, ours_first=r.n % 2 == 0):
        log(f"  round {r.n + 1} {line}")


def our_later_run(
    r: Round, before: dict[str, int], rsync_times: list[float], chosen: int, changed_bytes: int
) -> None:
    n, figures, work, world = r.n, r.figures, r.work, r.world
    profile = r.config.profile.with_suffix(f".later-{n}.prof") if r.config.profile else None
    started = time.perf_counter()
    later = run_cli(r.url, world, work, r.sampler, profile)
    head = later.head()
    wait_materialized(world.workspace_id, head)
    figures.later.append(time.perf_counter() - started)
    new_dirs = {k: v for k, v in dir_blobs(work).items() if k not in before}
    figures.uploaded.append(later.uploaded())
    figures.changed_bytes.append(changed_bytes)
    figures.changed_dirs.append(sum(new_dirs.values()))
    figures.allowed.append(changed_bytes + sum(new_dirs.values()))
    log(
        f"  round {n + 1} later run ({chosen:,} files changed): rsync -a"
        f" {figures.rsync[-1]:.2f} s (median of {', '.join(f'{t:.2f}' for t in rsync_times)}),"
        f" end to end {figures.later[-1]:.2f} s (CLI {later.seconds:.2f} s: command started at"
        f" {later.at('started:'):.2f} s, snapshot line at {later.at('snapshot:'):.2f} s,"
        f" result at {later.at('result:'):.2f} s, committed at"
        f" {later.at('finalization: committed'):.2f} s; {job_seconds(r.worker_log, head)});"
        f" uploaded {figures.uploaded[-1]:,} B"
        f" for {changed_bytes:,} B changed + {len(new_dirs)} new directory blobs"
        f" ({figures.changed_dirs[-1]:,} B); {scan_line(later)}"
    )
    if not same_files(work, world.cwd):
        raise RuntimeError(f"the cwd {world.cwd} differs from the workdir {work}")


def checkout_at_head(r: Round, paths: list[Path]) -> None:
    """A checkout of the workdir already at the head, as the CLI's first step does it (it must
    do no work), and what any run of the CLI costs before it does anything."""
    from paperclip_client import Client
    from paperclip_client.workdir import ClientStore, checkout

    n, figures, work, world = r.n, r.figures, r.work, r.world
    with Client(r.url, world.key) as client:
        started = time.perf_counter()
        tree = client.workspace_head(world.workspace_id).tree
        looked_up = time.perf_counter() - started
        done = checkout(
            ClientStore(client),
            work,
            tree,
            server=client.base_url,
            workspace=world.workspace_id,
            say=lambda _line: None,
        )
        figures.checkout.append(time.perf_counter() - started - looked_up)
    if done.fetched or done.written or done.files != len(paths):
        raise RuntimeError(f"a checkout at the head did work: {done}")
    # What any run of the CLI costs before it does anything: the interpreter's start and the
    # CLI's imports (httpx among them), three times, the median kept.
    figures.cli_start.append(
        statistics.median(
            timed(
                lambda: subprocess.run(
                    [sys.executable, "-c", "import paperclip_client.cli"], check=True
                )
            )
            for _ in range(3)
        )
    )
    log(
        f"  round {n + 1} checkout at the head: {figures.checkout[-1] * 1000:.0f} ms for"
        f" {done.files:,} files (head lookup {looked_up * 1000:.0f} ms)"
    )


def run(bench_url: str, scratch: Path, config: Config, server_kind: str) -> int:
    compile_client()
    env = prepare(bench_url, scratch)
    source = scratch / "source"
    log(f"writing {config.files:,} files in {source} ...")
    paths = make_tree(source, config.files, seed=1)
    total = sum(p.stat().st_size for p in paths)
    log(f"  {total / MB:.0f} MiB")

    worker_log = scratch / "worker.log"
    worker_prefix = [sys.executable]
    if config.profile is not None:
        worker_prefix += ["-m", "cProfile", "-o", str(config.profile.with_suffix(".worker.prof"))]
    figures = Figures()
    with serving(server_kind, env, scratch, worker_prefix=worker_prefix) as (url, sampler):
        for n in range(config.rounds):
            one_round(n, url, source, paths, scratch, config, sampler, figures, worker_log)
        web_processes = len(sampler.web_pids)
    return report(config, total, figures, sampler, web_processes)


def report(config: Config, total: int, f: Figures, sampler: RssSampler, web_processes: int) -> int:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    first_ratio = med(f.cp) / med(f.first)
    later_ratio = med(f.rsync) / med(f.later)
    upload_ratio = max(u / a for u, a in zip(f.uploaded, f.allowed, strict=True))
    log("")
    log(f"tree: {config.files:,} files, {total / MB:.0f} MiB; {config.rounds} round(s), medians")
    log(
        f"first run end to end: {med(f.first):.2f} s ({total / MB / med(f.first):.0f} MiB/s,"
        f" {config.files / med(f.first):,.0f} files/s); cp -a {med(f.cp):.2f} s"
        f" ({config.files / med(f.cp):,.0f} files/s; {min(f.cp_runs):.2f} to"
        f" {max(f.cp_runs):.2f} s over {len(f.cp_runs)} copies)"
    )
    log(
        f"later run end to end: {med(f.later):.2f} s; rsync -a {med(f.rsync):.2f} s"
        f" ({min(f.rsync_runs):.2f} to {max(f.rsync_runs):.2f} s over {len(f.rsync_runs)} runs);"
        f" the CLI's start alone (interpreter and imports, no request) {med(f.cli_start):.2f} s"
    )
    log(
        f"later run uploaded: {', '.join(f'{u:,}' for u in f.uploaded)} B; changed files"
        f" {', '.join(f'{c:,}' for c in f.changed_bytes)} B + new directory blobs"
        f" {', '.join(f'{d:,}' for d in f.changed_dirs)} B"
    )
    log(f"checkout at the head: {', '.join(f'{c * 1000:.0f} ms' for c in f.checkout)}")
    log(
        f"peak RSS: CLI {sampler.cli_peak / MB:.0f} MB, web worker {sampler.web_peak / MB:.0f} MB"
        f" (largest of {web_processes} server process(es))"
    )
    git_lines, git_checks = git_report(f.git, f.first, f.later)
    for line in git_lines:
        log(line)
    log("")
    checks = [
        (first_ratio >= 0.3, f"first run vs cp -a: ratio {first_ratio:.2f} (>= 0.3)"),
        (
            later_ratio >= 0.4,
            f"later run ({config.changed:.0%} changed) vs rsync -a: ratio {later_ratio:.2f}"
            " (>= 0.4)",
        ),
        *git_checks,
        (
            upload_ratio <= 1.1,
            f"later run uploaded / (changed bytes + new directory blobs): ratio"
            f" {upload_ratio:.2f} (<= 1.1)",
        ),
        (
            max(f.checkout) < 0.5,
            f"checkout at the head: {max(f.checkout) * 1000:.0f} ms (< 500 ms)",
        ),
        (sampler.cli_peak < 200 * MB, f"CLI peak RSS {sampler.cli_peak / MB:.0f} MB (< 200)"),
        (
            sampler.web_peak < 200 * MB,
            f"web worker peak RSS {sampler.web_peak / MB:.0f} MB (< 200)",
        ),
    ]
    for ok, text in checks:
        log(f"{'MET   ' if ok else 'MISSED'} {text}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=None)
    parser.add_argument("--changed", type=float, default=0.01)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--server", choices=("production", "gunicorn"), default="production")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="cProfile the CLI into PATH.<run>.prof and the worker into PATH.worker.prof",
    )
    parser.add_argument(
        "--watcher",
        action="store_true",
        help="run `paperclip-agent watch` on each round's workdir from before its first run",
    )
    parser.add_argument("--keep-db", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--cas",
        choices=("filesystem", "s3"),
        default="filesystem",
        help="s3: the s3 backend against the filesystem one, same run (bench/snapshots_cas.py)",
    )
    parser.add_argument(
        "--scale",
        action="store_true",
        help="the same change on --files files and 4x as many, watcher running"
        " (bench/snapshots_scale.py)",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    config = Config(
        files=args.files or (1_000 if args.quick else 50_000),
        changed=args.changed,
        rounds=args.rounds or (1 if args.quick else 2),
        profile=args.profile,
        watcher=args.watcher,
    )
    if args.profile is not None:
        args.profile.parent.mkdir(parents=True, exist_ok=True)
    for tool in ("cp", "rsync", "diff", "git"):
        if shutil.which(tool) is None:
            log(f"{tool} is not installed: this bench needs it")
            return 1
    where = args.dir
    # source, workdir, two copies, cwd, the store and two git peers (worktree, repository, bare
    # repository, clone) at once, with room to spare
    if where is None and SHM.is_dir() and shutil.disk_usage(SHM).free > 24 * config.files * 9_000:
        where = SHM
    scratch = Path(tempfile.mkdtemp(prefix="paperclip-bench-snapshots-", dir=where))
    log(f"scratch directory: {scratch}")
    server_url = os.environ.get("DATABASE_URL") or DEFAULT_SERVER
    name = os.environ.get("PAPERCLIP_BENCH_SNAPSHOTS_DB", "paperclip_bench_snapshots")
    try:
        with throwaway_database(server_url, name, keep=args.keep_db, log=log) as bench_url:
            if args.scale:
                from bench.snapshots_scale import run_scale

                return run_scale(
                    bench_url,
                    scratch,
                    config.files,
                    config.changed,
                    config.rounds,
                    args.server,
                    profile=config.profile,
                )
            if args.cas == "s3":
                from bench.snapshots_cas import run_cas

                return run_cas(bench_url, scratch, config.files, config.rounds, args.server)
            return run(bench_url, scratch, config, args.server)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        log(f"removed {scratch}")


if __name__ == "__main__":
    sys.exit(main())
