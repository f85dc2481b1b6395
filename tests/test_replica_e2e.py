"""Reads routed to a real streaming replica (DATABASE_REPLICA_URL, jobs/replica.py).

The module starts its own primary and replica (harness.pgpair: initdb, pg_basebackup -R),
migrates the primary, and runs two APIs, a worker and a reaper on them. Pausing the
replica's WAL replay makes the replica visibly stale, so each read shows where it went:
listings, history, admin list pages and scrapes read the replica; a job by id, writes
and a client's own listings right after it wrote read the primary; past the lag bound
everything reads the primary.
"""

from __future__ import annotations

import http.cookiejar
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from django.conf import settings as dj_settings

from harness import Processes, free_port, http_ok, manage, service_env, wait_until
from harness.pgpair import PostgresPair, available
from tests.runbook import run_check
from tests.scrape import port_scrape

# One group under `--dist loadgroup`: the module's primary and replica start once,
# not once on each worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("replica")]

TIGHT = 2.0  # seconds: the lag bound of the "tight" API; the others tolerate an hour


class Api:
    """Token (and, after `login`, staff session) calls to one gunicorn."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.cookies = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.cookies))

    def call(self, token: str, method: str, path: str, body: dict | None = None):
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, None

    def listed(self, token: str) -> set[int]:
        status, body = self.call(token, "GET", "/api/v1/jobs/?page_size=100")
        assert status == 200, status
        return {j["id"] for j in body["results"]}

    def login(self, username: str, password: str) -> None:
        url = f"http://127.0.0.1:{self.port}/admin/login/"
        page = self.opener.open(url, timeout=10).read().decode()
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)[1]
        form = {"username": username, "password": password, "csrfmiddlewaretoken": csrf,
                "next": "/admin/"}  # fmt: skip
        req = urllib.request.Request(url, data=urllib.parse.urlencode(form).encode(),
                                     headers={"Referer": url})  # fmt: skip
        self.opener.open(req, timeout=10).read()

    def admin_ids(self) -> set[int]:
        """Job ids on the admin's job list page."""
        page = self.opener.open(f"http://127.0.0.1:{self.port}/admin/jobs/job/", timeout=10)
        return {int(i) for i in re.findall(r"/admin/jobs/job/(\d+)/change/", page.read().decode())}

    def admin_detail(self, job_id: int) -> int:
        url = f"http://127.0.0.1:{self.port}/admin/jobs/job/{job_id}/change/"
        try:
            return self.opener.open(url, timeout=10).status
        except urllib.error.HTTPError as exc:
            return exc.code


class Topology:
    def __init__(self, pair: PostgresPair, env: dict[str, str], procs: Processes) -> None:
        self.pair, self.env, self.procs = pair, env, procs
        self.tokens: dict[str, str] = {}

    def manage(self, *args: str) -> str:
        import subprocess

        out = subprocess.run(manage(*args), env=self.env, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout.strip()

    def submit(self, client: str, queue: str = "default") -> int:
        """A job of `client` written on the primary without the API (so nothing pins)."""
        return int(self.manage("shell", "-c", (
            "from jobs import services; from jobs.models import Client; "
            f"print(services.submit('echo', {{}}, queue='{queue}', "
            f"client_id=Client.objects.get(name='{client}').pk)[0].pk)"
        )).splitlines()[-1])  # fmt: skip


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    reason = available()
    if reason:
        pytest.skip(reason)
    pair = PostgresPair().start()
    logs: Path = tmp_path_factory.mktemp("replica")
    try:
        env = service_env(
            pair.createdb("jobs"),
            dj_settings.REDIS_URL,
            dj_settings.JOBS_REDIS_PREFIX + "replica:",
            "demo.tasks",
            DATABASE_REPLICA_URL=pair.url("jobs", replica=True),
            JOBS_REPLICA_MAX_LAG_SECONDS="3600",
            JOBS_REPLICA_LAG_CHECK_SECONDS="0.2",
            JOBS_METRICS_CACHE_SECONDS="0.2",
        )
        top = Topology(pair, env, Processes(logs, env))
        top.manage("migrate", "--noinput")
        for name in ("A", "B"):
            top.tokens[name] = top.manage("createclient", name).splitlines()[-1]
        staff = "User.objects.create_superuser('staff', 'staff@example.com', 'pw-staff-1')"
        top.manage("shell", "-c", f"from django.contrib.auth.models import User; {staff}")
        top.loose, top.tight = Api(free_port()), Api(free_port())
        top.procs.api(top.loose.port, WEB_CONCURRENCY="1")
        top.procs.api(top.tight.port, WEB_CONCURRENCY="1",
                      JOBS_REPLICA_MAX_LAG_SECONDS=str(TIGHT))  # fmt: skip
        top.procs.worker("--concurrency", "2", "--queues", "default")
        top.reaper_port = free_port()
        reaper = top.procs.reaper("--metrics-port", str(top.reaper_port))
        # The tests scrape it at once (a test run first on its worker found it not up).
        wait_until(lambda: http_ok(top.reaper_port, "/metrics") or not reaper.alive(), 60,
                   "the reaper's metrics")  # fmt: skip
        assert reaper.alive(), reaper.output()
        for api in (top.loose, top.tight):
            api.login("staff", "pw-staff-1")
        yield top
    finally:
        try:
            if "top" in locals():
                top.procs.close()
        finally:
            pair.stop()


@pytest.fixture
def paused(topo):
    """The replica caught up, then its replay paused (resumed after the test)."""
    wait_until(topo.pair.caught_up, 30, "the replica to catch up")
    topo.pair.pause_replay()
    yield topo
    topo.pair.resume_replay()


def _lag(topo) -> float:
    return port_scrape(topo.reaper_port).value("jobs_replica_lag_seconds")


def test_listings_read_the_replica_a_job_by_id_and_a_writer_the_primary(paused):
    topo = paused
    a, b = topo.tokens["A"], topo.tokens["B"]
    job = topo.submit("A")  # written and run on the primary; the replica has not seen it
    wait_until(lambda: topo.loose.call(a, "GET", f"/api/v1/jobs/{job}/")[1]["status"] == "done",
               30, "the job done, read by id on the primary")  # fmt: skip
    # Listings and history read the replica: the job is not there yet.
    assert job not in topo.loose.listed(a)
    assert topo.loose.call(a, "GET", f"/api/v1/jobs/{job}/history/")[0] == 404
    # So does the admin's list page; the job's own page reads the primary.
    assert job not in topo.loose.admin_ids()
    assert topo.loose.admin_detail(job) == 200
    # A client that just wrote reads its listing from the primary: its own write is there.
    status, body = topo.loose.call(b, "POST", "/api/v1/jobs/", {"task": "echo", "payload": {}})
    assert status == 201
    assert topo.loose.call(b, "GET", f"/api/v1/jobs/{body['id']}/")[0] == 200
    assert body["id"] in topo.loose.listed(b)
    assert topo.loose.call(b, "GET", f"/api/v1/jobs/{body['id']}/history/")[0] == 200
    # Past the lag bound the replica is not used: the tight API reads the primary.
    wait_until(lambda: _lag(topo) > TIGHT + 0.5, 30, "the replica's lag past the bound")
    assert job in topo.tight.listed(a)
    assert job in topo.tight.admin_ids()
    assert job not in topo.loose.listed(a)  # still within the loose API's bound
    # Replay resumes: the replica catches up and the listing shows the job.
    topo.pair.resume_replay()
    wait_until(lambda: job in topo.loose.listed(a), 30, "the replica to replay the job")
    assert job in topo.loose.admin_ids()


def test_lag_is_exported_and_scrapes_read_the_replica(paused):
    """jobs_replica_lag_seconds grows while replay is paused and writes arrive, and is 0
    once caught up; the reaper's depth gauges (a collector) read the replica."""
    topo = paused
    queued = port_scrape(topo.reaper_port).value("jobs_depth", state="queued", queue="other")
    topo.submit("A", queue="other")  # no worker serves "other": it stays queued
    wait_until(lambda: _lag(topo) > 1.0, 30, "the lag to show")
    assert (
        port_scrape(topo.reaper_port).value("jobs_depth", state="queued", queue="other") == queued
    ), "the depth came from the primary"
    topo.pair.resume_replay()
    wait_until(lambda: _lag(topo) == 0.0, 30, "the lag back to 0")
    wait_until(
        lambda: (
            port_scrape(topo.reaper_port).value("jobs_depth", state="queued", queue="other")
            == queued + 1
        ),
        30,
        "the depth from the caught-up replica",
    )


def test_runbook_checks_for_the_replica(topo):
    """docs/operations.md "Past one Postgres", step 5, as written."""
    wait_until(topo.pair.caught_up, 30, "the replica to catch up")
    env = {**topo.env, "REAPER_METRICS": f"http://127.0.0.1:{topo.reaper_port}/metrics"}
    assert run_check("replica-streaming", env) == "streaming"
    wait_until(lambda: _lag(topo) == 0.0, 30, "no lag")
    assert run_check("replica-lag", env) == "jobs_replica_lag_seconds 0.0"
    assert run_check("replica-used", env) == "True"
