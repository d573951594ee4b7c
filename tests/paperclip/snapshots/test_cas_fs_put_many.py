"""The filesystem backend's batch write (`FilesystemBackend.put_many`): every blob written,
synced before it is renamed into place, a group's files synced together, and nothing
temporary left behind when a write fails (docs/snapshots.md#the-store)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from paperclip.snapshots.store import backends
from paperclip.snapshots.store.backends import FilesystemBackend, blob_path
from paperclip.snapshots.store.spool import Region
from tests.paperclip.snapshots.helpers import name_of


def region(data: bytes) -> Region:
    return Region(io.BytesIO(data), 0, len(data))


class BrokenFile(io.BytesIO):
    def read(self, size: int | None = -1, /) -> bytes:
        raise OSError("the spool could not be read")


@pytest.fixture
def cas_dir(settings: Any, tmp_path: Path) -> Path:
    settings.PAPERCLIP_CAS_DIR = tmp_path / "cas"
    return tmp_path / "cas"


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_a_batch_is_written_in_groups_each_file_synced_before_its_rename(
    cas_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group by group: every file of a group synced, then renamed into place. One sync after
    each write (sync, rename, sync, rename...) cost a journal commit per blob."""
    monkeypatch.setattr(backends, "SYNC_GROUP", 3)
    company = uuid4()
    blobs = [b"blob %d\n" % i for i in range(10)]
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd: int) -> None:
        fsync(fd)
        events.append(("sync", os.readlink(f"/proc/self/fd/{fd}")))

    def checked_replace(source: str, target: str) -> None:
        assert ("sync", source) in events  # durable before it is the blob
        events.append(("rename", source))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", checked_replace)
    FilesystemBackend().put_many(
        company_id=company, blobs=[(i, name_of(data), region(data)) for i, data in enumerate(blobs)]
    )
    assert [blob_path(company, name_of(data)).read_bytes() for data in blobs] == blobs
    kinds = [kind for kind, _ in events]
    assert kinds == (["sync"] * 3 + ["rename"] * 3) * 3 + ["sync", "rename"]
    assert leftovers(cas_dir) == []


def test_a_failed_write_leaves_no_temporary_file_and_only_earlier_groups_placed(
    cas_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backends, "SYNC_GROUP", 3)
    company = uuid4()
    blobs = [(i, name_of(b"blob %d" % i), region(b"blob %d" % i)) for i in range(6)]
    blobs[4] = (4, name_of(b"blob 4"), Region(BrokenFile(b"blob 4"), 0, 6))
    descriptors = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="the spool could not be read"):
        FilesystemBackend().put_many(company_id=company, blobs=blobs)
    placed = [blob_path(company, digest).exists() for _, digest, _ in blobs]
    assert placed == [True, True, True, False, False, False]  # the caller removes the first
    assert leftovers(cas_dir) == []
    assert len(os.listdir("/proc/self/fd")) == descriptors  # every descriptor closed


def test_one_blob_is_the_same_write(cas_dir: Path) -> None:
    company = uuid4()
    FilesystemBackend().put(
        blob_id=1, company_id=company, digest=name_of(b"x"), source=region(b"x")
    )
    assert blob_path(company, name_of(b"x")).read_bytes() == b"x"
    assert leftovers(cas_dir) == []
