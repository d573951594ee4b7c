"""Every test of the store runs on the three backends: the s3 one against a real S3 server
(`rclone serve s3`, one per test session, a key prefix per test: tests/support/s3.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import s3_settings


@pytest.fixture(params=["filesystem", "postgres", "s3"])
def backend(
    request: pytest.FixtureRequest, settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    settings.PAPERCLIP_CAS_BACKEND = request.param
    settings.PAPERCLIP_CAS_DIR = tmp_path / "cas"
    if request.param == "s3":
        s3_settings(settings, monkeypatch, request.getfixturevalue("s3_server"))
        # The store's own answers (the redirect has tests of its own: test_cas_s3.py).
        settings.PAPERCLIP_CAS_S3_REDIRECT = False
    return str(request.param)
