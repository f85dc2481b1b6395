"""OpenTelemetry spans of the job pipeline, after the messaging semantic conventions
(v1.44, D301).

Only the OpenTelemetry API is used, and its import is guarded (D302): without the
package, or with it and no SDK configured (the API's default provider), `tracer()` is
None and every caller returns after that one check.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit, urlunsplit

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, SpanKind, StatusCode
except ImportError:  # the `otel` extra is not installed: tracing stays off
    trace = None  # type: ignore[assignment]

SYSTEM = "jobservice"  # messaging.system: no value of the conventions' list fits
SCHEMA_URL = "https://opentelemetry.io/schemas/1.44.0"
MAX_TRACESTATE = 512  # W3C: 32 entries of at most 256 bytes; more is cut at an entry
MAX_STORED = 600  # the columns' bound: a traceparent (55) and a tracestate fit, with LINK
LINK = "~"  # before a stored context: link the attempt to it, do not parent under it
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")

# The raw headers of the request being served, for a deployment without the SDK: the
# job stores its caller's context as it came, so the Kafka record carries it on.
_incoming: ContextVar[str | None] = ContextVar("jobs_incoming_trace", default=None)

_tracer: Any = None
_provider: Any = None  # a provider of the caller's (tests, hosts without a global one)


def tracer() -> Any:
    """The app's tracer, or None while no SDK provider is configured."""
    global _tracer
    if _tracer is not None:
        return _tracer
    if trace is None:
        return None
    provider = _provider or trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    _tracer = provider.get_tracer("jobservice", schema_url=SCHEMA_URL)
    return _tracer


def use_provider(provider: Any) -> None:
    """Trace to `provider` instead of the global one (None: the global one again)."""
    global _tracer, _provider
    _provider, _tracer = provider, None


# --- the stored context -------------------------------------------------------------


def encode(carrier: Mapping[str, str]) -> str | None:
    """`traceparent`, and `tracestate` after a newline, as the job stores them; None when
    the carrier holds no valid traceparent."""
    parent = (carrier.get("traceparent") or "").strip().lower()
    if not _TRACEPARENT.match(parent) or parent.startswith("ff"):
        return None
    state = (carrier.get("tracestate") or "").strip()
    if len(state) > MAX_TRACESTATE:
        state = state[:MAX_TRACESTATE].rsplit(",", 1)[0]
    if not state.isascii() or "\n" in state:
        state = ""
    return f"{parent}\n{state}" if state else parent


def as_link(stored: str | None) -> str | None:
    """A stored context the worker links to and does not parent under (schedules)."""
    return LINK + stored if stored else None


def decode(stored: str) -> dict[str, str]:
    parent, _, state = stored.partition("\n")
    return {"traceparent": parent, "tracestate": state} if state else {"traceparent": parent}


def traceparent(stored: str | None) -> str | None:
    return stored.partition("\n")[0] if stored else None


def incoming(traceparent: str | None, tracestate: str | None = None) -> Any:
    """Hold a request's raw headers while it is served (`release(token)` after)."""
    stored = encode({"traceparent": traceparent or "", "tracestate": tracestate or ""})
    return _incoming.set(stored)


def release(token: Any) -> None:
    _incoming.reset(token)


def current() -> str | None:
    """The context a job submitted now stores: the active span's, else the request's."""
    if tracer() is None:
        return _incoming.get()
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return encode(carrier) or _incoming.get()


# --- spans --------------------------------------------------------------------------


def _attributes(queue: str, operation: str, name: str) -> dict[str, Any]:
    return {
        "messaging.system": SYSTEM,
        "messaging.operation.type": operation,
        "messaging.operation.name": name,
        "messaging.destination.name": queue,
    }


class Sent:
    """A submission's producer span ("send <queue>"): what the job stores comes from it."""

    __slots__ = ("span", "token", "context")

    def __init__(self, queue: str, task: str, count: int = 1) -> None:
        self.span = self.token = None
        t = tracer()
        if t is None:
            self.context = _incoming.get()
            return
        attributes = _attributes(queue, "send", "send")
        attributes["jobservice.task"] = task
        if count != 1:
            attributes["messaging.batch.message_count"] = count
        self.span = t.start_span(f"send {queue}", kind=SpanKind.PRODUCER, attributes=attributes)
        self.token = otel_context.attach(trace.set_span_in_context(self.span))
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        self.context = encode(carrier)

    def __enter__(self) -> Sent:
        return self

    def job(self, job_id: int) -> None:
        if self.span is not None:
            self.span.set_attribute("messaging.message.id", str(job_id))

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if self.span is None:
            return
        otel_context.detach(self.token)
        if exc is not None:
            self.span.set_attribute("error.type", type(exc).__qualname__)
            self.span.set_status(StatusCode.ERROR, str(exc)[:200])
        self.span.end()


def send(queue: str, task: str, write: Callable[..., tuple[Any, bool]]) -> tuple[Any, bool]:
    """`write(trace_context=...)` in the producer span, which it names after the job made."""
    with Sent(queue, task) as sent:
        job, created = write(trace_context=sent.context)
        sent.job(job.pk)
    return job, created


def process_span(
    queue: str, task: str, job_id: int, attempt: int, lease_version: int, stored: str | None
) -> Any:
    """An attempt's span ("process <queue>"): a child of the submission's producer span
    (one job is one message) and linked to it, as the conventions ask of a consumer."""
    t = tracer()
    linked_only = bool(stored) and stored.startswith(LINK)
    if linked_only:
        stored = stored[len(LINK) :]
    parent = propagate.extract(decode(stored)) if stored else None
    links = []
    if parent is not None:
        creation = trace.get_current_span(parent).get_span_context()
        if creation.is_valid:
            links.append(Link(creation, {"messaging.operation.type": "send"}))
    if linked_only:
        parent = None  # a schedule's firing: a trace of its own, linked to the creation
    attributes = _attributes(queue, "process", "process")
    attributes.update({
        "messaging.message.id": str(job_id),
        "jobservice.task": task,
        "jobservice.attempt": attempt,
        "jobservice.lease_version": lease_version,
    })  # fmt: skip
    return t.start_span(
        f"process {queue}", context=parent, kind=SpanKind.CONSUMER, links=links,
        attributes=attributes,
    )  # fmt: skip


def attach(span: Any) -> Any:
    return otel_context.attach(trace.set_span_in_context(span))


def detach(token: Any) -> None:
    otel_context.detach(token)


def failed(span: Any, exc: BaseException, error_type: str) -> None:
    span.record_exception(exc)
    span.set_attribute("error.type", error_type)
    span.set_status(StatusCode.ERROR, str(exc)[:200])


def settled(span: Any, outcome: str, status: str | None, retry: bool, stale: bool) -> None:
    """End an attempt's span once its write-back landed (or was fenced off)."""
    span.set_attribute("jobservice.outcome", outcome)
    if status is not None:
        span.set_attribute("jobservice.status", str(status))
        span.set_attribute("jobservice.retry", retry)
    span.set_attribute("jobservice.fence", "rejected" if stale else "held")
    if stale:
        span.add_event("jobservice.stale_write", {"jobservice.write": outcome})
    span.end()


class _Scoped:
    """A span current while its block runs (nothing at all while tracing is off)."""

    __slots__ = ("span", "token")

    def _start(self, name: str, **kwargs: Any) -> None:
        self.span = tracer().start_span(name, **kwargs)
        self.token = attach(self.span)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if self.span is None:
            return
        detach(self.token)
        if isinstance(exc, Exception):  # a park or a shutdown is not an error
            failed(self.span, exc, type(exc).__qualname__)
        self.span.end()


class Step(_Scoped):
    """A durable step's span, a child of its attempt's (INTERNAL, "step <name>")."""

    __slots__ = ()

    def __init__(self, name: str) -> None:
        self.span = self.token = None
        if tracer() is not None:
            self._start(f"step {name}", attributes={"jobservice.step": name})


class HttpCall(_Scoped):
    """An outgoing request's CLIENT span; its context goes out in `headers`."""

    __slots__ = ()

    def __init__(self, method: str, url: str, headers: dict[str, str]) -> None:
        self.span = self.token = None
        if tracer() is None:
            return
        parts = urlsplit(url)
        attributes: dict[str, Any] = {
            "http.request.method": method,
            # without the query or credentials: either may carry a secret
            "url.full": urlunsplit(
                (parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, "", "")
            ),
            "server.address": parts.hostname or "",
        }
        if parts.port is not None:
            attributes["server.port"] = parts.port
        self._start(method, kind=SpanKind.CLIENT, attributes=attributes)
        propagate.inject(headers)

    def answered(self, code: int) -> None:
        if self.span is not None:
            self.span.set_attribute("http.response.status_code", code)
            if code >= 400:
                self.span.set_attribute("error.type", str(code))
                self.span.set_status(StatusCode.ERROR)


def ids() -> tuple[str, str] | None:
    """(trace_id, span_id) of the active span, in hex; None without one."""
    if trace is None:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
