"""The default copy-back backend on real directories: the published directory's mode and times
are the source's (as `cp -a` gives them), and a source inside the destination is refused."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import pytest

from recovery.adapters.copyback import CopybackError, LocalDirectoryCopyback


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
