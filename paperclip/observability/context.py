"""What the current request or job is about, for its log lines (docs/operations.md#logs).

Set by the request middleware and the worker's job middleware; read by the log filter, so every
line a request or job writes carries its request id and, once known, its actor and company.
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar
from typing import Any

_SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

log_context: ContextVar[dict[str, Any] | None] = ContextVar("paperclip_log_context", default=None)


def request_id_accept(incoming: str | None) -> str:
    """An upstream proxy's X-Request-ID when it is a safe token of at most 128 characters,
    else a fresh one (never echo arbitrary text into headers and logs)."""
    if incoming and _SAFE_REQUEST_ID.fullmatch(incoming):
        return incoming
    return uuid.uuid4().hex


def context_get() -> dict[str, Any]:
    return log_context.get() or {}


def context_update(**values: Any) -> None:
    current = log_context.get()
    if current is not None:
        current.update({key: value for key, value in values.items() if value is not None})
