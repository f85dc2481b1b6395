"""Group commit of checkpoints (D385): concurrent handler threads' checkpoints share one
transaction, each still fenced by its own lease, each caller answered only once its
row committed, and a batch's failure never becomes another caller's."""

from __future__ import annotations

import dataclasses
import threading
import time

import psycopg
import pytest
from django.db import DataError, connection, connections

import tests.durable_tasks  # noqa: F401 - registers the durable test tasks
from jobs import services
from jobs.services import grouped, waits

pytestmark = pytest.mark.django_db(transaction=True)


def _until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def _conn() -> psycopg.Connection:
    s = connection.settings_dict
    return psycopg.connect(host=s["HOST"] or "127.0.0.1", port=s["PORT"] or 5432,
                           user=s["USER"], dbname=s["NAME"], autocommit=True)  # fmt: skip


class _Call(threading.Thread):
    """checkpoint_step on a thread of its own (its own connection, as a handler's)."""

    def __init__(self, lease: services.Lease, name: str, text: str = "1") -> None:
        super().__init__(daemon=True)
        self.args_ = (lease, name, text)
        self.answer: object = None
        self.error: BaseException | None = None
        self.visible_at_return: bool | None = None
        self.start()

    def run(self) -> None:
        try:
            self.answer = services.checkpoint_step(*self.args_)
            with _conn() as other:  # committed when the caller is answered
                row = other.execute(
                    "SELECT 1 FROM jobs_jobstep WHERE job_id = %s AND name = %s",
                    [self.args_[0].job_id, self.args_[1]],
                ).fetchone()
            self.visible_at_return = row is not None
        except BaseException as exc:
            self.error = exc
        finally:
            connections.close_all()


def _leases(n: int) -> list[services.Lease]:
    out = []
    for _ in range(n):
        job, _ = services.submit("durable.five_steps", {"dir": "/nonexistent"})
        out.append(services.claim(f"w-{job.pk}", job.pk))
    return out


def _held_lead(lease: services.Lease, then: list[tuple[services.Lease, str, str]]):
    """Hold `lease`'s row locked so its checkpoint (the lead, alone) waits; queue `then`
    behind it; release. The queued ones are written by the next leader as one batch."""
    blocker = _conn()
    blocker.execute("BEGIN")
    blocker.execute("SELECT 1 FROM jobs_job WHERE id = %s FOR UPDATE", [lease.job_id])
    first = _Call(lease, "a")
    group = waits._CHECKPOINTS
    _until(lambda: group._leading and not group._queued)  # its batch (of one) taken
    calls = [_Call(*args) for args in then]
    _until(lambda: len(group._queued) == len(then))
    blocker.execute("ROLLBACK")
    blocker.close()
    for c in [first, *calls]:
        c.join(30)
        assert not c.is_alive()
    return first, calls


def _steps(*leases: services.Lease) -> dict[tuple[int, str], tuple[str, object]]:
    with _conn() as c:
        rows = c.execute(
            "SELECT job_id, name, xmin::text, result FROM jobs_jobstep WHERE job_id = ANY(%s)",
            [[x.job_id for x in leases]],
        ).fetchall()
    return {(r[0], r[1]): (r[2], r[3]) for r in rows}


def test_overlapping_checkpoints_commit_in_one_transaction_each_after_its_commit():
    a, b, c = _leases(3)
    first, calls = _held_lead(a, [(b, "b", '{"x": 1}'), (c, "c", "2")])
    assert [first.answer, *(x.answer for x in calls)] == [True, True, True]
    assert all(x.visible_at_return for x in [first, *calls])
    steps = _steps(a, b, c)
    assert steps[(b.job_id, "b")][1] == {"x": 1} and steps[(c.job_id, "c")][1] == 2
    # b and c: one transaction (the batch); a: its own, before it.
    assert steps[(b.job_id, "b")][0] == steps[(c.job_id, "c")][0] != steps[(a.job_id, "a")][0]


def test_each_checkpoint_of_a_batch_is_fenced_by_its_own_lease():
    a, b, c = _leases(3)
    stale = dataclasses.replace(b, lease_version=b.lease_version + 1)  # not the holder
    first, calls = _held_lead(a, [(stale, "b", "1"), (c, "c", "1")])
    assert [first.answer, calls[0].answer, calls[1].answer] == [True, False, True]
    assert set(_steps(a, b, c)) == {(a.job_id, "a"), (c.job_id, "c")}


def test_a_step_stored_already_answers_by_the_fence_in_a_batch():
    a, b, c = _leases(3)
    assert services.checkpoint_step(b, "b", "1")
    first, calls = _held_lead(a, [(b, "b", "99"), (c, "c", "1")])
    assert [first.answer, calls[0].answer, calls[1].answer] == [True, True, True]
    assert _steps(b)[(b.job_id, "b")][1] == 1  # the first stored result stands


def test_a_result_postgresql_refuses_fails_its_own_step_only():
    a, b, c = _leases(3)
    first, calls = _held_lead(a, [(b, "b", '"\\u0000"'), (c, "c", "1")])
    assert first.answer is True and calls[1].answer is True
    assert isinstance(calls[0].error, DataError)
    assert set(_steps(a, b, c)) == {(a.job_id, "a"), (c.job_id, "c")}


def test_a_checkpoint_inside_a_transaction_is_never_batched_with_others():
    """Written on the caller's connection, alone: it commits with the caller's
    transaction, so another thread's step must not ride in it."""
    from django.db import transaction

    (a,) = _leases(1)
    with transaction.atomic():
        assert services.checkpoint_step(a, "a", "1")
        assert not waits._CHECKPOINTS._leading
    assert (a.job_id, "a") in _steps(a)


# --- the leader/follower rule, without a database ---------------------------------------


def _group(one, many) -> grouped.GroupCommit:
    return grouped.GroupCommit(one, many)


def test_a_lone_writer_writes_at_once_and_its_error_is_its_own():
    seen = []

    def one(item):
        seen.append(item)
        if item == "bad":
            raise ValueError(item)
        return item.upper()

    g = _group(one, lambda items: pytest.fail("no batch of one"))
    assert g.write("x") == "X"
    with pytest.raises(ValueError):
        g.write("bad")
    assert g.write("y") == "Y" and seen == ["x", "bad", "y"] and not g._leading


def test_writers_queued_behind_the_lead_are_written_as_one_batch_then_lead_passes():
    release = threading.Event()
    batches: list[list] = []

    def one(item):
        if item == "first":
            release.wait(10)
        return f"one:{item}"

    def many(items):
        batches.append(list(items))
        return [f"many:{i}" for i in items]

    g = _group(one, many)
    answers: dict[str, object] = {}

    def call(item):
        answers[item] = g.write(item)

    threads = [threading.Thread(target=call, args=("first",))]
    threads[0].start()
    _until(lambda: g._leading and not g._queued)
    for item in ("p", "q", "r"):
        threads.append(threading.Thread(target=call, args=(item,)))
        threads[-1].start()
    _until(lambda: len(g._queued) == 3)
    release.set()
    for t in threads:
        t.join(10)
    assert batches == [["p", "q", "r"]]
    assert answers == {"first": "one:first", "p": "many:p", "q": "many:q", "r": "many:r"}
    assert not g._leading and not g._queued


def test_a_failed_batch_writes_each_alone_and_an_unsettled_one_alone():
    release = threading.Event()

    def one(item):
        if item == "first":
            release.wait(10)
        if item == "bad":
            raise ValueError(item)
        return f"one:{item}"

    def many(items):
        if "bad" in items:
            raise RuntimeError("the batch failed")
        return [None if i == "unsettled" else f"many:{i}" for i in items]

    for queued, expected in (
        (["bad", "ok"], {"ok": "one:ok", "bad": ValueError}),
        (["unsettled", "ok"], {"unsettled": "one:unsettled", "ok": "many:ok"}),
    ):
        release.clear()
        g = _group(one, many)
        answers: dict[str, object] = {}

        def call(item, g=g, answers=answers):
            try:
                answers[item] = g.write(item)
            except ValueError as exc:
                answers[item] = type(exc)

        threads = [threading.Thread(target=call, args=("first",))]
        threads[0].start()
        _until(lambda g=g: g._leading and not g._queued)
        for item in queued:
            threads.append(threading.Thread(target=call, args=(item,)))
            threads[-1].start()
        n = len(queued)
        _until(lambda g=g, n=n: len(g._queued) == n)
        release.set()
        for t in threads:
            t.join(10)
        assert answers == {"first": "one:first", **expected}
        assert not g._leading
