"""The collector of unreferenced blobs, on both backends (docs/snapshots.md#collection)."""

from __future__ import annotations

import threading
from io import BytesIO, StringIO
from typing import Any
from uuid import UUID

import obstore
import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection, transaction
from django.db.models.expressions import RawSQL

from paperclip.models import (
    ActivityEvent,
    CasBlob,
    CasBlobChunk,
    Company,
    HeartbeatRun,
    RunSnapshot,
)
from paperclip.snapshots import trees
from paperclip.snapshots.collect import CollectProgress, cas_collect
from paperclip.snapshots.store import reads
from paperclip.snapshots.store.backends import FilesystemBackend, blob_path
from paperclip.snapshots.store.pins import cas_pin
from paperclip.snapshots.store.reads import cas_find_missing, cas_load_many
from paperclip.snapshots.store.s3 import S3Backend
from paperclip.snapshots.store.uploads import cas_put
from tests.helpers import raw_connection, wait_for_lock_waiters
from tests.paperclip.factories import (
    CompanyFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
    NativeRunFinalizationFactory,
)
from tests.paperclip.snapshots.helpers import NOTHING, kept, name_of

pytestmark = pytest.mark.usefixtures("backend")
DAY = 86_400


def store(company_id: UUID, data: bytes) -> str:
    name = name_of(data)
    cas_put(company_id=company_id, digest=name, stream=BytesIO(data), length=len(data))
    return name


def age(*names: str, seconds: int = 2 * DAY) -> None:
    CasBlob.objects.filter(digest__in=names).update(
        created_at=_ago(seconds), referenced_at=_ago(seconds)
    )


def _ago(seconds: int) -> Any:
    return RawSQL("now() - make_interval(secs => %s)", [seconds])


def tree_of(company_id: UUID, files: dict[str, bytes]) -> tuple[str, list[str]]:
    """Store a tree of `files` (and its directories); its root and every blob it reaches."""
    entries: dict[str, trees.Entry] = {}
    names: list[str] = []
    for path, data in files.items():
        parts = path.split("/")
        for depth in range(1, len(parts)):
            directory = "/".join(parts[:depth])
            entries[directory] = trees.Entry(name=parts[depth - 1], type="dir", mode=0o755)
        names.append(store(company_id, data))
        entries[path] = trees.Entry(
            name=parts[-1], type="file", mode=0o644, size=len(data), digest=names[-1]
        )
    root, blobs = trees.build(entries)
    for data in blobs.values():
        names.append(store(company_id, data))
    return root, names


@pytest.mark.django_db
def test_old_unreachable_blobs_go_with_their_bytes_young_ones_stay(company: Company) -> None:
    old, young = store(company.pk, b"old garbage"), store(company.pk, b"young")
    age(old)
    summary = cas_collect(batch_size=10)
    assert summary.deleted == 1
    assert summary.bytes == len(b"old garbage")
    assert kept(company.pk, old) == NOTHING
    assert kept(company.pk, young)["row"]
    event = ActivityEvent.objects.get(action="cas.blobs_collected")
    assert event.actor_type == "system"
    assert event.details["deleted"] == 1
    # Nothing left to do: no second audit row.
    assert cas_collect(batch_size=10).deleted == 0
    assert ActivityEvent.objects.filter(action="cas.blobs_collected").count() == 1


@pytest.mark.django_db
def test_the_grace_counts_from_the_last_reference(company: Company, settings: Any) -> None:
    blob = store(company.pk, b"referenced lately")
    CasBlob.objects.filter(digest=blob).update(created_at=_ago(2 * DAY))  # referenced now
    assert cas_collect(batch_size=10).deleted == 0
    settings.PAPERCLIP_CAS_GRACE_SECONDS = 3600
    age(blob, seconds=3000)
    assert cas_collect(batch_size=10).deleted == 0
    age(blob, seconds=4000)
    assert cas_collect(batch_size=10).deleted == 1


@pytest.mark.django_db
def test_what_a_head_reaches_is_kept(company: Company) -> None:
    root, reached = tree_of(company.pk, {"a.txt": b"A", "src/b.py": b"B", "src/deep/c": b"C"})
    garbage = store(company.pk, b"garbage")
    ExecutionWorkspaceFactory(company=company, head_tree=root)
    age(*reached, garbage)
    summary = cas_collect(batch_size=2)
    assert summary.deleted == 1
    assert all(kept(company.pk, name)["row"] for name in reached)
    assert kept(company.pk, garbage) == NOTHING


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("status", "phase", "live"),
    [
        (HeartbeatRun.Status.RUNNING, None, True),
        (HeartbeatRun.Status.SUCCEEDED, None, False),
        (HeartbeatRun.Status.FAILED, "result_accepted", True),
        (HeartbeatRun.Status.SUCCEEDED, "workspace_finalizing", True),
        (HeartbeatRun.Status.SUCCEEDED, "committed", False),
    ],
)
@pytest.mark.parametrize("registered_days_ago", [0, 2])
def test_what_a_live_runs_snapshot_or_one_registered_within_the_grace_reaches_is_kept(
    company: Company, status: str, phase: str | None, live: bool, registered_days_ago: int
) -> None:
    root, reached = tree_of(company.pk, {"x": b"run work", "d/y": b"more"})
    base, base_reached = tree_of(company.pk, {"x": b"before"})
    workspace = ExecutionWorkspaceFactory(company=company)
    if phase is None:
        run = HeartbeatRunFactory(company=company, status=status)
    else:
        run = NativeRunFinalizationFactory(run__company=company, phase=phase).run
        HeartbeatRun.objects.filter(pk=run.pk).update(status=status)
    RunSnapshot.objects.create(
        company=company,
        run=run,
        execution_workspace=workspace,
        tree=root,
        base=base,
        files=2,
        bytes=12,
        lease_generation=1,
    )
    RunSnapshot.objects.filter(run=run).update(created_at=_ago(registered_days_ago * DAY))
    age(*reached, *base_reached)
    cas_collect(batch_size=100)
    # A snapshot registered within the grace is a root whatever its run's state: a
    # registration that trusted the head touched only what the head did not have.
    root_now = live or registered_days_ago == 0
    assert all(kept(company.pk, n)["row"] == root_now for n in reached + base_reached)
    if not root_now:
        assert all(kept(company.pk, n) == NOTHING for n in reached)


@pytest.mark.django_db
def test_companies_are_apart_and_a_dry_run_changes_nothing(company: Company) -> None:
    other = CompanyFactory()
    root, reached = tree_of(company.pk, {"shared": b"same bytes"})
    ExecutionWorkspaceFactory(company=company, head_tree=root)
    theirs = store(other.pk, b"same bytes")  # the same name in another company: not reached
    age(*reached, theirs)
    out = StringIO()
    call_command("cas_collect", "--dry-run", stdout=out)
    assert "Dry run: would delete 1 blob(s)" in out.getvalue()
    assert kept(other.pk, theirs)["row"]
    out = StringIO()
    call_command("cas_collect", "--batch-size", "1", stdout=out)
    assert "deleted 1 blob(s)" in out.getvalue()
    assert "batch 1: deleted 1" in out.getvalue()
    assert kept(other.pk, theirs) == NOTHING
    assert kept(company.pk, name_of(b"same bytes"))["row"]


@pytest.mark.django_db
def test_roots_sharing_subtrees_have_each_directory_read_once(
    company: Company, monkeypatch: pytest.MonkeyPatch
) -> None:
    from paperclip.snapshots import collect

    layout = {f"d{i}/s{j}/f": b"%d %d" % (i, j) for i in range(4) for j in range(3)}
    workspace = ExecutionWorkspaceFactory(company=company)
    directories: set[str] = set()
    for version in range(3):  # three recent snapshots, each one file apart from the first
        root, _ = tree_of(company.pk, layout | {"d1/s1/f": b"version %d" % version})
        walked = trees.walk(
            root,
            load=lambda n: collect.cas_load_many(
                company_id=company.pk, digests=[n], max_bytes=1 << 20
            ).get(n),
        )
        directories |= set(walked.directories)
        RunSnapshot.objects.create(
            company=company,
            run=HeartbeatRunFactory(company=company, status=HeartbeatRun.Status.SUCCEEDED),
            execution_workspace=workspace,
            tree=root,
            files=12,
            bytes=36,
            lease_generation=1,
        )
    read: list[str] = []
    load_many = collect.cas_load_many

    def counting(**kwargs: Any) -> dict[str, bytes]:
        read.extend(kwargs["digests"])
        return load_many(**kwargs)

    monkeypatch.setattr(collect, "cas_load_many", counting)
    reached = collect.cas_reachable(company.pk)
    assert directories <= reached
    assert sorted(read) == sorted(directories)  # each once: 3 roots, 3 d1 and s1, the rest shared


@pytest.mark.django_db
def test_a_company_with_an_unreadable_root_is_skipped(company: Company) -> None:
    not_a_dir = store(company.pk, b"not a directory")
    garbage = store(company.pk, b"garbage")
    ExecutionWorkspaceFactory(company=company, head_tree=not_a_dir)
    age(not_a_dir, garbage)
    summary = cas_collect(batch_size=10)
    assert summary.skipped_companies == (company.pk,)
    assert kept(company.pk, garbage)["row"]


def _damage(company_id: UUID, name: str) -> None:
    """Damage in place of a blob's bytes at the same size (bit rot, an object overwritten):
    its row stays, its bytes no longer hash to its name."""
    data = cas_load_many(company_id=company_id, digests=[name], max_bytes=1 << 20)[name]
    bad = bytes(b ^ 0xFF for b in data)
    backend = settings.PAPERCLIP_CAS_BACKEND
    if backend == "filesystem":
        blob_path(company_id, name).write_bytes(bad)
    elif backend == "postgres":
        CasBlobChunk.objects.filter(blob__company_id=company_id, blob__digest=name).update(data=bad)
    else:
        s3 = S3Backend()
        obstore.put(s3.store, s3.key(company_id, name), bad)


@pytest.mark.django_db
@pytest.mark.parametrize("damage", ["damaged", "missing"])
def test_a_directory_a_head_reaches_that_cannot_be_read_skips_the_company(
    company: Company, damage: str
) -> None:
    """A head's directory whose bytes are damaged (or gone) was read as "not stored: nothing
    below it to keep", and every file under it was collected: the head's committed work lost
    for good, even once the directory was repaired by uploading it again. Now the company is
    skipped whole and the command says why."""
    files = {"README": b"top", "src/main.py": b"committed work", "src/lib/util.py": b"more"}
    root, reached = tree_of(company.pk, files)
    ExecutionWorkspaceFactory(company=company, head_tree=root)
    top = trees.decode_dir(
        cas_load_many(company_id=company.pk, digests=[root], max_bytes=1 << 20)[root], ""
    )
    src = next(e.digest for e in top if e.name == "src")
    assert src is not None
    garbage = store(company.pk, b"garbage")
    age(*reached, garbage)
    if damage == "damaged":
        _damage(company.pk, src)
    else:
        CasBlob.objects.filter(company_id=company.pk, digest=src).delete()
    reads._directories = reads._DirectoryCache()  # a fresh worker process: nothing cached
    out = StringIO()
    call_command("cas_collect", stdout=out)
    assert all(kept(company.pk, n)["row"] for n in reached if n != src)
    assert kept(company.pk, garbage)["row"]  # nothing deleted for the company
    assert f"company {company.pk}: skipped, nothing deleted" in out.getvalue()
    assert f"{src}: unreadable" in out.getvalue()


class _Killed(BaseException):
    """The collector's process dying (SIGKILL, the database lost at its commit)."""


@pytest.mark.django_db(transaction=True)
def test_a_collection_killed_after_the_bytes_leaves_rows_nothing_can_rely_on(
    company: Company, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between removing a batch's bytes and its commit, a collection left its rows,
    old and unreachable, without bytes; find-missing (on s3) and a registration's pin looked
    at rows alone, so a run could register and publish a tree naming such a blob, whose bytes
    were gone for good. The rows are marked doomed (committed) before the bytes go: doomed is
    missing to both, an upload restores the blob, and the next collection finishes the rest."""
    kept_blob, lost_blob = store(company.pk, b"uploaded again"), store(company.pk, b"nobody")
    age(kept_blob, lost_blob)
    real = FilesystemBackend.delete_many

    def removed_then_killed(self: FilesystemBackend, *, company_id: UUID, digests: Any) -> None:
        real(self, company_id=company_id, digests=digests)
        raise _Killed

    with monkeypatch.context() as patched:
        patched.setattr(FilesystemBackend, "delete_many", removed_then_killed)
        with pytest.raises(_Killed):
            cas_collect(batch_size=10)
    assert cas_find_missing(company_id=company.pk, digests=[kept_blob]) == [kept_blob]
    with transaction.atomic():
        assert cas_pin(company_id=company.pk, digests=[kept_blob]).missing == [kept_blob]
    assert CasBlob.objects.filter(company=company, doomed=True).count() == 2
    store(company.pk, b"uploaded again")  # what snapshot_blobs_missing makes the agent do
    row = CasBlob.objects.get(company=company, digest=kept_blob)
    assert not row.doomed
    assert cas_load_many(company_id=company.pk, digests=[kept_blob], max_bytes=1 << 20) == {
        kept_blob: b"uploaded again"
    }
    assert cas_collect(batch_size=10).deleted == 1  # the doomed one nobody uploaded
    assert kept(company.pk, lost_blob) == NOTHING
    assert kept(company.pk, kept_blob)["row"]


@pytest.mark.django_db(transaction=True)
def test_a_reference_registered_after_the_reachability_pass_wins(company: Company) -> None:
    """The forced race: the collector's reachability pass sees the blob unreferenced; before
    its DELETE, another connection pins the blob (as snapshot registration does) and
    commits; the DELETE re-checks the age on the row, so the blob survives, bytes and all."""
    blob = store(company.pk, b"about to be referenced")
    age(blob)
    reached = threading.Event()
    registered = threading.Event()
    errors: list[BaseException] = []

    def pause(step: CollectProgress) -> None:
        if step.phase == "reached":
            assert step.candidates == 1
            reached.set()
            assert registered.wait(timeout=10)

    def register() -> None:
        try:
            assert reached.wait(timeout=10)
            with transaction.atomic(durable=True):
                assert cas_pin(company_id=company.pk, digests=[blob]).missing == []
        except BaseException as exc:
            errors.append(exc)
        finally:
            registered.set()
            connection.close()

    thread = threading.Thread(target=register)
    thread.start()
    summary = cas_collect(batch_size=10, progress=pause)
    thread.join(timeout=10)
    assert errors == []
    assert summary.candidates == 1
    assert summary.deleted == 0
    assert kept(company.pk, blob)["row"]
    with raw_connection() as observer:
        row = observer.execute(
            "SELECT referenced_at > now() - interval '1 minute' FROM cas_blobs WHERE digest = %s",
            [blob],
        ).fetchone()
    assert row == (True,)
    assert b"".join(_read(company.pk, blob)) == b"about to be referenced"


def _read(company_id: UUID, name: str) -> Any:
    from paperclip.snapshots.store.reads import cas_open

    reader = cas_open(company_id=company_id, digest=name)
    assert reader is not None
    return reader.chunks


@pytest.mark.django_db(transaction=True)
def test_an_upload_while_the_collector_holds_the_row_recreates_it_with_bytes(
    company: Company,
) -> None:
    """An upload of a blob the collector is deleting waits for it, then stores the blob
    afresh: the row it commits has its bytes."""
    data = b"collected and uploaded again"
    blob = store(company.pk, data)
    age(blob)
    reached = threading.Event()
    uploaded = threading.Event()
    results: list[Any] = []

    def pause(step: CollectProgress) -> None:
        if step.phase == "reached":
            reached.set()

    def upload() -> None:
        try:
            assert reached.wait(timeout=10)
            results.append(
                cas_put(company_id=company.pk, digest=blob, stream=BytesIO(data), length=len(data))
            )
        except BaseException as exc:
            results.append(exc)
        finally:
            uploaded.set()
            connection.close()

    thread = threading.Thread(target=upload)
    thread.start()
    cas_collect(batch_size=10, progress=pause)
    thread.join(timeout=10)
    assert len(results) == 1
    assert not isinstance(results[0], BaseException), results
    # Whichever came first, the blob is there with its bytes.
    assert kept(company.pk, blob)["row"]
    assert b"".join(_read(company.pk, blob)) == data


@pytest.mark.django_db(transaction=True)
def test_a_pin_answers_the_missing_names_sorted_and_touches_only_old_rows(company: Company) -> None:
    young, old_one = store(company.pk, b"young"), store(company.pk, b"old")
    other = CompanyFactory()
    elsewhere = store(other.pk, b"another company's")
    age(old_one)
    before = dict(CasBlob.objects.filter(company=company).values_list("digest", "referenced_at"))
    absent = sorted(name_of(bytes([i])) for i in range(3))
    with transaction.atomic():
        missing = cas_pin(
            company_id=company.pk, digests=[absent[2], young, elsewhere, old_one, *absent, young]
        ).missing
    assert missing == sorted([*absent, elsewhere])
    after = dict(CasBlob.objects.filter(company=company).values_list("digest", "referenced_at"))
    assert after[young] == before[young]  # young: only read
    assert after[old_one] > before[old_one]  # old: touched, safe from the collector again


def _pin_behind(company: Company, blob: str, holder_sql: str) -> list[str]:
    """`cas_pin` of `blob` (an old row) while another transaction, `holder_sql` on the row,
    holds its lock: the pin is seen queued behind it, then the holder commits."""
    results: list[Any] = []

    def pin() -> None:
        try:
            with transaction.atomic():
                results.append(cas_pin(company_id=company.pk, digests=[blob]).missing)
        except BaseException as exc:
            results.append(exc)
        finally:
            connection.close()

    with raw_connection(autocommit=False) as holder:
        holder.execute(holder_sql, [str(company.pk), blob])
        thread = threading.Thread(target=pin)
        thread.start()
        assert wait_for_lock_waiters(holder=holder, table="cas_blobs")
        holder.commit()
    thread.join(timeout=10)
    assert len(results) == 1, results
    assert not isinstance(results[0], BaseException), results
    missing: list[str] = results[0]
    return missing


@pytest.mark.django_db(transaction=True)
def test_a_pin_queued_behind_a_collection_that_deletes_the_row_answers_it_missing(
    company: Company,
) -> None:
    """The race: the pin's statement saw the old row, then waited for the collector's lock
    on it; the collector committed the delete. The name must come back missing (the CLI then
    uploads it again), never held: a snapshot must not reference a collected blob."""
    blob = store(company.pk, b"being collected")
    age(blob)
    deleting = (  # as the collector deletes: the row, and the postgres backend's bytes
        "WITH gone AS (DELETE FROM cas_blobs WHERE company_id = %s AND digest = %s RETURNING id)"
        " DELETE FROM cas_blob_chunks WHERE blob_id IN (SELECT id FROM gone)"
    )
    assert _pin_behind(company, blob, deleting) == [blob]


@pytest.mark.django_db(transaction=True)
def test_a_pin_queued_behind_another_reference_answers_it_held(company: Company) -> None:
    """The same race with a reference (an upload, another registration) that made the row
    young meanwhile: the blob is held, and safe from the collector."""
    blob = store(company.pk, b"referenced meanwhile")
    age(blob)
    touching = "UPDATE cas_blobs SET referenced_at = now() WHERE company_id = %s AND digest = %s"
    assert _pin_behind(company, blob, touching) == []
