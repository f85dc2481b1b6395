"""A submission with flow fields, in the order the controls apply
(docs/queue-controls.md): the drop form of a key's rate (`rate_limit`, refused with
429), then debounce (join the key's waiting job, or make one), then the key strategy
(only for a job being made), then the insert. One transaction (a savepoint inside the
caller's), so a refusal or a failure writes nothing and counts nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db import transaction

from jobs.exceptions import RateLimited
from jobs.flow import debounce, keyrate, rules, strategies
from jobs.models import Job


def submit(
    item: dict[str, Any],
    client_key: int,
    actor: str,
    insert: Callable[[datetime | None], tuple[Job, bool]],
    replay: Callable[[], bool],
) -> tuple[Job, bool]:
    """`insert(run_at)` writes the job (services.submit); `replay()` says whether the
    request's idempotency key already made one (a replay is answered, never counted
    nor refused by the rate)."""
    queue, key = item["queue"], item.get("concurrency_key")
    limit = item["rate_limit"]
    with transaction.atomic():
        counted = limit is not None and not replay()
        if counted:
            keyrate.lock_key(keyrate.SUBMIT, queue, client_key, key)
            wait = keyrate.submission_retry_after(queue, client_key, key, *limit)
            if wait is not None:
                raise RateLimited(key, *limit, wait)

        def make(run_at: datetime | None) -> tuple[Job, bool]:
            if item["key_strategy"] in (None, rules.QUEUE):
                return insert(run_at)
            return strategies.submit(item, client_key, actor, lambda: insert(run_at))

        if item["debounce_key"] is not None:
            job, created = debounce.submit(item, client_key, actor, make)
        else:
            job, created = make(None)
        if counted and (created or job.debounced):
            keyrate.record_submission(queue, client_key, key)
    return job, created
