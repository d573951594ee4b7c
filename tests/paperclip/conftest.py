"""Core test fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings) -> None:  # type: ignore[no-untyped-def]
    # UserFactory hashes a password per user; PBKDF2 would dominate these tests' runtime.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
