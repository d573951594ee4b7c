"""Checkpoint tests use a fixed primary key from settings and a throwaway data directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.checkpoints.factories import TEST_KEY


@pytest.fixture(autouse=True)
def checkpoint_keys(settings: Any, tmp_path: Path) -> Any:
    settings.DATA_DIR = tmp_path / "data"
    settings.PAPERCLIP_CHECKPOINT_KEYS = [TEST_KEY]
    return settings
