"""The rules one submitted job must pass, whichever way it comes (Python, the API, a
batch, a workflow's step, a schedule): a task that exists (and is public, for a client),
a declared queue, bounded numbers, keys of printable ASCII, a run_at in range and a
payload PostgreSQL can store. Each refusal is a SubmissionError naming the field, raised
before anything is written; `request_hash` is what an idempotent replay must match.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from typing import Any

from django.utils.dateparse import parse_datetime

from jobs import queues, tasks
from jobs.conf import settings
from jobs.exceptions import InvalidSubmission, PayloadTooLarge, UnknownQueue, UnknownTask
from jobs.flow import rules as flow_rules
from jobs.models import PRIORITY_MAX, PRIORITY_MIN

MAX_RETRIES_LIMIT = 100
MAX_PAYLOAD_DEPTH = 100
IDEMPOTENCY_KEY_RE = re.compile(r"[\x21-\x7e]{1,200}")  # printable ASCII, no spaces; fullmatch
TASK_NAME_MAX = 200


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSubmission(f"{name} must be an integer", field=name, code="invalid_" + name)
    if not lo <= value <= hi:
        raise InvalidSubmission(
            f"{name} must be between {lo} and {hi}", field=name, code="invalid_" + name
        )
    return value


def why_unstorable(value: str) -> str | None:
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
            why = why_unstorable(value)
            if why:
                raise InvalidSubmission(
                    f"payload strings may not contain {why}",
                    field="payload",
                    code="invalid_payload",
                )
        elif isinstance(value, dict):
            for k, v in value.items():
                why = why_unstorable(k) if isinstance(k, str) else None
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


def validate(
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
    run_at_text: bool = False,
) -> tuple[datetime | None, int, str | None, str, float | None]:
    """Every rule one submission must pass; returns (run_at in UTC, max_retries,
    request hash or None, the payload as compact JSON, the timeout in seconds or None).

    Raises a SubmissionError naming the field. Shared by submit and submit_many (and
    so by both API endpoints): a job in a batch is held to exactly the rules of a
    single one. `for_client`: the job belongs to an API client, which may run public
    tasks in open queues only (an internal task or queue is refused exactly like a name
    that does not exist). `run_at_text`: run_at may be ISO 8601 text (a JSON request).
    """
    spec = None
    if isinstance(task, str) and len(task) <= TASK_NAME_MAX:
        spec = tasks.submittable(task, for_client=for_client)
    if spec is None:
        shown = repr(task) if len(repr(task)) <= 210 else repr(task)[:200] + "…"
        raise UnknownTask(
            f"unknown task {shown}; known: {', '.join(tasks.public_names())}", field="task"
        )
    refused = queues.refusal(queue, for_client=for_client)
    if refused == "invalid":
        raise InvalidSubmission(
            "queue must be 1-100 characters of letters, digits, '_', '.', ':' or '-'",
            field="queue",
            code="invalid_queue",
        )
    # An internal queue (the service's own, or marked so) answers a client as a name that
    # does not exist, and no client's answer lists it (D197).
    if refused is not None:
        shown = queues.open_names() if for_client else queues.declared()
        raise UnknownQueue(
            f"unknown queue {queue!r}; declared (JOBS_QUEUES): {', '.join(shown)}",
            field="queue",
        )
    priority = _check_int("priority", priority, PRIORITY_MIN, PRIORITY_MAX)
    if max_retries is None:
        max_retries = settings.JOBS_MAX_RETRIES
    max_retries = _check_int("max_retries", max_retries, 0, MAX_RETRIES_LIMIT)
    run_at = parse_run_at(run_at, text=run_at_text)
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
        if spec.validate is not None:
            spec.validate(payload)
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


def check_item(
    item: dict[str, Any], *, for_client: bool = False, run_at_text: bool = False
) -> None:
    """Every rule of one submission, asked in one place: `validate` on the job's fields,
    then the rules of its flow fields (jobs.flow.rules; absent ones become None). Fills
    in `item` its run_at in UTC, max_retries, request_hash, payload_json and timeout,
    and `flow_control`: whether it takes the flow path (jobs.flow.rules.wanted)."""
    (
        item["run_at"],
        item["max_retries"],
        item["request_hash"],
        item["payload_json"],
        item["timeout"],
    ) = validate(
        item["task"],
        item["payload"],
        item["queue"],
        item["priority"],
        item["run_at"],
        item["max_retries"],
        item["idempotency_key"],
        item.get("unique_key"),
        item.get("concurrency_key"),
        item.get("timeout"),
        item.get("sequence_key"),
        for_client=for_client,
        run_at_text=run_at_text,
    )
    if any(item.get(name) is not None for name in flow_rules.FIELDS):
        flow_rules.check(item)
        item["flow_control"] = flow_rules.wanted(item)
    else:  # a plain submission: no flow field to check, nothing of jobs.flow to ask
        item.update(dict.fromkeys(flow_rules.FIELDS), flow_control=False)


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
