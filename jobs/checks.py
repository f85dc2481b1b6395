"""System checks of the jobs app: a host project's misconfiguration, each with a hint.

Registered by `JobsConfig.ready()`. `migrate`, `runworker` and `check` stop on an error
with the message and the hint, never with a traceback from deep inside the app.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.apps import apps
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from jobs import extras, queues
from jobs.schedules.define import periodic_problems

# What jobs truly needs beside itself, and why. The API, admin and Tasks framework add
# theirs (docs/django.md says which).
REQUIRED_APPS = {
    "django.contrib.contenttypes": "the Job model declares permissions",
    "django.contrib.auth": "the Job model declares permissions",
    "django.contrib.postgres": "the models' ArrayField columns: Django 6 refuses them "
    "without it (postgres.E005)",
}


@checks.register(checks.Tags.compatibility)
def check_setup(app_configs: Any = None, **kwargs: Any) -> Iterable[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    try:
        queues.declared()
    except ImproperlyConfigured as exc:
        errors.append(
            checks.Error(
                str(exc),
                hint='JOBS_QUEUES maps queue names to settings, e.g. {"default": {}, '
                '"reports": {"concurrency": 2}} (docs/queue-controls.md); leave it unset '
                "for the one queue `default`.",
                id="jobs.E103",
            )
        )
    for alias, database in settings.DATABASES.items():
        engine = database.get("ENGINE", "")
        if alias == "default" and "postgresql" not in engine and "postgis" not in engine:
            errors.append(
                checks.Error(
                    f"DATABASES['default'] uses {engine or 'no ENGINE'}; jobs needs PostgreSQL",
                    hint="Set ENGINE to django.db.backends.postgresql (PostgreSQL 14 or later): "
                    "claims use SKIP LOCKED, triggers and advisory locks.",
                    id="jobs.E104",
                )
            )
    for app, why in REQUIRED_APPS.items():
        if not apps.is_installed(app):
            errors.append(
                checks.Error(
                    f"{app} is not in INSTALLED_APPS; the jobs app needs it",
                    hint=f'Add "{app}" to INSTALLED_APPS ({why}).',
                    id="jobs.E105",
                )
            )
    for extra in extras.missing_for_settings():
        errors.append(
            checks.Error(
                f"{extra.setting}, but {extra.distribution} is not installed",
                hint=f"pip install 'jobservice[{extra.name}]' ({extra.feature.lower()}).",
                id="jobs.E111",
            )
        )
    return errors


@checks.register(checks.Tags.compatibility)
def check_periodic(app_configs: Any = None, **kwargs: Any) -> Iterable[checks.CheckMessage]:
    """Each `@periodic` declaration held to the rules `migrate` syncs it by (D223)."""
    try:
        problems = periodic_problems()  # imports the task modules to find them
    except Exception as exc:  # a check reports, never a traceback (the module's own bug)
        return [
            checks.Error(
                f"importing the task modules failed: {type(exc).__name__}: {exc}",
                hint="Every process imports each installed app's `tasks` module and "
                "JOBS_TASK_MODULES: `python -c 'import <module>'` shows the traceback.",
                id="jobs.E107",
            )
        ]
    return [
        checks.Error(
            problem,
            hint="Fix the @periodic declaration: migrate writes it to the schedules table "
            "with the rules of the API (docs/schedules.md).",
            id="jobs.E106",
        )
        for problem in problems
    ]
