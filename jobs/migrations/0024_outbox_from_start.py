"""The built-in outbox subscribers' cursors exist from here on (D192), and a webhook
notes the history id it starts after (D194).

A nullable column without a default (no rewrite of jobs_webhook) and an insert into
jobs_outboxcursor that leaves existing rows alone: a deployment's cursors are never
rewound. A built-in cursor missing where others exist (`stream` on a deployment that
ran without Redis) starts where the oldest history cursor stands: the events before it
were written when it was no subscriber. With no cursor at all (a new database, or one
whose dispatcher never ran) both start at the beginning.
"""

from django.db import migrations, models

SEED_BUILT_IN_CURSORS_SQL = """
INSERT INTO jobs_outboxcursor (name, last_id, updated_at)
SELECT name, COALESCE((SELECT min(last_id) FROM jobs_outboxcursor
                       WHERE name NOT LIKE '%.domain'), 0), now()
FROM unnest(ARRAY['webhooks', 'stream']) AS built_in(name)
ON CONFLICT (name) DO NOTHING
"""


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0023_archive_periods"),
    ]

    operations = [
        migrations.AddField(
            model_name="webhook",
            name="after_event_id",
            field=models.BigIntegerField(
                blank=True,
                help_text="The last history id drawn when it was created: it gets the events "
                "after it (empty: created before this was noted, every event the outbox "
                "dispatches).",
                null=True,
            ),
        ),
        # Reversed: the cursors stay (removing them would lose the positions).
        migrations.RunSQL(SEED_BUILT_IN_CURSORS_SQL, migrations.RunSQL.noop),
    ]
