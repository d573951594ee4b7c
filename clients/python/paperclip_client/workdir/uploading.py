"""A snapshot of the workdir: scan it, upload the blobs the store lacks (batches streamed
from the files, large blobs by `PUT`), and record it in the index once it is registered.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from paperclip_client.cas import TRANSFER_THREADS, BatchFrame
from paperclip_client.errors import BlobDigestMismatch
from paperclip_client.workdir import watch_state
from paperclip_client.workdir.errors import WorkdirChanged
from paperclip_client.workdir.index import (
    DIRS,
    INDEX,
    Index,
    Rows,
    fs_now,
    load_index,
    save_state,
    state_path,
    stored_by_index,
)
from paperclip_client.workdir.rescan import scan_watched
from paperclip_client.workdir.scanning import (
    PIECE,
    Scan,
    under,
)
from paperclip_client.workdir.transfer import (
    SMALL_BLOB,
    Progress,
    Say,
    Store,
    run_parallel,
)

# A batch split off a small change holds at least this much (fewer, larger requests below).
SPLIT_MIN_BYTES = 256 * 1024
SPLIT_MIN_BLOBS = 64
FRAME_OVERHEAD = 24  # a batch frame's bytes besides its name and content

# --- uploading -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    tree: str
    files: int
    bytes: int
    uploaded: int
    scan: Scan
    started_ns: int | None = None  # when its scan started (`fs_now`): the index's `racy_ns`


def upload(
    store: Store,
    workdir: Path,
    found: Scan,
    *,
    say: Say,
    threads: int = TRANSFER_THREADS,
    known: Collection[str] = frozenset(),
) -> int:
    """Upload the blobs of `found` that the store lacks; the bytes sent. Batches and large
    blobs are sent by up to `threads` requests at once. Batch bodies are streamed from the
    files (never held in memory) and not hashed again: the store checks every blob, and a
    mismatch means the file changed since the scan (`WorkdirChanged`). Names in `known` are
    taken as stored without asking (`stored_by_index`)."""
    limits = store.limits()
    names = [n for n in found.sources if n not in known]
    names += [n for n in found.dirs if n not in found.sources and n not in known]
    missing = store.find_missing(names)
    del names
    total = sum(len(found.dirs[n]) if n in found.dirs else found.sources[n][2] for n in missing)
    progress = Progress(say, "upload", total)
    small_limit = min(SMALL_BLOB, limits.max_batch_bytes // 4)
    # A change smaller than `threads` full batches is split into about `threads` batches: in
    # one, the server would check and store all of it in one worker while the others idle.
    ways = max(1, threads)
    framed_total = total + sum(len(n) + FRAME_OVERHEAD for n in missing)
    batch_bytes = min(limits.max_batch_bytes, max(SPLIT_MIN_BYTES, -(-framed_total // ways)))
    batch_blobs = min(limits.max_batch_blobs, max(SPLIT_MIN_BLOBS, -(-len(missing) // ways)))

    def batch(frames: list[BatchFrame]) -> Callable[[], None]:
        def send() -> None:
            _put_batch(store, found, frames)
            progress.add(sum(f.size for f in frames))

        return send

    def large(name: str, size: int) -> Callable[[], None]:
        def send() -> None:
            _put_large(store, workdir, found, name, size)
            progress.add(size)

        return send

    def jobs() -> Iterator[Callable[[], None]]:
        frames: list[BatchFrame] = []
        frame_bytes = 0
        for name in missing:
            frame = _frame(workdir, found, name)
            if frame.size > small_limit:
                yield large(name, frame.size)
                continue
            framed = len(name) + FRAME_OVERHEAD + frame.size
            if frames and (frame_bytes + framed > batch_bytes or len(frames) >= batch_blobs):
                yield batch(frames)
                frames, frame_bytes = [], 0
            frames.append(frame)
            frame_bytes += framed
        if frames:
            yield batch(frames)

    run_parallel(jobs(), threads)
    return total


def _frame(workdir: Path, found: Scan, name: str) -> BatchFrame:
    data = found.dirs.get(name)
    if data is not None:
        return BatchFrame(name, len(data), lambda: (data,))
    path, offset, length = found.sources[name]
    return BatchFrame(name, length, lambda: _read_source(workdir, path, offset, length))


def _read_source(workdir: Path, path: str, offset: int, length: int) -> Iterator[bytes]:
    """`length` bytes of the file at `path` from `offset`, in pieces (a file that no longer
    has them: `WorkdirChanged`; one whose bytes changed is the store's mismatch)."""
    try:
        fd = os.open(under(workdir, path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise WorkdirChanged(f"{path}: changed while it was snapshotted") from exc
    try:
        while length > 0:
            piece = os.pread(fd, min(PIECE, length), offset)
            if not piece:
                raise WorkdirChanged(f"{path}: changed while it was snapshotted")
            offset += len(piece)
            length -= len(piece)
            yield piece
    finally:
        os.close(fd)


def _put_batch(store: Store, found: Scan, frames: Sequence[BatchFrame]) -> None:
    try:
        store.put_batch(frames)
    except BlobDigestMismatch as exc:
        digest = str(exc.details.get("digest", ""))
        path = found.sources[digest][0] if digest in found.sources else "a file"
        raise WorkdirChanged(f"{path}: changed while it was snapshotted") from exc


def _put_large(store: Store, workdir: Path, found: Scan, name: str, size: int) -> None:
    if name in found.dirs:
        store.put(name, io.BytesIO(found.dirs[name]), size)
        return
    path, offset, length = found.sources[name]
    try:
        handle = open(workdir / path, "rb", opener=_nofollow)  # noqa: SIM115 - closed below
    except OSError as exc:
        raise WorkdirChanged(f"{path}: changed while it was snapshotted") from exc
    with handle:
        handle.seek(offset)
        try:
            store.put(name, handle, length)
        except BlobDigestMismatch as exc:
            raise WorkdirChanged(f"{path}: changed while it was snapshotted") from exc


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def snapshot(
    store: Store,
    workdir: Path,
    *,
    say: Say,
    warn: Say,
    attempts: int = 3,
    threads: int = TRANSFER_THREADS,
    trust_index: tuple[str, str] | None = None,
) -> SnapshotResult:
    """Scan the workdir (with its stat cache) and upload what the store lacks. The index is
    not written here: `commit_snapshot` does it once the snapshot is registered.
    `trust_index` (server, workspace): blobs the index names for them are not asked about
    (`stored_by_index`)."""
    limits = store.limits()
    for attempt in range(attempts):
        index = load_index(workdir)
        started = fs_now(workdir)
        found = scan_watched(
            workdir,
            max_blob_bytes=limits.max_blob_bytes,
            index=index,
            warn=warn,
            say=say,
            trust=trust_index,
        )
        known = _known(workdir, index, found, trust_index)
        try:
            uploaded = upload(store, workdir, found, say=say, threads=threads, known=known)
        except WorkdirChanged as exc:
            if attempt == attempts - 1:
                raise
            say(f"snapshot: {exc}; scanning again")
            continue
        return SnapshotResult(found.tree, found.files, found.bytes, uploaded, found, started)
    raise AssertionError("unreachable")


def _known(
    workdir: Path, index: Index | None, found: Scan, trust_index: tuple[str, str] | None
) -> Collection[str]:
    """The blobs of `found` taken as stored without asking (`stored_by_index`). When the scan
    found the very tree the index records for this server and workspace (a run that changed
    nothing), that is every blob of the scan, without reading `dirs.json` and the index's
    50,000 names again (issue #42)."""
    if trust_index is None:
        return frozenset()
    server, workspace = trust_index
    if (
        index is not None
        and index.tree is not None
        and index.tree == found.tree
        and (index.server, index.workspace) == (server, workspace)
    ):
        return found.sources.keys() | found.dirs.keys()
    if found.vouched is not None:  # a partial scan: taken only with the index trusted
        return found.vouched
    return stored_by_index(workdir, index, server=server, workspace=workspace)


def drop_state(workdir: Path) -> None:
    """The watcher's token and the index removed (in that order, as `commit_snapshot` replaces
    them): the workdir then records no tree, and the next snapshot or checkout reads every
    file. After a `commit_snapshot` that failed part way, which may leave an index of the
    tree before."""
    watch_state.drop_state(workdir)
    with contextlib.suppress(FileNotFoundError):
        (state_path(workdir) / INDEX).unlink()


def commit_snapshot(workdir: Path, result: SnapshotResult, *, server: str, workspace: str) -> None:
    """Record the registered snapshot in the index (and its directory blobs), then the
    watcher's token taken before its scan (`watch.json`, naming that index). A run that
    changed nothing leaves the index and the blobs as they are: the index (the scan's own,
    from `load_index`'s cache) already records the same tree and stat cache, and rewriting
    them was work proportional to the workspace (about 75 ms and two fsyncs for 50,000
    files); after a partial scan that read nothing, that is known from the index's header
    without parsing its rows."""
    index = load_index(workdir)
    found = result.scan
    if (
        index is not None
        and index.records(tree=result.tree, server=server, workspace=workspace, files=found.stats)
        and (state_path(workdir) / DIRS).is_file()
        and index.id
    ):
        index_id = index.id
    else:
        watch_state.drop_state(workdir)  # before the index it names is replaced
        index_id = save_state(
            workdir,
            tree=result.tree,
            server=server,
            workspace=workspace,
            files=found.stats,
            dirs=found.dirs,
            racy_ns=result.started_ns,
        )
    if found.token is None or (isinstance(found.stats, Rows) and found.stats.unreadable):
        # No token, or an index just written without the rows a partial scan goes on from.
        watch_state.drop_state(workdir)
        return
    watch_state.save_state(
        workdir,
        watch_state.WatchState(
            token=found.token,
            index=index_id,
            tree=result.tree,
            ignore=found.ignore,
            max_blob_bytes=found.max_blob_bytes,
            paths=found.paths,
            links=found.links,
            left_out=found.left_out,
            linked=found.linked,
        ),
    )
