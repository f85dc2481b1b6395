"""Redis transport: batches of ids per round trip, earlier queues first (SPEC §1)."""

from __future__ import annotations

import pytest

from jobs.transport import get_transport


@pytest.fixture
def transport():
    t = get_transport()
    assert t.enabled
    return t


@pytest.mark.parametrize("multi_pop", [True, False], ids=["blmpop", "blpop-fallback"])
def test_pop_takes_up_to_count_from_the_first_non_empty_queue(transport, multi_pop):
    transport._blmpop = multi_pop
    try:
        transport.push({"bulk": [1, 2, 3], "urgent": [10, 11]})
        assert transport.pop(["urgent", "bulk"], 1.0, 5) == ("urgent", [10, 11])
        assert transport.pop(["urgent", "bulk"], 1.0, 2) == ("bulk", [1, 2])
        assert transport.pop(["urgent", "bulk"], 0, 5) == ("bulk", [3])
        assert transport.pop(["urgent", "bulk"], 0, 5) == ("", [])
        assert transport.pop(["urgent", "bulk"], 0.2, 5) == ("", [])
    finally:
        transport._blmpop = True


def test_non_blocking_pop_prefers_earlier_queues(transport):
    transport.push({"b": [7], "a": [5, 6]})
    assert transport.pop(["a", "b"], 0, 10) == ("a", [5, 6])
    assert transport.pop(["a", "b"], 0, 10) == ("b", [7])


def test_cached_metric_children_are_the_labelled_children():
    from jobs import metrics

    child = metrics.child(metrics.CLAIMED, "cache-test")
    assert child is metrics.child(metrics.CLAIMED, "cache-test")
    before = metrics.CLAIMED.labels("cache-test")._value.get()
    child.inc(2)
    assert metrics.CLAIMED.labels("cache-test")._value.get() == before + 2


def test_a_repeated_batch_of_events_is_not_added_to_the_stream_twice(transport):
    """The dispatcher moves its cursor after its XADDs: a dispatcher killed between them
    sends the batch again, overlapping what the stream already holds."""
    key = f"{transport.prefix}events"
    transport._client.delete(key)

    def entry(n: int) -> dict[str, str]:
        return {"id": f"evt_{n}", "type": "job.done", "body": f'{{"n": {n}}}'}

    assert transport.append_events([entry(n) for n in (3, 4, 5)], 1000) == 3
    assert transport.append_events([entry(n) for n in (4, 5, 6, 7)], 1000) == 2
    assert transport.append_events([entry(5)], 1000) == 0
    ids = [fields[b"id"].decode() for _, fields in transport._client.xrange(key)]
    assert ids == ["evt_3", "evt_4", "evt_5", "evt_6", "evt_7"]
    transport._client.delete(key)
