"""End to end with the SPEC's timings (lease 15 s, sweep 5 s): 2,000 jobs through the
API while a worker is killed (kill -9) every few seconds (SPEC §5, §6).

Every job must end terminal, none done twice (one processing → done per done job,
at most one effect per job), and 95% of jobs within 25 s of submission.
"""

from __future__ import annotations

import os

import pytest

from chaos.profiles import PROFILES
from chaos.run import run
from harness import DEFAULT_ADMIN_URL

pytestmark = pytest.mark.slow

JOBS = 2000


@pytest.mark.timeout(240)
def test_two_thousand_jobs_with_workers_killed_every_few_seconds():
    profile = PROFILES["slo"]
    assert (profile.max_jobs, profile.lease, profile.reaper_interval) == (JOBS, 15, 5)
    result = run(
        profile,
        seed=int(os.environ.get("CHAOS_SEED", "2000")),
        admin_url=os.environ.get("CHAOS_ADMIN_DATABASE_URL", DEFAULT_ADMIN_URL),
    )
    lat = result.latency
    print(
        f"\nsubmission -> terminal over {lat.jobs} jobs: p50 {lat.p50:.2f}s, p95 {lat.p95:.2f}s, "
        f"p99 {lat.p99:.2f}s; {lat.share_within_slo:.2%} within 25 s"
    )
    assert result.injected["worker_kill"] >= 10
    assert result.observed["lease_expired_requeued"] > 0, "no kill hit a job"
    assert result.accepted == JOBS and lat.jobs == JOBS
    assert lat.terminal == JOBS  # 100% terminal
    assert result.violations["lost_or_stuck"] == []
    assert result.violations["done_exactly_once"] == []  # one processing → done per done job
    assert result.violations["effects_at_most_once"] == []  # ≤ 1 effect per job
    assert result.ok, "\n".join(str(v) for vs in result.violations.values() for v in vs)
    assert lat.p95 <= 25.0, f"p95 {lat.p95:.2f}s is over the 25 s SLO"
