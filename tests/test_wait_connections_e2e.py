"""Many `?wait=` requests arriving at once against the real server (issue 42.2, D238):
none answers 500 and the API never holds more PostgreSQL connections than its
WEB_THREADS per process, however many waits its extra threads hold.

The server logs in as a role of its own with a CONNECTION LIMIT, so that its
connections can be counted apart from everyone else's and a burst past the budget is
refused by PostgreSQL itself ("too many connections for role"), as a full
`max_connections` refuses it in production.
"""

from __future__ import annotations

import http.client
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from jobs import services
from jobs.models import Client
from tests.harness import database_url
from tests.test_metrics_e2e import ApiServer

pytestmark = pytest.mark.slow

THREADS = 2  # WEB_THREADS: the process's connection budget
WAITS = 60  # simultaneous waits, each on its own job (JOBS_API_WAIT_SLOTS holds them all)
LIMIT = THREADS + 2  # the role's CONNECTION LIMIT: the budget and a little slack


@pytest.fixture
def budget_role():
    """A login role with the test user's privileges and a connection limit."""
    name = f"waitbudget_{secrets.token_hex(4)}"
    admin = psycopg.connect(database_url(), autocommit=True)
    me = admin.execute("SELECT current_user").fetchone()[0]
    admin.execute(f'CREATE ROLE {name} LOGIN CONNECTION LIMIT {LIMIT} IN ROLE "{me}"')
    try:
        yield name, admin
    finally:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [name]
        )
        for _ in range(50):
            if not admin.execute(
                "SELECT 1 FROM pg_stat_activity WHERE usename = %s", [name]
            ).fetchone():
                break
            time.sleep(0.1)
        admin.execute(f"DROP ROLE {name}")
        admin.close()


def as_role(url: str, role: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, f"{role}@{host}", parts.path, parts.query, ""))


def wait_on(port: int, token: str, job_id: int, seconds: float) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=seconds + 60)
    try:
        conn.request(
            "GET", f"/api/v1/jobs/{job_id}/?wait={seconds}",
            headers={"Authorization": f"Token {token}"},
        )  # fmt: skip
        answer = conn.getresponse()
        answer.read()
        return f"{answer.status} {answer.getheader('Jobs-Wait')}"
    finally:
        conn.close()


def test_simultaneous_waits_stay_within_the_connection_budget(
    transactional_db, tmp_path, budget_role
):
    role, admin = budget_role
    owner, token = Client.create_with_token("many-waits")
    ids = [services.submit("echo", {}, client_id=owner.pk)[0].pk for _ in range(WAITS)]
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    server = ApiServer(
        tmp_path, metrics,
        DATABASE_URL=as_role(database_url(), role), WEB_CONCURRENCY="1",
        WEB_THREADS=str(THREADS), JOBS_API_WAIT_SLOTS=str(WAITS), DB_CONN_MAX_AGE="60",
    )  # fmt: skip
    peak, stop = [0], threading.Event()

    def sample() -> None:  # from before the first wait is sent
        while not stop.is_set():
            count = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE usename = %s", [role]
            ).fetchone()[0]
            peak[0] = max(peak[0], count)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with ThreadPoolExecutor(WAITS) as pool:
            answers = list(pool.map(lambda i: wait_on(server.port, token, i, 2.0), ids))
        # The server still serves a submission right after, within its budget.
        assert server.post("/api/v1/jobs/", {"task": "echo", "payload": {}}, token) == 201
    finally:
        stop.set()
        sampler.join()
        server.stop()
    tally = {a: answers.count(a) for a in set(answers)}
    assert tally == {"200 timeout": WAITS}, (tally, server.output()[-3000:])
    # The sampler saw the server's connections, never more than its WEB_THREADS lent ones
    # (the waiter's fallback poll borrows one of them too).
    assert 1 <= peak[0] <= THREADS, peak[0]
