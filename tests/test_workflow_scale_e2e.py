"""A large workflow through real workers: a fan-out 1 → N → 1 and an N-deep chain in one
graph. Every job runs after all its parents ended; the time from the last parent's end
to the child's claim is measured (database clock) and reported.

`make test` runs 100 nodes; `make workflow-bench` runs the full 1,000 (WORKFLOW_NODES).
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
from django.db import connection

from jobs import workflows
from jobs.models import Workflow
from tests.harness import wait_until

pytestmark = pytest.mark.slow

NODES = int(os.environ.get("WORKFLOW_NODES", "100"))

HANDOFF_SQL = """
WITH claims AS (
  SELECT job_id, min(at) AS claimed FROM jobs_jobevent
  WHERE to_status = 'processing' GROUP BY job_id),
parents AS (
  SELECT d.child_id, max(p.finished_at) AS last_end, bool_and(p.status = 'done') AS all_done
  FROM jobs_jobdependency d JOIN jobs_job p ON p.id = d.parent_id GROUP BY d.child_id)
SELECT wn.key, extract(epoch FROM c.claimed - pa.last_end), pa.all_done
FROM jobs_workflownode wn JOIN parents pa ON pa.child_id = wn.job_id
JOIN claims c ON c.job_id = wn.job_id
WHERE wn.workflow_id = %s"""


def _pct(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def test_fan_out_fan_in_and_a_deep_chain_run_in_dependency_order(stack):
    half = NODES // 2
    wf = workflows.Workflow(f"scale-{NODES}")
    wf.step("root", "echo", {"n": 0})
    for i in range(half - 2):
        wf.step(f"fan{i}", "echo", {"n": i}, after=["root"])
    wf.step("join", "echo", {}, after=[f"fan{i}" for i in range(half - 2)])
    wf.step("c0", "echo", {"n": 0})
    for i in range(1, NODES - half):
        wf.step(f"c{i}", "echo", {"n": i}, after=[f"c{i - 1}"])
    assert len(wf.steps) == NODES
    started = time.monotonic()
    workflow_id = wf.submit()
    env = {"JOBS_LEASE_SECONDS": "10"}
    for _ in range(2):
        stack.worker("--concurrency", "4", "--poll-interval", "0.5", **env)
    stack.reaper("--interval", "1", **env)
    wait_until(
        lambda: Workflow.objects.get(pk=workflow_id).finished_at is not None,
        60 + NODES * 0.5,
        "the workflow finished",
        interval=0.2,
    )
    elapsed = time.monotonic() - started
    detail = workflows.detail(workflow_id)
    assert detail["status"] == "done"
    assert {s["status"] for s in detail["steps"]} == {"done"}
    with connection.cursor() as cur:
        cur.execute(HANDOFF_SQL, [workflow_id])
        rows = cur.fetchall()
    assert len(rows) == NODES - 2  # every job but the two roots has parents
    assert all(all_done for _, _, all_done in rows)
    early = [(key, gap) for key, gap, _ in rows if gap <= 0]
    assert not early, f"claimed before a parent ended: {early[:5]}"
    print(f"\nworkflow of {NODES} jobs (fan-out 1→{half - 2}→1, chain of {NODES - half}) "
          f"done in {elapsed:.1f}s; last parent's end → child's claim:")  # fmt: skip
    parts = {
        "all": lambda key: True,
        "chain (one child due at a time)": lambda key: key.startswith("c"),
        f"fan-out ({half - 2} due at once, 8 slots)": lambda key: key.startswith("fan"),
    }
    for name, pick in parts.items():
        gaps = sorted(float(gap) * 1000 for key, gap, _ in rows if pick(key))
        print(f"  {name}: p50 {_pct(gaps, 50):.1f} ms, p99 {_pct(gaps, 99):.1f} ms, "
              f"max {gaps[-1]:.1f} ms (n={len(gaps)})")  # fmt: skip
