"""The bench's private world: a scratch database, a private redis-server, real processes.

Nothing here touches the shared Redis or any existing database: the bench creates
`jobservice_bench_<checkout>_<pid>` on the PostgreSQL server named by
BENCH_DATABASE_URL (default: the test server), migrates it, and drops it at the end;
Redis is a `redis-server` of its own on a free port (both from `harness`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness import DEFAULT_ADMIN_URL, ROOT, Processes, ScratchDatabase, service_env

TASK_MODULES = "demo.tasks,bench.tasks"
PREFIX = "bench:"
# The test task the HTTP scenarios submit as a client, opened by name (D196).
PUBLIC_TASKS = "echo"


def scratch_database() -> ScratchDatabase:
    return ScratchDatabase("bench", os.environ.get("BENCH_DATABASE_URL", DEFAULT_ADMIN_URL))


def processes(db_url: str, redis_url: str, logdir: Path) -> Processes:
    """Workers, reapers and gunicorn on the scratch database and the private Redis.

    PYTHONPATH is emptied so a baseline tree's processes import their own code.
    """
    return Processes(
        logdir,
        service_env(
            db_url, redis_url, PREFIX, TASK_MODULES, PYTHONPATH="", JOBS_PUBLIC_TASKS=PUBLIC_TASKS
        ),
    )


def setup_django(db_url: str, redis_url: str, **settings_env: str) -> None:
    """Configure this process for the scratch database and private Redis, then migrate."""
    os.environ.update(
        DJANGO_SETTINGS_MODULE="jobservice.settings",
        DATABASE_URL=db_url,
        REDIS_URL=redis_url,
        JOBS_REDIS_PREFIX=PREFIX,
        JOBS_TASK_MODULES=TASK_MODULES,
        JOBS_PUBLIC_TASKS=PUBLIC_TASKS,
        LOG_LEVEL="WARNING",
        **settings_env,
    )
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)


@contextmanager
def scratch_django(**settings_env: str) -> Iterator[ScratchDatabase]:
    """A scratch database and a private redis-server, this process's Django set up on
    them; both gone afterwards."""
    from harness import RedisServer

    db = scratch_database().create()
    redis = RedisServer().start()
    try:
        setup_django(db.url(), redis.url, **settings_env)
        yield db
    finally:
        from django.db import connections

        connections.close_all()
        redis.stop()
        db.drop()


class Code:
    """Where worker processes run from: this checkout, or a git ref exported to a temp dir
    (for side-by-side before/after runs on the same database and the same machine)."""

    def __init__(self, ref: str | None = None) -> None:
        self.ref = ref
        self._tmp: str | None = None
        if ref is None:
            self.root = ROOT
            self.label = "current"
        else:
            self._tmp = tempfile.mkdtemp(prefix="jobservice-bench-")
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", self._tmp], input=archive, check=True)
            # The bench's own helper tasks must be importable from the old tree too.
            shutil.copytree(ROOT / "bench", Path(self._tmp) / "bench", dirs_exist_ok=True)
            self.root = Path(self._tmp)
            sha = subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", ref],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            self.label = f"{ref}@{sha}"

    def close(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
