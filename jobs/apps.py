from django.apps import AppConfig
from django.db.models.signals import post_migrate


def _sync_queues(sender, using="default", **kwargs) -> None:
    """`migrate` seeds the Queue rows from JOBS_QUEUES (runworker syncs them again)."""
    from django.db import connections

    from jobs import queuecontrol
    from jobs.models import Queue

    # Not when migrating back past the table's migration.
    if Queue._meta.db_table in connections[using].introspection.table_names():
        queuecontrol.sync(using=using)


def _sync_periodic(sender, using="default", **kwargs) -> None:
    """`@periodic` declarations reach the table at migrate (and when a runreaper starts)."""
    from django.db import connections

    from jobs.schedules.define import sync_periodic

    if "jobs_schedule" in connections[using].introspection.table_names():  # else migrated back
        sync_periodic()


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from jobs import checks, clientcache, pgtypes  # noqa: F401  (registers checks; signals)

        connection_created.connect(pgtypes.on_connection_created, dispatch_uid="jobs.pgtypes")
        try:  # the Tasks framework's checks of TASKS (jobs.E101, E102) run at `check`
            from jobs import tasks_compat  # noqa: F401
        except ImportError:  # Django 5.2 without the backport: jobs.E111 names it
            pass

        post_migrate.connect(_sync_queues, sender=self, dispatch_uid="jobs.sync_queues")
        post_migrate.connect(_sync_periodic, sender=self, dispatch_uid="jobs.sync_periodic")
