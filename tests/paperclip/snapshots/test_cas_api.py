"""The content-addressed store's API on both backends (docs/snapshots.md#the-store)."""

from __future__ import annotations

import io
import os
import tracemalloc
from collections.abc import Callable
from typing import Any

import obstore
import pytest
from django.conf import settings
from rest_framework.test import APIClient

from paperclip.models import ActivityEvent, Agent, CasBlob, CasBlobChunk, Company
from paperclip.snapshots.store.backends import blob_path
from paperclip.snapshots.store.s3 import S3Backend
from paperclip.snapshots.store.uploads import cas_put
from tests.helpers import assert_error
from tests.paperclip.factories import AgentFactory, ExecutionWorkspaceFactory, NativeRunFactory
from tests.paperclip.snapshots.helpers import NOTHING, frames, kept, name_of

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("backend")]
OCTETS = "application/octet-stream"


def put(client: APIClient, data: bytes, name: str | None = None, query: str = "") -> Any:
    return client.put(f"/api/cas/blobs/{name or name_of(data)}{query}", data, content_type=OCTETS)


def get_bytes(client: APIClient, name: str, query: str = "") -> tuple[int, bytes, Any]:
    response = client.get(f"/api/cas/blobs/{name}{query}")
    if response.status_code != 200:
        return response.status_code, b"", response
    return 200, b"".join(response.streaming_content), response


def test_limits(agent_client: APIClient, settings: Any) -> None:
    body = agent_client.get("/api/cas").json()
    assert body == {
        "max_blob_bytes": 64 * 1024 * 1024,
        "max_batch_bytes": 16 * 1024 * 1024,
        "max_batch_blobs": 500 if settings.PAPERCLIP_CAS_BACKEND == "s3" else 10_000,
        "max_find_missing": 10_000,
    }


def test_the_s3_backend_takes_smaller_batches(
    agent_client: APIClient, agent: Agent, settings: Any
) -> None:
    """Each blob of a batch is a round trip to the bucket: 500 frames at most, advertised
    and enforced (the 501st frame is refused before anything is stored)."""
    settings.PAPERCLIP_CAS_BACKEND = "s3"
    settings.PAPERCLIP_CAS_S3_BUCKET = "never-reached"
    assert agent_client.get("/api/cas").json()["max_batch_blobs"] == 500
    blobs = [f"blob {i}\n".encode() for i in range(501)]
    response = agent_client.post("/api/cas/batch", frames(*blobs), content_type=OCTETS)
    error = assert_error(response, 400, "invalid_request")
    assert error["details"]["fields"]["body"] == ["More than 500 frames."]
    assert not CasBlob.objects.exists()


def test_put_is_201_then_200_and_get_streams_the_exact_bytes(
    agent_client: APIClient, agent: Agent
) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)  # several postgres chunks
    name = name_of(data)
    events = ActivityEvent.objects.count()
    first = put(agent_client, data)
    assert first.status_code == 201, first.content
    assert first.json() == {"digest": name, "size": len(data), "created": True}
    again = put(agent_client, data)
    assert again.status_code == 200
    assert again.json()["created"] is False
    code, got, response = get_bytes(agent_client, name)
    assert code == 200
    assert got == data
    assert response["Content-Length"] == str(len(data))
    assert response["Content-Type"] == OCTETS
    # A download that asks for the bytes' type is served too.
    accept = agent_client.get(f"/api/cas/blobs/{name}", HTTP_ACCEPT=OCTETS)
    assert b"".join(accept.streaming_content) == data
    assert ActivityEvent.objects.count() == events  # content, not domain state


def test_the_empty_blob(agent_client: APIClient) -> None:
    assert put(agent_client, b"").status_code == 201
    assert get_bytes(agent_client, name_of(b""))[:2] == (200, b"")


def test_a_mismatch_is_400_and_keeps_nothing(agent_client: APIClient, agent: Agent) -> None:
    claimed = name_of(b"what I said")
    error = assert_error(put(agent_client, b"what I sent", claimed), 400, "blob_digest_mismatch")
    assert error["details"]["digest"] == claimed
    assert kept(agent.company_id, claimed) == NOTHING


def test_an_oversized_blob_is_413_and_keeps_nothing(
    agent_client: APIClient, agent: Agent, settings: Any
) -> None:
    settings.PAPERCLIP_CAS_MAX_BLOB_BYTES = 1000
    data = b"x" * 1001
    error = assert_error(put(agent_client, data), 413, "blob_too_large")
    assert error["details"]["max_bytes"] == 1000
    assert kept(agent.company_id, name_of(data)) == NOTHING
    assert put(agent_client, b"x" * 1000).status_code == 201


@pytest.mark.parametrize("name", ["sha256:ABC", "md5:" + "0" * 64, "sha256:" + "0" * 63, "x"])
def test_a_bad_name_is_400(agent_client: APIClient, name: str) -> None:
    assert_error(put(agent_client, b"a", name), 400, "invalid_request")
    assert_error(agent_client.get(f"/api/cas/blobs/{name}"), 400, "invalid_request")
    assert not CasBlob.objects.exists()


def test_find_missing_answers_per_company_in_request_order(
    agent_client: APIClient, agent: Agent, make_agent_client: Callable[[Agent], APIClient]
) -> None:
    mine, theirs, nowhere = b"mine", b"theirs", b"nowhere"
    other = make_agent_client(AgentFactory())
    assert put(agent_client, mine).status_code == 201
    assert put(other, theirs).status_code == 201
    asked = [name_of(nowhere), name_of(mine), name_of(theirs), name_of(nowhere)]
    response = agent_client.post("/api/cas/find-missing", {"digests": asked}, format="json")
    assert response.status_code == 200, response.content
    assert response.json() == {"missing": [name_of(nowhere), name_of(theirs), name_of(nowhere)]}
    # Another company's blob: 404 like a blob that exists nowhere.
    assert get_bytes(agent_client, name_of(theirs))[0] == 404
    assert get_bytes(agent_client, name_of(nowhere))[0] == 404
    assert get_bytes(other, name_of(theirs))[1] == theirs


def test_find_missing_validates_its_body(agent_client: APIClient) -> None:
    bad = agent_client.post("/api/cas/find-missing", {"digests": ["nope"]}, format="json")
    assert "digests[0]" in assert_error(bad, 400, "invalid_request")["details"]["fields"]
    many = agent_client.post(
        "/api/cas/find-missing", {"digests": [name_of(b"")] * 10_001}, format="json"
    )
    assert_error(many, 400, "invalid_request")
    extra = agent_client.post("/api/cas/find-missing", {"digests": [], "x": 1}, format="json")
    assert_error(extra, 400, "invalid_request")


def test_board_callers_name_the_company(
    make_board_client: Callable[..., APIClient], company: Company, other_company: Company
) -> None:
    board = make_board_client(company)
    data = b"board bytes"
    assert_error(put(board, data), 400, "invalid_request")
    assert_error(put(board, data, query="?company_id=nope"), 400, "invalid_request")
    assert_error(put(board, data, query=f"?company_id={other_company.pk}"), 404, "not_found")
    assert put(board, data, query=f"?company_id={company.pk}").status_code == 201
    assert get_bytes(board, name_of(data), f"?company_id={company.pk}")[1] == data
    assert get_bytes(board, name_of(data), f"?company_id={other_company.pk}")[0] == 404
    found = board.post(
        f"/api/cas/find-missing?company_id={company.pk}",
        {"digests": [name_of(data)]},
        format="json",
    )
    assert found.json() == {"missing": []}


def test_an_agent_naming_another_company_is_404(
    agent_client: APIClient, agent: Agent, other_company: Company
) -> None:
    assert_error(put(agent_client, b"a", query=f"?company_id={other_company.pk}"), 404, "not_found")
    assert put(agent_client, b"a", query=f"?company_id={agent.company_id}").status_code == 201


def test_a_batch_stores_all_and_reports_new_and_existing(
    agent_client: APIClient, agent: Agent
) -> None:
    assert put(agent_client, b"old").status_code == 201
    body = frames(b"one", b"old", b"", b"one")
    response = agent_client.post("/api/cas/batch", body, content_type=OCTETS)
    assert response.status_code == 200, response.content
    assert response.json() == {
        "stored": [name_of(b"one"), name_of(b"")],
        "existing": [name_of(b"old")],
    }
    assert get_bytes(agent_client, name_of(b"one"))[1] == b"one"


def damage_in_place(company_id: Any, data: bytes) -> None:
    """The stored bytes of `data` changed behind the plane's back, keeping their size."""
    name, damaged = name_of(data), bytes([data[0] ^ 0xFF]) + data[1:]
    if settings.PAPERCLIP_CAS_BACKEND == "filesystem":
        blob_path(company_id, name).write_bytes(damaged)
    elif settings.PAPERCLIP_CAS_BACKEND == "postgres":
        CasBlobChunk.objects.filter(blob__company_id=company_id, blob__digest=name).update(
            data=damaged
        )
    else:
        backend = S3Backend()
        obstore.put(backend.store, backend.key(company_id, name), damaged)


@pytest.mark.parametrize("upload", ["put", "batch"])
def test_uploading_a_blob_again_repairs_its_bytes_damaged_in_place(
    agent_client: APIClient, agent: Agent, upload: str
) -> None:
    """What the 422 tells an agent to do works: the upload's verified bytes are written
    anew. A size check alone kept a damaged object of the right size, 422 for ever."""
    data = b"the right bytes, damaged in place later\n"
    assert put(agent_client, data).status_code == 201
    damage_in_place(agent.company_id, data)
    assert_error(agent_client.get(f"/api/cas/blobs/{name_of(data)}"), 422, "blob_unreadable")
    if upload == "put":
        again = put(agent_client, data)
        assert (again.status_code, again.json()["created"]) == (200, False)
    else:
        again = agent_client.post("/api/cas/batch", frames(data), content_type=OCTETS)
        assert (again.status_code, again.json()["existing"]) == (200, [name_of(data)])
    assert get_bytes(agent_client, name_of(data))[:2] == (200, data)


def test_a_batch_with_one_bad_frame_keeps_nothing(agent_client: APIClient, agent: Agent) -> None:
    body = frames(b"good", b"liar", names=[name_of(b"good"), name_of(b"truth")])
    response = agent_client.post("/api/cas/batch", body, content_type=OCTETS)
    error = assert_error(response, 400, "blob_digest_mismatch")
    assert error["details"]["digest"] == name_of(b"truth")
    assert kept(agent.company_id, name_of(b"good")) == NOTHING
    assert not CasBlob.objects.exists()


def test_a_batch_with_an_oversized_blob_is_413(agent_client: APIClient, settings: Any) -> None:
    settings.PAPERCLIP_CAS_MAX_BLOB_BYTES = 10
    response = agent_client.post("/api/cas/batch", frames(b"a", b"b" * 11), content_type=OCTETS)
    assert assert_error(response, 413, "blob_too_large")["details"]["max_bytes"] == 10
    settings.PAPERCLIP_CAS_MAX_BATCH_BYTES = 5
    response = agent_client.post("/api/cas/batch", frames(b"a"), content_type=OCTETS)
    assert assert_error(response, 413, "request_too_large")["details"]["max_bytes"] == 5
    assert not CasBlob.objects.exists()


@pytest.mark.parametrize(
    "body",
    [
        b"no newline at all",
        b"sha256:" + b"0" * 64 + b"\n",  # no size
        frames(b"abc")[:-1],  # ends inside the bytes
        frames(b"abc") + b"\n",  # an empty header line
        b"sha256:" + b"a" * 64 + b" 03\nabc",  # leading zero
        b"sha256:" + b"a" * 64 + b" -3\nabc",
        b"sha256:" + b"a" * 64 + b" 3 \nabc",
        b"x" * 500,
        b"[]",
    ],
)
def test_malformed_framing_is_400_and_keeps_nothing(agent_client: APIClient, body: bytes) -> None:
    response = agent_client.post("/api/cas/batch", body, content_type=OCTETS)
    error = assert_error(response, 400, "invalid_request")
    assert "body" in error["details"]["fields"]
    assert not CasBlob.objects.exists()


def test_an_empty_batch_stores_nothing(agent_client: APIClient) -> None:
    response = agent_client.post("/api/cas/batch", b"", content_type=OCTETS)
    assert response.json() == {"stored": [], "existing": []}


def test_a_large_upload_streams_through_without_being_held_in_memory(
    agent: Agent, tmp_path: Any
) -> None:
    """20 MiB through the service with tracemalloc watching: the peak stays a small fraction
    of the blob (the spool moves to a temporary file; pieces are 64 KiB / 1 MiB; the s3
    backend's multipart upload reads a part of 5 MiB at a time)."""
    size = 20 * 1024 * 1024
    source = tmp_path / "big"
    with source.open("wb") as out:
        for _ in range(size // (1024 * 1024)):
            out.write(os.urandom(1024 * 1024))
    import hashlib

    digest = "sha256:" + hashlib.sha256(source.read_bytes()).hexdigest()
    # A small upload first: a backend's one-time set-up (the s3 backend's client and its
    # connection pool) is not what this measures.
    warm = b"warm-up\n"
    cas_put(
        company_id=agent.company_id,
        digest="sha256:" + hashlib.sha256(warm).hexdigest(),
        stream=io.BytesIO(warm),
        length=len(warm),
    )
    tracemalloc.start()
    try:
        with source.open("rb") as stream:
            stored = cas_put(company_id=agent.company_id, digest=digest, stream=stream, length=size)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stored.created
    assert stored.size == size
    assert peak < 6 * 1024 * 1024, peak


def test_the_head_of_a_workspace(
    agent_client: APIClient,
    agent: Agent,
    make_agent_client: Callable[[Agent], APIClient],
) -> None:
    workspace = ExecutionWorkspaceFactory(company=agent.company)
    url = f"/api/execution-workspaces/{workspace.pk}/head"
    assert agent_client.get(url).json() == {"tree": None, "run_id": None, "committed_at": None}
    run = NativeRunFactory(company=agent.company, agent=agent)
    tree = name_of(b'{"entries":[],"schema":"paperclip.dir.v1"}')
    from django.utils import timezone

    workspace.head_tree, workspace.head_run, workspace.head_committed_at = (
        tree,
        run,
        timezone.now(),
    )
    workspace.save()
    body = agent_client.get(url).json()
    assert body["tree"] == tree
    assert body["run_id"] == str(run.pk)
    assert body["committed_at"]
    stranger = make_agent_client(AgentFactory())
    assert_error(stranger.get(url), 404, "not_found")
