"""The Django Tasks API, from wherever this Django provides it.

Django 6.0 ships it as `django.tasks`; on Django 5.2 the `django-tasks` package
backports the same API as `django_tasks`. Everything in jobservice imports it
from here, so upgrading to Django 6 changes nothing in this project (drop the
`django-tasks` dependency and the `django_tasks` entry of INSTALLED_APPS).

Importing it registers the framework's system check of TASKS, which otherwise runs only
once something has imported `django.tasks` (Django 6) or with `django_tasks` in
INSTALLED_APPS (the backport): `JobsConfig.ready()` imports it, so a bad TASKS fails
`check` in every host.
"""

from __future__ import annotations

try:  # Django >= 6.0 (importing django.tasks registers its check)
    from django.tasks import DEFAULT_TASK_QUEUE_NAME, task, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
    from django.tasks.exceptions import InvalidTask as InvalidTaskError
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
except ImportError:  # Django 5.2 with the django-tasks backport
    try:
        from django_tasks import DEFAULT_TASK_QUEUE_NAME, task, task_backends
    except ImportError as exc:
        from jobs.extras import EXTRAS

        raise ImportError(EXTRAS["tasks-backport"].message()) from exc
    import django_tasks.checks  # noqa: F401  (registers the check of TASKS)
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued, task_finished, task_started

__all__ = [
    "DEFAULT_TASK_QUEUE_NAME",
    "BaseTaskBackend",
    "InvalidTaskError",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "task",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]
