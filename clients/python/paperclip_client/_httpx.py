"""httpx, imported without its command-line client, and without what only some requests use.

httpx's package imports `httpx._main` (its `httpx` command) whenever `click` and `rich` are
installed, and falls back to a stub when that import fails. Where they are installed (a
developer's environment) that is about 80 modules (rich, click, pygments, decimal, ...) the
agent never uses, paid before the CLI's first request (issue #42: the CLI's start to its first
request under 0.1 s). Holding `httpx._main` absent while httpx loads takes httpx's own
fallback; the entry is removed again afterwards, so an explicit `import httpx._main` later
still works. Every module of this package imports httpx from here;
tests/clients/test_cli_imports.py fails when httpx stops tolerating the absent module or when
the CLI's import pulls in a listed heavy module again.

`DEFERRED` are modules httpx and httpcore bind at import time but use only in some requests:
`certifi` (its CA bundle: https:// with the default verification; it imports
`importlib.resources`), `anyio` (async clients) and `idna` (host names outside ASCII). Each not
yet imported is put in `sys.modules` as a `Deferred` stand-in, which imports the real module at
the first attribute read (any but `__name__`, `__spec__`, `__loader__` and `__package__`, what
the import system reads of a module it finds in `sys.modules`) and hands that read, and every
later one, to it: `import certifi` anywhere still gives a working module, and the code runs
when it is first used, not at the CLI's start.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from importlib.machinery import PathFinder
from typing import Any

_CLI_MODULE = "httpx._main"
DEFERRED = ("anyio", "certifi", "idna")
_SWAP = threading.Lock()  # held only to swap a stand-in out of sys.modules, never to import


class Deferred(types.ModuleType):
    """Stands in `sys.modules` for a module that has not run yet (see the module's doc)."""

    def __getattr__(self, attr: str) -> Any:
        real = self.__dict__.get("_deferred_real")
        if real is None:
            name = self.__name__
            with _SWAP:  # one thread takes the stand-in out; the import system does the rest
                if sys.modules.get(name) is self:
                    del sys.modules[name]
            real = importlib.import_module(name)
            self.__dict__["_deferred_real"] = real  # the one sys.modules holds: later reads
        return getattr(real, attr)


def _defer(names: tuple[str, ...]) -> None:
    for name in names:
        if name in sys.modules:
            continue
        spec = PathFinder.find_spec(name)
        if spec is None:  # not installed: the importer's own fallback applies, as before
            continue
        stand_in = Deferred(name)
        stand_in.__spec__ = spec
        stand_in.__loader__ = spec.loader
        stand_in.__package__ = name if spec.submodule_search_locations is not None else ""
        sys.modules[name] = stand_in


if "httpx" in sys.modules or _CLI_MODULE in sys.modules:
    import httpx as httpx  # loaded already: nothing to hold back
else:
    _defer(DEFERRED)
    sys.modules[_CLI_MODULE] = None  # type: ignore[assignment]  # None: "import fails"
    try:
        import httpx as httpx
    finally:
        del sys.modules[_CLI_MODULE]

__all__ = ["httpx"]
