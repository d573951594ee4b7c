"""The read-only admin of checkpoint parts never shows contents or ciphertext."""

from __future__ import annotations

import base64

import pytest
from django.contrib.auth.models import Permission
from django.test import Client

from checkpoints.models import NativeRunnerCheckpoint
from checkpoints.services import checkpoint_write
from tests.checkpoints.factories import coordinator, lease, owner_of
from tests.paperclip.factories import BoardMembershipFactory, UserFactory

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
    assert row.key_id in page
    detail = client.get(f"/admin/checkpoints/nativerunnercheckpoint/{row.pk}/change/")
    assert detail.status_code == 200
    for response in (listing, detail):
        text = response.content.decode()
        assert "TOP-SECRET-CONTENTS" not in text
        assert bytes(row.ciphertext)[:16].hex() not in text
        assert base64.b64encode(bytes(row.ciphertext))[:16].decode() not in text
    assert client.get("/admin/checkpoints/nativerunnercheckpoint/add/").status_code == 403
    assert (
        client.post(f"/admin/checkpoints/nativerunnercheckpoint/{row.pk}/delete/").status_code
        == 403
    )
    assert NativeRunnerCheckpoint.objects.filter(pk=row.pk).exists()


def _part_in_new_company(contents: str = "x") -> NativeRunnerCheckpoint:
    fin = coordinator()
    checkpoint_write(
        run_id=fin.run_id,
        agent_id=fin.run.agent_id,
        owner=owner_of(lease(fin.run)),
        reset=False,
        changed={"header": contents},
        removed=[],
        work_command_ids=[],
        predecessor=None,
    )
    return NativeRunnerCheckpoint.objects.get(run=fin.run)


def test_board_staff_see_only_their_companies_parts(client: Client) -> None:
    mine = _part_in_new_company()
    theirs = _part_in_new_company()
    user = UserFactory()  # staff, not superuser
    user.user_permissions.add(Permission.objects.get(codename="view_nativerunnercheckpoint"))
    BoardMembershipFactory(user=user, company=mine.company)
    client.force_login(user)
    listing = client.get("/admin/checkpoints/nativerunnercheckpoint/")
    assert listing.status_code == 200
    page = listing.content.decode()
    assert str(mine.run_id) in page
    assert str(theirs.run_id) not in page
    assert theirs.company.name not in page  # not even offered as a filter choice
    assert (
        client.get(f"/admin/checkpoints/nativerunnercheckpoint/{mine.pk}/change/").status_code
        == 200
    )
    other = client.get(f"/admin/checkpoints/nativerunnercheckpoint/{theirs.pk}/change/")
    assert other.status_code == 302  # the admin's "does not exist" redirect
    searched = client.get("/admin/checkpoints/nativerunnercheckpoint/", {"q": str(theirs.run_id)})
    assert searched.status_code == 200
    assert "0 results" in searched.content.decode()
