"""A PostgreSQL primary and a streaming replica of the caller's own, each on a free port.

The shared server's pg_hba.conf allows no replication connections, so the pair is made
from scratch: `initdb` in a temp dir (replication allowed from loopback, trust), then
`pg_basebackup -R` of it for the replica (hot standby). PostgreSQL refuses to run as
root: as root both run as the system user `postgres`. `stop()` stops both and deletes
their data.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import psycopg

from harness import pgserver
from harness.pgserver import BIN, USER
from harness.procs import free_port, wait_until


def available() -> str | None:
    """None when a pair can be made here, else why not."""
    return pgserver.available("pg_basebackup")


class PostgresPair:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pgpair-"))
        self.primary_port = free_port()
        self.replica_port = free_port()
        self.user = pgserver.os_user()

    def _run(self, *argv: str | Path) -> None:
        pgserver.run_pg(*argv)

    def url(self, database: str = "postgres", replica: bool = False) -> str:
        port = self.replica_port if replica else self.primary_port
        return f"postgres://{self.user}@127.0.0.1:{port}/{database}"

    def _start(self, data: Path, port: int) -> None:
        options = f"-p {port} -k {self.dir} -c listen_addresses=127.0.0.1"
        self._run(BIN / "pg_ctl", "-D", data, "-o", options, "-l", f"{data}.log", "-w", "start")

    def start(self) -> PostgresPair:
        if os.geteuid() == 0:
            shutil.chown(self.dir, USER)
        primary, replica = self.dir / "primary", self.dir / "replica"
        self._run(BIN / "initdb", "-D", primary, "-U", self.user, "--auth=trust", "-E", "UTF8",
                  "--no-sync")  # fmt: skip
        with open(primary / "postgresql.conf", "a") as conf:
            conf.write("wal_level = replica\nmax_wal_senders = 4\nfsync = off\n"
                       "synchronous_commit = off\nfull_page_writes = off\n")  # fmt: skip
        with open(primary / "pg_hba.conf", "a") as hba:
            hba.write("host replication all 127.0.0.1/32 trust\n")
        self._start(primary, self.primary_port)
        self._run(BIN / "pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary_port),
                  "-U", self.user, "-D", replica, "-R", "-X", "stream", "--no-sync")  # fmt: skip
        self._start(replica, self.replica_port)
        wait_until(self.streaming, 30, "the replica to stream from the primary")
        return self

    def _one(self, sql: str, replica: bool = False, database: str = "postgres"):
        with psycopg.connect(self.url(database, replica), autocommit=True) as conn:
            cur = conn.execute(sql)
            return cur.fetchone() if cur.description else None

    def streaming(self) -> bool:
        try:
            row = self._one("SELECT count(*) FROM pg_stat_wal_receiver WHERE status = 'streaming'",
                            replica=True)  # fmt: skip
        except psycopg.Error:
            return False
        return bool(row and row[0])

    def createdb(self, name: str) -> str:
        """A database on the primary (and so on the replica); its primary URL."""
        self._one(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def caught_up(self) -> bool:
        """The replica has replayed everything the primary wrote so far."""
        (lsn,) = self._one("SELECT pg_current_wal_lsn()::text")
        (ok,) = self._one(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn", replica=True)
        return bool(ok)

    def pause_replay(self) -> None:
        self._one("SELECT pg_wal_replay_pause()", replica=True)

    def resume_replay(self) -> None:
        self._one("SELECT pg_wal_replay_resume()", replica=True)

    def stop(self) -> None:
        for name in ("replica", "primary"):
            data = self.dir / name
            if (data / "postmaster.pid").exists():
                try:
                    self._run(BIN / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
                except RuntimeError:
                    pass
        shutil.rmtree(self.dir, ignore_errors=True)
