"""System checks: a malformed checkpoint key stops `manage.py check` / start-up with a clear
message, instead of surfacing later as failed checkpoint reads."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from checkpoints.crypto import keyring


@checks.register(checks.Tags.security)
def checkpoint_keys_check(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    if not settings.PAPERCLIP_CHECKPOINT_KEYS:
        # The key file is created by the first writer; reading it here would be premature.
        return []
    try:
        keyring(create=False)
    except ImproperlyConfigured as exc:
        return [
            checks.Error(
                str(exc),
                hint="Each entry of PAPERCLIP_CHECKPOINT_KEYS is 32 bytes as base64 or 64 hex "
                "digits; the first is the primary key. See docs/checkpoints.md#key-management.",
                id="checkpoints.E001",
            )
        ]
    return []
