"""`python -m bench --scenario table-growth --growth-jobs 20000 --quick` fills both layouts and
reports every figure for each; the partitioned claim touches only jobs_job_hot.

It checks the report's shape, never a timing.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import psycopg
import pytest

from harness import DEFAULT_ADMIN_URL
from tests.harness import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.long]

COMMAND = [
    *(sys.executable, "-m", "bench", "--scenario", "table-growth"),
    *("--growth-jobs", "20000", "--quick"),
]
FIGURES = (
    "fill rate",
    "disk per million jobs",
    "claim statement p99",
    "submission p99",
    "dead tuples",
    "VACUUM",
    "retention of the oldest week",
    "job tables the claim",
)


def test_quick_table_growth_reports_both_layouts(tmp_path):
    out = tmp_path / "growth.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    proc = subprocess.run(
        # What `make table-growth TABLE_GROWTH_JOBS=20000 TABLE_GROWTH_ARGS=--quick` runs.
        [*COMMAND, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    by_layout: dict[str, list[dict]] = {}
    for r in records:
        assert r["scenario"] == "table-growth"
        assert r["command"] == "python -m bench --scenario table-growth --quick --growth-jobs 20000"
        assert isinstance(r["value"], float) and math.isfinite(r["value"]) and r["value"] >= 0
        by_layout.setdefault(r["details"]["report"]["layout"], []).append(r)
    assert set(by_layout) == {"today", "partitioned"}, proc.stdout
    for layout, rs in by_layout.items():
        for figure in FIGURES:
            assert sum(figure in r["figure"] for r in rs) == 1, (layout, figure)
        report = rs[0]["details"]["report"]
        assert report["jobs"] == 20_000
        kept = report["retention"]
        assert kept["jobs"] > 0 and kept["history_rows"] == 5 * kept["jobs"], kept

    today = by_layout["today"][0]["details"]["report"]
    parted = by_layout["partitioned"][0]["details"]["report"]
    assert today["explain"]["job_relations"] == ["jobs_job"]
    assert parted["explain"]["job_relations"] == ["jobs_job_hot"], parted["explain"]["text"]
    assert "jobs_job_hot" in parted["explain"]["text"]
    assert today["migration"].startswith("0020_") and parted["migration"] > today["migration"]
    # The scratch databases are gone afterwards.
    with psycopg.connect(DEFAULT_ADMIN_URL) as c:
        names = [today["database"], parted["database"]]
        left = c.execute("SELECT datname FROM pg_database WHERE datname = ANY(%s)", [names])
        assert left.fetchall() == []
