"""Helpers for tests that run code in separate OS processes against the test database."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote, urlencode

from django.conf import settings
from django.db import connection


def database_url(settings_dict: dict[str, Any] | None = None) -> str:
    """A DATABASE_URL that reaches exactly the database of `settings_dict` (default: the
    connection in use, i.e. the test database inside a test).

    Works for TCP servers and for Unix-socket servers such as the embedded one, whose socket
    directory sits in OPTIONS["host"] (django-environ reads it back from `?host=`).
    """
    s = settings_dict if settings_dict is not None else connection.settings_dict
    user = quote(str(s.get("USER") or ""), safe="")
    password = quote(str(s.get("PASSWORD") or ""), safe="")
    auth = f"{user}:{password}@" if user or password else ""
    name = quote(str(s["NAME"]), safe="")
    options = s.get("OPTIONS") or {}
    host = str(s.get("HOST") or options.get("host") or "")
    port = str(s.get("PORT") or options.get("port") or "")
    if host.startswith("/"):
        query = {"host": host, **({"port": port} if port else {})}
        return f"postgresql://{auth}/{name}?{urlencode(query, safe='/')}"
    return f"postgresql://{auth}{host or '127.0.0.1'}:{port or 5432}/{name}"


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python process that must use the current (test) database:
    the parent's environment, the settings module, the project on PYTHONPATH, DATABASE_URL and
    the parent's secret key (a child is neither manage.py nor pytest, so it gets no
    development defaults: paperclip/settings.py)."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "paperclip.settings",
        "PYTHONPATH": str(settings.BASE_DIR),
        "DATABASE_URL": database_url(),
        "DJANGO_SECRET_KEY": settings.SECRET_KEY,
        **extra,
    }
