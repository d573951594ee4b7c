from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture
def request_lines() -> Iterator[list[logging.LogRecord]]:
    """The `paperclip.request` log records written during the test."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logger = logging.getLogger("paperclip.request")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
