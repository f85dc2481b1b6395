"""Running one attempt in a handler thread and settling its outcome."""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable

from django.db import (
    close_old_connections,
    connection,
    transaction,
)

from jobs import durable, metrics, services, tasks, watchdog
from jobs.errors import (
    class_path,
)
from jobs.lifecycle import CANCELLED
from jobs.observability import hooks
from jobs.services import Lease
from jobs.starts import Verdict
from jobs.tasks import JobContext
from jobs.worker.attempts import (
    InFlight,
    Outcome,
    OutcomeKind,
    _Cancelled,
    _FenceRejected,
    _key,
    by_policy,
    call_handler,
    check_result,
    failed_outcome,
    guarded,
    log,
    unknown_task,
)


class Execution:
    """A room of `Worker` (jobs.worker): its methods run on the worker's own state."""

    def _spawn_handler(self) -> None:
        thread = threading.Thread(
            target=self._handler_loop, name=f"job_{len(self._handlers)}", daemon=True
        )
        self._handlers.append(thread)
        thread.start()

    def _handler_loop(self, execute: Callable[[Lease, JobContext], Outcome] | None = None) -> None:
        """Take attempts off the heap and run them (`execute`: a process pool's slot
        runs them in its child; None: in this thread) until told to exit."""
        get = self._ready.get
        try:
            while True:
                if get() is None:
                    return
                item = self._take()
                if item is None:
                    continue
                # A session the server ended while this thread was idle or in its last
                # job is replaced before its next handler's ORM calls meet it.
                close_old_connections()
                self._run_taken(item, execute)
                if item.replaced:  # the watchdog ended it and gave the slot to a new thread
                    return
        finally:
            # Not left to the garbage collector: a test database is dropped once the
            # worker returns, and an open session refuses the drop (D228).
            connection.close()

    def _take(self) -> InFlight | None:
        """The best attempt on the heap, now this thread's (None: released unrun
        meanwhile); one `_ready` token was taken for it."""
        with self._lock:  # one token per heap entry: the heap is not empty
            item = heapq.heappop(self._heap)[-1]
            if not item.waiting:  # released unrun meanwhile (shutdown, waited too long)
                return None
            item.waiting = False
            item.running_since = time.monotonic()
            item.thread = threading.current_thread()
            self._waiting -= 1
            self._running += 1
        return item

    def _run_taken(
        self, item: InFlight, execute: Callable[[Lease, JobContext], Outcome] | None = None
    ) -> None:
        """Admit, time-limit, run and settle one attempt a thread took (the worker's
        handler threads, and jobs.testing in the caller's own thread)."""
        if not self._admit(item):
            return
        spec = tasks.get(item.lease.task)
        item.limit = watchdog.limit_seconds(
            item.lease.timeout, spec.timeout if spec is not None else None
        )
        if item.limit is not None:
            item.deadline = item.running_since + item.limit
        try:
            self._run_one(item.lease, item.ctx, execute)
        except BaseException as exc:  # the worker's own code around the handler
            log.exception("failed around an attempt", extra=item.lease.log_fields())
            self._settle(self._failed(item.lease, exc, False))

    def _admit(self, item: InFlight) -> bool:
        """Record a prefetched attempt's start (before its handler runs where a crash
        charge would decide, D77); a revoked or cancelled one is dropped unrun (D78)."""
        verdict = self.starter.admit(item.lease, item.ctx, item.marked)
        if verdict == Verdict.CANCELLED:
            self._settle(Outcome(item.lease, OutcomeKind.FAIL, error=CANCELLED, permanent=True))
        elif verdict != Verdict.RUN:
            self._forget([item.lease])
        return verdict == Verdict.RUN

    def _run_one(
        self,
        lease: Lease,
        ctx: JobContext,
        execute: Callable[[Lease, JobContext], Outcome] | None = None,
    ) -> None:
        started = time.monotonic()
        with hooks.attempt(lease):
            outcome = (execute or self._execute)(lease, ctx)
        durable.observe_steps(lease, ctx)
        took = time.monotonic() - started
        metrics.child(metrics.DURATION, lease.queue, lease.task).observe(took)
        self._learn_run_time(took)
        if (
            outcome.kind in (OutcomeKind.DONE, OutcomeKind.FAIL)
            and ctx.cancel_seen
            and not ctx.lost_authority
        ):
            # The handler saw the cancel request and returned or raised: cancelled, no retry.
            log.info("cancelled: the handler stopped on request", extra=lease.log_fields())
            outcome = Outcome(
                lease,
                OutcomeKind.FAIL,
                error=CANCELLED,
                permanent=True,
                error_class=outcome.error_class,
                traceback=outcome.traceback,
            )
        elif (
            outcome.kind in (OutcomeKind.DONE, OutcomeKind.FAIL)
            and ctx.timed_out
            and not ctx.lost_authority
        ):
            # Told its time was up, it returned or raised: a timeout, retried per budget.
            outcome = self._timed_out(lease, outcome)
        elif (
            outcome.kind == OutcomeKind.FAIL
            and ctx.stop.is_set()
            and self.stopping.is_set()
            and not ctx.lost_authority
        ):
            # Interrupted by shutdown, not by its own fault: hand it back without a retry.
            outcome = Outcome(lease, OutcomeKind.RELEASE)
        self._settle(outcome)

    def _execute(self, lease: Lease, ctx: JobContext) -> Outcome:
        spec = tasks.get(lease.task)
        if spec is None:
            return unknown_task(lease)
        run = self._execute_transactional if spec.transactional else call_handler
        return guarded(lease, spec, ctx, run, self._failed, self._park)

    def _park(self, lease: Lease, ctx: JobContext, wait: durable.Suspend) -> Outcome:
        """The handler parks its job (jobs.durable)."""
        self._mark_finishing(lease)  # its heartbeat stops before the lease is bumped
        durable.park(lease, ctx, wait)
        return Outcome(lease, OutcomeKind.SETTLED)

    def _timed_out(self, lease: Lease, outcome: Outcome) -> Outcome:
        with self._lock:
            item = self._inflight.get(_key(lease))
            limit = item.limit if item is not None else None
        timed_out = Outcome(
            lease,
            OutcomeKind.FAIL,
            error=watchdog.timed_out_error(limit or 0),
            error_class=outcome.error_class or class_path(watchdog.AttemptTimeout()),
            traceback=outcome.traceback,
        )
        spec = tasks.get(lease.task)
        if spec is None or spec.retry is None:
            return timed_out
        # The task's policy judges a timeout as a TimeoutError (AttemptTimeout is one).
        return by_policy(spec, lease, watchdog.AttemptTimeout(), lambda *a: timed_out)

    def _failed(
        self, lease: Lease, exc: BaseException, permanent: bool, message: str | None = None
    ) -> Outcome:
        return failed_outcome(self._traceback_log, lease, exc, permanent, message)

    def _execute_transactional(
        self, spec: tasks.TaskSpec, lease: Lease, ctx: JobContext
    ) -> Outcome:
        """Handler writes and the fenced completion commit together or not at all."""
        if spec.validate is not None:
            spec.validate(lease.payload)
        try:
            with transaction.atomic(durable=True):
                result = check_result(spec.fn(lease.payload, ctx))
                if ctx.cancel_seen:
                    raise _Cancelled  # its writes roll back; the job fails "cancelled"
                if not self._mark_finishing(lease):  # ended by the watchdog meanwhile
                    raise _FenceRejected
                if lease.job_id not in services.complete([(lease, result)]):
                    raise _FenceRejected
        except _FenceRejected:
            services.record_fence_rejections([lease], "complete")
            hooks.ended(lease, OutcomeKind.DONE, stale=True)
            return Outcome(lease, OutcomeKind.SETTLED)
        except _Cancelled:
            return Outcome(lease, OutcomeKind.FAIL, error=CANCELLED, permanent=True)
        finally:
            if not connection.in_atomic_block:  # run_jobs() inside a TestCase (D227)
                connection.close_if_unusable_or_obsolete()
        self._count_finished(1)
        return Outcome(lease, OutcomeKind.SETTLED)

    def _mark_finishing(self, lease: Lease) -> bool:
        """Stop heartbeats for the attempt; False if the watchdog ended it already."""
        with self._lock:
            item = self._inflight.get(_key(lease))
            if item is not None and item.abandoned:
                return False
            if item is not None and not item.finishing:
                item.finishing = True
                self._running -= 1
            return True

    def _settle(self, outcome: Outcome) -> None:
        self.starter.ended(outcome.lease)
        if outcome.kind == OutcomeKind.SETTLED:
            hooks.ended(outcome.lease, OutcomeKind.SETTLED)
            self._forget([outcome.lease])
            self._quiet.set()  # written by the handler itself: an idle dispatcher resumes
        else:
            if not self._mark_finishing(outcome.lease):
                return  # the watchdog wrote this attempt off: its late outcome is dropped
            self._outcomes.put(outcome)
            # A handler thread is free again: the next claim overlaps this write-back.
            self._slot_free.set()

    def _forget(self, leases: list[Lease]) -> None:
        with self._lock:
            for lease in leases:
                item = self._inflight.pop(_key(lease), None)
                if item is None:
                    continue
                if item.waiting:
                    item.waiting = False
                    self._waiting -= 1
                elif not item.finishing:
                    self._running -= 1
        self.gate.freed({lease.queue for lease in leases})
        self._slot_free.set()
