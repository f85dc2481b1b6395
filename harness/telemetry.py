"""Receivers for the telemetry a process sends, on free loopback ports: an OTLP/HTTP
trace endpoint (protobuf, as opentelemetry-exporter-otlp-proto-http posts it) and a
Sentry DSN endpoint that records each envelope's events. Real HTTP, nothing faked in
the sender."""

from __future__ import annotations

import gzip
import json
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from harness.receiver import serve_on_loopback


def _body(handler: BaseHTTPRequestHandler) -> bytes:
    raw = handler.rfile.read(int(handler.headers.get("content-length") or 0))
    encoding = (handler.headers.get("content-encoding") or "").lower()
    if encoding == "gzip":
        return gzip.decompress(raw)
    if encoding == "deflate":
        return zlib.decompress(raw)
    if encoding == "br":
        import brotli  # sentry-sdk compresses so only when brotli is installed

        return brotli.decompress(raw)
    return raw


def _answer(handler: BaseHTTPRequestHandler, content_type: str, body: bytes) -> None:
    handler.send_response(200)
    handler.send_header("content-type", content_type)
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@dataclass
class Span:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    links: list[tuple[str, str]]
    events: list[str]
    service: str
    status: int


@dataclass
class _Recorder:
    """What a receiver recorded, in arrival order, read from the test's thread."""

    items: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _record(self, found: list) -> None:
        with self.lock:
            self.items.extend(found)

    def received(self) -> list:
        with self.lock:
            return list(self.items)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class OtlpReceiver(_Recorder):
    """POST /v1/traces: every span received, decoded (`received()`: Span each)."""

    def __post_init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = ExportTraceServiceRequest()
                request.ParseFromString(_body(self))
                receiver._add(request)
                _answer(self, "application/x-protobuf", b"")

            def log_message(self, *args: Any) -> None:
                pass

        self.server, self.url = serve_on_loopback(Handler, "/v1/traces")

    def _add(self, request: Any) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    found.append(Span(
                        s.name, s.kind, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        {a.key: _value(a.value) for a in s.attributes},
                        [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        [e.name for e in s.events], str(resource.get("service.name")),
                        s.status.code,
                    ))  # fmt: skip
        self._record(found)


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@dataclass
class SentryReceiver(_Recorder):
    """A DSN's envelope endpoint (POST /api/<project>/envelope/): every event received
    (`received()`: the event payloads)."""

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                receiver._add(_body(self))
                _answer(self, "application/json", b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server, url = serve_on_loopback(Handler, "")
        host = url.removeprefix("http://")
        self.dsn = f"http://public@{host}/1"

    def _add(self, envelope: bytes) -> None:
        """An envelope: a header line, then per item a header line and its payload
        (`length` bytes, or up to the next newline)."""
        found = []
        pos = envelope.find(b"\n") + 1 if b"\n" in envelope else len(envelope)
        while pos < len(envelope):
            end = envelope.find(b"\n", pos)
            end = len(envelope) if end == -1 else end
            line, pos = envelope[pos:end], end + 1
            if not line.strip():
                continue
            item = json.loads(line)
            length = item.get("length")
            if length is None:
                end = envelope.find(b"\n", pos)
                end = len(envelope) if end == -1 else end
                payload, pos = envelope[pos:end], end + 1
            else:
                payload, pos = envelope[pos : pos + length], pos + length + 1
            if item.get("type") == "event":
                found.append(json.loads(payload))
        self._record(found)
