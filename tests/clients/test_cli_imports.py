"""The CLI's start stays light (issue #42: its start to its first request under 0.1 s).

`import paperclip_client.cli` (what the `paperclip-agent` console script does first) must not
load what no run needs before its first request: httpx's own command-line client (rich, click,
pygments: about 80 modules where they are installed), the workdir's modules and pathspec
(loaded by the run once it holds its lease), the checkout and snapshot steps. Each check runs
in a fresh interpreter, since this test process has imported everything already.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

import paperclip_client
from paperclip_client import Client
from paperclip_client.transport import _tls_context

# Modules `import paperclip_client.cli` must not load (a prefix counts its submodules too).
HEAVY = (
    "httpx._main",
    "rich",
    "click",
    "pygments",
    "pathspec",
    "concurrent.futures",
    "paperclip_client.workdir",
    "paperclip_client.run_workspace",
)
# Modules the CLI reaches only after its first request, imported where first used: the
# models (read from the first answer on), the session checkpoints (with --session-dir) and the
# directory blobs (the checkout). (`dataclasses` is not one: h11 needs it to send.)
AFTER_FIRST_REQUEST = (
    "paperclip_client.models",
    "paperclip_client.session",
    "paperclip_client.trees",
    "uuid",  # with platform: the controller lease's boot id, made after the first answer
)
# The same code as this test's: the package's own directory first on the path.
CLIENT_PATH = str(Path(paperclip_client.__file__).resolve().parents[1])


def loaded_after(code: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
        env={**os.environ, "PYTHONPATH": CLIENT_PATH},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    modules: list[str] = json.loads(done.stdout)
    return modules


def heavy_in(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(f"{h}.") for h in HEAVY)]


def test_importing_the_cli_loads_no_heavy_module() -> None:
    modules = loaded_after("import paperclip_client.cli")
    assert "paperclip_client.cli" in modules
    assert "httpx" in modules  # the first request needs it
    assert heavy_in(modules) == []


def test_importing_the_cli_leaves_what_the_first_request_does_not_need() -> None:
    """The package's `__init__` no longer imports its whole API, `models` is imported at the
    first answer read, the session and tree modules where a run uses them."""
    modules = loaded_after(
        "import paperclip_client.cli\n"
        "from paperclip_client.cli import parser\n"
        "from paperclip_client.client import Client\n"
        "parser().parse_args(['run', '--workspace', 'w', '--issue', 'i', '--', 'true'])\n"
        "Client('http://127.0.0.1:9', 'k.s').close()"
    )
    early = [m for m in modules if m in AFTER_FIRST_REQUEST]
    assert early == []


def test_the_first_request_goes_out_before_the_models_load() -> None:
    """`me()`, the run's first request, is sent before `paperclip_client.models` is imported
    (naming `models.Me` in the same call would import it first); its answer then loads it."""
    modules = loaded_after(
        "import sys\n"
        "from paperclip_client.cli import Client\n"
        "from paperclip_client._httpx import httpx\n"
        "seen = []\n"
        "def answer(request):\n"
        "    seen.append((request.url.path, 'paperclip_client.models' in sys.modules))\n"
        "    body = {'actor_type': 'agent', 'company_ids': ['c'], 'agent_id': 'a'}\n"
        "    return httpx.Response(200, json=body)\n"
        "client = Client('http://paperclip.test', 'k.s', transport=httpx.MockTransport(answer))\n"
        "me = client.me()\n"
        "assert seen == [('/api/me', False)], seen\n"
        "assert me.agent_id == 'a' and me.company_ids == ['c'], me"
    )
    assert "paperclip_client.models" in modules


def test_the_package_api_is_whole_when_imported_late() -> None:
    """Every name of `paperclip_client.__all__` is there for `from paperclip_client import`,
    and the lazily named models are the module's own classes."""
    modules = loaded_after(
        "import paperclip_client\n"
        "from paperclip_client import *  # noqa: F403\n"
        "import paperclip_client.models as models\n"
        "from paperclip_client import client, keepers\n"
        "for name in paperclip_client.__all__:\n"
        "    assert getattr(paperclip_client, name) is not None, name\n"
        "assert paperclip_client.models is models\n"
        "assert client.models.Run is models.Run\n"
        "assert keepers.models.RuntimeLease is models.RuntimeLease\n"
        "assert set(paperclip_client.__all__) <= set(dir(paperclip_client))\n"
        "for sub in ('client', 'cas', 'transport', 'keepers', 'session'):\n"
        "    assert getattr(paperclip_client, sub).__name__ == f'paperclip_client.{sub}'\n"
        "try:\n"
        "    paperclip_client.Nothing\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('an unknown name resolved')"
    )
    assert "paperclip_client.models" in modules


def test_the_console_script_path_loads_no_heavy_module_before_main() -> None:
    """The shim pip writes (`from paperclip_client.cli import entry`), and what `main` reaches
    before its first request: the parser and the client."""
    modules = loaded_after(
        "import re, sys\n"
        "from paperclip_client.cli import entry, parser\n"
        "from paperclip_client.client import Client\n"
        "parser().parse_args(['run', '--workspace', 'w', '--issue', 'i', '--', 'true'])\n"
        "Client('http://127.0.0.1:9', 'k.s').close()"
    )
    assert heavy_in(modules) == []


def test_httpx_loaded_without_its_cli_still_works_and_its_cli_still_imports() -> None:
    """httpx takes its own fallback for the held-back module (its `main` stub), and the entry
    is gone afterwards: a later `import httpx._main` is not refused by us."""
    modules = loaded_after(
        "import paperclip_client.client, httpx, sys\n"
        "assert 'httpx._main' not in sys.modules, 'held-back entry left behind'\n"
        "assert callable(httpx.main) and httpx.Client\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('click') and importlib.util.find_spec('rich'):\n"
        "    import httpx._main"
    )
    assert "paperclip_client._httpx" in modules


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "HTTP://example.test/"])
def test_a_plain_http_server_gets_a_tls_context_that_trusts_nothing(url: str) -> None:
    """No bundle loaded for http://, and still no unverified TLS: the context requires a
    certificate and the host name, and trusts no authority (an https:// peer would fail)."""
    context = _tls_context(url)
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname is True
    assert context.get_ca_certs() == []


def test_an_https_server_gets_httpx_default_verification() -> None:
    assert _tls_context("https://paperclip.example.test") is True


def test_a_client_of_an_http_server_loads_no_certificate_bundle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Neither the API's client (plain http://) nor the redirected downloads' one (made at the
    first redirect) reads certifi's bundle while the CLI starts; https:// still does."""
    loads: list[object] = []
    monkeypatch.setattr(
        ssl.SSLContext, "load_verify_locations", lambda _self, *a, **_k: loads.append(a)
    )
    Client("http://127.0.0.1:9", "k.s").close()
    assert loads == []
    Client("https://paperclip.example.test", "k.s").close()
    assert loads != []
