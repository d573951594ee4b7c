"""The admin actions' per-item loop as a plain function (paperclip/admin/toolkit.py
`act_on_each`): every item is tried, a domain error fails that item alone and names it with its
code and why, and each outcome is counted. No database, no request."""

from __future__ import annotations

import pytest

from paperclip.admin.toolkit import act_on_each
from paperclip.errors import NotFoundError, PermissionDenied


def test_every_item_is_tried_and_each_failure_names_its_item_and_code() -> None:
    tried: list[int] = []

    def act(item: int) -> str:
        tried.append(item)
        if item == 2:
            raise NotFoundError()
        if item == 4:
            raise PermissionDenied()
        return "changed" if item % 2 else "unchanged"

    done = act_on_each([1, 2, 3, 4, 5, 6], act, name=lambda item: f"#{item}")
    assert tried == [1, 2, 3, 4, 5, 6]
    assert done.counts == {"changed": 3, "unchanged": 1}
    assert done.failed == [
        "#2: not_found (Not found)",
        "#4: permission_denied (You do not have permission to perform this action)",
    ]


def test_an_error_that_is_not_a_domain_error_is_not_swallowed() -> None:
    def act(item: int) -> str:
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError):
        act_on_each([1], act, name=str)
