"""Periodic jobs (docs/schedules.md): a schedule's definition and the scheduler_runs row
each slot inserts before its job, so any number of schedulers fire a slot once
(jobs.schedules). Jobs point back at a schedule by id only (D57)."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from jobs.models.jobs import Client


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
    # schedule_name_per_client leads with it (D406).
    client = models.ForeignKey(
        Client, null=True, blank=True, on_delete=models.PROTECT, related_name="schedules",
        db_index=False,
    )  # fmt: skip
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
