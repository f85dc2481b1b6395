"""A workflow's creation: its row, its jobs and their dependency edges in one
transaction, idempotent per client and key; the roots are signalled once it commits.
What happens as the jobs end is the graph's trigger (jobs.graph) and
common.signal_woken_children.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from django.db import transaction

from jobs import metrics
from jobs.conf import settings
from jobs.exceptions import WorkflowIdempotencyConflict
from jobs.lifecycle import BLOCKED_RUN_AT, Status, WaitReason
from jobs.services.common import T, _count_on_commit, _hot_rows, _rows, signal_after_commit

_WORKFLOW_INSERT_SQL = """
INSERT INTO jobs_workflow (name, on_failure, client_id, unfinished, idempotency_key,
                           request_hash, created_at)
VALUES (%s, %s, %s, %s, %s, %s, now())
ON CONFLICT DO NOTHING RETURNING id"""
_WORKFLOW_BY_KEY_SQL = """
SELECT id, request_hash FROM jobs_workflow
WHERE client_id IS NOT DISTINCT FROM %s AND idempotency_key = %s"""
_WORKFLOW_IDS_SQL = (
    f"SELECT nextval(pg_get_serial_sequence('{T}', 'id')) FROM generate_series(1, %s)"
)
_WORKFLOW_JOBS_SQL = f"""
INSERT INTO {T} (id, task, payload, queue, priority, run_at, max_retries, client_id,
                 updated_by, status, retry_count, lease_version, wait_reason, concurrency_key,
                 timeout, trace_context)
SELECT u.id, u.task, u.payload::jsonb, u.queue, u.priority,
       CASE WHEN u.blocked THEN %(blocked)s::timestamptz ELSE now() END,
       u.max_retries, %(client)s, %(actor)s, '{Status.QUEUED}', 0, 0,
       CASE WHEN u.blocked THEN '{WaitReason.PARENTS}' END, u.ckey, u.timeout, %(trace)s
FROM unnest(%(ids)s::bigint[], %(tasks)s::text[], %(payloads)s::text[], %(queues)s::text[],
            %(priorities)s::int[], %(max_retries)s::int[], %(blocked_flags)s::boolean[],
            %(ckeys)s::text[], %(timeouts)s::float8[])
     AS u(id, task, payload, queue, priority, max_retries, blocked, ckey, timeout)"""
_WORKFLOW_NODES_SQL = """
INSERT INTO jobs_workflownode (job_id, workflow_id, key, pending_parents, ended)
SELECT u.id, %(workflow)s, u.key, u.pending, false
FROM unnest(%(ids)s::bigint[], %(keys)s::text[], %(pending)s::int[]) AS u(id, key, pending)"""
_WORKFLOW_EDGES_SQL = """
INSERT INTO jobs_jobdependency (child_id, parent_id)
SELECT u.child, u.parent FROM unnest(%(children)s::bigint[], %(parents)s::bigint[])
     AS u(child, parent)"""


def create_workflow(
    name: str,
    on_failure: str,
    steps: Sequence[tuple[str, Sequence[str], dict[str, Any]]],
    *,
    client_id: int | None = None,
    actor: str = "app",
    idempotency_key: str | None = None,
    request_hash: str | None = None,
    trace_context: str | None = None,
) -> tuple[int, bool]:
    """Insert a checked workflow (jobs.workflows.build): every job, node and edge in one
    (nested) transaction. Each step is (id, parent ids, checked submission arguments).
    Jobs without parents are due now and signalled on commit; the others wait for the
    database to count their parents down (jobs.graph). Returns (workflow id, created):
    a reused idempotency key returns the existing workflow, or raises
    WorkflowIdempotencyConflict when `request_hash` differs."""
    with transaction.atomic():
        row = _rows(
            _WORKFLOW_INSERT_SQL,
            [name, on_failure, client_id, len(steps), idempotency_key, request_hash],
        )
        if not row:
            existing_id, existing_hash = _rows(_WORKFLOW_BY_KEY_SQL, [client_id, idempotency_key])[
                0
            ]
            if existing_hash != request_hash:
                raise WorkflowIdempotencyConflict(existing_id)
            return existing_id, False
        workflow_id = row[0][0]
        ids = [r[0] for r in _rows(_WORKFLOW_IDS_SQL, [len(steps)])]
        by_key = {key: job_id for (key, _, _), job_id in zip(steps, ids, strict=True)}
        default_retries = settings.JOBS_MAX_RETRIES
        jobs = [job for _, _, job in steps]
        _hot_rows(
            _WORKFLOW_JOBS_SQL,
            {
                "ids": ids,
                "tasks": [j["task"] for j in jobs],
                "payloads": [j["payload_json"] for j in jobs],
                "queues": [j["queue"] for j in jobs],
                "priorities": [j["priority"] for j in jobs],
                "max_retries": [
                    default_retries if j["max_retries"] is None else j["max_retries"] for j in jobs
                ],
                "blocked_flags": [bool(after) for _, after, _ in steps],
                "ckeys": [j.get("concurrency_key") for j in jobs],
                "timeouts": [j.get("timeout") for j in jobs],
                "trace": trace_context,
                "blocked": BLOCKED_RUN_AT,
                "client": client_id,
                "actor": actor,
            },
        )
        _hot_rows(
            _WORKFLOW_NODES_SQL,
            {
                "workflow": workflow_id,
                "ids": ids,
                "keys": [key for key, _, _ in steps],
                "pending": [len(after) for _, after, _ in steps],
            },
        )
        edges = [(by_key[key], by_key[p]) for key, after, _ in steps for p in after]
        if edges:
            _hot_rows(
                _WORKFLOW_EDGES_SQL,
                {"children": [c for c, _ in edges], "parents": [p for _, p in edges]},
            )
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for job in jobs:
            counts[(job["queue"], job["task"])] += 1
        for (queue, task), n in counts.items():
            _count_on_commit(metrics.child(metrics.SUBMITTED, queue, task), n)
        roots = [(job_id, job["queue"]) for (_, after, job), job_id in zip(steps, ids, strict=True)
                 if not after]  # fmt: skip
        signal_after_commit(roots, park_on_failure=True)
    return workflow_id, True
