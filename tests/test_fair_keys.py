"""Fair share and concurrency keys in one process: the claims against the real database.

Across workers (and the drain of a client's backlog) see test_fair_keys_e2e.py.
"""

from __future__ import annotations

import json

import pytest
from django.core.exceptions import ImproperlyConfigured

from jobs import queuecontrol, queues, services
from jobs.models import Job, Queue
from jobs.queuecontrol import Gate
from jobs.services.claims import turns
from tests.factories import ClientFactory, raw


def _submit(n: int, queue: str, client=None, **fields) -> list[int]:
    cid = client.pk if client is not None else None
    return [
        services.submit("echo", {}, queue=queue, client_id=cid, **fields)[0].pk for _ in range(n)
    ]


@pytest.mark.parametrize(
    "conf,says",
    [
        pytest.param({"fair": "yes"}, "fair must be true or false", id="fair-text"),
        pytest.param({"key_concurrency": 0}, "key_concurrency must be a whole number", id="k0"),
        pytest.param({"key_concurrency": True}, "key_concurrency must be a whole", id="kbool"),
    ],
)
def test_bad_fair_and_key_settings_are_refused(conf, says):
    with pytest.raises(ImproperlyConfigured) as info:
        queues.parse(json.dumps({"default": {}, "shared": conf}))
    assert "JOBS_QUEUES['shared']" in str(info.value) and says in str(info.value)


@pytest.mark.django_db(transaction=True)
def test_sync_seeds_fair_and_key_concurrency_and_defaults_are_off():
    queuecontrol.sync({"default": {}, "shared": {"fair": True, "key_concurrency": 2}})
    row = Queue.objects.get(name="shared")
    assert (row.fair, row.key_concurrency) == (True, 2)
    default = Queue.objects.get(name="default")
    assert (default.fair, default.key_concurrency) == (False, None)
    # The previous release's sync inserts rows without the new columns (rolling deploy).
    raw(
        "INSERT INTO jobs_queue (name, paused, rate_starts, declared)"
        " VALUES ('old', false, '{}', '{}')"
    )
    assert Queue.objects.get(name="old").fair is False


@pytest.mark.django_db(transaction=True)
def test_fair_claim_takes_turns_between_clients_behind_a_backlog():
    """A's 50 jobs were queued first; B's and the code's (no client) still start in the
    first claim, one per client per round, each client's own rows by priority."""
    queuecontrol.sync({"default": {}, "shared": {"fair": True}})
    a, b = ClientFactory.create(), ClientFactory.create()
    _submit(50, "shared", a)
    low = _submit(2, "shared", b)
    high = _submit(1, "shared", b, priority=5)
    _submit(3, "shared")
    assert services.claim_next("w", ["shared"], 5) == []  # the plain claim refuses it
    gate = Gate()
    assert gate.open(["shared"]) == ["shared"]  # reads the controls
    first = gate.claim_next("w", ["shared"], 6)
    owners = dict(Job.objects.filter(pk__in=[x.job_id for x in first]).values_list("pk", "client"))
    # Two rounds of three clients: each client got two; B's priority-5 job came first.
    assert sorted(owners.values(), key=str) == sorted([a.pk, a.pk, b.pk, b.pk, None, None], key=str)
    assert high[0] in owners and low[0] in owners
    # One job at a time, the turn moves on to the client after the one served last.
    seen = []
    for _ in range(3):
        (lease,) = gate.claim_next("w", ["shared"], 1)
        seen.append(Job.objects.get(pk=lease.job_id).client_id)
    assert seen == [a.pk, b.pk, None]  # each once, in turn, though A has 47 more
    # Started marks (D77): all claimed when `start` is None, else the first `start` in turn.
    assert not Job.objects.filter(pk__in=owners, started_at__isnull=True).exists()
    two = gate.claim_next("w", ["shared"], 2, start=1)
    marked = Job.objects.filter(pk__in=[x.job_id for x in two], started_at__isnull=False)
    assert list(marked.values_list("pk", flat=True)) == [two[0].job_id]


@pytest.mark.django_db(transaction=True)
def test_fair_claim_uses_the_fair_index_not_a_sort_of_the_backlog():
    queuecontrol.sync({"default": {}, "shared": {"fair": True}})
    a = ClientFactory.create()
    raw(
        "INSERT INTO jobs_job (task, payload, queue, priority, run_at, max_retries, client_id,"
        " status, retry_count, lease_version, updated_by)"
        " SELECT 'echo', '{}', 'shared', 0, now(), 3, %s, 'queued', 0, 0, 'app'"
        " FROM generate_series(1, 5000)",
        [a.pk],
    )
    raw("ANALYZE jobs_job")
    sql = turns._CLAIM_FAIR_OPEN_SQL
    params = {"queue": "shared", "limit": 10, "after": 0, "worker": "w", "actor": "worker:w",
              "start": None}  # fmt: skip
    plan = "\n".join(r[0] for r in raw("EXPLAIN (ANALYZE, BUFFERS) " + sql, params))
    assert "job_fair_claim_idx" in plan
    assert "Seq Scan on jobs_job" not in plan
    # Sorts only of what was fetched (at most `limit` rows per client), never the backlog.
    for line in plan.splitlines():
        if "rows=" in line and "Sort" in line and "actual" in line:
            rows = int(line.split("actual")[1].split("rows=")[1].split()[0])
            assert rows <= 20, line


@pytest.mark.django_db(transaction=True)
def test_key_concurrency_caps_each_key_and_lets_other_keys_through():
    queuecontrol.sync({"default": {}, "keyed": {"key_concurrency": 2}})
    a, b = ClientFactory.create(), ClientFactory.create()
    _submit(10, "keyed", a, concurrency_key="k")  # a full key's backlog first
    other = _submit(2, "keyed", a, concurrency_key="other")
    b_same_name = _submit(1, "keyed", b, concurrency_key="k")  # keys are per client
    free = _submit(1, "keyed", a)  # no key: not capped
    assert services.claim_next("w", ["keyed"], 10) == []  # never the open claim
    got = services.claim_limited_under_queue_lock("w1", "keyed", 10, start=3)
    claimed = {x.job_id for x in got.leases}
    assert Job.objects.filter(pk__in=claimed, started_at__isnull=False).count() == 3
    assert len(claimed) == 2 + 2 + 1 + 1
    assert set(other) | set(b_same_name) | set(free) <= claimed
    assert got.blocked_for == services.CAP_RECHECK_SECONDS  # key k holds jobs back
    again = services.claim_limited_under_queue_lock("w2", "keyed", 10)
    assert again.leases == [] and again.blocked_for == services.CAP_RECHECK_SECONDS
    # A finished job of key k frees one slot of k, and only one.
    k_leases = [x for x in got.leases if x.job_id in _ids_of_key(a, "k")]
    services.complete([(k_leases[0], {})])
    third = services.claim_limited_under_queue_lock("w2", "keyed", 10)
    assert len(third.leases) == 1
    assert Job.objects.get(pk=third.leases[0].job_id).concurrency_key == "k"


def _ids_of_key(client, key) -> list[int]:
    return list(Job.objects.filter(client=client, concurrency_key=key).values_list("pk", flat=True))


@pytest.mark.django_db(transaction=True)
def test_a_key_slot_held_by_a_crashed_worker_returns_when_the_reaper_requeues_it():
    """Held like the queue cap: the count is the processing rows, so a lease the reaper
    takes back frees the slot, and no claim of the key starts meanwhile."""
    queuecontrol.sync({"default": {}, "keyed": {"key_concurrency": 1}})
    _submit(3, "keyed", concurrency_key="k")
    (held,) = services.claim_limited_under_queue_lock("dead", "keyed", 5).leases
    assert services.claim_limited_under_queue_lock("w", "keyed", 5).leases == []
    raw("UPDATE jobs_job SET heartbeat_at = now() - interval '1 hour' WHERE id = %s", [held.job_id])
    assert held.job_id in services.reap_expired(60)
    (next_,) = services.claim_limited_under_queue_lock("w", "keyed", 5).leases
    assert next_.job_id != held.job_id  # the next of key k; the reaped one waits its turn
    assert services.claim_limited_under_queue_lock("w", "keyed", 5).leases == []


@pytest.mark.django_db(transaction=True)
def test_fair_and_keyed_together_and_under_a_cap():
    queuecontrol.sync(
        {"default": {}, "both": {"fair": True, "key_concurrency": 1, "concurrency": 3}}
    )
    a, b = ClientFactory.create(), ClientFactory.create()
    _submit(5, "both", a, concurrency_key="x")
    _submit(5, "both", a, concurrency_key="y")
    _submit(5, "both", b, concurrency_key="x")
    got = services.claim_limited_under_queue_lock("w", "both", 10)
    keys = sorted(
        Job.objects.filter(pk__in=[x.job_id for x in got.leases]).values_list(
            "client_id", "concurrency_key"
        )
    )
    assert keys == sorted([(a.pk, "x"), (a.pk, "y"), (b.pk, "x")])
