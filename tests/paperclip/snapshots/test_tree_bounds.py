"""Trees an agent builds to make the plane work for them: directories shared by many paths (a
few kilobytes naming millions of long paths) and JSON nested past the parser's depth. Each is
refused with a reason, within bounds the settings name, never a 500 or a walk without end
(docs/snapshots.md#trees)."""

from __future__ import annotations

from io import BytesIO
from typing import Any
from uuid import UUID

import pytest

from paperclip.ids import parse_count
from paperclip.models import Company
from paperclip.snapshots import bounds, changes, trees
from paperclip.snapshots.diff import TreeUnreadable, tree_diff
from paperclip.snapshots.head import PublishError, tree_entries
from paperclip.snapshots.registration import SnapshotTreeInvalid, snapshot_walk
from paperclip.snapshots.store.reads import directory_loader
from paperclip.snapshots.store.uploads import cas_put
from paperclip.snapshots.trees import Entry, TreeInvalid, encode_dir
from tests.paperclip.snapshots.helpers import name_of
from tests.recovery.snapshots import store_tree

pytestmark = pytest.mark.django_db


def put(company_id: UUID, data: bytes) -> str:
    name = name_of(data)
    cas_put(company_id=company_id, digest=name, stream=BytesIO(data), length=len(data))
    return name


def shared_levels(company_id: UUID, levels: int, name_bytes: int = 1) -> str:
    """A root whose every directory holds two entries naming the same directory below it:
    `levels` + 1 blobs, 2 ** (levels + 1) - 2 paths."""
    below = put(company_id, encode_dir([]))
    for _ in range(levels):
        first, second = "a" * name_bytes, "b" * name_bytes
        below = put(
            company_id,
            encode_dir(
                [
                    Entry(name=first, type="dir", mode=0o755, digest=below),
                    Entry(name=second, type="dir", mode=0o755, digest=below),
                ]
            ),
        )
    return below


def test_a_directory_reached_by_many_paths_is_decoded_once(
    company: Company, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = shared_levels(company.pk, 12)
    decoded: list[str] = []
    decode = trees.decode_stored_dir

    def counted(data: bytes, digest: str, *args: Any, **kwargs: Any) -> Any:
        decoded.append(digest)
        return decode(data, digest, *args, **kwargs)

    monkeypatch.setattr(trees, "decode_stored_dir", counted)
    walked = trees.walk(root, load_many=directory_loader(company.pk), keep_files=False)
    assert walked.count == 2**13 - 2
    assert len(decoded) == len(set(decoded)) == 13  # each blob once, not once per path


def test_shared_directories_are_bounded_by_entries_and_by_path_bytes(
    company: Company, settings: Any
) -> None:
    """A snapshot's walk: about 3.5 KB of directory blobs name 8,190 paths of up to 3 KB."""
    root = shared_levels(company.pk, 12, name_bytes=255)
    settings.PAPERCLIP_SNAPSHOT_MAX_ENTRIES = 1_000
    with pytest.raises(SnapshotTreeInvalid) as entries:
        snapshot_walk(company_id=company.pk, tree=root)
    assert entries.value.details["reason"] == "too_many_entries"
    settings.PAPERCLIP_SNAPSHOT_MAX_ENTRIES = 2_000_000
    settings.PAPERCLIP_SNAPSHOT_MAX_PATH_BYTES = 1_000_000
    with pytest.raises(SnapshotTreeInvalid) as path_bytes:
        snapshot_walk(company_id=company.pk, tree=root)
    assert path_bytes.value.details["reason"] == "too_many_entries"
    settings.PAPERCLIP_SNAPSHOT_MAX_PATH_BYTES = 64 * 1024 * 1024
    assert snapshot_walk(company_id=company.pk, tree=root).count == 2**13 - 2


def test_the_comparison_with_the_head_and_the_diff_give_up_past_their_budget(
    company: Company, settings: Any
) -> None:
    """Against the head the comparison hands over to the whole walk (which names the
    reason); the diff, which agents may ask of any tree of their company, refuses it. Both
    walked every path before, to a depth of 256: two to the power of the depth."""
    head = store_tree(company.pk, {"README.md": b"hello\n"})
    root = shared_levels(company.pk, 12)
    load = directory_loader(company.pk)
    assert changes.walk_changes(root, head, load_many=load, max_entries=1_000) is None
    assert changes.walk_changes(root, head, load_many=load) is not None
    settings.PAPERCLIP_SNAPSHOT_MAX_ENTRIES = 1_000
    with pytest.raises(TreeUnreadable) as refused:
        tree_diff(company_id=company.pk, before=None, after=root)
    assert refused.value.reason == "too_many_entries"


def test_the_comparison_with_the_head_counts_the_path_bytes_it_compares(
    company: Company,
) -> None:
    """About 3.5 KB of directories naming 8,190 paths of up to 3 KB (12 MB of path text): the
    comparison gives up past `max_path_bytes` as the whole walk refuses the tree, so the
    registration's bound on path text holds against the head too."""
    head = store_tree(company.pk, {"README.md": b"hello\n"})
    root = shared_levels(company.pk, 12, name_bytes=255)
    load = directory_loader(company.pk)
    assert changes.walk_changes(root, head, load_many=load, max_path_bytes=1_000_000) is None
    with pytest.raises(TreeInvalid) as refused:
        trees.walk(root, load_many=load, max_path_bytes=1_000_000)
    assert refused.value.reason == "too_many_entries"
    compared = changes.walk_changes(root, head, load_many=load, max_path_bytes=64 << 20)
    assert compared is not None
    assert compared.entries == 2**13 - 2 - 1  # README.md counted out


def test_json_nested_past_the_parsers_depth_is_not_json() -> None:
    """A directory blob of 100,000 nested arrays: RecursionError in every decoder, which was
    a 500 at registration (the whole walk, the base, and the comparison with the head)."""
    deep = b'{"entries":[' + b"[" * 100_000 + b"]" * 100_000 + b'],"schema":"paperclip.dir.v1"}'
    with pytest.raises(TreeInvalid) as refused:
        trees.decode_dir(deep, "")
    assert refused.value.reason == "not_json"
    piece = b'name":"b","zz":' + b"[" * 100_000 + b"]" * 100_000 + b',"type":"dir"'
    with pytest.raises(TreeInvalid):
        trees.known_entries([piece], "")
    assert changes._checked_pieces([piece], [], "") is None


def test_whole_numbers_padded_with_zeros_are_counted_by_their_value() -> None:
    assert parse_count("0" * 5000 + "2", high=10) == 2  # int() refuses over 4,300 digits
    assert parse_count("9" * 5000, high=10) is None
    assert parse_count("00", high=10) == 0
    assert parse_count("11", high=10) is None
    assert parse_count("²", high=10) is None
    assert parse_count(None, high=10) is None


def test_walks_of_registered_trees_allow_the_larger_of_each_setting_and_its_built_in_bound(
    company: Company, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree registered under a setting raised past the built-in bound is still read by the
    walks the worker and the console make (publication reads it through `tree_entries`); a
    setting lowered later does not strand a tree registered before. The built-in bounds are
    lowered here so that a small tree passes them."""
    root = shared_levels(company.pk, 12)  # 8,190 paths
    monkeypatch.setattr(bounds, "MAX_ENTRIES", 1_000)
    settings.PAPERCLIP_SNAPSHOT_MAX_ENTRIES = 10_000  # raised past the built-in bound
    assert snapshot_walk(company_id=company.pk, tree=root).count == 2**13 - 2
    assert len(tree_entries(company.pk, root)) == 2**13 - 2
    settings.PAPERCLIP_SNAPSHOT_MAX_ENTRIES = 1_000
    with pytest.raises(PublishError):  # past both: refused, with the reason
        tree_entries(company.pk, root)
    monkeypatch.setattr(bounds, "MAX_ENTRIES", 10_000)  # lowered below the built-in bound
    assert len(tree_entries(company.pk, root)) == 2**13 - 2

    links = {f"l{i}": Entry(name=f"l{i}", type="symlink", target="a/../a/../b") for i in range(10)}
    monkeypatch.setattr(bounds, "MAX_SYMLINK_STEPS", 10)
    settings.PAPERCLIP_SNAPSHOT_MAX_SYMLINK_STEPS = 1_000
    trees.check_symlinks(links)
    settings.PAPERCLIP_SNAPSHOT_MAX_SYMLINK_STEPS = 10
    with pytest.raises(TreeInvalid) as refused:
        trees.check_symlinks(links)
    assert refused.value.reason == "too_many_entries"
