"""Shared fixtures: API clients authenticated as an agent or a board member, an admin client
logged in as a superuser, fast password hashing, and the emptying of Procrastinate's tables
after transactional tests; and the order tests start in (slow ones first)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from paperclip.credentials import agent_key_create, board_token_create
from paperclip.models import Agent, BoardMembership, Company
from tests.helpers import close_if_dead
from tests.paperclip.factories import AgentFactory, CompanyFactory, UserFactory
from tests.support.s3 import RcloneUnavailable, S3Server, must_not_skip, rclone_s3

PROCRASTINATE_TABLES = (
    "procrastinate_events",
    "procrastinate_periodic_defers",
    "procrastinate_jobs",
    "procrastinate_workers",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Start the `slow` tests (servers, OS processes, mostly waiting) first: under
    pytest-xdist they then overlap with the many short CPU-bound tests instead of forming a
    tail at the end. A stable sort, after pytest-randomly's shuffle and pytest-django's
    grouping, so the order within each part is still the seed's."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings: Any) -> None:
    # UserFactory hashes a password per user; PBKDF2 (about half a second each on a small
    # machine) would dominate the runtime of every test that makes a board member.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def _cas_dir_per_test(settings: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    # The filesystem store of blobs (paperclip/snapshots/store/backends.py) in a temporary
    # directory, never the checkout's data directory.
    settings.PAPERCLIP_CAS_DIR = tmp_path_factory.mktemp("cas")


def _test_copyback_roots(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return [str(tmp_path_factory.getbasetemp()), str(Path(settings.DATA_DIR) / "demo")]


@pytest.fixture(scope="session", autouse=True)
def _copyback_roots_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Subprocesses the tests start (workers, servers) inherit the tests' copy-back root."""
    previous = os.environ.get("PAPERCLIP_COPYBACK_ROOTS")
    os.environ["PAPERCLIP_COPYBACK_ROOTS"] = ",".join(_test_copyback_roots(tmp_path_factory))
    yield
    if previous is None:
        os.environ.pop("PAPERCLIP_COPYBACK_ROOTS", None)
    else:
        os.environ["PAPERCLIP_COPYBACK_ROOTS"] = previous


@pytest.fixture(autouse=True)
def _copyback_roots(settings: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    # The legacy copy-back (off by default) reads the run directories tests make under pytest's
    # temporary directory, and the demo's (`seed_demo`); tests of the guard itself set their own
    # roots (tests/recovery/test_copyback_guard.py).
    settings.PAPERCLIP_COPYBACK_ROOTS = _test_copyback_roots(tmp_path_factory)


@pytest.fixture(autouse=True)
def _dead_connection_replaced() -> None:
    """Several tests end Django's own session from outside (pg_terminate_backend, as a
    failover would); the thread's connection object then still looks open, and the next
    transactional test on the same xdist worker met `AdminShutdown` at its first query. Such
    a connection is closed here, outside any transaction, so the test opens a fresh one."""
    close_if_dead()


@pytest.fixture(autouse=True)
def _procrastinate_tables_emptied(request: pytest.FixtureRequest) -> Iterator[None]:
    """Procrastinate's tables are unmanaged, so Django's flush after a transactional test
    leaves their rows behind; empty them so that no job outlives its test."""
    yield
    marker = request.node.get_closest_marker("django_db")
    transactional = "transactional_db" in request.fixturenames or (
        marker is not None and bool(marker.kwargs.get("transaction"))
    )
    if transactional:
        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {', '.join(PROCRASTINATE_TABLES)} RESTART IDENTITY CASCADE")


@pytest.fixture
def company() -> Company:
    return CompanyFactory()


@pytest.fixture
def other_company() -> Company:
    return CompanyFactory()


@pytest.fixture
def agent(company: Company) -> Agent:
    return AgentFactory(company=company)


@pytest.fixture
def make_agent_client() -> Callable[[Agent], APIClient]:
    """An APIClient sending `Bearer pcak_...` for the given agent (a real key, real auth)."""

    def make(agent: Agent) -> APIClient:
        client = APIClient()
        client.credentials(
            HTTP_AUTHORIZATION=f"Bearer {agent_key_create(agent_id=agent.pk).secret}"
        )
        return client

    return make


@pytest.fixture
def make_board_client() -> Callable[..., APIClient]:
    """An APIClient sending `Bearer pcbt_...` for a staff user who is a board member of the
    given companies (or a superuser with `superuser=True`)."""

    def make(*companies: Company, superuser: bool = False, **user_fields: Any) -> APIClient:
        user = UserFactory(is_superuser=superuser, **user_fields)
        for c in companies:
            BoardMembership.objects.get_or_create(user=user, company=c)
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {board_token_create(user=user).secret}")
        client.user = user  # type: ignore[attr-defined]
        return client

    return make


@pytest.fixture
def agent_client(agent: Agent, make_agent_client: Callable[[Agent], APIClient]) -> APIClient:
    return make_agent_client(agent)


@pytest.fixture
def board_client(company: Company, make_board_client: Callable[..., APIClient]) -> APIClient:
    return make_board_client(company)


@pytest.fixture
def superuser_client() -> Client:
    """A Django test client logged in as a superuser (for admin pages)."""
    client = Client()
    client.force_login(UserFactory(is_superuser=True))
    return client


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One `rclone serve s3` per test session (per xdist worker); each test that uses it takes
    a key prefix of its own (`s3_settings`)."""
    yield from _s3_serve(tmp_path_factory.mktemp("s3"))


@pytest.fixture
def s3_own_server(tmp_path: Path) -> Iterator[S3Server]:
    """A server for one test only (failure injection: killed, stopped, restarted)."""
    yield from _s3_serve(tmp_path / "s3")


def _s3_serve(root: Path) -> Iterator[S3Server]:
    try:
        server_context = rclone_s3(root)
        server = server_context.__enter__()
    except RcloneUnavailable as exc:
        if must_not_skip():
            pytest.fail(f"the real S3 server is needed under CI=true: {exc}")
        pytest.skip(f"no S3 server: {exc}")
    try:
        yield server
    finally:
        server_context.__exit__(None, None, None)


def s3_settings(settings: Any, monkeypatch: pytest.MonkeyPatch, server: S3Server) -> str:
    """Point the store at `server` under a key prefix of the test's own (credentials and
    region in the standard AWS_* environment, as in production); returns the prefix."""
    prefix = f"t{uuid.uuid4().hex[:12]}/cas/"
    settings.PAPERCLIP_CAS_BACKEND = "s3"
    settings.PAPERCLIP_CAS_S3_BUCKET = server.bucket
    settings.PAPERCLIP_CAS_S3_PREFIX = prefix
    settings.PAPERCLIP_CAS_S3_ENDPOINT_URL = server.endpoint
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    monkeypatch.setenv("AWS_REGION", server.region)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return prefix
