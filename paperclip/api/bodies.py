"""Request bodies are read in full or refused, never read as empty (docs/api.md#request-bodies).

Django reads a request's body as `CONTENT_LENGTH` bytes, and as nothing at all when the WSGI
server gave no `CONTENT_LENGTH`. Two cases would then be read wrong without a word:

- A chunked body (`Transfer-Encoding: chunked`, no `Content-Length`). granian and gunicorn
  de-chunk it and say so (`wsgi.input_terminated`): `request_body_prepare` then reads it into
  a spool (up to the largest body any endpoint accepts, else 413 `request_too_large`) and
  gives Django its length, so it is read like any other body. Django's `runserver` (`make run`)
  hands the raw chunks over without saying so: `RequestBodyMiddleware` answers 411
  `length_required` before any view runs.
- A body cut short (the client stopped sending before `Content-Length` bytes): the stream
  `request_body_prepare` puts in front of the server's raises `RequestBodyIncomplete` (400
  `invalid_request`) when it meets the end early, whoever reads it (a JSON parser, the store
  of blobs, a form), and the middleware answers a body so marked.

`request_body_prepare` runs in `paperclip.wsgi.application`, ahead of Django (every server the
project runs: runserver, granian, gunicorn); the middleware runs in every request's chain,
the in-process test clients' included.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any, Final, Protocol

from django.conf import settings
from django.core.exceptions import BadRequest
from django.http import HttpRequest, HttpResponse, JsonResponse

from paperclip.api.errors import error_body
from paperclip.errors import DomainError, InvalidRequest, PayloadTooLargeError
from paperclip.ids import parse_count

# The environ key a step before Django sets when the body already proved unreadable.
BODY_PROBLEM: Final = "paperclip.request_body_problem"
BODY_INCOMPLETE: Final = "incomplete"
_TOO_LARGE: Final = "too_large"
_BAD_LENGTH: Final = "bad_length"
# A spooled chunked body stays in memory up to this size, then moves to a temporary file.
SPOOL_IN_MEMORY: Final = 1 << 20
_READ: Final = 1 << 16


class LengthRequired(DomainError):  # 411
    code = "length_required"
    message = (
        "This server cannot read a body without Content-Length (a chunked body): send the body "
        "with a Content-Length header."
    )
    status_code = 411


class RequestBodyIncomplete(InvalidRequest, BadRequest):
    """The body ended before `Content-Length` bytes (a BadRequest too, so that Django answers
    400 where it meets it outside a view, e.g. the CSRF check reading a form)."""

    message = "The request body ended before the Content-Length it announced."


class RequestBodyTooLarge(PayloadTooLargeError):
    code = "request_too_large"
    message = "The request body is too large."


class _Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...
    def readline(self, size: int = ..., /) -> bytes: ...


class ExactBody:
    """The server's input as `length` bytes exactly: reading up to them gives them, and the
    end of the input met before them raises RequestBodyIncomplete (every later read too)."""

    def __init__(self, stream: _Readable, length: int, environ: dict[str, Any]) -> None:
        self._stream = stream
        self._left = length
        self._environ = environ

    def _want(self, size: int | None) -> int:
        return self._left if size is None or size < 0 else min(size, self._left)

    def _short(self) -> RequestBodyIncomplete:
        self._environ[BODY_PROBLEM] = BODY_INCOMPLETE
        return RequestBodyIncomplete(missing=self._left)

    def read(self, size: int | None = -1, /) -> bytes:
        want = self._want(size)
        parts: list[bytes] = []
        while want > 0:  # a server's read may give less than asked before the end
            data = self._stream.read(want)
            if not data:
                raise self._short()
            parts.append(data)
            self._left -= len(data)
            want -= len(data)
        return b"".join(parts)

    def readline(self, size: int | None = -1, /) -> bytes:
        want = self._want(size)
        if want <= 0:
            return b""
        line = self._stream.readline(want)
        self._left -= len(line)
        if len(line) < want and not line.endswith(b"\n"):  # only the end stops it short
            raise self._short()
        return line


def largest_body() -> int:
    """The largest body any endpoint accepts: the spool's limit for a chunked body."""
    return max(
        int(settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 0),
        int(settings.PAPERCLIP_CAS_MAX_BLOB_BYTES),
        int(settings.PAPERCLIP_CAS_MAX_BATCH_BYTES),
    )


def _chunked_without_length(environ: dict[str, Any]) -> bool:
    return not environ.get("CONTENT_LENGTH") and bool(
        str(environ.get("HTTP_TRANSFER_ENCODING", "")).strip()
    )


def request_body_prepare(environ: dict[str, Any]) -> None:
    """Before Django reads `environ`: a body of announced length is read exactly (ExactBody);
    a chunked body the server de-chunked is spooled and given its length. A chunked body the
    server did not de-chunk is left for RequestBodyMiddleware to refuse (411)."""
    announced = environ.get("CONTENT_LENGTH")
    length = parse_count(announced, high=2**63 - 1)
    if length is not None:
        if length > 0:
            environ["wsgi.input"] = ExactBody(environ["wsgi.input"], length, environ)
        return
    if announced:  # not a length: Django would read it as an empty body, and a view act on it
        environ[BODY_PROBLEM] = _BAD_LENGTH
        return
    if not _chunked_without_length(environ) or environ.get("wsgi.input_terminated") is not True:
        return
    limit = largest_body()
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)  # noqa: SIM115 - the request owns it
    size = 0
    source = environ["wsgi.input"]
    while data := source.read(_READ):
        size += len(data)
        if size > limit:
            spool.close()
            environ[BODY_PROBLEM] = _TOO_LARGE
            return
        spool.write(data)
    spool.seek(0)
    environ["wsgi.input"] = spool
    environ["CONTENT_LENGTH"] = str(size)


def request_body_problem(meta: dict[str, Any]) -> DomainError | None:
    """Why the request's body cannot be read in full, found before any view reads it."""
    problem = meta.get(BODY_PROBLEM)
    if problem == BODY_INCOMPLETE:
        return RequestBodyIncomplete()
    if problem == _TOO_LARGE:
        return RequestBodyTooLarge(max_bytes=largest_body())
    if problem == _BAD_LENGTH:
        return InvalidRequest(fields={"body": ["Content-Length is not a number of bytes."]})
    if _chunked_without_length(meta) and meta.get("wsgi.input_terminated") is not True:
        return LengthRequired()
    return None


def _refusal(error: DomainError) -> JsonResponse:
    return JsonResponse(error_body(error.code, error.text, error.details), status=error.status_code)


class RequestBodyMiddleware:
    """Refuse a request whose body cannot be read in full before any view runs (411 or 400,
    413 for a chunked body over the largest accepted), and answer 400 when a view meets a
    body cut short. Nothing is written: no view ran, or the view's transaction failed."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        error = request_body_problem(request.META)
        if error is not None:
            return _refusal(error)
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if isinstance(exception, RequestBodyIncomplete):
            return _refusal(exception)
        return None
