"""The database backend's health check (jobservice/postgresql, D76): a request on a
healthy persistent connection costs no `SELECT 1`, and a session the server ended is
still found out before the request's first query, so the request is answered."""

from __future__ import annotations

import json
import select
import urllib.error
import urllib.request

import psycopg
import pytest
from django.db import connection, connections

from jobs import clientcache
from jobs.models import Client, Job
from tests.harness import database_url

pytestmark = pytest.mark.django_db(transaction=True)


def _other():
    return psycopg.connect(database_url(), autocommit=True)


def test_the_backend_is_ours():
    assert connection.settings_dict["ENGINE"] == "jobservice.postgresql"
    assert type(connections["default"]).__module__ == "jobservice.postgresql.base"


def test_a_healthy_idle_connection_is_usable_without_a_statement():
    with connection.cursor() as cur:
        cur.execute("SELECT 'marker for the health check test'")
    pid = connection.connection.info.backend_pid
    assert connection.is_usable()
    with _other() as other:
        query = other.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", [pid])
        assert query.fetchone()[0] == "SELECT 'marker for the health check test'"  # no SELECT 1


def test_a_session_the_server_ended_is_unusable():
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    with _other() as other:
        assert other.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()[0]
    assert select.select([connection.connection.fileno()], [], [], 10)[0]
    assert not connection.is_usable()
    connection.close()


def _post(base: str, token: str) -> int:
    req = urllib.request.Request(
        base + "/api/v1/jobs/",
        data=json.dumps({"task": "echo", "payload": {}}).encode(),
        headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.slow
@pytest.mark.parametrize("lane", ["1", "0"], ids=["fast-lane", "django"])
def test_the_api_answers_after_the_server_ended_its_sessions(tmp_path, lane):
    """Every session of the API's workers is terminated between requests: the next
    requests reconnect before their first query (the INSERT of a single submission,
    which bypasses Django's cursor) instead of failing with a 500; through the single
    submission's lane (its request signals) as through Django."""
    from tests.test_metrics_e2e import ApiServer

    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    client, token = Client.create_with_token("health-check-e2e")
    api = ApiServer(tmp_path, metrics_dir, JOBS_API_FAST_LANE=lane)
    try:
        assert [_post(api.base, token) for _ in range(10)] == [201] * 10
        mine = connection.connection.info.backend_pid if connection.connection else 0
        with _other() as other:
            ended = other.execute(
                # The timeout waits for each backend to be gone: without it the signal may
                # land after the next request's health check, inside its statement.
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000))"
                " FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid NOT IN (pg_backend_pid(), %s)",
                [mine],
            ).fetchone()[0]
        assert ended >= 1
        # The token's next lookup reads the row through Django's cursor, which checks
        # nothing itself: close_old_connections at the request's start must have.
        clientcache.forget([client.token_hash])
        assert [_post(api.base, token) for _ in range(10)] == [201] * 10
        assert Job.objects.count() == 20
    finally:
        assert api.stop() == 0
