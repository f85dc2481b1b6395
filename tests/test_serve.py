"""The API's server (D135, D136) and what a worker loads at start (D137), on real processes."""

from __future__ import annotations

import http.client
import json
import re
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from jobs.models import Client, Job
from jobservice import serve
from tests.harness import database_url, wait_until
from tests.test_metrics_e2e import ApiServer


def test_the_default_server_is_granian_and_an_unknown_one_is_refused():
    assert serve.server_name({}) == "granian"
    assert serve.server_name({"JOBS_HTTP_SERVER": " Gunicorn "}) == "gunicorn"
    with pytest.raises(SystemExit, match="JOBS_HTTP_SERVER='uwsgi'"):
        serve.server_name({"JOBS_HTTP_SERVER": "uwsgi"})


def _post(conn: http.client.HTTPConnection, token: str) -> tuple[int, bool]:
    body = json.dumps({"task": "echo", "payload": {}})
    headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}
    conn.request("POST", "/api/v1/jobs/", body=body, headers=headers)
    resp = conn.getresponse()
    resp.read()
    return resp.status, resp.will_close


def _waiting_on_the_lock(other: psycopg.Connection) -> list[str]:
    return [q for (q,) in other.execute(
        "SELECT query FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'"
    )]  # fmt: skip


@pytest.mark.slow
def test_one_default_server_process_serves_two_kept_alive_connections_at_once(
    transactional_db, tmp_path
):
    """The reason for the default (D75, D135): a kept-alive connection stays with one
    process, and that process must still serve another client's request meanwhile. One
    worker process; the table is locked, so both clients' INSERTs wait inside it at the
    same time; then both answer, and both connections stay open."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    _, token = Client.create_with_token("keep-alive")
    api = ApiServer(tmp_path, metrics_dir, WEB_CONCURRENCY="1")
    conns = [http.client.HTTPConnection("127.0.0.1", api.port, timeout=30) for _ in range(2)]
    try:
        assert [_post(c, token) for c in conns] == [(201, False)] * 2  # warm, kept alive
        with (
            psycopg.connect(database_url(), autocommit=True) as other,
            psycopg.connect(database_url()) as locker,
            ThreadPoolExecutor(2) as pool,
        ):
            locker.execute("LOCK TABLE jobs_job IN EXCLUSIVE MODE")
            try:
                answers = [pool.submit(_post, c, token) for c in conns]
                wait_until(lambda: len(_waiting_on_the_lock(other)) == 2, 20,
                           "both requests inside the one process at once")  # fmt: skip
                assert all("jobs_job" in q for q in _waiting_on_the_lock(other))
            finally:
                locker.rollback()
            assert [a.result(timeout=20) for a in answers] == [(201, False)] * 2
        assert Job.objects.count() == 4
    finally:
        for c in conns:
            c.close()
        assert api.stop() == 0


# Modules a worker never needs: the admin's registrations, the API, its OpenAPI schema,
# the URLconf that pulls them all in.
NOT_FOR_WORKERS = re.compile(
    r"\| +(jobs\.admin|jobs\.api|drf_spectacular\.openapi|jobservice\.urls)(\.|\s*$)", re.M
)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["runworker", "runreaper"])
def test_a_worker_starts_without_the_admin_the_api_or_the_urlconf(stack, command):
    """`python -X importtime` (PYTHONPROFILEIMPORTTIME) of a real start: up to the
    running process's first line, none of those modules was imported (D137)."""
    svc = stack.start(command, PYTHONPROFILEIMPORTTIME="1")
    started = "worker started" if command == "runworker" else "reaper"
    wait_until(lambda: re.search(rf"INFO .*{started}", svc.output()) or not svc.alive(), 60,
               f"{command} to start")  # fmt: skip
    svc.stop()
    out = svc.output()
    assert "import time:" in out
    assert "jobs.services" in out  # the import list is there...
    assert not NOT_FOR_WORKERS.findall(out), NOT_FOR_WORKERS.findall(out)  # ... without these


@pytest.mark.slow
def test_a_process_serves_more_kept_alive_connections_than_it_has_threads(
    transactional_db, tmp_path
):
    """granian's backpressure counts connections (D149): with it at the thread count, a
    connection beyond the threads of its process was not accepted until another one
    closed, and its first request waited for the whole of a benchmark run (the 10 s
    outlier). One process, one thread: the second kept-alive connection is answered while
    the first stays open, and the first is still served afterwards."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    _, token = Client.create_with_token("many-connections")
    api = ApiServer(tmp_path, metrics_dir, WEB_CONCURRENCY="1", WEB_THREADS="1")
    conns = [http.client.HTTPConnection("127.0.0.1", api.port, timeout=5) for _ in range(3)]
    try:
        assert _post(conns[0], token) == (201, False)  # held open from here on
        assert [_post(c, token) for c in conns[1:]] == [(201, False)] * 2
        assert [_post(c, token) for c in conns] == [(201, False)] * 3
        assert Job.objects.count() == 6
    finally:
        for c in conns:
            c.close()
        assert api.stop() == 0


@pytest.mark.slow
def test_a_token_and_an_idempotency_key_in_any_spelling_through_the_default_server(
    transactional_db, tmp_path
):
    """The token and the key are read from the environ (HTTP_AUTHORIZATION,
    HTTP_IDEMPOTENCY_KEY), not from request.headers (D151): a header in any case, as the
    server passes it, is the same, and a request without a key is not a replay."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    _, token = Client.create_with_token("spellings")
    api = ApiServer(tmp_path, metrics_dir, WEB_CONCURRENCY="1")
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=10)
    body = json.dumps({"task": "echo", "payload": {}})

    def post(auth: str = "Authorization", **headers: str) -> tuple[int, int]:
        conn.request("POST", "/api/v1/jobs/", body=body, headers={
            auth: f"Token {token}", "Content-Type": "application/json", **headers
        })  # fmt: skip
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())["id"]

    try:
        status, first = post(**{"idempotency-key": "order-7"})
        assert status == 201
        assert post("authorization", **{"IDEMPOTENCY-KEY": "order-7"}) == (200, first)
        assert post(**{"Idempotency-Key": "order-7"}) == (200, first)
        status, other = post()
        assert status == 201 and other != first
        assert Job.objects.filter(idempotency_key="order-7").count() == 1
    finally:
        conn.close()
        assert api.stop() == 0
