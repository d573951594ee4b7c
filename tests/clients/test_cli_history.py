"""`paperclip-agent history` and `paperclip-agent diff` against the in-process app (real
PostgreSQL): the lines they print, and clear errors with their exit status."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import transaction

from paperclip.snapshots.history import head_move_record_in_tx
from paperclip_client import Client, history_cli
from paperclip_client.cli import main
from tests.clients.conftest import World
from tests.recovery.snapshots import store_tree

pytestmark = pytest.mark.django_db


@pytest.fixture
def via(monkeypatch: pytest.MonkeyPatch, client: Client) -> list[str]:
    """The CLI's calls go to the in-process app (its Client is the test's)."""

    class Same:
        def __init__(self, *args: Any) -> None:
            pass

        def __enter__(self) -> Client:
            return client

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(history_cli, "Client", Same)
    return ["--url", "http://testserver", "--key", "k"]


def _two_moves(world: World) -> tuple[str, str]:
    company_id = world.workspace.company_id
    first = store_tree(company_id, {"README.md": b"hello\n", "src/a.py": b"a\n"})
    second = store_tree(company_id, {"README.md": b"hello!\n", "src/b.py": b"b\n"})
    with transaction.atomic():
        for tree, previous in ((first, None), (second, first)):
            head_move_record_in_tx(
                company_id=company_id,
                workspace_id=world.workspace.pk,
                tree=tree,
                previous_tree=previous,
                kind="publish",
                actor_type="system",
                actor_id="test",
                note="by hand" if previous else None,
            )
    return first, second


def test_history_prints_one_line_per_move_newest_first(
    world: World, via: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = _two_moves(world)
    assert main(["history", "--workspace", str(world.workspace.pk), *via]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("2 ")
    assert f" publish {second} +1 -1 ~1 run=- by=system:test by hand" in lines[0]
    assert lines[1].startswith("1 ")
    assert f" publish {first} +3 -0 ~0 " in lines[1] + " "
    assert main(["history", "--workspace", str(world.workspace.pk), "--limit", "1", *via]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 1
    assert "more: --before 2" in captured.err  # apart from the data


def test_diff_prints_name_status_lines_and_a_summary(
    world: World, via: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = _two_moves(world)
    assert main(["diff", "--workspace", str(world.workspace.pk), first, second, *via]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["M\tREADME.md", "D\tsrc/a.py", "A\tsrc/b.py"]
    assert "1 added, 1 removed, 1 modified" in captured.err
    assert main(["diff", "--workspace", str(world.workspace.pk), "empty", first, *via]) == 0
    assert capsys.readouterr().out.count("A\t") == 3


def test_errors_are_one_clear_line_with_their_status(
    world: World, via: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    absent = "sha256:" + "0" * 64
    assert main(["diff", "--workspace", str(world.workspace.pk), "empty", absent, *via]) == 1
    assert "error: not_found:" in capsys.readouterr().err
    assert main(["diff", "--workspace", str(world.workspace.pk), "HEAD", absent, *via]) == 1
    assert "error: invalid_request:" in capsys.readouterr().err
    assert main(["diff", "--workspace", "x", "--url", "ftp://x", "--key", "k", "a", "b"]) == 2
    assert "see paperclip-agent diff --help" in capsys.readouterr().err


def test_paths_that_could_forge_lines_or_drive_a_terminal_are_quoted(
    world: World, via: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A tree is an agent's: its names may hold tabs, newlines and escape sequences."""
    company_id = world.workspace.company_id
    tree = store_tree(company_id, {"ok.txt": b"x", "a\nM\tforged": b"y", "red\x1b[31m": b"z"})
    assert main(["diff", "--workspace", str(world.workspace.pk), "empty", tree, *via]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == ['A\t"a\\nM\\tforged"', "A\tok.txt", 'A\t"red\\x1b[31m"']
    assert "\x1b" not in out
