"""Checkout: make the workdir hold a workspace head, touching only the paths where it differs
from the tree the workdir last held, and refusing to overwrite local work.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from paperclip_client.cas import TRANSFER_THREADS
from paperclip_client.errors import ApiError, BlobCorrupt, PaperclipError
from paperclip_client.trees import (
    Entry,
    TreeError,
    blob_name,
    decode_dir,
    symlink_escapes,
)
from paperclip_client.workdir.errors import LocalChanges
from paperclip_client.workdir.index import (
    JOURNAL,
    STATE_DIR,
    Index,
    Stat,
    load_dirs,
    load_index,
    save_state,
    state_path,
    write_atomic,
)
from paperclip_client.workdir.scanning import MAX_DEPTH
from paperclip_client.workdir.transfer import (
    SMALL_BLOB,
    Progress,
    Say,
    Store,
)
from paperclip_client.workdir.writer import (
    TEMP_NAME,
    WRITE_MODE_BITS,
    CheckoutWriter,
    DirFds,
    Prefetch,
    batches,
)

# The most paths a tree may expand to here, as the server's default limit on a snapshot.
MAX_TREE_ENTRIES = 2_000_000
# The most trees of interrupted checkouts a journal names (the latest kept): each is read
# again at the next checkout.
MAX_INTERRUPTED = 8

# --- checkout --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckoutResult:
    tree: str | None
    files: int
    fetched: int  # bytes over the network (file contents and directory blobs)
    written: int  # paths created, replaced or removed


def read_tree(
    tree: str | None,
    load_many: Callable[[list[str]], dict[str, bytes]],
    dirs: dict[str, bytes] | None = None,
) -> dict[str, Entry]:
    """Every entry of `tree` by path, each directory blob checked (`dirs` collects them). The
    directories are read a level at a time: `load_many` gets every name of a level at once
    (a name it leaves out is a tree that cannot be read). Refused (TreeError): a tree naming
    the CLI's own state directory at its root (`reserved_name`: writing there would replace
    the index), or one of more than MAX_TREE_ENTRIES paths (`too_many_entries`: directories
    shared by many paths name millions of them from a few blobs), besides what `decode_dir`
    and the symlink check refuse."""
    entries: dict[str, Entry] = {}
    if tree is None:
        return entries
    level: list[tuple[str, str, tuple[str, ...]]] = [("", tree, ())]
    while level:
        for path, digest, chain in level:
            if digest in chain or len(chain) > MAX_DEPTH:
                raise TreeError(path, "cycle" if digest in chain else "too_deep")
        got = load_many(list(dict.fromkeys(digest for _, digest, _ in level)))
        below: list[tuple[str, str, tuple[str, ...]]] = []
        for path, digest, chain in level:
            data = got.get(digest)
            if data is None or blob_name(data) != digest:
                raise TreeError(path, "digest_mismatch")
            if dirs is not None:
                dirs[digest] = data
            below.extend(_entries_of(data, path, (*chain, digest), entries))
        level = below
    for where, entry in entries.items():
        if entry.type == "symlink" and symlink_escapes(entries, where):
            raise TreeError(where, "escaping_symlink")
    return entries


def _entries_of(
    data: bytes, path: str, chain: tuple[str, ...], entries: dict[str, Entry]
) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """The directory `data` at `path` into `entries`; its subdirectories, to read next."""
    for entry in decode_dir(data, path):
        where = f"{path}/{entry.name}" if path else entry.name
        if where == STATE_DIR:
            raise TreeError(where, "reserved_name")
        entries[where] = entry
        if len(entries) > MAX_TREE_ENTRIES:
            raise TreeError(where, "too_many_entries")
        if entry.type == "dir":
            assert entry.digest is not None  # noqa: S101 - decode_dir checked it
            yield where, entry.digest, chain


def _same(current: Entry | None, wanted: Entry | None) -> bool:
    """Whether the workdir's entry is `wanted` for the local-work rule (a directory by type;
    a mode as a checkout writes it, without setuid, setgid or sticky bits)."""
    if current is None or wanted is None:
        return current is wanted
    if current.type == "dir" or wanted.type == "dir":
        return current.type == wanted.type
    if wanted.mode & ~WRITE_MODE_BITS:
        wanted = replace(wanted, mode=wanted.mode & WRITE_MODE_BITS)
    return current.same(wanted)


def _journal(workdir: Path) -> dict[str, object]:
    """What an interrupted checkout left in its journal (`{}` when there is none or it cannot
    be read)."""
    try:
        journal = json.loads((state_path(workdir) / JOURNAL).read_bytes())
    except (OSError, ValueError):
        return {}
    return journal if isinstance(journal, dict) else {}


def _interrupted_trees(journal: Mapping[str, object]) -> list[str | None]:
    """The trees that checkouts interrupted since the index was saved were writing: the
    workdir may hold any mix of them (a journal of version 1 names the last alone)."""
    named = journal.get("trees", [journal["tree"]] if "tree" in journal else [])
    if not isinstance(named, list):
        return []
    return [t for t in named if t is None or isinstance(t, str)][-MAX_INTERRUPTED:]


def _removing(journal: Mapping[str, object]) -> set[str]:
    """The paths interrupted checkouts said they would remove (none from a journal written
    before they said so: a path they removed then shows as local work, refused, never lost)."""
    named = journal.get("removing", [])
    return {str(p) for p in named} if isinstance(named, list) else set()


def _clean_leftovers(
    workdir: Path, journal: Mapping[str, object], tracked: Collection[str]
) -> None:
    """Remove the temporary files an interrupted checkout left in the directories it wrote:
    names as `temp_name` makes them (`.paperclip-tmp-` and 32 hex digits) that no tree the
    workdir held or is to hold names (`tracked`). A file of the agent's or a tree's that
    merely starts with `.paperclip-tmp-` is left alone: removing it would lose it, and a
    tracked one would be published as deleted by the next snapshot."""
    named = journal.get("dirs", [])
    if not isinstance(named, list):
        return
    dirs = [str(d) for d in named]
    opener = DirFds(workdir)
    try:
        for rel in dirs:
            fd = opener.try_open(rel)
            if fd is None:
                continue
            with os.scandir(fd) as it:
                stale = [
                    i.name
                    for i in it
                    if TEMP_NAME.fullmatch(i.name)
                    and (f"{rel}/{i.name}" if rel else i.name) not in tracked
                ]
            for name in stale:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
    finally:
        opener.close()


def checkout(
    store: Store,
    workdir: Path,
    head: str | None,
    *,
    server: str,
    workspace: str,
    discard_local_changes: bool = False,
    say: Say,
    threads: int = TRANSFER_THREADS,
) -> CheckoutResult:
    """Make the workdir hold `head` (None: the empty tree). Only paths where `head` differs
    from the tree the workdir last held are touched; each of them whose content is neither
    of the two is local work: `LocalChanges` before anything is written, unless
    `discard_local_changes`. File contents come from the workdir itself when a file there
    holds them (checked while copied), else from the store (small blobs fetched by up to
    `threads` requests at once)."""
    index = load_index(workdir)
    journal = state_path(workdir) / JOURNAL
    same_place = index is not None and index.server == server and index.workspace == workspace
    base_tree = index.tree if index is not None and same_place else None
    if base_tree == head and index is not None and not journal.exists():
        return CheckoutResult(head, index.count, 0, 0)  # the header's: the rows not parsed
    left = _journal(workdir) if journal.exists() else {}
    interrupted = [t for t in dict.fromkeys(_interrupted_trees(left)) if t != base_tree]
    limits = store.limits()
    head_dirs: dict[str, bytes] = {}
    wanted, base, dir_bytes = _read_trees(store, workdir, head, base_tree, head_dirs)
    # What an interrupted checkout wrote is neither local work nor to be left behind: its
    # trees count as held, and every path where one differs from the head is made the head's.
    written = _read_interrupted(store, workdir, interrupted, head)
    held = [base, *written]
    if left:
        _clean_leftovers(workdir, left, set(wanted).union(*held))
    changed = sorted(
        p
        for p in set(wanted).union(*held)
        if not all(_both(wanted.get(p), tree.get(p)) for tree in held)
    )
    removed = _removing(left) if interrupted else set()
    work = CheckoutWriter(store, workdir, index, limits, say)
    try:
        current = {p: work.current(p) for p in changed}
        conflicts, broken = _local_work(work, changed, wanted, held, current, removed)
        if conflicts and not discard_local_changes:
            raise LocalChanges(sorted(set(conflicts)))
        parents = sorted({p.rpartition("/")[0] for p in changed})
        trees = ([*interrupted, head] if head != base_tree else interrupted)[-MAX_INTERRUPTED:]
        body = {"tree": head, "trees": trees, "dirs": parents, "removing": sorted(removed)}
        write_atomic(journal, json.dumps(body).encode())

        def removing(paths: Collection[str]) -> None:
            # Said before the first removal: only a path named here may be missing because
            # an interrupted checkout removed it (`_local_work`); any other missing path the
            # next checkout finds was removed by the agent, which is local work.
            body["removing"] = sorted(removed.union(paths))
            write_atomic(journal, json.dumps(body).encode())

        work.progress = Progress(say, "checkout", _to_fetch(wanted, changed, current))
        work.prefetch = Prefetch(store, _ahead(wanted, changed, current, work.local), threads)
        _apply(
            work,
            changed,
            wanted,
            current,
            broken,
            discard_local_changes=discard_local_changes,
            before_removals=removing,
        )
    finally:
        work.close()
    files = _new_stats(wanted, changed, index, work.stats)
    save_state(workdir, tree=head, server=server, workspace=workspace, files=files, dirs=head_dirs)
    with contextlib.suppress(FileNotFoundError):
        journal.unlink()
    count = sum(1 for e in wanted.values() if e.type == "file")
    return CheckoutResult(head, count, work.fetched + dir_bytes, work.written)


def _read_trees(
    store: Store,
    workdir: Path,
    head: str | None,
    base_tree: str | None,
    head_dirs: dict[str, bytes],
) -> tuple[dict[str, Entry], dict[str, Entry], int]:
    """The head's entries (its directory blobs collected in `head_dirs`), the last-held tree's
    (empty when it cannot be read) and the bytes fetched for them: directory blobs come from
    `.paperclip/dirs.json` when it holds them, else from the store."""
    cached = load_dirs(workdir)
    dir_bytes = 0

    def load_many(names: list[str]) -> dict[str, bytes]:
        nonlocal dir_bytes
        found = {n: cached[n] for n in names if n in cached and blob_name(cached[n]) == n}
        wanted = [n for n in names if n not in found]
        for batch in batches([(n, 0) for n in wanted]):
            fetched = _fetch_dirs(store, batch)
            dir_bytes += sum(len(data) for data in fetched.values())
            found.update(fetched)
        return found

    wanted = read_tree(head, load_many, head_dirs)
    try:
        base = read_tree(base_tree, load_many)
    except (TreeError, PaperclipError):
        base = {}  # unknown: every difference from the head counts as local work
    return wanted, base, dir_bytes


def _read_interrupted(
    store: Store,
    workdir: Path,
    interrupted: Sequence[str | None],
    head: str | None,
) -> list[dict[str, Entry]]:
    """The entries of each tree an interrupted checkout was writing (the head's and the
    last-held tree's need no second read; one that cannot be read any more counts as holding
    nothing, so what it wrote is local work, as before the journal named it)."""
    read: list[dict[str, Entry]] = []
    for tree in interrupted:
        if tree == head:
            continue
        try:
            read.append(_read_trees(store, workdir, tree, None, {})[0] if tree else {})
        except (TreeError, PaperclipError):
            continue
    return read


def _fetch_dirs(store: Store, names: list[str]) -> dict[str, bytes]:
    """Directory blobs in one batch read; should it fail (too large together, one missing or
    damaged, a server without batch reads), each alone, whose read says what is wrong."""
    try:
        return store.get_batch(names)
    except (ApiError, BlobCorrupt):
        found: dict[str, bytes] = {}
        for name in names:
            buffer = io.BytesIO()
            store.get(name, buffer)
            found[name] = buffer.getvalue()
        return found


def _local_work(
    work: CheckoutWriter,
    changed: Sequence[str],
    wanted: Mapping[str, Entry],
    held: Sequence[Mapping[str, Entry]],
    current: Mapping[str, Entry | None],
    removed: Collection[str] = frozenset(),
) -> tuple[list[str], list[str]]:
    """The paths checkout would overwrite or delete that hold local work (content that is
    neither the head's nor that of a tree the workdir held, `held`: the last-held tree, then
    those of interrupted checkouts), and the directories of both trees that are no longer
    directories in the workdir (`broken`, among them). A path missing from the workdir is
    held by an interrupted checkout's tree only where that checkout said it would remove it
    (`removed`): it had written its files, not yet removed anything, when it was killed, so
    any other missing path is the agent's deletion."""
    last, *interrupted = held

    def was_held(p: str) -> bool:
        cur = current[p]
        if _same(cur, last.get(p)):
            return True
        return (cur is not None or p in removed) and any(
            _same(cur, tree.get(p)) for tree in interrupted
        )

    conflicts = [p for p in changed if not _same(current[p], wanted.get(p)) and not was_held(p)]
    known: set[str] = set().union(*held)
    for p in changed:
        cur, want = current[p], wanted.get(p)
        if cur is not None and cur.type == "dir" and want is not None and want.type != "dir":
            conflicts.extend(work.untracked_under(p, known))
    # A directory both trees have that is no longer one in the workdir (a symlink put in
    # its place, say) must be made again before anything is written under it.
    broken = _broken_parents(work, changed, wanted, current)
    conflicts.extend(broken)
    return conflicts, broken


def _apply(
    work: CheckoutWriter,
    changed: Sequence[str],
    wanted: Mapping[str, Entry],
    current: Mapping[str, Entry | None],
    broken: Sequence[str],
    *,
    discard_local_changes: bool,
    before_removals: Callable[[Collection[str]], None] = lambda paths: None,
) -> None:
    """Write the head's entries at the changed paths, then remove what it no longer has
    (`before_removals` told first which paths)."""
    for p in broken:
        work.remove(p, force=True)
        work.make_dir(p, wanted[p].mode)
    for p in changed:
        want = wanted.get(p)
        if want is not None:
            _write_entry(work, p, want, current[p])
    # Removals last (a removed file may be the local copy of a new one), deepest first.
    doomed = sorted((p for p in changed if p not in wanted), key=_depth, reverse=True)
    if doomed:
        before_removals(doomed)
    for p in doomed:
        work.remove(p, force=discard_local_changes)


def _write_entry(work: CheckoutWriter, p: str, want: Entry, cur: Entry | None) -> None:
    if cur is not None and cur.type != want.type:
        work.remove(p, force=True)  # checked above: tracked content or discarded
        cur = None
    if want.type == "dir":
        work.make_dir(p, want.mode)
    elif want.type == "symlink":
        if cur is None or cur.target != want.target:
            work.make_symlink(p, want.target)
    elif cur is not None and _same(cur, want):
        return
    elif cur is not None and cur.blobs() == want.blobs():
        work.set_mode(p, want.mode)
    else:
        work.write_file(p, want)


def _broken_parents(
    work: CheckoutWriter,
    changed: Sequence[str],
    wanted: Mapping[str, Entry],
    current: Mapping[str, Entry | None],
) -> list[str]:
    touched = set(changed)
    broken: set[str] = set()
    checked: set[str] = set()
    for p in changed:
        if p not in wanted:
            continue
        parts = p.split("/")[:-1]
        below_broken = False
        for depth in range(1, len(parts) + 1):
            a = "/".join(parts[:depth])
            if below_broken:
                # Under a directory made anew: gone with what was there, made anew too.
                if a not in touched:
                    broken.add(a)
                continue
            if a in touched or a in checked:
                continue
            checked.add(a)
            cur = current.get(a) if a in current else work.current(a)
            if cur is None or cur.type != "dir":
                broken.add(a)
                below_broken = True
    return sorted(broken, key=lambda path: (_depth(path), path))


def _ahead(
    wanted: Mapping[str, Entry],
    changed: Sequence[str],
    current: Mapping[str, Entry | None],
    local: Mapping[str | tuple[str, ...], str],
) -> list[tuple[str, int]]:
    """The small blobs checkout will fetch (name, size), in the order it writes their files
    (each once; none that a workdir file already holds): what `checkout`'s loop sends to
    `write_file`."""
    names: list[tuple[str, int]] = []
    seen: set[str] = set()
    for p in changed:
        want = wanted.get(p)
        if want is None or want.type != "file" or want.digest is None:
            continue
        cur = current[p]
        if cur is not None and cur.type != want.type:
            cur = None
        if cur is not None and (cur.same(want) or cur.blobs() == want.blobs()):
            continue
        if want.size > SMALL_BLOB or want.digest in seen or want.digest in local:
            continue
        seen.add(want.digest)
        names.append((want.digest, want.size))
    return names


def _both(a: Entry | None, b: Entry | None) -> bool:
    return (a is None and b is None) or (a is not None and a.same(b))


def _depth(path: str) -> int:
    return path.count("/")


def _to_fetch(
    wanted: Mapping[str, Entry], changed: Sequence[str], current: Mapping[str, Entry | None]
) -> int:
    total = 0
    for p in changed:
        want, cur = wanted.get(p), current.get(p)
        if (
            want is not None
            and want.type == "file"
            and (cur is None or cur.blobs() != want.blobs())
        ):
            total += want.size
    return total


def _new_stats(
    wanted: Mapping[str, Entry],
    changed: Sequence[str],
    index: Index | None,
    fresh: Mapping[str, Stat],
) -> dict[str, Stat]:
    """The stat cache after a checkout: what was read or written now, else what the old
    index knew (a stat cache entry stays right whatever tree it came from), but for a row
    racily clean under the old index (modified in or after its file's timestamp tick): the
    new index would vouch for it, and a change made in that tick would be missed."""
    touched = set(changed)
    files: dict[str, Stat] = {}
    old = index.files if index is not None else {}
    written = index.written_ns if index is not None else 0
    for path, entry in wanted.items():
        if entry.type != "file":
            continue
        if path in fresh:
            files[path] = fresh[path]
        elif path not in touched and path in old and old[path][1] < written:
            files[path] = old[path]
    return files


def iter_names(entries: Mapping[str, Entry]) -> Iterator[str]:
    for entry in entries.values():
        yield from entry.blobs()
