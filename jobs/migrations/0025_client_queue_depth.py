# A client's share of a queue's depth (jobs.submission, D198): one nullable column on the
# small jobs_client table, no rewrite and no default to fill; NULL takes the setting.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0024_outbox_from_start"),
    ]

    operations = [
        migrations.AddField(
            model_name="client",
            name="max_queue_depth",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="Queued jobs (parked ones too) it may hold in one queue; "
                "empty: JOBS_MAX_CLIENT_QUEUE_DEPTH.",
                null=True,
            ),
        ),
    ]
