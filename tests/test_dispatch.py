"""Weighted polling across queues (jobs.dispatch) and the claim's use of job_claim_idx."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from jobs import services
from jobs.dispatch import QueueSpecError, parse_queues, polling_order
from jobs.services.claims import plain


def test_parse_weights_defaults_and_wildcard():
    assert parse_queues("a:4,b:1").weights == {"a": 4.0, "b": 1.0}
    assert parse_queues("a,b,c").weights == {"a": 3.0, "b": 2.0, "c": 1.0}
    spec = parse_queues("high:5,*")
    assert spec.weights == {"high": 5.0} and spec.wildcard_weight == 1.0
    assert spec.with_queues(["high", "x"]) == {"high": 5.0, "x": 1.0}
    assert not parse_queues("a").serves_all and parse_queues("*").serves_all
    for bad in ("", " , ", "a:x", "a:0", "a:-1", "a,a", ":3", "*,*"):
        with pytest.raises(QueueSpecError):
            parse_queues(bad)


def test_runworker_refuses_a_bad_queue_spec():
    with pytest.raises(CommandError, match="--queues"):
        call_command("runworker", "--queues", "a:zero")


def test_polling_order_puts_each_queue_first_in_proportion_to_its_weight():
    rng = random.Random(7)
    firsts = Counter(polling_order({"a": 4, "b": 1}, rng)[0] for _ in range(10_000))
    share = firsts["a"] / 10_000
    assert 0.77 <= share <= 0.83, share  # 4 / (4 + 1) = 0.8
    assert sorted(polling_order({"a": 1, "b": 1, "c": 1}, rng)) == ["a", "b", "c"]


@pytest.mark.django_db
def test_claim_by_queue_takes_postgres_order_and_the_claim_index():
    low = [services.submit("echo", {}, queue="ord", priority=-5)[0].pk for _ in range(3)]
    high, _ = services.submit("echo", {}, queue="ord", priority=5)
    leases = services.claim_next("w-order", ["ord"], 2)
    assert [x.job_id for x in leases] == [high.pk, low[0]]
    with connection.cursor() as cur:
        # On a table this small any index is as cheap as another: ask the planner to
        # avoid sorts, which only the claim index (queue, priority DESC, run_at, id) can.
        cur.execute("SET LOCAL enable_seqscan = off")
        cur.execute("SET LOCAL enable_sort = off")
        cur.execute(
            "EXPLAIN "
            + plain._CLAIM_NEXT_SQL.replace("%(queue)s", "'ord'")
            .replace("%(limit)s", "2")
            .replace("%(worker)s", "'w'")
            .replace("%(actor)s", "'w'")
            .replace("%(start)s", "0")
        )
        plan = "\n".join(r[0] for r in cur.fetchall())
    assert "job_claim_idx" in plan, plan
