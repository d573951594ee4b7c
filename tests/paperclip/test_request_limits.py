"""Django-level rejections keep the one JSON error body (never an HTML page, never a 500)."""

from __future__ import annotations

import pytest
from django.test import override_settings

from tests.helpers import assert_error

pytestmark = pytest.mark.django_db


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1024)
def test_oversized_body_is_413_json(agent_client) -> None:
    response = agent_client.post(
        "/api/heartbeat-runs", {"runtime_mode": "legacy", "pad": "x" * 4096}, format="json"
    )
    error = assert_error(response, 413, "request_too_large")
    assert error["details"] == {"max_bytes": 1024}


def test_default_limit_admits_a_full_checkpoint_write(settings) -> None:
    assert settings.DATA_UPLOAD_MAX_MEMORY_SIZE > settings.PAPERCLIP_CHECKPOINT_MAX_WRITE_BYTES
