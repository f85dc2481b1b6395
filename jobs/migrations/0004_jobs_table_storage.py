"""Storage settings that keep jobs_job healthy under constant updates.

Every status change rewrites the row outside HOT (status is an index key and the
partial indexes' predicate), so each job leaves about two dead tuples and two sets
of dead index entries behind. The defaults (vacuum after 20 % of the table is dead)
would let a 10-million-row table accumulate two million dead rows before vacuum
starts; here vacuum and analyze start after 2 % / 1 % and are allowed to work
about ten times faster. fillfactor 70 leaves room on each page so a row's new
version lands on its own page (HOT when no indexed column changes, and cheaper
index maintenance otherwise). Only pages written after this migration use it.
See docs/operations.md "Scaling and deployment" for the reasoning and measured figures.
"""

from django.db import migrations

STORAGE = {
    "fillfactor": "70",
    "autovacuum_vacuum_scale_factor": "0.02",
    "autovacuum_analyze_scale_factor": "0.01",
    "autovacuum_vacuum_cost_limit": "2000",
}

FORWARD = "ALTER TABLE jobs_job SET ({});".format(
    ", ".join(f"{k} = {v}" for k, v in STORAGE.items())
)
REVERSE = "ALTER TABLE jobs_job RESET ({});".format(", ".join(STORAGE))


class Migration(migrations.Migration):
    dependencies = [("jobs", "0003_job_staff_permissions")]

    operations = [migrations.RunSQL(FORWARD, reverse_sql=REVERSE)]
