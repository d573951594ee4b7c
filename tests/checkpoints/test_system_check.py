"""A malformed PAPERCLIP_CHECKPOINT_KEYS fails Django's system checks with a clear error."""

from __future__ import annotations

import base64

from django.test import override_settings

from checkpoints.checks import checkpoint_keys_check


@override_settings(PAPERCLIP_CHECKPOINT_KEYS=["not-a-key"])
def test_malformed_key_is_a_system_check_error() -> None:
    errors = checkpoint_keys_check()
    assert [e.id for e in errors] == ["checkpoints.E001"]
    assert "not-a-key" not in errors[0].msg  # never echo key material


@override_settings(PAPERCLIP_CHECKPOINT_KEYS=[base64.b64encode(b"k" * 32).decode()])
def test_valid_keys_pass() -> None:
    assert checkpoint_keys_check() == []


@override_settings(PAPERCLIP_CHECKPOINT_KEYS=[])
def test_no_configured_keys_pass_without_touching_the_key_file() -> None:
    assert checkpoint_keys_check() == []
