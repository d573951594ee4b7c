"""`seed_demo` needs the copy-back roots `make run` sets: without them it stops before writing
anything and says what to set (docs/setup.md#the-demo)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from paperclip.models import Company

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("roots", [[], ["/somewhere/else"]])
def test_without_the_demo_root_the_seed_says_what_to_set(
    settings: Any, tmp_path: Path, roots: list[str]
) -> None:
    settings.DATA_DIR = tmp_path
    settings.PAPERCLIP_COPYBACK_ROOTS = roots
    with pytest.raises(CommandError, match=f"PAPERCLIP_COPYBACK_ROOTS={tmp_path / 'demo'}"):
        call_command("seed_demo", stdout=io.StringIO())
    assert not Company.objects.exists()
