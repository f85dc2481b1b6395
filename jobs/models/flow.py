"""The tables of jobs.flow (docs/queue-controls.md): what a key counts, gathers or runs
in order (rates, debounce, sequences), and the batches whose callbacks wait for their
jobs. Written in the transaction of the claim or submission they serve and by the
database triggers of jobs.flow.triggers; none has a database foreign key to jobs_job."""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from jobs.models.jobs import Client


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
    # sequencewait_position_uniq leads with it (D406).
    sequence = models.ForeignKey(
        Sequence, on_delete=models.DO_NOTHING, db_constraint=False, related_name="waits",
        db_index=False,
    )  # fmt: skip
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
    # batchfailure_uniq leads with it (D406).
    batch = models.ForeignKey(
        Batch, on_delete=models.DO_NOTHING, db_constraint=False, related_name="failures",
        db_index=False,
    )  # fmt: skip
    job_id = models.BigIntegerField()

    class Meta:
        db_table = "jobs_batchfailure"
        constraints = [
            models.UniqueConstraint(name="batchfailure_uniq", fields=["batch", "job_id"]),
        ]

    def __str__(self) -> str:
        return f"batch {self.batch_id}: job {self.job_id} failed"
