from django.apps import AppConfig
from django.db.models.signals import post_migrate


def _sync_periodic(sender, **kwargs) -> None:
    """`@periodic` declarations reach the table at migrate (and when a runreaper starts)."""
    from django.db import connections

    from jobs.schedules.define import sync_periodic

    using = kwargs.get("using", "default")
    if "jobs_schedule" in connections[using].introspection.table_names():  # else migrated back
        sync_periodic()


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from jobs import clientcache  # noqa: F401  (connects the cache's revocation signals)

        post_migrate.connect(_sync_periodic, sender=self)
