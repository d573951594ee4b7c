"""The state a partial scan trusts (`.paperclip/dirs.json`, `.paperclip/watch.json`) altered by
hand, by a bad disk or by a bug: the scan falls back to the full scan (or fails) and never
publishes a tree the workdir does not hold. A partial scan splices changes into the last
tree's directory blobs and keeps the entries it did not touch as they are, so a blob that is
not what its name says, or a directory path that names another directory's blob, would
otherwise reach the published tree unnoticed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paperclip_client.workdir import watch_state
from paperclip_client.workdir.index import load_dirs, state_path
from tests.clients.test_watch import Watcher, full_tree, settled, take, watch, watchers
from tests.clients.test_workdir import FakeStore, make

__all__ = ["watchers"]

FILES = {"d1/f0": "A", "d1/f1": "B", "d1/s/x": "C", "d2/s/y": "D"}


def settled_workdir(
    tmp_path: Path, watchers: list[Watcher]
) -> tuple[FakeStore, Path, dict[str, str]]:
    """A workdir snapshotted with the watcher running: the store, the root, the state's paths."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, FILES)
    watch(watchers, root)
    settled(store, root)
    state = watch_state.load_state(root)
    assert state is not None
    return store, root, dict(state.paths)


def rewrite_dirs(root: Path, name: str, data: bytes) -> None:
    """dirs.json with the blob `name` replaced by `data`, its name kept."""
    path = state_path(root) / "dirs.json"
    header, _, _ = path.read_bytes().partition(b"\n")
    blobs = load_dirs(root) | {name: data}
    path.write_bytes(
        header + b"\n" + b"".join(b"%s\t%s\n" % (k.encode(), v) for k, v in blobs.items())
    )


def edited_entry(blob: bytes, name: str, **changes: object) -> bytes:
    value = json.loads(blob)
    for entry in value["entries"]:
        if entry["name"] == name:
            entry.update(changes)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def rewrite_paths(root: Path, change: dict[str, str | None]) -> None:
    path = state_path(root) / "watch.json"
    body = json.loads(path.read_bytes())
    for key, value in change.items():
        if value is None:
            del body["paths"][key]
        else:
            body["paths"][key] = value
    path.write_text(json.dumps(body))


def test_a_blob_in_dirs_json_that_is_not_what_its_name_says_is_not_used(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """d1's blob altered (f1 names f0's content, or the subdirectory s names d2/s), its name
    kept: a change beside them must not publish the altered entries."""
    store, root, paths = settled_workdir(tmp_path, watchers)
    blob = load_dirs(root)[paths["d1"]]
    f0 = next(e for e in json.loads(blob)["entries"] if e["name"] == "f0")
    rewrite_dirs(root, paths["d1"], edited_entry(blob, "f1", digest=f0["digest"], size=f0["size"]))
    (root / "d1/f0").write_text("A2")
    result, line = take(store, root)
    assert result.tree == full_tree(root), line
    assert line.startswith("full scan:"), line

    blob = load_dirs(root)[watch_state.load_state(root).paths["d1"]]  # type: ignore[union-attr]
    rewrite_dirs(
        root,
        watch_state.load_state(root).paths["d1"],
        edited_entry(blob, "s", digest=paths["d2/s"]),
    )  # type: ignore[union-attr]
    (root / "d1/f0").write_text("A3")
    result, line = take(store, root)
    assert result.tree == full_tree(root), line


@pytest.mark.parametrize(
    ("change", "edits"),
    [
        ({"d1/s": "d2/s"}, ("d1/s/x",)),  # names another directory's blob
        ({"d1/s": None}, ("d1/s/x",)),  # a directory of the tree left out
        ({"d1/s": None}, ("d1/s/x", "d1/f0")),
    ],
)
def test_paths_in_watch_json_that_are_not_the_last_tree_give_the_full_scan(
    tmp_path: Path, watchers: list[Watcher], change: dict[str, str | None], edits: tuple[str, ...]
) -> None:
    store, root, paths = settled_workdir(tmp_path, watchers)
    rewrite_paths(root, {k: paths[v] if v is not None else None for k, v in change.items()})
    for rel in edits:
        (root / rel).write_text("changed")
    result, line = take(store, root)
    assert result.tree == full_tree(root), line
