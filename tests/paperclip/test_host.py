"""The kernel boot id (paperclip/host.py): read from the kernel once per process, None when
it can't be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from paperclip.host import BOOT_ID_PATH, kernel_boot_id, read_kernel_boot_id


def test_the_boot_id_is_the_kernels_and_is_read_once() -> None:
    if not BOOT_ID_PATH.exists():
        pytest.skip("no /proc/sys/kernel/random/boot_id here")
    assert kernel_boot_id() == BOOT_ID_PATH.read_text().strip()
    before = kernel_boot_id.cache_info().misses
    assert kernel_boot_id() is kernel_boot_id()
    assert kernel_boot_id.cache_info().misses == before


@pytest.mark.parametrize(("content", "expected"), [(None, None), ("", None), ("\n", None)])
def test_an_unreadable_or_empty_boot_id_is_none(
    tmp_path: Path, content: str | None, expected: str | None
) -> None:
    path = tmp_path / "boot_id"
    if content is not None:
        path.write_text(content)
    assert read_kernel_boot_id(path) == expected


def test_a_boot_id_loses_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "boot_id"
    path.write_text("3c89d313-8d71-4341-ab24-dd3696470a0f\n")
    assert read_kernel_boot_id(path) == "3c89d313-8d71-4341-ab24-dd3696470a0f"
