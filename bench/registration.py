"""Snapshot registration of a large tree's successor: against the head, against the whole walk.

Run with `make bench` (or `.venv/bin/python bench/registration.py`). Not part of the test
suite.

It creates a throwaway database (`paperclip_bench_registration`, or
$PAPERCLIP_BENCH_REGISTRATION_DB) on the server of $DATABASE_URL (default
postgres://postgres@127.0.0.1:5432/postgres), migrates it, measures, and drops it at the end,
also on failure; the filesystem store lives in a temporary directory (on /dev/shm when there
is one), removed at the end. One run's agent holds the workspace's runtime lease; a tree of
--files files (200 directories of 7 subdirectories, as bench/snapshots.py's) is registered
and made the workspace's head. Then, for each change size (--changes, default 1, 10 and 500
files, chosen at random), rounds alternate two registrations of a new tree that changes that
many files of the head (its blobs uploaded first, not timed):

- **against the head**: `run_snapshot_register` as shipped, which compares the tree with the
  head and reads and pins only where they differ (docs/snapshots.md#registering-against-the-head);
- **whole walk** (the baseline): the same call with the comparison turned off, so that it
  reads every directory and pins every blob, as every registration did before.

It prints the median wall and CPU time of each (--rounds per path, default 5) and the ratio
whole / against the head. Then publishing's merge of two runs' trees that each change that
many files of the tree (disjoint) with its base: `publish_plan` as shipped, which merges by
directory (docs/snapshots.md#merging), alternating with the same call merging the whole trees
path by path (the baseline, as every merge did before); the median of each and the ratio. No
target is set by an issue; the ratios are what the docs quote.

Options: --files N (default 50,000), --changes 1,10,500, --rounds N, --quick (2,000 files,
changes 1 and 20, 2 rounds: a smoke run), --keep-db.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.servers import throwaway_database  # noqa: E402

DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432/postgres"
BATCH = 4000  # blobs per batch upload


def log(message: str = "") -> None:
    print(message, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=50_000)
    parser.add_argument("--changes", default="1,10,500")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--keep-db", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.files, args.changes, args.rounds = 2_000, "1,20", 2
    changes = [int(c) for c in args.changes.split(",")]
    server = os.environ.get("DATABASE_URL") or DEFAULT_SERVER
    name = os.environ.get("PAPERCLIP_BENCH_REGISTRATION_DB", "paperclip_bench_registration")
    shm = "/dev/shm"  # noqa: S108 - a private mkdtemp directory inside it
    where = shm if Path(shm).is_dir() else None
    store = Path(tempfile.mkdtemp(prefix="paperclip-bench-registration-", dir=where))
    try:
        with throwaway_database(server, name, keep=args.keep_db, log=log) as url:
            os.environ["DATABASE_URL"] = url
            os.environ["PAPERCLIP_CAS_BACKEND"] = "filesystem"
            os.environ["PAPERCLIP_CAS_DIR"] = str(store)
            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
            os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only")  # neither manage.py nor pytest
            import django

            django.setup()
            from django.core.management import call_command
            from django.db import connections

            log("migrating ...")
            call_command("migrate", verbosity=0)
            try:
                run_bench(args.files, changes, args.rounds)
            finally:
                connections.close_all()
    finally:
        shutil.rmtree(store, ignore_errors=True)
        log(f"removed {store}")
    return 0


def _layout(files: int) -> dict[str, bytes]:
    layout: dict[str, bytes] = {}
    per_leaf = max(1, -(-files // 1400))
    for n in range(files):
        leaf, k = divmod(n, per_leaf)
        layout[f"d{leaf // 7:03}/s{leaf % 7}/f{k:03}.txt"] = b"file %d\n" % n
    return layout


class Store:
    """Builds trees and uploads what the company's store lacks (not timed)."""

    def __init__(self, company_id: Any) -> None:
        self.company_id = company_id
        self.stored: set[str] = set()

    def tree(self, layout: dict[str, bytes]) -> str:
        from paperclip.snapshots.trees import Entry, blob_name, build

        entries: dict[str, Entry] = {}
        blobs: dict[str, bytes] = {}
        for path, data in layout.items():
            parts = path.split("/")
            for depth in range(1, len(parts)):
                entries.setdefault(
                    "/".join(parts[:depth]), Entry(name=parts[depth - 1], type="dir", mode=0o755)
                )
            digest = blob_name(data)
            blobs[digest] = data
            entries[path] = Entry(
                name=parts[-1], type="file", mode=0o644, size=len(data), digest=digest
            )
        root, directories = build(entries)
        blobs.update(directories)
        self.upload({n: d for n, d in blobs.items() if n not in self.stored})
        return root

    def upload(self, blobs: dict[str, bytes]) -> None:
        from paperclip.snapshots.store.batch import cas_put_batch

        names = sorted(blobs)
        for start in range(0, len(names), BATCH):
            body = io.BytesIO()
            for name in names[start : start + BATCH]:
                body.write(f"{name} {len(blobs[name])}\n".encode())
                body.write(blobs[name])
            size = body.tell()
            body.seek(0)
            cas_put_batch(company_id=self.company_id, stream=body, length=size)
        self.stored.update(names)


def run_bench(files: int, changes: list[int], rounds: int) -> None:
    from leases.services import RuntimeLeaseOwner, run_snapshot_register, runtime_lease_claim
    from paperclip.models import Agent, Company, ExecutionWorkspace, HeartbeatRun, Issue
    from paperclip.snapshots import registration

    company = Company.objects.create(name="bench")
    agent = Agent.objects.create(company=company, name="bench-agent")
    workspace = ExecutionWorkspace.objects.create(company=company, name="bench-workspace")
    issue = Issue.objects.create(company=company, title="bench", status="in_progress")
    run = HeartbeatRun.objects.create(
        company=company,
        agent=agent,
        issue=issue,
        native_issue=issue,
        execution_workspace=workspace,
        status="running",
        runtime_mode="native",
    )
    claim = runtime_lease_claim(
        company_id=company.pk,
        execution_workspace_id=workspace.pk,
        action="start",
        owner=RuntimeLeaseOwner.for_agent(agent.pk, run_id=run.pk),
    )
    assert claim.lease is not None
    generation = claim.lease.generation
    store = Store(company.pk)
    layout = _layout(files)
    log(f"uploading a tree of {len(layout):,} files ...")
    head = store.tree(layout)

    def register(tree: str, base: str | None) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        run_snapshot_register(
            company_id=company.pk,
            run_id=run.pk,
            agent_id=agent.pk,
            tree=tree,
            base=base,
            generation=generation,
        )
        return time.perf_counter() - wall, time.process_time() - cpu

    wall, _ = register(head, None)
    log(f"first registration (no head yet: the whole walk): {wall:.3f} s")
    ExecutionWorkspace.objects.filter(pk=workspace.pk).update(head_tree=head)

    against: Callable[..., Any] = registration._plan_against_head
    paths = sorted(layout)
    rng = random.Random(27)
    log()
    log(f"{'changed files':>13}  {'against the head':>24}  {'whole walk':>24}  ratio")
    for count in changes:
        timings: dict[str, list[tuple[float, float]]] = {"head": [], "whole": []}
        for number in range(rounds * 2):
            path = "head" if number % 2 == 0 else "whole"
            chosen = rng.sample(paths, min(count, len(paths)))
            tree = store.tree(
                layout | {p: b"changed %d %s\n" % (number, p.encode()) for p in chosen}
            )
            registration._plan_against_head = against if path == "head" else _never
            try:
                timings[path].append(register(tree, head))
            finally:
                registration._plan_against_head = against
        head_wall = statistics.median(t[0] for t in timings["head"])
        whole_wall = statistics.median(t[0] for t in timings["whole"])
        head_cpu = statistics.median(t[1] for t in timings["head"])
        whole_cpu = statistics.median(t[1] for t in timings["whole"])
        log(
            f"{count:>13,}  {head_wall * 1000:>8.1f} ms ({head_cpu * 1000:>6.1f} CPU)"
            f"  {whole_wall * 1000:>8.1f} ms ({whole_cpu * 1000:>6.1f} CPU)"
            f"  {whole_wall / head_wall:5.1f}x"
        )
    log()
    log(
        f"tree: {len(layout):,} files; median of {rounds} registrations per path and size, "
        "alternating; ratio = whole walk / against the head (wall time)"
    )
    merges(company.pk, workspace.pk, store, layout, head, changes, rounds)


def merges(
    company_id: Any,
    workspace_id: Any,
    store: Store,
    layout: dict[str, bytes],
    base: str,
    changes: list[int],
    rounds: int,
) -> None:
    """Publishing's merge of a run's tree with a head another run moved, both changing that
    many files of `base` (disjoint): by directory as shipped, against the whole-tree merge."""
    from paperclip.models import ExecutionWorkspace
    from paperclip.snapshots import head

    by_directory: Callable[..., Any] = head.merge_trees
    paths = sorted(layout)
    rng = random.Random(30)
    log()
    log(f"{'changed files':>13}  {'merge by directory':>18}  {'whole trees':>12}  ratio")
    for count in changes:
        timings: dict[str, list[float]] = {"directory": [], "whole": []}
        for number in range(rounds * 2):
            path = "directory" if number % 2 == 0 else "whole"
            chosen = rng.sample(paths, min(2 * count, len(paths)))
            theirs = store.tree(layout | {p: b"theirs %d\n" % number for p in chosen[:count]})
            ours = store.tree(layout | {p: b"ours %d\n" % number for p in chosen[count:]})
            ExecutionWorkspace.objects.filter(pk=workspace_id).update(head_tree=theirs)
            head.merge_trees = by_directory if path == "directory" else _never
            try:
                started = time.perf_counter()
                plan = head.publish_plan(
                    company_id=company_id, workspace_id=workspace_id, tree=ours, base=base
                )
                timings[path].append(time.perf_counter() - started)
            finally:
                head.merge_trees = by_directory
            assert plan.kind == "merged", plan
        directory = statistics.median(timings["directory"])
        whole = statistics.median(timings["whole"])
        log(
            f"{count:>13,}  {directory * 1000:>15.1f} ms  {whole * 1000:>9.1f} ms"
            f"  {whole / directory:5.1f}x"
        )
    log()
    log(
        f"merge: each side changes that many files of the {len(layout):,}-file tree; median of"
        f" {rounds} merges per path, alternating; ratio = whole trees / by directory"
    )


def _never(*_args: Any, **_kwargs: Any) -> None:
    return None


if __name__ == "__main__":
    sys.exit(main())
