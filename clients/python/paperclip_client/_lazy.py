"""A module imported at its first use, not where it is named.

Issue #42 (the CLI's start to its first request under 0.1 s): `paperclip_client.models` (30
frozen, slotted dataclasses and `dataclasses` with `inspect`: about 25 ms here) is needed to
read the first answer, not to send the first request. The modules that build models name it
through `LazyModule`, which imports it at the first attribute read and keeps each attribute
it hands out (later reads are plain attribute reads). A call reads the answer before it names
a model: in `models.build(models.Me, self._get(...))` the names are read, and the module
imported, before the request is sent. Type checkers see the real module
(`if TYPE_CHECKING:` imports), so this only changes when the import happens.
tests/clients/test_cli_imports.py fails when the CLI's import loads it again.
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyModule:
    """Stands for the module `name` until an attribute is read from it, then imports it (the
    import system's lock makes concurrent first reads safe)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # copy, pickle, inspect probing the proxy itself
            raise AttributeError(attr)
        value = getattr(importlib.import_module(self._name), attr)
        setattr(self, attr, value)
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"
