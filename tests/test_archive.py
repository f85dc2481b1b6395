"""Retention by partition (issue 33): expired periods are detached, archived to Parquet,
verified and dropped; `manage.py archive` reads them back and restores them. Real
PostgreSQL, real files, real SIGKILLs."""

from __future__ import annotations

import datetime
import json
import signal
import subprocess
import sys
import textwrap
import threading
from io import StringIO
from pathlib import Path

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from rest_framework.test import APIClient

from harness import ROOT, database_url, service_env
from jobs import services
from jobs.archive import files, tables
from jobs.archive.tables import SIDE_TABLES
from jobs.models import (
    ArchivedPeriod,
    Client,
    JobDependency,
    JobSignal,
    JobStep,
    Webhook,
    WebhookDelivery,
    Workflow,
    WorkflowNode,
)
from tests.factories import JobFactory, raw

pytestmark = pytest.mark.django_db(transaction=True)

UTC = datetime.UTC
WEEK = datetime.timedelta(days=7)
TABLES = ("jobs_job", "jobs_jobevent", *SIDE_TABLES)


def monday(weeks_ago: int) -> datetime.date:
    today = datetime.datetime.now(UTC).date()
    return today - datetime.timedelta(days=today.weekday()) - weeks_ago * WEEK


def at(day: datetime.date, hours: float = 0) -> datetime.datetime:
    return datetime.datetime.combine(day, datetime.time(), tzinfo=UTC) + datetime.timedelta(
        hours=hours
    )


def legacy_bound() -> str:
    bound = raw(
        "SELECT pg_get_expr(relpartbound, oid) FROM pg_class WHERE relname = 'jobs_jobevent_legacy'"
    )[0][0]
    return bound.split("TO (", 1)[1].rstrip(")")


MADE: list[str] = []


@pytest.fixture
def layout(transactional_db):
    """History partitions from five weeks ago on (older history is legacy), as a
    database partitioned that long ago has; cold job partitions are made as tests move
    jobs into them. Everything made here is undone after the test."""
    old_bound = legacy_bound()
    start = monday(5)
    raw("ALTER TABLE jobs_jobevent DETACH PARTITION jobs_jobevent_legacy")
    raw(
        "ALTER TABLE jobs_jobevent ATTACH PARTITION jobs_jobevent_legacy "
        f"FOR VALUES FROM (MINVALUE) TO ('{at(start)}')"
    )
    day = start
    while at(day) < datetime.datetime.fromisoformat(old_bound.strip("'")):
        end = day + WEEK
        name = f"jobs_jobevent_p{day:%Y%m%d}"
        if not exists(name):
            raw(
                f"CREATE TABLE {name} PARTITION OF jobs_jobevent "
                f"FOR VALUES FROM ('{at(day)}') TO ('{at(end)}')"
            )
            raw(f"ALTER TABLE {name} ADD PRIMARY KEY (id)")
            MADE.append(name)
        day = end
    yield start
    raw("TRUNCATE jobs_job, jobs_jobevent")
    while MADE:
        raw(f"DROP TABLE IF EXISTS {MADE.pop()}")
    raw("ALTER TABLE jobs_jobevent DETACH PARTITION jobs_jobevent_legacy")
    raw(
        "ALTER TABLE jobs_jobevent ATTACH PARTITION jobs_jobevent_legacy "
        f"FOR VALUES FROM (MINVALUE) TO ({old_bound})"
    )


def make_job_partition(day: datetime.date) -> None:
    name = f"jobs_job_p{day:%Y%m%d}"
    if exists(name):
        return
    raw(f"CREATE TABLE {name} PARTITION OF jobs_job FOR VALUES FROM ('{day}') TO ('{day + WEEK}')")
    raw(f"ALTER TABLE {name} ADD PRIMARY KEY (id)")
    MADE.append(name)


def move(job_ids: list[int], day: datetime.date, finished_hours: float = 30) -> None:
    """Jobs created on `day` and finished `finished_hours` later, moved to the day's
    period with their history, as the mover does once they are finished."""
    raw(
        """UPDATE jobs_job SET created_at = %s,
                  finished_at = CASE WHEN finished_at IS NULL THEN NULL
                                     ELSE %s + (id %% 100) * interval '1 ms' END
           WHERE id = ANY(%s)""",
        [at(day, 2), at(day, finished_hours), job_ids],
    )
    start = day - datetime.timedelta(days=day.weekday())
    make_job_partition(start)
    raw(
        "UPDATE jobs_job SET period = %s WHERE id = ANY(%s) AND status IN ('done', 'failed')",
        [start, job_ids],
    )
    # History of jobs created before the history partitions is legacy ('-infinity').
    raw(
        """UPDATE jobs_jobevent e SET job_created_at = CASE WHEN j.created_at >= %s
                                     THEN j.created_at ELSE '-infinity' END
           FROM jobs_job j WHERE j.id = e.job_id AND j.id = ANY(%s)""",
        [at(monday(5)), job_ids],
    )


BIG = {"text": 'ünïcødé ✓ 日本語 "quoted", comma\nnewline', "rows": [{"n": i} for i in range(4000)]}


def populate(day: datetime.date) -> dict:
    """A period's worth: jobs in every terminal status with their history, a large
    unicode result, a cancelled job, durable steps and signals, a workflow, a webhook
    delivery job."""
    client = Client.objects.create(name=f"c-{day}", token_hash=Client.hash_token(f"t-{day}"))
    done = [JobFactory.create(status="done", client_id=client.pk).pk for _ in range(4)]
    failed = [JobFactory.create(status="failed", client_id=client.pk).pk for _ in range(3)]
    cancelled = JobFactory.create(status="queued", client_id=client.pk).pk
    services.cancel([cancelled], actor="client:test", client_id=client.pk)
    big = JobFactory.create(status="queued", client_id=client.pk, payload={"k": "∂"}).pk
    lease = services.claim("w-big", big)
    services.complete([(lease, BIG)])
    ids = [*done, *failed, cancelled, big]
    for i, job_id in enumerate(done):
        JobStep.objects.create(
            job_id=job_id, name=f"step-{i}", result={"v": i, "s": "é"}, lease_version=1,
            worker_id="w-factory",
        )  # fmt: skip
    JobSignal.objects.create(job_id=done[0], key="go", payload=None, sent_by="")
    flow = Workflow.objects.create(name="flow", client=client)
    WorkflowNode.objects.create(job_id=done[1], workflow=flow, key="a", ended=True)
    WorkflowNode.objects.create(job_id=done[2], workflow=flow, key="b", ended=True)
    JobDependency.objects.create(parent_id=done[1], child_id=done[2])
    hook = Webhook.objects.create(
        client=client, url="https://example.com/h", secret_salt="s", events=["job.done"]
    )
    WebhookDelivery.objects.create(
        webhook=hook, event_id=1, source_job_id=done[0], seq=1, type="job.done",
        body="{}", job_id=failed[0],
    )  # fmt: skip
    move(ids, day + datetime.timedelta(days=1))
    return {"client": client, "ids": ids, "token": f"t-{day}", "big": big}


def snapshot(job_ids: list[int]) -> dict[str, list]:
    """Every column of every row of the jobs, their history and side rows, as
    PostgreSQL prints them (to_jsonb keeps NULLs, microseconds and JSON exactly)."""
    jobs = "unnest(%(ids)s::bigint[]) AS u(id)"
    wheres = {"jobs_job": "id IN (SELECT id FROM {jobs})"}
    wheres["jobs_jobevent"] = "job_id IN (SELECT id FROM {jobs})"
    out = {}
    for table in TABLES:
        where = (wheres.get(table) or SIDE_TABLES[table]).format(jobs=jobs)
        rows = raw(
            f"SELECT to_jsonb(t) FROM {table} t WHERE {where} ORDER BY to_jsonb(t)::text",
            {"ids": job_ids},
        )
        out[table] = [r[0] for r in rows]
    return out


def prune(*args: str) -> str:
    out = StringIO()
    call_command("prunejobs", "--older-than", "7d", *args, stdout=out)
    return out.getvalue()


def archive(*args: str) -> str:
    out = StringIO()
    call_command("archive", *args, stdout=out)
    return out.getvalue()


def exists(table: str) -> bool:
    return raw("SELECT to_regclass(%s) IS NOT NULL", [table])[0][0]


def attached(table: str) -> bool:
    return bool(raw("SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass(%s)", [table]))


def api_get(token: str, path: str):
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return api.get(path)


# --- the whole cycle --------------------------------------------------------------------


def test_period_is_archived_verified_dropped_shown_and_restored(layout, tmp_path, settings):
    settings.JOBS_ARCHIVE_DIR = str(tmp_path)
    day = layout  # five weeks ago: its own history partition
    data = populate(day)
    ids = data["ids"]
    before = snapshot(ids)
    assert len(before["jobs_jobevent"]) == 3 * len(ids) - 1  # the cancelled job: 2
    assert all(before[t] for t in TABLES if t != "jobs_jobevent_legacy")
    api_before = {
        i: (
            api_get(data["token"], f"/api/v1/jobs/{i}/").json(),
            api_get(data["token"], f"/api/v1/jobs/{i}/history/?page_size=100").json()["results"],
        )
        for i in ids
    }
    jobs_table, events_table = f"jobs_job_p{day:%Y%m%d}", f"jobs_jobevent_p{day:%Y%m%d}"

    out = prune()

    assert f"period {day:%Y-%m-%d}: detach" in out and "verify" in out and "drop" in out
    assert f"period {day:%Y-%m-%d}: {len(ids)} jobs, {len(before['jobs_jobevent'])} history" in out
    assert not exists(jobs_table) and not exists(events_table)
    assert raw("SELECT count(*) FROM jobs_job WHERE id = ANY(%s)", [ids]) == [(0,)]
    after = snapshot(ids)
    assert all(after[t] == [] for t in TABLES), "side rows and history went with the period"
    period = ArchivedPeriod.objects.get(period=day)
    assert (period.period, period.jobs) == (day, len(ids))
    assert (period.min_job_id, period.max_job_id) == (min(ids), max(ids))
    directory = tmp_path / f"{day:%Y%m%d}"
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["schema_version"] == files.SCHEMA_VERSION
    for name, entry in manifest["tables"].items():
        assert files.sha256_of(directory / entry["file"]) == entry["sha256"]
        assert entry["rows"] == len(before[name]), name
    assert not list(directory.glob(".*")), "no temporary file is left"

    listed = archive("list")
    assert f"{day:%Y-%m-%d}  archived" in listed and str(directory) in listed

    # A job and its whole history, read from the files, shaped as the API shows them.
    shown = {i: json.loads(archive("show", str(i))) for i in ids}
    for i in ids:
        job, history = api_before[i]
        assert shown[i]["job"] == job
        assert shown[i]["history"] == history
        assert shown[i]["period"] == f"{day:%Y-%m-%d}"
    assert shown[data["big"]]["job"]["result"] == BIG

    # Archived: the API answers 404 as for any job that is not there (D174).
    assert api_get(data["token"], f"/api/v1/jobs/{ids[0]}/").status_code == 404

    out = archive("restore", f"{day:%Y-%m-%d}")
    assert f"{len(ids)} jobs" in out
    assert attached(jobs_table) and attached(events_table)
    assert snapshot(ids) == before
    for i in ids:
        job, history = api_before[i]
        assert api_get(data["token"], f"/api/v1/jobs/{i}/").json() == job
        got = api_get(data["token"], f"/api/v1/jobs/{i}/history/?page_size=100").json()
        assert got["results"] == history
    assert ArchivedPeriod.objects.get(period=day).restored_at is not None
    assert "restored" in archive("list")

    with pytest.raises(CommandError, match="is attached"):
        archive("restore", f"{day:%Y-%m-%d}")


def test_legacy_history_goes_with_its_period(layout, tmp_path, settings):
    """A period older than the history partitions: its jobs' history is in
    jobs_jobevent_legacy, archived with them and deleted row by row."""
    settings.JOBS_ARCHIVE_DIR = str(tmp_path)
    day = monday(7)
    ids = [JobFactory.create(status="done").pk for _ in range(3)]
    move(ids, day + datetime.timedelta(days=2))
    before = snapshot(ids)
    assert (
        len(before["jobs_jobevent_legacy"]) == 9
        and before["jobs_jobevent"] == before["jobs_jobevent_legacy"]
    )

    prune()

    assert snapshot(ids)["jobs_jobevent_legacy"] == []
    shown = json.loads(archive("show", str(ids[0])))
    assert [e["to_status"] for e in shown["history"]] == ["queued", "processing", "done"]
    archive("restore", f"{day:%Y-%m-%d}")
    assert snapshot(ids) == before


def test_a_restore_missing_a_deleted_client_says_which_and_changes_nothing(
    layout, tmp_path, settings
):
    """Once its jobs are archived nothing protects their client: staff may delete it
    (its workflow first; its webhooks go with it). A restore names the missing row,
    leaves no table behind, and succeeds once the rows are back."""
    settings.JOBS_ARCHIVE_DIR = str(tmp_path)
    day = layout
    data = populate(day)
    before = snapshot(data["ids"])
    prune()
    client_id = data["client"].pk
    gone = {}
    for table in ("jobs_webhook", "jobs_workflow", "jobs_client"):
        column = "id" if table == "jobs_client" else "client_id"
        gone[table] = raw(f"SELECT to_jsonb(t) FROM {table} t WHERE {column} = %s", [client_id])
    Workflow.objects.filter(client_id=client_id).delete()
    Client.objects.filter(pk=client_id).delete()
    assert not Webhook.objects.filter(client_id=client_id).exists()
    jobs_table, events_table = f"jobs_job_p{day:%Y%m%d}", f"jobs_jobevent_p{day:%Y%m%d}"

    missing = rf'Key \(client_id\)=\({client_id}\) is not present in table "jobs_client"'
    with pytest.raises(CommandError, match=missing + ".*nothing was restored"):
        archive("restore", f"{day:%Y-%m-%d}")

    for table in (jobs_table, events_table, f"{jobs_table}_restore", f"{events_table}_restore"):
        assert not exists(table), table
    assert snapshot(data["ids"]) == {t: [] for t in TABLES}
    assert ArchivedPeriod.objects.get(period=day).restored_at is None

    for table in ("jobs_client", "jobs_workflow", "jobs_webhook"):
        for (row,) in gone[table]:  # to_jsonb's text, as Django's cursor returns it
            raw(f"INSERT INTO {table} SELECT * FROM jsonb_populate_record(NULL::{table}, %s)",
                [row])  # fmt: skip
    archive("restore", f"{day:%Y-%m-%d}")
    assert snapshot(data["ids"]) == before


# --- what holds a period back -------------------------------------------------------------


def test_a_live_job_holds_its_period_back(layout, tmp_path, settings):
    settings.JOBS_ARCHIVE_DIR = str(tmp_path)
    day = layout + WEEK
    finished = [JobFactory.create(status="done").pk for _ in range(2)]
    live = JobFactory.create(status="processing").pk
    move([*finished, live], day + datetime.timedelta(days=1))
    assert raw("SELECT tableoid::regclass::text FROM jobs_job WHERE id = %s", [live]) == [
        ("jobs_job_hot",)
    ]

    out = prune()

    assert f"period {day:%Y-%m-%d} held back: 1 jobs created in it are still in jobs_job_hot" in out
    assert attached(f"jobs_job_p{day:%Y%m%d}")
    assert not (tmp_path / f"{day:%Y%m%d}").exists()
    assert raw("SELECT count(*) FROM jobs_job WHERE id = ANY(%s)", [[*finished, live]]) == [(3,)]


def test_a_job_finished_after_the_cutoff_holds_its_period_back(layout, tmp_path, settings):
    settings.JOBS_ARCHIVE_DIR = str(tmp_path)
    day = layout
    ids = [JobFactory.create(status="done").pk for _ in range(2)]
    move(ids, day)
    raw("UPDATE jobs_job SET finished_at = now() - interval '1 day' WHERE id = %s", [ids[0]])
    out = prune()
    assert "1 of its jobs finished after the cutoff" in out
    assert attached(f"jobs_job_p{day:%Y%m%d}")


def test_a_staff_retry_just_before_detach_sends_the_period_back(
    layout, tmp_path, settings, monkeypatch
):
    """Between the look at jobs_job_hot and DETACH, staff retry a failed job of the
    period (it goes back hot): the look after DETACH finds it, and the period goes back
    attached, whole, with its history."""
    settings.JOBS_ARCHIVE_DIR = str(tmp_path)
    day = layout
    ids = [JobFactory.create(status="failed").pk for _ in range(2)]
    move(ids, day)
    table = f"jobs_job_p{day:%Y%m%d}"
    detach = tables.detach

    def retry_then_detach(p):
        assert services.staff_retry([ids[0]], actor="staff:test") == [ids[0]]
        detach(p)

    monkeypatch.setattr(tables, "detach", retry_then_detach)
    out = prune()
    assert f"period {day:%Y-%m-%d} held back: 1 jobs created in it are still in" in out
    assert attached(table) and attached(f"jobs_jobevent_p{day:%Y%m%d}")
    assert raw("SELECT count(*) FROM jobs_job WHERE id = ANY(%s)", [ids]) == [(2,)]
    assert raw("SELECT count(*) FROM jobs_jobevent WHERE job_id = %s", [ids[0]]) == [(4,)]
    assert not ArchivedPeriod.objects.filter(period=day).exists()


def test_dry_run_and_no_archive_dir_change_nothing(layout, settings):
    settings.JOBS_ARCHIVE_DIR = ""
    day = layout
    ids = [JobFactory.create(status="done").pk for _ in range(2)]
    move(ids, day)
    out = prune("--dry-run")
    assert (
        f"dry run: would archive and drop period {day:%Y-%m-%d} (jobs_job_p{day:%Y%m%d}, 2 jobs)"
        in out
    )
    out = prune()
    assert "expired but kept: set JOBS_ARCHIVE_DIR" in out
    assert attached(f"jobs_job_p{day:%Y%m%d}")
    assert not ArchivedPeriod.objects.exists()


def test_an_unfinished_row_in_a_detached_period_stops_retention(layout, tmp_path, settings):
    """A cold partition holds finished jobs only (job_cold_is_finished); a detached one
    whose constraint was tampered with is checked all the same and never archived."""
    settings.JOBS_ARCHIVE_DIR = str(tmp_path)
    day = layout
    ids = [JobFactory.create(status="done").pk for _ in range(2)]
    move(ids, day)
    table = f"jobs_job_p{day:%Y%m%d}"
    raw(f"ALTER TABLE jobs_job DETACH PARTITION {table} CONCURRENTLY")
    raw(f"ALTER TABLE {table} DROP CONSTRAINT job_cold_is_finished")
    raw(
        f"UPDATE {table} SET status = 'queued', finished_at = NULL, result = NULL WHERE id = %s",
        [ids[0]],
    )
    with pytest.raises(CommandError, match="1 jobs in .* are not finished"):
        prune()
    assert exists(table)
    assert not ArchivedPeriod.objects.exists()
    assert not (tmp_path / f"{day:%Y%m%d}" / "manifest.json").exists()


def command(archive_dir: Path | str, *args: str) -> subprocess.CompletedProcess:
    """`manage.py ARGS` in a process of its own, JOBS_ARCHIVE_DIR set as a deployment sets it."""
    env = service_env(
        database_url(), "", "archive-test:", "demo.tasks", JOBS_ARCHIVE_DIR=str(archive_dir)
    )
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_hot_job_holding_its_period_back_is_archived_with_it_not_deleted(layout, tmp_path):
    """The mover is behind: one finished job of an expired period is still hot. With an
    archive directory, prunejobs moves it to its period and archives it with the rest;
    it never deletes it row by row (D170, D213)."""
    day = layout
    cold = [JobFactory.create(status="done").pk for _ in range(3)]
    move(cold, day + datetime.timedelta(days=1))
    late = JobFactory.create(status="failed").pk
    move([late], day + datetime.timedelta(days=2))
    raw("UPDATE jobs_job SET period = 'infinity' WHERE id = %s", [late])  # not moved yet
    assert raw("SELECT tableoid::regclass::text FROM jobs_job WHERE id = %s", [late]) == [
        ("jobs_job_hot",)
    ]
    before = snapshot([*cold, late])

    dry = command(tmp_path, "prunejobs", "--older-than", "7d", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would delete" not in dry.stdout
    assert "dry run: would move 1 expired jobs" in dry.stdout
    assert raw("SELECT count(*) FROM jobs_job WHERE id = ANY(%s)", [[*cold, late]]) == [(4,)]

    pruned = command(tmp_path, "prunejobs", "--older-than", "7d")

    assert pruned.returncode == 0, pruned.stderr
    assert "jobs deleted" not in pruned.stdout, pruned.stdout
    assert "moved 1 expired jobs from jobs_job_hot to their periods" in pruned.stdout
    assert f"period {day:%Y-%m-%d}: 4 jobs" in pruned.stdout, pruned.stdout
    assert raw("SELECT count(*) FROM jobs_job WHERE id = ANY(%s)", [[*cold, late]]) == [(0,)]
    shown = command(tmp_path, "archive", "show", str(late))
    assert shown.returncode == 0, shown.stderr
    job = json.loads(shown.stdout)
    assert (job["job"]["id"], job["job"]["status"], job["period"]) == (
        late, "failed", f"{day:%Y-%m-%d}"
    )  # fmt: skip
    assert [e["to_status"] for e in job["history"]] == ["queued", "processing", "failed"]
    restored = command(tmp_path, "archive", "restore", f"{day:%Y-%m-%d}")
    assert restored.returncode == 0, restored.stderr
    after = snapshot([*cold, late])
    assert {t: rows for t, rows in after.items() if t != "jobs_job"} == {
        t: rows for t, rows in before.items() if t != "jobs_job"
    }, "its history and side rows archived and restored whole"
    jobs = {r["id"]: r for r in map(json.loads, after["jobs_job"])}
    expected = {r["id"]: r for r in map(json.loads, before["jobs_job"])}
    assert jobs == {i: {**r, "period": f"{day:%Y-%m-%d}"} for i, r in expected.items()}


def test_status_subset_with_an_archive_dir_deletes_nothing_row_by_row(layout, tmp_path):
    """`--status done` keeps the periods; with an archive directory the expired hot rows
    are not deleted without a copy either."""
    day = layout
    late = JobFactory.create(status="done").pk
    move([late], day + datetime.timedelta(days=2))
    raw("UPDATE jobs_job SET period = 'infinity' WHERE id = %s", [late])

    pruned = command(tmp_path, "prunejobs", "--older-than", "7d", "--status", "done")

    assert pruned.returncode == 0, pruned.stderr
    assert "jobs deleted" not in pruned.stdout, pruned.stdout
    assert raw("SELECT count(*) FROM jobs_job WHERE id = %s", [late]) == [(1,)]
    assert attached(f"jobs_job_p{day:%Y%m%d}")


# --- faults -----------------------------------------------------------------------------

KILLER = """
import os, signal, sys
import django
django.setup()
from jobs.archive import files, retention, tables

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

step = sys.argv[1]
if step == "detached":  # after both DETACHes, before any file
    files.write_table = die
elif step == "written":  # files and manifest written, not verified
    retention._verify = die
elif step == "verified":  # verified, before the DROP transaction
    tables.drop = die
from django.core.management import call_command
call_command("prunejobs", "--older-than", "7d")
"""


def run_prune(archive_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = service_env(
        database_url(), "", "archive-test:", "demo.tasks", JOBS_ARCHIVE_DIR=str(archive_dir)
    )
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILLER), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("step", ["detached", "written", "verified"])
def test_a_prune_killed_midway_is_finished_by_the_next(layout, tmp_path, settings, step):
    settings.JOBS_ARCHIVE_DIR = str(tmp_path)
    day = layout
    data = populate(day)
    before = snapshot(data["ids"])
    table = f"jobs_job_p{day:%Y%m%d}"

    killed = run_prune(tmp_path, step)

    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert exists(table) and not attached(table), "left detached, not dropped"
    assert snapshot(data["ids"])["jobs_jobstep"] == before["jobs_jobstep"]
    assert "detached, not dropped" in archive("list")
    assert not ArchivedPeriod.objects.exists()

    out = prune()

    assert f"period {day:%Y-%m-%d}: {len(data['ids'])} jobs" in out
    assert not exists(table)
    assert ArchivedPeriod.objects.filter(period=day).count() == 1
    archive("restore", f"{day:%Y-%m-%d}")
    assert snapshot(data["ids"]) == before, "nothing lost, nothing twice"


def test_a_detach_left_pending_is_finalized(layout, tmp_path, settings):
    """DETACH … CONCURRENTLY waits for older snapshots in its second transaction; a
    prune killed there (process and session) leaves the partition "detach pending",
    which the next run finishes with FINALIZE."""
    settings.JOBS_ARCHIVE_DIR = str(tmp_path)
    day = layout
    ids = [JobFactory.create(status="done").pk for _ in range(3)]
    move(ids, day)
    table = f"jobs_job_p{day:%Y%m%d}"
    dsn = database_url()
    holder = psycopg.connect(dsn)
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT count(*) FROM jobs_job")  # a snapshot that sees the partition
    env = service_env(dsn, "", "archive-test:", "demo.tasks", JOBS_ARCHIVE_DIR=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "prunejobs", "--older-than", "7d"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        pending = []
        for _ in range(300):
            pending = raw(
                "SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass(%s)",
                [table],
            )
            if pending and pending[0][0]:
                break
            threading.Event().wait(0.1)
        assert pending == [(True,)], "the detach waits for the open snapshot"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        raw(
            """SELECT pg_terminate_backend(pid) FROM pg_stat_activity
               WHERE query LIKE 'ALTER TABLE jobs_job DETACH PARTITION%%'
                 AND pid <> pg_backend_pid()"""
        )
    finally:
        holder.close()
    assert raw(
        "SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass(%s)", [table]
    ) == [(True,)]
    assert "detach pending" in archive("list")

    out = prune()

    assert f"period {day:%Y-%m-%d}: 3 jobs" in out
    assert not exists(table)


def test_a_corrupted_file_fails_verification_and_nothing_is_dropped(
    layout, tmp_path, settings, monkeypatch
):
    settings.JOBS_ARCHIVE_DIR = str(tmp_path)
    day = layout
    data = populate(day)
    before = snapshot(data["ids"])
    table = f"jobs_job_p{day:%Y%m%d}"
    write_manifest = files.write_manifest

    def corrupt_then_write(directory, manifest):
        path = directory / manifest["tables"]["jobs_job"]["file"]
        raw_bytes = bytearray(path.read_bytes())
        raw_bytes[len(raw_bytes) // 2] ^= 0xFF
        path.write_bytes(bytes(raw_bytes))
        return write_manifest(directory, manifest)

    monkeypatch.setattr(files, "write_manifest", corrupt_then_write)
    with pytest.raises(CommandError, match="failed verification, nothing dropped.*sha256"):
        prune()
    assert exists(table) and not attached(table), "kept, detached"
    assert raw(f"SELECT count(*) FROM {table}") == [(len(data["ids"]),)]
    kept = snapshot(data["ids"])
    assert all(kept[t] == before[t] for t in SIDE_TABLES), "side rows kept"
    assert not ArchivedPeriod.objects.exists()

    monkeypatch.undo()
    prune()  # the next run writes the files again
    assert not exists(table)
    archive("restore", f"{day:%Y-%m-%d}")
    assert snapshot(data["ids"]) == before


def test_one_archiving_run_at_a_time(layout, tmp_path, settings):
    settings.JOBS_ARCHIVE_DIR = str(tmp_path)
    day = layout
    ids = [JobFactory.create(status="done").pk for _ in range(2)]
    move(ids, day)
    with psycopg.connect(database_url(), autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", [tables._LOCK_KEY])
        with pytest.raises(CommandError, match="another prunejobs is archiving"):
            prune()
        assert attached(f"jobs_job_p{day:%Y%m%d}")
        # Given back before the close: a closed session's locks go only when its backend ends.
        other.execute("SELECT pg_advisory_unlock_all()")
    assert f"period {day:%Y-%m-%d}: 2 jobs" in prune()


# --- the command's input ------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,message",
    [
        (["show", "x"], "not a positive whole number"),
        (["show", "0"], "not a positive whole number"),
        (["show", "12345678"], "in no archived period"),
        (["restore", "2026-13-01"], "not a date"),
        (["restore", "2020-01-06"], "not in the archive"),
    ],
)
def test_archive_command_refuses_bad_input(args, message):
    with pytest.raises(CommandError, match=message):
        archive(*args)


def test_archive_list_when_empty():
    assert archive("list").strip() == "nothing archived, nothing detached"


# --- the admin ----------------------------------------------------------------------------


def archived_row(day: datetime.date, low: int, high: int) -> ArchivedPeriod:
    return ArchivedPeriod.objects.create(
        period=day, starts_at=at(day), ends_at=at(day + WEEK), jobs=high - low + 1, events=0,
        min_job_id=low, max_job_id=high, location=f"/archive/{day:%Y%m%d}", files={},
        archived_at=at(day + 5 * WEEK, 3),
    )  # fmt: skip


@pytest.fixture
def staff(client):
    from django.contrib.auth.models import Permission, User

    user = User.objects.create_user("ada", password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename="view_job"))
    client.force_login(User.objects.get(pk=user.pk))
    return client


def test_the_admin_says_where_an_archived_job_went(staff):
    from django.contrib.messages import get_messages
    from django.urls import reverse

    day = monday(6)
    archived_row(day, 1_000_000, 1_000_999)
    said = f"job 1000500 was archived at {at(day + 5 * WEEK, 3):%Y-%m-%d %H:%M}"
    restore_with = f"restore with `manage.py archive restore {day:%Y-%m-%d}`"

    page = staff.get(reverse("admin:jobs_job_changelist"), {"q": "1000500"})
    assert page.status_code == 200
    shown = [str(m) for m in get_messages(page.wsgi_request)]
    assert any(said in m and restore_with in m for m in shown), shown

    page = staff.get(reverse("admin:jobs_job_change", args=[1000500]), follow=True)
    shown = [str(m) for m in get_messages(page.wsgi_request)]
    assert any(said in m and restore_with in m for m in shown), shown

    # An id no period held: Django's own "does not exist".
    page = staff.get(reverse("admin:jobs_job_change", args=[999]), follow=True)
    shown = [str(m) for m in get_messages(page.wsgi_request)]
    assert shown and not any("archived" in m for m in shown)

    listing = staff.get(reverse("admin:jobs_archivedperiod_changelist"))
    assert listing.status_code == 200
    assert f"/archive/{day:%Y%m%d}" in listing.content.decode()
    detail = staff.get(reverse("admin:jobs_archivedperiod_change", args=[str(day)]))
    assert f"manage.py archive restore {day:%Y-%m-%d}" in detail.content.decode()
    assert staff.get(reverse("admin:jobs_archivedperiod_add")).status_code == 403
