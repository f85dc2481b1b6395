"""What a job keeps beyond its row and the graphs jobs run in: a durable job's committed
steps and delivered signals (jobs.durable, jobs.signals), workflows and their
dependencies (jobs.workflows). Each row hangs off a job without a database foreign key
(jobs_job is large and history-heavy) and is pruned with it."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from jobs.models.jobs import Client, Job


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

    job = _job_part_fk("signals", db_index=False)  # jobsignal_job_key_uniq leads with it (D406)
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
    # workflownode_key_uniq leads with it (D406).
    workflow = models.ForeignKey(
        Workflow,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="nodes",
        db_index=False,
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
    # Indexed by jobdependency_uniq (child first) and jobdependency_parent_idx (D406).
    child = models.ForeignKey(
        Job, on_delete=models.DO_NOTHING, db_constraint=False, related_name="parent_links",
        db_index=False,
    )  # fmt: skip
    parent = models.ForeignKey(
        Job, on_delete=models.DO_NOTHING, db_constraint=False, related_name="child_links",
        db_index=False,
    )  # fmt: skip

    class Meta:
        db_table = "jobs_jobdependency"
        constraints = [
            models.UniqueConstraint(name="jobdependency_uniq", fields=["child", "parent"]),
        ]
        indexes = [models.Index(name="jobdependency_parent_idx", fields=["parent"])]

    def __str__(self) -> str:
        return f"{self.parent_id} → {self.child_id}"
