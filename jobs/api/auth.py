"""API clients: token authentication, the client-only permission, per-client throttling.

A client sends `Authorization: Token <token>` (or `Bearer <token>`, what most HTTP
clients send for a bearer token); only the token's SHA-256 is stored, so a database
leak does not leak usable tokens.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from rest_framework import HTTP_HEADER_ENCODING, exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.throttling import SimpleRateThrottle

from jobs import clientcache
from jobs.models import Client

KEYWORD = "Token"
SCHEMES = (b"token", b"bearer")


def authorization_header(request: Request) -> bytes:
    """DRF's get_authorization_header, read from the environ: DRF reads request.headers,
    which Django builds by parsing every environ key, under granian the whole process
    environment too (D151)."""
    auth = request.META.get("HTTP_AUTHORIZATION", b"")
    return auth.encode(HTTP_HEADER_ENCODING) if isinstance(auth, str) else auth


def client_for(header: bytes) -> tuple[Client, str] | None:
    """The active client and token an Authorization header names; None without
    credentials. Anything else raises AuthenticationFailed with the reason (a 401)."""
    parts = header.split()
    if not parts:
        return None  # no credentials: IsClient answers 401
    if parts[0].lower() not in SCHEMES:
        scheme = parts[0].decode("latin-1")[:20]
        raise exceptions.AuthenticationFailed(
            f"Unsupported authorization scheme {scheme!r}: send "
            "'Authorization: Token <token>' (or 'Bearer <token>')."
        )
    if len(parts) != 2:
        raise exceptions.AuthenticationFailed(
            "Invalid Authorization header: expected 'Token <token>'."
        )
    try:
        token = parts[1].decode("ascii")
    except UnicodeDecodeError as exc:
        raise exceptions.AuthenticationFailed("Invalid token.") from exc
    client = clientcache.active_client(Client.hash_token(token))
    if client is None:
        raise exceptions.AuthenticationFailed("Invalid token.")
    if not client.is_active:
        raise exceptions.AuthenticationFailed("Client is inactive.")
    return client, token


class ClientTokenAuthentication(BaseAuthentication):
    """`Authorization: Token <token>` → the active Client whose token hash matches."""

    def authenticate(self, request: Request) -> tuple[Client, str] | None:
        return client_for(authorization_header(request))

    def authenticate_header(self, request: Request) -> str:
        # Makes DRF answer 401 (with WWW-Authenticate) rather than 403.
        return KEYWORD


class IsClient(BasePermission):
    """Only an authenticated, active API client may call the API."""

    def has_permission(self, request: Request, view: Any) -> bool:
        user = request.user
        return isinstance(user, Client) and user.is_active


class ClientRateThrottle(SimpleRateThrottle):
    """Requests per client (rate from JOBS_API_THROTTLE, scope "client"), counted per
    process over a sliding window, as DRF's SimpleRateThrottle counts.

    DRF keeps each client's request times as a list in Django's cache: copied, pickled
    and stored again on every request, so a request costs time in proportion to the
    requests in the window (1.2 ms at 30,000 a minute per process). Here each client's
    times live in a deque of this process: O(1) per request, the same answers.
    """

    scope = "client"
    _histories: dict[str, deque[float]] = {}
    _lock = threading.Lock()

    @classmethod
    def reset(cls) -> None:
        """Forget every count (tests)."""
        with cls._lock:
            cls._histories.clear()

    def allow_request(self, request: Request, view: Any) -> bool:
        if self.rate is None:
            return True
        self.key = self.get_cache_key(request, view)
        if self.key is None:
            return True
        self.now = now = self.timer()
        horizon = now - self.duration
        with self._lock:
            history = self._histories.get(self.key)
            if history is None:
                history = self._histories[self.key] = deque()
            while history and history[0] <= horizon:
                history.popleft()
            # What wait() needs, read under the lock: the oldest time and the count.
            self._oldest = history[0] if history else None
            self._count = len(history)
            if self._count >= self.num_requests:
                return self.throttle_failure()
            history.append(now)
        return True

    def uncount(self) -> None:
        """Take back the request allow_request just counted: the lane's, when it hands
        the request to the view, which counts it again."""
        if getattr(self, "key", None) is None:
            return  # nothing was counted (no rate, or no client)
        with self._lock:
            history = self._histories.get(self.key, ())
            for i in range(len(history) - 1, -1, -1):  # the newest, or nearly: O(1)
                if history[i] == self.now:
                    del history[i]
                    return

    def wait(self) -> float | None:
        """DRF's Retry-After arithmetic over the snapshot allow_request took."""
        if self._oldest is not None:
            remaining = self.duration - (self.now - self._oldest)
        else:
            remaining = self.duration
        available = self.num_requests - self._count + 1
        if available <= 0:
            return None
        return remaining / float(available)

    def get_rate(self) -> str | None:
        # Read at call time (DRF reads it at import), so settings overrides apply.
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)

    def get_cache_key(self, request: Request, view: Any) -> str | None:
        user = request.user
        if not isinstance(user, Client):
            return None  # public endpoints (schema, docs) are not throttled per client
        return self.cache_format % {"scope": self.scope, "ident": user.pk}
