"""The attempt a thread runs, for its log lines (jobs.observability.logs)."""

from __future__ import annotations

from contextvars import ContextVar

# (job_id, task) of the attempt this thread runs: every log line inside it carries them.
running_job: ContextVar[tuple[int, str] | None] = ContextVar("jobs_running_job", default=None)
