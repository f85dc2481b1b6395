"""A logging filter that joins log lines to traces and jobs (docs/observability.md).

Add it to a handler (`"filters": ["jobs"]` with `{"()": "jobs.observability.logs.
JobContextFilter"}`): each record gets `trace_id`/`span_id` while a span is active, and
`job_id`/`task` inside an attempt, unless the call's own `extra` set them.
"""

from __future__ import annotations

import logging

from jobs.observability import tracing
from jobs.observability.context import running_job


class JobContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        job = running_job.get()
        if job is not None:
            if not hasattr(record, "job_id"):
                record.job_id = job[0]
            if not hasattr(record, "task"):
                record.task = job[1]
        ids = tracing.ids()
        if ids is not None and not hasattr(record, "trace_id"):
            record.trace_id, record.span_id = ids
        return True
