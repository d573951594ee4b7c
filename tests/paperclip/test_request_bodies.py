"""Request bodies are read in full or refused, never as empty (docs/api.md#request-bodies), on
the real servers the project runs, spoken to over raw sockets: Django's runserver (`make run`)
answers a chunked body 411 `length_required`; granian (`python -m paperclip.serve`) and
gunicorn de-chunk it, and the upload is stored; a body cut short is 400 `invalid_request` on
each; nothing is written by a refused request."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from paperclip.credentials import agent_key_create
from paperclip.models import ActivityEvent, CasBlob
from tests.paperclip.factories import AgentFactory, CompanyFactory
from tests.support.processes import child_env
from tests.support.servers import free_port, stop_process, wait_for_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.xdist_group("request-bodies"),
]

SERVERS = ("runserver", "granian", "gunicorn")


def _argv(server: str, port: int) -> list[str]:
    python = Path(sys.executable)
    if server == "runserver":
        return [str(python), "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"]
    if server == "granian":
        return [str(python), "-m", "paperclip.serve", f"--bind=127.0.0.1:{port}", "--workers=1"]
    return [
        str(python.with_name("gunicorn")), "paperclip.wsgi:application",
        f"--bind=127.0.0.1:{port}", "--workers=1", "--threads=2",
    ]  # fmt: skip


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[dict[str, int]]:
    """Each server on a free port against the test database, one store of blobs."""
    env = child_env(
        DJANGO_DEBUG="false",
        DJANGO_ALLOWED_HOSTS="127.0.0.1",
        DJANGO_LOG_LEVEL="ERROR",
        PAPERCLIP_CAS_DIR=str(tmp_path / "cas"),
    )
    started: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
    try:
        for name in SERVERS:
            port = free_port()
            proc = subprocess.Popen(
                _argv(name, port),
                cwd=settings.BASE_DIR,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            started[name] = (port, proc)
        for port, proc in started.values():
            wait_for_server(port, proc).close()
        yield {name: port for name, (port, _) in started.items()}
    finally:
        for _, proc in started.values():
            stop_process(proc)


@pytest.fixture
def key() -> str:
    agent = AgentFactory(company=CompanyFactory())
    return agent_key_create(agent_id=agent.pk).secret


def _send(port: int, head: str, *parts: bytes, end: bool = False) -> tuple[int, dict[str, Any]]:
    """Send a request's head and body bytes as given, read the answer; `end`: end the sending
    side after the bytes (a client that stopped sending; granian then closes at once when the
    body was whole)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + b"".join(parts))
        if end:
            sock.shutdown(socket.SHUT_WR)
        response = http.client.HTTPResponse(sock)
        response.begin()
        body = response.read()
    return response.status, json.loads(body) if body else {}


def _chunked(data: bytes, size: int = 1 << 16) -> bytes:
    out = b"".join(
        f"{len(data[i : i + size]):x}\r\n".encode() + data[i : i + size] + b"\r\n"
        for i in range(0, len(data), size)
    )
    return out + b"0\r\n\r\n"


def _head(method: str, path: str, key: str, *headers: str) -> str:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {key}"]
    return "\n".join([*lines, *headers]) + "\n"


BLOB = bytes(range(256)) * 4096  # 1 MiB
NAME = "sha256:" + hashlib.sha256(BLOB).hexdigest()


def test_a_chunked_upload_is_411_under_runserver_and_stored_whole_by_granian_and_gunicorn(
    servers: dict[str, int], key: str
) -> None:
    head = _head(
        "PUT", f"/api/cas/blobs/{NAME}", key,
        "Content-Type: application/octet-stream", "Transfer-Encoding: chunked",
    )  # fmt: skip
    audit = ActivityEvent.objects.count()
    status, body = _send(servers["runserver"], head, _chunked(BLOB))
    assert (status, body["error"]["code"]) == (411, "length_required"), body
    assert not CasBlob.objects.exists()
    assert ActivityEvent.objects.count() == audit

    for server in ("granian", "gunicorn"):
        status, body = _send(servers[server], head, _chunked(BLOB))
        assert status in (200, 201), (server, body)
        assert (body["digest"], body["size"]) == (NAME, len(BLOB)), server
    assert CasBlob.objects.get().size == len(BLOB)


def test_a_chunked_json_body_is_411_under_runserver_and_parsed_by_the_others(
    servers: dict[str, int], key: str
) -> None:
    payload = json.dumps({"digests": [NAME]}).encode()
    head = _head(
        "POST", "/api/cas/find-missing", key,
        "Content-Type: application/json", "Transfer-Encoding: chunked",
    )  # fmt: skip
    status, body = _send(servers["runserver"], head, _chunked(payload, 7))
    assert (status, body["error"]["code"]) == (411, "length_required"), body
    for server in ("granian", "gunicorn"):
        answer = _send(servers[server], head, _chunked(payload, 7))
        assert answer == (200, {"missing": [NAME]}), server


@pytest.mark.parametrize("server", SERVERS)
def test_a_body_cut_short_is_400_and_nothing_is_stored(
    servers: dict[str, int], key: str, server: str
) -> None:
    audit = ActivityEvent.objects.count()
    upload = _head(
        "PUT", f"/api/cas/blobs/{NAME}", key,
        "Content-Type: application/octet-stream", f"Content-Length: {len(BLOB)}",
    )  # fmt: skip
    status, body = _send(servers[server], upload, BLOB[: len(BLOB) // 2], end=True)
    assert (status, body["error"]["code"]) == (400, "invalid_request"), body

    # A JSON body whose first bytes happen to be a whole document: still not read as such.
    short = b'{"digests": []}'
    find = _head(
        "POST", "/api/cas/find-missing", key,
        "Content-Type: application/json", f"Content-Length: {len(short) + 10}",
    )  # fmt: skip
    status, body = _send(servers[server], find, short, end=True)
    assert (status, body["error"]["code"]) == (400, "invalid_request"), body

    # The runtime-lease claim (its lean view reads the body too).
    claim = b'{"action": "start"}'
    head = _head(
        "POST", f"/api/execution-workspaces/{uuid.uuid4()}/runtime-lease/claim", key,
        "Content-Type: application/json", f"Content-Length: {len(claim) + 10}",
    )  # fmt: skip
    status, body = _send(servers[server], head, claim, end=True)
    assert (status, body["error"]["code"]) == (400, "invalid_request"), body
    assert not CasBlob.objects.exists()
    assert ActivityEvent.objects.count() == audit
