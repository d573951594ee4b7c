"""What made the diff and the history fast (issue 40) changes no answer: a recorded tree's
directories compared as raw entries equal the validated walk and the whole trees' diff; a
directory that is not valid is refused either way; the per-process directory cache never serves
another company's directory; the backends read many small blobs at once; the history's page,
read as rows without model instances, keeps every field of the contract."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from paperclip.access import Actor, agent_actor
from paperclip.api.history_views import MoveSerializer
from paperclip.errors import NotFoundError
from paperclip.models import Agent, Company
from paperclip.snapshots import diff as diff_module
from paperclip.snapshots.counts import Counts, known_valid_trees, tree_counts_record
from paperclip.snapshots.diff import TreeUnreadable, changes_between, tree_diff
from paperclip.snapshots.history import Move, workspace_history
from paperclip.snapshots.models import WorkspaceHeadMove
from paperclip.snapshots.store.backends import blob_backend, blob_path
from paperclip.snapshots.store.reads import cas_rows
from paperclip.snapshots.trees import (
    Entry,
    blob_name,
    build,
    decode_dir,
    encode_dir,
    entry_pieces,
)
from tests.helpers import assert_error
from tests.paperclip.factories import AgentFactory, ExecutionWorkspaceFactory
from tests.recovery.snapshots import Files, entries_of, put_blob, store_tree

pytestmark = pytest.mark.django_db

# Names a split on raw bytes could trip over: JSON punctuation, quotes, escapes, non-ASCII.
AWKWARD = [
    'a"},{"b',
    "a},{",
    "},{",
    "}",
    "{",
    "back\\slash",
    'q"',
    "é",
    "日本",
    "tab\there",
    ",",
    "]",
]


def _trees(company: Company) -> tuple[str, str, dict[str, Entry], dict[str, Entry]]:
    rng = random.Random(40)
    before: Files = {
        f"d{d}/{name}/f{f}": f"{d}{name}{f}".encode()
        for d in range(3)
        for name in AWKWARD
        for f in range(3)
    }
    after = dict(before)
    for path in rng.sample(sorted(before), 12):
        after[path] = b"changed " + path.encode()
    for path in rng.sample(sorted(after), 6):
        after.pop(path)
    after['d9/new"},{"dir/x'] = b"added"
    old_entries, new_entries = entries_of(company.pk, before), entries_of(company.pk, after)
    new_entries["d0/{"] = Entry(name="{", type="dir", mode=0o700)  # a mode change only
    new_entries["d1/link"] = Entry(name="link", type="symlink", target='../"},{"')
    new_entries["d1/link2"] = Entry(name="link2", type="symlink", target="../},{")
    old_entries["d1/link3"] = Entry(name="link3", type="symlink", target="../},{")
    old_entries["d2/big"] = Entry(
        name="big",
        type="file",
        mode=0o644,
        size=2,
        digest=None,
        chunks=(blob_name(b"1"), blob_name(b"2")),
    )
    new_entries["d2/big"] = Entry(
        name="big",
        type="file",
        mode=0o755,
        size=2,
        digest=None,
        chunks=(blob_name(b"1"), blob_name(b"2")),
    )
    roots = []
    for entries in (old_entries, new_entries):
        root, blobs = build(entries)
        for data in blobs.values():
            put_blob(company.pk, data)
        roots.append(root)
    return roots[0], roots[1], old_entries, new_entries


def test_recorded_trees_compared_raw_give_the_validated_walks_changes(
    company: Company, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new, old_entries, new_entries = _trees(company)
    whole = [c.as_json() for c in changes_between(old_entries, new_entries)]
    validated = tree_diff(company_id=company.pk, before=old, after=new)
    assert [c.as_json() for c in validated.changes] == whole
    for tree in (old, new):
        tree_counts_record(company_id=company.pk, tree=tree, counts=Counts(0, 0, 0))
    assert known_valid_trees(company_id=company.pk, trees=[old, new]) == {old, new}
    calls: list[str] = []
    real = diff_module.decode_dir
    monkeypatch.setattr(
        diff_module, "decode_dir", lambda data, path="": calls.append(path) or real(data, path)
    )
    raw = tree_diff(company_id=company.pk, before=old, after=new)
    assert [c.as_json() for c in raw.changes] == whole
    assert raw.counts == validated.counts
    assert raw.read == validated.read
    assert calls == []  # no directory of a recorded tree validated again
    back = tree_diff(company_id=company.pk, before=new, after=None)
    assert {c.path for c in back.changes} == set(new_entries)
    assert all(c.change == "removed" for c in back.changes)


def test_pieces_split_a_directory_exactly_whatever_its_names() -> None:
    entries = [
        Entry(name=n, type="file", mode=0o644, size=1, digest=blob_name(n.encode()))
        for n in AWKWARD
    ]
    pieces = entry_pieces(encode_dir(entries))
    assert pieces is not None
    assert len(pieces) == len(AWKWARD)
    assert entry_pieces(encode_dir([])) == []
    assert entry_pieces(b'{"entries": [], "schema":"paperclip.dir.v1"}') is None


def test_same_as_compares_what_an_entry_shows_but_its_name() -> None:
    """`same_as` compares fields instead of two `as_json` renderings: the same answer."""
    digest, other = blob_name(b"a"), blob_name(b"b")
    chunks = (blob_name(b"1"), blob_name(b"2"))
    variants = [
        Entry(name="x", type="file", mode=0o644, size=1, digest=digest),
        Entry(name="y", type="file", mode=0o644, size=1, digest=digest),
        Entry(name="x", type="file", mode=0o755, size=1, digest=digest),
        Entry(name="x", type="file", mode=0o644, size=2, digest=digest),
        Entry(name="x", type="file", mode=0o644, size=1, digest=other),
        Entry(name="x", type="file", mode=0o644, size=2, chunks=chunks),
        Entry(name="x", type="file", mode=0o644, size=2, chunks=chunks[::-1]),
        Entry(name="x", type="symlink", target="a"),
        Entry(name="x", type="symlink", target="b"),
        Entry(name="x", type="dir", mode=0o755, digest=digest),
        Entry(name="x", type="dir", mode=0o755, digest=other),
        Entry(name="x", type="dir", mode=0o700, digest=digest),
    ]
    for a in variants:
        assert not a.same_as(None)
        for b in variants:
            if a.type == b.type == "dir":
                expected = a.mode == b.mode  # what is inside compares path by path
            else:
                expected = a.as_json() | {"name": ""} == b.as_json() | {"name": ""}
            assert a.same_as(b) == expected, (a, b)


def test_a_directory_whose_stored_bytes_are_not_its_own_is_never_compared(
    company: Company, settings: Any, tmp_path: Path
) -> None:
    """The walk does not hash a recorded tree's directories again: the loader's check (every
    blob against its name, before it is cached) is what keeps damaged bytes out."""
    settings.PAPERCLIP_CAS_BACKEND = "filesystem"
    settings.PAPERCLIP_CAS_DIR = tmp_path / "cas"
    old = store_tree(company.pk, {"a/f": b"1", "b/f": b"2"})
    new = store_tree(company.pk, {"a/f": b"1!", "b/f": b"2!"})
    for tree in (old, new):
        tree_counts_record(company_id=company.pk, tree=tree, counts=Counts(0, 0, 0))
    below = {e.name: e.digest for e in known_dir(company, new)}
    assert below["b"] is not None
    damage(company, below["b"], encode_dir([]))  # valid bytes, but not the blob's
    with pytest.raises(TreeUnreadable) as caught:
        tree_diff(company_id=company.pk, before=old, after=new)
    assert (caught.value.tree, caught.value.path) == (new, "b")


def known_dir(company: Company, digest: str) -> list[Entry]:
    return list(decode_dir(_bytes_of(company, digest)))


def damage(company: Company, digest: str, data: bytes) -> None:
    """Replace the stored bytes of `digest` behind the store's back (the filesystem backend)."""
    blob_path(company.pk, digest).write_bytes(data)


@pytest.mark.parametrize("recorded", [False, True])
@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (b"not json", "not_json"),
        (b'{"entries":[{"name":"a","type":"file"}],"schema":"paperclip.dir.v1"}', "bad_fields"),
        (b'{"entries":[],"schema":"other"}', "unknown_schema"),
    ],
)
def test_a_directory_that_is_not_valid_is_refused(
    company: Company, agent_client: APIClient, recorded: bool, blob: bytes, reason: str | None
) -> None:
    """Unrecorded: validated as read. Recorded (which only the server's own checks can make so,
    here forced): whatever does not even split or parse is still refused, never a 500."""
    good = store_tree(company.pk, {"a": b"a"})
    bad = put_blob(company.pk, blob)
    if recorded:
        tree_counts_record(company_id=company.pk, tree=bad, counts=Counts(0, 0, 0))
    with pytest.raises(TreeUnreadable) as caught:
        tree_diff(company_id=company.pk, before=good, after=bad)
    assert caught.value.tree == bad
    if reason is not None:
        assert caught.value.reason == reason
    workspace = ExecutionWorkspaceFactory(company=company)
    url = f"/api/execution-workspaces/{workspace.pk}/diff"
    assert_error(agent_client.get(url, {"from": good, "to": bad}), 404, "not_found")


def test_the_directory_cache_never_serves_another_companys_directory(
    company: Company, other_company: Company, make_agent_client: Callable[[Agent], APIClient]
) -> None:
    """Digests are shared across companies, blobs are not: a directory one company's diff read
    (and the per-process cache kept) is still absent for a company whose store lacks it."""
    old, new, *_ = _trees(company)
    for tree in (old, new):
        tree_counts_record(company_id=company.pk, tree=tree, counts=Counts(0, 0, 0))
    assert tree_diff(company_id=company.pk, before=old, after=new).changes  # cache warmed
    assert known_valid_trees(company_id=other_company.pk, trees=[old, new]) == set()
    with pytest.raises(TreeUnreadable):
        tree_diff(company_id=other_company.pk, before=old, after=new)
    workspace = ExecutionWorkspaceFactory(company=other_company)
    client = make_agent_client(AgentFactory(company=other_company))
    url = f"/api/execution-workspaces/{workspace.pk}/diff"
    assert_error(client.get(url, {"from": "empty", "to": new}), 404, "not_found")
    # The other company holding the root only: the directories below are still not its own.
    put_blob(other_company.pk, _bytes_of(company, new))
    with pytest.raises(TreeUnreadable) as caught:
        tree_diff(company_id=other_company.pk, before=None, after=new)
    assert caught.value.path != ""


def _bytes_of(company: Company, digest: str) -> bytes:
    rows = cas_rows(company_id=company.pk, digests=[digest])
    return blob_backend().get_many(company_id=company.pk, rows=rows)[digest]


def test_the_backends_read_many_small_blobs_at_once(company: Company, backend: str) -> None:
    blobs = [b"", b"one", b"two" * 1000]
    names = [put_blob(company.pk, data) for data in blobs]
    rows = cas_rows(company_id=company.pk, digests=[*names, "sha256:" + "0" * 64])
    found = blob_backend().get_many(company_id=company.pk, rows=rows)
    assert found == dict(zip(names, blobs, strict=True))
    assert blob_backend().get_many(company_id=company.pk, rows={}) == {}


@pytest.mark.parametrize("before", [None, 1, 7, 12])
def test_every_shape_of_the_history_statement_reads_the_same_page(
    company: Company, other_company: Company, before: int | None
) -> None:
    """The page is one prepared statement in four shapes (scoped to the actor's companies or
    not, with `before` or not): each gives what the ORM gives, and a scope without the
    workspace's company finds nothing."""
    workspace = ExecutionWorkspaceFactory(company=company)
    WorkspaceHeadMove.objects.bulk_create(
        WorkspaceHeadMove(
            company=company,
            workspace=workspace,
            seq=seq,
            tree=blob_name(b"%d" % seq),
            previous_tree=blob_name(b"%d" % (seq - 1)) if seq > 1 else None,
            kind="publish",
            actor_type="system",
            actor_id="test",
        )
        for seq in range(1, 12)
    )
    rows = WorkspaceHeadMove.objects.filter(workspace=workspace).order_by("-seq")
    if before is not None:
        rows = rows.filter(seq__lt=before)
    expected = [Move.of(row).as_json() for row in rows[:4]]
    actors = [
        Actor(type="board", company_ids=None),
        Actor(type="board", company_ids=frozenset({other_company.pk, company.pk})),
        agent_actor(AgentFactory(company=company)),
    ]
    for actor in actors:
        page = workspace_history(actor=actor, workspace_id=workspace.pk, limit=4, before=before)
        assert [move.as_json() for move in page.moves] == expected
        assert page.next == (expected[-1]["seq"] if len(rows) > 4 else None)
    outsider = Actor(type="board", company_ids=frozenset({other_company.pk}))
    with pytest.raises(NotFoundError):
        workspace_history(actor=outsider, workspace_id=workspace.pk, limit=4, before=before)


def test_a_history_page_keeps_every_field_of_the_contract(
    company: Company, agent_client: APIClient, make_agent_client: Callable[[Agent], APIClient]
) -> None:
    workspace = ExecutionWorkspaceFactory(company=company)
    url = f"/api/execution-workspaces/{workspace.pk}/history"
    assert agent_client.get(url).json() == {"results": [], "next": None}
    WorkspaceHeadMove.objects.create(
        company=company,
        workspace=workspace,
        seq=1,
        tree=blob_name(b"t"),
        kind="publish",
        actor_type="system",
        actor_id="test",
        note="n",
        added=1,
        removed=2,
        modified=3,
    )
    row = WorkspaceHeadMove.objects.get(workspace=workspace)
    shown: dict[str, Any] = agent_client.get(url).json()["results"][0]
    assert set(shown) == set(MoveSerializer().fields)  # the documented shape, every field
    assert shown == Move.of(row).as_json()
    assert shown["counts"] == {"added": 1, "removed": 2, "modified": 3}
    assert shown["note"] == "n"
    assert_error(make_agent_client(AgentFactory()).get(url), 404, "not_found")
    with pytest.raises(NotFoundError):  # another company's, with moves or without
        workspace_history(actor=agent_actor(AgentFactory()), workspace_id=workspace.pk)
    empty = ExecutionWorkspaceFactory(company=company)
    with pytest.raises(NotFoundError):
        workspace_history(actor=agent_actor(AgentFactory()), workspace_id=empty.pk)
