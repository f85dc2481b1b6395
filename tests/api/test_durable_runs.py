"""A continued durable job through the API (issue 45): each run shows its number, its
chain and the previous runs' ids, GET shows the run's history size, and a signal sent
to an earlier run's id reaches the live run."""

from __future__ import annotations

import pytest

import tests.durable_tasks  # noqa: F401 - registers the durable test tasks
from jobs import services
from tests.test_durable_steps import run_once

pytestmark = pytest.mark.django_db(transaction=True)


def test_runs_show_their_number_links_and_history(api, me):
    job, _ = services.submit("durable.chained_signal", {}, client_id=me.pk)
    run_once(job.pk)  # run 1: a step, then continue as new
    first = api.get(f"/api/v1/jobs/{job.pk}/").json()
    assert first["status"] == "done" and first["run_number"] == 1
    assert first["chain_id"] == job.pk and first["previous_run_ids"] is None
    assert first["history"] == {"steps": 1, "waits": 0, "bytes": first["history"]["bytes"]}
    second_id = first["next_run_id"]
    assert first["result"] == {"continued_as_new": second_id}
    run_once(second_id)  # run 2 parks on its wait for "go"
    second = api.get(f"/api/v1/jobs/{second_id}/").json()
    assert (second["run_number"], second["chain_id"]) == (2, job.pk)
    assert second["previous_run_ids"] == [job.pk] and second["next_run_id"] is None
    assert second["history"]["waits"] == 1 and second["wait_reason"] == "signal"
    listed = api.get("/api/v1/jobs/").json()["results"]
    assert {j["id"]: j["run_number"] for j in listed} == {job.pk: 1, second_id: 2}

    r = api.post(f"/api/v1/jobs/{job.pk}/signal/", {"key": "go", "payload": 5}, format="json")
    assert r.status_code == 202 and r.json()["woke"] is True  # forwarded to run 2
    run_once(second_id)
    assert api.get(f"/api/v1/jobs/{second_id}/").json()["result"] == 5
