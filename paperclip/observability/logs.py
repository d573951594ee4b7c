"""Log formats (docs/operations.md#logs): `console` for people, `json` (one object per line) for
machines. Selected by PAPERCLIP_LOG_FORMAT; both carry the request or job context."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from paperclip.observability.context import context_get

# Attributes every LogRecord has; anything else on a record came in through `extra=`.
_STANDARD = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class ContextFilter(logging.Filter):
    """Stamp each record with the current request / job context (request id, actor, ...)."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = context_get()
        record.request_id = context.get("request_id", "-")
        record.context = context
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC), level, logger, message, the request or job context
    and whatever the caller passed in `extra=`; an exception as its formatted traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, tz=UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(getattr(record, "context", None) or {})
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in ("context", "request_id"):
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class ConsoleFormatter(logging.Formatter):
    """The human default: `time level logger [request id] message`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s [%(request_id)s] %(message)s")
