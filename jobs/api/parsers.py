"""A JSON parser that refuses oversized bodies before reading them whole."""

from __future__ import annotations

import codecs
import json
import re
from typing import Any

import orjson
from django.utils.http import parse_header_parameters
from rest_framework.exceptions import ParseError, UnsupportedMediaType
from rest_framework.parsers import BaseParser

from jobs.api.errors import RequestTooLarge
from jobs.conf import settings

# Room for the other fields and for JSON that is escaped (\uXXXX) or pretty-printed:
# the payload limit itself is enforced on the re-serialised payload (jobs.submission).
BODY_SLACK_FACTOR = 8
BODY_SLACK_BYTES = 64 * 1024


def max_body_bytes() -> int:
    return BODY_SLACK_FACTOR * settings.JOBS_MAX_PAYLOAD_BYTES + BODY_SLACK_BYTES


class BoundedJSONParser(BaseParser):
    """Reject a body far larger than JOBS_MAX_PAYLOAD_BYTES with 413, unread when
    Content-Length says so, and never read more than the bound otherwise.

    Not a JSONParser subclass: DRF 3.18 hands those `request.body`, read whole and
    refused past DATA_UPLOAD_MAX_MEMORY_SIZE with Django's HTML 400; any other parser
    gets the raw stream, which this one reads only up to its bound."""

    media_type = "application/json"

    def max_bytes(self) -> int:
        return max_body_bytes()

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        limit = self.max_bytes()
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
        # The charset as sent: Django drops one it cannot look up, DRF then assumes UTF-8.
        _, params = parse_header_parameters(media_type or "")
        encoding = params.get("charset", "utf-8")
        if not _is_utf8(encoding):
            raise UnsupportedMediaType(
                media_type,
                detail=f"JSON must be UTF-8 (RFC 8259); charset={encoding!r} is not supported.",
            )
        if not _LONG_NUMBER.search(raw):  # orjson reads integers past 64 bits as floats
            try:
                return orjson.loads(raw)  # strict RFC 8259: NaN and Infinity refused too
            except orjson.JSONDecodeError:
                pass  # the standard parser decides, and words the error, as it always has
        try:
            text = raw.decode(encoding)
            return json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise ParseError(f"JSON parse error - {exc}") from exc


# 19 digits in a row: possibly an integer orjson cannot hold (the standard parser can).
_LONG_NUMBER = re.compile(rb"\d{19}")


def _is_utf8(encoding: str) -> bool:
    """JSON exchanged between systems is UTF-8 (RFC 8259 §8.1): any other charset,
    and a non-text codec such as hex, base64, rot13 or zlib, is refused (415)."""
    try:
        return codecs.lookup(encoding).name == "utf-8"
    except (LookupError, TypeError, ValueError):
        return False


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# A batch of up to 1,000 jobs: room for the usual small payloads of many jobs, while
# still bounded (a batch of large payloads is split by the client).
BATCH_BODY_FACTOR = 16


class BatchJSONParser(BoundedJSONParser):
    """The bounded parser for POST /api/v1/jobs/batch/ (BATCH_BODY_FACTOR × the single bound)."""

    def max_bytes(self) -> int:
        return BATCH_BODY_FACTOR * max_body_bytes()
