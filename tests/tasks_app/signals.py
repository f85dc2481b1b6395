"""Receivers of the framework's signals: with TASKS_APP_SIGNAL_LOG set (the e2e tests
set it for runworker), each signal appends one JSON line to that file."""

from __future__ import annotations

import json
import os

from django.dispatch import receiver

from jobs.tasks_compat import task_enqueued, task_finished, task_started


def _write(name: str, task_result) -> None:
    path = os.environ.get("TASKS_APP_SIGNAL_LOG")
    if not path:
        return
    line = {
        "signal": name,
        "id": task_result.id,
        "task": task_result.task.module_path,
        "status": str(task_result.status),
        "errors": [e.exception_class_path for e in task_result.errors],
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


@receiver(task_enqueued)
def on_enqueued(sender, task_result, **kwargs) -> None:
    _write("enqueued", task_result)


@receiver(task_started)
def on_started(sender, task_result, **kwargs) -> None:
    _write("started", task_result)


@receiver(task_finished)
def on_finished(sender, task_result, **kwargs) -> None:
    _write("finished", task_result)
