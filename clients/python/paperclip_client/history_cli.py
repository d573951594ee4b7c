"""`paperclip-agent history` and `paperclip-agent diff`: a workspace's head moves and the
changes between two of its trees, for agents and people at a terminal (the server's
`GET .../history` and `GET .../diff`).

`history` prints one line per move, newest first:
`<seq> <at> <kind> <tree> +<added> -<removed> ~<modified> run=<id|-> by=<type>:<id> [note]`.
`diff` prints one line per changed path, `A`, `D` or `M` and the path (as
`git diff --name-status`), then a summary line on stderr. A path or note holding a control
character, a double quote or a backslash is printed quoted and escaped, as git quotes paths
(`"a\\tb"`): a tree is an agent's, and its names must not forge lines or send escape
sequences to a terminal. `history`'s "more" line goes to stderr, apart from the data.
Exit status: 0; 1 when the server refuses (its code and message printed); 2 for bad usage;
69 when the server cannot be reached.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from paperclip_client.cli_output import EXIT_REFUSED, EXIT_UNREACHABLE, PROG, emit, fail
from paperclip_client.client import Client
from paperclip_client.errors import ApiError, ServerUnreachable

LETTERS = {"added": "A", "removed": "D", "modified": "M"}
_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r", '"': '\\"', "\\": "\\\\"}


def shown(text: str) -> str:
    """`text` as is, or quoted with C escapes when it holds a control character (C0, DEL,
    C1), a double quote or a backslash."""
    if all(" " <= c != "\x7f" and not "\x80" <= c <= "\x9f" and c not in '"\\' for c in text):
        return text
    quoted = "".join(
        _ESCAPES.get(c) or (f"\\x{ord(c):02x}" if c < " " or "\x7f" <= c <= "\x9f" else c)
        for c in text
    )
    return f'"{quoted}"'


def _common(command: argparse.ArgumentParser) -> None:
    command.add_argument("--workspace", required=True, help="execution workspace id")
    command.add_argument("--url", default=os.environ.get("PAPERCLIP_URL"), help="$PAPERCLIP_URL")
    command.add_argument(
        "--key", default=os.environ.get("PAPERCLIP_AGENT_KEY"), help="$PAPERCLIP_AGENT_KEY"
    )


def add_parsers(sub: Any) -> None:
    """The `history` and `diff` verbs, beside `run`."""
    history = sub.add_parser("history", help="list the moves of a workspace's head")
    _common(history)
    history.add_argument(
        "--limit", type=int, default=50, metavar="N", help="moves to list, 1..500 (default 50)"
    )
    history.add_argument("--before", type=int, metavar="SEQ", help="only moves before SEQ")
    diff = sub.add_parser("diff", help="list the paths that differ between two trees")
    _common(diff)
    diff.add_argument(
        "--limit", type=int, default=1000, metavar="N", help="paths to list, 1..10000"
    )
    diff.add_argument("from_tree", metavar="FROM", help="a tree (sha256:...) or `empty`")
    diff.add_argument("to_tree", metavar="TO", help="a tree (sha256:...)")


def usage_problem(args: argparse.Namespace) -> str | None:
    if not args.url:
        return "no server URL: give --url or set PAPERCLIP_URL"
    if not args.key:
        return "no agent key: give --key or set PAPERCLIP_AGENT_KEY"
    if not args.url.startswith(("http://", "https://")):
        return f"--url must start with http:// or https:// (got {args.url!r})"
    return None


def move_line(move: dict[str, Any]) -> str:
    counts, actor = move["counts"], move["actor"]
    line = (
        f"{move['seq']} {move['at']} {move['kind']} {move['tree']}"
        f" +{counts['added']} -{counts['removed']} ~{counts['modified']}"
        f" run={move['run_id'] or '-'} by={actor['type']}:{actor['id']}"
    )
    return f"{line} {shown(move['note'])}" if move.get("note") else line


def run_verb(args: argparse.Namespace) -> int:
    """Run `history` or `diff` (arguments already parsed and checked)."""
    try:
        with Client(args.url, args.key) as client:
            if args.verb == "history":
                page = client.workspace_history(
                    args.workspace, limit=args.limit, before=args.before
                )
                for move in page["results"]:
                    emit(sys.stdout, move_line(move))
                if page["next"] is not None:
                    emit(sys.stderr, f"{PROG}: more: --before {page['next']}")
                return 0
            start = None if args.from_tree == "empty" else args.from_tree
            diff = client.workspace_diff(args.workspace, start, args.to_tree, limit=args.limit)
            counted = dict.fromkeys(LETTERS, 0)
            for change in diff["changes"]:
                counted[change["change"]] += 1
                emit(sys.stdout, f"{LETTERS[change['change']]}\t{shown(change['path'])}")
            summary = ", ".join(f"{n} {kind}" for kind, n in counted.items())
            emit(
                sys.stderr,
                f"{diff['from']}..{diff['to']}: {summary}"
                + (" (truncated: raise --limit)" if diff["truncated"] else ""),
            )
            return 0
    except ServerUnreachable as exc:
        fail(f"cannot reach the server at {args.url}: {exc.reason}")
        return EXIT_UNREACHABLE
    except ApiError as exc:
        fail(f"{exc.code}: {exc.message}")
        return EXIT_REFUSED
