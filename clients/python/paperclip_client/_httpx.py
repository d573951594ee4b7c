"""httpx, imported without its command-line client.

httpx's package imports `httpx._main` (its `httpx` command) whenever `click` and `rich` are
installed, and falls back to a stub when that import fails. Where they are installed (a
developer's environment) that is about 80 modules (rich, click, pygments, decimal, ...) the
agent never uses, paid before the CLI's first request (issue #42: the CLI's start to its first
request under 0.1 s). Holding `httpx._main` absent while httpx loads takes httpx's own
fallback; the entry is removed again afterwards, so an explicit `import httpx._main` later
still works. Every module of this package imports httpx from here;
tests/clients/test_cli_imports.py fails when httpx stops tolerating the absent module or when
the CLI's import pulls in a listed heavy module again.
"""

from __future__ import annotations

import sys

_CLI_MODULE = "httpx._main"

if "httpx" in sys.modules or _CLI_MODULE in sys.modules:
    import httpx as httpx  # loaded already: nothing to hold back
else:
    sys.modules[_CLI_MODULE] = None  # type: ignore[assignment]  # None: "import fails"
    try:
        import httpx as httpx
    finally:
        del sys.modules[_CLI_MODULE]

__all__ = ["httpx"]
