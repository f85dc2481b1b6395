"""A PgBouncer of the caller's own on a free port, in transaction mode, in front of one
PostgreSQL server: the tests, the fault suite and the bench run the stack through it.

Debian's pgbouncer (1.18) refuses to run as root: as root it is started as the
system user `postgres` (which the package creates), with its files readable by it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

from harness.procs import free_port, wait_until

BINARY = "pgbouncer"


def available() -> str | None:
    """None when a pgbouncer can be started here, else why not."""
    if shutil.which(BINARY) is None:
        return "pgbouncer is not installed (make tools installs the Debian package pgbouncer)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "pgbouncer refuses root and there is no user postgres to run it as"
    return None


class PgBouncer:
    """`pool_mode` transaction (the mode that lets many processes share few server
    connections), every database of `server_url`'s server, trust auth on loopback."""

    def __init__(self, server_url: str, pool_size: int = 20, max_client_conn: int = 1000) -> None:
        self.server = urlsplit(server_url)
        self.port = free_port()
        self.pool_size = pool_size
        self.max_client_conn = max_client_conn
        self.dir = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
        self.proc: subprocess.Popen | None = None

    def url(self, server_url: str) -> str:
        """`server_url` (a database on the server behind) as reached through this pooler."""
        parts = urlsplit(server_url)
        auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        return urlunsplit(
            (parts.scheme, f"{auth}127.0.0.1:{self.port}", parts.path, parts.query, "")
        )

    @property
    def admin_url(self) -> str:
        """The admin console (SHOW POOLS, SHOW SERVERS, ...)."""
        return self.url(urlunsplit(self.server._replace(path="/pgbouncer")))

    def _config(self) -> str:
        user = self.server.username or "postgres"
        host = self.server.hostname or "127.0.0.1"
        port = self.server.port or 5432
        return "\n".join([
            "[databases]",
            f"* = host={host} port={port}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {self.dir / 'users.txt'}",
            f"admin_users = {user}",  # SHOW SERVERS, SHOW POOLS on database pgbouncer
            "pool_mode = transaction",
            f"default_pool_size = {self.pool_size}",
            f"max_client_conn = {self.max_client_conn}",
            # psycopg and Django send nothing else at startup; application_name is tracked.
            "ignore_startup_parameters = extra_float_digits,options",
            "server_reset_query =",
            "log_connections = 0",
            "log_disconnections = 0",
            "",
        ])  # fmt: skip

    def start(self) -> PgBouncer:
        user = self.server.username or "postgres"
        (self.dir / "users.txt").write_text(f'"{user}" ""\n')
        ini = self.dir / "pgbouncer.ini"
        ini.write_text(self._config())
        argv = [BINARY, str(ini)]
        if os.geteuid() == 0:
            os.chmod(self.dir, 0o755)
            argv[1:1] = ["-u", "postgres"]
        with open(self.dir / "pgbouncer.log", "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_until(lambda: self.ping() or self.proc.poll() is not None, 15, "pgbouncer")
        if self.proc.poll() is not None:
            raise RuntimeError(f"pgbouncer exited: {self.log()}")
        return self

    def ping(self) -> bool:
        try:
            with psycopg.connect(self.url(urlunsplit(self.server)), connect_timeout=1) as c:
                c.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    def log(self) -> str:
        return (self.dir / "pgbouncer.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
