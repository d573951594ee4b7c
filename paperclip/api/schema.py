"""OpenAPI (drf-spectacular) extensions for the API's bearer authentication.

Imported from `paperclip.api.urls`, so they are registered before any schema is generated.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class AgentKeyAuthenticationScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    target_class = "paperclip.api.auth.AgentKeyAuthentication"
    name = "agentKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "pcak_<prefix>.<secret>",
            "description": "Agent API key from `manage.py create_agent_key --agent <uuid>`.",
        }


class BoardTokenAuthenticationScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    target_class = "paperclip.api.auth.BoardTokenAuthentication"
    name = "boardToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "pcbt_<prefix>.<secret>",
            "description": "Board token from `manage.py create_board_token --user <name>`.",
        }


def add_database_unavailable(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """Postprocessing hook: every operation can answer `503 database_unavailable` (the
    database connection was lost mid-request), so the schema says so once for all."""
    for path in result.get("paths", {}).values():
        for operation in path.values():
            if isinstance(operation, dict) and "responses" in operation:
                own = operation["responses"].get("503")
                if own is not None:  # the operation's own 503 (blob_store_unavailable)
                    own["description"] = f"{own.get('description', '')} | database_unavailable"
                    continue
                operation["responses"].setdefault(
                    "503",
                    {
                        "description": "database_unavailable (retry after Retry-After seconds)",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/ErrorResponse"}
                            }
                        },
                    },
                )
    return result


def close_request_objects(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """Postprocessing hook: request bodies refuse unknown keys (every input serializer is a
    StrictInputSerializer, tests/paperclip/test_strict_bodies.py), so their schemas say
    `additionalProperties: false`; free-form JSON fields inside them stay open."""
    for name, component in result.get("components", {}).get("schemas", {}).items():
        if name.endswith("Request") and component.get("type") == "object":
            component.setdefault("additionalProperties", False)
    return result
