"""Where the service keeps its local state, found without loading the settings: the settings
use it, and so does `python -m paperclip.serve`, which must not load them (loading them may
start the embedded database)."""

from __future__ import annotations

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    """`PAPERCLIP_DATA_DIR` (default `.data` in the checkout), with `.env` read first."""
    environ.Env.read_env(BASE_DIR / ".env", overwrite=False)
    return Path(environ.Env().str("PAPERCLIP_DATA_DIR", default=str(BASE_DIR / ".data"))).resolve()
