"""`Transport`: how `Client` sends a call, and when it may repeat one.

Transport rules (why each call may or may not be repeated):

- every call has a timeout (`timeout`, and `wait + timeout` for `finalize(wait=...)`);
- a request that never reached the server (connection refused, connect timeout) is retried
  with back-off, whatever it is: nothing can have happened;
- `503 database_unavailable`, `503 blob_store_unavailable`, `409 resource_busy` and
  `409 workspace_runtime_lease_contended`
  are retried too: the API guarantees a failed request changes nothing;
- a request sent without an answer (read timeout, dropped connection) is retried only when
  repeating it is harmless: reads, a runtime-lease claim or controller-lease renew by the same
  owner, a release, an environment-lease acquire, heartbeat or release (same outcome), a
  result posted with a `caller_result_id`, a finalize wake-up. A fenced write, a cleanup claim
  or a checkpoint write raises `OutcomeUnknown` instead: the caller must re-read;
- a download the API redirects (`307` to a pre-signed URL of the object store) is fetched
  from there by a second HTTP client that never carries the API's `Authorization` header;
  a store that refuses it (an expired URL) counts as a dropped answer: the download is asked
  of the API again, which signs a fresh URL. The caller verifies the bytes as before.
"""

from __future__ import annotations

import random
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Self, TypeVar

from paperclip_client._httpx import httpx
from paperclip_client.errors import (
    ApiError,
    BlobStoreUnavailable,
    DatabaseUnavailable,
    OutcomeUnknown,
    ResourceBusy,
    ServerUnreachable,
    WorkspaceRuntimeLeaseContended,
)

F = TypeVar("F", bound=Callable[..., Any])
RETRYABLE_ERRORS = (
    DatabaseUnavailable,
    BlobStoreUnavailable,
    ResourceBusy,
    WorkspaceRuntimeLeaseContended,
)
USER_AGENT = "paperclip-client/0.1"
REDIRECTS = frozenset({301, 302, 303, 307, 308})


class DirectFetchFailed(httpx.TransportError):
    """The object store refused a redirected download (its status in the message)."""


def operation(operation_id: str) -> Callable[[F], F]:
    """Tag a method with the OpenAPI operation it calls (the schema-coverage test reads it)."""

    def mark(func: F) -> F:
        func.operation_id = operation_id  # type: ignore[attr-defined]
        return func

    return mark


def drop_none(body: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


class Transport:
    """The HTTP side of `Client`: requests with timeouts, retries where they are safe, error
    answers raised as the class of their code.

    `retries` is how many times a retry-safe failure is repeated (back-off from `backoff`
    seconds, doubling, with jitter, capped at `backoff_cap`; a `Retry-After` is honoured up to
    that cap). `transport` is for tests (e.g. `httpx.WSGITransport`).
    """

    def __init__(
        self,
        base_url: str,
        key: str,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        retries: int = 4,
        backoff: float = 0.25,
        backoff_cap: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.backoff = backoff
        self.backoff_cap = backoff_cap
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {key}", "User-Agent": USER_AGENT},
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            transport=transport,
            verify=_tls_context(self.base_url),
        )
        # Redirected downloads' client, made at the first redirect: building it loads
        # certifi's bundle (about 20 ms), which a run without one never needs (issue #42:
        # the CLI's start to its first request).
        self._direct_client: httpx.Client | None = None
        self._direct_lock = threading.Lock()  # the transfer threads may redirect at once

    def _direct(self) -> httpx.Client:
        """The client of redirected downloads: no Authorization header, ever (the store must
        never see the agent's key), and no redirect of its own followed."""
        with self._direct_lock:
            if self._direct_client is None:
                self._direct_client = httpx.Client(
                    headers={"User-Agent": USER_AGENT},
                    timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout),
                    follow_redirects=False,
                )
            return self._direct_client

    def close(self) -> None:
        self._http.close()
        with self._direct_lock:
            if self._direct_client is not None:
                self._direct_client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport ---------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        idempotent: bool,
        timeout: float | None = None,
        content: Callable[[], bytes | Iterator[bytes]] | None = None,
        headers: Mapping[str, str] | None = None,
        receive: Callable[[httpx.Response], Any] | None = None,
    ) -> Any:
        """Send one API call and return its decoded JSON body; raise the error class of its
        code. `idempotent`: whether a request sent without an answer may be repeated.
        `content()` gives a raw body for each attempt (bytes or an iterator of chunks, sent
        with the `Content-Length` of `headers`); `receive(response)` reads a successful
        answer as a stream (it must start over when called again) and gives the result."""
        attempt = 0
        while True:
            delay: float | None = None
            try:
                response = self._send(method, path, json, params, timeout, content, headers)
                if receive is not None and response.status_code in REDIRECTS:
                    response = self._redirected(response, timeout)
                try:
                    if receive is not None and response.status_code < 400:
                        return receive(response)
                    response.read()
                finally:
                    response.close()
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                if attempt >= self.retries:
                    raise ServerUnreachable(self.base_url, _reason(exc)) from exc
            except httpx.TransportError as exc:  # sent, no (complete) answer
                if not idempotent:
                    raise OutcomeUnknown(method, path, _reason(exc)) from exc
                if attempt >= self.retries:
                    raise ServerUnreachable(self.base_url, _reason(exc)) from exc
            else:
                body = _decode(response)
                if response.status_code < 400:
                    return body
                error = ApiError.from_body(
                    response.status_code, body, request_id=response.headers.get("X-Request-ID")
                )
                if not isinstance(error, RETRYABLE_ERRORS) or attempt >= self.retries:
                    raise error
                delay = _retry_after(response)
            attempt += 1
            pause = min(self.backoff_cap, self.backoff * 2 ** (attempt - 1))
            pause = pause * (0.5 + random.random() / 2)  # noqa: S311 - jitter, not security
            time.sleep(min(self.backoff_cap, max(pause, delay or 0.0)))

    def _send(
        self,
        method: str,
        path: str,
        json: Any,
        params: Mapping[str, Any] | None,
        timeout: float | None,
        content: Callable[[], bytes | Iterator[bytes]] | None,
        headers: Mapping[str, str] | None,
    ) -> httpx.Response:
        request = self._http.build_request(
            method,
            path,
            json=json,
            params=params,
            content=None if content is None else content(),
            headers=headers,
            # None would mean "no timeout" to httpx: the client's default applies instead.
            timeout=httpx.USE_CLIENT_DEFAULT
            if timeout is None
            else httpx.Timeout(timeout, connect=self.connect_timeout),
        )
        return self._http.send(request, stream=True)

    def _redirected(self, response: httpx.Response, timeout: float | None) -> httpx.Response:
        """The answer of the URL a redirect names, fetched without the API's headers;
        DirectFetchFailed when the store refuses it (or the redirect names no URL)."""
        location = response.headers.get("Location")
        response.read()
        response.close()
        if not location:
            raise DirectFetchFailed(f"a {response.status_code} without a Location")
        direct_client = self._direct()
        request = direct_client.build_request(
            "GET",
            response.url.join(location),
            timeout=httpx.USE_CLIENT_DEFAULT
            if timeout is None
            else httpx.Timeout(timeout, connect=self.connect_timeout),
        )
        direct = direct_client.send(request, stream=True)
        if direct.status_code >= 300:
            direct.read()
            direct.close()
            raise DirectFetchFailed(f"the object store answered {direct.status_code}")
        return direct

    def _get(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        return self.request("GET", path, params=params, idempotent=True)

    def _pages(self, path: str) -> list[Any]:
        """Every item of a `{"results", "next"}` list, following `next` (same server)."""
        items: list[Any] = []
        url: str | None = path
        while url is not None:
            page = self._get(url)
            items.extend(page["results"])
            following = page.get("next")
            url = None
            if isinstance(following, str):
                parts = httpx.URL(following)
                url = parts.raw_path.decode("ascii")
        return items


def _tls_context(base_url: str) -> ssl.SSLContext | bool:
    """What verifies the server's certificate: httpx's default (certifi's bundle) for an
    https:// server. A plain http:// server never needs TLS (every request goes to `base_url`;
    redirects are not followed), so it gets a context that trusts no certificate at all: an
    https:// connection would fail, never go unverified, and the CLI does not load the bundle
    (about 20 ms) before its first request (issue #42)."""
    if httpx.URL(base_url).scheme == "http":
        return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, with no trusted CA
    return True


def _decode(response: httpx.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return None


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
