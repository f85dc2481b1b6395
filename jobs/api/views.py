"""The job API (SPEC §8, §9): submit, read, list, cancel, history — each client
sees and touches only its own jobs; another client's job is a 404, never a 403.

A submission's answer is written here by hand (`submitted_answer`, D150, D399), beside
the view that returns it and the row and Location it answers with."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, tzinfo
from typing import Any

from django.conf import settings as django_settings
from django.db import connection, transaction
from django.urls import get_script_prefix, get_urlconf, reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse
from rest_framework import exceptions, generics, status, viewsets
from rest_framework.pagination import Cursor, CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import ISO_8601, api_settings

from jobs import lending, replica, selectors, services, submission, waiting
from jobs.api.errors import Conflict, InvalidCursor, exception_handler
from jobs.api.filters import JobFilter
from jobs.api.parsers import BatchJSONParser, BoundedJSONParser
from jobs.api.policy import APIPolicy
from jobs.api.schema import extend_schema
from jobs.api.serializers import (
    BatchResultSerializer,
    BatchSubmitSerializer,
    ErrorSerializer,
    JobDetailSerializer,
    JobEventSerializer,
    JobSerializer,
    JobSubmitSerializer,
    SubmittedJobSerializer,
)
from jobs.conf import settings
from jobs.lifecycle import TERMINAL, Status
from jobs.models import Job, JobEvent


class StrictCursorPagination(CursorPagination):
    """DRF's cursor pagination, refusing (400) a cursor it did not issue: DRF answers
    404 to some and passes others' position to the database (a 500)."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500

    def decode_cursor(self, request: Request) -> Cursor | None:
        try:
            cursor = super().decode_cursor(request)
        except exceptions.NotFound:
            raise InvalidCursor() from None
        if cursor is None:
            return None
        if cursor == Cursor(offset=0, reverse=False, position=None):
            raise InvalidCursor()  # decodes to nothing: never issued
        if cursor.position is not None and not self._valid_position(cursor.position):
            raise InvalidCursor()
        return cursor

    def _valid_position(self, position: str) -> bool:
        raise NotImplementedError


class IdCursorPagination(StrictCursorPagination):
    """Pages ordered by the rows' bigint id (`ordering` says which way)."""

    def _valid_position(self, position: str) -> bool:
        return position.isascii() and position.isdigit() and int(position) < 2**63


# What a route may answer besides success; a module's `_errors` adds or overrides.
ERRORS = {
    400: "Invalid request (see `code` and `errors`).",
    401: "Missing, invalid or inactive token.",
    409: "Conflict (see `code`).",
    413: "Request body too large.",
    415: "Content-Type is not application/json.",
}


def error_responses(described: dict[int, str]) -> Callable[..., dict[int, OpenApiResponse]]:
    """A module's `_errors(*codes)`: each code's ErrorSerializer answer, described by
    `described` or else by ERRORS."""
    table = {**ERRORS, **described}

    def errors(*codes: int) -> dict[int, OpenApiResponse]:
        return {c: OpenApiResponse(ErrorSerializer, description=table[c]) for c in codes}

    return errors


class JobCursorPagination(StrictCursorPagination):
    """Newest first. Cursor pages stay stable while new jobs arrive."""

    ordering = ("-created_at", "-id")

    def _valid_position(self, position: str) -> bool:
        try:
            parsed = parse_datetime(position)
            return parsed is not None and parsed.astimezone(UTC) is not None
        except (ValueError, OverflowError):
            return False


_errors = error_responses({
    404: "No such job for this client.",
    413: "Payload or request body too large.",
    429: "Throttled, or the queue is full (backpressure); see Retry-After.",
})  # fmt: skip


def _submission_responses(serializer: Any, created: str, replayed: str) -> dict:
    """A submission's answers: 201 when it created, 200 when it replayed, and its refusals."""
    return {
        201: OpenApiResponse(serializer, description=created),
        200: OpenApiResponse(serializer, description=replayed),
        **_errors(400, 401, 409, 413, 415, 429),
    }


IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=False,
    description="Per client. The same key with the same body returns the existing job "
    "(200); with another body, 409. 1-200 printable ASCII characters, no spaces.",
)


def _inside_callers_transaction() -> bool:
    """An atomic() block is open around the view (not a test case's): its on_commit push
    would wait for that block, after the answer that says where the job is."""
    blocks = connection.atomic_blocks
    return bool(blocks) and not getattr(blocks[-1], "_from_testcase", False)


# A job's URL around its id, per URLconf and script prefix: reverse() walks the
# resolver for every submission (17 µs, 1.5 % of its CPU).
_LOCATIONS: dict[tuple[str, str], tuple[str, str]] = {}
_SOME_ID = 918_273_645_546_372


MAX_WAIT_SECONDS = 60.0


class _WaitSlots:
    """The waits this process holds at once (JOBS_API_WAIT_SLOTS), read per use so a
    test's setting applies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0

    def acquire(self) -> bool:
        with self._lock:
            if self.held >= int(settings.JOBS_API_WAIT_SLOTS):
                return False
            self.held += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.held -= 1


wait_slots = _WaitSlots()


def wait_seconds(raw: str | None) -> float:
    """`?wait=` as seconds, or a 400 naming the allowed range."""
    if raw is None or raw == "":
        return 0.0
    limit = min(float(settings.JOBS_API_MAX_WAIT_SECONDS), MAX_WAIT_SECONDS)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 <= seconds <= limit:
        raise exceptions.ValidationError(
            {"wait": [f"wait must be a number of seconds from 0 to {limit:g}"]}
        )
    return seconds


def as_stored(job: Job) -> Job:
    """A new job as its row now reads: one that is not queued had its push fail and was
    parked (enqueue_failed) after the object was made, so it is read again. A job its
    key_strategy skipped was read after it ended (jobs.flow.strategies)."""
    return job if job.status == Status.QUEUED or job.skipped else Job.objects.get(pk=job.pk)


def job_location(pk: int) -> str:
    """reverse("job-detail", args=[pk]), from the URL reverse() gave for another id."""
    key = (get_urlconf() or django_settings.ROOT_URLCONF, get_script_prefix())
    around = _LOCATIONS.get(key)
    if around is None:
        head, _, tail = reverse("job-detail", args=[_SOME_ID]).rpartition(str(_SOME_ID))
        if len(_LOCATIONS) >= 64:  # prefixes come from deployments, not requests
            _LOCATIONS.clear()
        around = _LOCATIONS[key] = (head, tail)
    return f"{around[0]}{int(pk)}{around[1]}"


def _when(value: datetime | None, tz: tzinfo) -> str | None:
    """DRF's DateTimeField for an aware datetime in ISO 8601: the current time zone, 'Z'
    for UTC."""
    if value is None:
        return None
    text = value.astimezone(tz).isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def _plain_settings() -> bool:
    return api_settings.DATETIME_FORMAT == ISO_8601 and not getattr(
        api_settings, "COERCE_BIG_INT_TO_STRING", False
    )


def submitted_answer(job: Job) -> dict[str, Any]:
    """The answer to `POST /api/v1/jobs/`: SubmittedJobSerializer(job).data as a plain
    dict, written by hand, field for field and in its order, without DRF's per-field
    dispatch (4-5 % of a submission's CPU, issue 31, D150). The serializer stays the
    schema and the answer of every other route; tests/api/test_answers.py compares the
    two for many generated jobs. A project whose DRF settings change how dates or big
    integers are written gets the serializer's answer."""
    dates = (job.run_at, job.created_at, job.updated_at, job.finished_at)
    stamps = (job.cancel_requested_at, job.fire_time)
    if not _plain_settings() or any(d is not None and d.tzinfo is None for d in dates + stamps):
        return dict(SubmittedJobSerializer(job).data)
    tz = timezone.get_current_timezone()
    timeout = job.timeout
    if job.queue_paused is None or job.progress is not None:  # a row read from the table
        progress, wait_reason = selectors.progress_and_wait(job)
    else:  # the row its INSERT returned, with its queue's state: nothing more to read
        progress = None
        wait_reason = job.wait_reason or (  # as selectors.wait_reason
            selectors.QUEUE_PAUSED if job.status == Status.QUEUED and job.queue_paused else None
        )
    return {
        "id": job.id,
        "task": job.task,
        "queue": job.queue,
        "priority": job.priority,
        "status": job.status,
        "payload": job.payload,
        "result": job.result,
        "error": job.error,
        "retry_count": job.retry_count,
        "max_retries": job.max_retries,
        "timeout": None if timeout is None else float(timeout),
        "lease_version": job.lease_version,
        "idempotency_key": job.idempotency_key,
        "run_at": _when(job.run_at, tz),
        "created_at": _when(job.created_at, tz),
        "updated_at": _when(job.updated_at, tz),
        "finished_at": _when(job.finished_at, tz),
        "progress": progress,
        "cancel_requested_at": _when(job.cancel_requested_at, tz),
        "cancel_too_late": job.status == Status.DONE and job.cancel_requested_at is not None,
        "unique_key": job.unique_key,
        "concurrency_key": job.concurrency_key,
        "sequence_key": job.sequence_key,
        "batch": job.batch_id,
        "schedule": job.schedule_id,
        "fire_time": _when(job.fire_time, tz),
        "wait_reason": wait_reason,
        "chain_id": job.chain_id,
        "run_number": job.run_number or 1,
        "previous_run_ids": job.previous_run_ids,
        "next_run_id": job.next_run_id,
        "duplicate": job.duplicate,
        "debounced": job.debounced,
        "skipped": job.skipped,
    }


class JobViewSet(APIPolicy, viewsets.GenericViewSet):
    serializer_class = JobSerializer
    parser_classes = [BoundedJSONParser]
    filterset_class = JobFilter
    filter_backends = [DjangoFilterBackend]
    pagination_class = JobCursorPagination

    def get_exception_handler(self) -> Any:
        return exception_handler

    def get_queryset(self) -> Any:
        if getattr(self, "swagger_fake_view", False):  # schema generation
            return Job.objects.none()
        return Job.objects.filter(client=self.request.user)

    def _actor(self) -> str:
        return f"client:{self.request.user.name}"

    @extend_schema(
        summary="Submit a job",
        request=JobSubmitSerializer,
        parameters=[IDEMPOTENCY_KEY],
        responses=_submission_responses(
            SubmittedJobSerializer,
            "Created.",
            "Idempotent replay: the job this key created; or, with `duplicate: true`, the "
            "live job holding this `unique_key`.",
        ),
        examples=[
            OpenApiExample(
                "echo", value={"task": "echo", "payload": {"hello": "world"}}, request_only=True
            ),
        ],
    )
    def create(self, request: Request) -> Response:
        if _inside_callers_transaction():
            raise RuntimeError(
                "a job submission through the API is its own durable transaction: "
                "it may not run inside atomic()"
            )
        # META, not request.headers: that mapping is built from every key of the
        # environ, which granian fills with the whole process environment (D151).
        key = request.META.get("HTTP_IDEMPOTENCY_KEY")
        # One INSERT is the only write, so it runs in autocommit: it is its own
        # transaction (D72), without a BEGIN and a COMMIT round trip. The Redis push
        # (on_commit) runs as soon as it returns; a failed push has parked the row by
        # then and marked the job object; only then is the row read again.
        job, created = submission.submit_request(
            request.data, idempotency_key=key, client=request.user
        )
        if not created:
            return Response(submitted_answer(job), status=status.HTTP_200_OK)
        job = as_stored(job)
        return Response(
            submitted_answer(job),
            status=status.HTTP_201_CREATED,
            headers={"Location": job_location(job.pk)},
        )

    def get_parsers(self) -> list[Any]:
        # DRF asks before it sets self.action: the route's action map says which it is.
        if getattr(self, "action_map", {}).get("post") == "create_batch":
            return [BatchJSONParser()]
        return super().get_parsers()

    @extend_schema(
        summary="Submit up to 1000 jobs at once",
        description="All or nothing: if any job is refused, the answer is 400 with an error "
        "per refused job (`jobs.<index>.<field>`) and nothing is written. Each job may carry "
        "its own `idempotency_key`: a replay returns the existing job with `created: false`; "
        "a key reused with a different request is a 409 for the whole batch. Backpressure "
        "counts the jobs the batch would create (replays do not count). One Redis push "
        "signals every due job after the commit. A job may carry flow fields "
        "(`debounce_key`, `key_strategy`, `rate_limit`): it is submitted as a single one "
        "would be, in the batch's order and transaction, and answered with `debounced` / "
        "`skipped`; a `rate_limit` refusal is a 429 for the whole batch.",
        request=BatchSubmitSerializer,
        responses=_submission_responses(
            BatchResultSerializer,
            created="At least one job created.",
            replayed="Every job was an idempotent replay.",
        ),
        examples=[
            OpenApiExample(
                "two echoes",
                value={
                    "jobs": [
                        {"task": "echo", "payload": {"n": 1}, "idempotency_key": "order-1"},
                        {"task": "echo", "payload": {"n": 2}, "priority": 5},
                    ]
                },
                request_only=True,
            ),
        ],
    )
    def create_batch(self, request: Request) -> Response:
        data = request.data
        with transaction.atomic(durable=True):
            out = submission.submit_batch_request(data, client=request.user)
        # As for a single job: a failed push after commit has parked rows by now.
        current = dict(
            Job.objects.filter(pk__in=[o.job_id for o in out if o.created]).values_list(
                "pk", "status"
            )
        )
        keys = [j.get("idempotency_key") for j in data["jobs"]]
        body = {
            "jobs": [
                {
                    "id": o.job_id,
                    "created": o.created,
                    "status": current.get(o.job_id, o.status),
                    "task": o.task,
                    "queue": o.queue,
                    "idempotency_key": key,
                    "run_at": o.run_at,
                    "created_at": o.created_at,
                    "debounced": getattr(o, "debounced", False),  # jobs.flow (D360)
                    "skipped": getattr(o, "skipped", False),
                }
                for o, key in zip(out, keys, strict=True)
            ]
        }
        created = any(o.created for o in out)
        return Response(body, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(
        summary="A job",
        description=(
            "With `wait=SECONDS` (0 to JOBS_API_MAX_WAIT_SECONDS, at most 60) the answer "
            "waits until the job is done or failed, or until the seconds have passed, and "
            "then gives the job as it is. The `Jobs-Wait` header says how the wait ended: "
            "`ended` (the job is terminal), `timeout` (it is not), or `busy` (this server "
            "held as many waits as it may: the job as it is now, at once; ask again)."
        ),
        parameters=[
            OpenApiParameter(
                "wait",
                OpenApiTypes.NUMBER,
                description="Seconds to wait for the job to end (0 to the server's maximum).",
            )
        ],
        responses={200: JobDetailSerializer, **_errors(400, 401, 404)},
    )
    def retrieve(self, request: Request, pk: int) -> Response:
        wait = wait_seconds(request.query_params.get("wait"))
        job = self.get_object()
        if not wait or job.status in TERMINAL:
            response = Response(JobDetailSerializer(job).data)
            if wait:
                response["Jobs-Wait"] = "ended"
            return response
        if not wait_slots.acquire():
            response = Response(JobDetailSerializer(job).data)
            response["Jobs-Wait"] = "busy"
            return response
        try:
            with lending.released():  # no connection held for the wait's length (D238)
                ended = waiting.waiter().wait(job.pk, wait)
            job = self.get_object()
        finally:
            wait_slots.release()
        response = Response(JobDetailSerializer(job).data)
        response["Jobs-Wait"] = "ended" if ended or job.status in TERMINAL else "timeout"
        return response

    @extend_schema(
        summary="The client's jobs, newest first",
        responses={200: JobSerializer(many=True), **_errors(400, 401)},
    )
    def list(self, request: Request) -> Response:
        with replica.reads(request.user.pk):  # a listing may lag; a job by id does not
            qs = self.filter_queryset(self.get_queryset())
            page = self.paginate_queryset(qs)
            return self.get_paginated_response(JobSerializer(page, many=True).data)

    @extend_schema(
        summary="Cancel a job",
        description="queued or enqueue_failed → failed with error `cancelled` (200). "
        "processing → the cancel is requested (202): the worker tells the handler at its "
        "next heartbeat (within a third of the lease); a handler that stops ends `failed` "
        "with error `cancelled`, one that finishes anyway ends `done` with "
        "`cancel_too_late` true. A retry or a lost lease never runs it again. "
        "done or failed → 409 with the current `status`.",
        request=None,
        responses={
            200: OpenApiResponse(JobSerializer, description="Cancelled: the job is failed."),
            202: OpenApiResponse(
                JobSerializer,
                description="Running: the cancel is requested (`cancel_requested_at`).",
            ),
            **_errors(401, 404, 409),
        },
    )
    def cancel(self, request: Request, pk: int) -> Response:
        job = self.get_object()
        outcome = services.request_cancel(
            [job.pk], actor=self._actor(), client_id=request.user.pk
        ).get(job.pk)
        job = self.get_object()
        if outcome == "cancelled":
            return Response(JobSerializer(job).data)
        if outcome == "requested":
            return Response(JobSerializer(job).data, status=status.HTTP_202_ACCEPTED)
        raise Conflict(
            f"job {job.pk} is {job.status}; a finished job cannot be cancelled",
            code="not_cancellable",
            extra={"status": job.status},
        )


class HistoryCursorPagination(IdCursorPagination):
    """Oldest first, in the order the history rows were written."""

    ordering = ("id",)


class JobHistoryView(APIPolicy, generics.ListAPIView):
    """A job's history, a cursor page at a time. The job list's filters do not apply
    here: any query parameter but `cursor` and `page_size` is refused (400)."""

    serializer_class = JobEventSerializer
    pagination_class = HistoryCursorPagination
    filter_backends: list[Any] = []
    allowed_params = frozenset({"cursor", "page_size"})

    def get_exception_handler(self) -> Any:
        return exception_handler

    def get_queryset(self) -> Any:
        if getattr(self, "swagger_fake_view", False):  # schema generation
            return JobEvent.objects.none()
        if not Job.objects.filter(pk=self.kwargs["pk"], client=self.request.user).exists():
            raise exceptions.NotFound()
        return JobEvent.objects.filter(job_id=self.kwargs["pk"])

    @extend_schema(
        summary="A job's history, oldest first",
        description="Every status change (which role, when, which lease, retry count, error) "
        "and every stale write the fence refused, oldest first, in cursor pages. Only "
        "`cursor` and `page_size` are accepted; any other query parameter is a 400.",
        responses={200: JobEventSerializer(many=True), **_errors(400, 401, 404)},
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        unknown = sorted(set(request.query_params) - self.allowed_params)
        if unknown:
            raise exceptions.ValidationError(
                {
                    name[:100]: [
                        exceptions.ErrorDetail(
                            "Unknown query parameter; history takes only cursor and page_size.",
                            code="unknown_parameter",
                        )
                    ]
                    for name in unknown
                }
            )
        with replica.reads(request.user.pk):
            return super().get(request, *args, **kwargs)
