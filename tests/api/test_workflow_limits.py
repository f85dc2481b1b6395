"""The bounds of `POST /api/v1/workflows/` (issue 28): edges per workflow capped with a
400 naming the cap, and every step counted against JOBS_MAX_QUEUE_DEPTH like a batch
(429 + Retry-After). A refusal writes nothing."""

from __future__ import annotations

import json

import pytest
from prometheus_client import REGISTRY

from jobs import admission, submission, workflows
from jobs.exceptions import QueueFull
from jobs.models import Workflow, WorkflowNode
from tests.api.conftest import counts
from tests.factories import JobFactory

URL = "/api/v1/workflows/"
pytestmark = pytest.mark.django_db


def post(api, steps, key=None):
    extra = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    return api.post(URL, data=json.dumps({"name": "wf", "steps": steps}),
                    content_type="application/json", **extra)  # fmt: skip


def chain(n: int, queue: str = "default") -> list[dict]:
    return [{"id": f"s{i}", "task": "echo", "payload": {}, "queue": queue,
             "after": [f"s{i - 1}"] if i else []} for i in range(n)]  # fmt: skip


def complete(n: int) -> list[dict]:
    """Each step after every earlier one: n(n-1)/2 edges."""
    return [{"id": f"s{i}", "task": "echo", "payload": {}, "after": [f"s{j}" for j in range(i)]}
            for i in range(n)]  # fmt: skip


def written() -> tuple:
    return (*counts(), Workflow.objects.count(), WorkflowNode.objects.count())


def rejected(queue: str = "default") -> float:
    labels = {"queue": queue, "code": "queue_full"}
    return REGISTRY.get_sample_value("jobs_submissions_rejected_total", labels) or 0.0


def test_more_edges_than_the_cap_is_a_400_naming_the_cap(api, settings):
    settings.JOBS_WORKFLOW_MAX_EDGES = 9
    before = written()
    r = post(api, complete(5))  # 10 edges
    assert r.status_code == 400, r.content
    [error] = r.json()["errors"]["steps"]
    assert error["code"] == "too_many_edges"
    assert "at most 9 edges" in error["message"] and "not 10" in error["message"]
    assert written() == before
    assert post(api, complete(5)[:4] + [{**complete(5)[4], "after": ["s0", "s1", "s2"]}]
                ).status_code == 201  # 9 edges: at the cap  # fmt: skip


def test_the_default_cap_is_ten_thousand_edges(api):
    def after(i: int) -> list[str]:
        return ["root", *(f"s{j}" for j in range(max(0, i - 10), i))]

    over = [{"id": "root", "task": "echo", "payload": {}}] + [
        {"id": f"s{i}", "task": "echo", "payload": {}, "after": after(i)} for i in range(920)
    ]
    edges = sum(len(s.get("after", [])) for s in over)
    assert edges > 10_000
    before = written()
    r = post(api, over)
    assert r.status_code == 400
    assert "at most 10000 edges" in r.json()["errors"]["steps"][0]["message"]
    assert written() == before


def test_a_workflow_that_would_pass_the_queue_depth_is_a_429(api, settings):
    settings.JOBS_MAX_QUEUE_DEPTH = 10
    JobFactory.create_batch(5, queue="default")
    admission.clear_depth_cache()
    before, refused = written(), rejected()
    r = post(api, chain(6))
    assert r.status_code == 429, r.content
    assert r["Retry-After"] == str(submission.RETRY_AFTER_SECONDS)
    assert r.json()["code"] == "queue_full"
    assert written() == before
    assert rejected() == refused + 6
    # Steps on another queue do not count against this one; 5 more fill it exactly.
    assert post(api, chain(6, queue="other")).status_code == 201
    assert post(api, chain(5)).status_code == 201
    assert post(api, chain(1)).status_code == 429  # this process's reading counted them


def test_a_replay_is_answered_when_the_queue_is_full(api, settings):
    settings.JOBS_MAX_QUEUE_DEPTH = 3
    first = post(api, chain(3), key="wf-1")
    assert first.status_code == 201
    before = written()
    again = post(api, chain(3), key="wf-1")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    assert post(api, chain(3), key="wf-2").status_code == 429
    assert written() == before


def test_the_django_builder_meets_the_same_backpressure(settings):
    settings.JOBS_MAX_QUEUE_DEPTH = 1
    admission.clear_depth_cache()
    wf = workflows.Workflow("nightly").step("a", "echo").step("b", "echo", after=["a"])
    before = written()
    with pytest.raises(QueueFull):
        wf.submit()
    assert written() == before
