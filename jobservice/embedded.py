"""Embedded PostgreSQL for development when DATABASE_URL is unset.

Production and tests always name a real server; this only exists so that
`make run` works on a bare machine. The data lives under var/pgdata (git-ignored).
As root, pgserver runs the server as the system user `pgserver`, so stop it with
`make stop-db` (pg_ctl), not by killing it; `make reset-db` also deletes the data.
JOBS_EMBEDDED_PGDATA moves the data directory.
"""

from __future__ import annotations

import os
import pwd
import shutil
import sys
import warnings
from pathlib import Path

DB_NAME = "jobservice"


def _pgserver():
    # platformdirs warns on every import when XDG_RUNTIME_DIR is unset (containers, ssh
    # sessions) and falls back to /tmp/runtime-<uid>, which is all pgserver needs.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
        import pgserver  # imported lazily: only development without DATABASE_URL needs it
    return pgserver


def pgdata_dir(base_dir: Path) -> Path:
    """var/pgdata, or JOBS_EMBEDDED_PGDATA (tests use a scratch one)."""
    return Path(os.environ.get("JOBS_EMBEDDED_PGDATA") or base_dir / "var" / "pgdata")


def database_settings(base_dir: Path) -> dict:
    """Start (or reuse) the embedded server and return Django DATABASES['default']."""
    pgserver = _pgserver()
    pgdata = pgdata_dir(base_dir)
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


def is_running(base_dir: Path) -> bool:
    _pgserver()
    from pgserver.utils import PostmasterInfo

    info = PostmasterInfo.read_from_pgdata(pgdata_dir(base_dir))
    return info is not None and info.is_running()


def stop(base_dir: Path) -> bool:
    """Stop the embedded server (fast shutdown: open sessions are ended). True if it ran."""
    pgdata = pgdata_dir(base_dir)
    if not pgdata.exists() or not is_running(base_dir):
        return False
    pgserver = _pgserver()
    owner = pgdata.stat().st_uid
    user = pwd.getpwuid(owner).pw_name
    # pg_ctl refuses to run as root; the data directory's owner runs the server.
    pgserver.pg_ctl(
        ["-m", "fast", "-w", "stop"], pgdata=pgdata, user=user if owner else None, timeout=60
    )
    return True


def reset(base_dir: Path) -> None:
    """Stop the embedded server and delete its data: the next command starts a fresh one."""
    stop(base_dir)
    shutil.rmtree(pgdata_dir(base_dir), ignore_errors=True)


def main(argv: list[str]) -> int:
    base_dir = Path(__file__).resolve().parent.parent
    action = argv[0] if argv else ""
    if action == "stop":
        stopped = stop(base_dir)
        print("embedded PostgreSQL stopped" if stopped else "embedded PostgreSQL not running")
    elif action == "reset":
        reset(base_dir)
        print(f"embedded PostgreSQL stopped and {pgdata_dir(base_dir)} deleted")
    elif action == "status":
        print("running" if is_running(base_dir) else "not running")
    else:
        print("usage: python -m jobservice.embedded stop|reset|status", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
