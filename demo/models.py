"""An example application table written by jobs, to show exactly-once effects."""

from django.db import models
from django.db.models.functions import Now


class Effect(models.Model):
    """One row per committed run of a `demo.record` job. Written inside the job's
    fenced completion, so a stale worker's row rolls back with its result."""

    job_id = models.BigIntegerField(db_index=True)
    lease_version = models.BigIntegerField()
    worker_id = models.CharField(max_length=200)
    created_at = models.DateTimeField(db_default=Now())

    def __str__(self) -> str:
        return f"effect of job {self.job_id} at lease {self.lease_version}"
