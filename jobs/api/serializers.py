"""Request and response shapes of the API (SPEC §9)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from jobs import submission
from jobs.lifecycle import STATUSES, Status
from jobs.models import PRIORITY_MAX, PRIORITY_MIN, Job, JobEvent
from jobs.selectors import progress_of

# Field errors get one stable code per field, whatever DRF check caught them.
_FIELD_CODES = {
    "queue": "invalid_queue",
    "priority": "invalid_priority",
    "run_at": "invalid_run_at",
    "max_retries": "invalid_max_retries",
    "task": "invalid_task",
    "payload": "invalid_payload",
}
_KEEP_CODES = {"required", "null", "unknown_field"}


class JobSubmitSerializer(serializers.Serializer):
    """The body of `POST /api/v1/jobs/`. Unknown fields are refused."""

    task = serializers.CharField(max_length=200, help_text="A registered task name.")
    payload = serializers.JSONField(
        help_text="Any JSON value except null; at most JOBS_MAX_PAYLOAD_BYTES "
        "(default 65536) bytes once serialised compactly."
    )
    queue = serializers.RegexField(
        submission.QUEUE_NAME_RE.pattern, required=False, default="default", max_length=100
    )
    priority = serializers.IntegerField(
        required=False,
        default=0,
        min_value=PRIORITY_MIN,
        max_value=PRIORITY_MAX,
        help_text="Higher runs first.",
    )
    run_at = serializers.DateTimeField(
        required=False,
        allow_null=True,
        default=None,
        help_text="ISO 8601; not before this time. Without an offset it is UTC.",
    )
    max_retries = serializers.IntegerField(
        required=False,
        allow_null=True,
        default=None,
        min_value=0,
        max_value=submission.MAX_RETRIES_LIMIT,
        help_text="Retries after the first attempt; default JOBS_MAX_RETRIES (3).",
    )

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        errors: dict[str, list[serializers.ErrorDetail]] = {}
        if isinstance(data, dict):
            for name in sorted(set(data) - set(self.fields)):
                errors[name] = [
                    serializers.ErrorDetail(
                        f"Unknown field {name!r}; allowed: {', '.join(self.fields)}.",
                        code="unknown_field",
                    )
                ]
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            errors = {**_recode(exc.detail), **errors}
            raise serializers.ValidationError(errors) from exc
        if errors:
            raise serializers.ValidationError(errors)
        return value


def _recode(detail: Any) -> dict[str, Any]:
    if not isinstance(detail, dict):
        return {"non_field_errors": detail}
    out = {}
    for field, errs in detail.items():
        code = _FIELD_CODES.get(field)
        if code is None or not isinstance(errs, list):
            out[field] = errs
            continue
        out[field] = [
            e
            if getattr(e, "code", None) in _KEEP_CODES
            else serializers.ErrorDetail(str(e), code=code)
            for e in errs
        ]
    return out


class BatchItemSerializer(JobSubmitSerializer):
    """One job of a batch: the single body, with its own idempotency key."""

    idempotency_key = serializers.CharField(
        required=False,
        allow_null=True,
        default=None,
        max_length=200,
        help_text="Per client, like the Idempotency-Key header of a single submission.",
    )


class BatchSubmitSerializer(serializers.Serializer):
    """The body of `POST /api/v1/jobs/batch/` (documentation; validated by jobs.submission)."""

    jobs = BatchItemSerializer(many=True, help_text="1 to 1000 jobs.")


class BatchJobSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    created = serializers.BooleanField(help_text="False: an idempotent replay of an earlier job.")
    status = serializers.ChoiceField(choices=STATUSES)
    task = serializers.CharField()
    queue = serializers.CharField()
    idempotency_key = serializers.CharField(allow_null=True)
    run_at = serializers.DateTimeField()
    created_at = serializers.DateTimeField()


class BatchResultSerializer(serializers.Serializer):
    jobs = BatchJobSerializer(many=True, help_text="In the order submitted.")


class ProgressSerializer(serializers.Serializer):
    """What the running handler last reported, as written with the worker's heartbeat."""

    done = serializers.FloatField(help_text="Units of work done so far.")
    total = serializers.FloatField(allow_null=True, help_text="Units in all; null if unknown.")
    fraction = serializers.FloatField(
        allow_null=True, help_text="done / total, between 0 and 1; null when total is unknown."
    )
    message = serializers.CharField(allow_blank=True)
    updated_at = serializers.DateTimeField(help_text="When the database stored the report.")


class JobSerializer(serializers.ModelSerializer):
    """A job as its client sees it (the worker's identity is internal)."""

    progress = serializers.SerializerMethodField(
        help_text="The running handler's latest progress report: null until it reports "
        "one, cleared when a new attempt starts, kept on the finished job."
    )
    cancel_requested_at = serializers.DateTimeField(
        read_only=True,
        allow_null=True,
        help_text="When a cancel was asked of this job while it was processing.",
    )
    cancel_too_late = serializers.SerializerMethodField(
        help_text="True when a cancel was requested but the handler finished without "
        "stopping: the job is done and its result kept."
    )

    @extend_schema_field(ProgressSerializer(allow_null=True))
    def get_progress(self, job: Job) -> dict[str, Any] | None:
        return progress_of(job)

    @extend_schema_field(OpenApiTypes.BOOL)
    def get_cancel_too_late(self, job: Job) -> bool:
        return job.status == Status.DONE and job.cancel_requested_at is not None

    class Meta:
        model = Job
        fields = [
            "id",
            "task",
            "queue",
            "priority",
            "status",
            "payload",
            "result",
            "error",
            "retry_count",
            "max_retries",
            "lease_version",
            "idempotency_key",
            "run_at",
            "created_at",
            "updated_at",
            "finished_at",
            "progress",
            "cancel_requested_at",
            "cancel_too_late",
        ]
        read_only_fields = fields


class JobEventSerializer(serializers.ModelSerializer):
    """One entry of a job's history: a transition, or a stale write the fence refused.

    The event that ended a failed attempt carries its exception class and traceback
    (the last 30 frames, at most 8 KiB); they are null on every other event.
    """

    class Meta:
        model = JobEvent
        fields = [
            "id",
            "kind",
            "at",
            "actor",
            "from_status",
            "to_status",
            "lease_version",
            "retry_count",
            "error",
            "error_class",
            "error_traceback",
        ]
        read_only_fields = fields


class ErrorItemSerializer(serializers.Serializer):
    message = serializers.CharField()
    code = serializers.CharField()


class ErrorSerializer(serializers.Serializer):
    """The shape of every error response (see jobs.api.errors)."""

    detail = serializers.CharField()
    code = serializers.CharField(help_text="Stable, machine-readable.")
    errors = serializers.DictField(
        child=ErrorItemSerializer(many=True),
        required=False,
        help_text="Per-field errors, for invalid requests.",
    )
    job_id = serializers.IntegerField(
        required=False, help_text="The job an idempotency key already belongs to (409)."
    )
    status = serializers.ChoiceField(
        choices=STATUSES, required=False, help_text="The job's current status (cancel, 409)."
    )
    retry_after = serializers.IntegerField(required=False, help_text="Seconds (429).")
