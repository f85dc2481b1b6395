"""The Django Tasks API, from wherever this Django provides it.

Django 6.0 ships it as `django.tasks`; on Django 5.2 the `django-tasks` package
backports the same API as `django_tasks`. Everything in jobservice imports it
from here, so upgrading to Django 6 changes nothing in this project (drop the
`django-tasks` dependency and the `django_tasks` entry of INSTALLED_APPS).
"""

from __future__ import annotations

try:  # Django >= 6.0
    from django.tasks import DEFAULT_TASK_QUEUE_NAME, task, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
    from django.tasks.exceptions import InvalidTask as InvalidTaskError
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
except ImportError:  # Django 5.2 with the django-tasks backport
    from django_tasks import DEFAULT_TASK_QUEUE_NAME, task, task_backends
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
