"""The child side of the process pool: runs one attempt at a time, sent by its parent.

The child owns no lease and writes no job state: its context asks the parent for
steps, signals and parents' results, and for every fenced write (checkpoints, parks);
the parent writes the outcome it sends back. Messages, over one duplex pipe:

    parent -> child   ("run", lease) | ("ctx", flags) | ("reply", ok, value) | ("exit",)
    child -> parent   ("progress", report) | ("call", op, args) | ("end", outcome, seen, steps, rss)

The handler runs on the child's main thread; a reader thread applies the parent's
stop, timeout and cancel flags to the running context, and ends the child at once
when the parent is gone (pipe EOF).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.db import close_old_connections, connections

from jobs import durable, tasks
from jobs.errors import PerKeyRateLimit
from jobs.services import Lease
from jobs.tasks import JobContext
from jobs.worker.attempts import (
    Outcome,
    OutcomeKind,
    call_handler,
    failed_outcome,
    guarded,
    unknown_task,
)

PROGRESS_EVERY = 0.05  # seconds between progress messages to the parent (the latest wins)
# A hook of the tests and the fault suite, read once at the child's start: the path of a
# file holding seconds; while it exists, the child's main thread sleeps that long right
# after sending `end`, while its reader thread already reads the parent's next `run`
# (D210). Unset (production): no cost per attempt.
PAUSE_AFTER_END_ENV = "JOBS_TEST_PAUSE_AFTER_END"


def forget_inherited_connections() -> None:
    """Drop the database connections inherited from the parent without closing them:
    closing would send PostgreSQL a Terminate on the parent's own socket. psycopg
    does not finish a connection object in another process than its creator, so the
    handler's ORM use opens the child's own fresh connection (D127)."""
    for conn in connections.all(initialized_only=True):
        conn.connection = None
        conn.in_atomic_block = False
        conn.needs_rollback = False
        conn.savepoint_ids = []
        conn.run_on_commit = []


class Channel:
    """The child's end of the pipe: requests answered by the parent, progress sent."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.replies: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.progress_at = float("-inf")
        self.pending: Any = None

    def send(self, message: tuple) -> None:
        with self.lock:
            self.conn.send(message)

    def call(self, op: str, *args: Any) -> Any:
        self.send(("call", op, args))
        ok, value = self.replies.get()
        if not ok:
            raise value
        return value

    def progress(self, report: Any) -> None:
        now = time.monotonic()
        if now - self.progress_at >= PROGRESS_EVERY:
            self.progress_at = now
            self.pending = None
            self.send(("progress", report))
        else:
            self.pending = report

    def flush(self) -> None:
        if self.pending is not None:
            report, self.pending = self.pending, None
            self.send(("progress", report))


@dataclass
class ChildContext(durable.DurableContext):
    """A handler's context in a child: reads and fenced writes go through the parent."""

    channel: Channel | None = field(default=None, repr=False, compare=False)

    def _read_steps(self):
        return self.channel.call("steps")

    def _read_signal(self, key: str):
        return self.channel.call("signal", key)

    def _read_parents(self):
        return self.channel.call("parents")

    def _write_checkpoint(self, name: str, text: str) -> bool:
        return self.channel.call("checkpoint", name, text)

    def _in_workflow(self) -> bool:
        return self.channel.call("workflow")

    def progress(self, done: float, total: float | None = None, message: str = "") -> None:
        super().progress(done, total, message)
        self.channel.progress(self._progress)

    def apply(self, flags: tuple[bool, bool, bool, bool]) -> None:
        """The parent's view of the attempt: stop, timed out, cancel requested, lost."""
        stop, timed_out, cancel, lost = flags
        if timed_out:
            self.timed_out = True
        if cancel:
            self._cancel_requested = True
        if lost:
            self.lost_authority = True
        if stop or timed_out or cancel or lost:
            self.stop.set()


def context(lease: Lease, channel: Channel) -> ChildContext:
    return durable.context(lease, ChildContext, channel=channel)


def rss_mb() -> float:
    """This process's resident memory now, in MB (Linux; 0 where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def pause_after_end(path: str) -> None:
    try:
        seconds = float(Path(path).read_text())
    except (OSError, ValueError):
        return  # disarmed
    time.sleep(max(0.0, seconds))


def carried(outcome: Outcome) -> Outcome:
    """The outcome as the parent stores it, in types pickle always carries: the result as
    its JSON (what the write-back stores, already checked by check_result), and
    `retry_after` as a float (D212)."""
    result = outcome.result
    if result is not None:
        result = json.loads(json.dumps(result))
    try:
        retry_after = None if outcome.retry_after is None else float(outcome.retry_after)
    except (TypeError, ValueError):
        retry_after = None
    return dataclasses.replace(outcome, result=result, retry_after=retry_after)


def send_end(channel: Channel, outcome: Outcome, *rest: Any) -> None:
    """The attempt's end to the parent. A value JSON takes but pickle cannot carry (an
    instance of a class defined inside the handler) fails the pickling before a byte is
    written: it is sent again as stored, so the child lives on (D212)."""
    try:
        channel.send(("end", outcome, *rest))
    except (pickle.PicklingError, TypeError, AttributeError):
        channel.send(("end", carried(outcome), *rest))


def main(conn) -> None:
    """The child's life: run what the parent sends until told to exit or orphaned."""
    # The parent decides when a child ends (a terminal's Ctrl-C and a supervisor's
    # SIGTERM to the process group reach the child too): warm stops stay warm.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
    forget_inherited_connections()
    pause_file = os.environ.get(PAUSE_AFTER_END_ENV)
    channel = Channel(conn)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    current: list[ChildContext | None] = [None]

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the parent is gone: nothing this child does could land
            kind = message[0]
            if kind == "run":
                ctx = context(message[1], channel)
                current[0] = ctx
                inbox.put((message[1], ctx))
            elif kind == "ctx":
                if current[0] is not None:
                    current[0].apply(message[1])
            elif kind == "reply":
                channel.replies.put(message[1:])
            else:
                inbox.put(None)

    threading.Thread(target=read, name="parent", daemon=True).start()
    limiter = PerKeyRateLimit(burst=5, every=12.0)
    while (got := inbox.get()) is not None:
        lease, ctx = got
        close_old_connections()
        outcome = run(lease, ctx, channel, limiter)
        channel.flush()
        names = sorted(ctx._names or ())
        # Cleared before `end` is sent: the parent sends the next `run` only once it has
        # read `end`, so the reader installs the next attempt's context after this line,
        # never before it (cleared after, the next attempt's stop, timeout and cancel
        # flags were lost: the parent sends a flag once, D210).
        current[0] = None
        send_end(channel, outcome, ctx.cancel_seen, names, rss_mb())
        if pause_file:
            pause_after_end(pause_file)
    os._exit(0)


def run(lease: Lease, ctx: ChildContext, channel: Channel, limiter: PerKeyRateLimit) -> Outcome:
    spec = tasks.get(lease.task)
    if spec is None:
        return unknown_task(lease)

    def park(lease: Lease, ctx: JobContext, wait: durable.Suspend) -> Outcome:
        if isinstance(wait, durable.ContinueAsNew):
            channel.call("continue", wait.payload_json)
            return Outcome(lease, OutcomeKind.SETTLED)
        channel.call("park", wait.reason, wait.key, wait.seconds, wait.until, wait.checkpoint)
        return Outcome(lease, OutcomeKind.SETTLED)

    def failed(*args: Any) -> Outcome:
        return failed_outcome(limiter, *args)

    return guarded(lease, spec, ctx, call_handler, failed, park)
