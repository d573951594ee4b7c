"""`manage.py cas_migrate`: every blob copied to another backend and verified, bad source
bytes reported and not copied, bad input refused before anything, a killed run resumed, the
collector and uploads beside a copy (docs/snapshots.md#moving-the-store-to-another-backend)."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from io import BytesIO, StringIO
from pathlib import Path
from typing import Any
from uuid import UUID

import obstore
import pytest
from django.conf import settings as django_settings
from django.core.management import CommandError, call_command
from django.db import connection

from paperclip.models import CasBlob, CasBlobChunk
from paperclip.snapshots.collect import cas_collect
from paperclip.snapshots.store.backends import FilesystemBackend, PostgresBackend, blob_path
from paperclip.snapshots.store.names import CHUNK_BYTES, BlobStoreUnavailable
from paperclip.snapshots.store.reads import cas_open
from paperclip.snapshots.store.s3 import MULTIPART_BYTES, S3Backend
from paperclip.snapshots.store.uploads import cas_put
from tests.conftest import s3_settings
from tests.paperclip.factories import CompanyFactory
from tests.paperclip.snapshots.helpers import NOTHING, kept, name_of, s3_object_exists
from tests.support.processes import child_env

PAIRS = [
    ("filesystem", "postgres"),
    ("postgres", "filesystem"),
    ("filesystem", "s3"),
    ("s3", "postgres"),
    ("postgres", "s3"),
    ("s3", "filesystem"),
]
OTHER = {"filesystem": "postgres", "postgres": "s3", "s3": "filesystem"}


def configure(
    request: pytest.FixtureRequest, settings: Any, monkeypatch: pytest.MonkeyPatch, *names: str
) -> None:
    """Every store of `names` usable (s3: the session's rclone server, a prefix of the test's
    own), the first one in use."""
    if "s3" in names:
        s3_settings(settings, monkeypatch, request.getfixturevalue("s3_server"))
        settings.PAPERCLIP_CAS_S3_REDIRECT = False
    settings.PAPERCLIP_CAS_BACKEND = names[0]


@pytest.fixture(params=PAIRS, ids="->".join)
def move(
    request: pytest.FixtureRequest, settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, str]:
    """(source in use, target)."""
    settings.PAPERCLIP_CAS_DIR = tmp_path / "cas"
    configure(request, settings, monkeypatch, *request.param)
    return request.param


@pytest.fixture(params=["filesystem", "postgres", "s3"])
def source(
    request: pytest.FixtureRequest, settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    settings.PAPERCLIP_CAS_DIR = tmp_path / "cas"
    configure(request, settings, monkeypatch, request.param, OTHER[request.param])
    return str(request.param)


def backend_class(name: str) -> type[Any]:
    return {"filesystem": FilesystemBackend, "postgres": PostgresBackend, "s3": S3Backend}[name]


def store(company_id: UUID, data: bytes) -> str:
    name = name_of(data)
    cas_put(company_id=company_id, digest=name, stream=BytesIO(data), length=len(data))
    return name


def migrate(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("cas_migrate", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def read(company_id: UUID, name: str) -> bytes | None:
    blob = cas_open(company_id=company_id, digest=name)
    return None if blob is None else b"".join(blob.chunks)


def in_target(target: str, company_id: UUID, name: str) -> bool:
    """Whether the target backend holds bytes of the blob (whatever they are)."""
    if target == "postgres":
        return CasBlobChunk.objects.filter(blob__company_id=company_id, blob__digest=name).exists()
    if target == "s3":
        return s3_object_exists(company_id, name)
    return blob_path(company_id, name).exists()


@pytest.mark.django_db
def test_every_blob_of_every_company_is_copied_and_reads_back_from_the_target(
    move: tuple[str, str], settings: Any
) -> None:
    source, target = move
    first, second = CompanyFactory(), CompanyFactory()
    big = os.urandom(2 * CHUNK_BYTES + 12345)  # three pieces in postgres
    contents = {
        first.pk: [b"", b"alpha", big, b"shared bytes"],
        second.pk: [b"shared bytes", b"beta" * 1000],
    }
    names = {c: [store(c, data) for data in blobs] for c, blobs in contents.items()}

    # The empty blob has no pieces in postgres: there it is present from the start.
    copied, present = (5, 1) if target == "postgres" else (6, 0)

    out, err = migrate("--to", target, "--batch-size", "2")

    assert f"done: copied {copied} blob(s)" in out
    assert f"{present} already there, 0 gone (collected meanwhile), 0 not copied" in out
    assert f"set PAPERCLIP_CAS_BACKEND={target}" in out
    assert f"PAPERCLIP_CAS_BACKEND={source} manage.py cas_migrate --to {target}" in out
    lines = err.splitlines()
    assert [line.split(":")[0] for line in lines] == ["batch 1", "batch 2", "batch 3"]
    assert lines[-1].startswith("batch 3: 6/6 blobs, ")
    assert " MiB/s, ETA " in lines[-1]
    assert source == settings.PAPERCLIP_CAS_BACKEND  # switches nothing
    settings.PAPERCLIP_CAS_BACKEND = target
    for company_id, blobs in contents.items():
        for name, data in zip(names[company_id], blobs, strict=True):
            assert read(company_id, name) == data
    if target == "postgres":
        assert CasBlobChunk.objects.filter(blob__digest=name_of(big)).count() == 3
    settings.PAPERCLIP_CAS_BACKEND = source  # the source keeps its copy
    assert read(first.pk, name_of(big)) == big

    again, _ = migrate("--to", target)

    assert "done: copied 0 blob(s), 0.0 MiB" in again
    assert "6 already there" in again


@pytest.mark.django_db
def test_a_dry_run_counts_what_the_target_lacks_and_copies_nothing(move: tuple[str, str]) -> None:
    _, target = move
    company = CompanyFactory()
    names = [store(company.pk, data) for data in (b"one", b"two")]

    out, _ = migrate("--to", target, "--dry-run")

    assert "done: would copy 2 blob(s)" in out
    assert not any(in_target(target, company.pk, name) for name in names)


def _spoil(backend: str, company_id: UUID, name: str, data: bytes | None) -> None:
    """Replace the source's bytes of `name` with `data`, or remove them (None)."""
    if backend == "filesystem":
        path = blob_path(company_id, name)
        if data is None:
            path.unlink()
        else:
            path.write_bytes(data)
        return
    if backend == "s3":
        s3 = S3Backend()
        key = s3.key(company_id, name)
        if data is None:
            obstore.delete(s3.store, key)
        else:
            obstore.put(s3.store, key, data)
        return
    chunks = CasBlobChunk.objects.filter(blob__company_id=company_id, blob__digest=name)
    if data is None:
        chunks.delete()
    else:
        chunks.update(data=data)


@pytest.mark.django_db
def test_source_bytes_that_are_not_the_blob_are_reported_and_never_copied(
    move: tuple[str, str],
) -> None:
    source, target = move
    company = CompanyFactory()
    good, corrupt, short, missing = (
        store(company.pk, data) for data in (b"good", b"corrupt", b"short one", b"missing")
    )
    _spoil(source, company.pk, corrupt, b"CORRUPT")  # same size, other bytes
    _spoil(source, company.pk, short, b"short")
    _spoil(source, company.pk, missing, None)
    out = StringIO()

    with pytest.raises(CommandError, match=r"3 blob\(s\) not copied"):
        call_command("cas_migrate", "--to", target, stdout=out, stderr=StringIO())

    text = out.getvalue()
    assert "done: copied 1 blob(s)" in text
    assert "3 not copied" in text
    expected = {
        corrupt: f"its 7 bytes (recorded 7) hash to {name_of(b'CORRUPT')}",
        short: f"its 5 bytes (recorded 9) hash to {name_of(b'short')}",
        missing: "missing from the source",
    }
    for name, reason in expected.items():
        assert f"not copied (unreadable): company {company.pk} blob {name}: {reason}" in text
        assert not in_target(target, company.pk, name)
    assert in_target(target, company.pk, good)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--to", "s4"], "--to must be one of filesystem, postgres, s3, not 's4'"),
        (["--to", "{source}"], "is the backend in use"),
        (["--to", "{target}", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["--to", "{target}", "--max-batch-mib", "0"], "--max-batch-mib must be at least 1"),
        (["--to", "{target}", "--jobs", "0"], "--jobs must be 1 to 64, not 0"),
        (["--to", "{target}", "--jobs", "65"], "--jobs must be 1 to 64, not 65"),
    ],
)
def test_bad_input_is_a_command_error_and_copies_nothing(
    source: str, args: list[str], message: str
) -> None:
    company = CompanyFactory()
    name = store(company.pk, b"untouched")
    filled = [a.format(source=source, target=OTHER[source]) for a in args]
    out = StringIO()

    with pytest.raises(CommandError, match=message):
        call_command("cas_migrate", *filled, stdout=out, stderr=StringIO())

    assert out.getvalue() == ""
    assert not in_target(OTHER[source], company.pk, name)


@pytest.mark.django_db
def test_an_s3_target_without_its_bucket_is_a_command_error_before_anything(
    settings: Any, tmp_path: Path
) -> None:
    settings.PAPERCLIP_CAS_BACKEND = "filesystem"
    settings.PAPERCLIP_CAS_DIR = tmp_path / "cas"
    settings.PAPERCLIP_CAS_S3_BUCKET = ""
    store(CompanyFactory().pk, b"untouched")
    out = StringIO()

    with pytest.raises(CommandError, match=r"--to s3: .*needs PAPERCLIP_CAS_S3_BUCKET"):
        call_command("cas_migrate", "--to", "s3", stdout=out, stderr=StringIO())

    assert out.getvalue() == ""


@pytest.mark.django_db
def test_an_s3_target_that_cannot_be_reached_stops_the_pass_with_nothing_copied(
    settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.PAPERCLIP_CAS_BACKEND = "filesystem"
    settings.PAPERCLIP_CAS_DIR = tmp_path / "cas"
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings.PAPERCLIP_CAS_S3_BUCKET = "nowhere"
    settings.PAPERCLIP_CAS_S3_ENDPOINT_URL = f"http://127.0.0.1:{port}"
    settings.PAPERCLIP_CAS_S3_CONNECT_TIMEOUT = 0.5
    settings.PAPERCLIP_CAS_S3_MAX_ATTEMPTS = 1
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    store(CompanyFactory().pk, b"untouched")

    with pytest.raises(CommandError, match=r"the target store cannot be reached \(stat: "):
        call_command("cas_migrate", "--to", "s3", stdout=StringIO(), stderr=StringIO())


@pytest.mark.django_db
def test_an_s3_target_lost_during_a_copy_is_said_unreachable_not_a_bad_blob(
    request: pytest.FixtureRequest, settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store answered the pass's first questions, then stopped answering during a copy:
    the message says the target cannot be reached (resume when it is back), where it said a
    blob "cannot be written", as if the target had stored it wrong."""
    settings.PAPERCLIP_CAS_DIR = tmp_path / "cas"
    configure(request, settings, monkeypatch, "filesystem", "s3")
    name = store(CompanyFactory().pk, b"copied while the store goes away")

    def gone(self: S3Backend, **_: Any) -> None:
        raise BlobStoreUnavailable(reason="upload: GenericError")

    monkeypatch.setattr(S3Backend, "put", gone)
    with pytest.raises(
        CommandError, match=r"the target store cannot be reached \(upload: GenericError\)"
    ):
        call_command("cas_migrate", "--to", "s3", stdout=StringIO(), stderr=StringIO())
    assert CasBlob.objects.get(digest=name).size == len(b"copied while the store goes away")


@pytest.mark.django_db
def test_a_blob_over_the_multipart_size_goes_to_s3_in_parts_and_comes_back(
    request: pytest.FixtureRequest, settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.PAPERCLIP_CAS_DIR = tmp_path / "cas"
    configure(request, settings, monkeypatch, "filesystem", "s3")
    company = CompanyFactory()
    big = os.urandom(MULTIPART_BYTES + CHUNK_BYTES + 7)
    name = store(company.pk, big)

    out, _ = migrate("--to", "s3")

    assert f"done: copied 1 blob(s), {len(big) / 2**20:.1f} MiB" in out
    settings.PAPERCLIP_CAS_BACKEND = "s3"
    assert read(company.pk, name) == big

    back, _ = migrate("--to", "postgres")

    assert "done: copied 1 blob(s)" in back
    assert CasBlobChunk.objects.filter(blob__digest=name).count() == -(-len(big) // CHUNK_BYTES)
    settings.PAPERCLIP_CAS_BACKEND = "postgres"
    assert read(company.pk, name) == big


@pytest.mark.django_db
def test_a_copy_that_does_not_read_back_stops_the_pass_and_keeps_nothing_of_it(
    move: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, target = move
    company = CompanyFactory()
    first, second = store(company.pk, b"first"), store(company.pk, b"second")
    target_class = backend_class(target)

    def garbled(self: Any, **kwargs: Any) -> Iterator[bytes]:
        return iter([b"not what was written"])

    monkeypatch.setattr(target_class, "get", garbled)

    with pytest.raises(CommandError, match=rf"the copy to {target} failed: .* {first}: read back"):
        call_command("cas_migrate", "--to", target, stdout=StringIO(), stderr=StringIO())

    assert not in_target(target, company.pk, first)
    assert not in_target(target, company.pk, second)  # the pass stopped at the first


@pytest.mark.django_db(transaction=True)
def test_the_collector_skips_a_blob_being_copied_and_uploads_do_not_wait_for_it(
    move: tuple[str, str], settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, target = move
    settings.PAPERCLIP_CAS_GRACE_SECONDS = 0  # every committed blob is old: no root keeps any
    company = CompanyFactory()
    held, collected = store(company.pk, b"held"), store(company.pk, b"collected")
    target_class = backend_class(target)
    entered, release = threading.Event(), threading.Event()
    real_put = target_class.put

    def paused_put(self: Any, **kwargs: Any) -> None:
        if kwargs["digest"] == held:
            entered.set()
            release.wait(20)
        real_put(self, **kwargs)

    monkeypatch.setattr(target_class, "put", paused_put)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            # One copy at a time: `collected` must still be waiting while `held` is paused.
            outcome["out"], _ = migrate("--to", target, "--jobs", "1")
        except BaseException as exc:  # reported to the test below
            outcome["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert entered.wait(20)
        summary = cas_collect(batch_size=10)  # holds nothing while the copy is paused
        started = time.monotonic()
        cas_put(company_id=company.pk, digest=held, stream=BytesIO(b"held"), length=4)
        waited = time.monotonic() - started
    finally:
        release.set()
        thread.join(30)

    assert "error" not in outcome, outcome.get("error")
    assert summary.deleted == 1  # `collected` only: the row being copied was skipped
    assert waited < 2  # the upload's upsert does not wait for the copy's row lock
    assert kept(company.pk, collected) == NOTHING
    assert "done: copied 1 blob(s)" in outcome["out"]
    assert "1 gone (collected meanwhile)" in outcome["out"]
    assert in_target(target, company.pk, held)
    assert not in_target(target, company.pk, collected)  # never re-created

    cas_collect(batch_size=10)  # later, the held blob goes from both backends

    assert kept(company.pk, held) == NOTHING
    assert not in_target(target, company.pk, held)  # s3 too: its bucket is configured


def _seed(company_id: UUID, count: int) -> None:
    """`count` distinct blobs of about 2 KiB in the filesystem store, written directly (the
    upload path's fsync per blob would make this the slowest part of the test)."""
    rows = []
    for index in range(count):
        data = index.to_bytes(4, "big") * 512
        name = name_of(data)
        path = blob_path(company_id, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        rows.append(CasBlob(company_id=company_id, digest=name, size=len(data)))
    CasBlob.objects.bulk_create(rows)


def _verified_in(target: str) -> int:
    """How many blobs the target holds whole and right (hashed)."""
    if target == "postgres":
        with connection.cursor() as cursor:
            cursor.execute(VERIFIED_IN_POSTGRES)
            return int(cursor.fetchone()[0])
    backend = S3Backend()
    rows: dict[Any, dict[str, tuple[int, int]]] = {}
    for blob in CasBlob.objects.order_by("pk"):
        rows.setdefault(blob.company_id, {})[blob.digest] = (blob.pk, blob.size)
    right = 0
    for company_id, named in rows.items():  # several reads in flight (get_many), not one by one
        found = backend.get_many(company_id=company_id, rows=named)
        right += sum(name_of(data) == digest for digest, data in found.items())
    return right


DEFAULT_SIGINT_THEN_EXEC = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)

VERIFIED_IN_POSTGRES = """
    SELECT count(*) FROM cas_blobs b
    WHERE 'sha256:' || encode(sha256(coalesce(
        (SELECT string_agg(c.data, ''::bytea ORDER BY c.seq)
         FROM cas_blob_chunks c WHERE c.blob_id = b.id), ''::bytea)), 'hex') = b.digest
"""


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("target", "stop", "total"),
    [
        ("postgres", signal.SIGKILL, 200),
        ("postgres", signal.SIGINT, 200),
        ("s3", signal.SIGKILL, 200),
    ],
    ids=["postgres-kill", "postgres-ctrl-c", "s3-kill"],
)
def test_a_run_stopped_part_way_resumes_and_copies_only_the_rest(
    request: pytest.FixtureRequest,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    target: str,
    stop: signal.Signals,
    total: int,
) -> None:
    settings.PAPERCLIP_CAS_DIR = tmp_path / "cas"
    configure(request, settings, monkeypatch, "filesystem", target)
    _seed(CompanyFactory().pk, total)
    env = {
        "PAPERCLIP_CAS_BACKEND": "filesystem",
        "PAPERCLIP_CAS_DIR": str(tmp_path / "cas"),
        **(
            {
                "PAPERCLIP_CAS_S3_BUCKET": settings.PAPERCLIP_CAS_S3_BUCKET,
                "PAPERCLIP_CAS_S3_PREFIX": settings.PAPERCLIP_CAS_S3_PREFIX,
                "PAPERCLIP_CAS_S3_ENDPOINT_URL": settings.PAPERCLIP_CAS_S3_ENDPOINT_URL,
            }
            if target == "s3"
            else {}
        ),
    }
    # The race is forced, not hoped for: the command's progress goes into a pipe of one page
    # (some 39 of its lines of about 105 bytes), so when this test reads its fifth line the
    # command is at most two pipes ahead (what this test's reader took in one read, and a
    # pipe more): about 83 batches of 2 blobs, short of the 100 batches of the whole, however
    # loaded the machine.
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    # The command starts with SIGINT's default disposition whatever this process has: an
    # ignored SIGINT is inherited across exec (a suite started in the background of a
    # non-interactive shell has it so), and Ctrl-C then did nothing: exit 0, twice.
    command = ["manage.py", "cas_migrate", "--to", target, "--batch-size", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-c", DEFAULT_SIGINT_THEN_EXEC, sys.executable, *command],
        cwd=django_settings.BASE_DIR,
        env=child_env(**env),  # the AWS_* credentials: in os.environ (monkeypatched)
        stdout=(tmp_path / "stdout").open("wb"),
        stderr=write_end,
        start_new_session=True,
    )
    os.close(write_end)
    stderr = os.fdopen(read_end, "r")
    lines: list[str] = []
    try:
        for line in stderr:
            if line.startswith("batch 5: "):
                os.killpg(proc.pid, stop)
                lines = stderr.readlines()  # to its end: the process is gone
                break
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        stderr.close()
    if stop == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 1, (
            lines,
            (tmp_path / "stdout").read_text(),
            signal.getsignal(signal.SIGINT),
        )
        assert any(
            "interrupted after copying" in line and "run the command again" in line
            for line in lines
        ), lines
    copied_before = _verified_in(target)
    assert 10 <= copied_before < total  # stopped part way, after five batches

    out, _ = migrate("--to", target, "--batch-size", "500")

    assert f"done: copied {total - copied_before} blob(s)" in out
    assert f"{copied_before} already there, 0 gone" in out
    assert _verified_in(target) == total
