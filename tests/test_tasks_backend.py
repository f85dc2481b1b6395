"""jobservice as the Django Tasks backend, in this process against the real PostgreSQL
and Redis: enqueue, refusals, get_result, transactions, signals, the admin.
Running the tasks through runworker is in test_tasks_backend_e2e.py."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import User
from django.core import checks
from django.db import connections, transaction
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from jobs import services
from jobs.admission import clear_depth_cache
from jobs.backends import InvalidTaskArguments, JobServiceBackend, idempotency_key
from jobs.models import Job
from jobs.submission import IdempotencyConflict, QueueFull
from jobs.tasks_compat import (
    InvalidTaskError,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_backends,
    task_enqueued,
)
from jobs.transport import get_transport
from tests.tasks_app import tasks as app

TWO_QUEUES = {
    "default": {"BACKEND": "jobs.backends.JobServiceBackend", "QUEUES": ["default", "emails"]}
}
# The deployment's own allowlist of queues (JOBS_QUEUES), declaring both.
BOTH_DECLARED = {"default": {}, "emails": {}}


def redis_queue(name: str = "default") -> list[str]:
    t = get_transport()
    return [i.decode() for i in t._client.lrange(f"{t.prefix}q:{name}", 0, -1)]


def test_backend_declares_what_it_supports():
    backend = task_backends["default"]
    assert isinstance(backend, JobServiceBackend)
    assert backend.supports_defer and backend.supports_async_task
    assert backend.supports_get_result and backend.supports_priority


@pytest.mark.django_db
def test_enqueue_creates_a_queued_job_named_by_the_import_path():
    run_after = timezone.now() + timedelta(minutes=5)
    result = app.add.using(priority=-7, run_after=run_after).enqueue(2, b=3)
    job = Job.objects.get(pk=int(result.id))
    assert job.task == "tests.tasks_app.tasks.add"
    assert job.payload == {"args": [2], "kwargs": {"b": 3}, "run_after": run_after.isoformat()}
    assert (job.status, job.queue, job.priority, job.run_at) == ("queued", "default", -7, run_after)
    assert result.status == TaskResultStatus.READY
    assert (result.args, result.kwargs, result.backend) == ([2], {"b": 3}, "default")
    assert result.enqueued_at == job.created_at
    assert result.task.func is app.add.func
    assert (result.worker_ids, result.errors, result.started_at) == ([], [], None)
    with pytest.raises(ValueError, match="not finished"):
        _ = result.return_value


@pytest.mark.django_db
def test_a_result_read_back_carries_what_the_task_was_enqueued_with():
    run_after = timezone.now() + timedelta(minutes=5)
    with override_settings(TASKS=TWO_QUEUES, JOBS_QUEUES=BOTH_DECLARED):
        task = app.echo.using(priority=-3, queue_name="emails", run_after=run_after)
        enqueued = task.enqueue("x")
        read = app.echo.get_result(enqueued.id)
        assert read.task == enqueued.task == task
        assert (read.task.priority, read.task.queue_name, read.task.run_after) == (
            -3, "emails", run_after,
        )  # fmt: skip
        assert read == enqueued
        # Without run_after the result says none, not the job's run_at.
        plain = app.echo.enqueue("y")
        assert app.echo.get_result(plain.id).task == plain.task == app.echo


@pytest.mark.django_db
def test_context_tasks_and_signals_see_the_enqueued_priority_queue_and_run_after():
    from jobs.backends import _handlers
    from jobs.tasks import JobContext
    from jobs.tasks_compat import task_finished, task_started

    run_after = timezone.now() - timedelta(seconds=1)
    with override_settings(TASKS=TWO_QUEUES, JOBS_QUEUES=BOTH_DECLARED):
        task = app.whoami.using(priority=4, queue_name="emails", run_after=run_after)
        result = task.enqueue(note="n")
        job = Job.objects.get(pk=int(result.id))
        heard = []

        def listen(sender, task_result, **kwargs):
            heard.append(task_result.task)

        task_started.connect(listen)
        task_finished.connect(listen)
        try:
            ctx = JobContext(
                job_id=job.pk, lease_version=job.lease_version, attempt=1, worker_id="w",
                queue=job.queue, task=job.task,
            )  # fmt: skip
            value = _handlers[job.task](job.payload, ctx)
        finally:
            task_started.disconnect(listen)
            task_finished.disconnect(listen)
    assert (value["priority"], value["queue"], value["run_after"]) == (
        4, "emails", run_after.isoformat(),
    )  # fmt: skip
    assert heard == [task, task]


@pytest.mark.django_db
def test_task_priority_comes_from_the_decorator_and_the_retry_policy_sets_max_retries(settings):
    echo = Job.objects.get(pk=int(app.echo.enqueue().id))
    assert echo.priority == 10
    assert echo.max_retries == settings.JOBS_MAX_RETRIES
    assert Job.objects.get(pk=int(app.flaky_once.enqueue("x").id)).max_retries == 1


@pytest.mark.django_db
def test_backend_options_set_the_default_retry_budget():
    options = {
        "default": {"BACKEND": "jobs.backends.JobServiceBackend", "OPTIONS": {"MAX_RETRIES": 7}}
    }
    with override_settings(TASKS=options):
        assert Job.objects.get(pk=int(app.add.enqueue(1, 2).id)).max_retries == 7
        assert Job.objects.get(pk=int(app.always_fails.enqueue("x").id)).max_retries == 2


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((timezone.now(),), {}),  # not JSON at all
        ((b"bytes",), {}),
        ((), {"n": float("nan")}),  # JSON, but not what jsonb stores
        (({1: "int key"},), {}),  # comes back with a string key
        ((), {"s": {1, 2}}),
    ],
)
def test_arguments_that_do_not_round_trip_through_json_are_refused(args, kwargs):
    with pytest.raises(InvalidTaskArguments, match="JSON round-trippable") as caught:
        app.echo.enqueue(*args, **kwargs)
    assert isinstance(caught.value, TypeError)  # what a framework caller may catch
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_tuples_come_back_as_lists():
    result = app.echo.enqueue((1, 2), pair=(3, 4))
    assert Job.objects.get(pk=int(result.id)).payload == {
        "args": [[1, 2]],
        "kwargs": {"pair": [3, 4]},
    }


@pytest.mark.django_db
def test_queue_names_are_checked_against_the_backends_queues():
    with override_settings(TASKS=TWO_QUEUES, JOBS_QUEUES=BOTH_DECLARED):
        result = app.add.using(queue_name="emails").enqueue(1, 1)
        assert Job.objects.get(pk=int(result.id)).queue == "emails"
        with pytest.raises(InvalidTaskError, match="Queue 'reports' is not valid"):
            app.add.using(queue_name="reports").enqueue(1, 1)
    with pytest.raises(InvalidTaskError, match="Queue 'emails' is not valid"):
        app.add.using(queue_name="emails")
    assert Job.objects.count() == 1


@pytest.mark.django_db
def test_priority_out_of_range_is_refused():
    with pytest.raises(InvalidTaskError, match="priority"):
        app.add.using(priority=101)


@pytest.mark.django_db
def test_backpressure_applies(settings):
    settings.JOBS_MAX_QUEUE_DEPTH = 2
    clear_depth_cache()
    for _ in range(3):
        app.add.enqueue(1, 1)
    clear_depth_cache()
    with pytest.raises(QueueFull):
        app.add.enqueue(1, 1)
    clear_depth_cache()
    assert Job.objects.count() == 3


@pytest.mark.django_db(transaction=True)
def test_idempotency_key_enqueues_once():
    heard = []

    def listen(sender, task_result, **kwargs):
        heard.append(task_result.id)

    task_enqueued.connect(listen)
    try:
        with idempotency_key("receipt-42"):
            first = app.add.enqueue(4, 2)
            services.claim("w-1", int(first.id))
            again = app.add.enqueue(4, 2)
            with pytest.raises(IdempotencyConflict):
                app.add.enqueue(4, 3)
        other = app.add.enqueue(4, 2)  # outside the block: no key
    finally:
        task_enqueued.disconnect(listen)
    assert first.id == again.id != other.id
    assert Job.objects.count() == 2
    assert heard == [first.id, other.id]  # a replay enqueues nothing, so says nothing
    assert (again.status, again.worker_ids) == (TaskResultStatus.RUNNING, ["w-1"])


@pytest.mark.django_db(transaction=True)
def test_rolled_back_enqueue_leaves_no_job_no_push_no_signal():
    heard = []

    def listen(sender, task_result, **kwargs):
        heard.append(task_result.id)

    task_enqueued.connect(listen)
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            result = app.add.enqueue(1, 2)
            assert Job.objects.filter(pk=int(result.id)).exists()
            raise RuntimeError("the caller's change fails")
        assert not Job.objects.exists()
        assert redis_queue() == []
        assert heard == []

        with transaction.atomic():
            kept = app.add.enqueue(1, 2)
            assert redis_queue() == [] and heard == []  # both wait for the commit
        assert redis_queue() == [kept.id]
        assert heard == [kept.id]
    finally:
        task_enqueued.disconnect(listen)


@pytest.mark.django_db(transaction=True)
def test_aenqueue_and_aget_result():
    async def go():
        result = await app.async_add.aenqueue(1, 2)
        fetched = await app.async_add.aget_result(result.id)
        # The shared thread sync_to_async ran them in keeps a connection: close it.
        await sync_to_async(connections.close_all, thread_sensitive=True)()
        return result, fetched

    result, fetched = asyncio.run(go())
    assert fetched.id == result.id and fetched.status == TaskResultStatus.READY
    assert Job.objects.get(pk=int(result.id)).task == "tests.tasks_app.tasks.async_add"


@pytest.mark.django_db
def test_get_result_of_unknown_or_foreign_ids_raises():
    backend = task_backends["default"]
    plain, _ = services.submit("echo", {"x": 1})  # an ordinary job, not a Task's
    for result_id in ("999999999", "not-a-number", "9" * 20, "-1", str(plain.pk)):
        with pytest.raises(TaskResultDoesNotExist):
            backend.get_result(result_id)


@pytest.mark.django_db
def test_status_mapping_and_history_fields(sql):
    result = app.always_fails.enqueue("boom")
    job_id = int(result.id)
    lease = services.claim("w-1", job_id)
    assert app.always_fails.get_result(result.id).status == TaskResultStatus.RUNNING
    # As the worker writes a failed attempt: text, exception class and traceback.
    tb = "Traceback (most recent call last):\n  ...\nKeyError: 'boom'\n"
    services.fail([(lease, "KeyError: 'boom'", False, "builtins.KeyError", tb)])
    sql("UPDATE jobs_job SET run_at = now() WHERE id = %s", [job_id])
    lease = services.claim("w-2", job_id)
    services.fail([(lease, "KeyError: 'boom'", True, "builtins.KeyError", tb)])

    fetched = app.always_fails.get_result(result.id)
    job = Job.objects.get(pk=job_id)
    assert fetched.status == TaskResultStatus.FAILED
    assert fetched.worker_ids == ["w-1", "w-2"] and fetched.attempts == 2
    assert fetched.finished_at == job.finished_at is not None
    # one test transaction: now() is the same instant throughout
    assert fetched.started_at <= fetched.last_attempted_at <= fetched.finished_at
    assert [e.exception_class_path for e in fetched.errors] == ["builtins.KeyError"] * 2
    assert fetched.errors[0].exception_class is KeyError
    assert "boom" in fetched.errors[-1].traceback
    with pytest.raises(ValueError, match="failed"):
        _ = fetched.return_value


@pytest.mark.django_db
def test_enqueue_failed_reads_as_ready_and_done_carries_the_return_value():
    result = app.add.enqueue(2, 2)
    services.mark_enqueue_failed([int(result.id)], reason="redis down")
    assert result.task.get_result(result.id).status == TaskResultStatus.READY
    services.repair_enqueue_failed(job_ids=[int(result.id)])
    lease = services.claim("w-1", int(result.id))
    services.complete([(lease, 4)])
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 4


def test_check_refuses_bad_queue_names():
    bad = {"default": {"BACKEND": "jobs.backends.JobServiceBackend", "QUEUES": ["ok", "no way"]}}
    with override_settings(TASKS=bad, JOBS_QUEUES={"ok": {}}):
        errors = list(task_backends["default"].check())
    assert [e.id for e in errors] == ["jobs.E101"]
    assert "'no way'" in errors[0].msg
    with override_settings(TASKS=TWO_QUEUES, JOBS_QUEUES=BOTH_DECLARED):
        assert list(task_backends["default"].check()) == []
    with override_settings(TASKS=TWO_QUEUES, JOBS_QUEUES={"default": {}}):
        assert [e.id for e in task_backends["default"].check()] == ["jobs.E102"]
    assert not any(e.id.startswith("jobs.E10") for e in checks.run_checks())


@pytest.mark.django_db
def test_admin_lists_and_shows_task_jobs_by_import_path(client):
    user = User.objects.create_user("staff", is_staff=True, password="x")
    from django.contrib.auth.models import Permission

    user.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(user)
    result = app.add.enqueue(20, 22)
    listing = client.get(reverse("admin:jobs_job_changelist"))
    assert listing.status_code == 200
    assert "tests.tasks_app.tasks.add" in listing.content.decode()
    detail = client.get(reverse("admin:jobs_job_change", args=[int(result.id)]))
    assert detail.status_code == 200
    page = detail.content.decode()
    assert "tests.tasks_app.tasks.add" in page and "22" in page


@pytest.mark.django_db
def test_timeout_and_retries_above_task_mark_it_as_under_it():
    """`@timeout(3)` above `@task` raised `TypeError: super(type, obj)` (a frozen Task)."""
    job = Job.objects.get(pk=int(app.marked_above.enqueue(1).id))
    assert (job.timeout, job.max_retries) == (3, 4)
    assert Job.objects.get(pk=int(app.overruns.enqueue().id)).timeout == 1  # under @task


@pytest.mark.django_db
def test_a_cancel_reads_as_a_cancel_not_as_a_lost_attempt():
    from jobs.backends import JobCancelled
    from jobs.lifecycle import CANCELLED

    result = app.add.enqueue(1, 2)
    assert services.cancel([int(result.id)], "staff:ann") == [int(result.id)]
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert [(e.exception_class, e.traceback) for e in result.errors] == [(JobCancelled, CANCELLED)]


def test_a_result_json_cannot_hold_is_recorded_as_a_type_error():
    """django-tasks' test_complex_return_value expects TypeError, as Django's backends."""
    from jobs.worker import InvalidResult, check_result

    with pytest.raises(TypeError, match="not JSON-serializable"):
        check_result(app.complex_return_value.call())
    assert issubclass(InvalidResult, TypeError)


@pytest.fixture
def declared():
    """@periodic declarations made by the test, removed after it."""
    from jobs.schedules import periodic

    before = list(periodic.DECLARED)
    yield periodic
    periodic.DECLARED[:] = before


@pytest.mark.django_db
def test_periodic_above_a_django_task_schedules_what_its_enqueue_would(declared):
    """It failed `migrate` with `name must be 1-200 characters (and 1 more in errors)`."""
    from jobs.models import Schedule
    from jobs.schedules import define

    declared.periodic(interval_seconds=60)(app.marked_above)
    declared.periodic(cron="0 3 * * *", args=[2], kwargs={"b": 3}, name="nightly-add")(app.add)
    assert define.sync_periodic() == 2
    tick = Schedule.objects.get(client=None, name="tests.tasks_app.tasks.marked_above")
    assert (tick.task, tick.payload, tick.interval_seconds) == (
        "tests.tasks_app.tasks.marked_above", {"args": [], "kwargs": {}}, 60
    )  # fmt: skip
    assert (tick.max_retries, tick.timeout, tick.origin) == (4, 3, "code")  # its markers
    nightly = Schedule.objects.get(client=None, name="nightly-add")
    assert (nightly.task, nightly.payload) == (
        "tests.tasks_app.tasks.add", {"args": [2], "kwargs": {"b": 3}}
    )  # fmt: skip


@pytest.mark.django_db
def test_periodic_refuses_what_cannot_run_and_names_every_broken_rule(declared):
    from django.core.exceptions import ImproperlyConfigured

    from jobs.checks import check_periodic
    from jobs.schedules import define

    with pytest.raises(TypeError, match="args= and kwargs=, not a payload"):
        declared.periodic(interval_seconds=60, payload=[1, 2])(app.add)
    with pytest.raises(InvalidTaskArguments):  # at definition: JSON would change it
        declared.periodic(interval_seconds=60, args=[{1: "a"}])(app.add)

    def not_a_task(payload, ctx): ...

    assert check_periodic() == []
    declared.periodic(interval_seconds=60)(not_a_task)
    with pytest.raises(ImproperlyConfigured, match="not_a_task.*not a registered task"):
        define.sync_periodic()
    declared.periodic(interval_seconds=0, timezone="Mars/Olympus", task="echo")(not_a_task)
    unregistered, refused = check_periodic()  # `check` says what `migrate` would refuse
    assert (unregistered.id, refused.id) == ("jobs.E106", "jobs.E106")
    assert "not_a_task" in unregistered.msg and "not a registered task" in unregistered.msg
    assert refused.msg.startswith("@periodic schedule 'echo': ")
    assert "interval_seconds" in refused.msg and "Mars/Olympus" in refused.msg  # both rules
    del declared.DECLARED[-2]
    with pytest.raises(ImproperlyConfigured) as caught:
        define.sync_periodic()
    assert str(caught.value) == refused.msg


@pytest.mark.django_db
def test_a_workflow_step_takes_the_task_object_and_refuses_what_cannot_run():
    """`.step("a", "shop.tasks.add", [1, 2])` was accepted and failed four attempts."""
    from jobs.exceptions import RequestInvalid
    from jobs.workflows import Workflow

    wf = Workflow("w").step("a", app.marked_above, args=[1])
    assert wf.steps[0] == {
        "id": "a", "task": "tests.tasks_app.tasks.marked_above",
        "payload": {"args": [1], "kwargs": {}}, "queue": "default", "priority": 0,
        "max_retries": 4, "timeout": 3, "after": [],
    }  # fmt: skip
    with pytest.raises(RequestInvalid) as caught:
        wf.step("b", "tests.tasks_app.tasks.add", [1, 2])
    assert list(caught.value.errors) == ["steps[1].payload"]
    assert 'payload is {"args": [...], "kwargs": {...}}' in str(caught.value)
    with pytest.raises(TypeError, match="args= and kwargs=, not a payload"):
        wf.step("b", app.add, [1, 2])
    with pytest.raises(InvalidTaskArguments):
        wf.step("b", app.add, args=[{1: "a"}])
    wf.step("b", app.add, args=[1], kwargs={"b": 2}, after=["a"], priority=5)
    assert len(wf.steps) == 2 and wf.steps[1]["priority"] == 5
    assert wf.submit() > 0


def test_a_task_module_that_fails_to_import_is_a_check_error_not_a_traceback(settings):
    from jobs import tasks
    from jobs.checks import check_periodic

    tasks.load()
    settings.JOBS_TASK_MODULES = ["tests.no_such_tasks_module"]
    tasks._loaded = False
    try:
        (error,) = check_periodic()
    finally:
        tasks._loaded = True  # as before: loaded
    assert error.id == "jobs.E107" and "ModuleNotFoundError" in error.msg, error.msg
