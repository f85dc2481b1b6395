"""Embedded PostgreSQL for development when DATABASE_URL is unset.

Production and tests always name a real server; this only exists so that
`make run` works on a bare machine. The data lives under var/pgdata (git-ignored).
"""

from __future__ import annotations

from pathlib import Path

DB_NAME = "jobservice"


def database_settings(base_dir: Path) -> dict:
    """Start (or reuse) the embedded server and return Django DATABASES['default']."""
    import pgserver  # imported lazily: only development without DATABASE_URL needs it

    pgdata = base_dir / "var" / "pgdata"
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(pgdata, cleanup_mode=None)
    exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DB_NAME}';")
    if "1 row" not in exists:
        server.psql(f"CREATE DATABASE {DB_NAME};")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": DB_NAME,
        "USER": "postgres",
        "HOST": str(pgdata),
        "PORT": "",
    }


def database_url(base_dir: Path) -> str:
    """The embedded server as a URL, for child processes started by `runstack`."""
    cfg = database_settings(base_dir)
    return f"postgresql://{cfg['USER']}@/{cfg['NAME']}?host={cfg['HOST']}"
