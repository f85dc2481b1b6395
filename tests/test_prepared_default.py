"""Prepared statements are on by default straight to PostgreSQL and off by default
behind a pooler (D392); DB_PREPARED_STATEMENTS says otherwise either way. Settings are
read once per process, so each case reads them in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIRECT = "postgres://root@127.0.0.1:5432/jobs"
POOLER = "postgres://root@127.0.0.1:6432/jobs"
READ = (
    "from jobservice import settings;"
    "print(settings.DATABASES['default'].get('OPTIONS', {}).get('prepare_threshold'))"
)


def _threshold(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("DB_PREPARED_STATEMENTS", "JOBS_DIRECT_DATABASE_URL")}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", READ],
        env={**clean, "PYTHONPATH": str(ROOT), "DATABASE_URL": DIRECT, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "5"),  # no pooler named: straight to PostgreSQL
        ({"JOBS_DIRECT_DATABASE_URL": DIRECT}, "5"),  # the direct address is DATABASE_URL
        ({"DB_PREPARED_STATEMENTS": ""}, "5"),  # compose's unset variable
        ({"JOBS_DIRECT_DATABASE_URL": DIRECT, "DATABASE_URL": POOLER}, "None"),  # a pooler
        ({"DB_PREPARED_STATEMENTS": "0"}, "None"),
        (
            {
                "DB_PREPARED_STATEMENTS": "1",
                "JOBS_DIRECT_DATABASE_URL": DIRECT,
                "DATABASE_URL": POOLER,
            },
            "5",
        ),  # on through a pooler that keeps them
    ],
)
def test_prepared_statements_default_follows_the_pooler(env, expected):
    assert _threshold(**env) == expected
