"""A declared queue's controls and the worker processes that serve the queues: what the
claim reads before it takes a job. Written by JOBS_QUEUES, staff and the workers
themselves (jobs.queuecontrol, jobs.presence), never by a job's writes; neither table
points at a job or a client."""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now


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
