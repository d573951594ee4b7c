"""`restore` writes a checkpoint's files only inside the directory it restores into: a header
whose paths leave it (`..`, absolute) is refused before anything is written
(docs/security.md#where-agent-strings-become-paths)."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from paperclip_client.session import FORMAT, HEADER, CheckpointError, restore


class _Stored:
    """Stands in for the server: `checkpoint_read` answers the parts as the API would."""

    def __init__(self, parts: dict[str, str]) -> None:
        self.parts = parts

    def checkpoint_read(self, run_id: str) -> dict[str, str]:
        return self.parts


def _parts(files: dict[str, bytes], dirs: list[str] | None = None) -> dict[str, str]:
    parts: dict[str, str] = {}
    entries: dict[str, Any] = {}
    for index, (rel, data) in enumerate(files.items()):
        parts[f"c{index}"] = base64.b64encode(data).decode()
        entries[rel] = {
            "chunks": [f"c{index}"],
            "sha256": hashlib.sha256(data).hexdigest(),
            "size": len(data),
            "mode": 0o644,
        }
    parts[HEADER] = json.dumps({"format": FORMAT, "files": entries, "dirs": dirs or []})
    return parts


@pytest.mark.parametrize(
    ("files", "dirs"),
    [
        ({"../escaped.txt": b"x"}, []),
        ({"a/../../escaped.txt": b"x"}, []),
        ({"/tmp/escaped-absolute.txt": b"x"}, []),
        ({}, ["../escaped-dir"]),
    ],
)
def test_paths_leaving_the_directory_are_refused(
    tmp_path: Path, files: dict[str, bytes], dirs: list[str]
) -> None:
    target = tmp_path / "session"
    with pytest.raises(CheckpointError, match="points outside the directory"):
        restore(_Stored(_parts(files, dirs)), "run", target)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session"]
    assert not Path("/tmp/escaped-absolute.txt").exists()


def test_paths_inside_are_restored(tmp_path: Path) -> None:
    target = tmp_path / "session"
    restore(_Stored(_parts({"a/b.txt": b"hello"}, ["empty"])), "run", target)  # type: ignore[arg-type]
    assert (target / "a" / "b.txt").read_bytes() == b"hello"
    assert (target / "empty").is_dir()
