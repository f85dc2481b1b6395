"""The Kafka key a publisher may choose for a domain event.

Safe on a live table: a nullable column without a default is a catalog change only
(no rewrite, a brief ACCESS EXCLUSIVE lock)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0017_fair_share_concurrency_keys"),
    ]

    operations = [
        migrations.AddField(
            model_name="domainevent",
            name="key",
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
    ]
