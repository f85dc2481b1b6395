"""Batches with callbacks (issue 46.5): N jobs submitted together, and `on_complete` /
`on_success` / `on_failure` jobs that run exactly once, after the last of them ended,
with the batch's counts and failed ids merged into their payload under "batch":
`{"id", "name", "total", "succeeded", "failed", "failed_ids"}` (a Django task's
callback gets it as the keyword argument `batch`).

The bookkeeping is the database's (jobs.flow.triggers), linear in the batch: one
jobs_batch row counted down once per write-back statement, one jobs_batchfailure row
per failed job, no edge per job (the workflow graph would write one per job).
`on_success` runs when no job failed, `on_failure` when one did, `on_complete` always.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction

from jobs import submission, tasks, validation
from jobs.exceptions import BatchInvalid, InvalidSubmission, RequestInvalid
from jobs.flow import rules
from jobs.flow.triggers import CALLBACKS
from jobs.models import Batch as BatchRow
from jobs.models import BatchFailure, Client

MAX_NAME = 200
BODY_FIELDS = ("name", "jobs", *CALLBACKS)
CALLBACK_FIELDS = ("task", "payload", "queue", "priority", "max_retries", "timeout")
# Failed ids a batch's progress lists (its callbacks get them all).
FAILED_SHOWN = 100


class BatchConflict(Exception):
    """An idempotency key reused with another request; `batch_id` is the key's batch."""

    def __init__(self, batch_id: int) -> None:
        super().__init__(f"idempotency key already used for batch {batch_id}")
        self.batch_id = batch_id


def _err(errors: dict, where: str, message: str, code: str = "invalid") -> None:
    errors.setdefault(where, []).append({"message": message, "code": code})


def check_callback(raw: Any, where: str, errors: dict, *, for_client: bool) -> dict | None:
    """A callback as the API takes it → the job it makes (its payload an object, which
    the batch's summary joins), or None with the refusals in `errors`."""
    if isinstance(raw, dict) and "payload" not in raw:
        raw = {**raw, "payload": {}}
    item, refusals = submission._request_item(raw, CALLBACK_FIELDS, for_client=for_client)
    for exc in refusals:
        _err(errors, f"{where}.{exc.field}" if exc.field else where, exc.message, exc.code)
    if refusals:
        return None
    if not isinstance(item["payload"], dict):
        _err(errors, f"{where}.payload", "a callback's payload must be a JSON object")
        return None
    return {
        "task": item["task"], "payload": item["payload"], "queue": item["queue"],
        "priority": item["priority"], "max_retries": item["max_retries"],
        "timeout": item["timeout"], "kwargs": False,
    }  # fmt: skip


def task_callback(target: Any, payload: Any = None, **options: Any) -> dict:
    """A callback from Django code: a Django task object (it gets `batch=` as a keyword
    argument) or a registered task name with its payload (an object)."""
    job = tasks.job_of(target, payload)
    is_task = callable(getattr(target, "get_backend", None))
    raw = {k: v for k, v in {**job, **options}.items() if v is not None}
    errors: dict = {}
    spec = check_callback(raw, "callback", errors, for_client=False)
    if spec is None:
        raise RequestInvalid(errors)
    spec["kwargs"] = is_task
    return spec


def _hash(doc: Any) -> str:
    return hashlib.sha256(
        json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()
    ).hexdigest()


def _replay(client_id: int | None, key: str | None, digest: str) -> int | None:
    if key is None:
        return None
    found = BatchRow.objects.filter(client_id=client_id, idempotency_key=key).first()
    if found is None:
        return None
    if found.request_hash != digest:
        raise BatchConflict(found.pk)
    return found.pk


def create(
    jobs: Sequence[Any],
    callbacks: dict[str, dict],
    *,
    name: str = "",
    client: Client | None = None,
    idempotency_key: str | None = None,
    request_hash: str | None = None,
) -> tuple[int, bool]:
    """Write a batch: its row, then its jobs MAX_BATCH at a time through
    jobs.submission.submit_many (each held to a submission's rules and backpressure),
    all in the caller's transaction. Returns (batch id, created)."""
    client_id = client.pk if client is not None else None
    keyed = [n for n, j in enumerate(jobs) if isinstance(j, dict) and "idempotency_key" in j]
    if keyed:  # a replayed job would belong to no batch, and the count would never end
        raise BatchInvalid(
            {f"jobs.{n}.idempotency_key": [{"message": "a batch's jobs take no idempotency "
             "key: give the batch one", "code": "unknown_field"}] for n in keyed},
            len(keyed), len(jobs),
        )  # fmt: skip
    flowed = {  # D360: a joined or separately written job escapes the batch's count
        (n, name): None
        for n, j in enumerate(jobs) if isinstance(j, dict)
        for name in rules.FIELDS if j.get(name) is not None
    }  # fmt: skip
    if flowed:
        raise BatchInvalid(
            {f"jobs.{n}.{name}": [{"message": "a batch with callbacks counts its own jobs: "
             "flow fields are for POST /api/v1/jobs/ and /api/v1/jobs/batch/ (D360)",
             "code": "unknown_field"}] for n, name in flowed},
            len({n for n, _ in flowed}), len(jobs),
        )  # fmt: skip
    digest = request_hash or _hash({"name": name, "jobs": list(jobs), "cb": callbacks})
    with transaction.atomic():
        replayed = _replay(client_id, idempotency_key, digest)
        if replayed is not None:
            return replayed, False
        row = BatchRow.objects.create(
            client_id=client_id, name=name, total=len(jobs), pending=len(jobs),
            callbacks=callbacks, idempotency_key=idempotency_key,
            request_hash=digest if idempotency_key is not None else None,
        )  # fmt: skip
        step = submission.MAX_BATCH
        for start in range(0, len(jobs), step):
            try:
                submission.submit_many(jobs[start : start + step], client=client, batch_id=row.pk)
            except BatchInvalid as exc:  # keyed by place in the chunk: say the batch's
                raise BatchInvalid(_shifted(exc.errors, start), exc.refused, len(jobs)) from None
    return row.pk, True


def _shifted(errors: dict, start: int) -> dict:
    if not start:
        return errors
    out = {}
    for where, found in errors.items():
        parts = where.split(".")
        if len(parts) > 1 and parts[0] == "jobs" and parts[1].isdigit():
            parts[1] = str(int(parts[1]) + start)
        out[".".join(parts)] = found
    return out


def check_request(body: Any, *, for_client: bool) -> tuple[str, list, dict[str, dict]]:
    """POST /api/v1/batches/: `{"name"?, "jobs", "on_complete"?, "on_success"?,
    "on_failure"?}`. Each job is held to a batch item's rules when written; here the
    shape, the callbacks and the size. Raises RequestInvalid naming each broken rule."""
    if not isinstance(body, dict):
        raise InvalidSubmission("the request must be a JSON object", code="invalid")
    errors: dict[str, list[dict[str, str]]] = {}
    for unknown in sorted(set(body) - set(BODY_FIELDS), key=str):
        _err(errors, submission._shown_name(unknown),
             f"Unknown field; allowed: {', '.join(BODY_FIELDS)}.", "unknown_field")  # fmt: skip
    name = body.get("name", "")
    if not isinstance(name, str) or len(name) > MAX_NAME or validation.why_unstorable(name):
        _err(errors, "name", f"name must be text of at most {MAX_NAME} characters")
    jobs = body.get("jobs")
    if not isinstance(jobs, list) or not 1 <= len(jobs) <= submission.MAX_BATCH:
        _err(errors, "jobs", f"jobs must be a list of 1 to {submission.MAX_BATCH} jobs",
             "invalid_batch")  # fmt: skip
        jobs = []
    callbacks = {}
    for kind in CALLBACKS:
        if body.get(kind) is not None:
            spec = check_callback(body[kind], kind, errors, for_client=for_client)
            if spec is not None:
                callbacks[kind] = spec
    if errors:
        raise RequestInvalid(errors)
    return name, jobs, callbacks


def submit_request(
    body: Any, *, client: Client | None = None, idempotency_key: str | None = None
) -> tuple[int, bool]:
    name, jobs, callbacks = check_request(body, for_client=client is not None)
    key = idempotency_key
    if key is not None and (
        not isinstance(key, str) or not validation.IDEMPOTENCY_KEY_RE.fullmatch(key)
    ):
        raise InvalidSubmission(
            "idempotency key must be 1-200 printable ASCII characters without spaces",
            field="idempotency_key",
            code="invalid_idempotency_key",
        )
    return create(
        jobs, callbacks, name=name, client=client, idempotency_key=key, request_hash=_hash(body)
    )


@dataclass
class Batch:
    """Build a batch in Django code, with the API's rules and no size cap:

        batch = Batch("thumbnails", on_complete=task_callback(send_email))
        for image in images:
            batch.add("thumbnail", {"image": image})  # or a Django task, args=, kwargs=
        batch_id = batch.submit()

    `submit()` writes inside the caller's transaction, like jobs.submission.submit().
    """

    name: str = ""
    on_complete: dict | None = None
    on_success: dict | None = None
    on_failure: dict | None = None
    jobs: list[dict[str, Any]] = field(default_factory=list)

    def add(
        self,
        task: Any,
        payload: Any = None,
        *,
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> Batch:
        job = tasks.job_of(task, payload, args, kwargs)
        self.jobs.append({k: v for k, v in {**job, **options}.items() if v is not None})
        return self

    def submit(self, *, client: Client | None = None, idempotency_key: str | None = None) -> int:
        if not self.jobs:
            raise InvalidSubmission("a batch needs at least one job", field="jobs")
        callbacks = {
            kind: spec
            for kind in CALLBACKS
            if (spec := getattr(self, kind)) is not None
        }  # fmt: skip
        return create(
            self.jobs, callbacks, name=self.name, client=client, idempotency_key=idempotency_key
        )[0]


def open_count() -> int:
    """Batches whose jobs have not all ended (`queue list`)."""
    return BatchRow.objects.filter(finished_at__isnull=True).count()


def progress(batch_id: int, client: Client | None = None, *, staff: bool = False) -> dict | None:
    """A batch's progress, or None (not found, or another client's)."""
    rows = BatchRow.objects.filter(pk=batch_id)
    if not staff:
        rows = rows.filter(client_id=client.pk if client is not None else None)
    row = rows.first()
    if row is None:
        return None
    ended = row.succeeded + row.failed
    failed_ids = list(
        BatchFailure.objects.filter(batch_id=row.pk)
        .order_by("job_id")
        .values_list("job_id", flat=True)[:FAILED_SHOWN]
    )
    return {
        "id": row.pk,
        "name": row.name,
        "total": row.total,
        "pending": row.pending,
        "succeeded": row.succeeded,
        "failed": row.failed,
        "fraction": ended / row.total if row.total else 1.0,
        "failed_ids": failed_ids,
        "callbacks": {kind: spec["task"] for kind, spec in row.callbacks.items()},
        "callback_jobs": list(row.callback_job_ids or []),
        "created_at": row.created_at,
        "finished_at": row.finished_at,
    }


__all__ = ["Batch", "BatchConflict", "create", "progress", "submit_request", "task_callback"]
