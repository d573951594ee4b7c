"""The read-only admin of checkpoint parts never shows contents or ciphertext."""

from __future__ import annotations

import pytest
from django.test import Client

from checkpoints.models import NativeRunnerCheckpoint
from checkpoints.services import checkpoint_write
from tests.checkpoints.factories import coordinator, lease, owner_of
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def test_admin_lists_metadata_only_and_is_read_only(client: Client) -> None:
    fin = coordinator()
    checkpoint_write(
        run_id=fin.run_id,
        agent_id=fin.run.agent_id,
        owner=owner_of(lease(fin.run)),
        reset=False,
        changed={"header": "TOP-SECRET-CONTENTS"},
        removed=[],
        work_command_ids=[],
        predecessor=None,
    )
    row = NativeRunnerCheckpoint.objects.get()
    client.force_login(UserFactory(is_superuser=True))
    listing = client.get("/admin/checkpoints/nativerunnercheckpoint/")
    assert listing.status_code == 200
    page = listing.content.decode()
    assert "header" in page
    assert row.material["keyId"] in page
    detail = client.get(f"/admin/checkpoints/nativerunnercheckpoint/{row.pk}/change/")
    assert detail.status_code == 200
    for response in (listing, detail):
        text = response.content.decode()
        assert "TOP-SECRET-CONTENTS" not in text
        assert row.material["ciphertext"][:16] not in text
    assert client.get("/admin/checkpoints/nativerunnercheckpoint/add/").status_code == 403
    assert (
        client.post(f"/admin/checkpoints/nativerunnercheckpoint/{row.pk}/delete/").status_code
        == 403
    )
    assert NativeRunnerCheckpoint.objects.filter(pk=row.pk).exists()
