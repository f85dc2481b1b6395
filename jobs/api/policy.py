"""The API's own policy, whatever the host project's REST_FRAMEWORK says: an app
included with `path("jobs/api/", include("jobs.api.urls"))` must not fall back to DRF's
defaults (AllowAny, no throttle) in someone else's project. Every view of jobs.api.urls
inherits it (tests/api/test_policy.py)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.openapi import AutoSchema
from rest_framework.permissions import SAFE_METHODS
from rest_framework.renderers import BrowsableAPIRenderer

from jobs import replica
from jobs.api.auth import ClientRateThrottle, ClientTokenAuthentication, IsClient
from jobs.api.errors import exception_handler
from jobs.api.renderers import JSONFirstNegotiation, ORJSONRenderer


class APIPolicy:
    authentication_classes = [ClientTokenAuthentication]
    permission_classes = [IsClient]
    throttle_classes = [ClientRateThrottle]
    renderer_classes = [ORJSONRenderer, BrowsableAPIRenderer]
    content_negotiation_class = JSONFirstNegotiation
    schema = AutoSchema()

    def get_exception_handler(self) -> Any:
        return exception_handler

    def finalize_response(self, request: Any, response: Any, *args: Any, **kwargs: Any) -> Any:
        """A client that wrote reads its listings from the primary for a while (D147)."""
        response = super().finalize_response(request, response, *args, **kwargs)
        client_id = getattr(request.user, "pk", None)
        if request.method not in SAFE_METHODS and response.status_code < 400 and client_id:
            replica.pin(client_id)
        return response
