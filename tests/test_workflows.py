"""Workflows against the real database: refusals write nothing, a child is claimable
only once its parents ended, and the parent's own write makes it due (jobs.graph)."""

from __future__ import annotations

import pytest

from jobs import durable, services, workflows
from jobs.exceptions import RequestInvalid
from jobs.lifecycle import BLOCKED_RUN_AT
from jobs.models import Job, JobDependency, Workflow, WorkflowNode

pytestmark = pytest.mark.django_db(transaction=True)


def _ids(workflow_id: int) -> dict[str, int]:
    return dict(WorkflowNode.objects.filter(workflow_id=workflow_id).values_list("key", "job_id"))


def _finish(job_id: int, result=None, *, error: str | None = None) -> None:
    lease = services.claim("w-wf", job_id)
    assert lease is not None, f"job {job_id} was not claimable"
    if error is None:
        assert job_id in services.complete([(lease, result)])
    else:
        assert job_id in services.fail([(lease, error, True)])


def _nothing_written():
    return (Job.objects.count(), Workflow.objects.count(), WorkflowNode.objects.count(),
            JobDependency.objects.count())  # fmt: skip


def _step(i, after=(), task="echo"):
    return {"id": str(i), "task": task, "payload": {"i": i}, "after": list(after)}


@pytest.mark.parametrize(
    "steps,field,code",
    [
        ([_step("a", ["c"]), _step("b", ["a"]), _step("c", ["b"])], "steps", "cycle"),
        ([_step("a", ["a"])], "steps", "cycle"),
        ([_step("a"), _step("b", ["zz"])], "steps[1].after", "unknown_step"),
        ([_step("a"), _step("b", task="no-such-task")], "steps[1].task", "unknown_task"),
        ([_step("a"), _step("a")], "steps[1].id", "duplicate_id"),
        ([_step(i) for i in range(1001)], "steps", "too_many_steps"),
    ],
    ids=["cycle", "self-loop", "unknown-id", "unknown-task", "duplicate-id", "oversized"],
)
def test_a_refused_graph_writes_nothing(steps, field, code):
    before = _nothing_written()
    with pytest.raises(RequestInvalid) as refused:
        workflows.submit_request({"name": "bad", "steps": steps})
    assert code in [e["code"] for e in refused.value.errors[field]]
    assert _nothing_written() == before


def test_a_child_waits_for_every_parent_and_the_last_one_makes_it_due():
    wf = workflows.Workflow("fan-in")
    wf.step("a", "echo", {"a": 1}).step("b", "echo", {"b": 2})
    wf.step("c", "echo", {}, after=["a", "b"])
    ids = _ids(wf.submit())
    child = Job.objects.get(pk=ids["c"])
    assert (child.status, child.wait_reason) == ("queued", "parents")
    assert child.run_at.year == int(BLOCKED_RUN_AT[:4])
    assert services.claim("w-wf", ids["c"]) is None  # blocked: not claimable
    _finish(ids["a"], {"a": 1})
    assert services.claim("w-wf", ids["c"]) is None  # one parent left
    _finish(ids["b"], {"b": 2})
    child.refresh_from_db()
    assert child.wait_reason is None and child.due_at == child.run_at  # the SLO clock starts
    lease = services.claim("w-wf", ids["c"])
    assert lease is not None
    assert durable.context(lease).parent_results == {"a": {"a": 1}, "b": {"b": 2}}


def test_fail_dependents_fails_every_descendant_with_the_failed_step():
    wf = workflows.Workflow("chain")
    wf.step("a", "echo").step("b", "echo", after=["a"]).step("c", "echo", after=["b"])
    wf.step("side", "echo")
    workflow_id = wf.submit()
    ids = _ids(workflow_id)
    _finish(ids["a"], error="boom")
    rows = {k: Job.objects.get(pk=v) for k, v in ids.items()}
    assert [(rows[k].status, rows[k].error) for k in ("b", "c")] == [
        ("failed", "dependency failed: a"),
        ("failed", "dependency failed: a"),
    ]
    assert rows["side"].status == "queued"
    assert Workflow.objects.get(pk=workflow_id).finished_at is None
    _finish(ids["side"], 1)
    detail = workflows.detail(workflow_id)
    assert detail["status"] == "failed" and detail["finished_at"] is not None


def test_continue_runs_the_child_after_a_failed_parent():
    wf = workflows.Workflow("tolerant", on_failure="continue")
    wf.step("a", "echo").step("b", "echo").step("c", "echo", after=["a", "b"])
    ids = _ids(wf.submit())
    _finish(ids["a"], error="boom")
    _finish(ids["b"], {"ok": True})
    lease = services.claim("w-wf", ids["c"])
    assert lease is not None
    ctx = durable.context(lease)
    assert ctx.parent_results == {"b": {"ok": True}}
    assert ctx.failed_parents == {"a": "boom"}


def test_cancel_cancels_the_steps_not_started():
    wf = workflows.Workflow("cancel-me")
    wf.step("a", "echo").step("b", "echo", after=["a"]).step("c", "echo")
    workflow_id = wf.submit()
    ids = _ids(workflow_id)
    running = services.claim("w-wf", ids["a"])
    assert sorted(workflows.cancel(workflow_id, actor="staff:t")) == sorted([ids["b"], ids["c"]])
    assert Job.objects.get(pk=ids["b"]).error == "cancelled"
    assert services.complete([(running, 1)])  # the running step finishes
    detail = workflows.detail(workflow_id)
    assert [s["status"] for s in detail["steps"]] == ["done", "failed", "failed"]
    assert detail["finished_at"] is not None


def test_the_builder_writes_in_the_callers_transaction():
    from django.db import transaction

    before = _nothing_written()
    with pytest.raises(RuntimeError), transaction.atomic():
        workflows.Workflow("rolled-back").step("a", "echo").submit()
        raise RuntimeError
    assert _nothing_written() == before


def test_the_end_that_finishes_a_workflow_observes_its_completion_time():
    from jobs import metrics

    def observed() -> float:
        return metrics.WORKFLOW_SECONDS._sum.get(), sum(
            b.get() for b in metrics.WORKFLOW_SECONDS._buckets
        )

    wf = workflows.Workflow("timed")
    wf.step("a", "echo").step("b", "echo", after=["a"])
    ids = _ids(wf.submit())
    _, count = observed()
    _finish(ids["a"], 1)
    services.signal_woken_children([ids["a"]])  # as the worker's write-back does
    assert observed()[1] == count  # not finished yet
    _finish(ids["b"], 2)
    services.signal_woken_children([ids["b"]])
    assert observed()[1] == count + 1


def test_waiting_gauge_counts_parked_and_blocked_jobs_by_reason():
    from jobs.collectors import DepthCollector, WaitingCollector
    from jobs.lifecycle import WaitReason

    collector = WaitingCollector(DepthCollector(cache_seconds=0))

    def read() -> dict[str, float]:
        return {s.labels["reason"]: s.value for f in collector.collect() for s in f.samples}

    none = {"sleep": 0, "signal": 0, "parents": 0, "sequence": 0, "sequence_halted": 0}
    assert read() == none
    workflows.Workflow("w").step("a", "echo").step("b", "echo", after=["a"]).submit()
    job, _ = services.submit("echo", {})
    services.suspend(services.claim("w-wf", job.pk), reason=WaitReason.SLEEP, seconds=60)
    assert read() == {**none, "sleep": 1, "parents": 1}
    services.submit("echo", {}, sequence_key="k")
    services.submit("echo", {}, sequence_key="k")  # waits its turn
    assert read() == {**none, "sleep": 1, "parents": 1, "sequence": 1}


def test_pruning_a_finished_job_takes_its_steps_signals_and_links_along(sql):
    from jobs.models import JobSignal, JobStep
    from jobs.signals import signal_job

    wf = workflows.Workflow("old")
    wf.step("a", "echo").step("b", "echo", after=["a"])
    ids = _ids(wf.submit())
    keep = services.submit("echo", {})[0]
    signal_job(ids["a"], "k", 1)
    lease = services.claim("w-wf", ids["a"])
    durable.context(lease).step("s", lambda: 1)
    services.complete([(lease, 1)])
    sql("UPDATE jobs_job SET finished_at = now() - interval '2 days' WHERE id = %s", [ids["a"]])
    assert services.prune_finished(86400, ["done", "failed"], 100) == 1
    assert not JobStep.objects.filter(job_id=ids["a"]).exists()
    assert not JobSignal.objects.filter(job_id=ids["a"]).exists()
    assert not WorkflowNode.objects.filter(job_id=ids["a"]).exists()
    assert not JobDependency.objects.filter(parent_id=ids["a"]).exists()
    assert WorkflowNode.objects.filter(job_id=ids["b"]).exists()
    assert Job.objects.filter(pk=keep.pk).exists()


def test_a_failed_descendant_no_longer_counts_as_waiting():
    wf = workflows.Workflow("w").step("a", "echo").step("b", "echo", after=["a"])
    ids = _ids(wf.submit())
    _finish(ids["a"], error="boom")
    assert Job.objects.get(pk=ids["b"]).wait_reason is None
