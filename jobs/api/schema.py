"""Describes the client token scheme to drf-spectacular (imported by jobs.api.urls)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ClientTokenScheme(OpenApiAuthenticationExtension):
    target_class = "jobs.api.auth.ClientTokenAuthentication"
    name = "ClientToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": "`Token <token>`; create one with `manage.py createclient NAME`.",
        }
