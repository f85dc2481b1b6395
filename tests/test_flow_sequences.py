"""Sequences against the real database (jobs.flow): one job of a key at a time in
submission order, whatever path claims or ends it; a failure halts, resume and skip
continue in order (jobs.flow.triggers)."""

from __future__ import annotations

import pytest
from django.db import transaction

from jobs import services, submission
from jobs.exceptions import InvalidSubmission
from jobs.flow import sequences
from jobs.lifecycle import BLOCKED_RUN_AT
from jobs.models import Job, Sequence, SequenceWait

pytestmark = pytest.mark.django_db(transaction=True)


def _submit(key: str, n: int, **kw) -> list[int]:
    return [submission.submit("echo", {"i": i}, sequence_key=key, **kw)[0].pk for i in range(n)]


def _claimable(ids: list[int]) -> list[int]:
    """Which of `ids` a worker could take now (due, queued)."""
    return sorted(
        Job.objects.filter(pk__in=ids, status="queued", run_at__lte=_now()).values_list(
            "pk", flat=True
        )
    )


def _now():
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT now()")
        return cur.fetchone()[0]


def _run(job_id: int, *, error: str | None = None) -> None:
    lease = services.claim("w-seq", job_id)
    assert lease is not None, f"job {job_id} was not claimable"
    if error is None:
        assert job_id in services.complete([(lease, {"ok": True})])
    else:
        assert job_id in services.fail([(lease, error, True)])


def test_only_the_head_is_due_and_each_end_makes_the_next_due_in_order():
    ids = _submit("ledger-1", 4)
    other = _submit("ledger-2", 1)
    assert _claimable(ids) == [ids[0]]
    assert _claimable(other) == other  # another key runs beside it
    waiting = Job.objects.get(pk=ids[1])
    assert (waiting.wait_reason, waiting.run_at.year) == ("sequence", 9999)
    # A claim by id (the Redis path) of a waiting job takes nothing.
    assert services.claim("w-seq", ids[1]) is None
    for n, job_id in enumerate(ids):
        assert _claimable(ids) == [job_id]
        _run(job_id)
        assert Job.objects.get(pk=job_id).status == "done"
        if n + 1 < len(ids):
            assert Job.objects.get(pk=ids[n + 1]).wait_reason is None
    seq = Sequence.objects.get(key="ledger-1")
    assert (seq.active_job_id, seq.halted_job_id) == (None, None)
    assert not SequenceWait.objects.filter(sequence=seq).exists()
    # Idle again: the next submission runs at once.
    assert _claimable(_submit("ledger-1", 1)) != []


def test_submit_many_keeps_the_order_of_the_batch():
    out = submission.submit_many(
        [{"task": "echo", "payload": {"i": i}, "sequence_key": "k"} for i in range(5)]
    )
    ids = [o.job_id for o in out]
    for job_id in ids:
        assert _claimable(ids) == [job_id]
        _run(job_id)


def test_a_failure_halts_and_resume_runs_it_again_then_the_rest_in_order():
    ids = _submit("acct", 3)
    _run(ids[0], error="boom")
    assert _claimable(ids) == []
    assert {j.wait_reason for j in Job.objects.filter(pk__in=ids[1:])} == {"sequence_halted"}
    # A job submitted while halted waits too, as halted.
    late = _submit("acct", 1)[0]
    assert Job.objects.get(pk=late).wait_reason == "sequence_halted"
    page = sequences.detail(None, "acct")
    assert (page.state, page.halted_job.pk, page.waiting) == ("halted", ids[0], 3)

    assert sequences.resume(None, "acct", "staff:t") == ids[0]
    assert _claimable([*ids, late]) == [ids[0]]
    assert {j.wait_reason for j in Job.objects.filter(pk__in=[*ids[1:], late])} == {"sequence"}
    for job_id in [*ids, late]:
        assert _claimable([*ids, late]) == [job_id]
        _run(job_id)
    with pytest.raises(sequences.SequenceRefused):
        sequences.resume(None, "acct", "staff:t")


def test_skip_leaves_the_failed_job_failed_and_runs_the_next():
    ids = _submit("acct-2", 3)
    _run(ids[0], error="boom")
    assert sequences.skip(None, "acct-2", "staff:t") == ids[1]
    assert Job.objects.get(pk=ids[0]).status == "failed"
    assert _claimable(ids) == [ids[1]]
    assert Job.objects.get(pk=ids[2]).wait_reason == "sequence"


def test_a_cancelled_job_does_not_halt_and_a_cancelled_waiter_is_passed_over():
    ids = _submit("c", 4)
    services.cancel([ids[1]], "staff:t")  # waiting: ends cancelled, its turn is skipped
    _run(ids[0])
    assert _claimable(ids) == [ids[2]]
    services.cancel([ids[2]], "staff:t")  # the due one, cancelled before it ran
    assert _claimable(ids) == [ids[3]]


def test_an_idempotent_replay_leaves_no_phantom_turn():
    first, created = submission.submit("echo", {}, sequence_key="p", idempotency_key="a")
    assert created
    _run(first.pk)
    # The replay's insert is skipped ON CONFLICT after the trigger took the turn.
    again, created = submission.submit("echo", {}, sequence_key="p", idempotency_key="a")
    assert (again.pk, created) == (first.pk, False)
    assert _claimable(_submit("p", 1)) != []


def test_a_submission_in_a_rolled_back_transaction_leaves_no_turn():
    with pytest.raises(RuntimeError), transaction.atomic():
        submission.submit("echo", {}, sequence_key="r")
        raise RuntimeError
    assert _claimable(_submit("r", 1)) != []


@pytest.mark.parametrize("bad", ["", "has space", 7, "x" * 201])
def test_a_bad_sequence_key_is_refused(bad):
    with pytest.raises(InvalidSubmission) as refused:
        submission.submit("echo", {}, sequence_key=bad)
    assert refused.value.code == "invalid_sequence_key"
    assert not Job.objects.exists()


def test_a_staff_retry_of_an_old_failure_waits_its_turn_at_the_end():
    ids = _submit("old", 2)
    _run(ids[0], error="boom")
    sequences.skip(None, "old", "staff:t")  # ids[1] is due now
    services.staff_retry([ids[0]], "staff:t")
    retried = Job.objects.get(pk=ids[0])
    assert (retried.status, retried.wait_reason, str(retried.run_at.year)) == (
        "queued",
        "sequence",
        BLOCKED_RUN_AT[:4],
    )
    _run(ids[1])
    assert _claimable(ids) == [ids[0]]


def test_the_commands_show_resume_and_skip_and_queue_list_counts(capsys):
    from django.core.management import CommandError, call_command

    ids = _submit("cmd", 3)
    _run(ids[0], error="boom")
    call_command("sequence", "show", "cmd")
    out = capsys.readouterr().out
    assert "sequence cmd: halted, 2 waiting" in out and f"halted job: {ids[0]}" in out
    call_command("queue", "list")
    assert "sequences\t0 running\t1 halted (cmd)" in capsys.readouterr().out
    call_command("sequence", "skip", "cmd")
    assert f"active job: {ids[1]}" in capsys.readouterr().out
    with pytest.raises(CommandError, match="is not halted"):
        call_command("sequence", "resume", "cmd")
    with pytest.raises(CommandError, match="no sequence"):
        call_command("sequence", "show", "nope")
    with pytest.raises(CommandError, match="unknown client"):
        call_command("sequence", "show", "cmd", "--client", "nobody")


def test_the_mover_moving_a_finished_sequence_job_changes_no_turn():
    from jobs import partitions

    ids = _submit("moved", 3)
    _run(ids[0])
    before = Job.objects.get(pk=ids[0]).run_at
    while partitions.move_batch(hot_seconds=0):
        pass
    moved = Job.objects.get(pk=ids[0])
    assert (moved.status, moved.run_at, moved.wait_reason) == ("done", before, None)
    assert Sequence.objects.get(key="moved").active_job_id == ids[1]
    assert not SequenceWait.objects.filter(job_id=ids[0]).exists()
    assert _claimable(ids) == [ids[1]]
