"""A WSGI lane in front of Django for the common single submission (issue 31, D185).

Django's request, its eleven middleware and DRF's view machinery were most of the API
process's ~1.1 ms per `POST /api/v1/jobs/`. For the plain case only (a JSON body, a
valid token of an active client, no Idempotency-Key, within the throttle and the body
limit, a body the shared rules accept), this lane runs the same steps Django would: the
request signals (close_old_connections, D76), the client cache (revocation, D45), the
throttle, the shared rules and the same service call, the hand-written answer (D150),
the replica pin (D147) and the kept Prometheus series (D73), and writes the bytes and
headers the full application writes. Anything else, a refusal included, is replayed to
Django untouched (the body it read in a BytesIO): every other answer stays Django's.
JOBS_API_FAST_LANE=0 turns it off.
"""

from __future__ import annotations

import io
import re
from typing import Any

import orjson
from django.conf import settings as django_settings
from django.core import signals
from django.core.handlers.exception import response_for_exception
from django.core.handlers.wsgi import WSGIHandler, WSGIRequest, get_script_name
from django.http.request import split_domain_port, validate_host
from django.urls import resolve, reverse, set_script_prefix
from django_prometheus.middleware import Metrics
from django_prometheus.utils import Time, TimeSince
from rest_framework.exceptions import AuthenticationFailed

from jobs import replica, submission
from jobs.api.auth import ClientRateThrottle, client_for
from jobs.api.parsers import max_body_bytes
from jobs.api.renderers import ORJSONRenderer
from jobs.api.views import as_stored, job_location, submitted_answer
from jobs.conf import settings
from jobs.exceptions import SubmissionError
from jobs.models import Client

_FAST_ACCEPTS = frozenset((None, "*/*", "application/json"))
_LONG_NUMBER = re.compile(rb"\d{19}")  # the parser's cue for the standard decoder
_STATUS = {201: "201 Created", 200: "200 OK"}
_RENDER = ORJSONRenderer().render


class _Answer:
    """The body, then request_finished when the server closes it, as Django's response."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    def __iter__(self) -> Any:
        return iter((self.body,))

    def close(self) -> None:
        signals.request_finished.send(sender=WSGIHandler)


class FastLane:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.path = reverse("job-list")
        self.view = resolve(self.path).view_name
        self.metrics = Metrics.get_instance()
        self.headers = {secure: self._headers(secure) for secure in (False, True)}

    def _headers(self, secure: bool) -> tuple[list, list]:
        """What DRF and the middleware add, in the full application's order: the answer
        goes Content-Type, Location, these, Content-Length, those."""
        ours = django_settings
        inner = [("Vary", "Accept"), ("Allow", "GET, POST, HEAD, OPTIONS")]
        if ours.X_FRAME_OPTIONS:
            inner.append(("X-Frame-Options", ours.X_FRAME_OPTIONS.upper()))
        outer = []
        if secure and ours.SECURE_HSTS_SECONDS:
            sts = f"max-age={ours.SECURE_HSTS_SECONDS}"
            sts += "; includeSubDomains" if ours.SECURE_HSTS_INCLUDE_SUBDOMAINS else ""
            outer.append(
                (
                    "Strict-Transport-Security",
                    sts + ("; preload" if ours.SECURE_HSTS_PRELOAD else ""),
                )
            )
        if ours.SECURE_CONTENT_TYPE_NOSNIFF:
            outer.append(("X-Content-Type-Options", "nosniff"))
        if policy := ours.SECURE_REFERRER_POLICY:
            parts = [v.strip() for v in policy.split(",")] if isinstance(policy, str) else policy
            outer.append(("Referrer-Policy", ",".join(parts)))
        if ours.SECURE_CROSS_ORIGIN_OPENER_POLICY:
            outer.append(("Cross-Origin-Opener-Policy", ours.SECURE_CROSS_ORIGIN_OPENER_POLICY))
        return inner, outer

    def _plain(self, environ: dict[str, Any]) -> bool:
        """The request is the common case, by its environ alone."""
        length = environ.get("CONTENT_LENGTH", "")
        return (
            environ.get("REQUEST_METHOD") == "POST"
            and environ.get("PATH_INFO") == self.path
            and not environ.get("SCRIPT_NAME")
            and not environ.get("QUERY_STRING")
            and environ.get("CONTENT_TYPE") == "application/json"
            and environ.get("HTTP_ACCEPT") in _FAST_ACCEPTS
            and "HTTP_IDEMPOTENCY_KEY" not in environ
            and "HTTP_CONTENT_LENGTH" not in environ
            and length.isdigit()
            and int(length) <= max_body_bytes()
            and not django_settings.FORCE_SCRIPT_NAME
            and not django_settings.USE_X_FORWARDED_HOST
            and (_secure(environ) or not django_settings.SECURE_SSL_REDIRECT)
            and _host_allowed(environ.get("HTTP_HOST", ""))
        )

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if not settings.JOBS_API_FAST_LANE or not self._plain(environ):
            return self.app(environ, start_response)
        started = Time()
        try:
            answer = self._serve(environ, started)
        except Exception as exc:  # any step, the client lookup too; never replayed (D207)
            return self._failed(environ, exc, started, start_response)
        if answer is None:
            return self.app(environ, start_response)
        status, headers, body = answer
        start_response(status, headers)
        return _Answer(body)

    def _serve(self, environ: dict[str, Any], started: float) -> tuple[str, list, bytes] | None:
        """The answer's status, headers and body; None for a request Django answers."""
        set_script_prefix(get_script_name(environ))  # as WSGIHandler: Location reads it
        signals.request_started.send(sender=WSGIHandler, environ=environ)
        client = _client(environ.get("HTTP_AUTHORIZATION", ""))
        if client is None:  # authenticated before any body is read: Django's 401, unread
            return None
        length = int(environ["CONTENT_LENGTH"])
        raw = environ["wsgi.input"].read(length) if length else b""
        environ["wsgi.input"] = io.BytesIO(raw)  # Django reads it if the lane does not answer
        item = data = None
        if len(raw) == length and not _LONG_NUMBER.search(raw):
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError:
                data = None
            if isinstance(data, dict):
                item = submission.checked_request(data, client=client)
        if item is None:
            return None
        throttle = ClientRateThrottle()
        if not throttle.allow_request(_User(client), None):
            return None  # not counted: Django's second look refuses it too and words the 429
        try:
            job, created = submission.submit_checked(item, client)
        except SubmissionError:  # refused before any write: Django answers it...
            throttle.uncount()  # ... and charges the throttle for it, once (D208)
            return None
        if created:
            job = as_stored(job)
        body = _RENDER(submitted_answer(job))
        replica.pin(client.pk)
        code = 201 if created else 200
        inner, outer = self.headers[_secure(environ)]
        headers = [("Content-Type", "application/json")]
        if created:
            headers.append(("Location", job_location(job.pk)))
        headers += [*inner, ("Content-Length", str(len(body))), *outer]
        self._count(code, started)
        return _STATUS[code], headers, body

    def _failed(self, environ, exc, started, start_response) -> Any:
        """Django's answer to a view's exception (handler500, got_request_exception, the
        django.request log) with what the middleware adds to it: never the server's bare
        500, which has no body, no security header and no count (D187, D207)."""
        m = self.metrics  # django_prometheus's process_exception
        m.exceptions_by_type.labels(type=type(exc).__name__).inc()
        m.exceptions_by_view.labels(view=self.view).inc()
        m.requests_latency_by_view_method.labels(view=self.view, method="POST").observe(
            TimeSince(started)
        )
        request = WSGIRequest(environ)  # the body, if read, is in a BytesIO: not read again
        response = response_for_exception(request, exc)
        inner, outer = self.headers[_secure(environ)]
        frame = [h for h in inner if h[0] == "X-Frame-Options"]
        length = [("Content-Length", str(len(response.content)))]
        headers = [*response.items(), *frame, *length, *outer]
        self._count(response.status_code, started, template=False)
        start_response(f"{response.status_code} {response.reason_phrase}", headers)
        return response  # its close() sends request_finished

    def _count(self, code: int, started: float, template: bool = True) -> None:
        """The series PrometheusBeforeMiddleware and our PrometheusAfterMiddleware write."""
        m, status = self.metrics, str(code)
        m.requests_total.inc()
        if template:  # DRF's Response is a template response
            m.responses_by_templatename.labels(templatename="None").inc()
        m.responses_by_status.labels(status=status).inc()
        m.responses_by_status_view_method.labels(status=status, view=self.view, method="POST").inc()
        m.requests_latency_by_view_method.labels(view=self.view, method="POST").observe(
            TimeSince(started)
        )
        m.responses_total.inc()
        m.requests_latency_before.observe(TimeSince(started))


def _secure(environ: dict[str, Any]) -> bool:
    """HttpRequest.is_secure()."""
    if django_settings.SECURE_PROXY_SSL_HEADER:
        header, value = django_settings.SECURE_PROXY_SSL_HEADER
        sent = environ.get(header)
        if sent is not None:
            return sent.split(",", 1)[0].strip() == value
    return environ.get("wsgi.url_scheme") == "https"


def _host_allowed(host: str) -> bool:
    domain, _ = split_domain_port(host)
    return bool(domain) and validate_host(domain, django_settings.ALLOWED_HOSTS)


def _client(header: str) -> Client | None:
    """ClientTokenAuthentication's answer when it accepts; None for anything it refuses
    (Django's path answers those, with the reason)."""
    try:
        found = client_for(header.encode("latin-1", "replace"))
    except AuthenticationFailed:
        return None
    return found[0] if found else None


class _User:
    def __init__(self, client: Client) -> None:
        self.user = client
