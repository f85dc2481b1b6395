"""JSON responses through orjson: several times faster than the standard encoder DRF uses."""

from __future__ import annotations

from typing import Any

import orjson
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import JSONRenderer

# Values DRF's encoder formats its own way (datetimes cut to milliseconds, dataclasses
# refused) go to `default`, which refuses them too: DRF's renderer then does the job.
_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS


class ORJSONRenderer(JSONRenderer):
    """The document DRF's JSONRenderer produces (compact, UTF-8, U+2028/U+2029 escaped;
    a float may be spelt 1e-7 for 1e-07), from orjson; anything orjson cannot write as
    DRF would is left to DRF's renderer."""

    def render(
        self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None
    ) -> bytes:
        if data is None:
            return b""
        if self.get_indent(accepted_media_type or "", renderer_context or {}):
            return super().render(data, accepted_media_type, renderer_context)
        try:
            out = orjson.dumps(data, option=_OPTIONS)
        except TypeError:  # big integers, datetimes, lazy strings, ...
            return super().render(data, accepted_media_type, renderer_context)
        return out.replace(b"\xe2\x80\xa8", b"\\u2028").replace(b"\xe2\x80\xa9", b"\\u2029")


class JSONFirstNegotiation(DefaultContentNegotiation):
    """DRF's negotiation, answered at once for what API clients send: no Accept header,
    `*/*` or `application/json`, with no `?format=` and no format suffix. DRF would pick
    the first renderer (JSON) with media type `application/json` for each of these, after
    parsing the header and matching every renderer: a visible share of a submission's CPU."""

    FAST_ACCEPTS = frozenset((None, "*/*", "application/json"))  # None: no header (not "")

    def select_renderer(self, request: Any, renderers: Any, format_suffix: Any = None) -> Any:
        if (
            format_suffix is None
            and renderers
            and renderers[0].media_type == "application/json"
            and request.META.get("HTTP_ACCEPT") in self.FAST_ACCEPTS
            and not request.META.get("QUERY_STRING")
        ):
            return renderers[0], "application/json"
        return super().select_renderer(request, renderers, format_suffix)
