"""`paperclip-agent run` in-process against the real API: once it holds both leases, its
renews carry the runtime and the controller lease in one `POST /api/leases/renew`, and the
controller lease is never renewed alone on its own endpoint."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from django.core.wsgi import get_wsgi_application

from paperclip_client import Client, cli, keepers
from tests.clients.conftest import World

pytestmark = pytest.mark.django_db(transaction=True)


class Recording(httpx.BaseTransport):
    """The app, recording each POST's path and JSON body; finalize answers at once that it
    failed (no worker runs here: the run's leases are what this test is about)."""

    def __init__(self) -> None:
        self.app = httpx.WSGITransport(app=get_wsgi_application())
        self.posts: list[tuple[str, object]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.headers.get("content-type") == "application/json":
            body = json.loads(request.read())
            self.posts.append((request.url.path, body))
        if request.url.path.endswith("/finalize"):
            error = {"error": {"code": "finalization_failed", "message": "spent", "details": {}}}
            return httpx.Response(409, json=error)
        return self.app.handle_request(request)


def run_recorded(world: World, tmp_path: Path, recent: float) -> Recording:
    """`paperclip-agent run -- sh -c 'echo made > made.txt'` with the runner's `recent`."""
    recording = Recording()
    args = cli.parser().parse_args(
        [
            "run", "--workspace", str(world.workspace.pk), "--issue", str(world.issue.pk),
            "--workdir", str(tmp_path / "work"), "--url", "http://testserver", "--key", world.key,
            "--", "sh", "-c", "echo made > made.txt",
        ]
    )  # fmt: skip
    with Client("http://testserver", world.key, transport=recording, retries=0) as client:
        runner = cli.Runner(client, args, list(args.command[1:]))
        runner.recent = recent
        code = runner.run()
    assert code == cli.EXIT_NOT_COMMITTED  # (finalize refused above)
    return recording


def test_a_run_renews_both_its_leases_in_one_request(world: World, tmp_path: Path) -> None:
    recording = run_recorded(world, tmp_path, recent=0.0)  # a renew before each write
    batches = [body for path, body in recording.posts if path == "/api/leases/renew"]
    assert batches, [path for path, _ in recording.posts]
    for body in batches:
        assert isinstance(body, dict)
        assert sorted(item["kind"] for item in body["leases"]) == ["controller", "runtime"]
    controller_renews = [
        body
        for path, body in recording.posts
        if path.endswith("/controller-lease") and isinstance(body, dict) and body.get("lease_owner")
    ]
    assert controller_renews == []  # only the acquire went to the single endpoint


def test_a_quick_run_writes_without_renewing_first(world: World, tmp_path: Path) -> None:
    """Its writes (the operations, the snapshot, the result) each come within `recent` of the
    claim: none waits on a renew (the server fences each write). The CLI's own window is
    `RECENT_RENEW_SECONDS`; 25 s here (under the cap of a tenth of the default 300 s TTL), so
    that a slow machine cannot make this run renew. tests/clients/test_keepers.py shows a
    write past the window renewing first."""
    assert keepers.RECENT_RENEW_SECONDS < 25.0
    recording = run_recorded(world, tmp_path, recent=25.0)
    paths = [path for path, _body in recording.posts]
    assert "/api/leases/renew" not in paths, paths
    assert any(path.endswith("/results") for path in paths)
