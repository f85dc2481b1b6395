"""What a new job does when its concurrency key is busy (`key_strategy`).

Busy: the key (client, queue, concurrency_key) has a live job, queued, enqueue_failed
or processing. `queue` (the default) lets the new job wait its turn. `cancel_running`
asks the key's processing jobs to stop (cooperatively: the handler sees ctx.stop at the
next heartbeat, any requeue ends the job) and cancels its queued ones, so the new job
is the one that runs. `skip_new` ends the new job at once, failed with a `skipped:`
error that names the busy job, and answers it so. Submissions that ask for a strategy
take a transaction advisory lock on the key, so two of them never both find it free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import connection

from jobs import lifecycle, services
from jobs.flow import keyrate, rules
from jobs.lifecycle import NON_TERMINAL
from jobs.models import Job

T = Job._meta.db_table
# Processing rows through job_key_processing_idx; queued ones through the client's
# entries of job_fair_claim_idx in the queue.
_LIVE_SQL = f"""
SELECT id, status FROM {T}
WHERE queue = %(queue)s AND COALESCE(client_id, 0) = %(client)s
  AND concurrency_key = %(key)s
  AND status IN ({lifecycle.sql_list(NON_TERMINAL)}) AND {lifecycle.hot_sql()}
ORDER BY id"""
SKIPPED = "skipped: concurrency key busy"


def submit(
    item: dict[str, Any], client_key: int, actor: str, insert: Callable[[], tuple[Job, bool]]
) -> tuple[Job, bool]:
    """Apply the item's key_strategy around `insert()`. Call inside a transaction."""
    strategy, key, queue = item["key_strategy"], item["concurrency_key"], item["queue"]
    keyrate.lock_key("busy", queue, client_key, key)
    with connection.cursor() as cur:
        cur.execute(_LIVE_SQL, {"queue": queue, "client": client_key, "key": key})
        live = [r[0] for r in cur.fetchall()]
    if strategy == rules.CANCEL_RUNNING and live:
        services.request_cancel(live, f"{actor}:cancel_running")
    job, created = insert()
    if strategy == rules.SKIP_NEW and live and created:
        services.cancel([job.pk], actor, error=f"{SKIPPED} (job {live[0]})")
        job = Job.objects.get(pk=job.pk)
        job.skipped = True
    return job, created
