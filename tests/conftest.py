"""Shared fixtures. Everything runs against the real PostgreSQL and Redis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.db import connection

from tests import flush
from tests.factories import raw

flush.install()  # transactional tests empty only the tables they wrote to (D367)


@pytest.fixture
def sql(db):
    """Run raw SQL on the test connection: sql("UPDATE ...", [params])."""
    return raw


@pytest.fixture(autouse=True)
def _clean_redis_keys(settings):
    """Each test starts with none of this checkout's Redis keys."""
    from jobs.transport import get_transport

    t = get_transport()
    if t.enabled:
        client = t._client
        try:
            keys = list(client.scan_iter(match=f"{t.prefix}*", count=1000))
            if keys:
                client.delete(*keys)
        except Exception:
            pass  # a test that stops Redis leaves it stopped; the next test restarts nothing
    yield


def job_row(job_id: int) -> dict:
    with connection.cursor() as cur:
        cur.execute("SELECT * FROM jobs_job WHERE id = %s", [job_id])
        cols = [c.name for c in cur.description]
        row = dict(zip(cols, cur.fetchone(), strict=True))
    # Django's psycopg setup hands jsonb back as text; decode it for comparisons.
    for key in ("payload", "result"):
        if isinstance(row[key], str):
            row[key] = json.loads(row[key])
    return row


@pytest.fixture
def private_redis():
    """A redis-server of this test's own, free to stop, freeze and flush."""
    from tests.harness import RedisServer

    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def broker():
    """A Kafka-protocol broker (Tansu) of this module's own on a free loopback port."""
    from tests.harness import KafkaBroker

    server = KafkaBroker().start()
    yield server
    server.stop()


@pytest.fixture
def stack(transactional_db, tmp_path, request):
    """Start runworker/runreaper subprocesses against the test database.

    Redis: the shared server with this test's own key prefix, unless the test
    calls `stack.env.update(REDIS_URL=...)` (e.g. a private server) first.
    """
    from django.conf import settings as dj_settings

    from tests.harness import Stack

    s = Stack(tmp_path, redis_url=dj_settings.REDIS_URL, prefix=dj_settings.JOBS_REDIS_PREFIX)
    yield s
    s.close()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        print(s.logs())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


# Tests that must share one process, or that load the machine, each run as one group on
# one worker of `pytest -n 3 --dist loadgroup` (make test): the API tests, because the
# schema-coverage test reads what the others requested; the long CPU-heavy runs, so that
# two of them never compete for the two cores while asserting their own figures.
HEAVY_FILES = {"test_chaos_short.py", "test_e2e_slo.py", "test_bench.py", "test_schedules_e2e.py"}
HEAVY_TESTS = {"test_make_target_runs"}


def pytest_itemcollected(item):
    path = Path(str(item.path))
    if path.parent.name == "api":
        item.add_marker(pytest.mark.xdist_group("api"))
    elif path.name in HEAVY_FILES or getattr(item, "originalname", item.name) in HEAVY_TESTS:
        item.add_marker(pytest.mark.xdist_group("heavy"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The fault suite (marker `chaos`) runs last: it is the slowest and proves the rest."""
    items.sort(key=lambda item: item.get_closest_marker("chaos") is not None)
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        refuse_lost_groups(items)


def refuse_lost_groups(items) -> None:
    """xdist groups a test by the "@group" it appends to the node id; a pytest that ignores
    that append (9.2 with xdist 3.8) spreads a group over the workers without a word, and two
    of the heavy runs then share a database. Refuse to run rather than run so."""
    lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(
            f"--dist loadgroup did not group {len(lost)} test(s) (e.g. {lost[0]}): "
            "this pytest and pytest-xdist do not work together; see pyproject.toml"
        )
