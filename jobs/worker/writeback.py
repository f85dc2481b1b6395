"""The flusher: finished attempts written back in fenced batches (natural group
commit); a row PostgreSQL refuses fails its own job only."""

from __future__ import annotations

import queue as queue_mod
import time
from collections.abc import Callable
from typing import Any

from django.db import (
    DatabaseError,
    InterfaceError,
    connection,
)

from jobs import durable, metrics, services
from jobs.errors import (
    MAX_ERROR_CHARS,
    class_path,
    storable,
)
from jobs.flow import sequences
from jobs.lifecycle import TERMINAL
from jobs.observability import hooks
from jobs.runtime import Backoff
from jobs.worker.attempts import (
    _ROW_DATA_ERRORS,
    DB_BACKOFF_MAX,
    MAX_BATCH,
    Outcome,
    OutcomeKind,
    _first_line,
    _key,
    log,
)


class WriteBack:
    """A room of `Worker` (jobs.worker): its methods run on the worker's own state."""

    def _flush_loop(self) -> None:
        outcomes = self._outcomes
        while not (self.halt.is_set() and outcomes.empty()):
            try:
                batch = [outcomes.get(timeout=0.1)]
            except queue_mod.Empty:
                continue
            # Natural group commit: everything that finished while the last write was
            # in flight goes into this one; an optional flush_interval waits for more.
            deadline = time.monotonic() + self.flush_interval
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(outcomes.get_nowait())
                except queue_mod.Empty:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        batch.append(outcomes.get(timeout=remaining))
                    except queue_mod.Empty:
                        break
            self._quiet.set()  # the write-back is under way: an idle dispatcher resumes
            try:
                self._write_back(batch)
            except Exception:  # never let one batch end write-backs for good
                log.exception(
                    "write-back of %d outcome(s) failed; the reaper will recover their jobs",
                    len(batch),
                    extra={"worker_id": self.worker_id},
                )
                self._forget([o.lease for o in batch])
        connection.close()

    def _write_back(self, batch: list[Outcome]) -> None:
        """Write a batch so that no statement holds two attempts of one job (results are
        matched to leases by job id; a job re-claimed by this worker while its stale
        attempt's result waited is written in a second round)."""
        while batch:
            seen: set[int] = set()
            now, later = [], []
            for o in batch:
                (later if o.lease.job_id in seen else now).append(o)
                seen.add(o.lease.job_id)
            self._write_back_unique(now)
            batch = later

    def _write_back_unique(self, batch: list[Outcome]) -> None:
        """One statement per kind for the whole batch, each retried until Postgres answers.

        A row PostgreSQL refuses (a data error, not a lost connection) is never retried
        with its batch: the batch is split until the row is alone, the rest is written,
        and that row's job fails by itself (see `_write_rows`).
        """
        with self._lock:
            batch = [o for o in batch if _key(o.lease) not in self._released]
        done = [(o.lease, o.result) for o in batch if o.kind == OutcomeKind.DONE]
        failed = [
            (
                o.lease,
                o.error,
                o.permanent,
                o.error_class,
                o.traceback,
                o.retry_after,
                o.retry_delay,
                o.retry_reason,
            )  # fmt: skip
            for o in batch
            if o.kind == OutcomeKind.FAIL
        ]
        released = [o.lease for o in batch if o.kind == OutcomeKind.RELEASE]
        unwritten: set[int] = set()  # job ids given up on: left to the reaper, not stale

        def refused_result(item: tuple, exc: Exception) -> None:
            lease, _ = item
            error = storable(f"invalid result: PostgreSQL refused it ({_first_line(exc)})")
            failed.append((lease, error[:MAX_ERROR_CHARS], True, class_path(exc), None))
            log.warning("result refused by PostgreSQL: failing its job", extra=lease.log_fields())

        def refused_error(item: tuple, exc: Exception) -> tuple | None:
            lease, error, permanent, cls, tb, *delays = item
            if cls is not None or tb is not None or not error.isascii():
                # Store the error alone, in plain ASCII: the detail was what was refused.
                ascii_error = error.encode("ascii", "backslashreplace").decode("ascii")
                return (lease, ascii_error[:MAX_ERROR_CHARS], permanent, None, None, *delays)
            unwritten.add(lease.job_id)
            log.error(
                "PostgreSQL refused a failed attempt's write-back (%s); the reaper will "
                "recover the job",
                _first_line(exc),
                extra=lease.log_fields(),
            )
            return None

        ok_done = ok_fail = ok_rel = None
        ok_done = self._write_rows(services.complete, done, refused_result)
        if ok_done is not None:
            ok_fail = self._write_rows(services.fail, failed, refused_error)
        if ok_fail is not None:
            ok_rel = self._write_rows(services.release, released, None)
        if ok_done is None or ok_fail is None or ok_rel is None:
            log.error(
                "giving up write-back of %d outcome(s) at exit; the reaper will recover their jobs",
                len(batch),
                extra={
                    "worker_id": self.worker_id,
                    "job_ids": [o.lease.job_id for o in batch][:20],
                },
            )
            self._forget([o.lease for o in batch])
            return
        failing = {item[0].job_id for item in failed}
        stale = [lease for lease, _ in done if lease.job_id not in ok_done.keys() | failing]
        stale += [
            item[0]
            for item in failed
            if item[0].job_id not in ok_fail and item[0].job_id not in unwritten
        ]
        stale_ops = {lease.job_id: "complete" for lease, _ in done}
        stale_ops.update({item[0].job_id: "fail" for item in failed})
        for op in ("complete", "fail"):
            services.record_fence_rejections([s for s in stale if stale_ops[s.job_id] == op], op)
        hooks.written(batch, ok_done, ok_fail, stale)
        self._count_finished(
            len(ok_done) + sum(1 for f in ok_fail.values() if f.status in TERMINAL)
        )
        # Workflow children these ends made due: pushed now, not at the next poll.
        ended = [*ok_done, *(i for i, f in ok_fail.items() if f.status in TERMINAL)]
        durable.after_ends(ended)
        sequences.after_ends(ended)  # sequence jobs and batch callbacks, likewise
        for o in batch:
            if o.kind == OutcomeKind.RELEASE and o.lease.job_id in ok_rel:
                log.info("released on shutdown", extra=o.lease.log_fields())
        self._forget([o.lease for o in batch])

    def _write_rows(
        self,
        write: Callable[[list], Any],
        items: list,
        refused: Callable[[Any, Exception], Any] | None,
    ) -> dict[int, Any] | None:
        """Run `write` over `items` until it lands; returns what landed, by job id.

        Connection and server trouble retries the same rows with backoff (None when
        the worker exits meanwhile). A data error is about some row, never about the
        batch: the rows are split in halves and written apart until the one PostgreSQL
        refuses is alone, and `refused(item, exc)` decides what happens to it (a
        replacement item to write instead, or None). Each statement commits on its
        own, so a retry never repeats rows that already landed.
        """
        landed: dict[int, Any] = {}
        pending = [items] if items else []
        backoff = Backoff(0.1, DB_BACKOFF_MAX)
        while pending:
            chunk = pending.pop()
            try:
                got = write(chunk)
            except _ROW_DATA_ERRORS as exc:
                if len(chunk) > 1:
                    half = len(chunk) // 2
                    pending += [chunk[half:], chunk[:half]]
                    continue
                lease = chunk[0][0] if isinstance(chunk[0], tuple) else chunk[0]
                metrics.WRITEBACK_REFUSED.labels(lease.queue, lease.task, write.__name__).inc()
                log.warning(
                    "write-back row refused by PostgreSQL: %s",
                    _first_line(exc),
                    extra=lease.log_fields(),
                )
                replacement = refused(chunk[0], exc) if refused is not None else None
                if replacement is not None:
                    pending.append([replacement])
                continue
            except (DatabaseError, InterfaceError) as exc:
                pending.append(chunk)
                metrics.child(metrics.DB_ERRORS, "write_back").inc()
                wait = backoff.next()
                log.warning(
                    "write-back failed, retrying in %.1fs: %s",
                    wait,
                    exc,
                    extra={"worker_id": self.worker_id},
                )
                connection.close()
                if self.halt.wait(wait) and wait >= DB_BACKOFF_MAX:
                    return None
                continue
            landed.update(got if isinstance(got, dict) else dict.fromkeys(got))
        return landed
