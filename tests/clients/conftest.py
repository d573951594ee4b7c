"""Fixtures for the agent client's tests: an agent with a key, an issue and an execution
workspace whose `cwd` is a temporary directory; a `Client` on the in-process WSGI app (real
PostgreSQL, the test's own transaction); and, for the slow tests, a live multi-worker gunicorn
plus a real `manage.py run_worker` against the test database."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections

from paperclip.credentials import agent_key_create
from paperclip.models import Agent, ExecutionWorkspace, Issue
from paperclip_client import Client
from tests.chaos.run import Config, GunicornServer
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    IssueFactory,
)
from tests.paperclip.worker.test_worker_processes import Worker
from tests.support.processes import child_env


@dataclass
class World:
    agent: Agent
    key: str
    issue: Issue
    workspace: ExecutionWorkspace
    dest: Path  # the workspace's cwd: where its head is materialized (or a run copied back)


def make_world(tmp_path: Path, name: str = "w") -> World:
    company = CompanyFactory()
    agent = AgentFactory(company=company)
    dest = tmp_path / f"{name}-dest"
    dest.mkdir()
    return World(
        agent=agent,
        key=agent_key_create(agent_id=agent.pk).secret,
        issue=IssueFactory(company=company, status=Issue.Status.IN_PROGRESS, assignee_agent=agent),
        workspace=ExecutionWorkspaceFactory(company=company, cwd=str(dest)),
        dest=dest,
    )


@pytest.fixture
def world(tmp_path: Path) -> World:
    return make_world(tmp_path)


@pytest.fixture
def client(world: World) -> Iterator[Client]:
    """A client on the in-process app: every request runs in this test's database state.
    As in Django's test client, requests do not close the database connection (that would
    end the test's transaction)."""
    transport = httpx.WSGITransport(app=get_wsgi_application())
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        with Client("http://testserver", world.key, transport=transport, retries=0) as c:
            yield c
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


@pytest.fixture(scope="session")
def live_cas_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The filesystem store of blobs that the live gunicorn and the live workers share (a
    temporary directory, never the checkout's data directory): pass it to every `Worker`
    as `PAPERCLIP_CAS_DIR`."""
    return tmp_path_factory.mktemp("live-cas")


def worker_env(cas_dir: Path) -> dict[str, str]:
    """A live worker's environment beside the live gunicorn: the same store of blobs."""
    return {"PAPERCLIP_CAS_DIR": str(cas_dir)}


@pytest.fixture
def worker(live_cas_dir: Path) -> Iterator[Worker]:
    """A real worker (finalizations, materializations; the periodic lease sweep every
    second) sharing the live gunicorn's store of blobs."""
    w = Worker(**worker_env(live_cas_dir))
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="session")
def gunicorn_url(
    django_db_setup: None,
    django_db_blocker: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    live_cas_dir: Path,
) -> Iterator[str]:
    """A gunicorn (2 workers x 4 threads) on the test database, for the whole session."""
    workdir = tmp_path_factory.mktemp("gunicorn")
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        env = child_env(
            DJANGO_DEBUG="false",
            DJANGO_ALLOWED_HOSTS="127.0.0.1,localhost",
            DJANGO_LOG_LEVEL="ERROR",
            PAPERCLIP_CAS_DIR=str(live_cas_dir),
        )
    server = GunicornServer(Config(gunicorn_workers=2, gunicorn_threads=4), env, workdir)
    try:
        server.start()
        yield server.base_url
    finally:
        server.stop()


@pytest.fixture
def clis() -> Iterator[list[Any]]:
    """The `paperclip-agent run` processes a test starts (`tests.clients.test_cli_live.Cli`,
    appended as started): any still running at the end is killed."""
    started: list[Any] = []
    yield started
    for cli in started:
        if cli.proc.poll() is None:
            cli.kill()
