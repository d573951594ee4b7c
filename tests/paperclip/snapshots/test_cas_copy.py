"""The filesystem store's copy of a spooled blob into its temporary sibling
(`backends.copy_region`): in the kernel, falling back to reads and writes where
`copy_file_range` is refused, and never a short blob."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import IO

import pytest

from paperclip.snapshots.store import backends
from paperclip.snapshots.store.spool import Region


def _region(data: bytes, offset: int, size: int) -> tuple[Region, IO[bytes]]:
    spool = tempfile.TemporaryFile()  # noqa: SIM115 - closed by the caller
    spool.write(data)
    spool.flush()
    return Region(spool, offset, size, spool.fileno()), spool


@pytest.mark.parametrize("refused", [False, True])
def test_a_region_of_the_batch_file_is_copied_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    if refused:

        def no_copy(*args: object, **kwargs: object) -> int:
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(os, "copy_file_range", no_copy)
    data = os.urandom(200_000)
    region, spool = _region(data, 1234, 150_000)
    out = os.open(tmp_path / "blob", os.O_WRONLY | os.O_CREAT)
    try:
        backends.copy_region(region, out)
    finally:
        os.close(out)
        spool.close()
    assert (tmp_path / "blob").read_bytes() == data[1234 : 1234 + 150_000]


def test_a_batch_file_that_ends_early_never_makes_a_short_blob(tmp_path: Path) -> None:
    region, spool = _region(b"x" * 100, 50, 80)
    out = os.open(tmp_path / "blob", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="missing"):
            backends.copy_region(region, out)
    finally:
        os.close(out)
        spool.close()
