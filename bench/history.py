"""A workspace's history and diff against git's on the same content, in the same run.

Run with `make bench` (or `.venv/bin/python bench/history.py`). Not part of the test suite.

It creates a throwaway database (`paperclip_bench_history`, or $PAPERCLIP_BENCH_HISTORY_DB)
on the server of $DATABASE_URL (default postgres://postgres@127.0.0.1:5432/postgres),
migrates it, measures, and drops it at the end, also on failure; the filesystem store and the
git repository live in a temporary directory, removed at the end. Each figure is the median of
--rounds (default 7), the sides taking turns in each round:

- **history**: the first page of 50 of a workspace with --moves moves (default 10,000): the
  service in process, one request over HTTP on a keep-alive connection to the production
  server (granian, one worker, started here), and `curl` fetching it (a command, its process
  start included), against `git log -n 50 --format=...` in a repository of as many commits.
  `curl` of `/healthz` shows what curl's own start costs, and `/healthz` over the same
  keep-alive connection the server's fixed cost per request. Two verdicts: one request over HTTP
  (the whole server path, as the console or the CLI pays it per page) against `git log`, and
  the two commands, `curl` and `git log`, each paying a process start as a person at a
  terminal does.
- **diff**: `tree_diff` of two trees of --files files (default 50,000) differing in --changed
  (default 500, at random), with a cold directory cache (every directory blob read from the
  store): first as trees nothing recorded (every directory validated as it is read), then
  recorded as the publisher records a tree it builds (what every head and registered snapshot
  is; their directories are not validated again), cold and warm (right after a cold one: the
  process's directory cache, bounded at 16 MiB, holding what it read, as for a user reopening
  the same diff); then the diff API over HTTP, the first request of a freshly started server
  (cold) and the next one (warm), a fresh server each round; against `git diff --stat` of the
  same two trees as two commits (a command each time).

Issue 40 asks for each of ours under 100 ms and no slower than git's; the last lines say MET or
MISSED for each. Options: --moves N, --files N, --changed N, --rounds N, --quick (500 moves,
2,000 files, 20 changed, 1 round: a smoke run), --keep-db.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.servers import (  # noqa: E402
    free_port,
    stop_process,
    throwaway_database,
    wait_for_server,
)

DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432/postgres"
TARGET_MS = 100  # issue 40's bound for each


def log(message: str = "") -> None:
    print(message, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moves", type=int, default=10_000)
    parser.add_argument("--files", type=int, default=50_000)
    parser.add_argument("--changed", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--keep-db", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.moves, args.files, args.changed, args.rounds = 500, 2_000, 20, 1
    server = os.environ.get("DATABASE_URL") or DEFAULT_SERVER
    name = os.environ.get("PAPERCLIP_BENCH_HISTORY_DB", "paperclip_bench_history")
    shm = "/dev/shm"  # noqa: S108 - a private mkdtemp directory inside it
    scratch = Path(
        tempfile.mkdtemp(prefix="paperclip-bench-history-", dir=shm if Path(shm).is_dir() else None)
    )
    try:
        with throwaway_database(server, name, keep=args.keep_db, log=log) as url:
            os.environ["DATABASE_URL"] = url
            os.environ["PAPERCLIP_CAS_BACKEND"] = "filesystem"
            os.environ["PAPERCLIP_CAS_DIR"] = str(scratch / "cas")
            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
            os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only")
            import django

            django.setup()
            from django.core.management import call_command
            from django.db import connections

            log("migrating ...")
            call_command("migrate", verbosity=0)
            try:
                run_bench(args, scratch)
            finally:
                connections.close_all()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        log(f"removed {scratch}")
    return 0


def git(repo: Path, *argv: str, stdin: bytes | None = None) -> bytes:
    done = subprocess.run(
        ["git", "-C", str(repo), *argv],
        input=stdin,
        capture_output=True,
        check=True,
    )
    return done.stdout


def _fast_import_commits(commits: list[dict[str, bytes]], *, full: bool) -> bytes:
    """A fast-import stream of one commit per mapping (path -> bytes), each on the last."""
    out: list[bytes] = []
    for n, files in enumerate(commits, 1):
        out.append(b"commit refs/heads/main\n")
        out.append(b"committer bench <bench@example.com> %d +0000\n" % (1_700_000_000 + n))
        message = b"move %d" % n
        out.append(b"data %d\n%s\n" % (len(message), message))
        if full and n == 1:
            out.append(b"deleteall\n")
        for path, data in files.items():
            out.append(b"M 100644 inline %s\ndata %d\n%s\n" % (path.encode(), len(data), data))
    return b"".join(out)


def _layout(files: int) -> dict[str, bytes]:
    per_leaf = max(1, -(-files // 1400))
    return {
        f"d{(n // per_leaf) // 7:03}/s{(n // per_leaf) % 7}/f{n % per_leaf:03}.txt": b"file %d\n"
        % n
        for n in range(files)
    }


def run_bench(args: argparse.Namespace, scratch: Path) -> None:
    from paperclip.models import Company, ExecutionWorkspace

    company = Company.objects.create(name="bench")
    workspace = ExecutionWorkspace.objects.create(company=company, name="bench")
    repo = scratch / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    from paperclip.credentials import agent_key_create
    from paperclip.models import Agent

    agent = Agent.objects.create(company=company, name="bench-agent")
    secret = agent_key_create(agent_id=agent.pk).secret
    verdicts = [
        bench_history(args, repo, company, workspace, secret),
        bench_diff(args, repo, company, workspace, secret),
    ]
    log("")
    for verdict in verdicts:
        log(verdict)


def interleaved_ms(rounds: int, calls: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """The median of `rounds` timings of each call, the calls taking turns in each round (a
    busy moment of the machine then weighs on every side alike)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(found) for name, found in times.items()}


def verdict(label: str, ours: float, theirs: float, baseline: str) -> str:
    under = "MET" if ours < TARGET_MS else "MISSED"
    parity = "MET" if ours <= theirs else "MISSED"
    return (
        f"{label}: under {TARGET_MS} ms {under} ({ours:.1f} ms);"
        f" no slower than {baseline} {parity} (ratio {baseline}/ours {theirs / ours:.2f})"
    )


def bench_history(
    args: argparse.Namespace, repo: Path, company: Any, workspace: Any, secret: str
) -> str:
    """The first page of a long history: the service in process, one request over HTTP (a
    keep-alive connection to a running server, as the console's or the CLI's), and `curl`, a
    command as `git log` is (a process started each time), against `git log -n 50`."""
    from django.db import connection

    from paperclip.access import Actor
    from paperclip.snapshots.history import workspace_history
    from paperclip.snapshots.models import WorkspaceHeadMove
    from paperclip.snapshots.trees import blob_name

    log(f"recording {args.moves:,} moves, and as many git commits ...")
    trees = [blob_name(b"tree %d" % n) for n in range(args.moves + 1)]
    WorkspaceHeadMove.objects.bulk_create(
        [
            WorkspaceHeadMove(
                company=company,
                workspace=workspace,
                seq=n,
                tree=trees[n],
                previous_tree=trees[n - 1],
                kind="publish",
                actor_type="system",
                actor_id="bench",
                added=1,
            )
            for n in range(1, args.moves + 1)
        ],
        batch_size=5000,
    )
    git(
        repo,
        "fast-import",
        "--quiet",
        stdin=_fast_import_commits(
            [{"log.txt": b"move %d\n" % n} for n in range(args.moves)], full=False
        ),
    )
    with connection.cursor() as cursor:
        # Plan as production does, with statistics (autovacuum analyzes a table that grew by
        # 10%): without them the planner guesses a few dozen moves per workspace and reads and
        # sorts all 10,000 for a page of 50.
        cursor.execute("ANALYZE workspace_head_moves")
    board = Actor(type="board", company_ids=None)
    page = workspace_history(actor=board, workspace_id=workspace.pk, limit=50)
    assert len(page.moves) == 50 and page.moves[0].seq == args.moves  # noqa: PT018
    path = f"/api/execution-workspaces/{workspace.pk}/history?limit=50"
    port = free_port()
    with running_server(port) as server:
        conn = wait_for_server(port, server)
        headers = {"Authorization": f"Bearer {secret}"}

        def over_http(where: str = path) -> None:
            conn.request("GET", where, headers=headers)
            response = conn.getresponse()
            body = response.read()
            assert response.status == 200, body[:200]

        curl = ["curl", "-sSf", "-o", "/dev/null", "-H", f"Authorization: Bearer {secret}"]
        url = f"http://127.0.0.1:{port}"
        log_argv = ["git", "-C", str(repo), "log", "-n", "50", "--format=%H %ct %an %s"]
        over_http()
        found = interleaved_ms(
            args.rounds,
            {
                "service": lambda: workspace_history(
                    actor=board, workspace_id=workspace.pk, limit=50
                ),
                "http": over_http,
                "http_healthz": lambda: over_http("/healthz"),
                "curl": lambda: subprocess.run([*curl, url + path], check=True),
                "healthz": lambda: subprocess.run([*curl, url + "/healthz"], check=True),
                "git": lambda: subprocess.run(log_argv, check=True, capture_output=True),
            },
        )
        conn.close()
    log(
        f"history (first page of 50 of {args.moves:,}): service {found['service']:.1f} ms,"
        f" one request over HTTP {found['http']:.1f} ms (/healthz over HTTP, the server's"
        f" fixed cost: {found['http_healthz']:.1f} ms), curl (a command) {found['curl']:.1f} ms"
        f" (curl of /healthz: {found['healthz']:.1f} ms); git log -n 50 (a command)"
        f" {found['git']:.1f} ms"
    )
    return "\n".join(
        (
            verdict("history, one request over HTTP", found["http"], found["git"], "git log"),
            verdict("history, curl against git log", found["curl"], found["git"], "git log"),
        )
    )


@contextmanager
def running_server(port: int, *, quiet: bool = False) -> Iterator[subprocess.Popen[bytes]]:
    """The production server (granian, `paperclip.serve`), one worker, on the bench's database
    and store, its request log discarded."""
    from paperclip import serve

    env = {
        **os.environ,
        "DJANGO_DEBUG": "false",
        "DJANGO_CONN_MAX_AGE": "600",  # persistent connections, as in production
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
    }
    argv = serve.command(bind=f"127.0.0.1:{port}", workers=1, threads=2)
    if not quiet:
        log(f"starting the server on 127.0.0.1:{port} (granian, 1 worker) ...")
    server = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield server
    finally:
        stop_process(server)


def bench_diff(
    args: argparse.Namespace, repo: Path, company: Any, workspace: Any, secret: str
) -> str:
    """Two trees of many files differing in a few, against `git diff --stat` of the same trees
    as two commits: in process cold (every directory read from the store) and warm (the
    process's directory cache holding them: a repeated diff); and over HTTP, the first request
    of a fresh server (cold) and the one after it (warm)."""
    from paperclip.snapshots.counts import Counts, tree_counts_record
    from paperclip.snapshots.diff import tree_diff
    from paperclip.snapshots.store import reads
    from paperclip.snapshots.store.uploads import cas_store_blobs
    from paperclip.snapshots.trees import Entry, blob_name, build

    log(f"building two trees of {args.files:,} files differing in {args.changed} ...")
    before = _layout(args.files)
    after = dict(before)
    for path in random.Random(40).sample(sorted(before), args.changed):
        after[path] = b"changed " + path.encode()

    def stored_tree(files: dict[str, bytes]) -> str:
        entries: dict[str, Entry] = {}
        for path, data in files.items():
            parts = path.split("/")
            for depth in range(1, len(parts)):
                entries.setdefault(
                    "/".join(parts[:depth]), Entry(name=parts[depth - 1], type="dir", mode=0o755)
                )
            entries[path] = Entry(
                name=parts[-1], type="file", mode=0o644, size=len(data), digest=blob_name(data)
            )
        root, blobs = build(entries)
        cas_store_blobs(company_id=company.pk, blobs=blobs)  # the directories: all a diff reads
        return root

    old, new = stored_tree(before), stored_tree(after)
    git(repo, "checkout", "-q", "--orphan", "trees")
    git(
        repo,
        "fast-import",
        "--quiet",
        stdin=_fast_import_commits([before], full=True).replace(
            b"refs/heads/main", b"refs/heads/trees"
        ),
    )
    git(
        repo,
        "fast-import",
        "--quiet",
        stdin=_fast_import_commits([{p: d for p, d in after.items() if before[p] != d}], full=False)
        .replace(b"refs/heads/main", b"refs/heads/trees")
        .replace(b"data 6\nmove 1\n", b"data 6\nmove 1\nfrom refs/heads/trees^0\n"),
    )

    def cold_diff() -> Any:
        reads._directories = reads._DirectoryCache()  # every directory read from the store
        return tree_diff(company_id=company.pk, before=old, after=new)

    def git_diff() -> bytes:
        return git(repo, "diff", "--stat", "trees~1", "trees")

    diff = cold_diff()
    assert diff.counts.modified == args.changed
    assert b"%d files changed" % args.changed in git_diff()
    unrecorded = interleaved_ms(args.rounds, {"ours": cold_diff})["ours"]
    for tree, files in ((old, before), (new, after)):  # as the publisher records a tree it built
        tree_counts_record(company_id=company.pk, tree=tree, counts=Counts(len(files), 0, 0))
    assert cold_diff().changes == diff.changes
    found = interleaved_ms(
        args.rounds,
        {
            "ours": cold_diff,
            "warm": lambda: tree_diff(company_id=company.pk, before=old, after=new),
            "git": git_diff,
        },
    )
    path = f"/api/execution-workspaces/{workspace.pk}/diff?from={old}&to={new}&limit=1000"
    http = diff_over_http(args.rounds, path, secret, git_diff)
    log(
        f"diff ({args.changed} of {args.files:,} files, {diff.read} directories read):"
        f" in process, recorded trees, cold {found['ours']:.1f} ms, warm {found['warm']:.1f} ms;"
        f" trees not recorded (every directory validated), cold {unrecorded:.1f} ms; over HTTP"
        f" (auth, the JSON of {args.changed} changes), the first request of a fresh server"
        f" (cold) {http['cold']:.1f} ms, the next (warm) {http['warm']:.1f} ms;"
        f" git diff --stat {found['git']:.1f} ms (in process) / {http['git']:.1f} ms (over HTTP)"
    )
    return "\n".join(
        (
            verdict("diff, cold, in process", found["ours"], found["git"], "git diff"),
            verdict("diff, warm, in process", found["warm"], found["git"], "git diff"),
            verdict("diff, cold, over HTTP", http["cold"], http["git"], "git diff"),
            verdict("diff, warm, over HTTP", http["warm"], http["git"], "git diff"),
        )
    )


def diff_over_http(
    rounds: int, path: str, secret: str, git_diff: Callable[[], Any]
) -> dict[str, float]:
    """The diff over HTTP on a keep-alive connection: each round a fresh server (its caches
    empty), warmed by one `/healthz`, then the diff twice (cold, then warm), then `git diff`;
    medians of the rounds."""
    times: dict[str, list[float]] = {"cold": [], "warm": [], "git": []}
    headers = {"Authorization": f"Bearer {secret}"}
    for _ in range(rounds):
        port = free_port()
        with running_server(port, quiet=True) as server:
            conn = wait_for_server(port, server)
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            for name in ("cold", "warm"):
                start = time.perf_counter()
                conn.request("GET", path, headers=headers)
                response = conn.getresponse()
                body = response.read()
                times[name].append((time.perf_counter() - start) * 1000)
                assert response.status == 200, body[:200]
            conn.close()
        start = time.perf_counter()
        git_diff()
        times["git"].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(found) for name, found in times.items()}


if __name__ == "__main__":
    sys.exit(main())
