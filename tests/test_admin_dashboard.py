"""The admin dashboard: its figures, its cache, and that every query it runs is
answered through an index, never a scan of the jobs table."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from django.core.cache import cache
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobs import selectors, services
from jobs.admin import dashboard
from tests.factories import JobFactory, raw

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _empty_cache():
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def staff(client):
    user = User.objects.create_user("dora", password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename="view_job"))
    client.force_login(user)
    return user


def build_mix() -> dict[str, int]:
    """Two queues, every state, known latencies (times shifted with the database clock)."""
    ids = {}
    ids["due"] = JobFactory.create(queue="default").pk
    ids["scheduled"], _ = services.submit("echo", {}, queue="default", run_at=None)
    ids["scheduled"] = ids["scheduled"].pk
    raw("UPDATE jobs_job SET run_at = now() + interval '1 hour' WHERE id = %s", [ids["scheduled"]])
    raw("UPDATE jobs_job SET run_at = now() - interval '30 seconds' WHERE id = %s", [ids["due"]])
    ids["running"] = JobFactory.create(status="processing", queue="mail").pk
    ids["stuck"] = JobFactory.create(status="processing", queue="mail").pk
    raw(
        "UPDATE jobs_job SET heartbeat_at = now() - interval '1 minute' WHERE id = %s",
        [ids["stuck"]],
    )
    ids["parked"] = JobFactory.create(status="enqueue_failed", queue="mail").pk
    ids["fast_done"] = JobFactory.create(status="done", queue="default").pk
    ids["slow_done"] = JobFactory.create(status="done", queue="mail").pk
    raw(
        "UPDATE jobs_job SET created_at = finished_at - interval '40 seconds', "
        "due_at = finished_at - interval '40 seconds' WHERE id = %s",
        [ids["slow_done"]],
    )
    ids["failed"] = JobFactory.create(status="failed", queue="default").pk
    ids["old_done"] = JobFactory.create(status="done").pk
    raw(
        "UPDATE jobs_job SET finished_at = now() - interval '2 hours', "
        "created_at = now() - interval '3 hours', due_at = now() - interval '3 hours' "
        "WHERE id = %s",
        [ids["old_done"]],
    )
    return ids


def test_dashboard_figures(settings):
    settings.JOBS_LEASE_SECONDS = 15
    settings.JOBS_SLO_SECONDS = 25
    build_mix()
    board = dashboard.dashboard()
    queues = {q.queue: q for q in board.queues}
    assert set(queues) == {"default", "mail"}
    d, m = queues["default"], queues["mail"]
    assert (d.queued, d.queued_due, d.done, d.failed) == (2, 1, 1, 1)
    assert 29 <= d.oldest_due_seconds < 60
    assert (m.processing, m.stuck, m.enqueue_failed, m.done) == (2, 1, 1, 1)
    t = board.totals
    assert (t.queued, t.processing, t.stuck, t.enqueue_failed) == (2, 2, 1, 1)
    # The last hour: 2 done + 1 failed; the job done 2 h ago is outside the window.
    assert (board.finished, board.done, board.failed) == (3, 2, 1)
    assert board.within_slo == 2  # the 40 s job missed the 25 s SLO
    assert board.attainment == pytest.approx(2 / 3)
    assert board.success_rate == pytest.approx(2 / 3)
    assert board.latency_p99 == pytest.approx(40, abs=1)
    assert len(board.minutes) == 60
    assert sum(b.done for b in board.minutes) == 2
    assert sum(b.failed for b in board.minutes) == 1


def test_dashboard_is_cached_for_a_few_seconds():
    JobFactory.create()
    first = dashboard.cached_dashboard()
    JobFactory.create()
    assert dashboard.cached_dashboard().totals.queued == first.totals.queued == 1
    cache.clear()
    assert dashboard.cached_dashboard().totals.queued == 2


def test_dashboard_page_renders_cards_chart_and_queue_table(client, staff):
    build_mix()
    response = client.get(reverse("admin:jobs_job_dashboard"))
    assert response.status_code == 200
    html = response.content.decode()
    assert '<svg id="throughput-chart"' in html and "<rect" in html
    assert html.count("<g><title>") == 60
    assert 'id="card-stuck"' in html and "?stuck=yes" in html
    assert html.count("66.6%") == 2  # SLO attainment and success rate, 2 of 3 (truncated)
    board = response.context["board"]
    assert board.totals.enqueue_failed == 1
    assert 'id="queue-table"' in html and "?queue=mail" in html
    assert "cdn" not in html.lower()  # everything is served by the app itself


def test_admin_index_links_to_the_dashboard(client, staff):
    html = client.get(reverse("admin:index")).content.decode()
    assert reverse("admin:jobs_job_dashboard") in html


def test_dashboard_queries_never_scan_the_jobs_table():
    """With sequential scans priced out, each query still has an index path: the
    bench on a million rows (bench/admin_million.py) shows the planner picks it."""
    build_mix()
    raw("ANALYZE jobs_job")
    queries = [
        *dashboard.dashboard_queries(),
        ("known_queues", selectors.KNOWN_QUEUES_SQL, {"recent": 10_000}),
    ]
    for name, sql, params in queries:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SET LOCAL enable_seqscan = off")
            cur.execute("EXPLAIN (COSTS OFF) " + sql, params)
            plan = "\n".join(r[0] for r in cur.fetchall())
        assert "Seq Scan on jobs_job" not in plan, (name, plan)
        if "jobs_job" in sql:
            assert "Index" in plan, (name, plan)
        if name in ("finished", "latency"):
            assert "job_finished_idx" in plan, (name, plan)


def test_list_page_counts_at_most_cap_rows(client, staff):
    """The changelist's only COUNT is the capped one: it stops after cap + 1 rows."""
    JobFactory.create()
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(reverse("admin:jobs_job_changelist")).status_code == 200
    counts = [q["sql"] for q in ctx.captured_queries if q["sql"].startswith("SELECT COUNT(")]
    assert counts and all("LIMIT 10001" in c for c in counts), counts


def test_dashboard_shows_sub_second_latencies_in_milliseconds(client, staff):
    for ms in (120, 250, 400):
        job = JobFactory.create(status="done")
        raw(
            "UPDATE jobs_job SET created_at = finished_at - %s * interval '1 millisecond', "
            "due_at = NULL WHERE id = %s",
            [ms, job.pk],
        )
    html = client.get(reverse("admin:jobs_job_dashboard")).content.decode()
    card = html.split('id="card-latency"', 1)[1].split("</div></div>", 1)[0]
    # p95 of 120/250/400 ms is 385 ms; p50 250 ms; never "0.4 s" or "0.2 s".
    assert "385 ms" in card and "p50 250 ms" in card, card
    assert " 0.4 s" not in card and "0.2 s" not in card


@pytest.mark.parametrize(
    "seconds, shown",
    [(None, "—"), (0, "0 ms"), (0.0042, "4.2 ms"), (0.25, "250 ms"), (0.9996, "1.0 s"),
     (3.14159, "3.1 s"), (42, "42.0 s")],
)  # fmt: skip
def test_duration_filter(seconds, shown):
    from jobs.templatetags.jobs_admin import duration

    assert duration(seconds) == shown


def test_dashboard_shows_the_kafka_sinks_state(client, staff, settings):
    html = client.get(reverse("admin:jobs_job_dashboard")).content.decode()
    assert 'id="kafka-sink"' not in html  # off: nothing to show
    settings.JOBS_KAFKA_BOOTSTRAP_SERVERS = "kafka-1:9092"
    settings.JOBS_KAFKA_TOPIC = "jobs.events"
    html = client.get(reverse("admin:jobs_job_dashboard")).content.decode()
    assert (
        'id="kafka-sink"' in html
        and "kafka-1:9092" in html
        and "not started" in html
        and "outbox start kafka --from" in html
    )
    services.submit("echo", {})
    raw("INSERT INTO jobs_outboxcursor (name, last_id, updated_at) VALUES ('kafka', 0, now())")
    raw("UPDATE jobs_jobevent SET at = now() - interval '90 seconds'")
    html = client.get(reverse("admin:jobs_job_dashboard")).content.decode()
    assert "behind" in html and "1 event<" in html and "90.0 s" in html
    raw("UPDATE jobs_outboxcursor SET last_id = (SELECT max(id) FROM jobs_jobevent)")
    html = client.get(reverse("admin:jobs_job_dashboard")).content.decode()
    assert "caught up" in html and "0 events" in html


def kafka_rows(html: str) -> dict[str, str]:
    """The Kafka table's rows by their events column."""
    table = html.split('id="kafka-sink"')[1].split("</table>")[0]
    rows = table.split("<tbody>")[1].split("</tr>")[:-1]
    return {r.split("<td>")[3].split("</td>")[0]: r for r in rows}


def test_dashboard_shows_the_domain_events_cursor_of_the_kafka_sink(client, staff, settings):
    settings.JOBS_KAFKA_BOOTSTRAP_SERVERS = "kafka-1:9092"
    rows = kafka_rows(client.get(reverse("admin:jobs_job_dashboard")).content.decode())
    assert set(rows) == {"job events", "domain events"}
    assert all("not started" in r for r in rows.values())
    assert "outbox start kafka.domain --from" in rows["domain events"]
    raw("INSERT INTO jobs_outboxcursor (name, last_id, updated_at) "
        "VALUES ('kafka', 0, now()), ('kafka.domain', 0, now())")  # fmt: skip
    raw(
        "INSERT INTO jobs_domainevent (type, payload, at) VALUES "
        "('order.placed', '{}', now() - interval '90 seconds'), ('order.paid', '{}', now())"
    )
    rows = kafka_rows(client.get(reverse("admin:jobs_job_dashboard")).content.decode())
    assert "caught up" in rows["job events"] and "0 events" in rows["job events"]
    domain = rows["domain events"]
    assert "behind" in domain and "2 events" in domain and "90.0 s" in domain


def test_a_job_cancelled_before_it_started_is_no_failure_in_the_success_rate():
    """It counted as one: a dashboard of 1 done and 1 cancel read 50%."""
    build_mix()  # 2 done and 1 failed in the window
    waiting = JobFactory.create()
    assert services.cancel([waiting.pk], "staff:ann") == [waiting.pk]
    board = dashboard.dashboard()
    assert (board.finished, board.done, board.failed, board.cancelled_unstarted) == (4, 2, 2, 1)
    assert board.success_rate == pytest.approx(2 / 3)
    report = selectors.slo_report(3600, 25)
    assert (report.terminal, report.cancelled_unstarted) == (4, 1)
    assert report.success_rate == pytest.approx(2 / 3)
