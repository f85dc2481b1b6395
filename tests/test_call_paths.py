"""A submission's and a claim's path through the modules of jobs, measured as they run
(issue 43, D363): how many modules each crosses and how often it returns to a module it
had left. The figures are bounds, so a change that makes a path longer fails here; run
with `-s` to print the paths (docs/architecture.md quotes them).

How a path is counted: tests/callpaths.py. Both runs are real: a POST through the test
client to PostgreSQL and Redis, and the claim a worker makes after Redis hands it an id.
"""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from jobs import admission, queuecontrol, selectors, validation
from jobs.api.views import JobViewSet
from jobs.exceptions import InvalidSubmission
from jobs.flow import rules as flow_rules
from jobs.models import Client, Job
from jobs.transport import get_transport
from jobs.worker import Worker
from tests.callpaths import CallPath, Path
from tests.factories import JobFactory
from tests.test_architecture import LAYERS, layer_of

pytestmark = pytest.mark.django_db

# The figures after D399, each a ceiling: lower it when a change shortens a path.
# Measured the same way (docs/architecture.md): at 2b07e26, before the services split,
# submission 10 / 15 (stages 5 / 4), claim 9 / 22 (4 / 13); with the split, submission
# 17 / 32 (11 / 17), claim 10 / 26 (5 / 18); after D363-D366, submission 16 / 10
# (11 / 8), claim 10 / 22 (5 / 14); after D372, submission 11 / 7 (8 / 6).
SUBMISSION = {"modules": 9, "returns": 7, "stages": 6, "stage returns": 6}
CLAIM = {"modules": 8, "returns": 7, "stages": 5, "stage returns": 6}

LOWEST = [name for name, _ in LAYERS].index("model caches")


def lookup(module: str) -> bool:
    """A module of the lowest layers: settings, registries, helpers, drivers, models."""
    layer = layer_of(module)
    return layer is not None and layer <= LOWEST


def figures(path: CallPath) -> dict[str, int]:
    stages = path.stages(lookup)
    print(f"\n  every module: {path.summary()}\n  stages: {stages.summary()}")
    return {
        "modules": path.modules,
        "returns": path.returns,
        "stages": stages.modules,
        "stage returns": stages.returns,
    }


def within(measured: dict[str, int], ceiling: dict[str, int]) -> list[str]:
    return [f"{k}: {measured[k]} > {ceiling[k]}" for k in ceiling if measured[k] > ceiling[k]]


def test_a_submission_through_the_api():
    _, token = Client.create_with_token("paths")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")

    def post() -> object:
        return api.post(
            "/api/v1/jobs/",
            data=json.dumps({"task": "echo", "payload": {"n": 1}}),
            content_type="application/json",
        )

    assert post().status_code == 201  # the process's first request imports and loads
    # The readings cached for a second are read again, as every second in a live process.
    admission.clear_depth_cache()
    selectors.forget_paused_queues()
    path = CallPath(JobViewSet.create.__code__)
    response = path.run(post)
    assert response.status_code == 201, response.content
    assert Job.objects.filter(pk=response.json()["id"], status="queued").exists()
    assert path.steps[0] == "jobs.api.views" and "jobs.services.inserts" in path.steps
    assert within(figures(path), SUBMISSION) == []


def test_a_claim_by_the_worker(monkeypatch):
    monkeypatch.setattr(queuecontrol, "REFRESH_SECONDS", 3600.0)  # one read of the controls
    job = JobFactory.create()
    get_transport().push({"default": [job.pk]})
    worker = Worker(["default"], concurrency=1)
    path = CallPath(Worker._discover.__code__)
    leases = path.run(lambda: worker._discover(1, 1))
    assert [lease.job_id for lease in leases] == [job.pk]
    assert path.steps[0] == "jobs.worker" and "jobs.services.claims.plain" in path.steps
    assert within(figures(path), CLAIM) == []


def test_a_path_counts_returns_to_a_module_left():
    """The counting itself: a module seen again after another is a return."""
    path = Path(["a", "b", "b", "c", "b", "a", "d"])
    assert path.steps == ["a", "b", "c", "b", "a", "d"]
    assert (path.modules, path.returns) == (4, 2)


def test_the_rules_of_one_job_are_asked_in_one_place():
    """A small path read whole: the rules ask the task and the queue registries once
    each (a setting read is no step); the flow fields' rules only for an item that gives
    a flow field (D372), which also says whether it takes the flow path."""

    def item(**flow: object) -> dict:
        return {"task": "echo", "payload": {}, "queue": "default", "priority": 0,
                "run_at": None, "max_retries": None, "idempotency_key": "k",
                "concurrency_key": "c", **flow}  # fmt: skip

    plain = item()
    path = CallPath(validation.check_item.__code__)
    path.run(lambda: validation.check_item(plain))
    assert path.steps == ["jobs.validation", "jobs.tasks", "jobs.validation", "jobs.queues"]
    assert (path.modules, path.returns) == (3, 1)
    assert plain["request_hash"] and plain["flow_control"] is False
    assert all(plain[name] is None for name in flow_rules.FIELDS)

    for flow, wanted in (({"key_strategy": "skip_new"}, True), ({"key_strategy": "queue"}, False)):
        flowed = item(**flow)
        path = CallPath(validation.check_item.__code__)
        path.run(lambda flowed=flowed: validation.check_item(flowed))
        assert path.steps[-1] == "jobs.flow.rules" and flowed["flow_control"] is wanted
        assert flowed["debounce_key"] is None
    with pytest.raises(InvalidSubmission):  # a flow field given is still held to its rules
        validation.check_item(item(key_strategy="later"))
