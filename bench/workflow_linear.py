"""`python -m bench.workflow_linear [--repeat N] [--previous]` (or `make workflow-linear`).

Creates, fails at the root (the worker's fenced write) and cancels 1,000-step workflows
at the edge cap (JOBS_WORKFLOW_MAX_EDGES, 10,000) in two shapes, on a scratch database
and a private redis-server, and prints each operation's database time (one
statement's clock_timestamp on both sides) and the rows it wrote and read per table
(pg_stat_xact_user_tables). `--previous` measures the same with the dependents
function as migration 0012 installed it (jobs/migrations/_triggers.py), side by side. It
reports; it never asserts a timing.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

STEPS = 1000
CAP = 10_000
TABLES = ("jobs_job", "jobs_jobdependency", "jobs_workflownode", "jobs_workflow")


def dense_at_cap(steps: int = STEPS, cap: int = CAP) -> list[dict]:
    """Each step after every earlier one while the edges fit under the cap (the first
    ~141 steps form a complete DAG); every later step after step 0 and the steps just
    before it, as many as still fit, so that it too descends from the root."""
    out: list[dict] = []
    edges = 0
    for i in range(steps):
        room = cap - edges - (steps - i - 1)  # keep one edge for every later step
        after = list(range(i)) if i <= room else [0, *range(max(1, i - room + 1), i)]
        after = after[: max(0, room)] if i else []
        edges += len(after)
        out.append({"id": f"s{i:04d}", "task": "echo", "payload": {},
                    "after": [f"s{j:04d}" for j in after]})  # fmt: skip
    return out


def banded_at_cap(steps: int = STEPS, width: int = CAP // STEPS) -> list[dict]:
    """Each step after the `width` steps before it: every step descends from the root
    and the longest path is the whole graph (the deepest walk)."""
    return [
        {"id": f"s{i:04d}", "task": "echo", "payload": {},
         "after": [f"s{j:04d}" for j in range(max(0, i - width), i)]}
        for i in range(steps)
    ]  # fmt: skip


SHAPES: dict[str, Callable[[], list[dict]]] = {"dense": dense_at_cap, "banded": banded_at_cap}

_COUNTERS_SQL = f"""
SELECT relname, n_tup_ins, n_tup_upd, coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0)
FROM pg_stat_xact_user_tables WHERE relname IN ({", ".join(f"'{t}'" for t in TABLES)})"""


def _counters(cur) -> dict[str, tuple[int, int, int]]:
    cur.execute(_COUNTERS_SQL)
    return {name: tuple(rest) for name, *rest in cur.fetchall()}


def measured(op: Callable[[], Any]) -> tuple[Any, dict[str, tuple[int, ...]], float]:
    """Run `op` in a transaction: (its value, rows (inserted, updated, read) per table,
    database seconds from before its first statement to after its last)."""
    from django.db import connection, transaction

    with transaction.atomic(), connection.cursor() as cur:
        before = _counters(cur)
        cur.execute("SELECT clock_timestamp()")
        (start,) = cur.fetchone()
        value = op()
        cur.execute("SELECT extract(epoch FROM clock_timestamp() - %s)", [start])
        (seconds,) = cur.fetchone()
        after = _counters(cur)
    zero = (0, 0, 0)
    delta = {t: tuple(a - b for a, b in zip(after.get(t, zero), before.get(t, zero), strict=True))
             for t in TABLES}  # fmt: skip
    return value, delta, float(seconds)


def run_shape(steps: list[dict]) -> dict[str, tuple[float, dict]]:
    """Create, fail the root, create again, cancel: {operation: (seconds, rows)}."""
    from jobs import services, workflows
    from jobs.models import WorkflowNode

    graph = workflows.build({"name": "bench", "steps": steps})
    (workflow_id, _), create_rows, create_s = measured(lambda: workflows.create(graph))
    root = WorkflowNode.objects.get(workflow_id=workflow_id, key=steps[0]["id"]).job_id
    lease = services.claim("bench-linear", root)
    _, fail_rows, fail_s = measured(lambda: services.fail([(lease, "boom", True)]))
    other_id, _ = workflows.create(graph)
    _, cancel_rows, cancel_s = measured(lambda: workflows.cancel(other_id, actor="staff:bench"))
    return {"create": (create_s, create_rows), "fail root": (fail_s, fail_rows),
            "cancel": (cancel_s, cancel_rows)}  # fmt: skip


def _install(previous: bool) -> None:
    from django.db import connection

    from jobs.migrations import _triggers as frozen

    with connection.cursor() as cur:
        if previous:
            cur.execute(frozen.WORKFLOW_TRIGGERS_0012)
            cur.execute(frozen.HISTORY_PLAN_RESET)
        else:
            cur.execute(frozen.WORKFLOW_TRIGGERS_0016)
            cur.execute(frozen.HISTORY_PLAN_0016)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.workflow_linear", description=__doc__)
    p.add_argument("--repeat", type=int, default=3, help="Runs per shape (median reported).")
    p.add_argument("--previous", action="store_true",
                   help="Also measure the dependents function of migration 0012.")  # fmt: skip
    args = p.parse_args(argv)

    from bench.env import scratch_database, setup_django
    from harness import RedisServer

    db = scratch_database().create()
    redis = RedisServer().start()
    try:
        setup_django(db.url(), redis.url)
        from django.db import connection

        with connection.cursor() as cur:
            cur.execute("SET statement_timeout = '120s'")
        variants = [("current", False)] + ([("previous (0012)", True)] if args.previous else [])
        for label, previous in variants:
            _install(previous)
            for shape, build in SHAPES.items():
                steps = build()
                edges = sum(len(s["after"]) for s in steps)
                runs = [run_shape(steps) for _ in range(args.repeat)]
                print(f"{label}: {shape} workflow, {len(steps)} steps, {edges} edges "
                      f"(median of {args.repeat}, database time):")  # fmt: skip
                for op in runs[0]:
                    seconds = statistics.median(r[op][0] for r in runs)
                    rows = runs[-1][op][1]
                    print(f"  {op:9s} {seconds * 1000:8.1f} ms   edges read "
                          f"{rows['jobs_jobdependency'][2]:>8}, edges written "
                          f"{rows['jobs_jobdependency'][0] + rows['jobs_jobdependency'][1]:>6}, "
                          f"jobs updated {rows['jobs_job'][1]:>5}", flush=True)  # fmt: skip
        _install(False)
    finally:
        from django.db import connections

        connections.close_all()
        redis.stop()
        db.drop()


if __name__ == "__main__":
    main()
