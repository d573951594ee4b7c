"""The counts of a tree (files, their bytes, entries of every kind), as registration records
them for a snapshot and the publisher for a tree it builds itself (a merge, an adopted cwd):
what a later registration needs to compare its tree with the head instead of walking the
whole tree (docs/snapshots.md#registering-against-the-head)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from uuid import UUID

from django.conf import settings

from paperclip.models import RunSnapshot, TreeCounts
from paperclip.snapshots.changes import Changes, walk_changes
from paperclip.snapshots.trees import Entry


@dataclass(frozen=True, slots=True)
class Counts:
    files: int
    bytes: int
    entries: int  # entries of every kind, the root not counted


def counts_of(entries: Mapping[str, Entry]) -> Counts:
    """The counts of a tree given as all its entries by path (directories included)."""
    files = [entry.size for entry in entries.values() if entry.type == "file"]
    return Counts(files=len(files), bytes=sum(files), entries=len(entries))


def tree_counts_record(*, company_id: UUID, tree: str, counts: Counts) -> None:
    """Keep the counts of `tree`; a tree already counted is left as it is (its counts are a
    function of its content)."""
    TreeCounts.objects.bulk_create(
        [
            TreeCounts(
                company_id=company_id,
                tree=tree,
                files=counts.files,
                bytes=counts.bytes,
                entries=counts.entries,
            )
        ],
        ignore_conflicts=True,
    )


def tree_counts(*, company_id: UUID, tree: str) -> Counts | None:
    """The counts of `tree` if a registration or the publisher recorded them, else None."""
    row = (
        RunSnapshot.objects.filter(company_id=company_id, tree=tree, entries__isnull=False)
        .values_list("files", "bytes", "entries")
        .first()
    ) or (
        TreeCounts.objects.filter(company_id=company_id, tree=tree)
        .values_list("files", "bytes", "entries")
        .first()
    )
    if row is None or row[2] is None:
        return None
    return Counts(files=row[0], bytes=row[1], entries=row[2])


def known_valid_trees(*, company_id: UUID, trees: list[str]) -> set[str]:
    """The trees among `trees` known valid and whole in the company: those a registration
    validated (a snapshot row) or the publisher built (counts kept), the same knowledge
    `walk_changes` relies on for a head. Every directory such a tree reaches is valid: a
    directory's name fixes its bytes, and they were validated (or encoded here) when the tree
    was recorded. One query of two index lookups."""
    if not trees:
        return set()
    registered = RunSnapshot.objects.filter(company_id=company_id, tree__in=trees)
    built = TreeCounts.objects.filter(company_id=company_id, tree__in=trees)
    return set(
        registered.values_list("tree", flat=True).union(built.values_list("tree", flat=True))
    )


def counts_against_head(
    *,
    company_id: UUID,
    tree: str,
    head: str,
    load_many: Callable[[list[str]], Mapping[str, bytes]],
) -> tuple[Counts, Changes] | None:
    """The counts of `tree` from the head's and a comparison with it (`walk_changes`), and
    that comparison; None when the head's counts are not known or the comparison cannot vouch
    for the tree, which includes comparing more entries or path text than a registration's
    whole walk may read (PAPERCLIP_SNAPSHOT_MAX_ENTRIES, PAPERCLIP_SNAPSHOT_MAX_PATH_BYTES:
    the whole walk then names the reason)."""
    known = tree_counts(company_id=company_id, tree=head)
    if known is None:
        return None
    changes = walk_changes(
        tree,
        head,
        load_many=load_many,
        head_known_valid=True,
        max_entries=settings.PAPERCLIP_SNAPSHOT_MAX_ENTRIES,
        max_path_bytes=settings.PAPERCLIP_SNAPSHOT_MAX_PATH_BYTES,
    )
    if changes is None:
        return None
    counts = Counts(
        files=known.files + changes.files,
        bytes=known.bytes + changes.bytes,
        entries=known.entries + changes.entries,
    )
    return counts, changes
