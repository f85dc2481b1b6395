"""Per-client quotas: how many schedules and webhooks a client may hold, how many
signals one job may hold, and the client's share of a queue's depth (D198). A setting
gives each default; a client's own column (set by staff in the admin) replaces it for
that client. A refusal is QuotaExceeded (the depth's: ClientQueueFull), naming the
limit, and writes nothing.

The check runs in the transaction of the write it guards, after locking the client's
row (or, for signals, the job's row, which deliver_signal locks first): two requests
racing for the last place are taken one after the other, so the limit holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connection

from jobs.conf import settings
from jobs.exceptions import QuotaExceeded


@dataclass(frozen=True)
class Quota:
    what: str  # in the message: "schedules", "webhooks", "signals per job"
    column: str  # jobs_client's override
    setting: str
    default: int
    count_sql: str


SCHEDULES = Quota("schedules", "max_schedules", "JOBS_MAX_SCHEDULES", 100,
                  "SELECT count(*) FROM jobs_schedule WHERE client_id = %s")  # fmt: skip
WEBHOOKS = Quota("webhooks", "max_webhooks", "JOBS_MAX_WEBHOOKS", 10,
                 "SELECT count(*) FROM jobs_webhook WHERE client_id = %s")  # fmt: skip
# Per queue: counted by jobs.submission (bounded, cached), refused as ClientQueueFull.
QUEUE_DEPTH = Quota("queued jobs per queue", "max_queue_depth", "JOBS_MAX_CLIENT_QUEUE_DEPTH",
                    10_000, "")  # fmt: skip
SIGNALS_PER_JOB = Quota("signals per job", "max_signals_per_job", "JOBS_MAX_SIGNALS_PER_JOB", 20,
                        "SELECT count(*) FROM jobs_jobsignal WHERE job_id = %s")  # fmt: skip

_LIMIT_SQL = "SELECT {column} FROM jobs_client WHERE id = %s"
_LOCKED_LIMIT_SQL = _LIMIT_SQL + " FOR NO KEY UPDATE"


def default(quota: Quota) -> int:
    return int(getattr(settings, quota.setting))


def limit(quota: Quota, client_id: int | None, *, lock: bool = False) -> int:
    """The client's limit (its column, else the setting); `lock` holds its row until
    the transaction ends, so a concurrent check of the same client waits."""
    if client_id is None:
        return default(quota)
    sql = (_LOCKED_LIMIT_SQL if lock else _LIMIT_SQL).format(column=quota.column)
    with connection.cursor() as cur:
        cur.execute(sql, [client_id])
        row = cur.fetchone()
    return default(quota) if row is None or row[0] is None else row[0]


def check_room(quota: Quota, client_id: int | None, counted_id: int | None = None) -> None:
    """Raise QuotaExceeded unless one more fits: `counted_id` is what the count is
    per (the client, or the job for signals). Call inside the guarded write's
    transaction; client rows are locked here, a job's by its caller."""
    allowed = limit(quota, client_id, lock=counted_id is None)
    with connection.cursor() as cur:
        cur.execute(quota.count_sql, [client_id if counted_id is None else counted_id])
        held = cur.fetchone()[0]
    if held >= allowed:
        raise QuotaExceeded(
            f"quota exceeded: at most {allowed} {quota.what}"
            + ("" if counted_id is not None else " per client")
            + f" (holds {held}); delete one or ask staff to raise the limit",
            field=None,
        )
