"""The owner receipt's strict reading (paperclip/receipts.py) of the kernel boot id and the
start ticks: optional, since receipts written before them have none, but never damaged."""

from __future__ import annotations

from typing import Any

import pytest

from paperclip.receipts import read_owner

RECEIPT = {
    "token": "t-1",
    "controllerBootId": "c-1",
    "hostname": "ctl-3",
    "pid": 4242,
    "processStartedAt": "2026-11-29T12:00:00.123456+00:00",
}


def test_the_kernel_boot_id_is_read() -> None:
    owner = read_owner({**RECEIPT, "kernelBootId": "3c89d313-8d71-4341-ab24-dd3696470a0f"})
    assert owner is not None
    assert owner.kernel_boot_id == "3c89d313-8d71-4341-ab24-dd3696470a0f"


@pytest.mark.parametrize("extra", [{}, {"kernelBootId": None}])
def test_a_receipt_without_a_kernel_boot_id_stays_readable(extra: dict[str, Any]) -> None:
    owner = read_owner({**RECEIPT, **extra})
    assert owner is not None
    assert owner.kernel_boot_id is None


@pytest.mark.parametrize("damaged", ["", 42, True, ["3c89"], {"id": "3c89"}])
def test_a_damaged_kernel_boot_id_makes_the_receipt_unreadable(damaged: Any) -> None:
    # Read as "absent", it would let the receipt be judged by host name alone.
    assert read_owner({**RECEIPT, "kernelBootId": damaged}) is None


def test_the_start_ticks_are_read() -> None:
    owner = read_owner({**RECEIPT, "processStartTicks": 123456})
    assert owner is not None
    assert owner.process_start_ticks == 123456


@pytest.mark.parametrize("extra", [{}, {"processStartTicks": None}])
def test_a_receipt_without_start_ticks_stays_readable(extra: dict[str, Any]) -> None:
    owner = read_owner({**RECEIPT, **extra})
    assert owner is not None
    assert owner.process_start_ticks is None


@pytest.mark.parametrize("damaged", [-1, "123456", True, 1.5, [1]])
def test_damaged_start_ticks_make_the_receipt_unreadable(damaged: Any) -> None:
    # Read as "absent", they would let the receipt be judged by its wall-clock start alone.
    assert read_owner({**RECEIPT, "processStartTicks": damaged}) is None
