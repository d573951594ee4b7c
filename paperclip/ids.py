"""The one rule for ids given by a caller.

An id is a UUID in its canonical text form, 8-4-4-4-12 hex digits. In URL paths Django's
`<uuid:>` converter enforces it (lowercase; anything else is a 404 before a view runs). Ids
inside request bodies and stored JSON are parsed with `parse_uuid`, which accepts the same
form in either case and refuses the other spellings Python's `UUID()` would take (braces,
`urn:uuid:`, no hyphens) and every non-string. API serializers use
`paperclip.api.serializers.UUIDBodyField`, which is built on it.
"""

from __future__ import annotations

import re
from typing import Final
from uuid import UUID

_CANONICAL: Final = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE
)


def parse_uuid(value: object) -> UUID | None:
    """`value` as a UUID if it is one (or its canonical text); None otherwise."""
    if isinstance(value, UUID):
        return value
    if not isinstance(value, str) or not _CANONICAL.fullmatch(value):
        return None
    return UUID(value)


def is_uuid(value: object) -> bool:
    """True for a string in canonical UUID form (see `parse_uuid`)."""
    return isinstance(value, str) and parse_uuid(value) is not None


def parse_count(text: object, *, high: int) -> int | None:
    """A caller's whole number written in ASCII digits, 0..`high`; None for anything else.
    The digits are counted before they are converted: Python refuses to convert more than
    4,300 of them (a ValueError that became a 500), and a query string or header can carry
    any number."""
    if not isinstance(text, str) or not text.isascii() or not text.isdigit():
        return None
    digits = text.lstrip("0") or "0"  # zeros ahead of a small number count as digits too
    if len(digits) > len(str(high)):
        return None
    value = int(digits)
    return value if value <= high else None
