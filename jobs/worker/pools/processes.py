"""The process pool: each attempt runs in a pre-forked child, one at a time per child.

A slot is one parent thread (the "dispatcher") and its child. The dispatcher takes
attempts off the worker's heap exactly as a handler thread does, sends each to its
child and relays what the child asks (steps, signals, fenced checkpoints and parks)
and reports (progress), forwards stop/timeout/cancel flags, and settles the outcome
through the worker's fenced write-back: every job-state write is the parent's, on the
parent's connections; children hold no lease (D125).

A child that dies mid-attempt (segfault, os._exit, OOM or kill -9) is seen at once
(its sentinel, not a lease expiry): the attempt fails with "worker child exited:
signal 9 (SIGKILL)" and is retried per its budget, and a new child takes the slot
(D126). At timeout + grace the watchdog kills the child. Children are forked (D127)
and recycled after --max-tasks-per-child attempts or above --max-memory-per-child MB
(D128). Transactional tasks run in the dispatcher thread itself (D129).
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import threading
import time
from multiprocessing.connection import wait as wait_any

from jobs import durable, metrics, selectors, services, tasks, watchdog
from jobs.errors import class_path
from jobs.services import Lease
from jobs.tasks import JobContext
from jobs.worker.attempts import InFlight, Outcome, OutcomeKind, _key, log
from jobs.worker.pools import child as child_side

POLL = 0.1  # seconds between looks at the attempt's stop/timeout/cancel flags
EXIT_WAIT = 2.0  # seconds a recycled child gets to exit before it is killed


class ChildExited(Exception):
    """Stands for the class of an attempt whose child process died under it."""


def exit_description(code: int | None) -> str:
    if code is None:
        return "unknown status"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def flags(ctx: JobContext) -> tuple[bool, bool, bool, bool]:
    """What the child must know of the attempt; read without marking `stop` observed
    (a cancel only the child looked at counts as seen, jobs.tasks._StopEvent)."""
    stop = ctx._stop is not None and threading.Event.is_set(ctx._stop)
    return (stop, ctx.timed_out, ctx._cancel_requested, ctx.lost_authority)


class Slot:
    """One dispatcher thread and its child."""

    def __init__(self, pool: ProcessPool, number: int) -> None:
        self.pool = pool
        self.worker = pool.worker
        self.number = number
        self.lock = threading.Lock()
        self.process: multiprocessing.process.BaseProcess | None = None
        self.conn = None
        self.tasks = 0  # attempts the current child ran
        self.current: tuple[int, int] | None = None  # the attempt its child runs now
        self.thread = threading.Thread(target=self.serve, name=f"child_{number}", daemon=True)

    # --- the child's life -----------------------------------------------------------

    def spawn(self) -> None:
        started = time.monotonic()
        # One fork at a time in the pool: a child forked by another slot's thread while
        # this one's pipe end (or multiprocessing's sentinel pipe) was still open here
        # would inherit a copy, and this child's death would show neither EOF nor its
        # sentinel until that other child died too: the attempt would hang, not fail.
        with self.pool.forking:
            parent_end, child_end = self.pool.mp.Pipe(duplex=True)
            process = self.pool.mp.Process(
                target=child_side.main, args=(child_end,), name=f"jobs-child-{self.number}",
                daemon=True,
            )  # fmt: skip
            process.start()
            child_end.close()  # the child's end lives in the child only: death is EOF here
        self.process, self.conn, self.tasks = process, parent_end, 0
        metrics.POOL_CHILD_STARTS.observe(time.monotonic() - started)
        log.debug("child %s started", process.pid, extra={"worker_id": self.worker.worker_id})

    def retire(self, reason: str) -> None:
        """Ask the child to exit (killed if it does not within EXIT_WAIT) and fork its
        successor."""
        process, conn = self.process, self.conn
        if process is not None:
            try:
                conn.send(("exit",))
            except OSError:
                pass
            process.join(EXIT_WAIT)
            if process.is_alive():
                process.kill()
                process.join(1)
            conn.close()
            metrics.POOL_CHILDREN_REPLACED.labels(reason).inc()
        self.process = self.conn = None
        if not self.worker.halt.is_set():
            self.spawn()

    def kill(self) -> None:
        process = self.process
        if process is not None and process.is_alive():
            process.kill()

    def kill_if_running(self, key: tuple[int, int]) -> bool:
        """Kill the child if it still runs attempt `key` (the watchdog's hard end)."""
        with self.lock:
            if self.current != key:
                return False
            self.kill()
            return True

    def serve(self) -> None:
        try:
            self.spawn()
            self.worker._handler_loop(self.execute)
        finally:
            self.kill()
            if self.process is not None:
                self.process.join(1)

    # --- one attempt ----------------------------------------------------------------

    def execute(self, lease: Lease, ctx: JobContext) -> Outcome:
        spec = tasks.get(lease.task)
        if spec is not None and spec.transactional:
            # Its writes and its fenced completion share one transaction on this
            # thread's connection: run where that connection is (D129).
            return self.worker._execute(lease, ctx)
        if self.process is None or not self.process.is_alive():
            self.retire("exited")  # died between attempts
            if self.process is None:
                self.spawn()
        with self.lock:
            self.current = _key(lease)
        try:
            self.conn.send(("run", lease))
            outcome, rss = self.relay(lease, ctx)
        except OSError:  # the pipe broke under the send: the child is gone
            outcome, rss = self.died(lease), None
        except BaseException:
            self.kill()  # in an unknown state: the next attempt gets a new child
            raise
        finally:
            with self.lock:
                self.current = None
        if rss is None:  # it died: already replaced
            return outcome
        self.tasks += 1
        limit_tasks, limit_mb = self.pool.max_tasks, self.pool.max_memory_mb
        if limit_tasks and self.tasks >= limit_tasks:
            self.retire("max_tasks")
        elif limit_mb and rss > limit_mb:
            log.info("child %s at %.0f MB (limit %d MB): replacing it", self.process.pid, rss,
                     limit_mb, extra=lease.log_fields())  # fmt: skip
            self.retire("max_memory")
        return outcome

    def relay(self, lease: Lease, ctx: JobContext) -> tuple[Outcome, float | None]:
        """Serve the child until it ends the attempt or dies."""
        conn, sentinel = self.conn, self.process.sentinel
        sent = (False, False, False, False)
        while True:
            now = flags(ctx)
            if now != sent:
                conn.send(("ctx", now))
                sent = now
            ready = wait_any([conn, sentinel], POLL)
            if not ready:
                continue
            if conn not in ready:  # dead, and nothing left to read
                return self.died(lease), None
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return self.died(lease), None
            kind = message[0]
            if kind == "progress":
                ctx._progress = message[1]
            elif kind == "call":
                ok, value = self.answer(lease, ctx, message[1], message[2])
                try:
                    conn.send(("reply", ok, value))
                except (pickle.PicklingError, TypeError, AttributeError):
                    # An exception pickle cannot carry: its text is raised in the child.
                    conn.send(("reply", False, RuntimeError(f"{type(value).__name__}: {value}")))
            elif kind == "end":
                outcome, seen, names, rss = message[1:]
                if seen:
                    ctx._cancel_seen = True
                if names:
                    ctx._names = set(names)
                return outcome, rss

    def answer(self, lease: Lease, ctx: JobContext, op: str, args: tuple) -> tuple[bool, object]:
        """A child's request, done on the parent's connection: (ok, value or exception)."""
        try:
            if op == "steps":
                return True, selectors.job_steps(lease.job_id)
            if op == "signal":
                return True, selectors.job_signal(lease.job_id, *args)
            if op == "parents":
                return True, selectors.parent_outcomes(lease.job_id)
            if op == "checkpoint":
                held = services.checkpoint_step(lease, *args)
                if not held:
                    ctx.lost_authority = True
                    ctx.stop.set()
                    services.record_fence_rejections([lease], "step")
                return True, held
            if op == "workflow":
                return True, selectors.in_workflow(lease.job_id)
            if op == "continue":
                self.worker._park(lease, ctx, durable.ContinueAsNew(*args))
                return True, None
            if op == "park":
                reason, key, seconds, until, checkpoint = args
                wait = durable.Suspend(
                    reason, key=key, seconds=seconds, until=until, checkpoint=checkpoint
                )
                self.worker._park(lease, ctx, wait)
                return True, None
            return False, ValueError(f"unknown request {op!r}")
        except Exception as exc:  # raised in the child's handler, as in a thread
            return False, exc

    def died(self, lease: Lease) -> Outcome:
        """The child died under the attempt: failed now, retried per budget; a new child."""
        process = self.process
        # Under the fork lock: a fork reaps dead children too (multiprocessing's cleanup
        # in start()), and a reap racing this one would leave the status unknown here.
        with self.pool.forking:
            process.join(1)
        error = f"worker child exited: {exit_description(process.exitcode)}"
        log.error("attempt failed: %s", error, extra=lease.log_fields(child_pid=process.pid))
        with self.lock:
            self.current = None
        self.retire("died")
        return Outcome(lease, OutcomeKind.FAIL, error=error, error_class=class_path(ChildExited()))


class ProcessPool:
    kind = "processes"

    def __init__(self, worker, max_tasks: int = 0, max_memory_mb: int = 0) -> None:
        self.worker = worker
        self.capacity = worker.concurrency
        self.max_tasks = max(0, max_tasks)
        self.max_memory_mb = max(0, max_memory_mb)
        self.mp = multiprocessing.get_context("fork")
        self.forking = threading.Lock()  # see Slot.spawn
        self.slots: list[Slot] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        for _ in range(self.capacity):
            self._add_slot()

    def _add_slot(self) -> None:
        with self._lock:
            slot = Slot(self, len(self.slots))
            self.slots.append(slot)
        slot.thread.start()

    def _slot(self, item: InFlight) -> Slot | None:
        with self._lock:
            return next((s for s in self.slots if s.thread is item.thread), None)

    def replaces(self, item: InFlight) -> bool:
        slot = self._slot(item)
        if slot is None:
            return True
        with slot.lock:
            return slot.current != _key(item.lease)

    def write_off(self, item: InFlight, verdict: watchdog.Verdict) -> None:
        slot = self._slot(item)
        if slot is not None and slot.kill_if_running(_key(item.lease)):
            return  # its dispatcher sees the death and forks a new child
        # Ran in the dispatcher thread itself (a transactional task): abandoned like a
        # handler thread, a new slot serves in its place.
        self._add_slot()
        if verdict == watchdog.Verdict.TIMEOUT:
            self.worker._abandoned_thread(item.lease)

    def stop(self, cold: bool) -> None:
        """Children end with their dispatcher; any still alive is killed here, so none
        outlives the worker (they ignore SIGTERM: the parent decides)."""
        deadline = time.monotonic() + (0.5 if cold else 3.0)
        with self._lock:
            slots = list(self.slots)
        for slot in slots:
            slot.thread.join(max(0.0, deadline - time.monotonic()))
        for slot in slots:
            slot.kill()
        for process in self.mp.active_children():
            process.join(1)

    def alive(self) -> int:
        with self._lock:
            return sum(
                1
                for s in self.slots
                if s.thread.is_alive() and s.process is not None and s.process.is_alive()
            )
