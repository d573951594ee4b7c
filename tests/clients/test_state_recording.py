"""`paperclip-agent run` records the workdir's state (index, directory blobs, watcher token)
for its registered snapshot in a thread, while it posts the result and waits for the
finalization, and waits for it before it exits; a recording the filesystem refuses drops the
state (the next run reads every file) and is a warning, not a failed run."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from paperclip_client import Client, cli, run_workspace
from paperclip_client.workdir import INDEX, STATE_DIR, load_index, uploading
from tests.clients.conftest import World
from tests.clients.test_cli_renew import Recording

pytestmark = pytest.mark.django_db(transaction=True)


class ResultSeen(Recording):
    """The app (finalize refused, as Recording does), telling when the result is posted."""

    def __init__(self) -> None:
        super().__init__()
        self.result_posted = threading.Event()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path.endswith("/results"):
            self.result_posted.set()
        return response


def run(world: World, work: Path, transport: httpx.BaseTransport, text: str = "made") -> int:
    args = cli.parser().parse_args(
        [
            "run", "--workspace", str(world.workspace.pk), "--issue", str(world.issue.pk),
            "--workdir", str(work), "--url", "http://testserver", "--key", world.key,
            "--", "sh", "-c", f"echo {text} > made.txt",
        ]
    )  # fmt: skip
    with Client("http://testserver", world.key, transport=transport, retries=0) as client:
        return cli.Runner(client, args, list(args.command[1:])).run()


def test_the_result_is_posted_while_the_state_is_recorded(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = ResultSeen()
    seen: list[bool] = []
    save_state = uploading.save_state

    def after_the_result(*args: object, **kwargs: object) -> str:
        # Synchronous recording would wait here for a result it posts only afterwards.
        seen.append(transport.result_posted.wait(timeout=30))
        return save_state(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(uploading, "save_state", after_the_result)
    work = tmp_path / "work"
    assert run(world, work, transport) == cli.EXIT_NOT_COMMITTED  # (finalize refused)
    assert seen == [True]
    index = load_index(work)  # written before the CLI returned
    assert index is not None
    assert index.tree is not None
    assert index.count == 1


def test_a_state_the_filesystem_refuses_is_dropped_with_a_warning(
    world: World,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    work = tmp_path / "work"
    assert run(world, work, Recording()) == cli.EXIT_NOT_COMMITTED
    assert (work / STATE_DIR / INDEX).is_file()  # the first run's index: the tree before
    capsys.readouterr()

    def refused(*_args: object, **_kwargs: object) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(uploading, "save_state", refused)
    transport = Recording()
    assert run(world, work, transport, "changed") == cli.EXIT_NOT_COMMITTED
    assert any(path.endswith("/results") for path, _body in transport.posts)  # not failed
    err = capsys.readouterr().err
    assert "could not record the workdir's state ([Errno 28] No space left on device)" in err
    assert not (work / STATE_DIR / INDEX).exists()  # no index of the tree before


def test_an_index_that_cannot_be_removed_either_is_named(
    world: World,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def refused(*_args: object, **_kwargs: object) -> str:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(uploading, "save_state", refused)
    monkeypatch.setattr(run_workspace, "drop_state", refused)
    assert run(world, tmp_path / "work", Recording()) == cli.EXIT_NOT_COMMITTED
    err = capsys.readouterr().err
    assert (
        "could not record the workdir's state ([Errno 30] Read-only file system); the run's work"
        " is on the server; its index, of the tree before, could not be removed either ([Errno"
        " 30] Read-only file system): the next run's checkout compares the workdir with that"
        " tree"
    ) in " ".join(err.split())
