from django.apps import AppConfig
from django.db.models.signals import post_migrate


def _schema_is_current(model_name: str, state_apps) -> bool:
    """Whether the tables `migrate` left match the code's model: not when it migrated back
    past the table's migration, nor to a migration before one of the model's columns."""
    from django.apps import apps as code_apps

    try:
        then = state_apps.get_model("jobs", model_name)
    except LookupError:
        return False
    now = code_apps.get_model("jobs", model_name)
    have = {f.column for f in then._meta.concrete_fields}
    return all(f.column in have for f in now._meta.concrete_fields)


def _sync_queues(sender, using="default", apps=None, **kwargs) -> None:
    """`migrate` seeds the Queue rows from JOBS_QUEUES (runworker syncs them again)."""
    from jobs import queuecontrol

    if apps is None or _schema_is_current("Queue", apps):
        queuecontrol.sync(using=using)


def _sync_periodic(sender, using="default", apps=None, **kwargs) -> None:
    """`@periodic` declarations reach the table at migrate (and when a runreaper starts)."""
    from jobs.schedules.define import sync_periodic

    if apps is None or _schema_is_current("Schedule", apps):
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
