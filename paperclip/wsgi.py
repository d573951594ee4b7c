"""WSGI entry point (`python -m paperclip.serve` runs granian on it; gunicorn paperclip.wsgi)."""

import os
from collections.abc import Callable, Iterable
from typing import Any

from django.core.wsgi import get_wsgi_application
from django.http import HttpResponseBase

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
django_application = get_wsgi_application()

from paperclip.api.bodies import request_body_prepare  # noqa: E402 - needs the apps loaded


def application(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """Django's WSGI application, answering a response held in memory (every API answer) as
    a one-item list of bytes, closed first: granian sends a list in one call, while an
    iterable it drives chunk by chunk, taking the GIL back for each step and for `close()`
    (measured in the renew path's profile, docs/performance.md#the-renew-path). Streaming
    responses (downloads, files) stay iterables, closed by the server when sent."""
    request_body_prepare(environ)  # read in full or refused, never as empty
    response = django_application(environ, start_response)
    if isinstance(response, HttpResponseBase) and not response.streaming:
        try:
            return [b"".join(response)]
        finally:
            response.close()  # request_finished: what the server's close() would send
    return response
