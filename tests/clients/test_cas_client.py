"""The store's client methods on the wire (a mock transport; the live server is tested in the
CLI's live tests): the PUT body is streamed with its Content-Length, the batch body is framed
`<name> <size>\\n` + bytes, a download is checked against its name, find-missing is batched."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator

import httpx
import pytest

from paperclip_client import Client
from paperclip_client.cas import BatchFrame
from paperclip_client.errors import BlobCorrupt, BlobDigestMismatch


def name(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def client(handler: httpx.MockTransport) -> Client:
    return Client("http://testserver", "k", transport=handler, retries=1, backoff=0.0)


def test_put_streams_the_file_with_its_length_and_maps_a_mismatch() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = request.read()
        seen.append(request)
        if name(body) != request.url.path.rsplit("/", 1)[1]:
            error = {"code": "blob_digest_mismatch", "message": "no", "details": {}}
            return httpx.Response(400, json={"error": error})
        return httpx.Response(201, json={"digest": name(body), "size": len(body), "created": True})

    data = b"x" * (3 * 1024 * 1024 + 5)
    stream = io.BytesIO(b"skip" + data)
    stream.seek(4)
    with client(httpx.MockTransport(handle)) as c:
        answer = c.cas_put(name(data), stream, len(data))
        assert answer.created
        assert answer.size == len(data)
        assert seen[0].headers["content-length"] == str(len(data))
        with pytest.raises(BlobDigestMismatch):
            c.cas_put(name(b"other"), b"not it", 6)


def test_batch_frames_and_find_missing_batches() -> None:
    bodies: list[bytes] = []

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(request.read())
        if request.url.path == "/api/cas/find-missing":
            return httpx.Response(200, json={"missing": json.loads(bodies[-1])["digests"][:1]})
        return httpx.Response(200, json={"stored": [], "existing": []})

    with client(httpx.MockTransport(handle)) as c:
        c.cas_put_batch([(name(b"a"), b"a"), (name(b""), b"")])
        assert bodies[0] == f"{name(b'a')} 1\na{name(b'')} 0\n".encode()
        missing = c.cas_find_missing([name(bytes([i])) for i in range(5)], batch=2)
        assert missing == [name(b"\x00"), name(b"\x02"), name(b"\x04")]


def test_batch_bodies_are_streamed_with_their_length() -> None:
    seen: list[httpx.Request] = []
    reads: list[int] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = b"".join(request.stream)
        assert body == f"{name(b'abc')} 3\nabc{name(b'z')} 1\nz".encode()
        return httpx.Response(200, json={"stored": [], "existing": []})

    def read() -> Iterator[bytes]:
        reads.append(1)
        yield b"ab"
        yield b"c"

    with client(httpx.MockTransport(handle)) as c:
        c.cas_put_batch([BatchFrame(name(b"abc"), 3, read), (name(b"z"), b"z")])
    assert reads == [1]
    length = len(f"{name(b'abc')} 3\nabc{name(b'z')} 1\nz")
    assert seen[0].headers["content-length"] == str(length)


def test_get_checks_the_digest() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"hello")

    with client(httpx.MockTransport(handle)) as c:
        out = io.BytesIO()
        assert c.cas_get(name(b"hello"), out) == 5
        assert out.getvalue() == b"hello"
        with pytest.raises(BlobCorrupt):
            c.cas_get(name(b"other"), io.BytesIO())


def frames(*pairs: tuple[str, bytes]) -> bytes:
    return b"".join(f"{n} {len(d)}\n".encode() + d for n, d in pairs)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda a, b: frames((name(a), a), (name(b), b"not b")), id="wrong-bytes"),
        pytest.param(lambda a, b: frames((name(b), b), (name(a), a)), id="out-of-order"),
        pytest.param(lambda a, b: frames((name(a), a)), id="one-missing"),
        pytest.param(lambda a, b: frames((name(a), a), (name(b), b)) + b"x", id="trailing"),
        pytest.param(lambda a, b: frames((name(a), a), (name(b), b))[:-1], id="cut-short"),
        pytest.param(lambda a, b: f"{name(a)} 1e0\n".encode() + a, id="bad-size"),
    ],
)
def test_a_batch_read_takes_only_the_frames_asked_for_each_checked(answer: object) -> None:
    a, b = b"alpha", b"beta"
    asked: list[object] = []

    def good(request: httpx.Request) -> httpx.Response:
        asked.append(json.loads(request.read()))
        return httpx.Response(200, content=frames((name(a), a), (name(b), b)))

    with client(httpx.MockTransport(good)) as c:
        assert c.cas_get_batch([name(a), name(b), name(a)]) == {name(a): a, name(b): b}
        assert asked == [{"digests": [name(a), name(b)]}]  # each name asked once

    def lying(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=answer(a, b))  # type: ignore[operator]

    with client(httpx.MockTransport(lying)) as c, pytest.raises(BlobCorrupt):
        c.cas_get_batch([name(a), name(b)])
