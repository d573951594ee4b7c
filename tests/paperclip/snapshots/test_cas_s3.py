"""The s3 backend against a real S3 server of its own (`rclone serve s3`, tests/support/s3.py),
with failures injected: the server killed mid-upload, objects deleted or corrupted behind the
plane's back, a server that stops answering; and the redirect to a pre-signed URL
(docs/snapshots.md#object-storage)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import obstore
import obstore.exceptions
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models.functions import Now
from rest_framework.test import APIClient

from paperclip.models import Agent, CasBlob, ExecutionWorkspace
from paperclip.snapshots.collect import cas_collect
from paperclip.snapshots.head import workspace_materialize
from paperclip.snapshots.history import head_move_record_in_tx
from paperclip.snapshots.store import s3 as s3_module
from paperclip.snapshots.store.backends import blob_backend
from paperclip.snapshots.store.names import BlobStoreUnavailable, BlobUnreadable
from paperclip.snapshots.store.s3 import PART_BYTES, WHOLE_READ_BYTES, S3Backend
from tests.conftest import s3_settings
from tests.helpers import assert_error
from tests.paperclip.factories import AgentFactory, ExecutionWorkspaceFactory
from tests.paperclip.snapshots.helpers import kept, name_of
from tests.recovery.snapshots import store_tree
from tests.support.processes import child_env
from tests.support.s3 import S3Server

pytestmark = pytest.mark.django_db
OCTETS = "application/octet-stream"


@pytest.fixture
def s3(settings: Any, monkeypatch: pytest.MonkeyPatch, s3_own_server: S3Server) -> S3Server:
    """The store on a server of this test's own, with short timeouts (a stopped server is
    given up on in about 2 x (1 + 1) s) and the redirect off unless a test turns it on."""
    s3_settings(settings, monkeypatch, s3_own_server)
    settings.PAPERCLIP_CAS_S3_CONNECT_TIMEOUT = 1.0
    settings.PAPERCLIP_CAS_S3_READ_TIMEOUT = 1.0
    settings.PAPERCLIP_CAS_S3_MAX_ATTEMPTS = 2
    settings.PAPERCLIP_CAS_S3_REDIRECT = False
    return s3_own_server


def put(client: APIClient, data: bytes) -> Any:
    return client.put(f"/api/cas/blobs/{name_of(data)}", data, content_type=OCTETS)


def object_file(server: S3Server, company_id: Any, data: bytes) -> Path:
    return server.object_path(S3Backend().key(company_id, name_of(data)))


def test_a_server_killed_mid_upload_keeps_nothing_and_the_retry_succeeds(
    s3: S3Server,
    agent_client: APIClient,
    agent: Agent,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = os.urandom(20 * 1024 * 1024 + 5)  # a multipart upload: 3 parts
    parts: list[int] = []
    read = s3_module._RegionFile.read

    def kill_at_the_second_part(self: Any, size: int | None = -1) -> bytes:
        # The upload reads each part from the spool as it sends it.
        if self.size > PART_BYTES and self.at >= PART_BYTES and not parts:
            parts.append(self.at)
            s3.kill()
        return read(self, size)

    monkeypatch.setattr(s3_module._RegionFile, "read", kill_at_the_second_part)
    response = put(agent_client, data)  # the hook kills once: the retry below is spared
    assert_error(response, 503, "blob_store_unavailable")
    assert response["Retry-After"] == "5"
    assert parts == [PART_BYTES]
    assert not CasBlob.objects.filter(company_id=agent.company_id).exists()

    s3.start()
    settings.PAPERCLIP_CAS_S3_READ_TIMEOUT = 30.0  # the retry: not about a slow answer
    assert kept(agent.company_id, name_of(data)) == {"row": False, "chunks": False, "file": False}
    assert agent_client.post(
        "/api/cas/find-missing", {"digests": [name_of(data)]}, format="json"
    ).json() == {"missing": [name_of(data)]}
    again = put(agent_client, data)
    assert again.status_code == 201, again.content
    got = agent_client.get(f"/api/cas/blobs/{name_of(data)}")
    assert got.status_code == 200
    assert hashlib.sha256(b"".join(got.streaming_content)).hexdigest() == name_of(data)[7:]


def test_an_object_deleted_behind_the_plane_is_422_never_bytes(
    s3: S3Server, agent_client: APIClient, agent: Agent
) -> None:
    data = b"a small blob\n"
    assert put(agent_client, data).status_code == 201
    object_file(s3, agent.company_id, data).unlink()
    response = agent_client.get(f"/api/cas/blobs/{name_of(data)}")
    assert_error(response, 422, "blob_unreadable")
    assert response.json()["error"]["details"] == {"digest": name_of(data), "reason": "missing"}
    # Uploading it again writes its bytes anew (the upload checks an existing row's object).
    assert put(agent_client, data).status_code == 200
    assert b"".join(agent_client.get(f"/api/cas/blobs/{name_of(data)}").streaming_content) == data


@pytest.mark.parametrize(
    "damage",
    [b"the WRONG bytes\n", b"the right bytes\n" * 600_000],  # the same size; 9.6 MB
    ids=["same-size", "grown"],
)
def test_a_corrupted_small_object_is_422_before_any_byte(
    s3: S3Server, agent_client: APIClient, agent: Agent, damage: bytes
) -> None:
    data = b"the right bytes\n"
    assert put(agent_client, data).status_code == 201
    object_file(s3, agent.company_id, data).write_bytes(damage)
    response = agent_client.get(f"/api/cas/blobs/{name_of(data)}")
    assert_error(response, 422, "blob_unreadable")
    assert response.json()["error"]["details"]["reason"] == "digest_mismatch"


def test_an_object_grown_behind_the_plane_is_never_read_whole(
    s3: S3Server, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object grown behind the plane's back (9 MiB for a blob of 16 bytes): a read gives
    one byte more than the blob (enough for the verification to name it), a batch read
    leaves it out without reading its body at all."""
    data = b"small and right\n"
    store_tree(agent.company_id, {"a.txt": data})
    object_file(s3, agent.company_id, data).write_bytes(os.urandom(9 * 1024 * 1024))
    bodies: list[str] = []

    class Watched:
        """The store's answer, its body's reads recorded."""

        def __init__(self, answer: Any) -> None:
            self.answer, self.meta = answer, answer.meta

        def __getattr__(self, name: str) -> Any:
            bodies.append(name)  # bytes, bytes_async, stream: the body read
            return getattr(self.answer, name)

    get, get_async = obstore.get, obstore.get_async

    async def watched_async(*args: Any, **kwargs: Any) -> Watched:
        return Watched(await get_async(*args, **kwargs))

    monkeypatch.setattr(obstore, "get", lambda *args, **kwargs: Watched(get(*args, **kwargs)))
    monkeypatch.setattr(obstore, "get_async", watched_async)
    backend = S3Backend()
    rows = {name_of(data): (0, len(data))}
    chunks = backend.get(blob_id=0, company_id=agent.company_id, digest=name_of(data), size=16)
    assert len(b"".join(chunks)) == 17
    assert bodies == ["stream"]
    assert backend.get_many(company_id=agent.company_id, rows=rows) == {}
    assert bodies == ["stream"]
    intact = b"intact\n"  # the watch sees a body that is read
    store_tree(agent.company_id, {"b.txt": intact})
    assert backend.get_many(company_id=agent.company_id, rows={name_of(intact): (0, 7)}) == {
        name_of(intact): intact
    }
    assert bodies == ["stream", "bytes_async"]


@pytest.mark.parametrize("size", [3 * 1024 * 1024, WHOLE_READ_BYTES + 1024 * 1024])
def test_a_corrupted_large_object_is_cut_short_never_served_whole(
    s3: S3Server, agent_client: APIClient, agent: Agent, size: int
) -> None:
    """Read whole (3 MiB) or through a temporary file (9 MiB): the same verified stream."""
    data = os.urandom(size)
    assert put(agent_client, data).status_code == 201
    damaged = bytearray(data)
    damaged[-1] ^= 0xFF  # only the very end differs
    object_file(s3, agent.company_id, data).write_bytes(bytes(damaged))
    response = agent_client.get(f"/api/cas/blobs/{name_of(data)}")
    assert response.status_code == 200
    assert response["Content-Length"] == str(len(data))
    received = bytearray()

    def read_all() -> None:
        for piece in response.streaming_content:
            received.extend(piece)

    with pytest.raises(BlobUnreadable):
        read_all()
    assert len(received) < len(data)
    assert bytes(received) == data[: len(received)]


def test_a_slow_reader_of_a_large_object_outlasts_the_store_timeout(
    s3: S3Server, agent_client: APIClient, agent: Agent, settings: Any
) -> None:
    """The store's timeout covers a request's whole answer (1 s here): a large object is read
    into a temporary file at the store's pace, so a reader slower than that still gets all
    of it. Streamed straight from the store's answer instead, the stream was cut (more than
    the sockets' buffers hold was still unsent when the timeout struck)."""
    data = os.urandom(16 * 1024 * 1024)
    assert put(agent_client, data).status_code == 201
    response = agent_client.get(f"/api/cas/blobs/{name_of(data)}")
    assert response.status_code == 200
    received = bytearray()
    began = time.monotonic()
    for piece in response.streaming_content:
        received.extend(piece)
        time.sleep(len(piece) / (64 * 1024) * 0.01)  # 10 ms per 64 KiB: about 2.6 s in all
    assert time.monotonic() - began > 2 * settings.PAPERCLIP_CAS_S3_READ_TIMEOUT
    assert bytes(received) == data


def test_the_backends_batch_calls_work_from_inside_an_event_loop(
    s3: S3Server, agent: Agent
) -> None:
    """A synchronous caller on a thread that runs an event loop (an async worker calling a
    sync service): the batch runs its own loop on a helper thread instead of failing."""
    files = {"a.txt": b"first\n", "b.txt": b"second\n"}
    store_tree(agent.company_id, files)
    rows = {name_of(data): (0, len(data)) for data in files.values()}

    async def inside() -> dict[str, bytes]:
        return S3Backend().get_many(company_id=agent.company_id, rows=rows)

    assert asyncio.run(inside()) == {name_of(data): data for data in files.values()}


def test_the_materialization_refuses_a_corrupted_object(
    s3: S3Server, tmp_path: Path, agent: Agent
) -> None:
    company_id = agent.company_id
    workspace = ExecutionWorkspaceFactory(company=agent.company, cwd=str(tmp_path / "cwd"))
    files = {"ok.txt": b"fine\n", "bad.txt": b"will be damaged\n"}
    tree = store_tree(company_id, files)
    object_file(s3, company_id, b"will be damaged\n").write_bytes(b"WILL BE DAMAGED\n")
    ExecutionWorkspace.objects.filter(pk=workspace.pk).update(
        head_tree=tree, head_committed_at=Now()
    )
    outcome = workspace_materialize(workspace_id=workspace.pk)
    assert outcome.status == "failed"
    assert outcome.error is not None
    assert "blob_unreadable" in outcome.error
    assert name_of(b"will be damaged\n") in outcome.error
    assert not (tmp_path / "cwd" / "bad.txt").exists()


def test_the_materialization_reads_small_blobs_ahead_a_window_at_a_time(
    s3: S3Server, tmp_path: Path, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """150 small files: a few `get_many` windows, not a request after the other; a damaged
    one among them is still refused (the window leaves it out, the ordinary read names it)."""
    company_id = agent.company_id
    files = {f"d{i % 3}/f{i:03}.txt": f"file {i}\n".encode() for i in range(150)}
    tree = store_tree(company_id, files)
    windows: list[int] = []
    many = S3Backend.get_many

    def counted(self: S3Backend, *, company_id: Any, rows: Any) -> dict[str, bytes]:
        windows.append(len(rows))
        return many(self, company_id=company_id, rows=rows)

    monkeypatch.setattr(S3Backend, "get_many", counted)
    workspace = ExecutionWorkspaceFactory(company=agent.company, cwd=str(tmp_path / "cwd"))
    ExecutionWorkspace.objects.filter(pk=workspace.pk).update(
        head_tree=tree, head_committed_at=Now()
    )
    assert workspace_materialize(workspace_id=workspace.pk).status == "materialized"
    for path, data in files.items():
        assert (tmp_path / "cwd" / path).read_bytes() == data
    file_windows = [n for n in windows if n > 4]  # the tree walk's levels are 1 and 3 blobs
    assert sum(file_windows) == 150
    assert len(file_windows) == 3  # 64 + 64 + 22

    damaged = b"file 77\n"
    object_file(s3, company_id, damaged).write_bytes(b"FILE 77\n")
    again = ExecutionWorkspaceFactory(company=agent.company, cwd=str(tmp_path / "again"))
    ExecutionWorkspace.objects.filter(pk=again.pk).update(head_tree=tree, head_committed_at=Now())
    outcome = workspace_materialize(workspace_id=again.pk)
    assert outcome.status == "failed"
    assert outcome.error is not None
    assert name_of(damaged) in outcome.error
    assert not (tmp_path / "again" / "d2" / "f077.txt").exists()


@pytest.fixture
def paused(s3: S3Server) -> Iterator[S3Server]:
    s3.pause()
    try:
        yield s3
    finally:
        s3.resume()


def test_a_stopped_server_is_503_with_retry_after_within_the_timeout(
    s3: S3Server, agent_client: APIClient, agent: Agent, request: pytest.FixtureRequest
) -> None:
    stored = b"stored before the server stopped\n"
    assert put(agent_client, stored).status_code == 201
    request.getfixturevalue("paused")
    for call in (
        lambda: agent_client.get(f"/api/cas/blobs/{name_of(stored)}"),
        lambda: put(agent_client, b"a new blob\n"),
        lambda: agent_client.post(
            "/api/cas/batch",  # two new blobs: their PUTs in flight together (put_many)
            f"{name_of(b'x')} 1\nx{name_of(b'y')} 1\ny".encode(),
            content_type=OCTETS,
        ),
    ):
        began = time.monotonic()
        response = call()
        # Nominally about 6 s: 2 attempts of a 1 s read with back-off, then the failed
        # upload's cleanup (one delete, the same); far under the defaults' 3 x 30 s (90 s and
        # more). The margin is for a loaded 2-core machine (20 s was passed once, at load 6).
        assert time.monotonic() - began < 35
        assert_error(response, 503, "blob_store_unavailable")
        assert response["Retry-After"] == "5"
    assert not CasBlob.objects.filter(company_id=agent.company_id, size__lt=5).exists()


def test_the_blob_get_redirects_to_a_presigned_url_only_for_the_own_company(
    s3: S3Server,
    settings: Any,
    agent_client: APIClient,
    other_company: Any,
    make_agent_client: Any,
) -> None:
    other_agent_client = make_agent_client(AgentFactory(company=other_company))
    settings.PAPERCLIP_CAS_S3_REDIRECT = True
    data = b"fetched from the bucket directly\n"
    assert put(agent_client, data).status_code == 201
    # Below PAPERCLIP_CAS_S3_REDIRECT_MIN_BYTES (1 MiB) the web node answers: one round trip.
    direct = agent_client.get(f"/api/cas/blobs/{name_of(data)}")
    assert direct.status_code == 200
    assert b"".join(direct.streaming_content) == data
    settings.PAPERCLIP_CAS_S3_REDIRECT_MIN_BYTES = 0
    response = agent_client.get(f"/api/cas/blobs/{name_of(data)}")
    assert response.status_code == 307
    location = response["Location"]
    assert location.startswith(s3.endpoint)
    assert "X-Amz-Signature=" in location
    assert "X-Amz-Expires=300" in location
    with urllib.request.urlopen(location, timeout=5) as fetched:  # noqa: S310 - the test server
        assert fetched.read() == data
    # Another company's agent learns nothing: 404, no URL.
    assert_error(other_agent_client.get(f"/api/cas/blobs/{name_of(data)}"), 404, "not_found")


def test_a_lost_or_resized_object_is_422_not_a_redirect_to_nothing(
    s3: S3Server, settings: Any, agent_client: APIClient, agent: Agent
) -> None:
    """The redirect is answered only for an object the store holds at the blob's size: a
    redirect to a lost object was answered 404 by the store, which the client took for an
    expired URL and asked again, never learning the blob was unreadable."""
    settings.PAPERCLIP_CAS_S3_REDIRECT = True
    settings.PAPERCLIP_CAS_S3_REDIRECT_MIN_BYTES = 0
    lost, resized = b"lost behind the plane's back\n", b"resized behind the plane's back\n"
    for data in (lost, resized):
        assert put(agent_client, data).status_code == 201
        assert agent_client.get(f"/api/cas/blobs/{name_of(data)}").status_code == 307
    object_file(s3, agent.company_id, lost).unlink()
    object_file(s3, agent.company_id, resized).write_bytes(resized + b"more")
    for data in (lost, resized):
        response = agent_client.get(f"/api/cas/blobs/{name_of(data)}")
        assert_error(response, 422, "blob_unreadable")
        assert response.json()["error"]["details"]["digest"] == name_of(data)


def test_the_files_endpoint_refuses_a_corrupted_file_and_a_stopped_store(
    s3: S3Server, company: Any, board_client: APIClient
) -> None:
    workspace = ExecutionWorkspaceFactory(company=company)
    tree = store_tree(company.pk, {"a.txt": b"the file\n"})
    with transaction.atomic():
        ExecutionWorkspace.objects.filter(pk=workspace.pk).update(head_tree=tree)
        head_move_record_in_tx(
            company_id=company.pk,
            workspace_id=workspace.pk,
            tree=tree,
            previous_tree=None,
            kind="publish",
            actor_type="system",
            actor_id="test",
        )
    url = f"/api/execution-workspaces/{workspace.pk}/files"
    good = board_client.get(url, {"tree": tree, "path": "a.txt"})
    assert b"".join(good.streaming_content) == b"the file\n"
    object_file(s3, company.pk, b"the file\n").write_bytes(b"THE FILE\n")
    response = board_client.get(url, {"tree": tree, "path": "a.txt"})
    assert_error(response, 422, "blob_unreadable")
    assert response.json()["error"]["details"]["digest"] == name_of(b"the file\n")
    s3.pause()
    try:
        stopped = board_client.get(url, {"tree": tree, "path": "a.txt"})
    finally:
        s3.resume()
    assert_error(stopped, 503, "blob_store_unavailable")
    assert stopped["Retry-After"] == "5"


def test_a_store_without_the_batch_delete_has_its_objects_deleted_one_by_one(
    s3: S3Server, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store answering DeleteObjects with an error, as GCS's XML API does (501; rclone
    implements it, so the batch call is made to fail here): each object is then deleted on
    its own, on the real server."""
    stored = [b"one\n", b"two\n", b"three\n"]
    store_tree(agent.company_id, {f"{i}.txt": data for i, data in enumerate(stored)})
    files = [object_file(s3, agent.company_id, data) for data in stored]
    assert all(path.exists() for path in files)
    batches: list[int] = []
    delete = obstore.delete

    def no_batch_delete(store: Any, paths: Any) -> None:
        if isinstance(paths, list):
            batches.append(len(paths))
            raise obstore.exceptions.GenericError("NotImplemented: DeleteObjects (501)")
        delete(store, paths)

    monkeypatch.setattr(obstore, "delete", no_batch_delete)
    S3Backend().delete_many(
        company_id=agent.company_id, digests=[name_of(data) for data in stored] + [name_of(b"x")]
    )
    assert batches == [4]
    assert not any(path.exists() for path in files)


def test_a_stopped_store_fails_the_materialization_which_is_retried_and_then_succeeds(
    s3: S3Server, tmp_path: Path, agent: Agent, settings: Any
) -> None:
    company_id = agent.company_id
    workspace = ExecutionWorkspaceFactory(company=agent.company, cwd=str(tmp_path / "cwd"))
    tree = store_tree(company_id, {"a.txt": b"first\n", "b/c.txt": b"second\n"})
    ExecutionWorkspace.objects.filter(pk=workspace.pk).update(
        head_tree=tree, head_committed_at=Now()
    )
    s3.pause()
    try:
        outcome = workspace_materialize(workspace_id=workspace.pk)
    finally:
        s3.resume()
    assert outcome.status == "failed"
    assert outcome.error is not None
    assert "blob_store_unavailable" in outcome.error
    workspace.refresh_from_db()
    assert workspace.materialize_attempts == 1
    assert workspace.materialize_next_at is not None  # retried with back-off
    assert workspace.cwd_tree != tree
    # The retry, on the resumed server with the default timeouts (1 s reads flaked on a
    # loaded machine: a slow answer is not what this test is about).
    settings.PAPERCLIP_CAS_S3_READ_TIMEOUT = 30.0
    settings.PAPERCLIP_CAS_S3_MAX_ATTEMPTS = 3
    assert workspace_materialize(workspace_id=workspace.pk).status == "materialized"
    assert (tmp_path / "cwd" / "b" / "c.txt").read_bytes() == b"second\n"
    workspace.refresh_from_db()
    assert workspace.cwd_tree == tree
    assert workspace.materialize_error is None


def test_the_s3_backend_without_a_bucket_is_improperly_configured(settings: Any) -> None:
    settings.PAPERCLIP_CAS_BACKEND = "s3"
    settings.PAPERCLIP_CAS_S3_BUCKET = ""
    with pytest.raises(ImproperlyConfigured, match="PAPERCLIP_CAS_S3_BUCKET"):
        blob_backend()
    started = subprocess.run(  # startup itself stops
        [sys.executable, "-c", "import django; django.setup()"],
        env=child_env(PAPERCLIP_CAS_BACKEND="s3", PAPERCLIP_CAS_S3_BUCKET=""),
        capture_output=True,
        text=True,
        check=False,
    )
    assert started.returncode != 0
    assert "PAPERCLIP_CAS_S3_BUCKET" in started.stderr


def test_a_stopped_store_fails_a_batch_delete_at_once_not_key_by_key(
    s3: S3Server, agent: Agent, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a store that refuses the batch delete is asked key by key: one that does not
    answer fails the collection's batch within its timeouts. Falling back on any failure, 64
    keys cost 8 more rounds of timeouts (each 2 attempts of 1 s here; 3 of 30 s by default)
    while the collector held the rows locked."""
    stored = [f"blob {i}\n".encode() for i in range(64)]
    store_tree(agent.company_id, {f"{i}.txt": data for i, data in enumerate(stored)})
    one_by_one: list[str] = []
    delete_async = obstore.delete_async

    async def counted(store: Any, path: Any) -> None:
        one_by_one.append(path)
        await delete_async(store, path)

    monkeypatch.setattr(obstore, "delete_async", counted)
    request.getfixturevalue("paused")
    with pytest.raises(BlobStoreUnavailable):
        S3Backend().delete_many(
            company_id=agent.company_id, digests=[name_of(data) for data in stored]
        )
    assert one_by_one == []


def test_a_store_failing_while_a_large_object_is_copied_is_503_not_a_cut_200(
    s3: S3Server, agent_client: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large object is copied into the temporary file before the answer starts: a store
    that fails part way through is a 503 the client retries. Copied as the answer streamed,
    this was a 200 with its Content-Length, cut after the first piece."""
    data = os.urandom(WHOLE_READ_BYTES + 1024 * 1024)
    assert put(agent_client, data).status_code == 201
    get = obstore.get

    class FailingAnswer:
        def __init__(self, answer: Any) -> None:
            self.answer, self.meta = answer, answer.meta

        def stream(self, **options: Any) -> Iterator[Any]:
            for number, piece in enumerate(self.answer.stream(**options)):
                if number:
                    raise obstore.exceptions.GenericError("connection reset mid-answer")
                yield piece

    monkeypatch.setattr(obstore, "get", lambda store, key: FailingAnswer(get(store, key)))
    response = agent_client.get(f"/api/cas/blobs/{name_of(data)}")
    assert_error(response, 503, "blob_store_unavailable")
    assert response["Retry-After"] == "5"


def test_collection_keeps_local_bytes_when_the_bucket_cannot_delete(
    s3: S3Server, settings: Any, company: Any, request: pytest.FixtureRequest
) -> None:
    """Mid-move (the filesystem backend in use, the bucket still configured), a bucket that
    cannot be reached rolls the collection's batch back: its rows stay, and so do the local
    files they name (removed first, they were gone for good behind rows that stayed)."""
    settings.PAPERCLIP_CAS_BACKEND = "filesystem"
    data = b"old and unreachable\n"
    store_tree(company.pk, {"a.txt": data})
    CasBlob.objects.filter(company_id=company.pk).update(
        created_at=Now() - timedelta(days=2), referenced_at=Now() - timedelta(days=2)
    )
    request.getfixturevalue("paused")
    with pytest.raises(BlobStoreUnavailable):
        cas_collect(batch_size=100)
    assert kept(company.pk, name_of(data)) == {"row": True, "chunks": False, "file": True}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PAPERCLIP_CAS_S3_PREFIX", "/cas/"),
        ("PAPERCLIP_CAS_S3_PREFIX", "cas"),
        ("PAPERCLIP_CAS_S3_PREFIX", "a//b/"),
        ("PAPERCLIP_CAS_S3_PREFIX", "a/../"),
        ("PAPERCLIP_CAS_S3_REDIRECT_SECONDS", "0"),
    ],
)
def test_settings_the_store_would_refuse_stop_startup(name: str, value: str) -> None:
    """Each was an exception of obstore's at the first request (a 500), not at startup."""
    started = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env=child_env(**{name: value}),
        capture_output=True,
        text=True,
        check=False,
    )
    assert started.returncode != 0
    assert name in started.stderr


def test_a_bucket_that_is_gone_is_503_everywhere_never_500_nor_lost_bytes(
    s3: S3Server, settings: Any, agent_client: APIClient, agent: Agent
) -> None:
    """A bucket deleted, misnamed or not made yet answers "not found" (NoSuchBucket): the
    store cannot be used, retryably, which is neither an upload's 500 nor a read's "the store
    lost the bytes" (422 `missing`, whose remedy, uploading again, would fail too)."""
    from tests.paperclip.snapshots.helpers import frames

    kept_blob = b"stored, then the bucket setting points nowhere\n"
    assert put(agent_client, kept_blob).status_code == 201
    settings.PAPERCLIP_CAS_S3_BUCKET = "no-such-bucket"
    assert_error(put(agent_client, b"a blob for no bucket\n"), 503, "blob_store_unavailable")
    batch = agent_client.post("/api/cas/batch", frames(b"one\n", b"two\n"), content_type=OCTETS)
    assert_error(batch, 503, "blob_store_unavailable")
    assert list(CasBlob.objects.filter(company_id=agent.company_id).values_list("digest")) == [
        (name_of(kept_blob),)
    ]
    read = agent_client.get(f"/api/cas/blobs/{name_of(kept_blob)}")
    assert_error(read, 503, "blob_store_unavailable")
    backend = S3Backend()
    # A HEAD's 404 has no body to tell the bucket's from the object's: `stat` answers "not
    # there", and the upload that follows is the 503 above.
    with pytest.raises(BlobStoreUnavailable):
        backend.delete(company_id=agent.company_id, digest=name_of(kept_blob))
    row = CasBlob.objects.get(company_id=agent.company_id)
    with pytest.raises(BlobStoreUnavailable):
        backend.get_many(company_id=agent.company_id, rows={row.digest: (row.pk, len(kept_blob))})
