"""Encryption at rest: binding, tamper detection, keys, the key file and rotation."""

from __future__ import annotations

import base64
import dataclasses
import json
import stat
import subprocess
import uuid
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command

from checkpoints.crypto import (
    SCHEME,
    SCHEME_V1,
    Binding,
    CheckpointKey,
    KeyRing,
    Sealed,
    _associated_data,
    decrypt_part,
    encrypt_part,
    key_file_path,
    key_file_prepend_new_key,
    key_id_for,
    keyring,
    parse_key,
    read_keyring,
)
from checkpoints.errors import CheckpointUnreadable
from checkpoints.models import SEALED_FIELDS, NativeRunnerCheckpoint
from checkpoints.selectors import checkpoint_load, runner_run_get
from checkpoints.services import checkpoint_key_rotate_batch, checkpoint_write
from paperclip.models import ActivityEvent
from tests.checkpoints.factories import OLD_KEY, TEST_KEY, coordinator, lease, owner_of

B1 = Binding(uuid.uuid4(), uuid.uuid4(), uuid.uuid4())
KEY = CheckpointKey.from_secret(parse_key(TEST_KEY))


def unreadable_reason(binding: Binding, part: str, material: Any) -> str:
    with pytest.raises(CheckpointUnreadable) as exc:
        decrypt_part(binding, part, material, keyring())
    assert exc.value.details["part"] == part
    return str(exc.value.details["reason"])


def test_round_trip_and_fresh_nonce_per_encryption() -> None:
    a = encrypt_part(B1, "header", "contents", KEY)
    b = encrypt_part(B1, "header", "contents", KEY)
    assert a.nonce != b.nonce
    assert a.ciphertext != b.ciphertext
    assert len(a.nonce) == 12
    assert a.key_id == KEY.key_id
    assert decrypt_part(B1, "header", a, keyring()) == "contents"


@pytest.mark.parametrize(
    "moved_to",
    [
        ("other part", B1, "log"),
        ("other run", Binding(B1.company_id, B1.issue_id, uuid.uuid4()), "header"),
        ("other issue", Binding(B1.company_id, uuid.uuid4(), B1.run_id), "header"),
        ("other company", Binding(uuid.uuid4(), B1.issue_id, B1.run_id), "header"),
    ],
)
def test_ciphertext_moved_to_another_row_fails_authentication(moved_to: tuple[Any, ...]) -> None:
    _, binding, part = moved_to
    material = encrypt_part(B1, "header", "secret", KEY)
    assert unreadable_reason(binding, part, material) == "authentication_failed"


def test_key_id_is_bound_too() -> None:
    """The key id is authenticated, not only used to pick the key: the same secret filed
    under a second id decrypts nothing relabelled to that id. (Relabelling to another key's
    id proves nothing here: that key fails to decrypt whatever the bound data holds.)"""
    alias = CheckpointKey(key_id="alias-of-the-same-secret", secret=KEY.secret, aead=KEY.aead)
    material = encrypt_part(B1, "p", "x", KEY)
    relabelled = dataclasses.replace(material, key_id=alias.key_id)
    ring = type(keyring())(keys=(KEY, alias), source="settings")
    assert decrypt_part(B1, "p", material, ring) == "x"
    with pytest.raises(CheckpointUnreadable) as exc:
        decrypt_part(B1, "p", relabelled, ring)
    assert exc.value.details["reason"] == "authentication_failed"


@pytest.mark.parametrize("field", ["ciphertext", "nonce"])
def test_a_flipped_bit_is_rejected(field: str) -> None:
    material = encrypt_part(B1, "p", "contents", KEY)
    raw = bytearray(getattr(material, field))
    raw[len(raw) // 2] ^= 0x01
    tampered = dataclasses.replace(material, **{field: bytes(raw)})
    assert unreadable_reason(B1, "p", tampered) == "authentication_failed"


@pytest.mark.parametrize(
    "change",
    [
        {"scheme": "local_encrypted_v1"},
        {"scheme": ""},
        {"nonce": bytes(11)},
        {"ciphertext": bytes(15)},  # shorter than GCM's tag
    ],
)
def test_malformed_envelopes_are_unreadable_not_crashes(change: dict[str, Any]) -> None:
    material = dataclasses.replace(encrypt_part(B1, "p", "x", KEY), **change)
    assert unreadable_reason(B1, "p", material) == "malformed_envelope"


def test_unknown_key_is_reported(settings: Any) -> None:
    material = encrypt_part(B1, "p", "x", KEY)
    settings.PAPERCLIP_CHECKPOINT_KEYS = [OLD_KEY]
    assert unreadable_reason(B1, "p", material) == "unknown_key"


def test_key_formats() -> None:
    secret = bytes(range(32))
    assert parse_key(secret.hex()) == secret
    assert parse_key(base64.b64encode(secret).decode()) == secret
    assert parse_key(base64.urlsafe_b64encode(secret).decode().rstrip("=")) == secret
    for bad in ["", "short", base64.b64encode(b"x" * 31).decode()]:
        with pytest.raises(ValueError, match="checkpoint key"):
            parse_key(bad)


def test_key_file_is_created_0600_by_writers_only(settings: Any) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = []
    path = key_file_path()
    assert read_keyring() is None  # reading never creates the file
    assert not path.exists()
    ring = keyring(create=True)
    assert ring.source == "file"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert keyring(create=True).primary.key_id == ring.primary.key_id  # stable, not re-created
    assert read_keyring() is not None


@pytest.mark.django_db
def test_new_key_is_prepended_and_old_keys_still_decrypt(settings: Any) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = []
    first = keyring(create=True).primary
    material = encrypt_part(B1, "p", "x", first)
    out = StringIO()
    call_command("rotate_checkpoint_key", "--new-key", stdout=out)
    ring = keyring()
    assert [k.key_id for k in ring.keys] == [ring.primary.key_id, first.key_id]
    assert ring.primary.key_id != first.key_id
    assert stat.S_IMODE(Path(key_file_path()).stat().st_mode) == 0o600
    assert decrypt_part(B1, "p", material, ring) == "x"
    assert f"new primary key {ring.primary.key_id}" in out.getvalue()


@pytest.mark.django_db
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_deployment_with_no_checkpoint_yet_has_nothing_to_rotate(
    settings: Any, dry_run: bool
) -> None:
    """A fresh deployment has no key file until its first checkpoint write: the rotation (its
    dry run first, as the runbook says) answers 0 parts, not an error (found trying the
    runbook as a new operator)."""
    settings.PAPERCLIP_CHECKPOINT_KEYS = []
    out = StringIO()
    call_command("rotate_checkpoint_key", *(["--dry-run"] if dry_run else []), stdout=out)
    assert "no checkpoint key yet" in out.getvalue()
    assert "0 part(s) stored" in out.getvalue()
    assert not key_file_path().exists()


def test_new_key_refused_when_keys_come_from_settings() -> None:
    with pytest.raises(CommandError, match="PAPERCLIP_CHECKPOINT_KEYS"):
        call_command("rotate_checkpoint_key", "--new-key", stdout=StringIO())


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ("not-a-key!", "neither base64 nor hex"),
        (base64.b64encode(b"k" * 31).decode(), "decodes to 31 bytes, not 32"),
        ("ab" * 33, "decodes to 49 bytes, not 32"),
    ],
)
def test_invalid_configured_key_is_a_clear_configuration_error(
    settings: Any, entry: str, reason: str
) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = [TEST_KEY, entry]
    with pytest.raises(ImproperlyConfigured) as exc:
        keyring()
    message = str(exc.value)
    assert message.startswith("PAPERCLIP_CHECKPOINT_KEYS: entry 2 is not a valid key: ")
    assert reason in message
    assert "base64 (44 characters) or as 64 hex digits" in message
    assert entry not in message  # a mistyped secret is never echoed


def test_a_key_file_readable_by_others_is_tightened_on_read(settings: Any) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = []
    path = key_file_path()
    path.parent.mkdir(parents=True)
    path.write_text(f"{OLD_KEY}\n")
    path.chmod(0o644)
    assert read_keyring() is not None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_key_file_whose_mode_cannot_be_tightened_is_still_read(settings: Any) -> None:
    """Tightening is best effort: a key file that refuses chmod (here immutable, which even
    root can't chmod) is read as it is."""
    settings.PAPERCLIP_CHECKPOINT_KEYS = []
    path = key_file_path()
    path.parent.mkdir(parents=True)
    path.write_text(f"{OLD_KEY}\n")
    path.chmod(0o644)
    try:
        made_immutable = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    except FileNotFoundError:
        pytest.skip("chattr is not installed")
    if made_immutable.returncode != 0:
        pytest.skip("chattr +i needs CAP_LINUX_IMMUTABLE and a filesystem that has the flag")
    try:
        with pytest.raises(PermissionError):
            path.chmod(0o600)
        ring = read_keyring()
        assert ring is not None
        assert [k.key_id for k in ring.keys] == [key_id_for(parse_key(OLD_KEY))]
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_new_key_on_a_fresh_data_dir_creates_the_file_with_that_key_only(settings: Any) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = []
    key = key_file_prepend_new_key()
    path = key_file_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [k.key_id for k in keyring().keys] == [key.key_id]
    again = key_file_prepend_new_key()
    assert [k.key_id for k in keyring().keys] == [again.key_id, key.key_id]


# --- rotation over stored parts -------------------------------------------------------------


def _write_parts(count: int) -> Any:
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    checkpoint_write(
        run_id=fin.run_id,
        agent_id=fin.run.agent_id,
        owner=owner,
        reset=False,
        changed={f"p{i}": f"contents {i}" for i in range(count)},
        removed=[],
        work_command_ids=[],
        predecessor=None,
    )
    return fin


@pytest.mark.django_db
def test_rotation_reencrypts_everything_keeps_it_readable_and_audits_per_batch(
    settings: Any,
) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = [OLD_KEY]
    fin = _write_parts(5)
    other = _write_parts(2)
    old_id = CheckpointKey.from_secret(parse_key(OLD_KEY)).key_id
    settings.PAPERCLIP_CHECKPOINT_KEYS = [TEST_KEY, OLD_KEY]
    out = StringIO()
    call_command("rotate_checkpoint_key", "--batch-size", "3", stdout=out)
    text = out.getvalue()
    assert "7 part(s) under other keys" in text
    assert "batch 3: re-encrypted 1" in text
    assert "0 part(s) remain under other keys" in text
    key_ids = set(NativeRunnerCheckpoint.objects.values_list("key_id", flat=True))
    assert key_ids == {KEY.key_id}
    assert ActivityEvent.objects.filter(action="checkpoint_key.rotated").count() == 3
    # Readable with the new primary alone: nothing is left under the old key.
    settings.PAPERCLIP_CHECKPOINT_KEYS = [TEST_KEY]
    binding = runner_run_get(run_id=fin.run_id, agent_id=None).binding
    assert checkpoint_load(binding=binding) == {f"p{i}": f"contents {i}" for i in range(5)}
    assert (
        len(checkpoint_load(binding=runner_run_get(run_id=other.run_id, agent_id=None).binding))
        == 2
    )
    assert old_id not in key_ids


@pytest.mark.django_db
def test_rotation_resumes_after_an_interruption_and_is_idempotent(settings: Any) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = [OLD_KEY]
    _write_parts(4)
    settings.PAPERCLIP_CHECKPOINT_KEYS = [TEST_KEY, OLD_KEY]
    first = checkpoint_key_rotate_batch(after_id=None, batch_size=3)  # then "crash"
    assert first.reencrypted == 3
    out = StringIO()
    call_command("rotate_checkpoint_key", stdout=out)
    assert "1 part(s) under other keys" in out.getvalue()
    again = StringIO()
    call_command("rotate_checkpoint_key", stdout=again)
    assert "0 part(s) under other keys" in again.getvalue()
    assert ActivityEvent.objects.filter(action="checkpoint_key.rotated").count() == 2


@pytest.mark.django_db
def test_rotation_reports_parts_whose_key_is_lost_and_leaves_them(settings: Any) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = [OLD_KEY]
    _write_parts(2)
    rows = NativeRunnerCheckpoint.objects.order_by("part")
    before = list(rows.values_list("part", *SEALED_FIELDS))
    settings.PAPERCLIP_CHECKPOINT_KEYS = [TEST_KEY]  # the old key is gone
    out = StringIO()
    with pytest.raises(CommandError, match="2 part"):
        call_command("rotate_checkpoint_key", stdout=out)
    # Each lost part is named, and left exactly as it was.
    assert "unreadable part 'p0'" in out.getvalue()
    assert "unreadable part 'p1'" in out.getvalue()
    assert list(rows.values_list("part", *SEALED_FIELDS)) == before
    assert not ActivityEvent.objects.filter(action="checkpoint_key.rotated").exists()


@pytest.mark.django_db
def test_a_rotation_batch_is_bounded_by_bytes_but_always_progresses(settings: Any) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = [OLD_KEY]
    fin = _write_parts(5)  # "contents 0" .. "contents 4": 10 bytes each
    settings.PAPERCLIP_CHECKPOINT_KEYS = [TEST_KEY, OLD_KEY]
    first = checkpoint_key_rotate_batch(after_id=None, batch_size=100, max_bytes=25)
    assert (first.scanned, first.reencrypted) == (2, 2)
    tiny = checkpoint_key_rotate_batch(after_id=first.last_id, batch_size=100, max_bytes=1)
    assert (tiny.scanned, tiny.reencrypted) == (1, 1)  # one part even over the budget
    rest = checkpoint_key_rotate_batch(after_id=tiny.last_id, batch_size=100)
    assert (rest.scanned, rest.reencrypted) == (2, 2)
    assert checkpoint_key_rotate_batch(after_id=rest.last_id, batch_size=100).scanned == 0
    settings.PAPERCLIP_CHECKPOINT_KEYS = [TEST_KEY]
    binding = runner_run_get(run_id=fin.run_id, agent_id=None).binding
    assert checkpoint_load(binding=binding) == {f"p{i}": f"contents {i}" for i in range(5)}


# --- found by `make mutate` (docs/testing.md) ------------------------------------------------


def test_both_base64_alphabets_are_read_and_stray_characters_are_refused() -> None:
    secret = b"\xfb\xff" * 16  # encodes with + and / (standard), - and _ (urlsafe)
    standard = base64.b64encode(secret).decode()
    assert {"+", "/"} <= set(standard)
    assert parse_key(standard) == secret
    assert parse_key(base64.urlsafe_b64encode(secret).decode()) == secret
    # A lenient decoder would drop the stray character and accept 32 bytes.
    with pytest.raises(ValueError, match="neither base64 nor hex"):
        parse_key(standard[:20] + "!" + standard[20:])


@pytest.mark.parametrize(
    "missing", [{"key_id": ""}, {"nonce": b""}, {"ciphertext": b""}], ids=lambda m: next(iter(m))
)
def test_an_envelope_missing_any_one_field_is_malformed(missing: dict[str, Any]) -> None:
    material = dataclasses.replace(encrypt_part(B1, "p", "x", KEY), **missing)
    assert unreadable_reason(B1, "p", material) == "malformed_envelope"


@pytest.mark.django_db
def test_a_rewritten_key_file_and_its_lock_are_private_before_anything_reads_them(
    settings: Any,
) -> None:
    """Checked before any read: reading tightens a too-open key file, which would hide a
    rewrite that created it open."""
    settings.PAPERCLIP_CHECKPOINT_KEYS = []
    key_file_prepend_new_key()  # creates the file (by link)
    key_file_prepend_new_key()  # rewrites it (temp file, rename)
    path = key_file_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lock = path.with_name(f".{path.name}.lock")
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600


def test_a_rewrite_keeps_one_header_and_only_the_keys(settings: Any) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = []
    path = key_file_path()
    path.parent.mkdir(parents=True)
    path.write_text(f"# my note\n\n{OLD_KEY}\n")
    path.chmod(0o600)
    new = key_file_prepend_new_key()
    again = key_file_prepend_new_key()
    lines = path.read_text().splitlines()
    assert lines[0].startswith("#")
    assert [line for line in lines if line.startswith("#")] == [lines[0]]
    assert "" not in lines
    assert len(lines) == 4  # the header and three keys
    assert [k.key_id for k in keyring().keys] == [
        again.key_id,
        new.key_id,
        CheckpointKey.from_secret(parse_key(OLD_KEY)).key_id,
    ]


# Written by this code (a fixed key, a non-ASCII part name and contents): every part stored so
# far must stay readable, so the bound data's exact bytes (compact separators, UTF-8 rather than
# \u escapes) are part of the format, not a detail.
GOLDEN_KEY = CheckpointKey.from_secret(bytes(range(32)))
GOLDEN_BINDING = Binding(
    uuid.UUID("11111111-1111-4111-8111-111111111111"),
    uuid.UUID("22222222-2222-4222-8222-222222222222"),
    uuid.UUID("33333333-3333-4333-8333-333333333333"),
)
# Written as base64 (the form parts were stored in before the bytea columns), decoded here.
GOLDEN = Sealed(
    scheme="paperclip_aes256gcm_v1",
    key_id="630dcd2966c4",
    nonce=base64.b64decode("Cph3zv/L3/tAGw0H"),
    ciphertext=base64.b64decode(
        "ReuDPF5vBXxKy7uNkn/Qb9eRkVdsMucHl3AY3sHiiff9G5FQaEezu+oBlFKeoGZ1whYpGS/WUpb5ynFv6jZII+n8"
        "i4apjff0BQVflMCf1wqe8rYQ1XqXUs5JRvHN+d2VuS95aWVRwoHyI4U47132ISoUO5dAVL9q8hRlW8hxsaQyxx0o"
        "iWoOYzGhwDTcp9UIa+poCSBoHJk2k0mMY0YG2CfiVauVO3UVb/3gc/C5RC42R6SrNhsL3OQvbpdYJYe5bjjTZmec"
        "42zLTQ=="
    ),
)


# The same, sealed as v2 (the binding as JSON, a newline, the contents' bytes).
GOLDEN_V2 = Sealed(
    scheme="paperclip_aes256gcm_v2",
    key_id="630dcd2966c4",
    nonce=base64.b64decode("Cpj3zv/73/tAGw0H"),
    ciphertext=base64.b64decode(
        "pm/BpCXqJoWmph3h74qfPnito3JpiUuCwccZOPZaMWyC6F6kWoH6nsooRkT3E2yOPnNJNzKO64GJaBLaKWXXt7vV"
        "uIU+x0xQrwoP71RCG8/pTJYciAwq5s2gblqh3ViTtUQNA2HDJSOgpCzjUFa0b8v38yegho8Vtoh7G5RC1HadWADl"
        "FmYS8H0PwZ82T2/CZSJy6wz7b1OYl4SPJFckGdE81jR3c0VgfYeLrCylDJNfcJMCJYjDzRvDxI/XCxaTWZsbxw=="
    ),
)


@pytest.mark.parametrize(
    ("sealed", "contents"), [(GOLDEN, "contents é"), (GOLDEN_V2, 'contents é\n"line"')]
)
def test_a_part_written_before_stays_readable_byte_for_byte(sealed: Sealed, contents: str) -> None:
    ring = KeyRing(keys=(GOLDEN_KEY,), source="settings")
    assert decrypt_part(GOLDEN_BINDING, "hé", sealed, ring) == contents
    with pytest.raises(CheckpointUnreadable) as caught:
        decrypt_part(GOLDEN_BINDING, "he", sealed, ring)
    assert caught.value.details["reason"] == "authentication_failed"


def test_new_parts_are_v2_and_v1_parts_stay_readable() -> None:
    v2 = encrypt_part(B1, "p", 'a "quoted"\nline é', KEY)
    v1 = encrypt_part(B1, "p", 'a "quoted"\nline é', KEY, scheme=SCHEME_V1)
    assert v2.scheme == SCHEME != SCHEME_V1 == v1.scheme
    assert decrypt_part(B1, "p", v2, keyring()) == 'a "quoted"\nline é'
    assert decrypt_part(B1, "p", v1, keyring()) == 'a "quoted"\nline é'
    # The scheme is authenticated: a part relabelled to the other one fails to decrypt.
    for sealed, other in ((v2, SCHEME_V1), (v1, SCHEME)):
        relabelled = dataclasses.replace(sealed, scheme=other)
        assert unreadable_reason(B1, "p", relabelled) == "authentication_failed"


@pytest.mark.parametrize(
    "wrong", [{"companyId": "c"}, {"issueId": "i"}, {"runId": "r"}, {"part": "q"}, {"contents": 1}]
)
def test_an_authentic_envelope_naming_another_row_is_refused(wrong: dict[str, Any]) -> None:
    """Defence in depth behind the bound data: even a ciphertext made with the key and the
    row's own bound data is refused when the envelope inside names another row."""
    envelope = {
        "companyId": str(B1.company_id),
        "issueId": str(B1.issue_id),
        "runId": str(B1.run_id),
        "part": "p",
        "contents": "x",
        **wrong,
    }
    nonce = bytes(12)
    ciphertext = KEY.aead.encrypt(
        nonce, json.dumps(envelope).encode(), _associated_data(B1, "p", KEY.key_id, SCHEME_V1)
    )
    material = Sealed(SCHEME_V1, KEY.key_id, nonce, ciphertext)
    assert unreadable_reason(B1, "p", material) == "binding"
    # v2: the binding before the newline, the contents after it.
    contents = envelope.pop("contents")
    body = contents.encode() if isinstance(contents, str) else b"\xff"  # not UTF-8
    plaintext = json.dumps(envelope).encode() + b"\n" + body
    ciphertext = KEY.aead.encrypt(nonce, plaintext, _associated_data(B1, "p", KEY.key_id))
    assert unreadable_reason(B1, "p", Sealed(SCHEME, KEY.key_id, nonce, ciphertext)) == "binding"


def test_a_v2_plaintext_without_its_newline_is_refused() -> None:
    plaintext = json.dumps(
        {
            "companyId": str(B1.company_id),
            "issueId": str(B1.issue_id),
            "runId": str(B1.run_id),
            "part": "p",
        }
    ).encode()
    ciphertext = KEY.aead.encrypt(bytes(12), plaintext, _associated_data(B1, "p", KEY.key_id))
    sealed = Sealed(SCHEME, KEY.key_id, bytes(12), ciphertext)
    assert unreadable_reason(B1, "p", sealed) == "binding"


@pytest.mark.parametrize("create", ["writer", "operator"])
def test_the_key_file_is_created_under_a_data_dir_whose_parents_are_missing_too(
    settings: Any, tmp_path: Path, create: str
) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = []
    settings.DATA_DIR = tmp_path / "not" / "there" / "yet"
    key = keyring(create=True).primary if create == "writer" else key_file_prepend_new_key()
    assert key_file_path().is_file()
    assert [k.key_id for k in keyring().keys] == [key.key_id]
