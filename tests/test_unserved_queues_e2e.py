"""Jobs on a queue nobody serves are visible: dashboard, gauge, admin page; `*` serves them."""

from __future__ import annotations

import time

import pytest
from django.contrib.auth.models import User
from django.core.cache import cache
from django.urls import reverse

from jobs import services
from jobs.models import WorkerProcess
from tests.conftest import job_row
from tests.harness import free_port, wait_until
from tests.scrape import port_scrape

pytestmark = pytest.mark.slow

SWEEP = 1.0


def test_job_on_an_unserved_queue_is_reported_then_served_by_a_star_worker(stack, client):
    port = free_port()
    stack.reaper(
        "--interval", str(SWEEP), "--metrics-port", str(port), JOBS_METRICS_CACHE_SECONDS=str(SWEEP)
    )
    default_worker = stack.worker("--concurrency", "1")  # serves `default` only
    wait_until(
        lambda: WorkerProcess.objects.filter(pid=default_worker.pid).exists(),
        20,
        message="default worker registered",
    )
    wait_until(lambda: _scrape(port), 20, message="reaper metrics")
    job, _ = services.submit("echo", {"x": 1}, queue="orphan")
    submitted = time.monotonic()
    wait_until(
        lambda: _scrape(port).value("jobs_unserved_queue_depth", queue="orphan") == 1,
        2 * SWEEP + 3,
        interval=0.1,
        message="unserved gauge",
    )
    print(f"unserved gauge up {time.monotonic() - submitted:.2f}s after submission")
    scrape = _scrape(port)
    assert scrape.value("jobs_queue_consumers", queue="orphan") == 0
    assert scrape.value("jobs_unserved_queue_depth", queue="default") == 0

    admin = User.objects.create_superuser("ops", password="pw")
    client.force_login(admin)
    cache.clear()  # the dashboard is cached for a few seconds
    html = client.get(reverse("admin:jobs_job_dashboard")).content.decode()
    assert 'id="unserved-queues"' in html and "?queue=orphan" in html, html
    assert 'class="jd-unserved"' in html
    page = client.get(reverse("admin:jobs_job_change", args=[job.pk]), follow=True)
    assert "No worker serves the queue “orphan”" in page.content.decode()

    star = stack.worker("--concurrency", "1", "--queues", "*")
    wait_until(lambda: job_row(job.pk)["status"] == "done", 20, message="served by '*'")
    # runworker's second worker serves the webhook deliveries on threads of their own (D90).
    rows = sorted(r.queues for r in WorkerProcess.objects.filter(pid=star.pid))
    assert rows == [["*"], ["webhooks"]], rows
    wait_until(
        lambda: _scrape(port).value("jobs_queue_consumers", queue="orphan") == 1,
        2 * SWEEP + 3,
        interval=0.1,
        message="consumer counted",
    )
    assert _scrape(port).value("jobs_unserved_queue_depth", queue="orphan") == 0
    cache.clear()
    html = client.get(reverse("admin:jobs_job_dashboard")).content.decode()
    assert 'id="unserved-queues"' not in html


def _scrape(port: int):
    try:
        return port_scrape(port)
    except OSError:
        return None
