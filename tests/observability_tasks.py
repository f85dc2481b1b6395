"""Tasks of the observability tests (JOBS_TASK_MODULES=demo.tasks,tests.observability_tasks)."""

from __future__ import annotations

import logging
from typing import Any

from jobs import services
from jobs.tasks import task

log = logging.getLogger("tests.observability")


class CardDeclined(Exception):
    """The first attempt's failure: retried by the default policy."""


@task("obs.step_then_retry")
def step_then_retry(payload: Any, ctx: Any) -> dict:
    """A durable step, then a failure on the first attempt only: one trace shows both
    attempts, the step (run once: the second attempt reads its checkpoint) and the
    retry."""
    charged = ctx.step("charge", lambda: {"charged": payload.get("amount", 1)})
    log.warning("charging in the handler")
    if ctx.attempt == 1:
        raise CardDeclined("card declined, try again")
    return charged


@task("obs.always_fails")
def always_fails(payload: Any, ctx: Any) -> None:
    raise CardDeclined(f"declined on attempt {ctx.attempt}")


@task("obs.stale_failure")
def stale_failure(payload: Any, ctx: Any) -> None:
    """Its lease is revoked while it runs (as staff would), then it raises: the failure
    it reports is a stale write, fenced off."""
    services.revoke([ctx.job_id], "staff:test")
    raise CardDeclined("too late: another attempt owns the job")
