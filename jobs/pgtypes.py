"""PostgreSQL's infinite dates and times as Python values (D158).

`jobs_job.period` is 'infinity' for every hot row and `jobs_jobevent.job_created_at`
'-infinity' for legacy history; psycopg refuses to load either (Python's date and
datetime have no infinity). Every Django connection maps them to the extreme Python
values and back, in text and binary, so the ORM and the binary cursors read them.
"""

from __future__ import annotations

import datetime
import struct

from psycopg import pq
from psycopg.adapt import Loader as Loader_
from psycopg.types.datetime import (
    DateBinaryDumper,
    DateDumper,
    DatetimeBinaryDumper,
    DatetimeDumper,
)

HOT = datetime.date.max  # 'infinity': the hot partition's period
LEGACY = datetime.datetime.min.replace(tzinfo=datetime.UTC)  # '-infinity': legacy history

_DATE_INF = struct.pack("!i", 0x7FFFFFFF)
_DATE_NEG = struct.pack("!i", -0x80000000)
_TS_INF = struct.pack("!q", 0x7FFFFFFFFFFFFFFF)
_TS_NEG = struct.pack("!q", -0x8000000000000000)


class _InfDateDumper(DateDumper):
    def dump(self, obj):
        return b"infinity" if obj == HOT else super().dump(obj)


class _InfDateBinaryDumper(DateBinaryDumper):
    def dump(self, obj):
        return _DATE_INF if obj == HOT else super().dump(obj)


def _is_legacy(obj) -> bool:
    return obj.tzinfo is not None and obj == LEGACY


class _InfDatetimeDumper(DatetimeDumper):
    def dump(self, obj):
        return b"-infinity" if _is_legacy(obj) else super().dump(obj)


class _InfDatetimeBinaryDumper(DatetimeBinaryDumper):
    def dump(self, obj):
        return _TS_NEG if _is_legacy(obj) else super().dump(obj)


def _loader(base, fmt, *, high, low, inf: bytes, neg: bytes):
    """A loader wrapping psycopg's own (its C loaders cannot be subclassed)."""

    class Loader(Loader_):
        format = fmt
        timezone = getattr(base, "timezone", None)  # Django compares it per cursor

        def __init__(self, oid, context=None):
            super().__init__(oid, context)
            self._base = base(oid, context)

        def load(self, data):
            raw = bytes(data)
            if raw == inf:
                return high
            if raw == neg:
                return low
            return self._base.load(data)

    return Loader


def register(connection) -> None:
    """Teach one psycopg connection the infinities (Django's connection_created)."""
    adapters = connection.adapters
    dmin = datetime.date.min
    for fmt, inf, neg in (
        (pq.Format.TEXT, b"infinity", b"-infinity"),
        (pq.Format.BINARY, _DATE_INF, _DATE_NEG),
    ):
        base = adapters.get_loader(adapters.types["date"].oid, fmt)
        adapters.register_loader("date", _loader(base, fmt, high=HOT, low=dmin, inf=inf, neg=neg))
    tmax = datetime.datetime.max.replace(tzinfo=datetime.UTC)
    for fmt, inf, neg in (
        (pq.Format.TEXT, b"infinity", b"-infinity"),
        (pq.Format.BINARY, _TS_INF, _TS_NEG),
    ):
        base = adapters.get_loader(adapters.types["timestamptz"].oid, fmt)
        adapters.register_loader(
            "timestamptz", _loader(base, fmt, high=tmax, low=LEGACY, inf=inf, neg=neg)
        )
    adapters.register_dumper(datetime.date, _InfDateDumper)
    adapters.register_dumper(datetime.date, _InfDateBinaryDumper)
    adapters.register_dumper(datetime.datetime, _InfDatetimeDumper)
    adapters.register_dumper(datetime.datetime, _InfDatetimeBinaryDumper)


def on_connection_created(sender, connection, **kwargs) -> None:
    if connection.vendor == "postgresql":
        register(connection.connection)
