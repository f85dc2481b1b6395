"""Django's PostgreSQL backend, its health check answered without a round trip when it can.

With CONN_HEALTH_CHECKS, Django sends `SELECT 1` before the first query of every request
on a persistent connection: a round trip and a statement for each API request. A
connection psycopg has not seen break, idle, and whose socket holds nothing unread is
usable: a server that ends a session (pg_terminate_backend, shutdown, restart) sends its
FATAL message and closes the socket, which makes it readable. Only then, or outside an
idle transaction state, does Django's `SELECT 1` decide (D76).
"""

from __future__ import annotations

import select

from django.db.backends.postgresql import base
from psycopg.pq import TransactionStatus


class DatabaseWrapper(base.DatabaseWrapper):
    def is_usable(self) -> bool:
        conn = self.connection
        if conn is None or conn.closed or conn.broken:
            return False
        if conn.info.transaction_status != TransactionStatus.IDLE or _has_unread(conn.fileno()):
            return super().is_usable()
        return True


def _has_unread(fd: int) -> bool:
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return True
