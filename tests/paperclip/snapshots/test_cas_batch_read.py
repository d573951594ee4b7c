"""`POST /api/cas/batch-read`: many blobs in one answer of frames, on every backend, verified,
all or nothing, scoped to the caller's company."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from paperclip.models import ActivityEvent, Agent, CasBlob, CasBlobChunk, Company
from paperclip.snapshots.store.backends import blob_path
from paperclip.snapshots.store.batch_read import MAX_BATCH_READ_BLOBS
from tests.helpers import assert_error
from tests.paperclip.factories import AgentFactory
from tests.paperclip.snapshots.helpers import frames, name_of

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("backend")]
OCTETS = "application/octet-stream"


def put(client: APIClient, data: bytes) -> None:
    response = client.put(f"/api/cas/blobs/{name_of(data)}", data, content_type=OCTETS)
    assert response.status_code in (200, 201), response.content


def read(client: APIClient, names: list[str], query: str = "") -> Any:
    return client.post(f"/api/cas/batch-read{query}", {"digests": names}, format="json")


def body(response: Any) -> bytes:
    assert response.status_code == 200, response.content
    data = b"".join(response.streaming_content)
    assert response["Content-Length"] == str(len(data))
    assert response["Content-Type"] == OCTETS
    return data


def test_the_answer_is_the_frames_asked_for_in_order_each_once(agent_client: APIClient) -> None:
    blobs = [b"one\n", b"", b"three" * 1000, bytes(range(256))]
    for data in blobs:
        put(agent_client, data)
    events = ActivityEvent.objects.count()
    asked = [name_of(blobs[2]), name_of(blobs[0]), name_of(blobs[1]), name_of(blobs[0])]
    asked.append(name_of(blobs[3]))
    assert body(read(agent_client, asked)) == frames(blobs[2], blobs[0], blobs[1], blobs[3])
    assert ActivityEvent.objects.count() == events  # a read writes nothing


def test_a_name_the_company_lacks_is_404_naming_it_whoever_holds_it(
    agent_client: APIClient, make_agent_client: Callable[[Agent], APIClient]
) -> None:
    other = make_agent_client(AgentFactory())
    put(agent_client, b"mine")
    put(other, b"theirs")
    response = read(agent_client, [name_of(b"mine"), name_of(b"theirs"), name_of(b"nowhere")])
    error = assert_error(response, 404, "not_found")
    assert error["details"] == {"digests": [name_of(b"theirs"), name_of(b"nowhere")]}
    assert body(read(other, [name_of(b"theirs")])) == frames(b"theirs")


def test_the_request_is_checked_before_anything_is_read(agent_client: APIClient) -> None:
    bad = assert_error(read(agent_client, [name_of(b"x"), "nope"]), 400, "invalid_request")
    assert "digests[1]" in bad["details"]["fields"]
    assert_error(read(agent_client, []), 400, "invalid_request")
    too_many = [name_of(str(i).encode()) for i in range(MAX_BATCH_READ_BLOBS + 1)]
    assert_error(read(agent_client, too_many), 400, "invalid_request")
    extra = agent_client.post("/api/cas/batch-read", {"digests": [], "x": 1}, format="json")
    assert_error(extra, 400, "invalid_request")
    not_json = agent_client.post("/api/cas/batch-read", b"[", content_type="application/json")
    assert_error(not_json, 400, "invalid_request")


def test_more_bytes_than_one_answer_holds_is_413(
    agent_client: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("paperclip.snapshots.store.batch_read.MAX_BATCH_READ_BYTES", 10)
    put(agent_client, b"123456")
    put(agent_client, b"abcdef")
    error = assert_error(
        read(agent_client, [name_of(b"123456"), name_of(b"abcdef")]), 413, "request_too_large"
    )
    assert error["details"]["max_bytes"] == 10
    assert body(read(agent_client, [name_of(b"123456")])) == frames(b"123456")


def test_a_board_caller_names_the_company(
    make_board_client: Callable[..., APIClient], company: Company, other_company: Company
) -> None:
    board = make_board_client(company)
    data = b"board bytes"
    put_response = board.put(
        f"/api/cas/blobs/{name_of(data)}?company_id={company.pk}", data, content_type=OCTETS
    )
    assert put_response.status_code == 201
    assert_error(read(board, [name_of(data)]), 400, "invalid_request")
    assert_error(read(board, [name_of(data)], f"?company_id={other_company.pk}"), 404, "not_found")
    assert body(read(board, [name_of(data)], f"?company_id={company.pk}")) == frames(data)


@pytest.mark.parametrize("backend", ["filesystem", "postgres"], indirect=True)
def test_damaged_bytes_are_422_naming_the_blob_never_served(
    agent_client: APIClient, agent: Agent, backend: str
) -> None:
    good, bad = b"the good blob\n", b"the right bytes\n"
    put(agent_client, good)
    put(agent_client, bad)
    if backend == "filesystem":
        blob_path(agent.company_id, name_of(bad)).write_bytes(b"the WRONG bytes\n")
    else:
        CasBlobChunk.objects.filter(blob__digest=name_of(bad)).update(data=b"the WRONG bytes\n")
    response = read(agent_client, [name_of(good), name_of(bad)])
    error = assert_error(response, 422, "blob_unreadable")
    assert error["details"] == {"digest": name_of(bad), "reason": "digest_mismatch"}
    assert CasBlob.objects.count() == 2
