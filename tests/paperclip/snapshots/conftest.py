"""Every test of the store runs on both backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(params=["filesystem", "postgres"])
def backend(request: pytest.FixtureRequest, settings: Any, tmp_path: Path) -> str:
    settings.PAPERCLIP_CAS_BACKEND = request.param
    settings.PAPERCLIP_CAS_DIR = tmp_path / "cas"
    return str(request.param)
