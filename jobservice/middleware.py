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
from django.http import JsonResponse
from django_prometheus import middleware as prometheus
from django_prometheus.utils import Time, TimeSince

from jobs.api.errors import error_body

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


class RefuseBadContentLength:
    """A Content-Length that is not a whole number is a 400 before anything reads it.

    First in the chain: django_prometheus's request-size metric calls int() on the
    header and would turn such a request into a 500 (found by the schema fuzz).
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        # A header spelled `Content_Length` arrives as HTTP_CONTENT_LENGTH, which
        # request.headers would also call content-length: it is not the body's length
        # (gunicorn drops header names with underscores), so it goes.
        request.META.pop("HTTP_CONTENT_LENGTH", None)
        value = request.META.get("CONTENT_LENGTH", "")
        if value and not value.strip().isdigit():
            return JsonResponse(
                error_body("Content-Length must be a whole number.", code="bad_request"),
                status=400,
            )
        return self.get_response(request)


class RefuseUnknownLength:
    """A body without a Content-Length (`Transfer-Encoding: chunked`) is a 411 (D209).

    Django reads CONTENT_LENGTH bytes of a body, none without it: the view would answer
    a 400 about fields the client did send. Last in the chain, so the answer is counted
    and carries the security headers as any view's does.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        meta = request.META
        if meta.get("HTTP_TRANSFER_ENCODING") and not meta.get("CONTENT_LENGTH"):
            return JsonResponse(
                error_body(
                    "Send the body with a Content-Length header: a body without one "
                    "(Transfer-Encoding: chunked) is not read.",
                    code="length_required",
                ),
                status=411,
            )
        return self.get_response(request)


class PrometheusAfterMiddleware(prometheus.PrometheusAfterMiddleware):
    """django-prometheus's inner half (its outer half is used as it is), keeping the
    series that say how the API answers: responses by status (the JobsApiErrors alert),
    by status, view and method, and latency by view and method. The request and response
    size histograms and the counts by method, transport, view and charset are not
    written (D73): in the multiprocess mode gunicorn needs, each is a labelled write to
    a shared file on every request, and together they cost a single submission about
    4 % of its CPU."""

    def process_request(self, request):
        request.prometheus_after_middleware_event = Time()

    def process_view(self, request, view_func, *view_args, **view_kwargs):
        return None

    def process_response(self, request, response):
        method = self._method(request)
        name = self._get_view_name(request)
        status = str(response.status_code)
        self.metrics.responses_by_status.labels(status=status).inc()
        self.metrics.responses_by_status_view_method.labels(
            status=status, view=name, method=method
        ).inc()
        started = getattr(request, "prometheus_after_middleware_event", None)
        if started is not None:
            self.metrics.requests_latency_by_view_method.labels(view=name, method=method).observe(
                TimeSince(started)
            )
        else:
            self.metrics.requests_unknown_latency.inc()
        return response
