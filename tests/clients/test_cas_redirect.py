"""A blob download the API redirects to the object store (docs/snapshots.md#direct-transfers):
the client fetches the URL without the API's Authorization header, verifies the bytes against
the name as always, and asks the API again when the store refuses an (expired) URL; end to end
against the s3 backend on a real S3 server (`rclone serve s3`)."""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from paperclip_client import Client
from paperclip_client.errors import BlobCorrupt, ServerUnreachable
from tests.clients.conftest import World
from tests.conftest import s3_settings
from tests.support.s3 import S3Server


def name(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Store:
    """A local HTTP server standing for the object store: serves `body` at any path with the
    `status` given, and records every request's headers."""

    def __init__(self) -> None:
        self.body = b""
        self.statuses: list[int] = []  # answered in turn; 200 once they run out
        self.seen: list[dict[str, str]] = []
        store = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                store.seen.append({k.lower(): v for k, v in self.headers.items()})
                status = store.statuses.pop(0) if store.statuses else 200
                body = store.body if status == 200 else b"refused"
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def store() -> Iterator[Store]:
    running = Store()
    yield running
    running.close()


def api(store: Store, asked: list[httpx.Request]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        asked.append(request)
        return httpx.Response(
            307, headers={"Location": f"{store.url}/bucket/key?X-Amz-Signature={len(asked)}"}
        )

    return httpx.MockTransport(handle)


def test_the_redirect_is_followed_without_the_api_key_and_verified(store: Store) -> None:
    store.body = b"straight from the bucket"
    asked: list[httpx.Request] = []
    with Client("http://testserver", "pcak_secret.key", transport=api(store, asked)) as c:
        out = io.BytesIO()
        assert c.cas_get(name(store.body), out) == len(store.body)
        assert out.getvalue() == store.body
        assert asked[0].headers["authorization"] == "Bearer pcak_secret.key"
        assert len(store.seen) == 1
        assert "authorization" not in store.seen[0]
        assert not any("pcak_secret" in value for value in store.seen[0].values())
        # Bytes that are not the name's are refused as before.
        with pytest.raises(BlobCorrupt):
            c.cas_get(name(b"something else"), io.BytesIO())


def test_a_refused_url_is_asked_of_the_api_again(store: Store) -> None:
    store.body = b"signed again"
    store.statuses = [403]  # the first URL has expired
    asked: list[httpx.Request] = []
    with Client("http://testserver", "k", transport=api(store, asked), retries=2, backoff=0.0) as c:
        assert c.cas_get_bytes(name(store.body)) == store.body
    assert len(asked) == 2
    assert [s.get("authorization") for s in store.seen] == [None, None]


def test_a_store_that_keeps_refusing_is_a_failure_not_bytes(store: Store) -> None:
    store.statuses = [403, 403, 403]
    asked: list[httpx.Request] = []
    with (
        Client("http://testserver", "k", transport=api(store, asked), retries=2, backoff=0.0) as c,
        pytest.raises(ServerUnreachable),
    ):
        c.cas_get_bytes(name(b"never"))
    assert len(asked) == 3


@pytest.mark.django_db
def test_end_to_end_through_the_s3_backend(
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    s3_server: S3Server,
    world: World,
    client: Client,
) -> None:
    s3_settings(settings, monkeypatch, s3_server)
    settings.PAPERCLIP_CAS_S3_REDIRECT = True
    settings.PAPERCLIP_CAS_S3_REDIRECT_MIN_BYTES = 0
    data = b"a file of the workspace\n" * 1000
    client.cas_put(name(data), data, len(data))
    redirect = client._http.get(f"/api/cas/blobs/{name(data)}")  # the raw answer
    assert redirect.status_code == 307  # what cas_get below follows
    assert redirect.headers["Location"].startswith(s3_server.endpoint)
    out = io.BytesIO()
    assert client.cas_get(name(data), out) == len(data)
    assert out.getvalue() == data
