"""The layout's rules, checked on the code itself (docs/architecture.md, and the conventions
in docs/README.md#conventions).

- Every app imports only the apps on the floors below it: the core (`paperclip`), then
  `leases` and `checkpoints`, then `recovery`, then the console (`recovery.console`).
- The domain (models, services, selectors, locks, errors, adapters) never imports the API
  layer or the admin: views call services, not the other way round.
- No private name is imported from another app.
- No lazy re-exports (module `__getattr__`) and no imports guarded by `except ImportError`.
- No import cycle between the project's modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

from django.conf import settings

ROOT = Path(settings.BASE_DIR)
APPS = ("paperclip", "leases", "recovery", "checkpoints")
DOMAIN_PARTS = {"models", "services", "selectors", "locks", "errors", "adapters", "receipts"}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for app in APPS:
        for path in (ROOT / app).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names, line) of every absolute import of a project module in `path`."""
    out: list[tuple[str, list[str], int]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in APPS:
                out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] in APPS]
    return out


def _is_domain(module: str) -> bool:
    parts = module.split(".")
    return any(part in DOMAIN_PARTS for part in parts[1:]) and not (
        {"api", "admin", "management"} & set(parts)
    )


def test_the_domain_never_imports_the_api_layer_or_the_admin() -> None:
    offenders = [
        f"{module}:{line} imports {target}"
        for module, path in MODULES.items()
        if _is_domain(module)
        for target, _, line in _imports(path)
        if {"api", "admin"} & set(target.split("."))
    ]
    assert offenders == []


# The floors (docs/architecture.md#floors): an app may import its own modules and those of the
# apps on lower floors, never one on its own floor or above. `leases.environment` is part of
# `leases`; the console is a Django app of its own nested in `recovery`'s folder, a floor above it
# (nothing else of `recovery` may import it).
FLOORS = {"paperclip": 0, "leases": 1, "checkpoints": 1, "recovery": 2, "recovery.console": 3}


def _app_of(module: str) -> str:
    if module == "recovery.console" or module.startswith("recovery.console."):
        return "recovery.console"
    return module.split(".")[0]


def floor_violations(modules: dict[str, Path]) -> list[str]:
    out = []
    for module, path in modules.items():
        own = _app_of(module)
        for target, _, line in _imports(path):
            other = _app_of(target)
            if other != own and FLOORS[other] >= FLOORS[own]:
                out.append(f"{module}:{line} imports {target} ({other} is not below {own})")
    return out


def test_every_app_imports_only_the_floors_below_it() -> None:
    assert floor_violations(MODULES) == []


def test_the_floor_rule_catches_an_upward_or_sideways_import(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text(
        "from recovery.models import IssueRecoveryAction\n"
        "def f():\n"
        "    from checkpoints import selectors\n"  # a lazy import counts too
    )
    assert floor_violations({"paperclip.bad": module, "leases.bad": module}) == [
        "paperclip.bad:1 imports recovery.models (recovery is not below paperclip)",
        "paperclip.bad:3 imports checkpoints (checkpoints is not below paperclip)",
        "leases.bad:1 imports recovery.models (recovery is not below leases)",
        "leases.bad:3 imports checkpoints (checkpoints is not below leases)",
    ]
    console = tmp_path / "console.py"
    console.write_text("import recovery.models\nfrom recovery.console import site\n")
    assert floor_violations({"recovery.console.x": console}) == []
    # The rest of recovery is below its console.
    assert floor_violations({"recovery.services.x": console}) == [
        "recovery.services.x:2 imports recovery.console (recovery.console is not below recovery)"
    ]


def test_no_private_name_is_imported_from_another_app() -> None:
    offenders = [
        f"{module}:{line} imports {target}.{name}"
        for module, path in MODULES.items()
        for target, names, line in _imports(path)
        for name in names
        if name.startswith("_") and target.split(".")[0] != module.split(".")[0]
    ]
    assert offenders == []


def test_no_lazy_reexports_and_no_guarded_imports() -> None:
    offenders = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                offenders.append(f"{module}: module __getattr__")
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in {"ImportError", "ModuleNotFoundError"}
                for h in node.handlers
            ):
                offenders.append(f"{module}:{node.lineno}: import guarded by except ImportError")
    assert offenders == []


def _target_module(target: str, names: list[str]) -> list[str]:
    """The project modules an import statement loads (`from a import b` may name module b)."""
    hits = [f"{target}.{name}" for name in names if f"{target}.{name}" in MODULES]
    if target in MODULES and (len(hits) < len(names) or not names):
        hits.append(target)
    return hits


def test_no_import_cycle_between_modules() -> None:
    """Module-level imports only (those inside functions or TYPE_CHECKING run later)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        edges: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                edges |= set(_target_module(node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in MODULES}
        graph[module] = edges - {module}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    # A package's __init__ importing its own submodules is not a cycle in practice only when
    # the submodules do not import the package back; report every cycle, none is expected.
    assert cycles == []


# --- Module size --------------------------------------------------------------------------------

MAX_MODULE_LINES = 700
# Folders that hold no project source: generated, installed or scratch.
NOT_SOURCE = {"tests", "migrations", "build", "mutants", "node_modules", "__pycache__"}


def oversized_modules(root: Path, limit: int = MAX_MODULE_LINES) -> dict[str, int]:
    """Every `.py` file under `root` longer than `limit` lines (by path relative to `root`),
    outside tests, migrations, hidden folders (.venv, .data, ...) and generated ones."""
    found: dict[str, int] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if any(p in NOT_SOURCE or p.startswith(".") or p.endswith(".egg-info") for p in parts):
            continue
        with path.open("rb") as handle:
            lines = sum(1 for _ in handle)
        if lines > limit:
            found["/".join(parts)] = lines
    return found


def test_no_module_outside_tests_and_migrations_exceeds_700_lines() -> None:
    assert oversized_modules(ROOT) == {}


def test_the_size_rule_counts_lines_and_skips_tests_and_migrations(tmp_path: Path) -> None:
    (tmp_path / "app" / "migrations").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / ".venv").mkdir()
    body = "x = 1\n"
    (tmp_path / "app" / "small.py").write_text(body * 700)
    (tmp_path / "app" / "large.py").write_text(body * 701)
    for skipped in ("app/migrations/0001_initial.py", "tests/test_big.py", ".venv/lib.py"):
        (tmp_path / skipped).write_text(body * 2000)
    assert oversized_modules(tmp_path) == {"app/large.py": 701}
