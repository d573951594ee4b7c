"""The child-process DATABASE_URL reaches the very database the test uses (TCP or socket)."""

from __future__ import annotations

import subprocess
import sys

import environ
import pytest
from django.db import connection

from tests.support.processes import child_env, database_url

pytestmark = pytest.mark.embedded


@pytest.mark.parametrize(
    ("settings_dict", "expected"),
    [
        (
            {"NAME": "test_x", "USER": "us@er", "PASSWORD": "p:w", "HOST": "db", "PORT": 6543},
            {"NAME": "test_x", "USER": "us@er", "PASSWORD": "p:w", "HOST": "db", "PORT": 6543},
        ),
        (
            {
                "NAME": "test_y",
                "USER": "postgres",
                "HOST": "",
                "PORT": "",
                "OPTIONS": {"host": "/tmp/some dir/pgdata"},
            },
            {"NAME": "test_y", "USER": "postgres", "OPTIONS": {"host": "/tmp/some dir/pgdata"}},
        ),
    ],
)
def test_url_round_trips_through_django_environ(settings_dict, expected) -> None:  # type: ignore[no-untyped-def]
    parsed = environ.Env.db_url_config(database_url(settings_dict))
    for key, value in expected.items():
        assert parsed[key] == value, (key, parsed)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_child_process_connects_to_the_test_database() -> None:
    code = (
        "import django; django.setup();"
        "from django.db import connection;"
        "print(connection.cursor().execute('select current_database()').fetchone()[0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == connection.settings_dict["NAME"]
