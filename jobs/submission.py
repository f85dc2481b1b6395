"""Submitting jobs from Django code: validation, backpressure, transactional enqueue.

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

import hashlib
import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import groupby
from typing import Any

from django.db import connection, transaction
from django.utils.dateparse import parse_datetime

from jobs import metrics, queues, quotas, services, tasks
from jobs.conf import settings
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
from jobs.lifecycle import Status
from jobs.logconfig import job_log_fields
from jobs.models import PRIORITY_MAX, PRIORITY_MIN, Client, Job
from jobs.observability import hooks
from jobs.services import Submitted

log = logging.getLogger(__name__)

MAX_RETRIES_LIMIT = 100
MAX_PAYLOAD_DEPTH = 100
QUEUE_NAME_RE = queues.QUEUE_NAME_RE  # matched whole: fullmatch, never `$`
IDEMPOTENCY_KEY_RE = re.compile(r"[\x21-\x7e]{1,200}")  # printable ASCII, no spaces; fullmatch
TASK_NAME_MAX = 200
# How long a queue-depth reading is trusted, and what 429 tells clients to wait.
DEPTH_CACHE_SECONDS = 1.0


# --- validation -------------------------------------------------------------------


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSubmission(f"{name} must be an integer", field=name, code="invalid_" + name)
    if not lo <= value <= hi:
        raise InvalidSubmission(
            f"{name} must be between {lo} and {hi}", field=name, code="invalid_" + name
        )
    return value


def _storable_text(value: str) -> str | None:
    """Why PostgreSQL cannot store this string, or None: NUL, or a lone surrogate
    (a `\\ud800` escape is valid JSON text but no Unicode character, so not UTF-8)."""
    if "\x00" in value:
        return "NUL (\\u0000) characters"
    if _SURROGATE_RE.search(value):
        return "lone surrogate (\\ud800-\\udfff) characters"
    return None


_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _check_payload_shape(payload: Any) -> None:
    """Reject what PostgreSQL's jsonb cannot store (NUL, lone surrogates) and absurd
    nesting, so that a bad payload is a 400 and never a database error."""
    stack: list[tuple[Any, int]] = [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_PAYLOAD_DEPTH:
            raise InvalidSubmission(
                f"payload is nested deeper than {MAX_PAYLOAD_DEPTH} levels",
                field="payload",
                code="invalid_payload",
            )
        if isinstance(value, str):
            why = _storable_text(value)
            if why:
                raise InvalidSubmission(
                    f"payload strings may not contain {why}",
                    field="payload",
                    code="invalid_payload",
                )
        elif isinstance(value, dict):
            for k, v in value.items():
                why = _storable_text(k) if isinstance(k, str) else None
                if why:
                    raise InvalidSubmission(
                        f"payload keys may not contain {why}",
                        field="payload",
                        code="invalid_payload",
                    )
                stack.append((v, depth + 1))
        elif isinstance(value, list | tuple):
            stack.extend((v, depth + 1) for v in value)


def serialise_payload(payload: Any) -> bytes:
    """The payload as compact UTF-8 JSON: what JOBS_MAX_PAYLOAD_BYTES measures."""
    if payload is None:
        raise InvalidSubmission("payload may not be null", field="payload", code="invalid_payload")
    _check_payload_shape(payload)
    try:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidSubmission(
            f"payload is not JSON-serialisable: {exc}", field="payload", code="invalid_payload"
        ) from exc
    data = text.encode("utf-8")
    limit = settings.JOBS_MAX_PAYLOAD_BYTES
    if len(data) > limit:
        raise PayloadTooLarge(
            f"payload is {len(data)} bytes as JSON; the limit is {limit}", field="payload"
        )
    return data


def request_hash(
    task: str,
    payload: Any,
    queue: str,
    priority: int,
    run_at: datetime | None,
    max_retries: int,
    unique_key: str | None = None,
    concurrency_key: str | None = None,
    timeout: float | None = None,
    sequence_key: str | None = None,
) -> str:
    """SHA-256 of the normalised request, canonical JSON: what an idempotent replay must match.
    A unique_key, concurrency_key or timeout counts only when given, so hashes of requests
    without one are unchanged."""
    doc = {
        "task": task,
        "payload": payload,
        "queue": queue,
        "priority": priority,
        "run_at": run_at.astimezone(UTC).isoformat() if run_at is not None else None,
        "max_retries": max_retries,
    }
    if unique_key is not None:
        doc["unique_key"] = unique_key
    if concurrency_key is not None:
        doc["concurrency_key"] = concurrency_key
    if timeout is not None:
        doc["timeout"] = timeout
    if sequence_key is not None:
        doc["sequence_key"] = sequence_key
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# --- backpressure ---------------------------------------------------------------------
# Two limits (D198). A queue's depth, shared by everyone: past JOBS_MAX_QUEUE_DEPTH queued
# jobs, only those due within JOBS_QUEUE_DEPTH_HORIZON count, so parked work never refuses
# anybody. A client's share: at most its limit of queued jobs (parked ones too) in one
# queue, refused to that client alone. Each reading is a bounded count cached ~1 s per
# process; below both limits a submission costs the one count it always did.

_depth_lock = threading.Lock()
_depth_cache: dict[tuple, tuple[int, float]] = {}
_J = Job._meta.db_table
_DEPTH_SQL = (
    f"SELECT count(*) FROM (SELECT 1 FROM {_J} "
    f"WHERE status = '{Status.QUEUED}' AND queue = %s LIMIT %s) AS bounded"
)
# job_claim_idx holds run_at: the walk stays in the index.
_DUE_DEPTH_SQL = (
    f"SELECT count(*) FROM (SELECT 1 FROM {_J} WHERE status = '{Status.QUEUED}' AND queue = %s "
    "AND run_at <= now() + make_interval(secs => %s) LIMIT %s) AS bounded"
)
# job_fair_claim_idx: (queue, COALESCE(client_id, 0), ...) WHERE status = 'queued'.
_CLIENT_DEPTH_SQL = (
    f"SELECT count(*) FROM (SELECT 1 FROM {_J} WHERE status = '{Status.QUEUED}' AND queue = %s "
    "AND COALESCE(client_id, 0) = %s LIMIT %s) AS bounded"
)
# The lowest share any client has: below it, no client's own count is needed.
_LOWEST_SHARE_SQL = "SELECT min(max_queue_depth) FROM jobs_client"


def _cached_count(key: tuple, sql: str, params: list[Any]) -> int:
    now = time.monotonic()
    with _depth_lock:
        cached = _depth_cache.get(key)
        if cached is not None and cached[1] > now:
            return cached[0]
    with connection.cursor() as cur:
        cur.execute(sql, params)
        value = cur.fetchone()[0]
    with _depth_lock:
        _depth_cache[key] = (value, now + DEPTH_CACHE_SECONDS)
    return value


def queue_depth(queue: str, limit: int) -> int:
    """Queued jobs in `queue` as backpressure counts them, up to `limit` + 1: all of them
    while they are at most `limit`, else those due within JOBS_QUEUE_DEPTH_HORIZON.

    Each bounded count walks at most limit + 1 entries of the partial index job_claim_idx
    (past the limit, the parked entries too), cached ~1 s per process.
    """
    depth = _cached_count(("all", queue), _DEPTH_SQL, [queue, limit + 1])
    if depth <= limit:
        return depth
    horizon = float(settings.JOBS_QUEUE_DEPTH_HORIZON)
    return _cached_count(("due", queue), _DUE_DEPTH_SQL, [queue, horizon, limit + 1])


def _lowest_share() -> int:
    default = quotas.default(quotas.QUEUE_DEPTH)
    lowest = _cached_count(("lowest share",), _LOWEST_SHARE_SQL, [])
    return default if lowest is None else min(default, lowest)


def check_share(queue: str, client: Client | None, new: int) -> None:
    """ClientQueueFull when `new` more jobs would take the client past its share of
    `queue` (code without a client has none). The client's own count is read only when
    the whole queue holds more than the lowest share any client has."""
    if client is None or new <= 0:
        return
    limit = settings.JOBS_MAX_QUEUE_DEPTH
    depth = _cached_count(("all", queue), _DEPTH_SQL, [queue, limit + 1])
    if depth <= limit and depth + new <= _lowest_share():
        return
    share = quotas.limit(quotas.QUEUE_DEPTH, client.pk)
    held = _cached_count(("client", queue, client.pk), _CLIENT_DEPTH_SQL,
                         [queue, client.pk, share + 1])  # fmt: skip
    if held + new > share:
        raise ClientQueueFull(queue, held, share)


def _count_accepted(queue: str, n: int = 1, client_id: int | None = None) -> None:
    """Keep this process's cached readings current between refreshes."""
    with _depth_lock:
        for key in (("all", queue), ("due", queue), ("client", queue, client_id)):
            cached = _depth_cache.get(key)
            if cached is not None:
                _depth_cache[key] = (cached[0] + n, cached[1])


def due_soon(run_at: datetime | None) -> bool:
    """A job due within JOBS_QUEUE_DEPTH_HORIZON counts toward the shared depth."""
    horizon = timedelta(seconds=float(settings.JOBS_QUEUE_DEPTH_HORIZON))
    return run_at is None or run_at <= datetime.now(UTC) + horizon


def check_room(
    per_queue: Mapping[str, int],
    new_per_queue: Callable[[], Mapping[str, int]],
    client: Client | None = None,
    due_per_queue: Mapping[str, int] | None = None,
) -> None:
    """Backpressure for many jobs at once (a batch, a workflow): QueueFull for the first
    queue its due jobs (`due_per_queue`, default all) would take past JOBS_MAX_QUEUE_DEPTH,
    ClientQueueFull for the first its jobs would take past the client's share, counting
    every job refused. `new_per_queue` (the jobs that are not replays) is asked only when
    a queue is near full; a refusal writes nothing."""
    limit = settings.JOBS_MAX_QUEUE_DEPTH
    due = per_queue if due_per_queue is None else due_per_queue
    over = [q for q, n in due.items() if n and queue_depth(q, limit) + n > limit]
    new: Mapping[str, int] | None = None
    for queue in over:
        new = new_per_queue() if new is None else new
        depth = queue_depth(queue, limit)
        adding = min(new.get(queue, 0), due[queue])
        if adding and depth + adding > limit:
            metrics.SUBMISSIONS_REJECTED.labels(queue, QueueFull.code).inc(sum(per_queue.values()))
            raise QueueFull(queue, depth, limit)
    if client is None:
        return
    try:
        for queue, n in per_queue.items():
            try:
                check_share(queue, client, n)
            except ClientQueueFull:
                new = new_per_queue() if new is None else new
                check_share(queue, client, new.get(queue, 0))
    except ClientQueueFull as exc:
        metrics.SUBMISSIONS_REJECTED.labels(exc.queue, exc.code).inc(sum(per_queue.values()))
        raise


def count_accepted(per_queue: Mapping[str, int], client_id: int | None = None) -> None:
    for queue, n in per_queue.items():
        _count_accepted(queue, n, client_id)


def clear_depth_cache() -> None:
    with _depth_lock:
        _depth_cache.clear()


# --- the entry point --------------------------------------------------------------


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
    run_at, max_retries, digest, payload_json, timeout = _validate(
        task,
        payload,
        queue,
        priority,
        run_at,
        max_retries,
        idempotency_key,
        unique_key,
        concurrency_key,
        timeout,
        sequence_key,
        for_client=client is not None,
    )
    item = {
        "task": task,
        "payload": payload,
        "queue": queue,
        "priority": priority,
        "run_at": run_at,
        "max_retries": max_retries,
        "idempotency_key": idempotency_key,
        "request_hash": digest,
        "payload_json": payload_json,
        "unique_key": unique_key,
        "concurrency_key": concurrency_key,
        "timeout": timeout,
        "sequence_key": sequence_key,
        **(flow_fields or {}),
    }
    flow_rules.check(item)
    return submit_checked(item, client)


def submit_checked(item: dict[str, Any], client: Client | None) -> tuple[Job, bool]:
    """Backpressure and the write, for a submission _validate (or checked_request) has
    passed. A SubmissionError is raised before any write, uncounted."""
    task, queue = item["task"], item["queue"]
    idempotency_key, digest = item["idempotency_key"], item["request_hash"]
    limit = settings.JOBS_MAX_QUEUE_DEPTH
    depth = queue_depth(queue, limit)
    try:
        if depth > limit and due_soon(item["run_at"]):
            raise QueueFull(queue, depth, limit)
        check_share(queue, client, 1)
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
    with hooks.sending(queue, task) as sent:  # the producer span (jobs.observability)
        insert = _inserter(item, client, actor, sent.context)
        if flow_rules.wanted(item):  # debounce, a key's rate or strategy: jobs.flow
            job, created = _flow_submit(item, client, actor, insert)
        else:
            job, created = insert()
        sent.job(job.pk)
    if created:
        _count_accepted(queue, 1, client.pk if client is not None else None)
        log.debug(  # per job on the hot path: quiet unless LOG_LEVEL=DEBUG
            "job submitted",
            extra=job_log_fields(
                job.pk,
                job.lease_version,
                None,
                queue,
                task,
                client=client.name if client is not None else None,
            ),
        )
    return job, created


def _inserter(
    item: dict[str, Any], client: Client | None, actor: str, trace_context: str | None
) -> Callable[..., tuple[Job, bool]]:
    """The write of one checked item (services.submit); `run_at` given by jobs.flow."""

    def insert(run_at: datetime | None = None) -> tuple[Job, bool]:
        return services.submit(
            item["task"],
            item["payload"],
            queue=item["queue"],
            priority=item["priority"],
            run_at=item["run_at"] if run_at is None else run_at,
            max_retries=item["max_retries"],
            client_id=client.pk if client is not None else None,
            idempotency_key=item["idempotency_key"],
            request_hash=item["request_hash"],
            actor=actor,
            payload_json=item["payload_json"],
            unique_key=item.get("unique_key"),
            concurrency_key=item.get("concurrency_key"),
            timeout=item.get("timeout"),
            trace_context=trace_context,
            sequence_key=item.get("sequence_key"),
        )

    return insert


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


def parse_run_at(value: Any, *, text: bool = False) -> datetime | None:
    """run_at as an aware UTC datetime: an aware datetime, or with `text` (JSON requests)
    ISO 8601 text, where no offset means UTC. Impossible dates (Feb 30, hour 25) and times
    that leave the calendar once in UTC (year 1 at +05:00) are refused here, and offsets
    PostgreSQL refuses (past ±15:59) are normalised: never a database error."""
    if value is None:
        return None
    if isinstance(value, str) and text:
        try:
            parsed = parse_datetime(value)
        except ValueError:
            parsed = None
        if parsed is None:
            raise InvalidSubmission(
                "run_at must be an ISO 8601 date-time", field="run_at", code="invalid_run_at"
            )
        value = parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise InvalidSubmission(
            "run_at must be a timezone-aware datetime", field="run_at", code="invalid_run_at"
        )
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise InvalidSubmission(
            "run_at is out of range once converted to UTC (years 1 to 9999)",
            field="run_at",
            code="invalid_run_at",
        ) from None


def _validate(
    task: Any,
    payload: Any,
    queue: Any,
    priority: Any,
    run_at: Any,
    max_retries: Any,
    idempotency_key: Any,
    unique_key: Any = None,
    concurrency_key: Any = None,
    timeout: Any = None,
    sequence_key: Any = None,
    *,
    for_client: bool = False,
) -> tuple[datetime | None, int, str | None, str, float | None]:
    """Every rule one submission must pass; returns (run_at in UTC, max_retries,
    request hash or None, the payload as compact JSON, the timeout in seconds or None).

    Raises a SubmissionError naming the field. Shared by submit and submit_many (and
    so by both API endpoints): a job in a batch is held to exactly the rules of a
    single one. `for_client`: the job belongs to an API client, which may run public
    tasks in open queues only (an internal task or queue is refused exactly like a name
    that does not exist).
    """
    if (
        not isinstance(task, str)
        or len(task) > TASK_NAME_MAX
        or tasks.get(task) is None
        or (for_client and not tasks.is_public(task))
    ):
        shown = repr(task) if len(repr(task)) <= 210 else repr(task)[:200] + "…"
        raise UnknownTask(
            f"unknown task {shown}; known: {', '.join(tasks.public_names())}", field="task"
        )
    if not queues.valid_name(queue):
        raise InvalidSubmission(
            "queue must be 1-100 characters of letters, digits, '_', '.', ':' or '-'",
            field="queue",
            code="invalid_queue",
        )
    # An internal queue (the service's own, or marked so) answers a client as a name that
    # does not exist, and no client's answer lists it (D197).
    if not queues.is_declared(queue) or (for_client and queues.is_internal(queue)):
        shown = queues.open_names() if for_client else queues.declared()
        raise UnknownQueue(
            f"unknown queue {queue!r}; declared (JOBS_QUEUES): {', '.join(shown)}",
            field="queue",
        )
    priority = _check_int("priority", priority, PRIORITY_MIN, PRIORITY_MAX)
    if max_retries is None:
        max_retries = settings.JOBS_MAX_RETRIES
    max_retries = _check_int("max_retries", max_retries, 0, MAX_RETRIES_LIMIT)
    run_at = parse_run_at(run_at)
    codes = {
        "idempotency_key": "invalid_idempotency_key",
        "unique_key": "invalid_unique_key",
        "concurrency_key": "invalid_concurrency_key",
        "sequence_key": "invalid_sequence_key",
    }
    for field, key in (
        ("idempotency_key", idempotency_key),
        ("unique_key", unique_key),
        ("concurrency_key", concurrency_key),
        ("sequence_key", sequence_key),
    ):
        if key is not None and (not isinstance(key, str) or not IDEMPOTENCY_KEY_RE.fullmatch(key)):
            shown = "idempotency key" if field == "idempotency_key" else field
            raise InvalidSubmission(
                f"{shown} must be 1-200 printable ASCII characters without spaces",
                field=field,
                code=codes[field],
            )
    timeout = check_timeout(timeout)
    payload_json = serialise_payload(payload).decode("utf-8")
    try:
        tasks.validate_payload(task, payload)
    except tasks.InvalidPayload as exc:
        raise InvalidSubmission(str(exc), field="payload", code="invalid_payload") from exc

    digest = None
    if idempotency_key is not None:
        digest = request_hash(
            task,
            payload,
            queue,
            priority,
            run_at,
            max_retries,
            unique_key,
            concurrency_key,
            timeout,
            sequence_key,
        )
    return run_at, max_retries, digest, payload_json, timeout


def check_timeout(value: Any) -> float | None:
    """A job's own attempt timeout in seconds: None, or a number > 0 and at most
    JOBS_MAX_TIMEOUT (jobs.watchdog)."""
    if value is None:
        return None
    limit = float(settings.JOBS_MAX_TIMEOUT)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= limit  # NaN fails this too
    ):
        raise InvalidSubmission(
            f"timeout must be a number of seconds > 0 and at most {limit:g} (JOBS_MAX_TIMEOUT)",
            field="timeout",
            code="invalid_timeout",
        )
    return float(value)


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
    first rule of _validate it breaks)."""
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
    try:
        item["run_at"] = parse_run_at(item["run_at"], text=True)
        (
            item["run_at"],
            item["max_retries"],
            item["request_hash"],
            item["payload_json"],
            item["timeout"],
        ) = _validate(**item, for_client=for_client)
        if "debounce_key" in allowed:
            item |= {name: raw.get(name) for name in flow_rules.FIELDS}
            flow_rules.check(item)
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
    created = [o for o in out if o.created]
    for queue in per_queue:
        _count_accepted(
            queue,
            sum(1 for o in created if o.queue == queue),
            client.pk if client is not None else None,
        )
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
    trace_context = hooks.current_context()  # each job's process span links to it
    out: list[Submitted] = []
    with transaction.atomic():
        for flowed, group in groupby(enumerate(items), key=lambda p: flow_rules.wanted(p[1])):
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
