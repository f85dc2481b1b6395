"""Request and response shapes of the API (SPEC §9)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from jobs import queues, selectors, validation
from jobs.flow import rules as flow_rules
from jobs.lifecycle import STATUSES, Role, Status, actor_role
from jobs.models import PRIORITY_MAX, PRIORITY_MIN, Job, JobEvent, Schedule
from jobs.selectors import progress_of


def _key_field(help_text: str) -> serializers.RegexField:
    """A client's key: 1-200 printable ASCII characters without spaces, or null."""
    return serializers.RegexField(
        r"^[\x21-\x7e]{1,200}$",
        required=False,
        allow_null=True,
        default=None,
        max_length=200,
        help_text=help_text,
    )


class WaitReasonField(serializers.CharField):
    """A job's wait reason, its queue's pause included (jobs.selectors.wait_reason)."""

    def to_representation(self, job: Job) -> str | None:
        return selectors.wait_reason(job)


class KeyRateSerializer(serializers.Serializer):
    """A rate per concurrency key: `limit` events in any window of `period` seconds."""

    limit = serializers.IntegerField(min_value=1, max_value=queues.KEY_RATE_LIMIT_MAX)
    period = serializers.IntegerField(
        min_value=1, max_value=queues.KEY_RATE_PERIOD_MAX, help_text="Whole seconds."
    )


class JobSubmitSerializer(serializers.Serializer):
    """The body of `POST /api/v1/jobs/` (documentation: jobs.submission checks requests,
    the same way for both endpoints). Unknown fields are refused."""

    task = serializers.CharField(max_length=200, help_text="A registered task name.")
    payload = serializers.JSONField(
        help_text="Any JSON value except null; at most JOBS_MAX_PAYLOAD_BYTES "
        "(default 65536) bytes once serialised compactly."
    )
    queue = serializers.ChoiceField(
        choices=queues.names_for_docs(),
        required=False,
        default="default",
        help_text="A queue declared in JOBS_QUEUES, not an internal one (`webhooks`, or "
        'marked `"internal": true`); any other is refused (unknown_queue).',
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
        max_value=validation.MAX_RETRIES_LIMIT,
        help_text="Retries after the first attempt; default JOBS_MAX_RETRIES (3).",
    )
    timeout = serializers.FloatField(
        required=False,
        allow_null=True,
        default=None,
        help_text="Seconds one attempt may run, at most JOBS_MAX_TIMEOUT (86400); default "
        "the task's timeout, else JOBS_DEFAULT_TIMEOUT (3600). At the limit the handler's "
        "ctx.stop is set; JOBS_TIMEOUT_GRACE (5) seconds later the attempt ends failed "
        "with a `timeout:` error and is retried per max_retries.",
    )
    unique_key = _key_field(
        "Per client. While a job with this key is queued, enqueue_failed or "
        "processing, submitting returns that job (200, `duplicate: true`) instead of "
        "creating one; once it is done or failed the key is free again."
    )
    concurrency_key = _key_field(
        "Per client. In a queue with `key_concurrency: N`, at most N of your jobs "
        "with this key are processing at once; the others wait their turn, queued."
    )
    sequence_key = _key_field(
        "Per client. Jobs with this key run strictly one at a time, in the order they "
        "were submitted, across all workers; a job that fails halts the sequence (later "
        "ones wait with `wait_reason: sequence_halted`) until staff resume or skip it."
    )
    # Flow control per key (jobs.flow, docs/queue-controls.md).
    debounce_key = _key_field(
        "Per client. Submissions with this key gather into one job that runs "
        "`debounce_seconds` after the last of them, with the last payload; each is "
        "answered with that job (200, `debounced: true`, once it exists). Not with "
        "`run_at`, `unique_key` or an Idempotency-Key."
    )
    debounce_seconds = serializers.FloatField(
        required=False,
        allow_null=True,
        default=None,
        min_value=0,
        max_value=flow_rules.DEBOUNCE_SECONDS_MAX,
        help_text="Seconds (> 0) after the last submission of the `debounce_key` the job runs.",
    )
    debounce_max_wait = serializers.FloatField(
        required=False,
        allow_null=True,
        default=None,
        min_value=0,
        max_value=flow_rules.DEBOUNCE_MAX_WAIT_MAX,
        help_text="Seconds after the first submission the job runs at the latest, however "
        "many follow (at least `debounce_seconds`).",
    )
    key_strategy = serializers.ChoiceField(
        choices=flow_rules.STRATEGIES,
        required=False,
        allow_null=True,
        default=None,
        help_text="When the `concurrency_key` has a live job: `queue` (wait, the default), "
        "`cancel_running` (stop the key's running job cooperatively and cancel its queued "
        "ones; this one runs) or `skip_new` (this job ends at once, failed with a `skipped:` "
        "error; answered with `skipped: true`).",
    )
    rate_limit = KeyRateSerializer(
        required=False,
        allow_null=True,
        default=None,
        help_text="Past `limit` accepted submissions of the `concurrency_key` in the last "
        "`period` seconds, this one is refused: 429 `rate_limited` with Retry-After (the "
        "seconds until one fits). Idempotent replays are answered, never counted.",
    )


class BatchItemSerializer(JobSubmitSerializer):
    """One job of a batch: the single body, with its own idempotency key (unique keys are
    for single submissions; flow fields apply per job, in the batch's order: D360)."""

    unique_key = None

    idempotency_key = _key_field(
        "Per client, like the Idempotency-Key header of a single submission."
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
    debounced = serializers.BooleanField(
        help_text="True: this job joined the waiting job of its `debounce_key`."
    )
    skipped = serializers.BooleanField(
        help_text="True: its `concurrency_key` was busy and `key_strategy: skip_new` ended it."
    )


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

    wait_reason = WaitReasonField(
        source="*",
        read_only=True,
        allow_null=True,
        help_text="Why a queued job is not running: sleep or signal (parked by its "
        "handler), parents (a workflow step whose parents have not ended), sequence (an "
        "earlier job of its sequence_key has not ended), sequence_halted (an earlier one "
        "failed: staff resume or skip it), queue_paused "
        "(its queue is paused); null otherwise.",
    )

    batch = serializers.IntegerField(
        source="batch_id",
        read_only=True,
        allow_null=True,
        help_text="The batch this job belongs to (its id, GET /api/v1/batches/<id>/), or null.",
    )

    run_number = serializers.SerializerMethodField(
        help_text="Its run in a durable job's chain (continue-as-new): 1 for a first run."
    )

    @extend_schema_field(OpenApiTypes.INT)
    def get_run_number(self, job: Job) -> int:
        return job.run_number or 1

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
            "timeout",
            "lease_version",
            "idempotency_key",
            "run_at",
            "created_at",
            "updated_at",
            "finished_at",
            "progress",
            "cancel_requested_at",
            "cancel_too_late",
            "unique_key",
            "concurrency_key",
            "sequence_key",
            "batch",
            "schedule",
            "fire_time",
            "wait_reason",
            "chain_id",
            "run_number",
            "previous_run_ids",
            "next_run_id",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "chain_id": {"help_text": "The first run's id once a durable job continued as new."},
            "previous_run_ids": {
                "help_text": "The ids of the chain's earlier runs, oldest first (at most "
                "JOBS_CHAIN_IDS_KEPT); null for a first run."
            },
            "next_run_id": {
                "help_text": "The run this one continued as: it ended done and the job goes "
                "on there (signals sent here are delivered there)."
            },
            "schedule": {"help_text": "The schedule that made this job (its id), or null."},
            "fire_time": {"help_text": "The schedule's slot this job was made for, or null."},
        }

    # Fields bound once per process: ModelSerializer rebuilds all sixteen from the model
    # for every job it renders, the largest CPU cost of a submission's response.
    _bound_fields: tuple[tuple[str, serializers.Field], ...] | None = None

    @classmethod
    def _fields_once(cls) -> tuple[tuple[str, serializers.Field], ...]:
        if cls.__dict__.get("_bound_fields") is None:
            cls._bound_fields = tuple((f.field_name, f) for f in cls()._readable_fields)
        return cls._bound_fields

    def to_representation(self, instance: Job) -> dict:
        """What ModelSerializer.to_representation returns, with fields built once (these
        fields keep no per-call state, so one set serves every instance and thread)."""
        out = {}
        for name, field in self._fields_once():
            value = field.get_attribute(instance)
            out[name] = None if value is None else field.to_representation(value)
        return out


class HistorySerializer(serializers.Serializer):
    """A durable run's stored history (JOBS_MAX_STEPS bounds steps + waits)."""

    steps = serializers.IntegerField(help_text="Checkpointed steps (ctx.step).")
    waits = serializers.IntegerField(help_text="Sleeps, signal waits and patch markers.")
    bytes = serializers.IntegerField(help_text="Stored bytes of their results.")


class JobDetailSerializer(JobSerializer):
    """One job as GET /jobs/<id>/ answers it: with its durable history's size."""

    history = serializers.SerializerMethodField(
        help_text="The run's stored durable history: steps, waits and bytes."
    )

    @extend_schema_field(HistorySerializer)
    def get_history(self, job: Job) -> dict[str, int]:
        return selectors.job_history(job.pk)

    _bound_fields = None

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "history"]
        read_only_fields = fields


class SubmittedJobSerializer(JobSerializer):
    """The answer to a submission: the job, and whether a live job with the same
    `unique_key` was returned instead of a new one."""

    duplicate = serializers.SerializerMethodField(
        help_text="True: a live job of yours already held this `unique_key`; this is it."
    )
    debounced = serializers.SerializerMethodField(
        help_text="True: this submission joined the waiting job of its `debounce_key`."
    )
    skipped = serializers.SerializerMethodField(
        help_text="True: the `concurrency_key` was busy and `key_strategy: skip_new` ended "
        "this job at once."
    )

    @extend_schema_field(OpenApiTypes.BOOL)
    def get_duplicate(self, job: Job) -> bool:
        return job.duplicate

    @extend_schema_field(OpenApiTypes.BOOL)
    def get_debounced(self, job: Job) -> bool:
        return job.debounced

    @extend_schema_field(OpenApiTypes.BOOL)
    def get_skipped(self, job: Job) -> bool:
        return job.skipped

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "duplicate", "debounced", "skipped"]
        read_only_fields = fields

    _bound_fields = None


class JobEventSerializer(serializers.ModelSerializer):
    """One entry of a job's history: a transition, or a stale write the fence refused.

    The event that ended a failed attempt carries its exception class and traceback
    (the last 30 frames, at most 8 KiB); they are null on every other event. Who made
    the change is shown as a role; the actor's identity is for staff (the admin).
    """

    role = serializers.SerializerMethodField(
        help_text="Who made the change: a worker, the reaper, staff, the client, or the "
        "service itself (api)."
    )

    class Meta:
        model = JobEvent
        fields = [
            "id",
            "kind",
            "at",
            "role",
            "from_status",
            "to_status",
            "lease_version",
            "retry_count",
            "error",
            "error_class",
            "error_traceback",
        ]
        read_only_fields = fields

    @extend_schema_field(serializers.ChoiceField(choices=Role.choices))
    def get_role(self, event: JobEvent) -> str:
        return actor_role(event.actor)


class ScheduleWriteSerializer(serializers.Serializer):
    """The body of `POST` and `PATCH /api/v1/schedules/` (documentation: the rules are
    jobs.schedules.define's). Unknown fields are refused."""

    name = serializers.CharField(max_length=200, help_text="Unique among your schedules.")
    cron = serializers.CharField(
        required=False,
        allow_null=True,
        max_length=200,
        help_text="5 fields (minute hour day month weekday), or 6 with seconds first.",
    )
    interval_seconds = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, help_text="Instead of cron."
    )
    timezone = serializers.CharField(
        required=False, default="UTC", help_text="IANA name the cron times are read in."
    )
    task = serializers.CharField(max_length=200, help_text="A registered task name.")
    payload = serializers.JSONField(required=False, help_text="The job's payload; not null.")
    queue = serializers.ChoiceField(choices=queues.names_for_docs(), required=False)
    priority = serializers.IntegerField(
        required=False, min_value=PRIORITY_MIN, max_value=PRIORITY_MAX
    )
    max_retries = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=validation.MAX_RETRIES_LIMIT
    )
    timeout = serializers.FloatField(
        required=False,
        allow_null=True,
        help_text="Attempt timeout of the jobs it makes, seconds (see POST /api/v1/jobs/).",
    )
    enabled = serializers.BooleanField(required=False, default=True)
    catch_up = serializers.ChoiceField(
        choices=Schedule.CatchUp.choices,
        required=False,
        help_text="After downtime: one job for the missed period (skip), or one per "
        "missed slot (all, bounded by JOBS_SCHEDULE_CATCH_UP_MAX).",
    )
    overlap = serializers.ChoiceField(
        choices=Schedule.Overlap.choices,
        required=False,
        help_text="skip: no new job while the previous one is queued or processing.",
    )
    concurrency_key = _key_field("The jobs' concurrency key (as for POST /jobs/).")


class ScheduleSerializer(serializers.ModelSerializer):
    """A schedule as its client sees it."""

    class Meta:
        model = Schedule
        fields = [
            "id", "name", "cron", "interval_seconds", "timezone", "task", "payload", "queue",
            "priority", "max_retries", "timeout", "enabled", "catch_up", "overlap",
            "concurrency_key", "next_fire_at", "last_fire_at", "created_at", "updated_at",
        ]  # fmt: skip
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
