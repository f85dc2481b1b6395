"""Scratch databases: created per run, migrated by the caller, dropped at the end.

Named `jobservice_<kind>_<checkout>_<pid>`: unique per checkout (so parallel checkouts
on one server never meet) and per run (so a long run and a short one can go on side by
side in one checkout), and a leftover whose process is gone can be recognised and
dropped.
"""

from __future__ import annotations

import hashlib
import os
import re
from urllib.parse import urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import sql

from harness.procs import ROOT

DEFAULT_ADMIN_URL = "postgres://root@127.0.0.1:5432/postgres"


def checkout_tag() -> str:
    return hashlib.sha1(str(ROOT).encode()).hexdigest()[:8]


def database_url() -> str:
    """A URL for the database this Django process uses (in tests, the test database)."""
    from django.db import connection

    s = connection.settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s.get("PASSWORD") else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def _with_db(url: str, name: str, **query: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, urlencode(query), ""))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ScratchDatabase:
    def __init__(
        self, kind: str, admin_url: str = DEFAULT_ADMIN_URL, name: str | None = None
    ) -> None:
        self.admin_url = admin_url
        self.prefix = f"jobservice_{kind}_{checkout_tag()}_"
        self.name = name or f"{self.prefix}{os.getpid()}"
        if not re.fullmatch(r"[a-z0-9_]{1,63}", self.name):
            raise ValueError(f"bad scratch database name {self.name!r}")

    def url(self, application_name: str | None = None) -> str:
        query = {"application_name": application_name} if application_name else {}
        return _with_db(self.admin_url, self.name, **query)

    def _admin(self) -> psycopg.Connection:
        return psycopg.connect(self.admin_url, autocommit=True)

    def _drop(self, conn: psycopg.Connection, name: str) -> None:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )

    def drop_stale(self) -> list[str]:
        """Drop this checkout's leftovers of this kind from runs whose process is gone."""
        dropped = []
        with self._admin() as conn:
            names = [
                r[0]
                for r in conn.execute(
                    "SELECT datname FROM pg_database WHERE datname LIKE %s",
                    [self.prefix.replace("_", r"\_") + "%"],
                )
            ]
            for name in names:
                pid = name.removeprefix(self.prefix)
                if pid.isdigit() and not _pid_alive(int(pid)):
                    self._drop(conn, name)
                    dropped.append(name)
        return dropped

    def create(self) -> ScratchDatabase:
        with self._admin() as conn:
            self._drop(conn, self.name)
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
        return self

    def drop(self) -> None:
        with self._admin() as conn:
            self._drop(conn, self.name)

    def connect(self, application_name: str = "harness", **kwargs) -> psycopg.Connection:
        return psycopg.connect(self.url(application_name), **kwargs)
