"""The default copy-back backend on real directories: the published directory's mode and times
are the source's (as `cp -a` gives them), and a source inside the destination is refused."""

from __future__ import annotations

import os
import stat
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from recovery.adapters import copyback
from recovery.adapters.copyback import (
    CopybackError,
    LocalDirectoryCopyback,
    _copy_chunk,
    copyback_discards_wait,
)


def _noop() -> None:
    return None


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o700])
def test_the_destination_gets_the_source_directory_mode_and_times(
    tmp_path: Path, mode: int
) -> None:
    src, dest = tmp_path / "work", tmp_path / "host" / "repo"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.txt").write_text("a")
    src.chmod(mode)
    os.utime(src, (1_700_000_000, 1_700_000_000))
    LocalDirectoryCopyback().copy_back(
        run_id=uuid.uuid4(), source=str(src), destination=str(dest), check=_noop
    )
    assert stat.S_IMODE(dest.stat().st_mode) == mode
    assert dest.stat().st_mtime == 1_700_000_000
    assert (dest / "sub" / "a.txt").read_text() == "a"


@pytest.mark.parametrize("incremental", [False, True])
def test_setuid_setgid_and_sticky_bits_are_never_copied(tmp_path: Path, incremental: bool) -> None:
    """The worker copying may run as root and owns what it writes: a setuid program of the
    agent's would become a setuid-root one. Only the permission bits are kept, for files,
    directories and the destination itself; an incremental copy never links the previous copy
    in for a source that still carries the bits, and the result is the same."""
    src, dest = tmp_path / "work", tmp_path / "host" / "repo"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "tool").write_text("#!/bin/sh\nid\n")
    (src / "bin" / "tool").chmod(0o6755)
    (src / "bin").chmod(0o2755)
    src.chmod(0o1777)
    backend = LocalDirectoryCopyback(incremental=incremental)
    for _ in range(2):
        backend.copy_back(run_id=uuid.uuid4(), source=str(src), destination=str(dest), check=_noop)
        copyback_discards_wait()
        assert stat.S_IMODE((dest / "bin" / "tool").stat().st_mode) == 0o755
        assert stat.S_IMODE((dest / "bin").stat().st_mode) == 0o755
        assert stat.S_IMODE(dest.stat().st_mode) == 0o777


def test_a_source_inside_the_destination_is_refused_and_left_alone(tmp_path: Path) -> None:
    dest = tmp_path / "repo"
    src = dest / ".runs" / "work"
    src.mkdir(parents=True)
    (src / "keep.txt").write_text("keep")
    with pytest.raises(CopybackError) as raised:
        LocalDirectoryCopyback().copy_back(
            run_id=uuid.uuid4(), source=str(src), destination=str(dest), check=_noop
        )
    assert raised.value.code == "copyback_source_inside_destination"
    assert (src / "keep.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


def _tree(root: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under `root`: type, mode, modification time (ns), size or link target."""
    found: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                found[str(path.relative_to(root))] = ("link", os.readlink(path), st.st_mtime_ns)
            else:
                kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
                size = st.st_size if kind == "file" else None
                found[str(path.relative_to(root))] = (kind, st.st_mode, st.st_mtime_ns, size)
    return found


def _inodes(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in root.rglob("*") if p.is_file() and not p.is_symlink()}


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "work"
    (src / "a" / "b" / "c").mkdir(parents=True)
    (src / "empty-dir").mkdir()
    (src / "a" / "one.txt").write_text("one")
    (src / "a" / "b" / "two.bin").write_bytes(os.urandom(70_000))
    (src / "a" / "b" / "c" / "empty").write_bytes(b"")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    (src / "secret").write_text("s")
    (src / "secret").chmod(0o600)
    (src / "a" / "inner-link").symlink_to("one.txt")
    for i, path in enumerate(sorted(src.rglob("*"), reverse=True)):  # deepest first
        os.utime(
            path,
            ns=(1_600_000_000_000_000_000 + i, 1_650_000_000_123_456_789 + i),
            follow_symlinks=False,
        )
    (src / "a" / "b").chmod(0o711)
    os.utime(src / "a" / "b", ns=(1_600_000_000_000_000_000, 1_640_000_000_000_000_001))
    return src


@pytest.mark.parametrize("incremental", [False, True])
def test_a_copy_back_leaves_the_tree_cp_a_leaves(tmp_path: Path, incremental: bool) -> None:
    """Modes and modification times of files, directories (set after their contents) and kept
    symlinks, byte for byte contents, empty files and directories: compared with `cp -a`."""
    src = _source(tmp_path)
    subprocess.run(["cp", "-a", str(src), str(tmp_path / "by-cp")], check=True)
    dest = tmp_path / "host" / "repo"
    report = LocalDirectoryCopyback(incremental=incremental).copy_back(
        run_id=uuid.uuid4(), source=str(src), destination=str(dest), check=_noop
    )
    assert _tree(dest) == _tree(tmp_path / "by-cp")
    assert (dest / "a" / "b" / "two.bin").read_bytes() == (src / "a" / "b" / "two.bin").read_bytes()
    assert (report.files, report.directories, report.symlinks, report.linked) == (5, 4, 1, 0)


def test_an_incremental_copy_back_links_only_what_did_not_change(tmp_path: Path) -> None:
    src = _source(tmp_path)
    dest = tmp_path / "host" / "repo"
    backend = LocalDirectoryCopyback(incremental=True)
    backend.copy_back(run_id=uuid.uuid4(), source=str(src), destination=str(dest), check=_noop)
    before = {
        p.name: p.stat().st_ino for p in dest.rglob("*") if p.is_file() and not p.is_symlink()
    }
    (src / "a" / "one.txt").write_text("ONE")  # same size, new mtime
    (src / "secret").chmod(0o640)  # same contents, new mode
    mtime = (src / "run.sh").stat().st_mtime_ns
    (src / "run.sh").write_text("#!/bin/bash\n")  # new size, mtime put back
    os.utime(src / "run.sh", ns=(mtime, mtime))

    report = backend.copy_back(
        run_id=uuid.uuid4(), source=str(src), destination=str(dest), check=_noop
    )
    copyback_discards_wait()

    after = _inodes(dest)
    assert {name for name in after if after[name] == before[name]} == {"two.bin", "empty"}
    assert report.linked == 2
    assert report.files == 5
    assert (dest / "a" / "one.txt").read_text() == "ONE"
    assert (dest / "run.sh").read_text() == "#!/bin/bash\n"
    assert stat.S_IMODE((dest / "secret").stat().st_mode) == 0o640
    assert _tree(dest) == _tree(src)
    leftovers = [p.name for p in dest.parent.iterdir() if p.name != "repo"]
    assert leftovers == []


def test_without_incremental_nothing_is_linked(tmp_path: Path) -> None:
    src = _source(tmp_path)
    dest = tmp_path / "repo"
    backend = LocalDirectoryCopyback(incremental=False)
    backend.copy_back(run_id=uuid.uuid4(), source=str(src), destination=str(dest), check=_noop)
    inode = (dest / "a" / "b" / "two.bin").stat().st_ino
    report = backend.copy_back(
        run_id=uuid.uuid4(), source=str(src), destination=str(dest), check=_noop
    )
    assert report.linked == 0
    assert (dest / "a" / "b" / "two.bin").stat().st_ino != inode


def test_a_file_that_became_a_symlink_after_listing_is_skipped_not_followed(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("never copy me")
    link = tmp_path / "was-a-file"
    link.symlink_to(outside)
    target = tmp_path / "target"
    done = _copy_chunk([(str(link), str(target), "was-a-file", None)])
    assert (done.files, done.skipped) == (0, ["was-a-file"])
    assert not target.exists()


def test_ownership_lost_mid_copy_publishes_nothing(tmp_path: Path, monkeypatch: Any) -> None:
    src = _source(tmp_path)
    dest = tmp_path / "repo"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    monkeypatch.setattr(copyback, "CHECK_INTERVAL_SECONDS", 0)
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("ownership lost")

    with pytest.raises(RuntimeError, match="ownership lost"):
        LocalDirectoryCopyback().copy_back(
            run_id=uuid.uuid4(), source=str(src), destination=str(dest), check=check
        )
    assert sorted(p.name for p in dest.iterdir()) == ["old.txt"]


def test_a_leftover_of_a_process_that_died_deleting_is_removed_next_time(tmp_path: Path) -> None:
    src = _source(tmp_path)
    dest = tmp_path / "repo"
    leftover = tmp_path / f".repo.copyback-{uuid.uuid4()}.trash-0a1b2c3d"
    (leftover / "deep").mkdir(parents=True)
    LocalDirectoryCopyback().copy_back(
        run_id=uuid.uuid4(), source=str(src), destination=str(dest), check=_noop
    )
    copyback_discards_wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo", "work"]


def _with_secret(tmp_path: Path) -> tuple[Path, Path]:
    """A run directory and, beside it, another directory holding a secret."""
    src = tmp_path / "run"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.txt").write_text("mine")
    (src / "keep.txt").write_text("mine too")
    secret = tmp_path / "other-workspace"
    secret.mkdir()
    (secret / "a.txt").write_text("the secret")
    (secret / "secret.txt").write_text("the secret")
    return src, secret


def _contents(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def test_links_out_of_the_source_are_skipped_never_followed(tmp_path: Path) -> None:
    """A link to another directory (absolute, or escaping with `..`) is not copied and nothing
    is read through it; a link that stays inside the source is copied as a link."""
    src, secret = _with_secret(tmp_path)
    (src / "absolute").symlink_to(secret)
    (src / "sub" / "escaping").symlink_to("../../other-workspace")
    (src / "inside").symlink_to("sub/a.txt")
    dest = tmp_path / "repo"
    report = LocalDirectoryCopyback().copy_back(
        run_id=uuid.uuid4(), source=str(src), destination=str(dest), check=_noop
    )
    assert sorted(report.skipped) == ["absolute", "sub/escaping"]
    assert _contents(dest) == {"keep.txt": "mine too", "sub/a.txt": "mine"}
    assert os.readlink(dest / "inside") == "sub/a.txt"


@pytest.mark.parametrize("at_call", [2, 3])
def test_a_directory_swapped_for_a_link_mid_copy_is_not_followed(
    tmp_path: Path, monkeypatch: Any, at_call: int
) -> None:
    """The race forced: `sub` is replaced by a link to another directory after the walk listed
    it (call 2: before the walk descends into it; call 3: after its files were listed, before
    the copy threads open them). Nothing of the other directory is read."""
    src, secret = _with_secret(tmp_path)
    monkeypatch.setattr(copyback, "CHECK_INTERVAL_SECONDS", 0)
    calls: list[int] = []

    def check() -> None:
        calls.append(1)
        if len(calls) == at_call:
            (src / "sub").rename(tmp_path / "sub-moved")
            (src / "sub").symlink_to(secret)

    dest = tmp_path / "repo"
    report = LocalDirectoryCopyback(threads=1).copy_back(
        run_id=uuid.uuid4(), source=str(src), destination=str(dest), check=check
    )
    assert "the secret" not in _contents(dest).values()
    assert report.skipped


def test_a_source_swapped_for_a_link_before_the_walk_copies_nothing(tmp_path: Path) -> None:
    """The source itself replaced by a link to another directory after it was checked: the
    copy stops, nothing of the other directory is read, and the destination is left as it
    was (never replaced by an empty copy)."""
    src, secret = _with_secret(tmp_path)
    dest = tmp_path / "repo"
    dest.mkdir()
    (dest / "old.txt").write_text("old")

    def check() -> None:
        if not (src).is_symlink():
            src.rename(tmp_path / "run-moved")
            src.symlink_to(secret)

    with pytest.raises(CopybackError) as raised:
        LocalDirectoryCopyback(threads=1).copy_back(
            run_id=uuid.uuid4(), source=str(src), destination=str(dest), check=check
        )
    assert raised.value.code == "copyback_source_missing"
    assert _contents(dest) == {"old.txt": "old"}
