"""The whole project's OpenAPI schema generates cleanly: no errors, no warnings, valid."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
import yaml
from django.core.management import call_command


def test_schema_validates_without_warnings(tmp_path: Path) -> None:
    out = tmp_path / "schema.yaml"
    # --fail-on-warn turns any warning (an ambiguous enum name, an unresolvable serializer, a
    # view spectacular cannot introspect) into a failure; --validate checks it against OpenAPI 3.
    call_command(
        "spectacular", "--validate", "--fail-on-warn", "--file", str(out), stderr=StringIO()
    )
    schema = yaml.safe_load(out.read_text())
    paths = schema["paths"]
    for path in (
        "/api/execution-workspaces/{workspace_id}/runtime-lease/claim",
        "/api/heartbeat-runs/{run_id}/finalize",
        "/api/issues/{issue_id}/recovery-actions/resume-workspace-finalization",
        "/api/environment-leases/{lease_id}/cleanup-claims",
        "/api/heartbeat-runs/{run_id}/checkpoint",
    ):
        assert path in paths, sorted(paths)
    # A lost database is possible on every operation, and the schema says so.
    for path, operations in paths.items():
        for method, operation in operations.items():
            if isinstance(operation, dict) and "responses" in operation:
                assert "503" in operation["responses"], (method, path)


@pytest.mark.parametrize("url", ["/api/schema/", "/api/docs/"])
def test_schema_and_docs_are_served(client, url: str) -> None:  # type: ignore[no-untyped-def]
    assert client.get(url).status_code == 200


def test_the_docs_page_loads_swagger_ui_from_the_package_not_a_cdn(client) -> None:  # type: ignore[no-untyped-def]
    from django.contrib.staticfiles import finders

    page = client.get("/api/docs/").content.decode()
    assert "cdn." not in page
    assert "unpkg" not in page
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js" in page
    assert finders.find("drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js")
