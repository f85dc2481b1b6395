"""The single submission's edges through the real server (`jobservice.serve`, granian),
with the lane on and off: both paths answer alike, and the answers are Django's."""

from __future__ import annotations

import http.client
import json
import socket
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPMessage

import psycopg
import pytest

from jobs.models import Client, Job
from tests.factories import JobFactory
from tests.harness import database_url, wait_until
from tests.scrape import json_lines
from tests.test_metrics_e2e import ApiServer

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PATHS = pytest.mark.parametrize("lane", ["1", "0"], ids=["fast-lane", "django"])
BODY = b'{"task": "echo", "payload": {"n": 1}}'
SERVER_ERROR = {"detail": "Internal server error.", "code": "server_error"}
BY_STATUS = "django_http_responses_total_by_status_total"


def _api(tmp_path, lane: str, **env: str) -> ApiServer:
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    return ApiServer(tmp_path, metrics_dir, WEB_CONCURRENCY="1", JOBS_API_FAST_LANE=lane, **env)


def _post(api: ApiServer, token: str) -> tuple[int, HTTPMessage, bytes]:
    """A plain submission, as the lane serves it."""
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=30)
    try:
        conn.request("POST", "/api/v1/jobs/", body=BODY, headers={
            "Authorization": f"Token {token}", "Content-Type": "application/json",
        })  # fmt: skip
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()  # headers by any case
    finally:
        conn.close()


def _post_chunked(
    api: ApiServer, token: str, chunks: list[bytes]
) -> tuple[int, HTTPMessage, bytes]:
    """A submission sent chunked, without a Content-Length, in one write: the server may
    answer from the headers and close, and a second write would then meet a closed
    socket (a broken pipe) before the answer is read."""
    body = b"".join(b"%X\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    head = (
        f"POST /api/v1/jobs/ HTTP/1.1\r\nHost: 127.0.0.1:{api.port}\r\n"
        f"Authorization: Token {token}\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", api.port), timeout=30) as sock:
        sock.sendall(head + body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, resp.headers, resp.read()


def _waiting_on(other: psycopg.Connection, table: str) -> int | None:
    """The backend whose statement on `table` waits for a lock, if any."""
    row = other.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND query LIKE %s",
        [f"%{table}%"],
    ).fetchone()
    return row[0] if row else None


@PATHS
def test_a_database_error_on_the_client_lookup_is_djangos_json_500_counted_and_logged(
    tmp_path, lane
):
    """A token not in the client cache is looked up in PostgreSQL; the server's session
    is ended while that lookup waits for a lock: the answer is Django's JSON 500 with the
    security headers, counted in the series the JobsApiErrors alert reads, logged with
    its traceback, and the next request is served."""
    _, token = Client.create_with_token("db-error")
    api = _api(tmp_path, lane)
    try:
        before = api.metrics().value(BY_STATUS, status="500")
        with (
            psycopg.connect(database_url()) as locker,
            psycopg.connect(database_url(), autocommit=True) as other,
            ThreadPoolExecutor(1) as pool,
        ):
            locker.execute("LOCK TABLE jobs_client IN ACCESS EXCLUSIVE MODE")
            try:
                answer = pool.submit(_post, api, token)
                pid = wait_until(lambda: _waiting_on(other, "jobs_client"), 20,
                                 message="the client lookup waiting on the lock")  # fmt: skip
                assert other.execute("SELECT pg_terminate_backend(%s, 10000)", [pid]).fetchone()[0]
            finally:
                locker.rollback()
            status, headers, body = answer.result(timeout=30)
        assert status == 500, (status, headers, body)
        assert json.loads(body) == SERVER_ERROR
        assert headers["Content-Type"] == "application/json"
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["X-Frame-Options"] == "DENY"
        assert "Referrer-Policy" in headers
        counted = wait_until(
            lambda: api.metrics().value(BY_STATUS, status="500") - before or None,
            10,
            message="the 500 counted",
        )
        assert counted == 1
        logged = wait_until(lambda: [
            d for d in json_lines(api.output())
            if d["level"] == "error" and d["msg"] == "Internal Server Error: /api/v1/jobs/"
        ], 10, message="the 500 logged")  # fmt: skip
        assert len(logged) == 1 and "terminating connection" in logged[0]["exc"], logged
        assert _post(api, token)[0] == 201  # a new session for the next request
        assert Job.objects.count() == 1
    finally:
        assert api.stop() == 0


@PATHS
def test_a_submission_refused_for_a_full_queue_is_charged_to_the_throttle_once(tmp_path, lane):
    """JOBS_API_THROTTLE=6/minute and a full queue: six 429 queue_full, then throttled."""
    _, token = Client.create_with_token("throttled-once")
    JobFactory.create_batch(2)
    api = _api(tmp_path, lane, JOBS_API_THROTTLE="6/minute", JOBS_MAX_QUEUE_DEPTH="1")
    try:
        codes = []
        for _ in range(7):
            status, _, body = _post(api, token)
            codes.append((status, json.loads(body)["code"]))
        assert codes == [(429, "queue_full")] * 6 + [(429, "throttled")]
        assert Job.objects.count() == 2
    finally:
        assert api.stop() == 0


@PATHS
def test_a_chunked_body_without_a_length_is_refused_411_and_changes_nothing(tmp_path, lane):
    """`Transfer-Encoding: chunked` without Content-Length: the body is not taken as
    empty (a 400 about a missing field the client did send), it is refused by name."""
    _, token = Client.create_with_token("chunked")
    api = _api(tmp_path, lane)
    try:
        status, headers, body = _post_chunked(api, token, [BODY[:10], BODY[10:]])
        assert status == 411, body
        assert json.loads(body)["code"] == "length_required"
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert wait_until(lambda: api.metrics().value(BY_STATUS, status="411"), 10,
                          message="the 411 counted") == 1  # fmt: skip
        assert not Job.objects.exists()
        assert _post(api, token)[0] == 201  # the same body with its length is served
    finally:
        assert api.stop() == 0
