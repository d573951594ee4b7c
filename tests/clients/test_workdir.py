"""The client's workdir snapshots and checkouts, against a local in-memory store: the trees it
writes are the server's (`paperclip.snapshots.trees` decodes and rebuilds them), the ignore
rules, the stat cache, chunking, checkout into an empty and an older workdir, the local-work
rule and symlink safety. The transport is tested with the live server elsewhere."""

from __future__ import annotations

import os
import shutil
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import pytest

from paperclip.snapshots import trees as server_trees
from paperclip_client import trees, workdir
from paperclip_client.errors import BlobDigestMismatch, NotFound
from paperclip_client.workdir import Limits, LocalChanges, uploading

SERVER, WORKSPACE = "http://testserver", "ws-1"


class FakeStore:
    def __init__(self, max_blob_bytes: int = 64 * 1024 * 1024) -> None:
        self.blobs: dict[str, bytes] = {}
        self.config = Limits(
            max_blob_bytes=max_blob_bytes, max_batch_bytes=16 * 1024 * 1024, max_batch_blobs=10_000
        )
        self.gets = 0
        self.batch_reads = 0
        self.got: list[str] = []
        self.got_bytes = 0
        self.put_bytes = 0

    def limits(self) -> Limits:
        return self.config

    def find_missing(self, names: Sequence[str]) -> list[str]:
        return [n for n in names if n not in self.blobs]

    def _store(self, name: str, data: bytes) -> None:
        if trees.blob_name(data) != name:  # as the server answers it
            raise BlobDigestMismatch("no", status=400, details={"digest": name})
        assert len(data) <= self.config.max_blob_bytes
        self.blobs[name] = data
        self.put_bytes += len(data)

    def put(self, name: str, stream: IO[bytes], size: int) -> None:
        self._store(name, stream.read(size))

    def put_batch(self, frames: Sequence[workdir.BatchFrame]) -> None:
        for frame in frames:
            data = b"".join(frame.read())
            assert len(data) == frame.size
            self._store(frame.name, data)

    def get(self, name: str, dest: IO[bytes]) -> int:
        data = self.blobs[name]
        self.gets += 1
        self.got.append(name)
        self.got_bytes += len(data)
        dest.write(data)
        return len(data)

    def get_batch(self, names: Sequence[str]) -> dict[str, bytes]:
        self.batch_reads += 1
        self.got.extend(names)
        self.got_bytes += sum(len(self.blobs[n]) for n in names)
        return {n: self.blobs[n] for n in names}


def old(path: Path) -> None:
    """Date a file back, so that the stat cache is not racy about it."""
    os.utime(path, ns=(time.time_ns() - 10**10, time.time_ns() - 10**10), follow_symlinks=False)


def make(root: Path, files: dict[str, str | bytes], links: dict[str, str] | None = None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    for rel, target in (links or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, root / rel)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            old(Path(dirpath) / name)


def take(store: FakeStore, root: Path, warnings: list[str] | None = None) -> workdir.SnapshotResult:
    sink = warnings if warnings is not None else []
    result = workdir.snapshot(store, root, say=lambda _: None, warn=sink.append)
    workdir.commit_snapshot(root, result, server=SERVER, workspace=WORKSPACE)
    return result


def check_out(
    store: FakeStore, root: Path, head: str | None, *, discard: bool = False
) -> workdir.CheckoutResult:
    root.mkdir(parents=True, exist_ok=True)
    return workdir.checkout(
        store,
        root,
        head,
        server=SERVER,
        workspace=WORKSPACE,
        discard_local_changes=discard,
        say=lambda _: None,
    )


def listing(root: Path) -> dict[str, object]:
    """What a directory holds (files by content and mode, symlinks by target, dirs)."""
    found: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = [d for d in dirnames if not (rel == Path(".") and d == ".paperclip")]
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            key = str(rel / name) if str(rel) != "." else name
            if path.is_symlink():
                found[key] = ("link", os.readlink(path))
            elif path.is_dir():
                found[key] = ("dir", stat.S_IMODE(path.lstat().st_mode))
            else:
                found[key] = (path.read_bytes(), stat.S_IMODE(path.lstat().st_mode))
    return found


def store_dirs(store: FakeStore) -> list[str]:
    return [n for n, d in store.blobs.items() if d.startswith(b'{"entries":')]


def server_walk(store: FakeStore, tree: str) -> server_trees.Walk:
    return server_trees.walk(tree, store.blobs.get, contents=lambda names: [
        n for n in names if n not in store.blobs
    ])  # fmt: skip


# --- scanning and the tree format ------------------------------------------------------------


def test_a_scanned_tree_is_the_servers_encoding(tmp_path: Path) -> None:
    root = tmp_path / "w"
    make(
        root,
        {"a.txt": "alpha", "sub/b.bin": b"\x00\xff" * 100, "sub/deep/c": "", "é/ü.md": "x"},
        links={"sub/to-a": "../a.txt", "sub/deep/up": "../b.bin"},
    )
    (root / "empty").mkdir()
    (root / "a.txt").chmod(0o751)
    store = FakeStore()
    result = take(store, root)
    walked = server_walk(store, result.tree)
    assert walked.missing == []
    assert walked.files == result.files == 4
    assert walked.bytes == result.bytes == 5 + 200 + 0 + 1
    assert walked.entries["a.txt"].mode == 0o751
    assert walked.entries["sub/to-a"].target == "../a.txt"
    assert walked.entries["empty"].type == "dir"
    # The server's build of the same entries gives the same root.
    entries = {
        p: server_trees.Entry(**{k: v for k, v in e.as_json().items() if k != "chunks"})
        for p, e in walked.entries.items()
    }
    assert server_trees.build(entries)[0] == result.tree
    for name, data in result.scan.dirs.items():
        server_trees.decode_dir(data)  # strict: canonical bytes
        ours = [e.as_json() for e in trees.decode_dir(data)]
        assert ours == [e.as_json() for e in server_trees.decode_dir(data)]
        assert trees.blob_name(data) == name


def test_the_empty_workdir_is_the_empty_tree(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    result = take(FakeStore(), tmp_path / "w")
    assert result.tree == trees.EMPTY_TREE == server_trees.blob_name(server_trees.EMPTY_DIR)
    assert (result.files, result.bytes) == (0, 0)


def test_large_files_are_chunked_at_the_blob_limit(tmp_path: Path) -> None:
    root = tmp_path / "w"
    make(root, {"big": b"0123456789" * 250 + b"abcde", "exact": b"x" * 1000, "small": b"s"})
    store = FakeStore(max_blob_bytes=1000)
    result = take(store, root)
    walked = server_walk(store, result.tree)
    assert walked.missing == []
    big = walked.entries["big"]
    assert big.chunks is not None
    assert (len(big.chunks), big.size) == (3, 2505)
    assert walked.entries["exact"].digest is not None
    assert walked.entries["exact"].chunks is None
    assert [len(store.blobs[c]) for c in big.chunks] == [1000, 1000, 505]
    # and back, chunk by chunk
    other = tmp_path / "o"
    done = check_out(store, other, result.tree)
    assert listing(other) == listing(root)
    assert done.fetched == store.got_bytes
    assert set(store.got) - set(store_dirs(store)) == {
        *big.chunks,
        *walked.entries["exact"].blobs(),
        *walked.entries["small"].blobs(),
    }


def test_ignore_rules_and_the_state_directory(tmp_path: Path) -> None:
    root = tmp_path / "w"
    make(
        root,
        {
            ".paperclipignore": "build/\n*.log\n!keep.log\n/top-only\n",
            "build/out.o": "o",
            "src/build/nested.o": "o",
            "a.log": "l",
            "keep.log": "k",
            "top-only": "t",
            "src/top-only": "kept",
            "src/main.c": "c",
            ".paperclip/private": "never",
        },
    )
    result = take(FakeStore(), root)
    assert sorted(p for p, e in result.scan.entries.items() if e.type == "file") == [
        ".paperclipignore",
        "keep.log",
        "src/main.c",
        "src/top-only",
    ]


@pytest.mark.parametrize("rule_from", ["local", "the_run", "the_head"])
def test_ignore_rules_never_drop_a_path_the_workdir_checked_out(
    tmp_path: Path, rule_from: str
) -> None:
    """A path the head holds is tracked: ignore rules leave it in the snapshot, as git ignores
    no tracked file. Left out, the run's tree lacked a file its base had, and publishing
    removed another run's committed `build/out.bin` from the head: with a local rule, with a
    rule the run wrote, or with a head holding both the rule and the file (found in review,
    shown failing first). An untracked ignored file stays out."""
    store = FakeStore()
    other = tmp_path / "other"
    make(other, {"build/out.bin": "another run's work", "src/main.c": "c"})
    head = take(store, other).tree
    if rule_from == "the_head":  # another run adds the rule on top: the head holds both
        (other / ".paperclipignore").write_text("build/\n*.log\n")
        head = take(store, other).tree
    agent = tmp_path / "agent"
    check_out(store, agent, head)
    if rule_from in ("local", "the_run"):
        (agent / ".paperclipignore").write_text("build/\n*.log\n")
    (agent / "build" / "new.log").write_text("untracked and ignored")
    (agent / "scratch.log").write_text("untracked and ignored")
    (agent / "src" / "main.c").write_text("the run's change")
    snapshot = take(store, agent)
    files = sorted(p for p, e in snapshot.scan.entries.items() if e.type == "file")
    assert "build/out.bin" in files
    assert "build/new.log" not in files
    assert "scratch.log" not in files
    assert snapshot.scan.entries["build/out.bin"].digest == trees.blob_name(b"another run's work")
    # The same with the watcher's partial scan's state: a rule matching a tracked path there
    # means the full scan (which alone knows every tracked path).
    again = take(store, agent)
    assert again.tree == snapshot.tree


def test_symlinks_that_loop_are_left_out_so_the_snapshot_registers(tmp_path: Path) -> None:
    """`a -> b`, `b -> a` were kept (the client followed only the links inside a target),
    and the server refused the whole tree (`symlink_loop`): none of the run's work was
    registered (found in review, shown failing first)."""
    root = tmp_path / "w"
    make(root, {"f": "work"}, links={"a": "b", "b": "a", "c": "f", "d": "c"})
    warnings: list[str] = []
    result = take(FakeStore(), root, warnings)
    assert sorted(result.scan.entries) == ["c", "d", "f"]
    assert sorted(w.split(":")[0] for w in warnings) == ["a", "b"]
    server_trees.check_symlinks(dict(result.scan.entries))  # raises TreeInvalid on a loop


def test_symlinks_are_recorded_never_followed_and_escaping_ones_left_out(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    make(outside, {"secret": "s"})
    root = tmp_path / "w"
    make(
        root,
        {"d/f": "f"},
        links={
            "inside": "d/f",
            "to-dir": "d",
            "absolute": str(outside / "secret"),
            "escapes": "../outside/secret",
            "d/hop": "..",
            "d/through": "hop/../x",  # climbs out through the other link
            "dangling": "nowhere",
        },
    )
    warnings: list[str] = []
    result = take(FakeStore(), root, warnings)
    entries = result.scan.entries
    assert entries["inside"].target == "d/f"
    assert entries["to-dir"].type == "symlink"
    assert "to-dir/f" not in entries
    assert entries["dangling"].target == "nowhere"
    assert entries["d/hop"].target == ".."
    for left_out in ("absolute", "escapes", "d/through"):
        assert left_out not in entries
        assert any(w.startswith(left_out + ":") for w in warnings), warnings


def test_non_utf8_names_and_special_files_are_left_out_with_a_warning(tmp_path: Path) -> None:
    root = tmp_path / "w"
    make(root, {"ok": "ok"})
    with open(os.path.join(os.fsencode(root), b"bad-\xff"), "wb") as handle:
        handle.write(b"x")
    os.mkfifo(root / "fifo")
    warnings: list[str] = []
    result = take(FakeStore(), root, warnings)
    assert list(result.scan.entries) == ["ok"]
    assert any("not UTF-8" in w for w in warnings)
    assert any(w.startswith("fifo:") for w in warnings)


# --- the stat cache --------------------------------------------------------------------------


def test_the_stat_cache_skips_unchanged_files_and_catches_changed_ones(tmp_path: Path) -> None:
    root = tmp_path / "w"
    make(root, {"a": "one", "b": "two", "c/d": "three"})
    store = FakeStore()
    first = take(store, root)
    assert first.scan.hashed == 3
    index = workdir.load_index(root)
    assert index is not None
    assert index.tree == first.tree
    assert set(index.files) == {"a", "b", "c/d"}
    assert index.files["a"][4] == trees.blob_name(b"one")

    again = workdir.scan(root, max_blob_bytes=10**6, index=index, warn=print)
    assert again.hashed == 0
    assert again.tree == first.tree

    (root / "a").write_bytes(b"one")  # touched, same content: read again, same digest
    (root / "b").write_bytes(b"TWO")  # same size, new content
    for name in ("a", "b"):
        old(root / name)
        os.utime(root / name, ns=(time.time_ns() - 5 * 10**9,) * 2)
    after = workdir.scan(root, max_blob_bytes=10**6, index=index, warn=print)
    assert after.hashed == 2
    assert after.entries["a"].digest == trees.blob_name(b"one")
    assert after.entries["b"].digest == trees.blob_name(b"TWO")


def test_a_rewrite_in_place_keeping_size_and_mtime_is_read_again(tmp_path: Path) -> None:
    """`cp -p b a` where both came from one archive (one size, one mtime): the inode stays,
    size and mtime come back as they were; only the ctime, which no program can set, moved."""
    root = tmp_path / "w"
    make(root, {"d/a": "AAAA", "d/b": "BBBB"})
    stamp = time.time_ns() - 3600 * 10**9
    for name in ("d/a", "d/b"):
        os.utime(root / name, ns=(stamp, stamp))
    store = FakeStore()
    take(store, root)
    inode = (root / "d/a").stat().st_ino
    shutil.copy2(root / "d/b", root / "d/a")
    assert (root / "d/a").stat().st_ino == inode
    assert (root / "d/a").stat().st_mtime_ns == stamp
    again = take(store, root)
    assert again.scan.hashed == 1
    assert again.scan.entries["d/a"].digest == trees.blob_name(b"BBBB")


def test_a_checkout_s_files_are_not_read_again_by_the_next_snapshot(tmp_path: Path) -> None:
    """Checkout records each file's stat as the rename left it (a rename moves the ctime), and
    a file whose mode alone it changed after its change of mode: the snapshot that follows
    reads nothing."""
    store = FakeStore()
    one, two = tmp_path / "one", tmp_path / "two"
    make(one, {"a": "a", "d/b": "b", "x": "same"})
    make(two, {"a": "A", "d/b": "b", "d/c": "c", "x": "same"})
    (two / "x").chmod(0o755)
    t1, t2 = take(store, one).tree, take(store, two).tree
    agent = tmp_path / "agent"
    check_out(store, agent, t1)
    check_out(store, agent, t2)
    index = workdir.load_index(agent)
    assert index is not None
    index.written_ns = time.time_ns() + 10**9  # none racily clean
    scanned = workdir.scan(agent, max_blob_bytes=10**6, index=index, warn=print)
    assert (scanned.tree, scanned.hashed) == (t2, 0)


def test_a_write_in_the_scans_tick_after_it_read_the_file_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a filesystem whose timestamps are coarse, a file written in the tick the scan
    started in, read by the scan, then written again within that tick keeps the stat the scan
    recorded. The index is written later (after the upload and the registration), so its
    file's mtime does not make the row racy; the scan's start does (`racy_ns`). Simulated:
    the filesystem's clock is made to read the tick of the file's last write, and the second
    write is given the first one's mtime."""
    from paperclip_client.workdir import index as index_module
    from paperclip_client.workdir import uploading

    root = tmp_path / "w"
    make(root, {"d/a": "AAAA", "e/x": "x"})
    store = FakeStore()
    take(store, root)
    (root / "d" / "a").write_bytes(b"CCCC")
    tick = (root / "d" / "a").stat().st_mtime_ns
    monkeypatch.setattr(uploading, "fs_now", lambda _workdir: tick)
    result = workdir.snapshot(store, root, say=lambda _: None, warn=lambda _: None)
    with (root / "d" / "a").open("r+b") as handle:  # after the scan read it, in its tick
        handle.write(b"ZZZZ")
    os.utime(root / "d" / "a", ns=(tick, tick))
    time.sleep(0.01)  # the upload and the registration
    workdir.commit_snapshot(root, result, server=SERVER, workspace=WORKSPACE)
    monkeypatch.undo()
    index = workdir.load_index(root)
    assert index is not None
    assert index.racy_ns == tick
    assert index.written_ns == tick
    again = take(store, root)
    assert again.scan.entries["d/a"].digest == trees.blob_name(b"ZZZZ")
    assert index_module.fs_now(root) is not None


def test_a_racily_clean_entry_is_read_again(tmp_path: Path) -> None:
    root = tmp_path / "w"
    make(root, {"a": "one"})
    take(FakeStore(), root)
    index = workdir.load_index(root)
    assert index is not None
    index.written_ns = os.lstat(root / "a").st_mtime_ns  # written in the same tick as the file
    assert workdir.scan(root, max_blob_bytes=10**6, index=index, warn=print).hashed == 1


def test_the_index_is_read_again_only_when_its_file_changed(tmp_path: Path) -> None:
    root = tmp_path / "w"
    make(root, {"a": "one"})
    first = take(FakeStore(), root)
    index = workdir.load_index(root)
    assert index is not None
    assert index.tree == first.tree
    index.written_ns = 0  # a caller's change stays its own
    again = workdir.load_index(root)
    assert again is not None
    assert again.files is index.files  # not parsed again
    # The scan's start, before the index file was written.
    assert again.racy_ns is not None
    assert again.written_ns == again.racy_ns
    assert again.written_ns <= os.stat(root / ".paperclip" / "index.json").st_mtime_ns

    (root / "a").write_text("two")  # a new snapshot renames a new index over the old one
    old(root / "a")
    second = take(FakeStore(), root)
    assert second.tree != first.tree
    renamed = workdir.load_index(root)
    assert renamed is not None
    assert renamed.tree == second.tree

    path = root / ".paperclip" / "index.json"  # written in place, same inode and size
    text = path.read_text().replace(second.tree, first.tree)
    with path.open("r+") as handle:
        handle.write(text)
    rewritten = workdir.load_index(root)
    assert rewritten is not None
    assert rewritten.tree == first.tree


def test_a_missing_or_broken_index_means_hash_everything(tmp_path: Path) -> None:
    root = tmp_path / "w"
    make(root, {"a": "one"})
    take(FakeStore(), root)
    (root / ".paperclip" / "index.json").write_text("{not json")
    assert workdir.load_index(root) is None
    assert workdir.scan(root, max_blob_bytes=10**6, index=None, warn=print).hashed == 1


def test_upload_sends_only_what_the_store_lacks(tmp_path: Path) -> None:
    root = tmp_path / "w"
    make(root, {"a": "one", "b": "two"})
    store = FakeStore()
    first = take(store, root)
    assert first.uploaded == store.put_bytes > 0
    (root / "c").write_bytes(b"three")
    second = take(store, root)
    # the new file and the root directory blob
    assert second.uploaded == 5 + len(second.scan.dirs[second.tree])


def test_a_small_change_is_split_into_one_batch_per_transfer_thread(tmp_path: Path) -> None:
    """Under the store's batch limits, a change is still sent as about `threads` batches
    (each at least SPLIT_MIN_BYTES or SPLIT_MIN_BLOBS), so that the server checks and stores
    it in several workers at once; a tiny one stays one batch."""
    from paperclip_client.workdir import uploading

    class Counting(FakeStore):
        def __init__(self) -> None:
            super().__init__()
            self.batches: list[int] = []

        def put_batch(self, frames: Sequence[workdir.BatchFrame]) -> None:
            self.batches.append(len(frames))
            super().put_batch(frames)

    root = tmp_path / "w"
    make(root, {f"d{i % 4}/f{i}": f"{i:06d}".encode() * 500 for i in range(400)})  # 3 KB each
    store = Counting()
    workdir.snapshot(store, root, say=lambda _: None, warn=lambda _: None, threads=4)
    assert sum(store.batches) == 405  # 400 files, 4 directories and the root
    # about 4: the greedy packing may leave a small fifth for the last few blobs
    assert 4 <= len(store.batches) <= 5, store.batches
    assert max(store.batches) <= -(-405 // 4), store.batches
    assert uploading.SPLIT_MIN_BLOBS <= -(-405 // 4)  # so the count limit is the quarter
    (root / "d0" / "new").write_bytes(b"one more")
    store.batches.clear()
    workdir.snapshot(store, root, say=lambda _: None, warn=lambda _: None, threads=4)
    assert store.batches == [3]  # the file, d0 and the root: one batch


def test_a_file_changed_during_the_upload_is_scanned_again(tmp_path: Path) -> None:
    """The upload streams files without hashing them again: the store's check catches a
    file that changed since the scan, and the snapshot scans again."""
    root = tmp_path / "w"
    make(root, {"a": "one", "b": "two", "big": b"x" * 5000})
    said: list[str] = []

    class Changing(FakeStore):
        def find_missing(self, names: Sequence[str]) -> list[str]:
            if not any(s.startswith("snapshot:") for s in said):
                (root / "a").write_bytes(b"ONE")  # same size, other bytes
            return super().find_missing(names)

    store = Changing()
    result = workdir.snapshot(store, root, say=said.append, warn=lambda _: None)
    scans = ["full scan: no watcher running (paperclip-agent watch)"]
    assert said == [*scans, "snapshot: a: changed while it was snapshotted; scanning again", *scans]
    entries = workdir.read_tree(result.tree, lambda names: {n: store.blobs[n] for n in names})
    assert store.blobs[entries["a"].digest or ""] == b"ONE"


def test_the_batch_body_is_streamed_with_its_length() -> None:
    sent: list[str] = []

    def pieces() -> list[bytes]:
        sent.append("read")
        return [b"ab", b"c"]

    frames = [workdir.BatchFrame(trees.blob_name(b"abc"), 3, pieces)]
    store = FakeStore()
    store.put_batch(frames)
    store.put_batch(frames)  # read again from the start
    assert sent == ["read", "read"]
    assert store.blobs == {trees.blob_name(b"abc"): b"abc"}


# --- checkout --------------------------------------------------------------------------------


def test_checkout_into_an_empty_workdir_then_again_at_the_head(tmp_path: Path) -> None:
    source = tmp_path / "src"
    make(source, {"a": "alpha", "d/b": "beta", "d/e/c": "gamma"}, links={"d/l": "b"})
    (source / "d" / "b").chmod(0o700)
    (source / "empty").mkdir(mode=0o750)
    store = FakeStore()
    tree = take(store, source).tree
    target = tmp_path / "dst"
    done = check_out(store, target, tree)
    assert listing(target) == listing(source)
    assert (done.tree, done.files, done.fetched) == (tree, 3, store.got_bytes)
    assert store.got_bytes > 5 + 4 + 5
    index = workdir.load_index(target)
    assert index is not None
    assert index.tree == tree
    # At the head: nothing fetched, nothing read, nothing written.
    gets = store.gets
    again = check_out(store, target, tree)
    assert (again.files, again.fetched, again.written, store.gets) == (3, 0, 0, gets)
    # Snapshotting it reads nothing either and gives the same tree.
    for name in ("a", "d/b", "d/e/c"):
        old(target / name)
    index = workdir.load_index(target)
    assert index is not None
    index.written_ns = time.time_ns()
    rescanned = workdir.scan(target, max_blob_bytes=10**6, index=index, warn=print)
    assert rescanned.tree == tree


@pytest.mark.parametrize("threads", [1, 4])
def test_checkout_fetches_each_blob_once_whatever_the_threads(tmp_path: Path, threads: int) -> None:
    store = FakeStore()
    one = tmp_path / "one"
    files: dict[str, str | bytes] = {f"d{i % 5}/f{i}": f"content {i % 40}" for i in range(120)}
    files["big"] = b"x" * (workdir.SMALL_BLOB + 1)
    make(one, files)
    head = take(store, one).tree
    agent = tmp_path / "agent"
    agent.mkdir()
    store.gets, store.got = 0, []
    done = workdir.checkout(
        store, agent, head, server=SERVER, workspace=WORKSPACE, say=lambda _: None, threads=threads
    )
    assert listing(agent) == listing(one)
    file_blobs = [
        n for n in store.got if n in {e for e in store.blobs if store.blobs[e][:1] != b"{"}
    ]
    assert sorted(file_blobs) == sorted(set(file_blobs))  # 40 small contents and the big one
    assert len(file_blobs) == 41
    assert done.files == 121


def test_checkout_reads_in_batches_and_falls_back_to_single_reads(tmp_path: Path) -> None:
    store = FakeStore()
    one = tmp_path / "one"
    files: dict[str, str | bytes] = {f"d{i % 30}/e{i % 7}/f{i}": f"content {i}" for i in range(600)}
    make(one, files)
    head = take(store, one).tree
    store.gets, store.got = 0, []
    batched = tmp_path / "batched"
    check_out(store, batched, head)
    assert listing(batched) == listing(one)
    # 600 files in 241 directories: a batch a level for the directories (root, 30, then 210:
    # under the 256 names of a batch), three for the files (256, 256, 88); nothing alone.
    assert (store.gets, store.batch_reads) == (0, 1 + 1 + 1 + 3)

    class NoBatches(FakeStore):
        def get_batch(self, names: Sequence[str]) -> dict[str, bytes]:
            raise NotFound("no such endpoint", status=404, details={})

    plain = NoBatches()
    plain.blobs = store.blobs
    single = tmp_path / "single"
    check_out(plain, single, head)
    assert listing(single) == listing(one)
    assert plain.gets == 600 + 241  # every file and every directory blob, each alone


def test_parallel_jobs_stop_at_the_first_failure() -> None:
    ran: list[int] = []

    def job(i: int) -> Callable[[], None]:
        def run() -> None:
            if i == 3:
                raise RuntimeError("boom")
            ran.append(i)

        return run

    with pytest.raises(RuntimeError, match="boom"):
        workdir.run_parallel((job(i) for i in range(1000)), 2)
    assert len(ran) < 1000


def test_checkout_into_an_older_workdir_touches_only_what_changed(tmp_path: Path) -> None:
    store = FakeStore()
    one = tmp_path / "one"
    make(
        one,
        {"same": "s" * 100, "edit": "v1", "gone": "bye", "moved": "m" * 50, "todir": "f"},
        links={"link": "same"},
    )
    (one / "fromdir").mkdir()
    (one / "fromdir" / "x").write_bytes(b"x")
    t1 = take(store, one).tree
    agent = tmp_path / "agent"
    check_out(store, agent, t1)
    assert listing(agent) == listing(one)

    # Another workdir moves on from t1.
    two = tmp_path / "two"
    check_out(store, two, t1)
    (two / "edit").write_bytes(b"v2")
    (two / "gone").unlink()
    (two / "moved").rename(two / "renamed")
    (two / "todir").unlink()
    (two / "todir").mkdir()
    (two / "todir" / "in").write_bytes(b"in")
    (two / "fromdir" / "x").unlink()
    (two / "fromdir").rmdir()
    (two / "fromdir").write_bytes(b"now a file")
    (two / "link").unlink()
    os.symlink("edit", two / "link")
    (two / "same").chmod(0o600)
    t2 = take(store, two).tree

    inode = os.lstat(agent / "same").st_ino
    store.got_bytes, store.got = 0, []
    done = check_out(store, agent, t2)
    assert listing(agent) == listing(two)
    # "renamed" was copied from the local "moved", "same" only changed mode.
    assert done.fetched == store.got_bytes
    contents = [n for n in store.got if n not in store_dirs(store)]
    assert sorted(contents) == sorted(trees.blob_name(d) for d in (b"v2", b"in", b"now a file"))
    assert os.lstat(agent / "same").st_ino == inode
    index = workdir.load_index(agent)
    assert index is not None
    assert index.tree == t2
    assert set(index.files) == {"same", "edit", "renamed", "todir/in", "fromdir"}


def test_checkout_refuses_to_overwrite_local_work(tmp_path: Path) -> None:
    store = FakeStore()
    one = tmp_path / "one"
    make(one, {"a": "a1", "b": "b1", "c": "c1"})
    t1 = take(store, one).tree
    agent = tmp_path / "agent"
    check_out(store, agent, t1)
    two = tmp_path / "two"
    check_out(store, two, t1)
    (two / "a").write_bytes(b"a2")
    (two / "new").write_bytes(b"theirs")
    (two / "c").unlink()
    t2 = take(store, two).tree

    (agent / "a").write_bytes(b"mine")  # head changes it too: conflict
    (agent / "new").write_bytes(b"mine")  # untracked where head adds one: conflict
    (agent / "c").write_bytes(b"c-mine")  # head deletes it: conflict
    (agent / "b").write_bytes(b"b-mine")  # head does not touch it: kept
    before = listing(agent)
    with pytest.raises(LocalChanges) as refused:
        check_out(store, agent, t2)
    assert refused.value.paths == ["a", "c", "new"]
    assert "--discard-local-changes" in str(refused.value)
    assert listing(agent) == before  # nothing written
    index = workdir.load_index(agent)
    assert index is not None
    assert index.tree == t1

    # A local change that equals the head is no conflict.
    (agent / "a").write_bytes(b"a2")
    (agent / "new").write_bytes(b"theirs")
    (agent / "c").unlink()
    done = check_out(store, agent, t2)
    assert done.tree == t2
    assert (agent / "b").read_bytes() == b"b-mine"


def test_discard_local_changes_overwrites_them(tmp_path: Path) -> None:
    store = FakeStore()
    one = tmp_path / "one"
    make(one, {"a": "a1", "d/x": "x"})
    t1 = take(store, one).tree
    two = tmp_path / "two"
    check_out(store, two, t1)
    (two / "a").write_bytes(b"a2")
    (two / "d").rename(two / "gone")
    (two / "d").write_bytes(b"d is a file now")
    (two / "gone" / "x").unlink()
    (two / "gone").rmdir()
    t2 = take(store, two).tree
    agent = tmp_path / "agent"
    check_out(store, agent, t1)
    (agent / "a").write_bytes(b"mine")
    (agent / "d" / "untracked").write_bytes(b"u")
    with pytest.raises(LocalChanges) as refused:
        check_out(store, agent, t2)
    assert refused.value.paths == ["a", "d/untracked"]
    check_out(store, agent, t2, discard=True)
    assert listing(agent) == listing(two)


def test_a_first_checkout_into_a_non_empty_directory_keeps_what_differs(tmp_path: Path) -> None:
    store = FakeStore()
    one = tmp_path / "one"
    make(one, {"a": "a1", "b": "b1"})
    t1 = take(store, one).tree
    agent = tmp_path / "agent"
    make(agent, {"a": "a1", "b": "someone's file", "c": "unrelated"})
    with pytest.raises(LocalChanges) as refused:
        check_out(store, agent, t1)
    assert refused.value.paths == ["b"]


def test_checkout_never_writes_through_a_symlink_in_the_workdir(tmp_path: Path) -> None:
    store = FakeStore()
    one = tmp_path / "one"
    make(one, {"d/x": "x1"})
    t1 = take(store, one).tree
    two = tmp_path / "two"
    check_out(store, two, t1)
    (two / "d" / "x").write_bytes(b"x2")
    (two / "d" / "y").write_bytes(b"y2")
    t2 = take(store, two).tree

    outside = tmp_path / "outside"
    make(outside, {"x": "x1"})
    agent = tmp_path / "agent"
    check_out(store, agent, t1)
    (agent / "d" / "x").unlink()
    (agent / "d").rmdir()
    os.symlink(outside, agent / "d")  # a local change: d is now a link out of the workdir
    with pytest.raises(LocalChanges) as refused:
        check_out(store, agent, t2)
    assert refused.value.paths == ["d", "d/x"]
    check_out(store, agent, t2, discard=True)
    assert listing(agent) == listing(two)
    assert list(listing(outside)) == ["x"]  # untouched
    assert (outside / "x").read_bytes() == b"x1"


def test_an_interrupted_checkout_is_finished_by_the_next(tmp_path: Path) -> None:
    store = FakeStore()
    one = tmp_path / "one"
    make(one, {f"f{i}": f"content {i}" for i in range(20)})
    t1 = take(store, one).tree
    agent = tmp_path / "agent"

    class Dying(FakeStore):
        def get(self, name: str, dest: IO[bytes]) -> int:
            if self.gets >= 5:
                dest.write(b"partial")
                raise KeyboardInterrupt
            return super().get(name, dest)

        def get_batch(self, names: Sequence[str]) -> dict[str, bytes]:
            if self.batch_reads >= 1:  # the directories read, the files' batch dies
                raise KeyboardInterrupt
            return super().get_batch(names)

    dying = Dying()
    dying.blobs = store.blobs
    with pytest.raises(KeyboardInterrupt):
        check_out(dying, agent, t1)
    assert workdir.load_index(agent) is None
    # A leftover temporary file, as a kill -9 would leave it:
    from paperclip_client.workdir.writer import temp_name

    (agent / temp_name()).write_bytes(b"partial")
    done = check_out(store, agent, t1)
    assert done.tree == t1
    assert listing(agent) == listing(one)


def _interrupted_before_the_index(
    monkeypatch: pytest.MonkeyPatch, store: FakeStore, agent: Path, head: str | None
) -> None:
    """A checkout of `head` killed after every path was written, before the index was saved:
    the workdir holds `head`, the index still names the tree before, the journal is left."""
    from paperclip_client.workdir import checking_out

    def dies(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(checking_out, "save_state", dies)
        with pytest.raises(KeyboardInterrupt):
            check_out(store, agent, head)


@pytest.mark.parametrize("whose", ["the agent's", "a tree's"])
def test_finishing_an_interrupted_checkout_removes_only_its_own_temporary_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whose: str
) -> None:
    """A name that merely starts like checkout's temporary files (`.paperclip-tmp-`) is the
    agent's untracked file or a tracked file of the trees: finishing an interrupted checkout
    keeps it (removed, the first was lost, the second published as deleted)."""
    store = FakeStore()
    tracked = whose == "a tree's"
    trees: list[str | None] = []
    for version in ("1", "2"):
        root = tmp_path / f"t{version}"
        make(
            root, {"d/a": f"a{version}", **({"d/.paperclip-tmp-cache": "kept"} if tracked else {})}
        )
        trees.append(take(store, root).tree)
    agent = tmp_path / "agent"
    check_out(store, agent, trees[0])
    if not tracked:
        (agent / "d" / ".paperclip-tmp-notes").write_bytes(b"the agent's notes")
    _interrupted_before_the_index(monkeypatch, store, agent, trees[1])
    assert check_out(store, agent, trees[1]).tree == trees[1]
    if tracked:
        assert (agent / "d" / ".paperclip-tmp-cache").read_bytes() == b"kept"
        assert take(store, agent).tree == trees[1]  # the run changed nothing
    else:
        assert (agent / "d" / ".paperclip-tmp-notes").read_bytes() == b"the agent's notes"


def _three_heads(store: FakeStore, tmp_path: Path) -> list[str | None]:
    """`f` present, then removed, then back with other content."""
    heads: list[str | None] = []
    for name, files in {
        "h1": {"keep": "k", "f": "f1"},
        "h2": {"keep": "k2"},
        "h3": {"keep": "k2", "f": "f3"},
    }.items():
        make(tmp_path / name, files)
        heads.append(take(store, tmp_path / name).tree)
    return heads


def test_a_file_deleted_after_a_checkout_killed_before_its_removals_is_local_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interrupted checkout (to a head without `f`) wrote its files and was killed before
    it removed anything; the agent then deleted `f`. That deletion is the agent's: the next
    checkout, to a head that has `f` again, refuses it as local work instead of putting `f`
    back without a word (as it does with no interruption)."""
    from paperclip_client.workdir import checking_out

    store = FakeStore()
    h1, h2, h3 = _three_heads(store, tmp_path)
    agent = tmp_path / "agent"
    check_out(store, agent, h1)
    write = checking_out._write_entry

    def killed_after_its_writes(*args: Any) -> None:
        write(*args)  # `keep`, the one file h2 changes: then killed, before any removal
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(checking_out, "_write_entry", killed_after_its_writes)
        with pytest.raises(KeyboardInterrupt):
            check_out(store, agent, h2)
    assert (agent / "keep").read_bytes() == b"k2"
    assert (agent / "f").read_bytes() == b"f1"  # not removed yet
    (agent / "f").unlink()  # the agent's work
    with pytest.raises(LocalChanges):
        check_out(store, agent, h3)


def test_a_file_a_killed_checkout_removed_is_not_local_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after it removed `f`: the next checkout knows the removal was checkout's own
    (the journal named it before removing) and finishes."""
    from paperclip_client.workdir import checking_out

    store = FakeStore()
    h1, h2, h3 = _three_heads(store, tmp_path)
    agent = tmp_path / "agent"
    check_out(store, agent, h1)
    remove = checking_out.CheckoutWriter.remove

    def removed_then_killed(self: Any, path: str, **kwargs: Any) -> None:
        remove(self, path, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(checking_out.CheckoutWriter, "remove", removed_then_killed)
        with pytest.raises(KeyboardInterrupt):
            check_out(store, agent, h2)
    assert not (agent / "f").exists()
    assert check_out(store, agent, h3).tree == h3
    assert (agent / "f").read_bytes() == b"f3"


def test_a_checkout_after_an_interrupted_one_to_another_head_leaves_no_trace_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paths the interrupted checkout wrote are neither local work nor left behind: the
    next checkout, to another head, makes the workdir that head exactly (a file the first
    added is removed, one it changed or removed is put back), and local work stays."""
    store = FakeStore()
    trees_at: dict[str, str | None] = {}
    for name, files in {
        "t0": {"a": "a0", "b": "b0", "c": "c0", "d/e": "e0"},
        "t1": {"a": "a1", "b": "b0", "n1": "new", "d/e": "e0", "d/f": "f1"},  # c removed
        "t2": {"a": "a0", "b": "b2", "c": "c0", "d/e": "e0"},
        "t3": {"a": "a0", "b": "b2", "c": "c0", "d/e": "e3", "g": "g3"},
    }.items():
        root = tmp_path / name
        make(root, files)
        trees_at[name] = take(store, root).tree
    agent = tmp_path / "agent"
    check_out(store, agent, trees_at["t0"])
    _interrupted_before_the_index(monkeypatch, store, agent, trees_at["t1"])
    (agent / "mine").write_bytes(b"local work")
    _interrupted_before_the_index(monkeypatch, store, agent, trees_at["t2"])
    done = check_out(store, agent, trees_at["t3"])
    assert done.tree == trees_at["t3"]
    got = listing(agent)
    assert got.pop("mine") == listing(agent)["mine"]
    assert got == listing(tmp_path / "t3")
    assert not (agent / ".paperclip" / workdir.JOURNAL).exists()
    # The snapshot now sees the local file alone.
    assert take(store, agent).tree != trees_at["t3"]
    (agent / "mine").unlink()
    assert take(store, agent).tree == trees_at["t3"]


def test_local_work_after_an_interrupted_checkout_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FakeStore()
    heads = []
    for name, files in {"t0": {"a": "a0"}, "t1": {"a": "a1"}, "t2": {"a": "a2"}}.items():
        make(tmp_path / name, files)
        heads.append(take(store, tmp_path / name).tree)
    agent = tmp_path / "agent"
    check_out(store, agent, heads[0])
    _interrupted_before_the_index(monkeypatch, store, agent, heads[1])
    (agent / "a").write_bytes(b"edited by hand")
    with pytest.raises(LocalChanges) as refused:
        check_out(store, agent, heads[2])
    assert refused.value.paths == ["a"]
    assert (agent / "a").read_bytes() == b"edited by hand"


def test_checkout_of_an_empty_head_removes_tracked_files_only(tmp_path: Path) -> None:
    store = FakeStore()
    one = tmp_path / "one"
    make(one, {"a": "a", "d/b": "b"})
    t1 = take(store, one).tree
    agent = tmp_path / "agent"
    check_out(store, agent, t1)
    (agent / "d" / "mine").write_bytes(b"untracked")
    done = check_out(store, agent, None)
    assert (done.tree, done.files) == (None, 0)
    assert listing(agent) == {"d": listing(agent)["d"], "d/mine": listing(agent)["d/mine"]}


def test_a_hostile_head_is_refused_before_writing(tmp_path: Path) -> None:
    store = FakeStore()
    bad = trees.canonical_json(
        {
            "schema": "paperclip.dir.v1",
            "entries": [{"name": "x", "type": "symlink", "target": "../../etc"}],
        }
    )
    name = trees.blob_name(bad)
    store.blobs[name] = bad
    agent = tmp_path / "agent"
    with pytest.raises(trees.TreeError):
        check_out(store, agent, name)
    assert not (agent / "x").exists()
    bad = trees.canonical_json(
        {
            "schema": "paperclip.dir.v1",
            "entries": [{"name": "..", "type": "dir", "mode": 493, "digest": name}],
        }
    )
    store.blobs[trees.blob_name(bad)] = bad
    with pytest.raises(trees.TreeError):
        check_out(store, agent, trees.blob_name(bad))


def test_progress_is_said_at_most_every_interval() -> None:
    lines: list[str] = []
    progress = workdir.Progress(lines.append, "upload", 100, every=0.0)
    progress.add(10)
    assert lines == ["upload: 10/100 bytes"]
    slow = workdir.Progress(lines.append, "upload", 100, every=3600)
    slow.add(10)
    assert len(lines) == 1


class AskingStore(FakeStore):
    """Records every name asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def find_missing(self, names: Sequence[str]) -> list[str]:
        self.asked.extend(names)
        return super().find_missing(names)


def test_a_later_snapshot_trusting_the_index_asks_only_about_new_blobs(tmp_path: Path) -> None:
    store, root = AskingStore(), tmp_path / "w"
    make(root, {"a.txt": "one", "d/b.txt": "two", "d/c.txt": "three"})
    first = take(store, root)
    make(root, {"d/b.txt": "changed"})
    store.asked.clear()
    second = workdir.snapshot(
        store, root, say=lambda _: None, warn=lambda _: None, trust_index=(SERVER, WORKSPACE)
    )
    new_blobs = {trees.blob_name(b"changed"), *second.scan.dirs} - set(first.scan.dirs)
    assert set(store.asked) == new_blobs
    assert second.uploaded == sum(len(store.blobs[n]) for n in new_blobs)


def test_the_index_of_another_server_or_workspace_is_not_trusted(tmp_path: Path) -> None:
    store, root = AskingStore(), tmp_path / "w"
    make(root, {"a.txt": "one"})
    take(store, root)
    index = workdir.load_index(root)
    assert workdir.stored_by_index(root, index, server=SERVER, workspace="ws-2") == set()
    assert workdir.stored_by_index(root, index, server="http://other", workspace=WORKSPACE) == set()
    assert trees.blob_name(b"one") in workdir.stored_by_index(
        root, index, server=SERVER, workspace=WORKSPACE
    )


def state_files(root: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of the index and the directory blobs' file: a rewrite changes both."""
    return {
        name: (info.st_ino, info.st_mtime_ns)
        for name in ("index.json", "dirs.json")
        for info in [os.stat(root / ".paperclip" / name)]
    }


def test_a_snapshot_that_changed_nothing_leaves_the_index_as_it_is(tmp_path: Path) -> None:
    """Issue #42: a run that changed nothing does no work proportional to the workspace in
    writing its state; the stat cache still vouches for every file afterwards."""
    root = tmp_path / "w"
    make(root, {"a": "one", "c/d": "three"})
    store = FakeStore()
    first = take(store, root)
    before = state_files(root)
    again = take(store, root)
    assert again.tree == first.tree
    assert again.scan.hashed == 0
    assert state_files(root) == before
    assert (
        workdir.scan(root, max_blob_bytes=10**6, index=workdir.load_index(root), warn=print).hashed
        == 0
    )

    (root / "c" / "d").write_text("four")  # a change: the index is rewritten
    old(root / "c" / "d")
    changed = take(store, root)
    assert changed.tree != first.tree
    after = state_files(root)
    assert after["index.json"] != before["index.json"]
    assert after["dirs.json"] != before["dirs.json"]
    index = workdir.load_index(root)
    assert index is not None
    assert index.tree == changed.tree


def test_a_racily_clean_entry_or_a_lost_dirs_file_still_rewrites_the_state(tmp_path: Path) -> None:
    root = tmp_path / "w"
    make(root, {"a": "one"})
    store = FakeStore()
    take(store, root)
    index_file = root / ".paperclip" / "index.json"
    tick = os.lstat(root / "a").st_mtime_ns  # the index written in the same tick as the file
    os.utime(index_file, ns=(tick, tick))
    racy = take(store, root)
    assert racy.scan.hashed == 1
    assert os.stat(index_file).st_mtime_ns > tick  # rewritten: "a" is vouched for again
    assert take(store, root).scan.hashed == 0

    (root / ".paperclip" / "dirs.json").unlink()
    take(store, root)
    assert (root / ".paperclip" / "dirs.json").is_file()


def test_a_snapshot_of_the_indexed_tree_asks_nothing_and_reads_no_dirs_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #42: when the scan finds the tree the index records for this server and
    workspace, every blob is known without `stored_by_index` (dirs.json and every name read
    again); for another workspace it is still asked about."""
    store, root = AskingStore(), tmp_path / "w"
    make(root, {"a.txt": "one", "d/b.txt": "two"})
    take(store, root)
    calls: list[str] = []
    real = uploading.stored_by_index

    def counted(*args: Any, **kwargs: Any) -> set[str]:
        calls.append(kwargs["workspace"])
        return real(*args, **kwargs)

    monkeypatch.setattr(uploading, "stored_by_index", counted)
    store.asked.clear()
    again = workdir.snapshot(
        store, root, say=lambda _: None, warn=lambda _: None, trust_index=(SERVER, WORKSPACE)
    )
    assert (store.asked, again.uploaded, calls) == ([], 0, [])
    other = workdir.snapshot(
        store, root, say=lambda _: None, warn=lambda _: None, trust_index=(SERVER, "ws-2")
    )
    assert calls == ["ws-2"]
    assert set(store.asked) == set(other.scan.sources) | set(other.scan.dirs)
