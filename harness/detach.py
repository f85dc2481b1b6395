"""An interrupted `DETACH PARTITION … CONCURRENTLY`, made for real (issue 39).

The detach commits its first transaction (the partition is marked "detach pending"),
then waits for every older snapshot. A session holding one keeps it waiting; its
backend is then ended with `pg_terminate_backend`, as an operator's Ctrl-C, a lost
connection or a killed prunejobs ends it. What is left is a partition that PostgreSQL
no longer routes rows to nor reads through the parent, until `… FINALIZE`.
"""

from __future__ import annotations

import threading
import time

import psycopg


def pending(conn: psycopg.Connection, partition: str) -> bool:
    row = conn.execute(
        "SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass(%s)", [partition]
    ).fetchone()
    return bool(row and row[0])


def interrupt_detach(url: str, parent: str, partition: str, timeout: float = 30.0) -> None:
    """Start DETACH CONCURRENTLY of `partition` while a snapshot is held, wait until it
    is pending, terminate its backend, release the snapshot. Raises if it was pending
    already or never got pending (the partition is then as it was, or detached if the
    detach finished)."""
    with (
        psycopg.connect(url, autocommit=True) as watcher,
        psycopg.connect(url) as holder,
        psycopg.connect(url, autocommit=True) as detacher,
    ):
        if pending(watcher, partition):
            raise RuntimeError(f"{partition} is detach pending already")
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute(f"SELECT count(*) FROM (SELECT 1 FROM {parent} LIMIT 1) s")
        pid = detacher.info.backend_pid
        failure: list[BaseException] = []

        def detach() -> None:
            try:
                detacher.execute(f"ALTER TABLE {parent} DETACH PARTITION {partition} CONCURRENTLY")
            except psycopg.OperationalError:
                pass  # terminated: what this is for
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=detach, name="detach", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        try:
            while not pending(watcher, partition):
                if failure:
                    raise RuntimeError(f"DETACH CONCURRENTLY of {partition} failed: {failure[0]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{partition} never got detach pending in {timeout:g} s")
                time.sleep(0.02)
        finally:
            watcher.execute("SELECT pg_terminate_backend(%s)", [pid])
            thread.join(timeout)
            holder.rollback()
