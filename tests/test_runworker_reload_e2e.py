"""runworker --reload: a real worker process, a real edit of its task module. The next
job runs the new code, and the job in flight when the file changed is released by the
warm stop and run again by the new worker with no retry charged (D229)."""

from __future__ import annotations

import os
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from jobs import services
from jobs.models import Job, JobEvent
from tests.harness import wait_until

pytestmark = pytest.mark.timeout(180)

TASKS = """
import time
from pathlib import Path

from jobs.tasks import task

VALUE = {value}


@task("reload.value")
def value(payload, ctx):
    return VALUE


@task("reload.hold")
def hold(payload, ctx):
    gate = Path(payload["gate"])
    deadline = time.monotonic() + 60
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return VALUE
"""


def _done(job_id: int):
    job = Job.objects.get(pk=job_id)
    return job if job.status in ("done", "failed") else None


def test_reload_runs_the_edited_task_and_charges_no_retry(stack, tmp_path):
    module = tmp_path / "mods" / "reload_tasks.py"
    module.parent.mkdir()
    module.write_text(TASKS.format(value=5))
    gate = tmp_path / "gate"
    worker = stack.worker(
        "--reload", "--queues", "default", "--grace", "1", "--poll-interval", "0.2",
        ready=True, DEBUG="1", JOBS_TASK_MODULES="reload_tasks",
        PYTHONPATH=os.pathsep.join([str(module.parent), os.environ.get("PYTHONPATH", "")]),
    )  # fmt: skip
    first, _ = services.submit(task="reload.value")
    assert wait_until(lambda: _done(first.pk), 30, "the first job").result == 5

    held, _ = services.submit(task="reload.hold", payload={"gate": str(gate)})
    wait_until(lambda: Job.objects.get(pk=held.pk).started_at, 30, "the held job to start")
    edits = 0

    def reloading() -> bool:
        # Written again until the reloader has seen it change (its first look at the
        # file may come after a write: that write is then its baseline).
        nonlocal edits
        if "changed: stopping the worker warm" in worker.output():
            return True
        edits += 1
        module.write_text(TASKS.format(value=6) + f"\n# edit {edits}\n")
        return False

    wait_until(reloading, 30, "the reloader to see the edit", interval=1.5)
    wait_until(lambda: worker.output().count("worker started") >= 2, 60, "the new worker")
    assert worker.alive()

    second, _ = services.submit(task="reload.value")
    assert wait_until(lambda: _done(second.pk), 30, "the job after the edit").result == 6

    gate.touch()
    job = wait_until(lambda: _done(held.pk), 30, "the held job")
    assert (job.status, job.retry_count, job.result) == ("done", 0, 6)  # run by the new code
    events = list(JobEvent.objects.filter(job_id=held.pk).values_list("to_status", flat=True))
    assert "failed" not in events and events.count("processing") == 2, events


@pytest.mark.django_db(transaction=True)
def test_reload_is_refused_with_debug_off_unless_forced(settings):
    settings.DEBUG = False
    with pytest.raises(CommandError, match="--force-reload"):
        call_command("runworker", reload=True, stdout=StringIO())
    with pytest.raises(CommandError, match="applies to --reload only"):
        call_command("runworker", force_reload=True, stdout=StringIO())
    settings.DEBUG = True
    with pytest.raises(CommandError, match="not with --burst"):
        call_command("runworker", reload=True, burst=True, stdout=StringIO())
