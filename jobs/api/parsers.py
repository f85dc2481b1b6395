"""A JSON parser that refuses oversized bodies before reading them whole."""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from jobs.api.errors import RequestTooLarge

# Room for the other fields and for JSON that is escaped (\uXXXX) or pretty-printed:
# the payload limit itself is enforced on the re-serialised payload (jobs.submission).
BODY_SLACK_FACTOR = 8
BODY_SLACK_BYTES = 64 * 1024


def max_body_bytes() -> int:
    return BODY_SLACK_FACTOR * settings.JOBS_MAX_PAYLOAD_BYTES + BODY_SLACK_BYTES


class BoundedJSONParser(JSONParser):
    """Reject a body far larger than JOBS_MAX_PAYLOAD_BYTES with 413, unread when
    Content-Length says so, and never read more than the bound otherwise."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        limit = max_body_bytes()
        request = (parser_context or {}).get("request")
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        try:
            if declared and int(declared) > limit:
                raise RequestTooLarge(f"Request body is {declared} bytes; the limit is {limit}.")
        except ValueError:
            raise ParseError("Invalid Content-Length header.") from None
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise RequestTooLarge(f"Request body exceeds {limit} bytes.")
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            text = raw.decode(encoding)
            return json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise ParseError(f"JSON parse error - {exc}") from exc


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
