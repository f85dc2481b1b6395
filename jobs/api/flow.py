"""Batches and sequences over the API (issue 46.4-5): each client sees and touches only its
own; another client's batch or key is a 404, never a 403. A sequence key is sent in the
query or body, not the path: a key may hold any printable character."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse
from rest_framework import exceptions, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import submission, validation
from jobs.api.errors import Conflict, exception_handler
from jobs.api.parsers import BatchJSONParser, BoundedJSONParser
from jobs.api.policy import APIPolicy
from jobs.api.schema import extend_schema
from jobs.api.views import error_responses
from jobs.flow import batches, sequences
from jobs.lifecycle import STATUSES

_errors = error_responses({
    404: "No such batch or sequence for this client.",
    429: "A queue would pass JOBS_MAX_QUEUE_DEPTH (backpressure); see Retry-After.",
})  # fmt: skip

IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=False,
    description="Per client. The same key with the same body returns the existing batch "
    "(200); with another body, 409. 1-200 printable ASCII characters, no spaces.",
)


class CallbackSerializer(serializers.Serializer):
    task = serializers.CharField(help_text="A task this client may submit.")
    payload = serializers.JSONField(
        required=False,
        help_text='A JSON object (default {}); the batch summary joins it as "batch".',
    )
    queue = serializers.CharField(required=False)
    priority = serializers.IntegerField(required=False)
    max_retries = serializers.IntegerField(required=False, allow_null=True)
    timeout = serializers.FloatField(required=False, allow_null=True)


class BatchInSerializer(serializers.Serializer):
    name = serializers.CharField(required=False, allow_blank=True, max_length=batches.MAX_NAME)
    jobs = serializers.ListField(
        child=serializers.JSONField(),
        help_text=f"1 to {submission.MAX_BATCH} jobs, each as for POST /jobs/ (no "
        "idempotency key: give the batch one). Larger batches: jobs.flow.batches.Batch.",
    )
    on_complete = CallbackSerializer(required=False, help_text="Runs once every job ended.")
    on_success = CallbackSerializer(required=False, help_text="Runs once every job is done.")
    on_failure = CallbackSerializer(
        required=False, help_text="Runs once every job ended and at least one failed."
    )


class BatchSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField(allow_blank=True)
    total = serializers.IntegerField()
    pending = serializers.IntegerField(help_text="Jobs that have not ended.")
    succeeded = serializers.IntegerField()
    failed = serializers.IntegerField()
    fraction = serializers.FloatField(help_text="Jobs ended / total.")
    failed_ids = serializers.ListField(
        child=serializers.IntegerField(),
        help_text=f"The first {batches.FAILED_SHOWN} failed job ids (the callbacks get all).",
    )
    callbacks = serializers.DictField(child=serializers.CharField(), help_text="kind → task.")
    callback_jobs = serializers.ListField(
        child=serializers.IntegerField(), help_text="The callback jobs made, once finished."
    )
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)


class _View(APIPolicy, APIView):
    parser_classes = [BoundedJSONParser]

    def get_exception_handler(self) -> Any:
        return exception_handler

    def _actor(self) -> str:
        return f"client:{self.request.user.name}"


class BatchCreateView(_View):
    parser_classes = [BatchJSONParser]

    @extend_schema(
        summary="Submit a batch of jobs with callbacks",
        description="Every job is created in one transaction, or none is (each held to the "
        "rules of POST /jobs/; 400 `invalid_batch` keyed `jobs.<index>.<field>`). Once the "
        "last job ended, `on_complete` runs, and `on_success` (no job failed) or "
        "`on_failure` (one did): each exactly once, its payload joined by `batch`: "
        '`{"id", "name", "total", "succeeded", "failed", "failed_ids"}`.',
        request=BatchInSerializer,
        parameters=[IDEMPOTENCY_KEY],
        responses={
            201: OpenApiResponse(BatchSerializer, description="Created."),
            200: OpenApiResponse(BatchSerializer, description="Idempotent replay."),
            **_errors(400, 401, 409, 413, 415, 429),
        },
        examples=[
            OpenApiExample(
                "thumbnails",
                value={
                    "name": "thumbnails",
                    "jobs": [{"task": "echo", "payload": {"image": 1}}],
                    "on_complete": {"task": "echo", "payload": {"notify": "ops"}},
                },
                request_only=True,
            )
        ],
    )
    def post(self, request: Request) -> Response:
        try:
            with transaction.atomic(durable=True):
                batch_id, created = batches.submit_request(
                    request.data,
                    client=request.user,
                    idempotency_key=request.headers.get("Idempotency-Key"),
                )
        except batches.BatchConflict as exc:
            raise Conflict(
                str(exc), code="idempotency_conflict", extra={"batch_id": exc.batch_id}
            ) from None
        found = batches.progress(batch_id, request.user)
        if not created:
            return Response(BatchSerializer(found).data)
        return Response(
            BatchSerializer(found).data,
            status=status.HTTP_201_CREATED,
            headers={"Location": reverse("batch-detail", args=[batch_id])},
        )


class BatchDetailView(_View):
    @extend_schema(
        summary="A batch's progress",
        responses={200: BatchSerializer, **_errors(401, 404)},
    )
    def get(self, request: Request, pk: int) -> Response:
        found = batches.progress(pk, request.user)
        if found is None:
            raise exceptions.NotFound()
        return Response(BatchSerializer(found).data)


class SequenceJobSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    task = serializers.CharField()
    status = serializers.ChoiceField(choices=STATUSES)
    error = serializers.CharField(allow_null=True)


class SequenceSerializer(serializers.Serializer):
    key = serializers.CharField()
    state = serializers.ChoiceField(choices=["idle", "running", "halted"])
    active_job = SequenceJobSerializer(allow_null=True, help_text="The job whose turn it is.")
    halted_job = SequenceJobSerializer(allow_null=True, help_text="The failed job that halted it.")
    halted_at = serializers.DateTimeField(allow_null=True)
    waiting = serializers.IntegerField(help_text="Jobs waiting their turn.")
    next_jobs = SequenceJobSerializer(many=True, help_text=f"The next {sequences.PAGE}, in order.")
    updated_at = serializers.DateTimeField()


class SequenceKeySerializer(serializers.Serializer):
    key = serializers.CharField(help_text="The sequence_key.")


def _key(value: Any) -> str:
    if not isinstance(value, str) or not validation.IDEMPOTENCY_KEY_RE.fullmatch(value):
        raise exceptions.ValidationError(
            {"key": ["key must be 1-200 printable ASCII characters without spaces"]}
        )
    return value


def _page(request: Request, key: str) -> Response:
    found = sequences.detail(request.user.pk, key)
    if found is None:
        raise exceptions.NotFound()
    return Response(SequenceSerializer(found.as_dict()).data)


class SequenceDetailView(_View):
    @extend_schema(
        summary="A sequence: its state, the job whose turn it is, what waits",
        parameters=[OpenApiParameter("key", OpenApiTypes.STR, required=True)],
        responses={200: SequenceSerializer, **_errors(400, 401, 404)},
    )
    def get(self, request: Request) -> Response:
        unknown = sorted(set(request.query_params) - {"key"})
        if unknown:
            raise exceptions.ValidationError({n[:100]: ["Unknown parameter."] for n in unknown})
        return _page(request, _key(request.query_params.get("key")))


class _SequenceAction(_View):
    action = ""

    def post(self, request: Request) -> Response:
        body = request.data
        if not isinstance(body, dict) or set(body) - {"key"}:
            raise exceptions.ValidationError({"key": ['The body is {"key": <sequence_key>}.']})
        key = _key(body.get("key"))
        try:
            getattr(sequences, self.action)(request.user.pk, key, self._actor())
        except sequences.SequenceRefused as refused:
            if refused.reason == "not_found":
                raise exceptions.NotFound() from None
            raise Conflict(str(refused), code="sequence_not_halted") from None
        return _page(request, key)


class SequenceResumeView(_SequenceAction):
    action = "resume"

    @extend_schema(
        summary="Resume a halted sequence: its failed job runs again, then the rest in order",
        request=SequenceKeySerializer,
        responses={200: SequenceSerializer, **_errors(400, 401, 404, 409)},
    )
    def post(self, request: Request) -> Response:
        return super().post(request)


class SequenceSkipView(_SequenceAction):
    action = "skip"

    @extend_schema(
        summary="Skip a halted sequence's failed job: it stays failed, the next job runs",
        request=SequenceKeySerializer,
        responses={200: SequenceSerializer, **_errors(400, 401, 404, 409)},
    )
    def post(self, request: Request) -> Response:
        return super().post(request)


__all__ = [
    "BatchCreateView",
    "BatchDetailView",
    "SequenceDetailView",
    "SequenceResumeView",
    "SequenceSkipView",
]
