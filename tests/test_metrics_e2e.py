"""Scrape every process's /metrics after real work (SPEC §7): the API under each server
(granian, gunicorn) with two workers in multiprocess mode, a worker, a reaper, and a stale
worker fenced off.

Each counter must have moved by exactly the number of events the test caused, in the
process that caused them and nowhere else; logs are checked to be JSON lines that carry
the job's identity.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.utils import timezone
from prometheus_client import multiprocess

from harness import Service, api_server, http_ok
from jobs import selectors, services
from jobs.conf import settings as jobs_settings
from jobs.models import Client, Job, JobEvent
from jobs.transport import get_transport
from tests.conftest import job_row
from tests.harness import database_url, free_port, wait_until
from tests.scrape import Scrape, json_lines, parse, port_scrape, scrape

pytestmark = pytest.mark.slow


# --- the API: two server workers, one aggregated /metrics ---------------------------


class ApiServer:
    """The API as `make run` starts it (jobservice.serve), against the test database."""

    def __init__(self, tmp: Path, metrics_dir: Path, **env: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = Service(
            "api",
            api_server(),
            {
                **os.environ,
                "DJANGO_SETTINGS_MODULE": "jobservice.settings",
                "DATABASE_URL": database_url(),
                "REDIS_URL": settings.REDIS_URL,
                "JOBS_REDIS_PREFIX": settings.JOBS_REDIS_PREFIX,
                "BIND": f"127.0.0.1:{self.port}",
                "WEB_CONCURRENCY": "2",
                "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
                "LOG_FORMAT": "json",
                "DEBUG": "0",
                **env,
            },
            tmp / "api.log",
        ).start()
        wait_until(self.healthy, 30, interval=0.1, message="the API answering /healthz")

    def healthy(self) -> bool:
        assert self.server.alive(), self.output()
        return http_ok(self.port)

    def post(self, path: str, body: dict, token: str) -> int:
        req = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status

    def metrics(self) -> Scrape:
        return scrape(self.base + "/metrics")

    def worker_pids(self) -> set[int]:
        return set(self.server.children())

    def output(self) -> str:
        return self.server.output()

    def stop(self) -> int | None:
        return self.server.stop(grace=20)


def submitted_per_file(metrics_dir: Path) -> dict[str, float]:
    """jobs_submitted_total as each process's own file holds it."""
    out = {}
    for path in sorted(metrics_dir.glob("counter_*.db")):
        total = 0.0
        for family in multiprocess.MultiProcessCollector.merge([str(path)], accumulate=True):
            total += sum(s.value for s in family.samples if s.name == "jobs_submitted_total")
        out[path.name] = total
    return out


def write_stale_counter(metrics_dir: Path) -> Path:
    """A counter file as an earlier run would have left it: 1000 submissions."""
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from prometheus_client import Counter\n"
            "Counter('jobs_submitted', 'x', ['queue', 'task']).labels('default', 'echo').inc(1000)",
        ],
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)},
        check=True,
    )
    (stale,) = metrics_dir.glob("counter_*.db")
    return stale


# The server's line for a worker it started, in its own words.
BOOT_LINE = {"granian": "Spawning worker", "gunicorn": "Booting worker"}
# ... and its error line for the worker this test kills.
KILLED_LINE = {"granian": "Unexpected exit from worker", "gunicorn": "SIGKILL"}


@pytest.mark.parametrize("server", ["granian", "gunicorn"])
def test_api_submissions_over_two_server_workers_are_summed_in_one_scrape(
    transactional_db, tmp_path, server
):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    stale = write_stale_counter(metrics_dir)
    _, token = Client.create_with_token("obs-api")
    api = ApiServer(tmp_path, metrics_dir, JOBS_HTTP_SERVER=server)
    try:
        assert not stale.exists(), "the multiprocess directory was not emptied on start"
        workers = api.worker_pids()
        assert len(workers) == 2

        # Concurrent submissions, a fresh connection each, until both workers took some.
        submitted = 0
        with ThreadPoolExecutor(8) as pool:
            for _ in range(20):
                codes = list(
                    pool.map(
                        lambda i: api.post(
                            "/api/v1/jobs/", {"task": "echo", "payload": {"i": i}}, token
                        ),
                        range(submitted, submitted + 16),
                    )
                )
                assert codes == [201] * 16
                submitted += 16
                per_file = submitted_per_file(metrics_dir)
                if len([v for v in per_file.values() if v > 0]) >= 2:
                    break
        per_file = submitted_per_file(metrics_dir)
        assert len([v for v in per_file.values() if v > 0]) == 2, per_file
        assert sum(per_file.values()) == submitted
        assert Job.objects.count() == submitted

        m = api.metrics()
        assert m.value("jobs_submitted_total") == submitted
        assert m.value("jobs_submitted_total", queue="default", task="echo") == submitted
        assert m.value("django_http_responses_total_by_status_total", status="201") == submitted
        assert m.value("jobs_enqueue_failed_total") == 0
        assert m.value("jobs_finished_total") == 0  # nothing ran in the API
        # Counters carry no pid label: the processes' values were summed.
        assert all("pid" not in labels for labels, _ in m.series("jobs_submitted_total"))

        # A server worker dies and is replaced: its counts stay in the sum.
        victim = max(per_file, key=per_file.get)
        victim_pid = int(victim.removeprefix("counter_").removesuffix(".db"))
        os.kill(victim_pid, signal.SIGKILL)
        wait_until(
            lambda: len(api.worker_pids() - {victim_pid}) == 2, 30, message="a replacement worker"
        )
        wait_until(api.healthy, 30, message="healthy again")
        with ThreadPoolExecutor(4) as pool:
            codes = list(
                pool.map(
                    lambda i: api.post("/api/v1/jobs/", {"task": "echo", "payload": {}}, token),
                    range(8),
                )
            )
        assert codes == [201] * 8
        m = api.metrics()
        assert m.value("jobs_submitted_total") == submitted + 8
        assert Job.objects.count() == submitted + 8
    finally:
        assert api.stop() == 0
    output = api.output()
    lines = json_lines(output)  # every line the API's processes wrote is JSON
    assert any(BOOT_LINE[server] in d["msg"] for d in lines), output
    assert not [d for d in lines if "job_id" in d], "per-job lines on the submission hot path"
    assert not [
        d
        for d in lines
        if d["level"] in ("error", "critical") and KILLED_LINE[server] not in d["msg"]
    ], output


# --- a worker -----------------------------------------------------------------------


def test_worker_metrics_count_each_claim_attempt_and_outcome_once(stack):
    port = free_port()
    ok = [services.submit("echo", {"n": i})[0].pk for i in range(20)]
    bad, _ = services.submit("fail", {"message": "always"}, max_retries=1)
    # Every ok job signalled twice more: 40 deliveries that find the job already taken.
    services.push_now_ignoring_rollback([(i, "default") for i in ok] * 2)
    w = stack.worker(
        "--concurrency",
        "2",
        "--metrics-port",
        str(port),
        JOBS_RETRY_BACKOFF_BASE="0.1",
        LOG_FORMAT="json",
    )
    ids = [*ok, bad.pk]
    wait_until(
        lambda: (
            set(Job.objects.filter(pk__in=ids).values_list("status", flat=True))
            <= {"done", "failed"}
        ),
        30,
        message="all terminal",
    )
    wait_until(
        lambda: port_scrape(port).value("jobs_duplicate_deliveries_total") >= 40,
        15,
        message="every duplicate signal consumed",
    )
    key = f"{stack.env['JOBS_REDIS_PREFIX']}q:default"
    assert get_transport()._client.llen(key) == 0

    m = port_scrape(port)
    assert m.value("jobs_claimed_total", queue="default") == 22  # 20 + 2 attempts of `fail`
    assert m.value("jobs_duration_seconds_count") == 22
    assert m.value("jobs_duration_seconds_count", task="fail") == 2
    assert m.value("jobs_finished_total", outcome="done") == 20
    assert m.value("jobs_finished_total", outcome="failed", task="fail") == 1
    assert m.value("jobs_time_to_terminal_seconds_count", outcome="done") == 20
    assert m.value("jobs_time_to_terminal_seconds_count", outcome="failed") == 1
    assert m.value("jobs_time_to_terminal_seconds_bucket", le="+Inf") == 21
    assert m.value("jobs_retried_total", task="fail") == 1
    assert m.value("jobs_retries_count", outcome="failed") == 1
    assert m.value("jobs_retries_sum", outcome="failed") == 2  # failed with retry_count 2
    assert m.value("jobs_retries_sum", outcome="done") == 0
    assert m.value("jobs_duplicate_deliveries_total", queue="default") == 40
    assert m.value("jobs_fence_rejections_total") == 0
    assert m.value("jobs_redis_errors_total") == 0
    assert m.value("jobs_submitted_total") == 0  # submissions belong to whoever submitted
    assert m.value("jobs_lease_expired_total") == 0  # and expiries to the reaper
    assert m.value("jobs_worker_slots") == 2
    assert m.value("jobs_worker_inflight") == 0
    assert not m.has("jobs_depth")  # only the reaper reads depth from Postgres

    w.signal(signal.SIGTERM)
    assert w.wait(15) == 0
    lines = json_lines(w.output())
    about_jobs = [d for d in lines if "job_id" in d]
    # A healthy job leaves no line; the failing one logs each failed attempt.
    assert {d["job_id"] for d in about_jobs} == {bad.pk}
    assert len(about_jobs) == 2
    for d in about_jobs:
        assert {"lease_version", "worker_id", "queue", "task"} <= set(d), d
    assert [d["lease_version"] for d in about_jobs] == [1, 3]  # a retry bumps the lease too
    lifecycle = [d["msg"] for d in lines if d["level"] == "info" and "job_id" not in d]
    assert "worker started" in lifecycle and "worker stopped" in lifecycle


# --- the reaper and a stale worker ---------------------------------------------------


def test_reaper_counts_the_expired_lease_and_the_stale_worker_its_fence_rejection(stack):
    job, _ = services.submit("demo.record", {"seconds": 2.5})
    ports = {name: free_port() for name in ("stale", "fresh", "reaper")}
    stale = stack.worker(
        "--concurrency",
        "1",
        "--metrics-port",
        str(ports["stale"]),
        JOBS_LEASE_SECONDS="1",
        LOG_FORMAT="json",
    )
    wait_until(lambda: job_row(job.pk)["status"] == "processing", 15, message="claimed")
    stale_owner = job_row(job.pk)["owned_by"]
    stale.signal(signal.SIGSTOP)
    # A 3 s lease for the reaper: the stopped worker's expires, while the fresh worker's
    # heartbeats (every 1/3 s) keep a wide margin even on a loaded machine.
    reaper = stack.reaper(
        "--interval",
        "0.2",
        "--lease",
        "3",
        "--metrics-port",
        str(ports["reaper"]),
        LOG_FORMAT="json",
    )
    wait_until(lambda: job_row(job.pk)["lease_version"] == 2, 15, message="lease reaped")
    fresh = stack.worker(
        "--concurrency",
        "1",
        "--metrics-port",
        str(ports["fresh"]),
        JOBS_LEASE_SECONDS="1",
        LOG_FORMAT="json",
    )
    wait_until(lambda: job_row(job.pk)["status"] == "done", 20, message="fresh worker done")
    stale.signal(signal.SIGCONT)
    wait_until(
        lambda: JobEvent.objects.filter(job_id=job.pk, kind="fence_rejected").exists(),
        15,
        message="stale write rejected",
    )
    wait_until(
        lambda: port_scrape(ports["stale"]).value("jobs_worker_inflight") == 0,
        15,
        message="stale worker let go of the job",
    )

    r = port_scrape(ports["reaper"])
    assert r.value("jobs_lease_expired_total", queue="default") == 1
    assert r.value("jobs_recovered_total", kind="lease") == 1
    for kind in ("enqueue_failed", "lost_signal", "scheduled", "over_budget"):
        assert r.value("jobs_recovered_total", kind=kind) == 0, kind
    assert r.value("jobs_reaper_sweeps_total") >= 1
    assert r.value("jobs_reaper_sweep_duration_seconds_count") >= 1
    assert time.time() - r.value("jobs_reaper_last_sweep_timestamp_seconds") < 10
    assert r.value("jobs_reaper_interval_seconds") == 0.2
    assert r.value("jobs_finished_total") == 0  # requeued, not failed
    assert r.value("jobs_depth", state="processing") == 0  # the reaper exports depth
    assert r.value("jobs_depth", state="queued") == 0

    s = port_scrape(ports["stale"])
    rejected_writes = s.value("jobs_fence_rejections_total", op="complete") + s.value(
        "jobs_fence_rejections_total", op="fail"
    )
    assert rejected_writes == 1  # its one late result
    heartbeats_rejected = s.value("jobs_fence_rejections_total", op="heartbeat")
    assert heartbeats_rejected in (0, 1)  # its heartbeat may have noticed first, once
    assert s.value("jobs_claimed_total") == 1
    assert s.value("jobs_finished_total") == 0

    f = port_scrape(ports["fresh"])
    assert f.value("jobs_claimed_total") == 1
    assert f.value("jobs_finished_total", outcome="done", task="demo.record") == 1
    assert f.value("jobs_time_to_terminal_seconds_count") == 1
    assert f.value("jobs_fence_rejections_total") == 0

    for p in (stale, fresh, reaper):
        p.signal(signal.SIGTERM)
        assert p.wait(15) == 0
    # The reaper's line names the lease it took away and the worker that held it.
    (expired,) = [d for d in json_lines(reaper.output()) if d.get("job_id") == job.pk]
    assert expired["level"] == "warning" and expired["msg"].startswith("lease expired")
    assert "3.0s" in expired["msg"]
    assert (expired["lease_version"], expired["new_lease_version"]) == (1, 2)
    assert (expired["worker_id"], expired["queue"], expired["task"]) == (
        stale_owner,
        "default",
        "demo.record",
    )
    # The stale worker's lines: the fence rejection with both lease versions.
    stale_lines = [d for d in json_lines(stale.output()) if d.get("job_id") == job.pk]
    (fenced,) = [d for d in stale_lines if d["msg"].startswith("fence rejected")]
    assert fenced["level"] == "warning"
    assert (fenced["lease_version"], fenced["current_lease_version"]) == (1, 3)
    assert fenced["worker_id"] == stale_owner and fenced["task"] == "demo.record"
    lost = [d for d in stale_lines if d["msg"].startswith("lost authority")]
    assert len(lost) == heartbeats_rejected


def test_depth_and_age_gauges_from_the_reaper_match_the_database(stack):
    port = free_port()
    reaper = stack.reaper(
        "--interval",
        "3600",
        "--lease",
        "3600",
        "--metrics-port",
        str(port),
        JOBS_METRICS_CACHE_SECONDS="2",
    )
    wait_until(
        lambda: (
            _try_scrape(port)
            and _try_scrape(port).value("jobs_reaper_last_sweep_timestamp_seconds") > 0
        ),
        20,
        message="first sweep",
    )
    # Its next sweep is an hour away: the state below stays as built.
    due = [services.submit("echo", {}, queue="obs-a")[0].pk for _ in range(3)]
    services.submit("echo", {}, queue="obs-a", run_at=timezone.now() + timedelta(hours=1))
    assert services.claim("w-elsewhere", due[0])
    parked = [services.submit("echo", {}, queue="obs-b")[0].pk for _ in range(2)]
    services.mark_enqueue_failed(parked)
    done = services.claim("w-elsewhere", due[1])
    services.complete([(done, None)])
    time.sleep(2.5)  # ages worth measuring, and past the cache

    m = port_scrape(port)
    db_now = selectors.db_now()
    expected = {}
    for state in ("queued", "processing", "enqueue_failed"):
        for queue in ("obs-a", "obs-b"):
            expected[(state, queue)] = Job.objects.filter(status=state, queue=queue).count()
    assert expected == {
        ("queued", "obs-a"): 2,
        ("processing", "obs-a"): 1,
        ("enqueue_failed", "obs-a"): 0,
        ("queued", "obs-b"): 0,
        ("processing", "obs-b"): 0,
        ("enqueue_failed", "obs-b"): 2,
    }
    got = {(lab["state"], lab["queue"]): v for lab, v in m.series("jobs_depth")}
    assert got == expected

    def age(state: str, queue: str) -> float:
        return m.value("jobs_oldest_age_seconds", state=state, queue=queue)

    rows = {j.pk: j for j in Job.objects.filter(queue__in=["obs-a", "obs-b"])}
    oldest_due = max(
        db_now - max(j.run_at, j.updated_at)
        for j in rows.values()
        if j.status == "queued" and j.run_at <= db_now
    ).total_seconds()
    claimed = (db_now - rows[due[0]].claimed_at).total_seconds()
    parked_for = max(db_now - rows[i].updated_at for i in parked).total_seconds()
    # The scrape read the database just before db_now (within a scrape and the cache).
    for measured, truth in (
        (age("queued", "obs-a"), oldest_due),
        (age("processing", "obs-a"), claimed),
        (age("enqueue_failed", "obs-b"), parked_for),
    ):
        assert truth - 2.5 <= measured <= truth, (measured, truth)
        assert measured >= 2.0
    assert age("queued", "obs-b") == 0 and age("processing", "obs-b") == 0
    # The partitions (D191): the finished job is within its hot window; the first sweep
    # made the periods ahead.
    assert m.value("jobs_partition_move_lag_seconds") == 0
    ahead = jobs_settings.JOBS_PARTITION_AHEAD * 7 * 86400
    assert m.value("jobs_partition_runway_seconds") >= ahead

    # Cached between scrapes: a new job shows only once the reading is older than 2 s.
    services.submit("echo", {}, queue="obs-a")
    first = port_scrape(port).value("jobs_depth", state="queued", queue="obs-a")
    wait_until(
        lambda: port_scrape(port).value("jobs_depth", state="queued", queue="obs-a") == 3,
        10,
        interval=0.2,
        message="the next reading",
    )
    assert first in (2, 3)
    reaper.signal(signal.SIGTERM)
    assert reaper.wait(15) == 0


def _try_scrape(port: int) -> Scrape | None:
    try:
        return port_scrape(port)
    except OSError:
        return None


def test_multiproc_dir_in_the_environment_does_not_reach_workers(stack, tmp_path):
    """A PROMETHEUS_MULTIPROC_DIR meant for the API must not switch a worker or the reaper
    to file-backed metrics: they serve their own registry."""
    shared = tmp_path / "api-metrics"
    shared.mkdir()
    port = free_port()
    w = stack.worker("--metrics-port", str(port), PROMETHEUS_MULTIPROC_DIR=str(shared))
    job, _ = services.submit("echo", {})
    wait_until(lambda: job_row(job.pk)["status"] == "done", 20, message="done")
    wait_until(
        lambda: _try_scrape(port) and _try_scrape(port).value("jobs_finished_total") == 1,
        10,
        message="scraped",
    )
    assert list(shared.iterdir()) == []
    w.signal(signal.SIGTERM)
    assert w.wait(15) == 0


def test_parse_reads_the_exposition_format():
    m = parse('# TYPE x_total counter\nx_total{a="1"} 2.0\nx_total{a="2"} 3.0\n')
    assert m.value("x_total") == 5 and m.value("x_total", a="2") == 3
