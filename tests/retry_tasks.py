"""Tasks with their own retry policy, for tests/test_retry_policy_e2e.py
(JOBS_TASK_MODULES=demo.tasks,tests.retry_tasks)."""

from __future__ import annotations

from typing import Any

from jobs.tasks import JobContext, task

BACKOFF = (0.3, 0.5, 0.0)  # base, max, jitter: 0.3 s, then 0.5 s (capped), no jitter


@task("retry.timeouts", retry_on=(TimeoutError,), give_up_on=(ConnectionRefusedError,),
      backoff=BACKOFF)  # fmt: skip
def timeouts(payload: Any, ctx: JobContext) -> Any:
    """Raises what the payload names: TimeoutError (retried), ValueError (not in retry_on)
    or ConnectionRefusedError (given up on, though it is no TimeoutError either)."""
    raise {"timeout": TimeoutError, "value": ValueError, "refused": ConnectionRefusedError}[
        payload["raise"]
    ](f"attempt {ctx.attempt}")
