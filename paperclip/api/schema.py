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
