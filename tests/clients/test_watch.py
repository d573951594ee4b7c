"""The workdir watcher (`paperclip-agent watch`) and the partial scan it allows (issue #42).

Each test starts the real watcher process on a real directory and takes snapshots through the
client's own `snapshot` and `commit_snapshot` (the store is test_workdir's in-memory one). One
test per way a watcher can miss a change shows the next snapshot still holds it; the last
compares the partial scan with a full one over randomized edits.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import paperclip_client
from paperclip_client import trees, workdir
from paperclip_client.workdir import watch_state
from tests.clients.test_workdir import SERVER, WORKSPACE, FakeStore, make, old

CLIENT_PATH = str(Path(paperclip_client.__file__).resolve().parents[1])
ENTRY = (
    "import sys; sys.argv[0] = 'paperclip-agent'; from paperclip_client.cli import entry; entry()"
)


class Watcher:
    def __init__(self, root: Path, *extra: str) -> None:
        self.root = root
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ENTRY, "watch", "--workdir", str(root), *extra],
            env={**os.environ, "PYTHONPATH": CLIENT_PATH},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None
        self.first = self.proc.stdout.readline()
        assert "directories watched" in self.first, self.first

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        return out

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


@pytest.fixture
def watchers() -> Iterator[list[Watcher]]:
    started: list[Watcher] = []
    yield started
    for w in started:
        w.resume()
        w.stop()


def watch(watchers: list[Watcher], root: Path, *extra: str) -> Watcher:
    w = Watcher(root, *extra)
    watchers.append(w)
    return w


def take(store: FakeStore, root: Path) -> tuple[workdir.SnapshotResult, str]:
    """A snapshot as the CLI takes it, and its line saying how the workdir was scanned."""
    said: list[str] = []
    result = workdir.snapshot(
        store, root, say=said.append, warn=lambda _: None, trust_index=(SERVER, WORKSPACE)
    )
    workdir.commit_snapshot(root, result, server=SERVER, workspace=WORKSPACE)
    scans = [s for s in said if s.startswith(("watcher:", "full scan:"))]
    assert len(scans) == 1, said
    # The store holds the whole tree: a partial scan uploads what it read and the directories
    # it built, and every other blob was stored before.
    entries = workdir.read_tree(result.tree, lambda names: {n: store.blobs[n] for n in names})
    assert all(b in store.blobs for e in entries.values() for b in e.blobs())
    return result, scans[0]


def full_tree(root: Path) -> str:
    """The tree a full scan with no stat cache reads now."""
    return workdir.scan(root, max_blob_bytes=64 * 1024 * 1024, index=None, warn=lambda _: None).tree


def settled(store: FakeStore, root: Path) -> None:
    """Two snapshots: the first takes the watcher's first token (a full scan), the second
    is a partial scan that read nothing."""
    take(store, root)
    _result, line = take(store, root)
    assert line.startswith("watcher: 0 directories changed"), line


def tree_of(root: Path) -> dict[str, str | bytes]:
    return {f"d{i}/f{j}": f"content {i} {j}" for i in range(4) for j in range(5)}


def test_edits_while_the_watcher_was_down_are_in_the_next_snapshot(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    store, root = FakeStore(), tmp_path / "w"
    make(root, tree_of(root))
    first, line = take(store, root)
    assert line == "full scan: no watcher running (paperclip-agent watch)"
    (root / "d1/f1").write_text("edited before the watcher started")
    dead = watch(watchers, root)
    second, line = take(store, root)
    assert second.tree == full_tree(root) != first.tree
    assert line == "full scan: no watcher state from an earlier snapshot"
    dead.proc.send_signal(signal.SIGKILL)  # its socket stays behind, nobody answers
    dead.proc.wait(timeout=30)
    (root / "d2/f2").write_text("edited while the watcher was down")
    third, line = take(store, root)
    assert third.tree == full_tree(root) != second.tree
    assert line.startswith("full scan: the watcher did not answer"), line
    (root / "d3/f3").write_text("edited before the next watcher started")
    watch(watchers, root)
    fourth, line = take(store, root)
    assert fourth.tree == full_tree(root) != third.tree
    assert line == "full scan: no watcher state from an earlier snapshot"
    (root / "d0/f0").write_text("edited with the watcher")
    fifth, line = take(store, root)
    assert fifth.tree == full_tree(root) != fourth.tree
    assert line.startswith("watcher: 1 directory changed"), line


def test_edits_between_runs_are_in_the_next_snapshot(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    store, root = FakeStore(), tmp_path / "w"
    make(root, {**tree_of(root), "deep/a/b/c/f": "deep one"})
    watch(watchers, root)
    settled(store, root)
    before = full_tree(root)
    (root / "deep/a/b/c/f").write_text("DEEP ONE")  # same size
    (root / "d0/f0").unlink()
    (root / "d1/added").write_text("added")
    (root / "d2/f2").chmod(0o755)
    result, line = take(store, root)
    assert result.tree == full_tree(root) != before
    assert b"DEEP ONE" in store.blobs.values()
    assert line.startswith("watcher: 4 directories changed"), line


def test_more_pending_directories_than_the_watcher_keeps_means_a_full_scan(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    store, root = FakeStore(), tmp_path / "w"
    make(root, {f"d{i}/f": "x" for i in range(6)})
    watch(watchers, root, "--max-pending", "3")
    settled(store, root)
    for i in range(6):
        (root / f"d{i}/f").write_text(f"changed {i}")
    result, line = take(store, root)
    assert result.tree == full_tree(root)
    assert line == "full scan: more than 3 directories changed (--max-pending)"
    _again, line = take(store, root)  # a token issued after the overflow is answered again
    assert line.startswith("watcher: 0 directories changed"), line


def test_an_overflow_of_the_kernels_queue_means_a_full_scan(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"noise/a": "a", "noise/b": "b", "d/f": "before"})
    w = watch(watchers, root)
    settled(store, root)
    queued = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    w.pause()  # nothing is read: the kernel's queue fills
    for i in range(queued + 10):
        os.utime(root / ("noise/a" if i % 2 else "noise/b"))  # alternate: never merged
    (root / "d/f").write_text("after!")  # its events are past the queue's end: lost
    w.resume()
    result, line = take(store, root)
    assert result.tree == full_tree(root)
    assert b"after!" in store.blobs.values()
    assert line == "full scan: the kernel's event queue overflowed"


def test_a_rename_over_an_existing_file_is_in_the_next_snapshot(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/t": "aaaa", "d/other": "o"})
    watch(watchers, root)
    settled(store, root)
    outside = tmp_path / "outside"
    outside.write_text("bbbb")  # same size, same mtime: only the inode differs
    info = (root / "d/t").stat()
    os.utime(outside, ns=(info.st_atime_ns, info.st_mtime_ns))
    os.replace(outside, root / "d/t")
    result, line = take(store, root)
    assert result.tree == full_tree(root)
    assert b"bbbb" in store.blobs.values()
    assert line.startswith("watcher: 1 directory changed"), line


def test_a_directory_tree_made_before_its_watch_is_read_whole(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/f": "f"})
    w = watch(watchers, root)
    settled(store, root)
    w.pause()  # the whole tree is there before the watcher sees its first directory
    make(root, {"x/y/z/deep": "deep", "x/y/mid": "mid", "x/top": "top", "d/x/y/z": "z"})
    os.symlink("../top", root / "x/y/up")
    w.resume()
    result, line = take(store, root)
    assert result.tree == full_tree(root)
    assert {b"deep", b"mid", b"top", b"z"} <= set(store.blobs.values())
    assert line.startswith("watcher: "), line


def test_a_change_in_the_stat_caches_timestamp_tick_is_read_whatever_the_watcher_says(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """The racy rule kept: a file whose stat matches its index entry but whose mtime is not
    older than the index is read again, even when the watcher reports nothing about it."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/f": "AAAA", "e/g": "g"})
    old(root / "d/f")
    watch(watchers, root)
    settled(store, root)
    mtime = (root / "d/f").stat().st_mtime_ns
    (root / "d/f").write_text("BBBB")  # same size; then the same mtime again
    os.utime(root / "d/f", ns=(mtime, mtime))
    index = root / ".paperclip" / workdir.INDEX
    os.utime(index, ns=(mtime, mtime))  # the index written in the file's tick
    # The watcher saw the write: take a token after it, as if the write came in the tick
    # between the scan's read and the index's write.
    state = watch_state.load_state(root)
    assert state is not None
    answer = watch_state.ask(root, state.token)
    assert isinstance(answer, watch_state.Answer)
    assert (answer.dirs, dict(answer.names)) == (frozenset(), {"d": {"f"}})
    state.token = answer.token
    watch_state.save_state(root, state)
    result, line = take(store, root)
    assert result.tree == full_tree(root)
    assert b"BBBB" in store.blobs.values()
    assert line.startswith("watcher: 0 directories changed (1 file read)"), line


def test_a_restarted_watcher_means_a_full_scan(tmp_path: Path, watchers: list[Watcher]) -> None:
    store, root = FakeStore(), tmp_path / "w"
    make(root, tree_of(root))
    first = watch(watchers, root)
    settled(store, root)
    assert "watch: stopped" in first.stop()
    assert not (root / ".paperclip" / watch_state.SOCKET).exists()
    (root / "d0/f1").write_text("edited while no watcher ran")
    watch(watchers, root)
    result, line = take(store, root)
    assert result.tree == full_tree(root)
    assert b"edited while no watcher ran" in store.blobs.values()
    assert line == "full scan: the token is another watcher's (it was restarted)"


def test_a_file_written_through_another_hard_link_is_read_again(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/f": "one", "e/g": "g"})
    outside = tmp_path / "link"
    os.link(root / "d/f", outside)
    watch(watchers, root)
    settled(store, root)
    outside.write_text("two, longer")  # no event in the workdir: the inode is shared
    result, line = take(store, root)
    assert result.tree == full_tree(root)
    assert line.startswith("watcher: 0 directories changed (1 file read)"), line


def test_a_hard_link_made_since_the_last_snapshot_means_a_full_scan(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """`ln d/f e/g` makes an event in `e` alone (a change of link count is an event on the
    file, never on the directory of its other name), and a write through `e/g` later is an
    event in `e` alone: `d/f` was never looked at again and kept its old content for good."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/f": "one", "e/keep": "k"})
    watch(watchers, root)
    settled(store, root)
    os.link(root / "d/f", root / "e/g")
    result, line = take(store, root)
    assert line == "full scan: e/g: a new hard link (its other names are unknown)"
    assert result.tree == full_tree(root)
    (root / "e/g").write_text("two, longer")
    result, line = take(store, root)
    assert line.startswith("watcher: 1 directory changed"), line
    assert result.tree == full_tree(root)
    assert trees.blob_name(b"two, longer") == result.scan.entries["d/f"].digest


def test_two_directories_exchanged_in_one_step_stay_watched(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """renameat2's RENAME_EXCHANGE (`mv --exchange a b`): moved from a, moved to b, moved from
    b, moved to a. The second "moved from" unwatched the b the first "moved to" had just
    watched, and every later change under b was missed."""
    libc = ctypes.CDLL(None, use_errno=True)
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"a/f": "in a", "b/g": "in b", "c/h": "h"})
    watch(watchers, root)
    settled(store, root)
    at_cwd, rename_exchange = -100, 2
    assert (
        libc.renameat2(
            at_cwd,
            os.fsencode(root / "a"),
            at_cwd,
            os.fsencode(root / "b"),
            rename_exchange,
        )
        == 0
    ), os.strerror(ctypes.get_errno())
    result, _line = take(store, root)
    assert result.tree == full_tree(root)
    (root / "b/f").write_text("edited after the exchange")
    (root / "b/new").write_text("new under b")
    (root / "a/g").write_text("edited under a")
    result, line = take(store, root)
    assert line.startswith("watcher:"), line
    assert result.tree == full_tree(root)


def test_a_copy_of_the_workdir_made_with_hard_links_never_takes_its_watchers_answer(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """`cp -al w1 w2` links w1's socket into w2 (and copies `watch.json` with a token w1's
    watcher still answers): w2's snapshots were answered by w1's watcher, "0 directories
    changed", and w2's work was missing from them. Every answer names the directory watched."""
    store, w1 = FakeStore(), tmp_path / "w1"
    make(w1, {"d/f": "f", "e/g": "g"})
    watch(watchers, w1)
    settled(store, w1)
    w2 = tmp_path / "w2"
    subprocess.run(["cp", "-al", str(w1), str(w2)], check=True)
    (w2 / "d/new").write_text("work done in w2")
    result, line = take(store, w2)
    assert line == (
        "full scan: the watcher answering watches another directory (a copy of this workdir?)"
    )
    assert result.tree == full_tree(w2)
    _result, line = take(store, w1)  # the watched workdir itself is unaffected
    assert line.startswith("watcher: 0 directories changed"), line


def test_a_tracked_path_the_ignore_rules_match_is_read_by_the_full_scan(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """`a.log` is in the last tree, then `*.log` is ignored: it stays tracked (its deletion
    is never published). The partial scan does not know every tracked path: a change in a
    directory holding one means the full scan, which keeps it, changed."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/a.log": "first", "d/f": "f"})
    watch(watchers, root)
    settled(store, root)
    (root / ".paperclipignore").write_text("*.log\n")
    result, line = take(store, root)
    assert line == "full scan: the ignore rules changed"
    assert "d/a.log" in result.scan.entries
    (root / "d" / "a.log").write_text("second, tracked")
    result, line = take(store, root)
    assert line == "full scan: d/a.log: tracked, and matched by .paperclipignore"
    assert result.scan.entries["d/a.log"].digest == trees.blob_name(b"second, tracked")


def test_one_watcher_per_workdir(tmp_path: Path, watchers: list[Watcher]) -> None:
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"f": "f"})
    first = watch(watchers, root)
    second = subprocess.run(
        [sys.executable, "-c", ENTRY, "watch", "--workdir", str(root)],
        env={**os.environ, "PYTHONPATH": CLIENT_PATH},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert second.returncode == 1
    assert "another watcher already runs for this workdir" in second.stderr
    settled(store, root)
    assert first.stop().endswith("watch: stopped\n")
    assert sorted(os.listdir(root / ".paperclip")) == [
        workdir.DIRS,
        workdir.INDEX,
        "stamp",
        "watch.json",
        "watch.lock",
    ]


def _random_edit(rng: random.Random, root: Path, n: int) -> None:
    paths = [p for p in root.rglob("*") if ".paperclip" not in p.parts and not p.is_symlink()]
    files = [p for p in paths if p.is_file()]
    dirs = [p for p in paths if p.is_dir()]
    dirs.append(root)
    kind = rng.choice(
        ["write", "write", "append", "new", "delete", "chmod", "mkdir", "rmtree", "mvdir",
         "rename_over", "symlink", "mvfile", "many"]
    )  # fmt: skip
    if kind in ("write", "append", "delete", "chmod", "rename_over", "mvfile") and not files:
        kind = "new"
    if kind == "write":
        rng.choice(files).write_text(f"written {n}")
    elif kind == "append":
        with rng.choice(files).open("a") as handle:
            handle.write("+")
    elif kind == "new":
        (rng.choice(dirs) / f"n{n}").write_text(f"new {n}")
    elif kind == "delete":
        rng.choice(files).unlink()
    elif kind == "chmod":
        rng.choice(files).chmod(rng.choice([0o644, 0o755, 0o600]))
    elif kind == "mkdir":
        made = rng.choice(dirs) / f"m{n}" / "inner"
        made.mkdir(parents=True)
        (made / "x").write_text(f"x {n}")
        (made.parent / "y").write_text(f"y {n}")
    elif kind == "rmtree" and len(dirs) > 3:
        victim = rng.choice([d for d in dirs if d != root])
        shutil.rmtree(victim)
    elif kind == "mvdir" and len(dirs) > 3:
        moved = rng.choice([d for d in dirs if d != root])
        target = rng.choice([d for d in dirs if moved not in (d, *d.parents)])
        os.rename(moved, target / f"mv{n}")
    elif kind == "rename_over":
        a, b = rng.choice(files), rng.choice(files)
        if a != b:
            os.replace(a, b)
    elif kind == "symlink":
        where = rng.choice(dirs)
        depth = len(where.relative_to(root).parts)
        up = "../" * rng.randint(0, depth + 1)  # some leave the workdir
        os.symlink(f"{up}d{rng.randint(0, 9)}", where / f"l{n}")
    elif kind == "mvfile":
        os.rename(rng.choice(files), rng.choice(dirs) / f"r{n}")
    elif kind == "many":  # more than the watcher names one by one: the directory is listed
        where = rng.choice(dirs)
        for k in range(70):
            (where / f"many{n}-{k}").write_text(f"{n} {k}")


def test_a_partial_scan_builds_the_full_scans_tree_on_random_edits(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    rng = random.Random(42)
    store, root = FakeStore(), tmp_path / "w"
    files: dict[str, str | bytes] = {
        f"d{i}/s{j % 3}/f{j}": f"file {i} {j}" for i in range(10) for j in range(30)
    }
    make(root, files)
    os.symlink("../d1/s0", root / "d0/link")
    w = watch(watchers, root)
    settled(store, root)
    n = 0
    for _round in range(25):
        paused = rng.random() < 0.3  # the edits land before the watcher reads any of them
        if paused:
            w.pause()
        for _ in range(rng.randint(0, 8)):
            n += 1
            _random_edit(rng, root, n)
        if paused:
            w.resume()
        result, line = take(store, root)
        assert result.tree == full_tree(root), f"round {_round}: {line}"
        assert line.startswith("watcher: "), line


def test_a_stale_socket_file_means_a_full_scan(tmp_path: Path) -> None:
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"f": "f"})
    (root / ".paperclip").mkdir()
    fd = os.open(root / ".paperclip", os.O_RDONLY | os.O_DIRECTORY)
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(watch_state.socket_address(fd))
    os.close(fd)
    started = time.monotonic()
    result, line = take(store, root)
    assert line.startswith("full scan: the watcher did not answer"), line
    assert time.monotonic() - started < 5
    assert result.tree == full_tree(root)


def test_a_snapshot_that_asks_about_every_blob_scans_in_full(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """After `snapshot_blobs_missing` the CLI asks the store about every blob: a partial scan
    knows where only the blobs it read are, so the scan is full and the new store gets all."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, tree_of(root))
    watch(watchers, root)
    settled(store, root)
    (root / "d0/f0").write_text("changed")
    said: list[str] = []
    emptied = FakeStore()
    result = workdir.snapshot(emptied, root, say=said.append, warn=lambda _: None)
    entries = workdir.read_tree(result.tree, lambda names: {n: emptied.blobs[n] for n in names})
    assert all(b in emptied.blobs for e in entries.values() for b in e.blobs())
    assert result.tree == full_tree(root)
    assert said == [
        "full scan: every blob is asked about (the index is not trusted for this workspace)"
    ]


def test_the_watchers_socket_is_its_users_alone(tmp_path: Path, watchers: list[Watcher]) -> None:
    root = tmp_path / "w"
    make(root, {"f": "f"})
    watch(watchers, root)
    assert (root / ".paperclip" / watch_state.SOCKET).stat().st_mode & 0o777 == 0o600
