"""A circuit breaker per webhook endpoint (issue 27).

Columns with constant defaults or none (PostgreSQL stores the default in the catalog:
no rewrite), and a check on the new column, which every existing row passes at its
default; jobs_webhook holds one row per endpoint, so the check's scan is short.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0014_job_started_at"),
    ]

    operations = [
        migrations.AddField(
            model_name="webhook",
            name="circuit_failures",
            field=models.IntegerField(
                db_default=0, help_text="Failed attempts in a row (reset by an answer)."
            ),
        ),
        migrations.AddField(
            model_name="webhook",
            name="circuit_open_until",
            field=models.DateTimeField(
                blank=True,
                help_text="Open: deliveries wait until then; half open: the probe's deadline.",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="webhook",
            name="circuit_state",
            field=models.CharField(
                choices=[("closed", "Closed"), ("open", "Open"), ("half_open", "Half Open")],
                db_default="closed",
                max_length=10,
            ),
        ),
        migrations.AddConstraint(
            model_name="webhook",
            constraint=models.CheckConstraint(
                condition=models.Q(("circuit_state__in", ["closed", "open", "half_open"])),
                name="webhook_circuit_state_valid",
            ),
        ),
    ]
