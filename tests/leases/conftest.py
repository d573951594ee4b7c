"""Fixtures for runtime-lease tests."""

from __future__ import annotations

import pytest

from paperclip.models import Company, ExecutionWorkspace
from tests.paperclip.factories import ExecutionWorkspaceFactory


@pytest.fixture
def workspace(company: Company) -> ExecutionWorkspace:
    return ExecutionWorkspaceFactory(company=company)
