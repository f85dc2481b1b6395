"""A PostgreSQL server of the caller's own on a free port, for faults the shared server
must not suffer (`pg_ctl stop -m immediate`).

`initdb` in a temp dir (loopback, trust); fsync stays on and commits are synchronous
unless a statement says otherwise, like a production server. PostgreSQL refuses to run
as root: as root it runs as the system user `postgres`. `close()` stops it and deletes
its data.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import psycopg

from harness.procs import free_port

BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))
USER = "postgres"


def available(*tools: str) -> str | None:
    """None when a server can be made here, else why not."""
    for tool in ("initdb", "pg_ctl", *tools):
        if not (BIN / tool).exists():
            return f"{BIN / tool} is missing (PostgreSQL server binaries; PG_BIN names them)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(USER)
        except KeyError:
            return "PostgreSQL refuses root and there is no user postgres to run it as"
    return None


def run_pg(*argv: str | Path) -> None:
    """A server binary, as the user `postgres` when this process is root."""
    kwargs = {"user": USER} if os.geteuid() == 0 else {}
    out = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=120, **kwargs
    )
    if out.returncode:
        raise RuntimeError(f"{argv[0]} failed: {out.stdout}{out.stderr}")


def os_user() -> str:
    return USER if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name


class PostgresServer:
    # Nothing but the statements themselves (and the WAL writer) flushes WAL: no
    # autovacuum commits, no background writer evicting pages ahead of the WAL.
    QUIET = "autovacuum = off\nbgwriter_lru_maxpages = 0\n"

    def __init__(self, conf: str = "") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pgserver-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.user = os_user()
        self.conf = conf

    def url(self, database: str = "postgres") -> str:
        return f"postgres://{self.user}@127.0.0.1:{self.port}/{database}"

    def start(self) -> PostgresServer:
        if not self.data.exists():
            if os.geteuid() == 0:
                shutil.chown(self.dir, USER)
            run_pg(BIN / "initdb", "-D", self.data, "-U", self.user, "--auth=trust", "-E", "UTF8")
            with open(self.data / "postgresql.conf", "a") as conf:
                conf.write(self.conf)
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1"
        run_pg(BIN / "pg_ctl", "-D", self.data, "-o", options, "-l", f"{self.data}.log", "-w",
               "start")  # fmt: skip
        return self

    def one(self, sql: str, database: str = "postgres"):
        with psycopg.connect(self.url(database), autocommit=True) as conn:
            cur = conn.execute(sql)
            return cur.fetchone() if cur.description else None

    def createdb(self, name: str) -> str:
        self.one(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop_immediate(self) -> None:
        """`pg_ctl stop -m immediate`: every process quits at once, WAL buffers unwritten
        are lost, and the next start runs crash recovery. A held WAL writer cannot quit:
        the postmaster SIGKILLs it after 5 s."""
        run_pg(BIN / "pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")

    def hold_wal_writer(self) -> int:
        """SIGSTOP the WAL writer, so an asynchronous commit stays in the WAL buffers
        until the server stops; its pid (the stop kills it)."""
        (pid,) = self.one("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'")
        os.kill(pid, signal.SIGSTOP)
        return pid

    def close(self) -> None:
        if (self.data / "postmaster.pid").exists():
            try:
                run_pg(BIN / "pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
            except RuntimeError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
