"""Encryption of checkpoint parts at rest: AES-256-GCM with a random 96-bit nonce per part.

Keys
    `settings.PAPERCLIP_CHECKPOINT_KEYS` (a list; the first key is the primary, the others only
    decrypt) or, when that is empty, the key file `settings.DATA_DIR / "checkpoint_keys"` (same
    order, one key per line, `#` comments). A key is 32 random bytes written as base64 (standard
    or URL-safe alphabet) or as 64 hex digits. Its id is the first 12 hex digits of the key's
    SHA-256, so an id names a key without revealing it.

    The key file is created (mode 0600, atomically, so racing processes agree on one key)
    only by writers. Readers never create it: a missing key makes parts unreadable instead of
    silently minting a key that cannot decrypt anything.

Stored form (`Sealed`, one row's columns)
    `scheme` (`SCHEME`, or `SCHEME_V1` for parts written before v2), `key_id`, `nonce`
    (12 bytes) and `ciphertext` (bytea, GCM's 16-byte tag at its end): the bytes themselves,
    never base64.

Binding (beyond upstream)
    The associated data binds scheme, company, issue, run, part and key id, so a ciphertext
    copied to another row, run, part or company fails authentication. The plaintext also
    carries the binding (v2: `{companyId, issueId, runId, part}` JSON, a newline, the contents;
    v1: `{companyId, issueId, runId, part, contents}`,
    docs/checkpoints.md#associated-data-and-plaintext-binding) and is checked after decryption,
    as a second, independent line.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from uuid import UUID

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from checkpoints.errors import CheckpointUnreadable

# v2 (written since 3 December 2026): the plaintext is the binding as JSON, a newline, then
# the contents' UTF-8 bytes, so sealing never escapes the contents (JSON escaping of a 64 KiB
# part cost ~30x the AES-GCM itself). v1 (its plaintext one JSON object, contents inside) is
# still read. Both are AES-256-GCM with the same associated data, whose first item is the scheme.
SCHEME = "paperclip_aes256gcm_v2"
SCHEME_V1 = "paperclip_aes256gcm_v1"
SCHEMES = (SCHEME, SCHEME_V1)
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
KEY_FILE_NAME = "checkpoint_keys"

UnreadableReason = Literal[
    "malformed_envelope", "unknown_key", "key_unavailable", "authentication_failed", "binding"
]


@dataclass(frozen=True, slots=True)
class Binding:
    """The row a part belongs to; every read and write is scoped by it."""

    company_id: UUID
    issue_id: UUID
    run_id: UUID


@dataclass(frozen=True, slots=True)
class Sealed:
    """One part as stored: the columns `scheme`, `key_id`, `nonce`, `ciphertext` of its row."""

    scheme: str
    key_id: str
    nonce: bytes = field(repr=False)
    ciphertext: bytes = field(repr=False)  # GCM's tag is its last 16 bytes


@dataclass(frozen=True, slots=True)
class CheckpointKey:
    key_id: str
    secret: bytes = field(repr=False)
    aead: AESGCM = field(repr=False, compare=False)

    @classmethod
    def from_secret(cls, secret: bytes) -> CheckpointKey:
        if len(secret) != KEY_BYTES:
            raise ValueError(f"a checkpoint key is {KEY_BYTES} bytes, got {len(secret)}")
        return cls(key_id=key_id_for(secret), secret=secret, aead=AESGCM(secret))


@dataclass(frozen=True, slots=True)
class KeyRing:
    keys: tuple[CheckpointKey, ...]
    source: Literal["settings", "file"]

    @property
    def primary(self) -> CheckpointKey:
        return self.keys[0]

    def get(self, key_id: str) -> CheckpointKey | None:
        return next((k for k in self.keys if k.key_id == key_id), None)


class KeyUnavailable(Exception):
    """No key is configured and the key file does not exist (readers never create one)."""


def key_id_for(secret: bytes) -> str:
    return hashlib.sha256(secret).hexdigest()[:12]


KEY_FORMAT = f"{KEY_BYTES} random bytes as base64 (44 characters) or as 64 hex digits"


def parse_key(text: str) -> bytes:
    """A key from its text form: 64 hex digits, or base64 (either alphabet) of 32 bytes.

    ValueError messages say what is wrong without repeating the (possibly secret) text.
    """
    value = text.strip()
    if not value:
        raise ValueError(f"the checkpoint key is empty; expected {KEY_FORMAT}")
    if len(value) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    try:
        padded = value + "=" * (-len(value) % 4)
        secret = base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(
            f"the checkpoint key is neither base64 nor hex ({len(value)} characters); "
            f"expected {KEY_FORMAT}"
        ) from exc
    if len(secret) != KEY_BYTES:
        raise ValueError(
            f"the checkpoint key decodes to {len(secret)} bytes, not {KEY_BYTES}; "
            f"expected {KEY_FORMAT}"
        )
    return secret


def generate_key_text() -> str:
    return base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode("ascii")


def key_file_path() -> Path:
    return Path(settings.DATA_DIR) / KEY_FILE_NAME


def _parse_key_lines(lines: Iterable[str], origin: str) -> tuple[CheckpointKey, ...]:
    keys: list[CheckpointKey] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            keys.append(CheckpointKey.from_secret(parse_key(line)))
        except ValueError as exc:
            # Never echo the line: it may be a (mistyped) secret. The reason never contains it.
            raise ImproperlyConfigured(
                f"{origin}: entry {number} is not a valid key: {exc}"
            ) from exc
    return tuple(keys)


_cache_lock = threading.Lock()
_cache: dict[tuple[Any, ...], KeyRing] = {}


def _file_ring(path: Path) -> KeyRing | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ImproperlyConfigured(f"cannot read the checkpoint key file {path}: {exc}") from exc
    if stat.st_mode & 0o077:
        # Best effort, like upstream: a key file readable by others is tightened, not refused.
        with contextlib.suppress(OSError):
            os.chmod(path, 0o600)
    cache_key = ("file", str(path), stat.st_ino, stat.st_mtime_ns, stat.st_size)
    with _cache_lock:
        cached = _cache.get(cache_key)
    if cached is not None:
        return cached
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ImproperlyConfigured(f"cannot read the checkpoint key file {path}: {exc}") from exc
    keys = _parse_key_lines(text.splitlines(), str(path))
    if not keys:
        raise ImproperlyConfigured(f"{path} holds no checkpoint key")
    ring = KeyRing(keys=keys, source="file")
    with _cache_lock:
        _cache.clear()
        _cache[cache_key] = ring
    return ring


KEY_FILE_HEADER = "# Paperclip checkpoint keys: first line is the primary.\n"


def _create_key_file(path: Path, key_text: str | None = None) -> bool:
    """Create the key file unless it exists, atomically: the key is written and fsynced to a
    private temp file first and then hard-linked into place (link fails if the name exists),
    so a racing process sees either no file or a complete one, and all agree on one key.
    Returns whether this call created it (False: another process's file is kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f"{KEY_FILE_HEADER}{key_text or generate_key_text()}\n"
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process won: use its key
            return False
        _fsync_dir(path.parent)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    """Make a new directory entry durable: parts encrypted under a key must never outlive
    the key file's name after a power loss."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def keyring(*, create: bool = False) -> KeyRing:
    """The configured keys. `create=True` (writers only) creates the key file when missing.

    Raises KeyUnavailable when no key exists and `create` is False; ImproperlyConfigured when a
    configured key is malformed.
    """
    configured = tuple(settings.PAPERCLIP_CHECKPOINT_KEYS or ())
    if configured:
        cache_key = ("settings", configured)
        with _cache_lock:
            cached = _cache.get(cache_key)
        if cached is not None:
            return cached
        keys = _parse_key_lines(configured, "PAPERCLIP_CHECKPOINT_KEYS")
        if not keys:
            raise ImproperlyConfigured("PAPERCLIP_CHECKPOINT_KEYS holds no key")
        ring = KeyRing(keys=keys, source="settings")
        with _cache_lock:
            _cache[cache_key] = ring
        return ring
    path = key_file_path()
    ring_or_none = _file_ring(path)
    if ring_or_none is None and create:
        _create_key_file(path)
        ring_or_none = _file_ring(path)
    if ring_or_none is None:
        raise KeyUnavailable(str(path))
    return ring_or_none


def key_file_prepend_new_key() -> CheckpointKey:
    """Generate a key and make it the key file's primary; the old keys stay for decryption.

    Only for keys kept in the key file. The file is rewritten atomically (temp file with mode
    0600, fsync, rename) under an exclusive flock so two operators cannot lose each other's key.
    A missing file is created like a writer creates it (hard link, never a replace), so a writer
    creating it at the same moment keeps its key either way.
    """
    if settings.PAPERCLIP_CHECKPOINT_KEYS:
        raise ImproperlyConfigured(
            "keys come from PAPERCLIP_CHECKPOINT_KEYS: prepend the new key to that setting"
        )
    path = key_file_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(f".{path.name}.lock")
    lock_fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT, 0o600)
    new_text = generate_key_text()
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        # No file yet: create it the way writers do (link, never replace), so a writer that
        # creates it at the same moment cannot have its key overwritten and lost.
        if _create_key_file(path, new_text):
            return CheckpointKey.from_secret(parse_key(new_text))
        old = path.read_text()
        _parse_key_lines(old.splitlines(), str(path))  # refuse to rewrite a broken file
        body = [line.strip() for line in old.splitlines()]
        body = [line for line in body if line and not line.startswith("#")]
        content = KEY_FILE_HEADER + "\n".join([new_text, *body]) + "\n"
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        os.close(lock_fd)
    return CheckpointKey.from_secret(parse_key(new_text))


def _associated_data(binding: Binding, part: str, key_id: str, scheme: str = SCHEME) -> bytes:
    # JSON array: unambiguous for any part name, unlike a separator-joined string.
    return json.dumps(
        [
            scheme,
            str(binding.company_id),
            str(binding.issue_id),
            str(binding.run_id),
            part,
            key_id,
        ],
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()


def _binding_json(binding: Binding, part: str, **more: str) -> str:
    return json.dumps(
        {
            "companyId": str(binding.company_id),
            "issueId": str(binding.issue_id),
            "runId": str(binding.run_id),
            "part": part,
            **more,
        },
        separators=(",", ":"),
        ensure_ascii=False,
    )


def _plaintext(binding: Binding, part: str, contents: str, scheme: str) -> bytes:
    if scheme == SCHEME_V1:
        return _binding_json(binding, part, contents=contents).encode()
    # Compact JSON never holds a raw newline (it escapes them in strings), so the first
    # newline ends the binding.
    return b"\n".join((_binding_json(binding, part).encode(), contents.encode()))


def encrypt_part(
    binding: Binding, part: str, contents: str, key: CheckpointKey, *, scheme: str = SCHEME
) -> Sealed:
    """One part sealed under `key`, bound to its row (`scheme` other than the current one only
    to make parts as earlier versions wrote them)."""
    plaintext = _plaintext(binding, part, contents, scheme)
    nonce = secrets.token_bytes(NONCE_BYTES)
    ciphertext = key.aead.encrypt(
        nonce, plaintext, _associated_data(binding, part, key.key_id, scheme)
    )
    return Sealed(scheme=scheme, key_id=key.key_id, nonce=nonce, ciphertext=ciphertext)


def _opened(plaintext: bytes, scheme: str) -> tuple[object, object]:
    """(the binding object, the contents) of a decrypted plaintext; ValueError if malformed."""
    if scheme == SCHEME_V1:
        envelope = json.loads(plaintext)
        contents = envelope.get("contents") if isinstance(envelope, dict) else None
        return envelope, contents
    header, newline, body = plaintext.partition(b"\n")
    if not newline:
        raise ValueError("no newline after the binding")
    return json.loads(header), body.decode("utf-8")


def decrypt_part(binding: Binding, part: str, sealed: Sealed, ring: KeyRing | None) -> str:
    """The contents of one stored part; CheckpointUnreadable (naming the part) on any failure.

    `ring=None` means no key is available at all (reported as `key_unavailable`).
    """

    def unreadable(reason: UnreadableReason) -> CheckpointUnreadable:
        return CheckpointUnreadable(part=part, reason=reason, key_id=sealed.key_id or None)

    if (
        sealed.scheme not in SCHEMES
        or not sealed.key_id
        or len(sealed.nonce) != NONCE_BYTES
        or len(sealed.ciphertext) < TAG_BYTES
    ):
        raise unreadable("malformed_envelope")
    if ring is None:
        raise unreadable("key_unavailable")
    key = ring.get(sealed.key_id)
    if key is None:
        raise unreadable("unknown_key")
    try:
        plaintext = key.aead.decrypt(
            sealed.nonce,
            sealed.ciphertext,
            _associated_data(binding, part, sealed.key_id, sealed.scheme),
        )
    except InvalidTag:
        raise unreadable("authentication_failed") from None
    try:
        envelope, contents = _opened(plaintext, sealed.scheme)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError included
        raise unreadable("binding") from None
    if (
        not isinstance(envelope, dict)
        or envelope.get("companyId") != str(binding.company_id)
        or envelope.get("issueId") != str(binding.issue_id)
        or envelope.get("runId") != str(binding.run_id)
        or envelope.get("part") != part
        or not isinstance(contents, str)
    ):
        raise unreadable("binding")
    return contents


def read_keyring() -> KeyRing | None:
    """The keys for decryption, or None when none exist (never creates the key file)."""
    try:
        return keyring(create=False)
    except KeyUnavailable:
        return None
