"""Browser middleware that the token-authenticated API does not need.

The admin needs sessions, request.user and messages; the API under /api/
authenticates every request by its token and never reads a session, a cookie or a
message. Running them there costs a cookie signer per request and a session lookup
when a browser sends its cookie, for nothing. These are Django's own classes, skipped
for /api/ paths only, so the admin keeps them exactly (and Django's admin checks still
find them). CSRF stays Django's own middleware, unwrapped: `check --deploy` looks for it
by name, and DRF already exempts its token-authenticated views.
"""

from __future__ import annotations

from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.sessions import middleware as sessions

API_PREFIX = "/api/"


def is_api(request) -> bool:
    return request.path_info.startswith(API_PREFIX)


class _SkippedForAPI:
    """Mixin: the wrapped middleware runs for every path except /api/…."""

    def __call__(self, request):
        if is_api(request):
            return self.get_response(request)
        return super().__call__(request)


class SessionMiddleware(_SkippedForAPI, sessions.SessionMiddleware):
    pass


class AuthenticationMiddleware(_SkippedForAPI, auth.AuthenticationMiddleware):
    pass


class MessageMiddleware(_SkippedForAPI, messages.MessageMiddleware):
    pass
