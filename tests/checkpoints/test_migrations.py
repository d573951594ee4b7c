"""The move of checkpoint parts from base64 in `material` jsonb to bytea columns
(checkpoints/migrations/0003 to 0005), forward and back, on a table with rows."""

from __future__ import annotations

import base64
import importlib
from collections.abc import Iterator
from typing import Any

import pytest
from django.apps.registry import Apps
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test.utils import CaptureQueriesContext

from checkpoints.crypto import SCHEME_V1, Binding, Sealed, decrypt_part, encrypt_part, keyring
from checkpoints.errors import CheckpointUnreadable
from checkpoints.models import NativeRunnerCheckpoint
from checkpoints.selectors import checkpoint_load, checkpoint_parts_list, runner_run_get
from tests.checkpoints.factories import coordinator

BEFORE = ("checkpoints", "0002_checkpoint_work")
LATEST = ("checkpoints", "0005_checkpoint_drop_material")
CONVERSION = importlib.import_module("checkpoints.migrations.0004_checkpoint_material_to_bytea")


def migrate(target: tuple[str, str]) -> Apps:
    executor = MigrationExecutor(connection)
    executor.migrate([target])
    return MigrationExecutor(connection).loader.project_state([target]).apps


@pytest.fixture
def at_latest_afterwards() -> Iterator[None]:
    try:
        yield
    finally:
        migrate(LATEST)


def old_material(binding: Binding, part: str, contents: str) -> dict[str, str]:
    """A part as the code before the bytea columns stored it."""
    sealed = encrypt_part(binding, part, contents, keyring(create=True).primary, scheme=SCHEME_V1)
    return {
        "scheme": sealed.scheme,
        "keyId": sealed.key_id,
        "nonce": base64.b64encode(sealed.nonce).decode("ascii"),
        "ciphertext": base64.b64encode(sealed.ciphertext).decode("ascii"),
    }


@pytest.mark.django_db(transaction=True)
def test_parts_move_from_jsonb_to_bytea_and_back_in_batches(
    at_latest_afterwards: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(CONVERSION, "BATCH_SIZE", 8)
    good, bad = coordinator(), coordinator()
    binding = runner_run_get(run_id=good.run_id, agent_id=None).binding
    bad_binding = runner_run_get(run_id=bad.run_id, agent_id=None).binding
    contents = {f"p{i:02d}": f"contents {i} é" for i in range(40)}
    contents["big"] = "z" * (64 * 1024)

    old = migrate(BEFORE).get_model("checkpoints", "NativeRunnerCheckpoint")
    written: dict[str, Any] = {}
    for part, text in contents.items():
        written[part] = old_material(binding, part, text)
        old.objects.create(
            company_id=binding.company_id,
            issue_id=binding.issue_id,
            run_id=binding.run_id,
            part=part,
            material=written[part],
            size_bytes=len(text.encode()),
        )
    # Already unreadable before (a stray character in the base64): it must stay unreadable.
    broken = {**old_material(bad_binding, "header", "h"), "nonce": "!!"}
    old.objects.create(
        company_id=bad_binding.company_id,
        issue_id=bad_binding.issue_id,
        run_id=bad_binding.run_id,
        part="header",
        material=broken,
        size_bytes=1,
    )

    with CaptureQueriesContext(connection) as queries:
        migrate(LATEST)
    batches = [q for q in queries.captured_queries if "LIMIT 8" in q["sql"]]
    assert len(batches) == 7  # 42 rows: 6 batches of at most 8, then the empty one that ends

    assert checkpoint_load(binding=binding) == contents
    row = NativeRunnerCheckpoint.objects.get(run_id=binding.run_id, part="big")
    assert bytes(row.ciphertext) == base64.b64decode(written["big"]["ciphertext"])
    assert {p.key_id for p in checkpoint_parts_list(binding=binding)} == {keyring().primary.key_id}
    with pytest.raises(CheckpointUnreadable) as caught:
        checkpoint_load(binding=bad_binding)
    assert caught.value.details["reason"] == "malformed_envelope"

    old = migrate(BEFORE).get_model("checkpoints", "NativeRunnerCheckpoint")
    back = dict(old.objects.filter(run_id=binding.run_id).values_list("part", "material"))
    assert back == written  # byte for byte the envelopes that were there
    for part, material in back.items():
        sealed = Sealed(
            material["scheme"],
            material["keyId"],
            base64.b64decode(material["nonce"]),
            base64.b64decode(material["ciphertext"]),
        )
        assert decrypt_part(binding, part, sealed, keyring()) == contents[part]
    still_broken = old.objects.get(run_id=bad_binding.run_id).material
    assert still_broken["scheme"] == SCHEME_V1
    assert still_broken["nonce"] == ""  # malformed (not 12 bytes) as before
