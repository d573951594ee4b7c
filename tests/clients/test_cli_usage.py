"""`paperclip-agent` usage errors, in-process: exit 2 and one line on stderr, nothing else."""

from __future__ import annotations

from typing import Any

import pytest

from paperclip_client.cli import EXIT_USAGE, fail, main, say, warn

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


class _Writes:
    """A stream that keeps each write() apart, as an unbuffered pipe would send them."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
@pytest.mark.parametrize("function", [say, warn, fail])
def test_each_line_is_one_write(
    function: Any, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command shares the CLI's stdout and stderr: with PYTHONUNBUFFERED, a line written
    as its text and then its newline let the command's output land between the two."""
    sink = _Writes()
    monkeypatch.setattr(f"sys.{stream}", sink)
    function("started: pid 1 in /w: sh -c 'echo done'")
    if sink.writes:  # the stream this function writes to
        assert len(sink.writes) == 1
        assert sink.writes[0].endswith("'echo done'\n")
