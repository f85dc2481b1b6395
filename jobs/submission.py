"""Submitting jobs: the rules (jobs.validation), room (jobs.admission), then the write.

    from jobs.submission import submit

    with transaction.atomic():
        order.save()
        job, created = submit("send-receipt", {"order": order.pk})

The job row is written in the caller's transaction and the Redis push runs when
that transaction commits (SPEC §1): the job exists exactly when the caller's
change does. The REST API calls the same function, so both paths enforce the
same rules and raise the same exceptions (all subclasses of SubmissionError).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from itertools import groupby
from typing import Any

from django.db import transaction

from jobs import metrics, queues, services
from jobs.admission import admit, check_room, due_soon
from jobs.exceptions import (  # noqa: F401  (re-exported: jobs.submission.QueueFull, ...)
    RETRY_AFTER_SECONDS,
    BatchIdempotencyConflict,
    BatchInvalid,
    ClientQueueFull,
    DebounceConflict,
    IdempotencyConflict,
    InvalidSubmission,
    PayloadTooLarge,
    QueueFull,
    RateLimited,
    RequestInvalid,
    SubmissionError,
    UnknownQueue,
    UnknownTask,
)
from jobs.flow import pipeline as flow
from jobs.flow import rules as flow_rules
from jobs.models import Client, Job
from jobs.observability import tracing
from jobs.services import Submitted
from jobs.validation import check_item

log = logging.getLogger(__name__)


def submit(
    task: str,
    payload: Any,
    *,
    client: Client | None = None,
    queue: str = "default",
    priority: int = 0,
    run_at: datetime | None = None,
    max_retries: int | None = None,
    idempotency_key: str | None = None,
    unique_key: str | None = None,
    concurrency_key: str | None = None,
    timeout: float | None = None,
    sequence_key: str | None = None,
    **flow_fields: Any,
) -> tuple[Job, bool]:
    """Validate and enqueue a job inside the caller's transaction.

    Returns (job, created). With `idempotency_key`, a repeat of the same request
    (same client) returns the existing job with created=False; a different
    request under the same key raises IdempotencyConflict. With `unique_key`,
    while a job of the same client with that key is queued, enqueue_failed or
    processing, that job is returned (created=False, `job.duplicate` True). A
    `concurrency_key` counts against its queue's `key_concurrency`; jobs with one
    `sequence_key` run one at a time in submission order (jobs.flow). Raises UnknownTask,
    InvalidSubmission, PayloadTooLarge or QueueFull and writes nothing when the
    submission is refused. The Redis push runs when the caller's transaction
    commits; if it fails the job is parked as enqueue_failed (the reaper
    repairs it), never lost. `flow_fields`: debounce_key, debounce_seconds,
    debounce_max_wait, key_strategy, rate_limit (jobs.flow, docs/queue-controls.md).
    """
    metric_queue = _metric_queue(queue)
    try:
        job, created = _submit(
            task,
            payload,
            queue=queue,
            priority=priority,
            run_at=run_at,
            max_retries=max_retries,
            idempotency_key=idempotency_key,
            client=client,
            unique_key=unique_key,
            concurrency_key=concurrency_key,
            timeout=timeout,
            sequence_key=sequence_key,
            flow_fields=flow_fields,
        )
    except SubmissionError as exc:
        metrics.SUBMISSIONS_REJECTED.labels(metric_queue, exc.code).inc()
        raise
    return job, created


def _submit(
    task: str,
    payload: Any,
    *,
    queue: str,
    priority: int,
    run_at: datetime | None,
    max_retries: int | None,
    idempotency_key: str | None,
    client: Client | None,
    unique_key: str | None = None,
    concurrency_key: str | None = None,
    timeout: float | None = None,
    sequence_key: str | None = None,
    flow_fields: dict[str, Any] | None = None,
) -> tuple[Job, bool]:
    unknown = sorted(set(flow_fields or {}) - set(flow_rules.FIELDS))
    if unknown:
        raise TypeError(f"submit() got unexpected keyword argument(s) {', '.join(unknown)}")
    item = {
        "task": task,
        "payload": payload,
        "queue": queue,
        "priority": priority,
        "run_at": run_at,
        "max_retries": max_retries,
        "idempotency_key": idempotency_key,
        "unique_key": unique_key,
        "concurrency_key": concurrency_key,
        "timeout": timeout,
        "sequence_key": sequence_key,
        **(flow_fields or {}),
    }
    check_item(item, for_client=client is not None)
    return submit_checked(item, client)


def submit_checked(item: dict[str, Any], client: Client | None) -> tuple[Job, bool]:
    """Backpressure and the write, for a submission check_item (or checked_request) has
    passed. A SubmissionError is raised before any write, uncounted. The write counts
    the job in the readings backpressure keeps (jobs.services.inserts)."""
    task, queue = item["task"], item["queue"]
    idempotency_key, digest = item["idempotency_key"], item["request_hash"]
    try:
        admit(queue, client, item["run_at"])
    except QueueFull:
        # A replay of a request that was already accepted is answered, not refused.
        existing = _existing(client, idempotency_key) or services.key_holder(
            client.pk if client is not None else None, item.get("unique_key")
        )
        if existing is None:
            raise
        if existing.duplicate:
            return existing, False
        if existing.request_hash != digest:
            raise IdempotencyConflict(existing) from None
        return existing, False
    actor = f"client:{client.name}" if client is not None else "app"
    if item["flow_control"]:  # debounce, a key's rate or strategy: jobs.flow
        write = partial(_flow_write, item, client, actor)
    else:  # the services' insert itself
        write = partial(services.submit, **_write_args(item, client, actor))
    job, created = tracing.send(queue, task, write)  # in its producer span (D302, D372)
    if created:
        fields = {
            "job_id": job.pk,
            "lease_version": job.lease_version,
            "queue": queue,
            "task": task,
        }
        if client is not None:
            fields["client"] = client.name
        log.debug("job submitted", extra=fields)  # per job: quiet unless LOG_LEVEL=DEBUG
    return job, created


def _write_args(item: dict[str, Any], client: Client | None, actor: str) -> dict[str, Any]:
    """services.submit's arguments for one checked item, but its trace context."""
    return {
        "task": item["task"],
        "payload": item["payload"],
        "queue": item["queue"],
        "priority": item["priority"],
        "run_at": item["run_at"],
        "max_retries": item["max_retries"],
        "client_id": client.pk if client is not None else None,
        "idempotency_key": item["idempotency_key"],
        "request_hash": item["request_hash"],
        "actor": actor,
        "payload_json": item["payload_json"],
        "unique_key": item.get("unique_key"),
        "concurrency_key": item.get("concurrency_key"),
        "timeout": item.get("timeout"),
        "sequence_key": item.get("sequence_key"),
    }


def _inserter(
    item: dict[str, Any], client: Client | None, actor: str, trace_context: str | None
) -> Callable[..., tuple[Job, bool]]:
    """The write of one checked item (services.submit); `run_at` given by jobs.flow."""
    args = _write_args(item, client, actor)

    def insert(run_at: datetime | None = None) -> tuple[Job, bool]:
        when = item["run_at"] if run_at is None else run_at
        return services.submit(**{**args, "run_at": when}, trace_context=trace_context)

    return insert


def _flow_write(
    item: dict[str, Any], client: Client | None, actor: str, *, trace_context: str | None
) -> tuple[Job, bool]:
    return _flow_submit(item, client, actor, _inserter(item, client, actor, trace_context))


def _flow_submit(
    item: dict[str, Any],
    client: Client | None,
    actor: str,
    insert: Callable[..., tuple[Job, bool]],
) -> tuple[Job, bool]:
    return flow.submit(
        item,
        client.pk if client is not None else 0,
        actor,
        insert,
        lambda: _existing(client, item["idempotency_key"]) is not None,
    )


def _metric_queue(queue: Any) -> str:
    """A label value for a queue: declared queues only, so a client cannot grow the series."""
    return queue if queues.is_declared(queue) else "-"


def _existing(client: Client | None, idempotency_key: str | None) -> Job | None:
    if idempotency_key is None:
        return None
    return Job.objects.filter(
        client_id=client.pk if client is not None else None, idempotency_key=idempotency_key
    ).first()


# --- requests as JSON (both API endpoints) -------------------------------------------

JOB_FIELDS = ("task", "payload", "queue", "priority", "run_at", "max_retries", "timeout")
REQUEST_FIELDS = (*JOB_FIELDS, "unique_key", "concurrency_key", "sequence_key", *flow_rules.FIELDS)
# Unique keys: single submissions only. Flow fields: per item, in item order (D360).
BATCH_FIELDS = (
    *JOB_FIELDS,
    "idempotency_key",
    "concurrency_key",
    "sequence_key",
    *flow_rules.FIELDS,
)


def _request_item(
    raw: Any, allowed: Sequence[str], idempotency_key: Any = None, *, for_client: bool = False
) -> tuple[dict[str, Any], list[SubmissionError]]:
    """One job as the API received it (decoded JSON) → the checked arguments of a
    submission, or every reason it is refused (unknown fields, missing ones, and the
    first rule of validate it breaks)."""
    if not isinstance(raw, dict):
        return {}, [InvalidSubmission("each job must be a JSON object", code="invalid")]
    errors: list[SubmissionError] = [
        InvalidSubmission(
            f"Unknown field {name!r}; allowed: {', '.join(allowed)}.",
            field=_shown_name(name),
            code="unknown_field",
        )
        for name in sorted(set(raw) - set(allowed), key=str)
    ]
    for name in ("task", "payload"):
        if name not in raw:
            errors.append(InvalidSubmission("This field is required.", field=name, code="required"))
    if "task" not in raw or "payload" not in raw:
        return {}, errors
    item = {
        "task": raw["task"],
        "payload": raw["payload"],
        "queue": raw.get("queue", "default"),
        "priority": raw.get("priority", 0),
        "run_at": raw.get("run_at"),
        "max_retries": raw.get("max_retries"),
        "idempotency_key": raw.get("idempotency_key", idempotency_key),
        "unique_key": raw.get("unique_key"),
        "concurrency_key": raw.get("concurrency_key"),
        "timeout": raw.get("timeout"),
        "sequence_key": raw.get("sequence_key"),
    }
    if item["payload"] is None:
        errors.append(
            InvalidSubmission("This field may not be null.", field="payload", code="null")
        )
        return {}, errors
    if "debounce_key" in allowed:
        item |= {name: raw.get(name) for name in flow_rules.FIELDS}
    try:
        check_item(item, for_client=for_client, run_at_text=True)
    except SubmissionError as exc:
        errors.append(exc)
    return ({}, errors) if errors else (item, [])


def _shown_name(name: Any) -> str:
    """A client's field name as an error key: bounded, and encodable (lone surrogates escaped)."""
    return str(name)[:100].encode("utf-8", "backslashreplace").decode("utf-8")


def submit_request(
    raw: Any, *, idempotency_key: str | None = None, client: Client | None = None
) -> tuple[Job, bool]:
    """POST /api/v1/jobs/: the decoded JSON body, checked by the rules `submit` applies.

    One broken rule raises its own SubmissionError; several raise RequestInvalid.
    """
    item, problems = _request_item(
        raw, REQUEST_FIELDS, idempotency_key, for_client=client is not None
    )
    if problems:
        queue = raw.get("queue", "default") if isinstance(raw, dict) else None
        for exc in problems:
            metrics.SUBMISSIONS_REJECTED.labels(_metric_queue(queue), exc.code).inc()
        if len(problems) == 1:
            raise problems[0]
        errors: dict[str, list[dict[str, str]]] = {}
        for exc in problems:
            errors.setdefault(exc.field or "non_field_errors", []).append(
                {"message": exc.message, "code": exc.code}
            )
        raise RequestInvalid(errors)
    try:
        return submit_checked(item, client)
    except SubmissionError as exc:
        metrics.SUBMISSIONS_REJECTED.labels(_metric_queue(item["queue"]), exc.code).inc()
        raise


def checked_request(raw: Any, *, client: Client) -> dict[str, Any] | None:
    """submit_request's checked item for a body without an Idempotency-Key, or None when
    a rule refuses it (uncounted: the caller hands the request to the view, which counts)."""
    item, problems = _request_item(raw, REQUEST_FIELDS, None, for_client=True)
    return None if problems else item


# --- many at once -------------------------------------------------------------------

MAX_BATCH = 1000


def submit_batch_request(body: Any, *, client: Client | None = None) -> list[Submitted]:
    """POST /api/v1/jobs/batch/: `{"jobs": [...]}` and nothing else, then submit_many."""
    if not isinstance(body, dict) or not isinstance(body.get("jobs"), list):
        raise RequestInvalid(
            {"jobs": [{"message": "A list of jobs is required.", "code": "required"}]}
        )
    unknown = sorted(set(body) - {"jobs"})
    if unknown:
        raise RequestInvalid(
            {
                _shown_name(name): [
                    {"message": "Unknown field; allowed: jobs.", "code": "unknown_field"}
                ]
                for name in unknown
            }
        )
    return submit_many(body["jobs"], client=client)


def submit_many(
    raw_items: Sequence[Any], *, client: Client | None = None, batch_id: int | None = None
) -> list[Submitted]:
    """Validate and enqueue up to MAX_BATCH jobs in one INSERT, all or nothing.

    Every job is held to the rules of `submit`; if any is refused, BatchInvalid
    reports each refused job and nothing is written. Backpressure counts the jobs
    the batch would create (QueueFull when a queue would pass JOBS_MAX_QUEUE_DEPTH;
    replays of existing jobs do not count, as for `submit`). Idempotency keys
    are per job: a replay returns the existing job (created=False); a key reused
    with a different request raises BatchIdempotencyConflict and writes nothing.
    One Redis push signals all due jobs when the caller's transaction commits.
    """
    total = len(raw_items)
    if not 1 <= total <= MAX_BATCH:
        raise InvalidSubmission(
            f"a batch holds 1 to {MAX_BATCH} jobs; got {total}", field="jobs", code="invalid_batch"
        )
    items: list[dict[str, Any]] = []
    errors: dict[str, list[dict[str, str]]] = {}
    refused = 0
    for n, raw in enumerate(raw_items):
        item, problems = _request_item(raw, BATCH_FIELDS, for_client=client is not None)
        if problems:
            refused += 1
            queue = raw.get("queue", "default") if isinstance(raw, dict) else None
            for exc in problems:
                key = f"jobs.{n}.{exc.field}" if exc.field else f"jobs.{n}"
                errors.setdefault(key, []).append({"message": exc.message, "code": exc.code})
                metrics.SUBMISSIONS_REJECTED.labels(_metric_queue(queue), exc.code).inc()
        items.append(item)
    if refused:
        raise BatchInvalid(errors, refused, total)

    per_queue = Counter(item["queue"] for item in items)
    # Only jobs the batch would create count: replays are answered, as for `submit`.
    due = Counter(item["queue"] for item in items if due_soon(item["run_at"]))
    check_room(per_queue, lambda: _new_per_queue(items, client), client, due)

    try:
        out = _write_many(items, client, batch_id)
    except BatchIdempotencyConflict as exc:
        for n in exc.conflicts:
            metrics.SUBMISSIONS_REJECTED.labels(items[n]["queue"], "idempotency_conflict").inc()
        raise
    created = [o for o in out if o.created]  # counted by their writes (jobs.services.inserts)
    if created:
        log.info(
            "%d job(s) submitted in one batch (ids %d..%d)",
            len(created),
            created[0].job_id,
            created[-1].job_id,
            extra={"client": client.name if client is not None else None},
        )
    return out


@dataclass(frozen=True, slots=True)
class FlowSubmitted(Submitted):
    """A batch item that went through jobs.flow: whether it joined a debounced job or
    its key_strategy skipped it (the single answer's `debounced` / `skipped`)."""

    debounced: bool = False
    skipped: bool = False


def _write_many(
    items: list[dict[str, Any]], client: Client | None, batch_id: int | None
) -> list[Submitted]:
    """The batch's writes, in item order, in one transaction: each run of plain items is
    one INSERT (services.submit_many); an item with flow fields goes through jobs.flow as
    a single submission would (D360). A refusal of any item undoes the whole batch."""
    actor = f"client:{client.name}" if client is not None else "app"
    trace_context = tracing.current()  # each job's process span links to it
    out: list[Submitted] = []
    with transaction.atomic():
        for flowed, group in groupby(enumerate(items), key=lambda p: p[1]["flow_control"]):
            run = list(group)
            start = run[0][0]
            if flowed:
                out += [_flow_item(n, i, client, actor, trace_context) for n, i in run]
                continue
            try:
                out += services.submit_many(
                    [_new_job(i, trace_context) for _, i in run],
                    client_id=client.pk if client is not None else None,
                    actor=actor,
                    batch_id=batch_id,  # jobs.flow.batches
                )
            except BatchIdempotencyConflict as exc:  # indexes of the run → of the batch
                if not start:
                    raise
                raise BatchIdempotencyConflict(
                    {start + n: job for n, job in exc.conflicts.items()}
                ) from None
    return out


def _new_job(i: dict[str, Any], trace_context: str | None) -> services.NewJob:
    return services.NewJob(
        i["task"],
        i["payload"],
        i["queue"],
        i["priority"],
        i["run_at"],
        i["max_retries"],
        i["idempotency_key"],
        i["request_hash"],
        i["payload_json"],
        i["concurrency_key"],
        i["timeout"],
        trace_context,
        i["sequence_key"],
    )


def _flow_item(
    n: int, item: dict[str, Any], client: Client | None, actor: str, trace_context: str | None
) -> Submitted:
    """One batch item through jobs.flow; a refusal names the item (`jobs.N.<field>`)."""
    try:
        job, created = _flow_submit(
            item, client, actor, _inserter(item, client, actor, trace_context)
        )
    except (RateLimited, DebounceConflict) as exc:
        exc.field = f"jobs.{n}.{exc.field}"
        metrics.SUBMISSIONS_REJECTED.labels(_metric_queue(item["queue"]), exc.code).inc()
        raise
    return FlowSubmitted(
        job.pk, created, job.status, job.queue, job.task, job.created_at, job.run_at,
        debounced=job.debounced, skipped=job.skipped,
    )  # fmt: skip


def _new_per_queue(items: list[dict[str, Any]], client: Client | None) -> dict[str, int]:
    """Per queue, how many jobs of the batch are not replays of an existing job (a key
    repeated within the batch creates one job)."""
    keys = {i["idempotency_key"] for i in items if i["idempotency_key"] is not None}
    existing = set(
        Job.objects.filter(
            client_id=client.pk if client is not None else None, idempotency_key__in=keys
        ).values_list("idempotency_key", flat=True)
    )
    seen: set[str] = set()
    new: dict[str, int] = {}
    for item in items:
        key = item["idempotency_key"]
        if key is not None:
            if key in existing or key in seen:
                continue
            seen.add(key)
        new[item["queue"]] = new.get(item["queue"], 0) + 1
    return new
