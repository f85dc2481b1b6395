"""What drf-spectacular needs to describe the API in any host project: the client token
scheme (registered when jobs.api.urls imports this), and `extend_schema` built on
drf-spectacular's AutoSchema whatever the host's REST_FRAMEWORK says."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drf_spectacular import utils
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema


def extend_schema(**kwargs: Any) -> Callable[[Callable], Callable]:
    """drf-spectacular's decorator for a view method. Its schema class derives from
    DEFAULT_SCHEMA_CLASS as it is when the method is defined, and in a host that names
    none that is DRF's own, which the generator cannot call (a 500 on the schema page):
    the method names drf-spectacular's instead, as every view of the API does (D221)."""

    def decorate(fn: Callable) -> Callable:
        if not getattr(fn, "kwargs", {}).get("schema"):  # else it stacks on that one
            fn.schema = AutoSchema  # read first by utils.extend_schema
        return utils.extend_schema(**kwargs)(fn)

    return decorate


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
