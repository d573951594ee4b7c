"""`paperclip-agent run` in-process against the real API, with the server unreachable right
after the command exits: the exit operation and the result are retried until they get through
(each recorded once), and a run that cannot commit ends with exit status 70."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import httpx
import pytest
from django.core.wsgi import get_wsgi_application

from paperclip.models import NativeRunResult, WorkspaceOperation
from paperclip_client import Client, cli, runner
from tests.clients.conftest import World

pytestmark = pytest.mark.django_db(transaction=True)


class Outage(httpx.BaseTransport):
    """The app, except that the first requests of the chosen kinds never get through, and
    finalize answers that the retry budget is spent."""

    def __init__(self, refuse: dict[str, int]) -> None:
        self.app = httpx.WSGITransport(app=get_wsgi_application())
        self.refuse = Counter(refuse)
        self.refused: Counter[str] = Counter()

    def kind(self, request: httpx.Request) -> str:
        path = request.url.path
        if path.endswith("/operations"):
            return f"operation:{json.loads(request.content)['phase']}"
        return path.rsplit("/", 1)[-1]

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        kind = self.kind(request)
        if self.refuse[kind] > self.refused[kind]:
            self.refused[kind] += 1
            raise httpx.ConnectError("connection refused", request=request)
        if kind == "finalize":
            body = {"error": {"code": "finalization_failed", "message": "spent", "details": {}}}
            return httpx.Response(409, json=body)
        return self.app.handle_request(request)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "PATIENCE_PAUSE_SECONDS", 0.01)


def test_the_result_survives_an_outage_after_the_command(
    world: World, tmp_path: Path, quick: None, capsys: pytest.CaptureFixture[str]
) -> None:
    outage = Outage({"operation:exit": 2, "results": 1})
    args = cli.parser().parse_args(
        [
            "run", "--workspace", str(world.workspace.pk), "--issue", str(world.issue.pk),
            "--workdir", str(tmp_path / "work"), "--url", "http://testserver", "--key", world.key,
            "--", "sh", "-c", "echo made > made.txt",
        ]
    )  # fmt: skip
    with Client("http://testserver", world.key, transport=outage, retries=0) as client:
        code = cli.Runner(client, args, list(args.command[1:])).run()
    out = capsys.readouterr()
    assert code == cli.EXIT_NOT_COMMITTED, out
    assert outage.refused == {"operation:exit": 2, "results": 1}
    assert out.out.count("exit: server unreachable") == 2
    assert out.out.count("result: server unreachable") == 1
    assert "finalization_failed" in out.err
    run_id = next(line[5:] for line in out.out.splitlines() if line.startswith("run: "))
    phases = WorkspaceOperation.objects.filter(heartbeat_run_id=run_id).values_list("phase")
    assert sorted(p for (p,) in phases) == ["exit", "start"]
    assert NativeRunResult.objects.filter(run_id=run_id).count() == 1
    assert (tmp_path / "work" / "made.txt").read_text() == "made\n"
