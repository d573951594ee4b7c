"""A small HTTP/1.1 proxy that injects faults between the agent CLI and the test server. It
forwards each request to the upstream server unless a rule decides otherwise: answer a chosen
status (`("status", code, payload, headers)`), drop the connection before forwarding
(`"drop_before"`: the request never arrived) or after it (`"drop_after"`: the server applied it
and its answer is lost), or delay it (`("delay", seconds)`)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Callable
from typing import Any, BinaryIO
from urllib.parse import urlsplit

Rule = Callable[[str, str, bytes], Any]
_HOP = ("transfer-encoding", "content-length", "connection")


class Proxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rules: list[Rule] = []
        self.lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _action(self, method: str, path: str, body: bytes) -> Any:
        with self.lock:
            for rule in self.rules:
                action = rule(method, path, body)
                if action is not None:
                    return action
        return None

    def _serve(self, conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        try:
            while (request := _read_request(stream)) is not None:
                method, path, headers, body = request
                action = self._action(method, path, body)
                if action == "drop_before":
                    return
                if isinstance(action, tuple) and action[0] == "status":
                    _, code, payload, extra = action
                    data = json.dumps(payload).encode()
                    _answer(conn, code, "X", [("Content-Type", "application/json"), *extra], data)
                    continue
                if isinstance(action, tuple) and action[0] == "delay":
                    threading.Event().wait(action[1])
                status, reason, answer_headers, data = self._forward(method, path, headers, body)
                if action == "drop_after":
                    return
                _answer(conn, status, reason, answer_headers, data)
        except (OSError, ValueError):
            return
        finally:
            with contextlib.suppress(OSError):
                conn.close()

    def _forward(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        upstream = http.client.HTTPConnection(*self.upstream, timeout=700)
        try:
            sent = {k: v for k, v in headers if k.lower() not in _HOP}
            sent["Content-Length"] = str(len(body))
            upstream.request(method, path, body=body, headers=sent)
            response = upstream.getresponse()
            data = response.read()
            kept = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP]
            return response.status, response.reason, kept, data
        finally:
            upstream.close()


def _read_request(stream: BinaryIO) -> tuple[str, str, list[tuple[str, str]], bytes] | None:
    line = stream.readline()
    if not line:
        return None
    method, path, _version = line.decode("latin-1").split(" ", 2)
    headers: list[tuple[str, str]] = []
    while (raw := stream.readline()) not in (b"\r\n", b"\n", b""):
        key, value = raw.decode("latin-1").split(":", 1)
        headers.append((key.strip(), value.strip()))
    named = {k.lower(): v for k, v in headers}
    if "content-length" in named:
        return method, path, headers, stream.read(int(named["content-length"]))
    pieces = []
    if named.get("transfer-encoding", "").lower() == "chunked":
        while size := int(stream.readline().split(b";")[0], 16):
            pieces.append(stream.read(size))
            stream.readline()
        stream.readline()
    return method, path, headers, b"".join(pieces)


def _answer(
    conn: socket.socket, status: int, reason: str, headers: list[tuple[str, str]], data: bytes
) -> None:
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers)]
    lines.append(f"Content-Length: {len(data)}")
    conn.sendall("\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + data)


def once(
    method: str,
    fragment: str,
    action: Any,
    *,
    when: Callable[[bytes], bool] = lambda _body: True,
    times: int = 1,
) -> Rule:
    """A rule taking `action` for the first `times` requests of `method` whose path holds
    `fragment` and whose body passes `when`."""
    left = [times]

    def rule(method_: str, path: str, body: bytes) -> Any:
        if left[0] > 0 and method_ == method and fragment in path and when(body):
            left[0] -= 1
            return action
        return None

    return rule
