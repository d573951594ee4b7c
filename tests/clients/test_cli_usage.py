"""`paperclip-agent` usage errors, in-process: exit 2 and one line on stderr, nothing else."""

from __future__ import annotations

import pytest

from paperclip_client.cli import EXIT_USAGE, main

WS = ["run", "--workspace", "w", "--issue", "i", "--url", "http://x", "--key", "k"]


@pytest.mark.parametrize(
    ("argv", "word"),
    [
        ([], "required"),
        (["walk"], "invalid choice"),
        (["run", "--issue", "i", "--", "true"], "--workspace"),
        ([*WS], "COMMAND"),
        ([*WS, "--"], "COMMAND"),
        ([*WS, "--lease-ttl", "59", "--", "true"], "--lease-ttl"),
        ([*WS, "--lease-ttl", "soon", "--", "true"], "--lease-ttl"),
        ([*WS, "--checkpoint-every", "0", "--", "true"], "--checkpoint-every"),
        ([*WS, "--resume", "r", "--", "true"], "--session-dir"),
        ([*WS[:5], "--", "true"], "PAPERCLIP_URL"),
        ([*WS[:7], "--", "true"], "PAPERCLIP_AGENT_KEY"),
        ([*WS[:5], "--url", "127.0.0.1:8000", "--key", "k", "--", "true"], "http://"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(
    argv: list[str], word: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAPERCLIP_URL", raising=False)
    monkeypatch.delenv("PAPERCLIP_AGENT_KEY", raising=False)
    assert main(argv) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1
    assert err.startswith("paperclip-agent: error: ")
    assert word in err
