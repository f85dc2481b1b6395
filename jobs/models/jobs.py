"""The job and what it belongs to: its client, its row, its history, and where a period
of finished jobs went once archived. Every other room points at these rows, so this one
sits below them and imports none of them. Per-state invariants are named check
constraints built from `lifecycle`; transitions are guarded by a trigger (see
migrations)."""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce, Now

from jobs.lifecycle import NON_TERMINAL, STATUSES, TERMINAL, UNOWNED, Move, Status, WaitReason
from jobs.pgtypes import HOT, LEGACY

PRIORITY_MIN = -100
PRIORITY_MAX = 100

_OWNED = Q(owned_by__isnull=False, claimed_at__isnull=False, heartbeat_at__isnull=False)
_UNOWNED = Q(owned_by__isnull=True, claimed_at__isnull=True, heartbeat_at__isnull=True)


class JobQuerySet(models.QuerySet):
    """The reads the ORM can say; the database clock (`Now()`) decides what is due."""

    def in_states(self, states) -> JobQuerySet:
        return self.filter(status__in=sorted(Status(s).value for s in states))

    def eligible_for(self, move: Move) -> JobQuerySet:
        """Rows a lifecycle move may take (its source states)."""
        return self.in_states(move.sources)

    def queued(self) -> JobQuerySet:
        return self.filter(status=Status.QUEUED)

    def processing(self) -> JobQuerySet:
        return self.filter(status=Status.PROCESSING)

    def due(self, older_than: float = 0) -> JobQuerySet:
        """Queued rows whose run_at passed (at least `older_than` seconds ago)."""
        return self.queued().filter(run_at__lte=Now() - timedelta(seconds=older_than))

    def stuck(self, lease_seconds: float) -> JobQuerySet:
        """Processing rows whose heartbeat is older than the lease."""
        return self.processing().filter(heartbeat_at__lt=Now() - timedelta(seconds=lease_seconds))


class Client(models.Model):
    """An API client. The token is shown once; only its SHA-256 is stored."""

    name = models.CharField(max_length=100, unique=True)
    token_hash = models.CharField(max_length=64, unique=True)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(db_default=Now())
    # Per-client quotas (jobs.admission): empty takes the setting's default; staff raise one
    # client's limit in the admin.
    max_schedules = models.PositiveIntegerField(
        null=True, blank=True, help_text="Schedules it may hold; empty: JOBS_MAX_SCHEDULES."
    )
    max_webhooks = models.PositiveIntegerField(
        null=True, blank=True, help_text="Webhooks it may hold; empty: JOBS_MAX_WEBHOOKS."
    )
    max_signals_per_job = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Signals one of its jobs may hold; empty: JOBS_MAX_SIGNALS_PER_JOB.",
    )
    max_queue_depth = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Queued jobs (parked ones too) it may hold in one queue; "
        "empty: JOBS_MAX_CLIENT_QUEUE_DEPTH.",
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def hash_token(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def issue_token(self) -> str:
        """A new token for this client; only its hash is kept, so show it now or never."""
        token = secrets.token_urlsafe(32)
        self.token_hash = self.hash_token(token)
        return token

    @classmethod
    def create_with_token(cls, name: str) -> tuple[Client, str]:
        client = cls(name=name)
        token = client.issue_token()
        client.save()
        return client, token

    # DRF's IsAuthenticated-style checks read these.
    is_authenticated = True


class Job(models.Model):
    """Every fact about a job (SPEC §2). Written only through `jobs.services`."""

    id = models.BigAutoField(primary_key=True)
    task = models.CharField(max_length=200)
    payload = models.JSONField(default=dict)
    queue = models.CharField(max_length=100, default="default")
    priority = models.SmallIntegerField(default=0, help_text="Higher runs first.")
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(null=True, blank=True)
    # The failed attempt's exception, written with its `error` by the worker's fenced
    # fail; the history trigger copies both into the attempt's event.
    error_class = models.CharField(
        max_length=200, null=True, blank=True, help_text="Import path, e.g. builtins.ValueError."
    )
    error_traceback = models.TextField(null=True, blank=True)
    run_at = models.DateTimeField(db_default=Now())
    max_retries = models.IntegerField()
    # Seconds one attempt may run (jobs.watchdog); NULL: the task's timeout or the default.
    timeout = models.FloatField(null=True, blank=True)
    retry_count = models.IntegerField(default=0)
    lease_version = models.BigIntegerField(default=0)
    owned_by = models.CharField(max_length=200, null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    # When the handler of the latest attempt was called: set before the call (by the
    # claim, or the worker's batched start mark), cleared by every claim. Crash
    # recovery spends a retry only when it is set (D77).
    started_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    # Where the latency SLO starts (SPEC §6): the later of creation and run_at, set by
    # the insert trigger; a staff retry restarts it. NULL on rows older than the
    # column, which count from created_at.
    due_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)
    # Indexed by job_client_created_idx, which leads with it (D406).
    client = models.ForeignKey(
        Client, null=True, blank=True, on_delete=models.PROTECT, related_name="jobs",
        db_index=False,
    )  # fmt: skip
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)
    request_hash = models.CharField(max_length=64, null=True, blank=True)
    updated_by = models.CharField(
        max_length=250, null=True, blank=True, help_text="Actor of the latest write."
    )
    # What the running handler last reported ({"done", "total", "message", "updated_at"}),
    # written with the fenced heartbeat; cleared by the claim of a new attempt.
    progress = models.JSONField(null=True, blank=True)
    # A cancel asked of a processing job: the worker stops the handler at its next
    # heartbeat; a requeue with a request pending ends the job instead (lifecycle).
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    # How many status changes the row has had (1 on insert), kept by the guard trigger:
    # the `seq` of its latest history row and completion event. NULL on older rows.
    event_seq = models.IntegerField(null=True, blank=True, editable=False)
    # Per client: at most one live (queued, enqueue_failed, processing) job holds a key;
    # a submission with a held key returns that job (docs/schedules.md).
    unique_key = models.CharField(max_length=200, null=True, blank=True)
    # Per client: a queue's `key_concurrency` caps how many jobs with one key are
    # processing at once (docs/queue-controls.md).
    concurrency_key = models.CharField(max_length=200, null=True, blank=True)
    # The schedule that made the job and the slot it fired for. No database foreign
    # key: adding one validates 10M rows under lock, and a deleted schedule's jobs
    # keep its id as history (D57).
    schedule = models.ForeignKey(
        "Schedule",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,  # the partial indexes below serve every lookup
        related_name="jobs",
    )
    fire_time = models.DateTimeField(null=True, blank=True)
    # Why a queued job is not due yet (jobs.durable, jobs.workflows): parked by its
    # handler (sleep, a signal wait on `wait_key`) or blocked on workflow parents.
    wait_reason = models.CharField(max_length=20, null=True, blank=True, choices=WaitReason.choices)
    wait_key = models.CharField(max_length=200, null=True, blank=True)
    # The W3C trace context of its submission (jobs.tracing, D300): `traceparent`, then
    # `tracestate` after a newline; bounded, NULL when submitted outside a trace.
    trace_context = models.CharField(max_length=600, null=True, blank=True, editable=False)
    # Per client: jobs with one key run one at a time in submission order (jobs.flow).
    sequence_key = models.CharField(max_length=200, null=True, blank=True)
    # The batch the job belongs to (jobs.flow.batches). No database foreign key, like
    # schedule: adding one would validate every row under lock.
    batch_id = models.BigIntegerField(null=True, blank=True)
    # Continue-as-new (jobs.durable, D315): each run of a long-lived durable job is a job
    # of its own; the runs share `chain_id` (the first run's id) and link to each other.
    chain_id = models.BigIntegerField(
        null=True, blank=True, help_text="The first run's id, on every run of a chain."
    )
    run_number = models.IntegerField(
        null=True, blank=True, help_text="Its run in the chain (1 when empty)."
    )
    previous_run_ids = ArrayField(
        models.BigIntegerField(),
        null=True,
        blank=True,
        help_text="The ids of the earlier runs, oldest first (the last JOBS_CHAIN_IDS_KEPT).",
    )
    next_run_id = models.BigIntegerField(
        null=True, blank=True, help_text="The run it continued as (it ended done)."
    )
    # The partition (D155): 'infinity' (pgtypes.HOT) while live and recently finished,
    # then the start of its created_at's period, set by the mover (jobs.partitions).
    period = models.DateField(
        default=HOT,
        editable=False,
        help_text="The partition: 'infinity' (hot) until the mover moves the finished job "
        "to the period of its created_at.",
    )

    objects = JobQuerySet.as_manager()
    # Set on the job `submit()` returns when a live job already held its unique_key.
    duplicate = False
    # Set on the job a submission answers: it joined a debounced job (jobs.flow.debounce),
    # or its key was busy and its key_strategy skipped it (jobs.flow.strategies).
    debounced = False
    skipped = False
    # Set on the job its INSERT returned (jobs.services.inserts): whether its queue was
    # paused, read in that statement, so the answer reads nothing more. None: not read.
    queue_paused: bool | None = None

    class Meta:
        db_table = "jobs_job"
        # Staff actions in the admin, each granted on its own (see jobs/admin.py).
        permissions = [
            ("retry_job", "Can retry failed jobs (resets the retry budget)"),
            ("repair_job", "Can repair enqueue_failed jobs"),
            ("revoke_job", "Can revoke the lease of processing jobs"),
            ("cancel_job", "Can cancel jobs that have not started"),
            ("cancel_running_job", "Can ask running jobs to stop (cancel running)"),
            ("signal_job", "Can send a signal to a durable job"),
        ]
        constraints = [
            models.CheckConstraint(name="job_status_valid", condition=Q(status__in=STATUSES)),
            models.CheckConstraint(
                name="job_processing_is_owned",
                condition=~Q(status=Status.PROCESSING) | _OWNED,
            ),
            models.CheckConstraint(
                name="job_idle_is_unowned",
                condition=~Q(status__in=sorted(UNOWNED)) | _UNOWNED,
            ),
            models.CheckConstraint(
                name="job_done_has_no_error",
                condition=~Q(status=Status.DONE) | Q(error__isnull=True),
            ),
            models.CheckConstraint(
                name="job_failed_has_error",
                condition=~Q(status=Status.FAILED) | Q(error__isnull=False),
            ),
            models.CheckConstraint(
                name="job_terminal_is_finished",
                condition=(Q(status__in=sorted(TERMINAL)) & Q(finished_at__isnull=False))
                | (~Q(status__in=sorted(TERMINAL)) & Q(finished_at__isnull=True)),
            ),
            # A cancel request lives only on a running (or finished) job: a job that
            # waits for an attempt with one pending would be claimed and run.
            models.CheckConstraint(
                name="job_waiting_has_no_cancel_request",
                condition=~Q(status__in=[Status.QUEUED.value, Status.ENQUEUE_FAILED.value])
                | Q(cancel_requested_at__isnull=True),
            ),
            models.CheckConstraint(name="job_retry_count_nonneg", condition=Q(retry_count__gte=0)),
            models.CheckConstraint(
                name="job_lease_version_nonneg", condition=Q(lease_version__gte=0)
            ),
            models.CheckConstraint(name="job_max_retries_nonneg", condition=Q(max_retries__gte=0)),
            models.CheckConstraint(
                name="job_priority_range",
                condition=Q(priority__gte=PRIORITY_MIN, priority__lte=PRIORITY_MAX),
            ),
            # Unique within a partition only: submit() looks the key up in the cold
            # partitions after its insert into hot (D159).
            models.UniqueConstraint(
                name="job_idempotency_key_per_client",
                fields=["client", "idempotency_key", "period"],
                condition=Q(idempotency_key__isnull=False),
                nulls_distinct=False,
            ),
            # Live jobs are all hot (job_cold_is_finished): with period in the key this
            # is still "unique among live jobs" (0021; first built by 0011).
            models.UniqueConstraint(
                name="job_unique_key_live",
                fields=["client", "unique_key", "period"],
                condition=Q(unique_key__isnull=False, status__in=sorted(NON_TERMINAL)),
                nulls_distinct=False,
            ),
            # Live jobs are always in the hot partition.
            models.CheckConstraint(
                name="job_cold_is_finished",
                condition=Q(period=HOT) | Q(status__in=sorted(TERMINAL)),
            ),
        ]
        indexes = [
            # The claim: claimable rows only, in claim order.
            models.Index(
                name="job_claim_idx",
                fields=["queue", "-priority", "run_at", "id"],
                condition=Q(status=Status.QUEUED),
            ),
            # The reaper's expired-lease sweep reads every processing row (a few per
            # worker slot). Keyed on id, not heartbeat_at, so that a heartbeat changes
            # no indexed column and is a HOT update (see decision D17).
            # A fair queue's claim: each client's best row, clients visited in order.
            models.Index(
                F("queue"),
                Coalesce(F("client"), Value(0)),
                F("priority").desc(),
                F("run_at"),
                F("id"),
                name="job_fair_claim_idx",
                condition=Q(status=Status.QUEUED),
            ),
            # A keyed queue's claim: how many jobs of each key are processing.
            models.Index(
                name="job_key_processing_idx",
                fields=["queue", "client", "concurrency_key"],
                condition=Q(status=Status.PROCESSING, concurrency_key__isnull=False),
            ),
            models.Index(
                name="job_processing_id_idx",
                fields=["id"],
                condition=Q(status=Status.PROCESSING),
            ),
            models.Index(
                name="job_enqueue_failed_idx",
                fields=["id"],
                condition=Q(status=Status.ENQUEUE_FAILED),
            ),
            # A client's own listing, newest first.
            models.Index(name="job_client_created_idx", fields=["client", "-created_at", "-id"]),
            # Retention and time-window aggregates over finished jobs.
            models.Index(name="job_finished_idx", fields=["finished_at"]),
            models.Index(name="job_status_task_idx", fields=["status", "task"]),
            # A schedule's jobs, newest first (?schedule=), and its live ones (overlap).
            models.Index(
                name="job_schedule_created_idx",
                fields=["schedule", "-created_at", "-id"],
                condition=Q(schedule__isnull=False),
            ),
            models.Index(
                name="job_schedule_live_idx",
                fields=["schedule"],
                condition=Q(schedule__isnull=False, status__in=sorted(NON_TERMINAL)),
            ),
            # Parked and blocked jobs, for the metrics and the admin (few rows).
            models.Index(
                name="job_waiting_idx",
                fields=["wait_reason"],
                condition=Q(status=Status.QUEUED, wait_reason__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.id} {self.task} [{self.status}]"


class JobEvent(models.Model):
    """Append-only history: one row per transition (written by a database trigger),
    one per rejected stale write (written by the worker that was fenced off) and one
    per cancel request for a running job (written with the request)."""

    TRANSITION = "transition"
    FENCE_REJECTED = "fence_rejected"
    CANCEL_REQUESTED = "cancel_requested"
    RETRY_POLICY = "retry_policy"  # a task's retry policy's decision (jobs.retries)

    id = models.BigAutoField(primary_key=True)
    # Indexed by jobevent_job_idx, which leads with it (D406).
    job = models.ForeignKey(
        Job, on_delete=models.DO_NOTHING, db_constraint=False, related_name="events",
        db_index=False,
    )  # fmt: skip
    kind = models.CharField(max_length=20, default=TRANSITION, db_default=TRANSITION)
    at = models.DateTimeField(db_default=Now())
    from_status = models.CharField(max_length=20, null=True, blank=True)
    to_status = models.CharField(max_length=20)
    actor = models.CharField(max_length=250, blank=True, default="")
    lease_version = models.BigIntegerField()
    retry_count = models.IntegerField(default=0)
    error = models.TextField(null=True, blank=True)
    # Set on the event that ended a failed attempt (processing → queued / failed).
    error_class = models.CharField(max_length=200, null=True, blank=True)
    error_traceback = models.TextField(null=True, blank=True)
    # The job's `event_seq` after this transition: events of one job in order, no gaps.
    seq = models.IntegerField(null=True, blank=True)
    # The partition key (D160): the job's created_at, so a period's jobs and their
    # whole history leave together; '-infinity' (pgtypes.LEGACY) on rows older than
    # the partitions.
    job_created_at = models.DateTimeField(default=LEGACY, editable=False)

    class Meta:
        db_table = "jobs_jobevent"
        ordering = ["job_id", "id"]
        indexes = [models.Index(name="jobevent_job_idx", fields=["job", "id"])]

    def __str__(self) -> str:
        return f"{self.job_id}: {self.from_status or 'new'} → {self.to_status} by {self.actor}"


class ArchivedPeriod(models.Model):
    """A period whose partitions were archived to Parquet and dropped (jobs.archive):
    where its files are and which job ids it held, so the admin can say where a job
    went. Written in the transaction that drops the period's tables."""

    period = models.DateField(primary_key=True, help_text="The day the period starts (UTC).")
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField()
    jobs = models.BigIntegerField()
    events = models.BigIntegerField(help_text="History rows archived with the jobs.")
    min_job_id = models.BigIntegerField(null=True, blank=True)
    max_job_id = models.BigIntegerField(null=True, blank=True)
    location = models.CharField(max_length=1000, help_text="The period's archive directory.")
    files = models.JSONField(default=dict, help_text="Each file's name, rows, bytes, sha256.")
    bytes = models.BigIntegerField(default=0)
    archived_at = models.DateTimeField(db_default=Now())
    restored_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Attached again by `archive restore`; archived anew by the next prune.",
    )

    class Meta:
        db_table = "jobs_archivedperiod"
        ordering = ["-period"]
        indexes = [models.Index(name="archivedperiod_ids_idx", fields=["min_job_id", "max_job_id"])]

    def __str__(self) -> str:
        return f"period {self.period:%Y-%m-%d}"
