"""Flow fields over REST (jobs.flow): debounced submissions answered 200 with the job
they joined, the drop form's 429 `rate_limited` with Retry-After, a skipped job answered
as such, and every bad flow field a JSON 400 that writes nothing."""

from __future__ import annotations

import json

import pytest

from jobs.models import Job, KeyHit
from tests.api.conftest import counts

pytestmark = pytest.mark.django_db


def _post(api, body, **headers):
    return api.post("/api/v1/jobs/", data=json.dumps(body), content_type="application/json",
                    **headers)  # fmt: skip


def test_debounced_submissions_answer_the_job_they_joined(api):
    body = {"task": "echo", "payload": {"n": 1}, "debounce_key": "doc", "debounce_seconds": 30}
    first = _post(api, body)
    assert first.status_code == 201, first.content
    assert first.json()["debounced"] is False and first.json()["status"] == "queued"
    again = _post(api, {**body, "payload": {"n": 2}})
    assert again.status_code == 200, again.content
    doc = again.json()
    assert (doc["id"], doc["debounced"], doc["payload"]) == (first.json()["id"], True, {"n": 2})
    assert doc["run_at"] >= first.json()["run_at"]
    assert Job.objects.count() == 1


def test_the_drop_form_answers_429_with_retry_after(api):
    body = {"task": "echo", "payload": {}, "concurrency_key": "crm",
            "rate_limit": {"limit": 2, "period": 30}}  # fmt: skip
    for _ in range(2):
        assert _post(api, body).status_code == 201
    r = _post(api, body)
    assert r.status_code == 429, r.content
    doc = r.json()
    assert doc["code"] == "rate_limited" and "rate_limit" in doc["errors"]
    assert 29 <= int(r["Retry-After"]) <= 30 and doc["retry_after"] == int(r["Retry-After"])
    assert Job.objects.count() == 2 and KeyHit.objects.count() == 2


def test_a_skipped_job_is_answered_as_skipped(api):
    body = {"task": "echo", "payload": {}, "concurrency_key": "acct", "key_strategy": "skip_new"}
    assert _post(api, body).json()["skipped"] is False
    r = _post(api, body)
    assert r.status_code == 201, r.content
    doc = r.json()
    assert doc["skipped"] is True and doc["status"] == "failed"
    assert doc["error"].startswith("skipped: concurrency key busy")


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"debounce_key": "k"}, "debounce_seconds"),
        ({"debounce_key": "k", "debounce_seconds": "soon"}, "debounce_seconds"),
        ({"debounce_key": "k", "debounce_seconds": -1}, "debounce_seconds"),
        ({"debounce_key": 5, "debounce_seconds": 1}, "debounce_key"),
        ({"debounce_key": "k", "debounce_seconds": 1, "run_at": "2030-01-01T00:00:00Z"},
         "debounce_key"),
        ({"key_strategy": "cancel_running"}, "key_strategy"),
        ({"key_strategy": ["queue"], "concurrency_key": "c"}, "key_strategy"),
        ({"rate_limit": "10/m", "concurrency_key": "c"}, "rate_limit"),
        ({"rate_limit": {"limit": 1, "period": 0}, "concurrency_key": "c"}, "rate_limit"),
        ({"rate_limit": {"limit": 1, "period": 1}}, "rate_limit"),
    ],
)  # fmt: skip
def test_every_bad_flow_field_is_a_json_400_that_writes_nothing(api, extra, field):
    before = counts()
    r = _post(api, {"task": "echo", "payload": {}, **extra})
    assert r.status_code == 400, r.content
    assert r["Content-Type"] == "application/json"
    assert field in r.json()["errors"], r.json()
    assert counts() == before


def _batch(api, jobs):
    return api.post("/api/v1/jobs/batch/", data=json.dumps({"jobs": jobs}),
                    content_type="application/json")  # fmt: skip


def test_the_batch_debounces_its_jobs_in_order_like_single_submissions(api):
    deb = {"task": "echo", "debounce_key": "doc", "debounce_seconds": 30}
    r = _batch(api, [{**deb, "payload": {"n": 1}}, {"task": "echo", "payload": {"plain": 1}},
                     {**deb, "payload": {"n": 2}}])  # fmt: skip
    assert r.status_code == 201, r.content
    jobs = r.json()["jobs"]
    assert [(j["created"], j["debounced"], j["skipped"]) for j in jobs] == [
        (True, False, False), (True, False, False), (False, True, False)]  # fmt: skip
    assert jobs[2]["id"] == jobs[0]["id"] and jobs[1]["id"] > jobs[0]["id"]
    assert Job.objects.get(pk=jobs[0]["id"]).payload == {"n": 2}
    # A later single submission joins the job the batch made.
    single = _post(api, {**deb, "payload": {"n": 3}})
    assert (single.status_code, single.json()["id"]) == (200, jobs[0]["id"])
    again = _batch(api, [{**deb, "payload": {"n": 4}}])
    assert again.status_code == 200 and again.json()["jobs"][0]["debounced"] is True
    assert Job.objects.count() == 2


def test_the_batch_skips_and_cancels_per_key_in_item_order(api):
    key = {"task": "echo", "payload": {}, "concurrency_key": "acct"}
    r = _batch(api, [key, {**key, "key_strategy": "skip_new"},
                     {**key, "key_strategy": "cancel_running"}])  # fmt: skip
    assert r.status_code == 201, r.content
    first, skipped, last = r.json()["jobs"]
    assert (skipped["skipped"], skipped["status"]) == (True, "failed")
    assert last["skipped"] is False and last["status"] == "queued"
    assert Job.objects.get(pk=first["id"]).status == "failed"  # the queued one, cancelled
    assert Job.objects.get(pk=skipped["id"]).error.startswith("skipped: concurrency key busy")


def test_a_rate_limited_batch_item_is_a_429_for_the_whole_batch(api):
    limited = {"task": "echo", "payload": {}, "concurrency_key": "crm",
               "rate_limit": {"limit": 2, "period": 30}}  # fmt: skip
    assert _batch(api, [limited, limited]).status_code == 201
    before = counts()
    r = _batch(api, [{"task": "echo", "payload": {}}, limited])
    assert r.status_code == 429, r.content
    assert "jobs.1.rate_limit" in r.json()["errors"] and int(r["Retry-After"]) >= 29
    assert counts() == before and KeyHit.objects.count() == 2


def test_a_batch_debounce_conflict_names_the_item_and_writes_nothing(api):
    _post(api, {"task": "echo", "payload": {}, "debounce_key": "k", "debounce_seconds": 30})
    before = counts()
    r = _batch(api, [{"task": "echo", "payload": {}},
                     {"task": "sleep", "payload": {"seconds": 0}, "debounce_key": "k",
                      "debounce_seconds": 30}])  # fmt: skip
    assert r.status_code == 409 and "jobs.1.debounce_key" in r.json()["errors"], r.content
    assert counts() == before


def test_bad_flow_fields_in_a_batch_are_400_per_item(api):
    before = counts()
    r = _batch(
        api,
        [
            {"task": "echo", "payload": {}, "debounce_key": "k"},
            {"task": "echo", "payload": {}, "rate_limit": {"limit": 1, "period": 1}},
        ],
    )
    assert r.status_code == 400, r.content
    assert {"jobs.0.debounce_seconds", "jobs.1.rate_limit"} <= set(r.json()["errors"])
    assert counts() == before


def test_a_batch_with_callbacks_refuses_flow_fields_by_name(api):
    r = api.post("/api/v1/batches/", data=json.dumps({"jobs": [
        {"task": "echo", "payload": {}, "debounce_key": "k", "debounce_seconds": 1}],
        "on_complete": {"task": "echo"}}), content_type="application/json")  # fmt: skip
    assert r.status_code == 400 and "jobs.0.debounce_key" in r.json()["errors"], r.content
    assert Job.objects.count() == 0


def test_the_debounce_conflict_is_a_json_409(api):
    _post(api, {"task": "echo", "payload": {}, "debounce_key": "k", "debounce_seconds": 30})
    r = _post(api, {"task": "sleep", "payload": {"seconds": 0}, "debounce_key": "k",
                    "debounce_seconds": 30})  # fmt: skip
    assert r.status_code == 409, r.content
    assert r.json()["code"] == "debounce_conflict" and r.json()["job_id"]


def test_the_schema_documents_the_flow_fields_with_their_bounds(anon):
    from tests.api.test_schema import fetch_schema

    schema = fetch_schema(anon)
    parts = schema["components"]["schemas"]
    submit = parts["JobSubmit"]["properties"]
    assert submit["debounce_key"]["maxLength"] == 200
    assert submit["debounce_seconds"]["maximum"] == 86400
    assert submit["debounce_max_wait"]["maximum"] == 7 * 86400
    strategy = submit["key_strategy"]
    refs = [s.get("$ref") for s in strategy.get("oneOf", strategy.get("allOf", []))]
    enum = next(parts[r.rsplit("/", 1)[1]]["enum"] for r in refs if r)
    assert enum == ["queue", "cancel_running", "skip_new"]
    rate = parts["KeyRate"]["properties"]
    assert (rate["limit"]["minimum"], rate["limit"]["maximum"]) == (1, 1000)
    assert (rate["period"]["minimum"], rate["period"]["maximum"]) == (1, 86400)
    answer = parts["SubmittedJob"]["properties"]
    assert answer["debounced"]["type"] == answer["skipped"]["type"] == "boolean"
    batch = parts["BatchItem"]["properties"]
    assert {"debounce_key", "key_strategy", "rate_limit"} <= set(batch)
    assert "unique_key" not in batch
    result = parts["BatchJob"]["properties"]
    assert result["debounced"]["type"] == result["skipped"]["type"] == "boolean"
    post = schema["paths"]["/api/v1/jobs/"]["post"]["responses"]
    assert {"200", "201", "400", "409", "429"} <= set(post)
