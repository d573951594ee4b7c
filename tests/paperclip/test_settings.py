"""Production refuses the development defaults (paperclip/settings.py).

Without DATABASE_URL a developer's `manage.py` / pytest gets the embedded PostgreSQL and a
locally kept secret key; a production process (gunicorn, or anything told
`DJANGO_DEBUG=false`) must refuse to start instead, unless PAPERCLIP_EMBEDDED_DB=1 asks for
the embedded server on purpose. Each case is a fresh process, as a deployment starts one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

ROOT = Path(settings.BASE_DIR)
SETUP = "import django; django.setup(); print('started')"
PROBE = "from paperclip.settings import development_defaults_allowed as a; print(a())"


def _env(**values: str | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "DJANGO_SECRET_KEY", "DJANGO_DEBUG", "PAPERCLIP_EMBEDDED_DB"}
    }
    # An empty data dir: a refused start must not find (or leave) a local key either.
    env |= {"DJANGO_SETTINGS_MODULE": "paperclip.settings", "PYTHONPATH": str(ROOT)}
    env |= {k: v for k, v in values.items() if v is not None}
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("debug", ["false", None])
def test_a_production_process_without_database_url_refuses_to_start(
    tmp_path: Path, debug: str | None
) -> None:
    env = _env(DJANGO_DEBUG=debug, DJANGO_SECRET_KEY="s" * 50, PAPERCLIP_DATA_DIR=str(tmp_path))
    done = _run([sys.executable, "-c", SETUP], env)
    assert done.returncode != 0
    assert "DATABASE_URL is not set" in done.stderr
    assert "PAPERCLIP_EMBEDDED_DB=1" in done.stderr
    assert "started" not in done.stdout
    assert not (tmp_path / "pgdata").exists()  # no embedded server was started


@pytest.mark.parametrize("debug", ["false", None])
def test_a_production_process_without_secret_key_refuses_to_start(
    tmp_path: Path, debug: str | None
) -> None:
    env = _env(
        DJANGO_DEBUG=debug,
        DATABASE_URL="postgres://nobody@127.0.0.1:1/none",
        PAPERCLIP_DATA_DIR=str(tmp_path),
    )
    done = _run([sys.executable, "-c", SETUP], env)
    assert done.returncode != 0
    assert "DJANGO_SECRET_KEY is not set" in done.stderr
    assert not (tmp_path / "secret_key").exists()  # no key was minted


def test_the_message_names_every_missing_value(tmp_path: Path) -> None:
    env = _env(DJANGO_DEBUG="false", PAPERCLIP_DATA_DIR=str(tmp_path))
    done = _run([sys.executable, "-c", SETUP], env)
    assert done.returncode != 0
    assert "DATABASE_URL and DJANGO_SECRET_KEY are not set" in done.stderr
    assert list(tmp_path.iterdir()) == []  # neither a key nor a cluster was made


def test_manage_py_told_debug_false_refuses_too(tmp_path: Path) -> None:
    env = _env(DJANGO_DEBUG="false", DJANGO_SECRET_KEY="s" * 50, PAPERCLIP_DATA_DIR=str(tmp_path))
    done = _run([sys.executable, "manage.py", "check"], env)
    assert done.returncode != 0
    assert "DATABASE_URL is not set" in done.stderr


@pytest.mark.parametrize(
    ("argv", "values", "allowed"),
    [
        # A developer's manage.py (make run's migrate and seed_demo): the defaults serve.
        (["manage.py"], {}, True),
        (["manage.py"], {"DJANGO_DEBUG": "true"}, True),
        (["manage.py"], {"DJANGO_DEBUG": "false"}, False),
        # Anything else (gunicorn's worker, a script): only when asked, or with DEBUG on.
        (["-c"], {}, False),
        (["-c"], {"DJANGO_DEBUG": "false"}, False),
        (["-c"], {"DJANGO_DEBUG": "true"}, True),
        (["-c"], {"PAPERCLIP_EMBEDDED_DB": "1"}, True),
        (["-c"], {"DJANGO_DEBUG": "false", "PAPERCLIP_EMBEDDED_DB": "1"}, True),
        (["-c"], {"PAPERCLIP_EMBEDDED_DB": "0"}, False),
    ],
)
def test_who_gets_the_development_defaults(
    tmp_path: Path, argv: list[str], values: dict[str, str], allowed: bool
) -> None:
    # Both values set, so the probe itself starts in every case and only reports the rule.
    env = _env(
        DATABASE_URL="postgres://nobody@127.0.0.1:1/none",
        DJANGO_SECRET_KEY="s" * 50,
        PAPERCLIP_DATA_DIR=str(tmp_path),
        **values,
    )
    if argv == ["manage.py"]:
        args = [sys.executable, "manage.py", "shell", "--no-imports", "-c", PROBE]
    else:
        args = [sys.executable, "-c", PROBE]
    done = _run(args, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(allowed)


@pytest.mark.slow
def test_gunicorn_in_production_mode_exits_with_the_message(tmp_path: Path) -> None:
    """gunicorn (docs/setup.md#serving) with DATABASE_URL forgotten: it must not serve."""
    gunicorn = str(Path(sys.executable).with_name("gunicorn"))
    env = _env(DJANGO_DEBUG="false", DJANGO_SECRET_KEY="s" * 50, PAPERCLIP_DATA_DIR=str(tmp_path))
    done = _run([gunicorn, "paperclip.wsgi", "--bind", "127.0.0.1:0", "--workers", "1"], env)
    assert done.returncode != 0
    assert "DATABASE_URL is not set" in done.stderr
    assert not (tmp_path / "pgdata").exists()
