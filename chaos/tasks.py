"""Tasks only the fault suite submits (JOBS_TASK_MODULES=demo.tasks,chaos.tasks)."""

from __future__ import annotations

from typing import Any

from jobs.tasks import JobContext, task

BAD_RESULTS = {
    "set": lambda: {"ids": {1, 2}},  # not JSON
    "nan": lambda: {"ratio": float("nan")},  # JSON to Python, not to jsonb
    "nul": lambda: {"text": "a\x00b"},  # jsonb cannot hold NUL
}


@task("chaos.bad_result")
def bad_result(payload: Any, ctx: JobContext) -> Any:
    """Return a result PostgreSQL cannot store: the job must fail, not the worker (D20)."""
    kind = payload.get("kind") if isinstance(payload, dict) else None
    return BAD_RESULTS.get(kind, BAD_RESULTS["set"])()
