"""Log formatting: every line about a job carries its identity (SPEC §7).

Callers pass job fields through `extra=job_log_fields(...)`; the formatters put
them on the line, as JSON keys in production or `key=value` pairs in development.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

JOB_FIELDS = ("job_id", "lease_version", "worker_id", "queue", "task")
_RESERVED = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def job_log_fields(
    job_id: int | None = None,
    lease_version: int | None = None,
    worker_id: str | None = None,
    queue: str | None = None,
    task: str | None = None,
    **more: Any,
) -> dict[str, Any]:
    fields = {
        "job_id": job_id,
        "lease_version": lease_version,
        "worker_id": worker_id,
        "queue": queue,
        "task": task,
    }
    fields.update(more)
    return {k: v for k, v in fields.items() if v is not None}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _RESERVED}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(_extras(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The fields on the message's line, before a traceback (a line filter that
        finds the message finds the job too)."""
        line = super().formatMessage(record)
        extras = _extras(record)
        if extras:
            line += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        return line
