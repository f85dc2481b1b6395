"""Tables of the job system. Per-state invariants are named check constraints
built from `lifecycle`; transitions are guarded by a trigger (see migrations)."""

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
    client = models.ForeignKey(
        Client, null=True, blank=True, on_delete=models.PROTECT, related_name="jobs"
    )
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
    job = models.ForeignKey(
        Job, on_delete=models.DO_NOTHING, db_constraint=False, related_name="events"
    )
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


class WorkerProcess(models.Model):
    """One running worker process: the queues it serves and how to tell it is alive.

    Written only by the worker itself (jobs.presence) and cleaned by the reaper.
    `lock_key` names the session-level advisory lock the worker holds on its
    presence connection while it lives (NULL when session crash detection is
    off): when that session is gone and the heartbeat is stale, the process is
    dead and the reaper requeues its jobs without waiting for the lease.
    """

    id = models.CharField(max_length=200, primary_key=True, help_text="As in Job.owned_by.")
    hostname = models.CharField(max_length=255)
    pid = models.IntegerField()
    backend_pid = models.IntegerField(
        null=True, blank=True, help_text="PostgreSQL backend of the presence connection."
    )
    lock_key = models.IntegerField(null=True, blank=True)
    queues = ArrayField(models.CharField(max_length=100), help_text="'*' serves every queue.")
    concurrency = models.IntegerField()
    started_at = models.DateTimeField(db_default=Now())
    heartbeat_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "jobs_worker"
        ordering = ["id"]

    def __str__(self) -> str:
        return self.id


class Queue(models.Model):
    """A declared queue's controls (docs/queue-controls.md), enforced by the claim.

    Seeded from JOBS_QUEUES by `jobs.queuecontrol.sync`; staff may edit it in the
    admin. `declared` is the JOBS_QUEUES entry last applied, so a restart applies
    only what the deployment changed and keeps staff edits (decision D52).
    `rate_starts` holds the claim times (the history's `at`) of the latest starts
    within the rate's period: the sliding window the claim counts against.
    """

    name = models.CharField(max_length=100, primary_key=True)
    paused = models.BooleanField(default=False)
    concurrency = models.IntegerField(
        null=True, blank=True, help_text="Most jobs processing at once across all workers."
    )
    rate_limit = models.IntegerField(
        null=True, blank=True, help_text="Most job starts per rate period across all workers."
    )
    rate_period = models.IntegerField(
        null=True,
        blank=True,
        choices=[(1, "second"), (60, "minute"), (3600, "hour")],
        help_text="Seconds.",
    )
    weight = models.FloatField(
        null=True,
        blank=True,
        help_text="Polling weight for workers serving several queues without a weight of "
        "their own for it (runworker --queues a:4 wins).",
    )
    # A database default too: workers of the previous release insert rows without it
    # during a rolling deploy.
    fair = models.BooleanField(
        default=False,
        db_default=False,
        help_text="Claims take turns between the clients with due work.",
    )
    key_concurrency = models.IntegerField(
        null=True,
        blank=True,
        help_text="Most jobs with one concurrency key processing at once across all workers.",
    )
    key_rate_limit = models.IntegerField(
        null=True,
        blank=True,
        help_text="Most starts of one concurrency key per key rate period (throttle: the "
        "others wait).",
    )
    key_rate_period = models.IntegerField(null=True, blank=True, help_text="Seconds.")
    rate_starts = ArrayField(models.DateTimeField(), default=list, blank=True)
    declared = models.JSONField(default=dict, blank=True)
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "jobs_queue"
        ordering = ["name"]
        permissions = [("pause_queue", "Can pause and resume queues")]
        constraints = [
            models.CheckConstraint(
                name="queue_concurrency_positive",
                condition=Q(concurrency__isnull=True) | Q(concurrency__gte=1),
            ),
            models.CheckConstraint(
                name="queue_rate_complete",
                # Both or neither (a NULL in `IN (...)` would pass a CHECK: say it).
                condition=Q(rate_limit__isnull=True, rate_period__isnull=True)
                | Q(
                    rate_limit__isnull=False,
                    rate_period__isnull=False,
                    rate_limit__gte=1,
                    rate_limit__lte=1000,
                    rate_period__in=[1, 60, 3600],
                ),
            ),
            models.CheckConstraint(
                name="queue_weight_range",
                condition=Q(weight__isnull=True) | Q(weight__gt=0, weight__lte=1000),
            ),
            models.CheckConstraint(
                name="queue_key_concurrency_positive",
                condition=Q(key_concurrency__isnull=True) | Q(key_concurrency__gte=1),
            ),
            models.CheckConstraint(
                name="queue_key_rate_complete",
                condition=Q(key_rate_limit__isnull=True, key_rate_period__isnull=True)
                | Q(
                    key_rate_limit__isnull=False,
                    key_rate_period__isnull=False,
                    key_rate_limit__gte=1,
                    key_rate_limit__lte=1000,
                    key_rate_period__gte=1,
                    key_rate_period__lte=86400,
                ),
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def limited(self) -> bool:
        """Claims need the queue's lock: a cap or a rate to count against."""
        return (
            self.concurrency is not None
            or self.rate_limit is not None
            or self.key_concurrency is not None
            or self.key_rate_limit is not None
        )


# --- flow control per key (jobs.flow, docs/queue-controls.md) ----------------------


class KeyHit(models.Model):
    """One start (`scope` "start": a queue's `key_rate`) or one accepted submission
    (`scope` "submit": a submission's `rate_limit`) of a concurrency key, at the
    database's time. Written in the transaction of the claim or submission it counts,
    so a rollback uncounts it; rows older than their window are pruned as they go."""

    scope = models.CharField(max_length=10)
    queue = models.CharField(max_length=100)
    client_key = models.BigIntegerField(help_text="The client's id; 0 for jobs from code.")
    key = models.CharField(max_length=200)
    at = models.DateTimeField()

    class Meta:
        db_table = "jobs_keyhit"
        indexes = [
            models.Index(
                name="keyhit_window_idx", fields=["scope", "queue", "client_key", "key", "at"]
            ),
            models.Index(name="keyhit_prune_idx", fields=["scope", "queue", "at"]),
        ]

    def __str__(self) -> str:
        return f"{self.scope} {self.queue}/{self.client_key}/{self.key} at {self.at}"


class Debounce(models.Model):
    """The job a debounce key gathers submissions into while it has not started:
    its row is the lock concurrent submissions of the key take in turn."""

    client_key = models.BigIntegerField(help_text="The client's id; 0 for jobs from code.")
    key = models.CharField(max_length=200)
    job_id = models.BigIntegerField(null=True, blank=True)
    first_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "jobs_debounce"
        constraints = [
            models.UniqueConstraint(name="debounce_key_unique", fields=["client_key", "key"])
        ]

    def __str__(self) -> str:
        return f"debounce {self.client_key}/{self.key} → job {self.job_id}"


class CatchUp(models.TextChoices):
    SKIP = "skip"  # after downtime, only the latest missed slot
    ALL = "all"  # every missed slot, up to JOBS_SCHEDULE_CATCH_UP_MAX


class Overlap(models.TextChoices):
    ALLOW = "allow"
    SKIP = "skip"  # no new run while the previous one is queued or processing


class Origin(models.TextChoices):
    API = "api"
    CODE = "code"  # @periodic: synced from the task registry
    ADMIN = "admin"


class Schedule(models.Model):
    """A periodic job: a cron expression or an interval, in a time zone (docs/schedules.md).

    Fired by every runreaper (jobs.schedules.scheduler); a slot makes its job only
    through the SchedulerRun row it inserts first, so any number of replicas fire it once.
    """

    CatchUp = CatchUp
    Overlap = Overlap
    Origin = Origin

    id = models.BigAutoField(primary_key=True)
    client = models.ForeignKey(
        Client, null=True, blank=True, on_delete=models.PROTECT, related_name="schedules"
    )
    name = models.CharField(max_length=200)
    origin = models.CharField(max_length=10, choices=Origin.choices, default=Origin.ADMIN)
    cron = models.CharField(max_length=200, null=True, blank=True)
    interval_seconds = models.IntegerField(null=True, blank=True)
    timezone = models.CharField(max_length=64, default="UTC")
    task = models.CharField(max_length=200)
    payload = models.JSONField(default=dict, blank=True)
    queue = models.CharField(max_length=100, default="default")
    priority = models.SmallIntegerField(default=0)
    max_retries = models.IntegerField(null=True, blank=True)
    concurrency_key = models.CharField(max_length=200, null=True, blank=True)
    # The attempt timeout of the jobs it makes (seconds); NULL: the task's or the default.
    timeout = models.FloatField(null=True, blank=True)
    # The trace it was created in, as a link for the jobs it fires (jobs.observability,
    # D306): "~" then traceparent[\ntracestate]; NULL outside a trace.
    trace_context = models.CharField(max_length=600, null=True, blank=True, editable=False)
    enabled = models.BooleanField(default=True)
    catch_up = models.CharField(max_length=10, choices=CatchUp.choices, default=CatchUp.SKIP)
    overlap = models.CharField(max_length=10, choices=Overlap.choices, default=Overlap.ALLOW)
    next_fire_at = models.DateTimeField(null=True, blank=True)
    last_fire_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "jobs_schedule"
        ordering = ["name", "id"]
        permissions = [("run_schedule", "Can run a schedule now")]
        constraints = [
            models.UniqueConstraint(
                name="schedule_name_per_client", fields=["client", "name"], nulls_distinct=False
            ),
            models.CheckConstraint(
                name="schedule_cron_xor_interval",
                condition=(Q(cron__isnull=False) & Q(interval_seconds__isnull=True))
                | (Q(cron__isnull=True) & Q(interval_seconds__isnull=False)),
            ),
            models.CheckConstraint(
                name="schedule_interval_positive",
                condition=Q(interval_seconds__isnull=True) | Q(interval_seconds__gte=1),
            ),
            models.CheckConstraint(
                name="schedule_catch_up_valid", condition=Q(catch_up__in=CatchUp.values)
            ),
            models.CheckConstraint(
                name="schedule_overlap_valid", condition=Q(overlap__in=Overlap.values)
            ),
            models.CheckConstraint(
                name="schedule_enabled_has_next",
                condition=Q(enabled=False) | Q(next_fire_at__isnull=False),
            ),
        ]
        indexes = [
            models.Index(
                name="schedule_due_idx", fields=["next_fire_at"], condition=Q(enabled=True)
            )
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def every(self) -> str:
        return self.cron if self.cron else f"every {self.interval_seconds}s"


class SchedulerRun(models.Model):
    """One slot of a schedule, claimed by whichever scheduler inserted it first.

    The job exists only if this row does (same transaction); `job_id` is NULL for a
    slot skipped because the previous run was still live (overlap `skip`). No foreign
    key to the job: retention deletes finished jobs, the runs stay as the record.
    """

    id = models.BigAutoField(primary_key=True)
    schedule = models.ForeignKey(Schedule, on_delete=models.CASCADE, related_name="runs")
    fire_time = models.DateTimeField()
    job_id = models.BigIntegerField(null=True, blank=True)
    manual = models.BooleanField(default=False, help_text="Run now, by staff.")
    fired_by = models.CharField(max_length=250, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "scheduler_runs"
        ordering = ["schedule_id", "fire_time"]
        constraints = [
            models.UniqueConstraint(name="scheduler_run_slot", fields=["schedule", "fire_time"])
        ]

    def __str__(self) -> str:
        return f"{self.schedule_id} @ {self.fire_time:%Y-%m-%d %H:%M:%S}"


class JobPart(models.Model):
    """A row kept for one job and pruned with it (no database foreign key: jobs_job is
    large and history-heavy). `label` names the field that identifies it in the job."""

    id = models.BigAutoField(primary_key=True)
    created_at = models.DateTimeField(db_default=Now())
    label = "id"

    class Meta:
        abstract = True
        ordering = ["job_id", "id"]

    def __str__(self) -> str:
        return f"{self.job_id}: {getattr(self, self.label)}"


def _job_part_fk(related_name: str, db_index: bool = True) -> models.ForeignKey:
    return models.ForeignKey(
        Job,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name=related_name,
        db_index=db_index,
    )


class JobStep(JobPart):
    """A committed step of a durable job (`ctx.step`): its JSON result, written under
    the job's fence, returned instead of running the step again on a later attempt.
    Steps whose name starts with "~" are the job's own waits (sleep, signal)."""

    # No index of its own: the unique (job, name) serves every look-up by job, and a
    # checkpoint writes one index entry fewer (D369).
    job = _job_part_fk("steps", db_index=False)
    name = models.CharField(max_length=200)
    result = models.JSONField(null=True, blank=True)
    lease_version = models.BigIntegerField(help_text="The lease the checkpoint was written under.")
    worker_id = models.CharField(max_length=200)
    label = "name"

    class Meta(JobPart.Meta):
        db_table = "jobs_jobstep"
        constraints = [
            models.UniqueConstraint(name="jobstep_job_name_uniq", fields=["job", "name"]),
        ]


class JobSignal(JobPart):
    """A signal delivered to a job (`POST /jobs/<id>/signal/`, `jobs.signals`): kept
    until the job's `wait_for_signal(key)` consumes it, one per (job, key)."""

    job = _job_part_fk("signals")
    key = models.CharField(max_length=200)
    payload = models.JSONField(null=True, blank=True)
    sent_by = models.CharField(max_length=250, blank=True, default="")
    label = "key"

    class Meta(JobPart.Meta):
        db_table = "jobs_jobsignal"
        constraints = [
            models.UniqueConstraint(name="jobsignal_job_key_uniq", fields=["job", "key"]),
        ]


class OnFailure(models.TextChoices):
    FAIL_DEPENDENTS = "fail_dependents"
    CONTINUE = "continue"


class Workflow(models.Model):
    """A graph of jobs created together (jobs.workflows). `finished_at` is set by the
    database when its last job ends."""

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=200)
    on_failure = models.CharField(
        max_length=20, choices=OnFailure.choices, default=OnFailure.FAIL_DEPENDENTS
    )
    client = models.ForeignKey(
        Client, null=True, blank=True, on_delete=models.PROTECT, related_name="workflows"
    )
    unfinished = models.IntegerField(default=0, help_text="Jobs that have not ended yet.")
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)
    request_hash = models.CharField(max_length=64, null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "jobs_workflow"
        ordering = ["-id"]
        constraints = [
            models.CheckConstraint(
                name="workflow_on_failure_valid", condition=Q(on_failure__in=OnFailure.values)
            ),
            models.UniqueConstraint(
                name="workflow_idempotency_key_per_client",
                fields=["client", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                nulls_distinct=False,
            ),
        ]
        indexes = [
            models.Index(
                name="workflow_running_idx", fields=["id"], condition=Q(finished_at__isnull=True)
            )
        ]

    def __str__(self) -> str:
        return f"workflow {self.id} {self.name}"


class WorkflowNode(models.Model):
    """A job's place in its workflow: the caller's step id and how many of its
    parents have not ended yet (the database counts them down as parents end)."""

    job = models.OneToOneField(
        Job, primary_key=True, on_delete=models.DO_NOTHING, db_constraint=False,
        related_name="workflow_node",
    )  # fmt: skip
    workflow = models.ForeignKey(
        Workflow, on_delete=models.DO_NOTHING, db_constraint=False, related_name="nodes"
    )
    key = models.CharField(max_length=200)
    pending_parents = models.IntegerField(default=0)
    ended = models.BooleanField(default=False, db_default=False)

    class Meta:
        db_table = "jobs_workflownode"
        ordering = ["workflow_id", "job_id"]
        constraints = [
            models.UniqueConstraint(name="workflownode_key_uniq", fields=["workflow", "key"]),
            models.CheckConstraint(
                name="workflownode_pending_nonneg", condition=Q(pending_parents__gte=0)
            ),
        ]

    def __str__(self) -> str:
        return f"{self.workflow_id}/{self.key}: job {self.job_id}"


class JobDependency(models.Model):
    """child runs after parent has ended (done, or failed under on_failure=continue)."""

    id = models.BigAutoField(primary_key=True)
    child = models.ForeignKey(
        Job, on_delete=models.DO_NOTHING, db_constraint=False, related_name="parent_links"
    )
    parent = models.ForeignKey(
        Job, on_delete=models.DO_NOTHING, db_constraint=False, related_name="child_links"
    )

    class Meta:
        db_table = "jobs_jobdependency"
        constraints = [
            models.UniqueConstraint(name="jobdependency_uniq", fields=["child", "parent"]),
        ]
        indexes = [models.Index(name="jobdependency_parent_idx", fields=["parent"])]

    def __str__(self) -> str:
        return f"{self.parent_id} → {self.child_id}"


# --- completion events and the outbox (docs/events.md) ---------------------------------


class CircuitState(models.TextChoices):
    """A webhook endpoint's circuit breaker (jobs.events.circuit)."""

    CLOSED = "closed"  # deliveries go out
    OPEN = "open"  # deferred without a network attempt until circuit_open_until
    HALF_OPEN = "half_open"  # one probe delivery is out; the rest wait for its answer


class Webhook(models.Model):
    """A client's endpoint for its jobs' lifecycle events. The signing secret is not
    stored: it is derived from `secret_salt` and JOBS_WEBHOOK_KEY (jobs.events.signing),
    so a read of this table alone cannot forge a signature."""

    client = models.ForeignKey(Client, on_delete=models.CASCADE, related_name="webhooks")
    url = models.URLField(max_length=2000)
    events = ArrayField(models.CharField(max_length=40))
    enabled = models.BooleanField(default=True)
    secret_salt = models.CharField(max_length=64)
    disabled_reason = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())
    # Ids, not times: an event whose id was drawn before the webhook was created is not
    # its to receive, every later one is (D194).
    after_event_id = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="The last history id drawn when it was created: it gets the events after "
        "it (empty: created before this was noted, every event the outbox dispatches).",
    )
    # The circuit breaker, written by delivery attempts under their job's fence.
    circuit_state = models.CharField(
        max_length=10, choices=CircuitState.choices, db_default=CircuitState.CLOSED
    )
    circuit_failures = models.IntegerField(
        db_default=0, help_text="Failed attempts in a row (reset by an answer)."
    )
    circuit_open_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Open: deliveries wait until then; half open: the probe's deadline.",
    )

    class Meta:
        db_table = "jobs_webhook"
        ordering = ["id"]
        indexes = [models.Index(name="webhook_client_idx", fields=["client", "id"])]
        constraints = [
            models.CheckConstraint(name="webhook_has_events", condition=~Q(events=[])),
            models.CheckConstraint(
                name="webhook_circuit_state_valid",
                condition=Q(circuit_state__in=CircuitState.values),
            ),
        ]

    def __str__(self) -> str:
        return f"webhook {self.id} {self.url}"


class WebhookDelivery(models.Model):
    """One event for one webhook. `job` is the delivery job (its status is the
    delivery's: done = delivered, failed = dead letter); NULL while the delivery
    waits for an earlier event of the same job to the same endpoint (seq order)."""

    id = models.BigAutoField(primary_key=True)
    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    event_id = models.BigIntegerField(help_text="The jobs_jobevent row (the message id).")
    source_job_id = models.BigIntegerField()
    seq = models.IntegerField()
    type = models.CharField(max_length=40)
    body = models.TextField(help_text="The signed JSON, the same on every attempt.")
    job = models.OneToOneField(
        Job,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="webhook_delivery",
    )
    attempts = models.IntegerField(default=0)
    last_status_code = models.IntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True, default="")
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "jobs_webhookdelivery"
        ordering = ["-id"]
        verbose_name_plural = "webhook deliveries"
        permissions = [("redeliver_webhookdelivery", "Can redeliver failed webhook deliveries")]
        constraints = [
            models.UniqueConstraint(name="delivery_once_per_event", fields=["webhook", "event_id"]),
        ]
        indexes = [
            models.Index(name="delivery_chain_idx", fields=["webhook", "source_job_id", "seq"]),
            # Waiting deliveries only: what a full webhooks queue held back (D110).
            models.Index(
                name="delivery_waiting_idx",
                fields=["webhook", "source_job_id", "seq", "id"],
                condition=models.Q(job__isnull=True),
            ),
        ]

    def __str__(self) -> str:
        return f"delivery {self.id}: {self.type} of job {self.source_job_id} (seq {self.seq})"


class OutboxCursor(models.Model):
    """How far one outbox subscriber got, moved in the transaction of its work.

    `last_id` is the last history row handled. Ids are taken before their
    transactions commit, so rows past `horizon_id` may still appear: the
    dispatcher reads only up to a horizon whose snapshot's in-progress
    transactions have all ended (jobs.events.outbox)."""

    name = models.CharField(max_length=50, primary_key=True)
    last_id = models.BigIntegerField(default=0)
    horizon_id = models.BigIntegerField(null=True, blank=True)
    horizon_snapshot = models.TextField(null=True, blank=True)
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "jobs_outboxcursor"

    def __str__(self) -> str:
        return f"{self.name} at {self.last_id}"


class DomainEvent(models.Model):
    """An application event written by `jobs.events.publish` in the caller's
    transaction; each subscriber got its job in the same transaction."""

    id = models.BigAutoField(primary_key=True)
    type = models.CharField(max_length=200)
    payload = models.JSONField(default=dict)
    at = models.DateTimeField(db_default=Now())
    # The Kafka message key its publisher chose (None: the event id).
    key = models.CharField(max_length=255, null=True, blank=True)

    class Meta:
        db_table = "jobs_domainevent"
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.type} {self.id}"


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


class Sequence(models.Model):
    """One sequence key of one client (jobs.flow.sequences): the job allowed to run now,
    or the failed job that halted it. Written by the database triggers (jobs.flow.triggers)
    and by staff's resume and skip; its row lock orders the sequence's submissions."""

    id = models.BigAutoField(primary_key=True)
    owner = models.IntegerField(help_text="The client's id; 0 for the project's own jobs.")
    key = models.CharField(max_length=200)
    active_job_id = models.BigIntegerField(
        null=True, blank=True, help_text="The job whose turn it is (queued or processing)."
    )
    halted_job_id = models.BigIntegerField(
        null=True, blank=True, help_text="The failed job that halted the sequence."
    )
    halted_at = models.DateTimeField(null=True, blank=True)
    last_position = models.BigIntegerField(default=0, db_default=0)
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "jobs_sequence"
        ordering = ["owner", "key"]
        constraints = [
            models.UniqueConstraint(name="sequence_owner_key_uniq", fields=["owner", "key"]),
        ]

    def __str__(self) -> str:
        return f"sequence {self.key}"


class SequenceWait(models.Model):
    """A job waiting its turn in a sequence, in submission order (`position`)."""

    id = models.BigAutoField(primary_key=True)
    sequence = models.ForeignKey(
        Sequence, on_delete=models.DO_NOTHING, db_constraint=False, related_name="waits"
    )
    position = models.BigIntegerField()
    job_id = models.BigIntegerField()

    class Meta:
        db_table = "jobs_sequencewait"
        ordering = ["sequence_id", "position"]
        constraints = [
            models.UniqueConstraint(
                name="sequencewait_position_uniq", fields=["sequence", "position"]
            ),
        ]

    def __str__(self) -> str:
        return f"{self.sequence_id}#{self.position}: job {self.job_id}"


class Batch(models.Model):
    """Jobs submitted together whose callbacks run once the last of them ends
    (jobs.flow.batches). The database counts the ends (jobs.flow.triggers)."""

    id = models.BigAutoField(primary_key=True)
    client = models.ForeignKey(
        Client, null=True, blank=True, on_delete=models.PROTECT, related_name="batches"
    )
    name = models.CharField(max_length=200, blank=True, default="")
    total = models.IntegerField(default=0)
    pending = models.IntegerField(default=0, help_text="Jobs that have not ended yet.")
    succeeded = models.IntegerField(default=0)
    failed = models.IntegerField(default=0)
    callbacks = models.JSONField(
        default=dict, help_text="on_complete / on_success / on_failure: the job each makes."
    )
    callback_job_ids = ArrayField(models.BigIntegerField(), null=True, blank=True)
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)
    request_hash = models.CharField(max_length=64, null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "jobs_batch"
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                name="batch_idempotency_key_per_client",
                fields=["client", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                nulls_distinct=False,
            ),
        ]
        indexes = [
            models.Index(
                name="batch_running_idx", fields=["id"], condition=Q(finished_at__isnull=True)
            )
        ]

    def __str__(self) -> str:
        return f"batch {self.id} {self.name}".rstrip()


class BatchFailure(models.Model):
    """A job of a batch that failed: the failed ids its callbacks receive, without a
    scan of jobs_job (one row per failure, removed again by a staff retry)."""

    id = models.BigAutoField(primary_key=True)
    batch = models.ForeignKey(
        Batch, on_delete=models.DO_NOTHING, db_constraint=False, related_name="failures"
    )
    job_id = models.BigIntegerField()

    class Meta:
        db_table = "jobs_batchfailure"
        constraints = [
            models.UniqueConstraint(name="batchfailure_uniq", fields=["batch", "job_id"]),
        ]

    def __str__(self) -> str:
        return f"batch {self.batch_id}: job {self.job_id} failed"
