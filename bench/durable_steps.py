"""`python -m bench.durable_steps [--jobs N] [--steps S] [--baseline REF] [--dbos]
[--concurrency C]` (C: the worker's --concurrency).

Durable steps per second (issue 45): N jobs of S no-op checkpointed steps
(`bench.durable_steps`) submitted first, then one default `runworker` drains them on
a scratch database and a private redis-server; steps/s is N x S over first start ->
last finish (database clock). Also the rows written and the transactions committed per
job (pg_stat counters of the scratch database, every process included) and the CPU
per job of the worker process and of the database's server processes (from /proc,
from the worker's start to the last job's end: a figure the machine's load moves less
than the wall clock), and what the checkpointing connections were doing on average
(pg_stat_activity sampled every 0.2 s: running, waiting for the WAL or a lock, or idle
while the worker runs). `--baseline
REF` runs the same with the worker of a git ref, side by side; `--dbos` the same
workload on DBOS Transact (not a dependency: `pip install dbos==3.4.0` by hand, as the
pgqueuer peer, D248): S @DBOS.step no-ops in a @DBOS.workflow, N workflows enqueued on
a queue first, then run by DBOS's in-process queue worker on the same PostgreSQL
server, measured the same way (first start -> last finish, database clock). It
reports; it never asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

_COUNTERS_SQL = """
SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),
       (SELECT coalesce(sum(n_tup_ins), 0) FROM pg_stat_user_tables),
       (SELECT coalesce(sum(n_tup_upd), 0) FROM pg_stat_user_tables)"""


def _counters(url: str) -> tuple[int, int, int]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return tuple(int(v) for v in conn.execute(_COUNTERS_SQL).fetchone())


_TICK = os.sysconf("SC_CLK_TCK")
_BACKENDS_SQL = "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"


def _cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


# What each checkpoint's connection is doing: running, waiting for a lock or the WAL
# (WALWrite: another backend's flush; WALSync: its own), or idle, the worker's turn.
_STEP_WAITS_SQL = """
SELECT pid, CASE WHEN state = 'active' THEN coalesce(wait_event, 'running')
                 ELSE 'idle (the worker)' END
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND query LIKE '%%INSERT INTO jobs_jobstep%%'"""


def _backends_cpu(url: str, seen: dict[int, float], waits: Counter | None = None) -> None:
    """Record the CPU of the database's server processes now (their pids from
    pg_stat_activity): a backend's last reading stands for it once it is gone. With
    `waits`, count what each checkpointing connection is doing now (one sample)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        pids = [r[0] for r in conn.execute(_BACKENDS_SQL).fetchall()]
        me = conn.info.backend_pid
        if waits is not None:
            waits["samples"] += 1
            for _, doing in conn.execute(_STEP_WAITS_SQL).fetchall():
                waits[doing] += 1
    for pid in pids:
        if pid != me:
            seen[pid] = max(seen.get(pid, 0.0), _cpu(pid))


def run_jobservice(ref: str | None, jobs: int, steps: int, concurrency: int | None = None) -> dict:
    from bench.env import Code, processes, scratch_database, setup_django
    from harness import RedisServer, wait_until

    code = Code(ref)
    db = scratch_database().create()
    redis = RedisServer().start()
    try:
        setup_django(db.url(), redis.url)
        from django.db import connection, connections

        from jobs import services
        from jobs.services import NewJob

        services.submit_many([NewJob("bench.durable_steps", {"steps": steps})] * jobs)
        connections.close_all()
        time.sleep(1.0)  # the stats collector's last report
        before = _counters(db.url())
        with tempfile.TemporaryDirectory() as logs:
            procs = processes(db.url(), redis.url, Path(logs))
            try:
                procs.reaper(root=code.root)  # repairs a push a busy machine's Redis refused
                more = ("--concurrency", str(concurrency)) if concurrency else ()
                worker = procs.worker(*more, root=code.root, ready=True)
                cpu_at_start = _cpu(worker.pid)
                server: dict[int, float] = {}
                _backends_cpu(db.url(), server)
                server_at_start = dict(server)

                waits: Counter = Counter()

                def done() -> bool:
                    _backends_cpu(db.url(), server, waits)
                    return _finished(db.url()) >= jobs

                wait_until(done, 600, "jobs done", interval=0.2)
                worker_cpu = _cpu(worker.pid) - cpu_at_start
                _backends_cpu(db.url(), server)
                server_cpu = sum(v - server_at_start.get(k, 0.0) for k, v in server.items())
            finally:
                procs.stop_all()
        time.sleep(1.0)
        after = _counters(db.url())
        with connection.cursor() as cur:
            cur.execute(
                "SELECT extract(epoch FROM max(finished_at) - min(started_at)),"
                " count(*) FILTER (WHERE status = 'done') FROM jobs_job"
            )
            span, done = cur.fetchone()
        connections.close_all()
        per = [(a - b) / jobs for a, b in zip(after, before, strict=True)]
        cpu = [1000 * worker_cpu / jobs, 1000 * server_cpu / jobs]
        label = code.label + (f" --concurrency {concurrency}" if concurrency else "")
        samples = waits.pop("samples", 0) or 1
        step_waits = {k: round(v / samples, 2) for k, v in waits.most_common()}
        return {"label": label, "span": float(span), "done": done, "per_job": per, "cpu": cpu,
                "step_waits": step_waits}  # fmt: skip
    finally:
        redis.stop()
        db.drop()
        code.close()


def _finished(url: str) -> int:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM jobs_job WHERE status = 'done'").fetchone()[0]


def run_dbos(jobs: int, steps: int) -> dict | None:
    """DBOS measured as ours: every workflow enqueued first (DBOSClient, before the
    launch that starts the queue worker), then first start -> last finish on the
    database clock. Enqueued while the worker ran (`queue.enqueue` after `launch`), the
    enqueue took longer than the run and the span from its end counted the tail only."""
    try:
        from dbos import DBOS, DBOSClient
    except ImportError:
        return None
    import psycopg

    from bench.env import scratch_database

    db = scratch_database().create()
    try:
        config = {"name": "bench", "system_database_url": db.url(), "log_level": "WARNING"}
        DBOS(config=config)

        @DBOS.step()
        def noop(i: int) -> int:
            return i

        @DBOS.workflow()
        def five(n: int) -> int:
            for i in range(n):
                noop(i)
            return n

        DBOS.launch()  # migrates the system database
        DBOS.register_queue("bench")
        DBOS.destroy(destroy_registry=False)
        client = DBOSClient(system_database_url=db.url())
        for _ in range(jobs):
            client.enqueue({"queue_name": "bench", "workflow_name": five.__qualname__}, steps)
        client.destroy()
        DBOS(config=config)
        DBOS.launch()
        with psycopg.connect(db.url(), autocommit=True) as conn:
            done = "SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS'"
            deadline = time.monotonic() + 600
            while conn.execute(done).fetchone()[0] < jobs and time.monotonic() < deadline:
                time.sleep(0.2)
            span, finished, first = conn.execute(
                "SELECT (max(updated_at) - min(started_at_epoch_ms)) / 1000.0,"
                " count(*) FILTER (WHERE status = 'SUCCESS'),"
                " max(created_at) <= min(started_at_epoch_ms) FROM dbos.workflow_status"
            ).fetchone()
        DBOS.destroy()
        return {"label": "DBOS Transact", "span": float(span), "done": finished, "per_job": None,
                "enqueued_first": first}  # fmt: skip
    finally:
        db.drop()


def _one(kind: str, ref: str | None, jobs: int, steps: int, concurrency: int | None) -> dict:
    """One variant in a process of its own (Django is set up once per process)."""
    import json
    import subprocess
    import sys

    args = [sys.executable, "-m", "bench.durable_steps", "--jobs", str(jobs), "--steps",
            str(steps), "--only", kind] + (["--ref", ref] if ref else [])  # fmt: skip
    args += ["--concurrency", str(concurrency)] if concurrency else []
    out = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"label": f"{kind} {ref or ''}: FAILED\n{out.stderr[-2000:]}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> None:
    import json

    p = argparse.ArgumentParser(prog="python -m bench.durable_steps", description=__doc__)
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--baseline", help="A git ref whose worker runs the same workload first.")
    p.add_argument("--dbos", action="store_true", help="Also run the workload on DBOS.")
    p.add_argument("--concurrency", type=int,
                   help="The worker's --concurrency (default: runworker's own, 4).")  # fmt: skip
    p.add_argument("--only", choices=["jobservice", "dbos"], help=argparse.SUPPRESS)
    p.add_argument("--ref", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.only == "jobservice":
        print(json.dumps(run_jobservice(args.ref, args.jobs, args.steps, args.concurrency)))
        return
    if args.only == "dbos":
        print(json.dumps(run_dbos(args.jobs, args.steps) or {"label": "DBOS: NOT MEASURED"}))
        return
    results = []
    if args.baseline:
        results.append(_one("jobservice", args.baseline, args.jobs, args.steps, args.concurrency))
    results.append(_one("jobservice", None, args.jobs, args.steps, args.concurrency))
    if args.dbos:
        results.append(_one("dbos", None, args.jobs, args.steps, None))
    total = args.jobs * args.steps
    for r in results:
        if "span" not in r:
            print(r["label"])
            continue
        line = f"{r['label']}: {args.jobs} x {args.steps} steps in {r['span']:.2f} s = "
        line += f"{total / r['span']:.0f} steps/s"
        if r["per_job"]:
            xacts, ins, upd = r["per_job"]
            line += f" ({xacts:.1f} commits, {ins:.1f} rows inserted, {upd:.1f} updated per job"
            if r.get("cpu"):
                line += ", CPU {:.2f} ms worker + {:.2f} ms PostgreSQL per job".format(*r["cpu"])
            line += ")"
        if r.get("step_waits"):
            doing = ", ".join(f"{v:.2f} {k}" for k, v in r["step_waits"].items())
            line += f"\n  checkpointing connections, on average: {doing}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
