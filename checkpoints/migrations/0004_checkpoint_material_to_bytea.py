"""Checkpoint parts as bytes, step 2 of 3: move each row's envelope between the `material`
jsonb (`{scheme, keyId, nonce: base64, ciphertext: base64}`) and the sealed columns, both ways.

Rows are converted in batches in primary-key order (keyset pagination), never the whole table
at once: a part may be megabytes. Nothing is decrypted, so no key is needed and the ciphertext
and its binding are untouched. An envelope that was already unreadable as malformed (missing
fields, bad base64) stays malformed: its columns get what can be kept (empty bytes otherwise),
which the reader reports as `malformed_envelope` exactly as before.
"""

import base64
import binascii

from django.db import migrations

# Rows per batch. A part is at most PAPERCLIP_CHECKPOINT_MAX_PART_BYTES (8 MiB by default), so
# a batch holds at most a few hundred MiB even in the worst case; typical parts are far smaller.
BATCH_SIZE = 32
SEALED = ("scheme", "key_id", "nonce", "ciphertext")


def _b64(value: object) -> bytes:
    if not isinstance(value, str):
        return b""
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return b""


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _batches(model, fields):
    last = None
    while True:
        rows = model.objects.order_by("pk")
        if last is not None:
            rows = rows.filter(pk__gt=last)
        batch = list(rows.only(*fields)[:BATCH_SIZE])
        if not batch:
            return
        yield batch
        last = batch[-1].pk


def material_to_columns(apps, schema_editor):
    model = apps.get_model("checkpoints", "NativeRunnerCheckpoint")
    for batch in _batches(model, ["material"]):
        for row in batch:
            material = row.material if isinstance(row.material, dict) else {}
            row.scheme = _text(material.get("scheme"))
            row.key_id = _text(material.get("keyId"))
            row.nonce = _b64(material.get("nonce"))
            row.ciphertext = _b64(material.get("ciphertext"))
        model.objects.bulk_update(batch, SEALED)


def columns_to_material(apps, schema_editor):
    model = apps.get_model("checkpoints", "NativeRunnerCheckpoint")
    for batch in _batches(model, SEALED):
        for row in batch:
            row.material = {
                "scheme": row.scheme,
                "keyId": row.key_id,
                "nonce": base64.b64encode(bytes(row.nonce)).decode("ascii"),
                "ciphertext": base64.b64encode(bytes(row.ciphertext)).decode("ascii"),
            }
        model.objects.bulk_update(batch, ["material"])


class Migration(migrations.Migration):

    dependencies = [
        ('checkpoints', '0003_checkpoint_sealed_columns'),
    ]

    operations = [
        migrations.RunPython(material_to_columns, columns_to_material, elidable=False),
    ]
