"""The Redis side of a write: job ids pushed once their transaction commits (SPEC §1).

PostgreSQL holds every fact and Redis only signals, so a lost push costs latency, never
a job: the submission path parks a row whose push failed (queued → enqueue_failed, for
the reaper to repair); every other re-signal is only counted, and polling or the
lost-signal sweep finds the row. Workflow children a statement made due are pushed the
same way (a hint: the wake-up itself is committed by the graph's trigger).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

from django.db import transaction

from jobs import lifecycle, metrics
from jobs.lifecycle import Role, Status
from jobs.services.common import T, _hot_rows, _rows
from jobs.transport import TransportError, get_transport

log = logging.getLogger(__name__)


def _group_by_queue(pairs: Iterable[tuple[int, str]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for job_id, queue in pairs:
        out[queue].append(job_id)
    return dict(out)


def signal_after_commit(
    pairs: Iterable[tuple[int, str]],
    *,
    park_on_failure: bool,
    on_parked: Callable[[list[int]], None] | None = None,
) -> None:
    """Push job ids to Redis once the current transaction commits (SPEC §1).

    With `park_on_failure`, a failed push moves the still-queued rows to
    enqueue_failed in a second short transaction (the API's submission path),
    then tells `on_parked` which ids it parked.
    Otherwise (re-signals by workers and the reaper) a failed push is only
    counted: the row stays queued and the lost-signal sweep or polling finds it.
    """
    ids_by_queue = _group_by_queue(pairs)
    if not ids_by_queue:
        return

    def push() -> None:
        try:
            get_transport().push(ids_by_queue)
        except TransportError as exc:
            ids = [i for ids in ids_by_queue.values() for i in ids]
            if park_on_failure:
                parked = mark_enqueue_failed(ids, reason=str(exc))
                if on_parked is not None:
                    on_parked(parked)
                log.warning(
                    "redis push failed; %d job(s) parked as enqueue_failed: %s",
                    len(parked),
                    exc,
                    extra={"job_ids": parked[:20]},
                )
            else:
                log.warning(
                    "redis re-signal failed for %d job(s); polling will find them: %s",
                    len(ids),
                    exc,
                    extra={"job_ids": ids[:20]},
                )

    transaction.on_commit(push)


def push_now_ignoring_rollback(pairs: Iterable[tuple[int, str]]) -> None:
    """Push ids at once, even inside a transaction that may still roll back.

    Safe only for rows already committed (a wake-up for an uncommitted or
    rolled-back row is a harmless duplicate delivery). Raises TransportError.
    """
    get_transport().push(_group_by_queue(pairs))


_PARK_SQL = f"""
UPDATE {T} SET status = '{Status.ENQUEUE_FAILED}', updated_by = '{Role.API}'
WHERE id = ANY(%s) AND {lifecycle.PARK.where()} RETURNING id, queue"""


def mark_enqueue_failed(job_ids: Sequence[int], reason: str = "") -> list[int]:
    """queued → enqueue_failed for rows whose push failed and nobody has claimed yet."""
    rows = _rows(
        _PARK_SQL,
        [list(job_ids)],
    )
    for _, queue in rows:
        metrics.ENQUEUE_FAILED.labels(queue).inc()
    return [r[0] for r in rows]


# Children a statement's ends just made due (jobs.graph) are found by polling; this
# pushes them at once (a hint only: the wake-up itself is committed), and reports the
# workflows these ends finished (their finished_at is the ending statement's time).
_AFTER_ENDS_SQL = f"""
SELECT j.id, j.queue, NULL::float8 FROM jobs_jobdependency d JOIN {T} j ON j.id = d.child_id
WHERE d.parent_id = ANY(%(ids)s::bigint[]) AND {lifecycle.WAKE.where("j.status")}
  AND j.run_at <= now() AND j.wait_reason IS NULL
UNION ALL
SELECT DISTINCT w.id, NULL, extract(epoch FROM w.finished_at - w.created_at)::float8
FROM jobs_workflownode wn JOIN jobs_workflow w ON w.id = wn.workflow_id
JOIN {T} j ON j.id = wn.job_id
WHERE wn.job_id = ANY(%(ids)s::bigint[]) AND w.finished_at = j.finished_at"""


def signal_woken_children(parent_ids: Sequence[int]) -> None:
    """Push the workflow children that the end of `parent_ids` made due (on commit), and
    observe the completion time of the workflows those ends finished."""
    if not parent_ids:
        return
    rows = _hot_rows(_AFTER_ENDS_SQL, {"ids": list(parent_ids)})
    signal_after_commit([r[:2] for r in rows if r[1] is not None], park_on_failure=False)
    for r in rows:
        if r[1] is None and r[2] is not None:
            metrics.WORKFLOW_SECONDS.observe(max(0.0, r[2]))
