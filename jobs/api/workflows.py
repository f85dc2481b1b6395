"""Signals to jobs and workflows of jobs (issue 17): each client sees and touches
only its own; another client's job or workflow is a 404, never a 403."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiResponse,
)
from rest_framework import exceptions, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import signals, workflows
from jobs.api.errors import Conflict, exception_handler
from jobs.api.parsers import BatchJSONParser, BoundedJSONParser
from jobs.api.policy import APIPolicy
from jobs.api.schema import extend_schema
from jobs.api.views import error_responses
from jobs.lifecycle import STATUSES, Status, WaitReason
from jobs.models import OnFailure

_errors = error_responses({
    404: "No such job or workflow for this client.",
    429: "A queue would pass JOBS_MAX_QUEUE_DEPTH (backpressure); see Retry-After.",
})  # fmt: skip


IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=False,
    description="Per client. The same key with the same body returns the existing "
    "workflow (200); with another body, 409. 1-200 printable ASCII characters, no spaces.",
)


class SignalSerializer(serializers.Serializer):
    key = serializers.CharField(max_length=signals.MAX_KEY, help_text="What the job waits for.")
    payload = serializers.JSONField(
        required=False, allow_null=True, help_text="Returned by the job's wait_for_signal(key)."
    )


class SignalResultSerializer(serializers.Serializer):
    job_id = serializers.IntegerField()
    key = serializers.CharField()
    woke = serializers.BooleanField(
        help_text="True: the job was parked waiting for this key and is due now. False: "
        "the signal is kept until the job waits for it."
    )


class _View(APIPolicy, APIView):
    parser_classes = [BoundedJSONParser]

    def get_exception_handler(self) -> Any:
        return exception_handler

    def _actor(self) -> str:
        return f"client:{self.request.user.name}"


class JobSignalView(_View):
    @extend_schema(
        summary="Send a signal to a job",
        description="Stores the signal durably. A job parked in `wait_for_signal(key)` is "
        "due at once (`woke` true); to a job that has not reached a signal wait yet "
        "(running, not started, sleeping) the signal is kept and the wait returns it. 409 "
        "when the job is parked waiting for another key (`not_waiting_for_key`), has "
        "finished (`job_finished`), or already has a signal with this key "
        "(`duplicate_signal`: one per key per job).",
        request=SignalSerializer,
        responses={202: SignalResultSerializer, **_errors(400, 401, 404, 409, 413, 415)},
        examples=[
            OpenApiExample(
                "approval", value={"key": "approval", "payload": {"by": "ana"}}, request_only=True
            )
        ],
    )
    def post(self, request: Request, pk: int) -> Response:
        body = request.data
        if not isinstance(body, dict):
            raise exceptions.ValidationError({"key": ["This field is required."]})
        unknown = sorted(set(body) - {"key", "payload"}, key=str)
        if unknown:
            raise exceptions.ValidationError(
                {str(name)[:100]: ["Unknown field; allowed: key, payload."] for name in unknown}
            )
        if "key" not in body:
            raise exceptions.ValidationError({"key": ["This field is required."]})
        key = signals.check_key(body["key"])  # as sent: not trimmed, not made text
        try:
            woke = signals.signal_job(
                pk, key, body.get("payload"), actor=self._actor(), client_id=request.user.pk
            )
        except signals.SignalRefused as refused:
            if refused.reason == "not_found":
                raise exceptions.NotFound() from None
            codes = {"duplicate": "duplicate_signal", "not_waiting": "not_waiting_for_key"}
            raise Conflict(str(refused), code=codes.get(refused.reason, "job_finished")) from None
        return Response({"job_id": pk, "key": key, "woke": woke}, status=status.HTTP_202_ACCEPTED)


class WorkflowStepInSerializer(serializers.Serializer):
    id = serializers.CharField(max_length=workflows.MAX_STEP_ID)
    task = serializers.CharField()
    payload = serializers.JSONField()
    queue = serializers.CharField(required=False)
    priority = serializers.IntegerField(required=False)
    max_retries = serializers.IntegerField(required=False)
    concurrency_key = serializers.CharField(
        required=False, allow_null=True, help_text="As for a job (POST /jobs/)."
    )
    after = serializers.ListField(child=serializers.CharField(), required=False)


class WorkflowInSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=workflows.MAX_NAME)
    steps = WorkflowStepInSerializer(many=True, max_length=workflows.MAX_STEPS)
    on_failure = serializers.ChoiceField(
        choices=OnFailure.values, required=False, default=OnFailure.FAIL_DEPENDENTS.value
    )


class WorkflowStepSerializer(serializers.Serializer):
    id = serializers.CharField()
    job_id = serializers.IntegerField()
    task = serializers.CharField()
    queue = serializers.CharField()
    status = serializers.ChoiceField(choices=STATUSES)
    wait_reason = serializers.ChoiceField(choices=WaitReason.values, allow_null=True)
    after = serializers.ListField(child=serializers.CharField())
    result = serializers.JSONField(allow_null=True)
    error = serializers.CharField(allow_null=True)
    retry_count = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)


# A workflow's status, named apart from a job's in the OpenAPI document (settings).
WORKFLOW_STATUSES = ("running", Status.DONE.value, Status.FAILED.value)


class WorkflowSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    on_failure = serializers.ChoiceField(choices=OnFailure.values)
    status = serializers.ChoiceField(
        choices=WORKFLOW_STATUSES,
        help_text="running until every step ended; then failed if any step failed, else done",
    )
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    steps = WorkflowStepSerializer(many=True)


class WorkflowCreateView(_View):
    parser_classes = [BatchJSONParser]

    @extend_schema(
        summary="Create a workflow (a graph of jobs)",
        description="Every job of the graph is created in one transaction, or none is: a "
        "cycle, an unknown `after` id, an unknown task, more than 1,000 steps or more than "
        "`JOBS_WORKFLOW_MAX_EDGES` (10,000) `after` entries is a 400; a step that would take "
        "its queue past `JOBS_MAX_QUEUE_DEPTH` is a 429 with Retry-After, as for a batch. A "
        "step runs once all its `after` steps ended; under `fail_dependents` (default) a "
        "failed step fails its descendants (error `dependency failed: <id>`), under "
        "`continue` they run anyway.",
        request=WorkflowInSerializer,
        parameters=[IDEMPOTENCY_KEY],
        responses={
            201: OpenApiResponse(WorkflowSerializer, description="Created."),
            200: OpenApiResponse(
                WorkflowSerializer, description="Idempotent replay: the workflow this key created."
            ),
            **_errors(400, 401, 409, 413, 415, 429),
        },
        examples=[
            OpenApiExample(
                "fan-in",
                value={
                    "name": "etl",
                    "steps": [
                        {"id": "a", "task": "echo", "payload": {"part": 1}},
                        {"id": "b", "task": "echo", "payload": {"part": 2}},
                        {"id": "merge", "task": "echo", "payload": {}, "after": ["a", "b"]},
                    ],
                },
                request_only=True,
            )
        ],
    )
    def post(self, request: Request) -> Response:
        with transaction.atomic(durable=True):
            workflow_id, created = workflows.submit_request(
                request.data,
                client=request.user,
                actor=self._actor(),
                idempotency_key=request.headers.get("Idempotency-Key"),
            )
        found = workflows.detail(workflow_id, request.user)
        if not created:
            return Response(WorkflowSerializer(found).data)
        return Response(
            WorkflowSerializer(found).data,
            status=status.HTTP_201_CREATED,
            headers={"Location": reverse("workflow-detail", args=[workflow_id])},
        )


class WorkflowDetailView(_View):
    @extend_schema(
        summary="A workflow and the state of each step",
        responses={200: WorkflowSerializer, **_errors(401, 404)},
    )
    def get(self, request: Request, pk: int) -> Response:
        found = workflows.detail(pk, request.user)
        if found is None:
            raise exceptions.NotFound()
        return Response(WorkflowSerializer(found).data)


class WorkflowCancelView(_View):
    @extend_schema(
        summary="Cancel a workflow",
        description="The steps not started end failed with error `cancelled`; running "
        "steps finish. Answers the workflow as it is then.",
        request=None,
        responses={200: WorkflowSerializer, **_errors(401, 404)},
    )
    def post(self, request: Request, pk: int) -> Response:
        if workflows.cancel(pk, actor=self._actor(), client=request.user) is None:
            raise exceptions.NotFound()
        return Response(WorkflowSerializer(workflows.detail(pk, request.user)).data)


__all__ = ["JobSignalView", "WorkflowCancelView", "WorkflowCreateView", "WorkflowDetailView"]
