"""The scenarios. Each yields records: {scenario, figure, value, unit, target?, ...}.

Times that decide a figure come from the database (created_at, the history's claim
times, finished_at) wherever the database has them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import http_load
from bench.env import Code
from bench.measure import (
    Profiler,
    backend_pids,
    cpu_seconds,
    fmt_pcts,
    percentiles,
    released_together,
    sql,
)
from bench.variants import apply_variant, labelled
from harness import ROOT, Processes, RedisServer, ScratchDatabase, wait_until


@dataclass
class Context:
    args: argparse.Namespace
    db: ScratchDatabase
    redis: RedisServer
    procs: Processes
    code: Code
    baseline: Code | None
    logdir: Path

    @property
    def quick(self) -> bool:
        return self.args.quick

    def codes(self) -> list[Code]:
        """Baseline first, then the current tree: a side-by-side pair on the same run."""
        return [self.baseline, self.code] if self.baseline else [self.code]

    def setups(self) -> list[tuple[Code, str]]:
        """Every (code, database variant) pair to measure, side by side in this run."""
        variants = self.args.variant or ["default"]
        return [(code, v) for v in variants for code in self.codes()]


ALL: dict[str, Callable[[Context], Iterator[dict]]] = {}


def scenario(name: str):
    def register(fn):
        ALL[name] = fn
        return fn

    return register


# Run only when named: the scaling curve (bench/scaling.py) takes minutes and starts
# its own PgBouncer; the fillfactor comparison and the table-growth fill take minutes too.
ON_REQUEST = {"scale", "fillfactor", "table-growth", "http-waits"}


def default_names(quick: bool) -> list[str]:
    skip = ON_REQUEST | ({"claim-big"} if quick else set())
    return [n for n in ALL if n not in skip]


def run(name: str, ctx: Context) -> Iterator[dict]:
    for _ in range(max(1, ctx.args.repeat)):
        reset(ctx)
        load_before = os.getloadavg()[0]
        for record in ALL[name](ctx):
            record.setdefault("scenario", name)
            record["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            yield record


# --- helpers -------------------------------------------------------------------------------


def reset(ctx: Context) -> None:
    """Empty the job tables and Redis between measurements (a scratch database)."""
    ctx.procs.stop_all()
    sql("TRUNCATE jobs_job, jobs_jobevent, demo_effect")
    ctx.redis.flushall()


def preload(n: int, task: str = "echo", payload: Any = None, chunk: int = 1000) -> float:
    """Commit n queued jobs in one transaction (signalled after commit); returns seconds."""
    from django.db import transaction

    from jobs import services

    started = time.perf_counter()
    with transaction.atomic():
        for start in range(0, n, chunk):
            services.submit_many(
                [services.NewJob(task, payload or {}) for _ in range(min(chunk, n - start))]
            )
    return time.perf_counter() - started


def counts_by_status() -> dict[str, int]:
    return dict(sql("SELECT status, count(*) FROM jobs_job GROUP BY status"))


def wait_terminal(n: int, timeout: float, job_ids: list[int] | None = None) -> None:
    """Until n jobs are done or failed: any jobs, or these `job_ids` only. A scenario
    whose jobs make jobs of their own (webhook deliveries) names its own: else finished
    deliveries count for jobs still running, and their events are read before they exist."""
    if job_ids is None:
        query, params = "SELECT count(*) FROM jobs_job WHERE status IN ('done', 'failed')", None
    else:
        # bigint[]: psycopg sends small ids as int2[], and `id = ANY(int2[])` is not
        # an index probe but a scan that tests every row against the whole array.
        query = ("SELECT count(*) FROM jobs_job WHERE id = ANY(%s::bigint[]) "
                 "AND status IN ('done', 'failed')")  # fmt: skip
        params = [job_ids]
    wait_until(lambda: sql(query, params)[0][0] >= n, timeout, f"{n} jobs terminal", interval=0.05)


def worker_args(ctx: Context, concurrency: int | None) -> list[str]:
    """runworker's arguments: --concurrency unless None (the worker's own default)."""
    extra = ctx.args.worker_args.split() if ctx.args.worker_args else []
    return [*(["--concurrency", str(concurrency)] if concurrency else []), *extra]


# --- in-process submission -------------------------------------------------------------------


@scenario("submit")
def submit_loop(ctx: Context) -> Iterator[dict]:
    """services.submit in a loop, each its own transaction (commit + push per job)."""
    from jobs import services

    n = 100 if ctx.quick else 3000
    started = time.perf_counter()
    for _ in range(n):
        services.submit("echo", {})
    elapsed = time.perf_counter() - started
    yield {
        "figure": "in-process services.submit, one job per transaction",
        "value": n / elapsed,
        "unit": "jobs/s",
        "summary": f"{n} jobs in {elapsed:.2f}s",
        "details": {"jobs": n, "seconds": elapsed},
    }


@scenario("submit-many")
def submit_many(ctx: Context) -> Iterator[dict]:
    """services.submit_many, 1,000 jobs per transaction (one INSERT, one Redis push)."""
    from django.db import transaction

    from jobs import services

    n, batch = (2000, 1000) if ctx.quick else (30000, 1000)
    started = time.perf_counter()
    for _ in range(n // batch):
        with transaction.atomic():
            services.submit_many([services.NewJob("echo", {"n": i}) for i in range(batch)])
    elapsed = time.perf_counter() - started
    yield {
        "figure": f"in-process services.submit_many, {batch} jobs per transaction",
        "value": n / elapsed,
        "unit": "jobs/s",
        "summary": f"{n} jobs in {elapsed:.2f}s",
        "details": {"jobs": n, "batch": batch, "seconds": elapsed},
    }


# --- drain -------------------------------------------------------------------------------------


def drain(ctx: Context, workers: int, *, tuned: bool = True) -> Iterator[dict]:
    """`tuned`: --concurrency 128 (or --concurrency); otherwise runworker as users start it."""
    n = ctx.args.jobs or (300 if ctx.quick else 20000 if tuned else 10000)
    concurrency = (ctx.args.concurrency or 128) if tuned else None
    name = f"drain-{workers}" + ("" if tuned else "-default")
    for code, variant in ctx.setups():
        reset(ctx)
        apply_variant(variant)
        procs = [
            ctx.procs.worker(*worker_args(ctx, concurrency), root=code.root, ready=True)
            for _ in range(workers)
        ]
        profiler = Profiler(ctx.args.profile, procs, f"{name}-{code.label}")
        # Workers are up and idle; the jobs arrive in one commit and one push, so the
        # measurement starts from the same state for every worker.
        backends = backend_pids()
        worker_pids = [p.pid for p in procs]
        cpu_before = cpu_seconds(worker_pids), cpu_seconds(backends)
        load_s = preload(n)
        wait_terminal(n, timeout=max(60, n / 200))
        backends = sorted(set(backends) | set(backend_pids()))
        cpu_workers = cpu_seconds(worker_pids) - cpu_before[0]
        cpu_pg = cpu_seconds(backends) - cpu_before[1]
        profiles = profiler.stop()
        first_claim, last_finish, claims, claim_tx, done_tx = sql(
            """SELECT min(e.at), (SELECT max(finished_at) FROM jobs_job), count(*),
                      count(DISTINCT (e.actor, e.at)),
                      (SELECT count(DISTINCT (updated_by, finished_at)) FROM jobs_job)
               FROM jobs_jobevent e WHERE e.to_status = 'processing'"""
        )[0]
        # Started marks (D77): by the claim itself (started_at is the claim's time) or by
        # the starter's statements (each its own time). 0 and 0 for code without them.
        start_tx, by_claim = sql(
            """SELECT count(DISTINCT j.started_at) FILTER (WHERE e.job_id IS NULL),
                      count(*) FILTER (WHERE e.job_id IS NOT NULL)
               FROM jobs_job j LEFT JOIN jobs_jobevent e ON e.job_id = j.id
                    AND e.to_status = 'processing' AND e.at = j.started_at
               WHERE j.started_at IS NOT NULL"""
        )[0]
        seconds = (last_finish - first_claim).total_seconds()
        for p in procs:
            p.stop()
        status = counts_by_status()
        yield {
            "scenario": name,
            "code": labelled(code.label, variant),
            "figure": f"drain {n} no-op jobs with {workers} runworker process(es)"
            + ("" if tuned else " at runworker's defaults"),
            "value": n / seconds,
            "unit": "jobs/s",
            "target": (">= 7,800 jobs/s" if tuned else ">= 8,000 jobs/s") + " with 2 workers"
            if workers == 2
            else None,
            "summary": (
                f"first claim -> last finish {seconds:.3f}s, {claims} claims in "
                f"{claim_tx} statements, completions in {done_tx} statements, "
                f"starts marked by the claim {by_claim}, by {start_tx} start statements, "
                f"statuses {status}, --concurrency {concurrency or 'default'}, "
                f"preload {load_s:.2f}s; "
                f"CPU per job: workers {cpu_workers / n * 1e6:.0f} us, "
                f"postgres {cpu_pg / n * 1e6:.0f} us"
            ),
            "details": {
                "jobs": n,
                "workers": workers,
                "concurrency": concurrency,
                "worker_args": ctx.args.worker_args,
                "seconds": seconds,
                "claims": claims,
                "claim_statements": claim_tx,
                "complete_statements": done_tx,
                "start_statements": start_tx,
                "started_by_claim": by_claim,
                "statuses": status,
                "cpu_workers_s": cpu_workers,
                "cpu_postgres_s": cpu_pg,
                "profiles": profiles,
            },
        }


def pool_drain(
    ctx: Context, name: str, figure: str, n: int, concurrency: int, task: str, payload: Any
) -> Iterator[dict]:
    """One runworker per pool (`--pool threads`, then `processes`) drains the same n jobs
    of `task`, side by side in one run (current tree only: the baseline has no pools)."""
    seconds: dict[str, float] = {}
    for pool in ("threads", "processes"):
        reset(ctx)
        args = ["--pool", pool, *worker_args(ctx, concurrency)]
        proc = ctx.procs.worker(*args, root=ctx.code.root, ready=True)
        load_s = preload(n, task, payload)
        wait_terminal(n, timeout=max(120, n / 20))
        first_claim, last_finish = sql(
            """SELECT min(e.at), (SELECT max(finished_at) FROM jobs_job)
               FROM jobs_jobevent e WHERE e.to_status = 'processing'"""
        )[0]
        seconds[pool] = (last_finish - first_claim).total_seconds()
        proc.stop()
        status = counts_by_status()
        faster = seconds["threads"] / seconds[pool]
        yield {
            "scenario": name,
            "code": f"{ctx.code.label} --pool {pool}",
            "figure": f"{figure}, one runworker --concurrency {concurrency} --pool {pool}",
            "value": n / seconds[pool],
            "unit": "jobs/s",
            "target": ">= 1.6x threads" if name == "cpu-pool" and pool != "threads" else None,
            "summary": f"first claim -> last finish {seconds[pool]:.3f}s "
            f"({faster:.2f}x the thread pool's rate), statuses {status}, preload {load_s:.2f}s",
            "details": {"jobs": n, "pool": pool, "seconds": seconds[pool], "statuses": status,
                        "vs_threads": faster, "concurrency": concurrency},
        }  # fmt: skip


@scenario("cpu-pool")
def cpu_pool(ctx: Context) -> Iterator[dict]:
    """CPU-bound handlers (a pure-Python loop holding the GIL): 2 threads against 2
    children on the same jobs. Threads take turns on the GIL; children use both cores."""
    n = ctx.args.jobs or (24 if ctx.quick else 120)
    turns = 1_000_000 if ctx.quick else 3_000_000
    yield from pool_drain(
        ctx, "cpu-pool", f"drain {n} CPU-bound jobs ({turns:,} loop turns each)", n,
        ctx.args.concurrency or 2, "bench.spin", {"n": turns},
    )  # fmt: skip


@scenario("drain-pool")
def drain_pool(ctx: Context) -> Iterator[dict]:
    """No-op jobs through each pool at the process pool's default --concurrency (4), the
    threads given the same: what a child's round trip (a pipe message each way,
    pickling) costs per job."""
    n = ctx.args.jobs or (300 if ctx.quick else 5000)
    yield from pool_drain(
        ctx, "drain-pool", f"drain {n} no-op jobs", n, ctx.args.concurrency or 4, "echo", {}
    )


@scenario("drain-1")
def drain_1(ctx: Context) -> Iterator[dict]:
    yield from drain(ctx, 1)


@scenario("drain-2")
def drain_2(ctx: Context) -> Iterator[dict]:
    yield from drain(ctx, 2)


@scenario("drain-2-default")
def drain_2_default(ctx: Context) -> Iterator[dict]:
    """Two workers started without options: what users run, next to the tuned drain-2."""
    yield from drain(ctx, 2, tuned=False)


@scenario("drain-4")
def drain_4(ctx: Context) -> Iterator[dict]:
    yield from drain(ctx, 4)


# --- fair share (issue 28) -----------------------------------------------------------------------


def _client_jobs(n: int, client_id: int, queue: str) -> None:
    """Commit n queued no-op jobs of one client in one transaction (signalled after commit)."""
    from django.db import transaction

    from jobs import services

    with transaction.atomic():
        for start in range(0, n, 1000):
            services.submit_many(
                [services.NewJob("echo", {}, queue=queue) for _ in range(min(1000, n - start))],
                client_id=client_id,
            )


def _done_of(client_id: int) -> int:
    return sql(
        "SELECT count(*) FROM jobs_job WHERE client_id = %s AND status = 'done'", [client_id]
    )[0][0]


@scenario("fair-share")
def fair_share(ctx: Context) -> Iterator[dict]:
    """Client A queues 20,000 no-op jobs, one default runworker drains them, then client B
    submits 20: how long B waits, how much of A's backlog still waits when B is done, and
    the whole drain, on a plain queue and on a `fair` one side by side."""
    import json

    from jobs.models import Client

    n = ctx.args.jobs or (300 if ctx.quick else 20000)
    late = 20
    drains: dict[bool, float] = {}
    for fair in (False, True):
        reset(ctx)
        sql("DELETE FROM jobs_client WHERE name LIKE %s", ["bench-fair-%"])
        a, _ = Client.create_with_token("bench-fair-a")
        b, _ = Client.create_with_token("bench-fair-b")
        env = {"JOBS_QUEUES": json.dumps({"default": {}, "shared": {"fair": fair}})}
        worker = ctx.procs.worker("--queues", "shared", *worker_args(ctx, None), ready=True, **env)
        backends = backend_pids()
        cpu_before = cpu_seconds([worker.pid]), cpu_seconds(backends)
        _client_jobs(n, a.pk, "shared")
        wait_until(
            lambda: sql("SELECT count(*) FROM jobs_job WHERE status = 'done'")[0][0] >= 100,
            60,
            "A's backlog draining",
            interval=0.01,
        )
        _client_jobs(late, b.pk, "shared")
        wait_until(
            lambda b_id=b.pk: _done_of(b_id) == late,
            max(60, n / 200),
            "B's jobs done",
            interval=0.01,
        )
        b_wait, b_done_at = sql(
            "SELECT extract(epoch FROM max(finished_at) - min(created_at)), max(finished_at)"
            " FROM jobs_job WHERE client_id = %s",
            [b.pk],
        )[0]
        # A's jobs not yet started when B's last one finished (from the history).
        a_waiting = sql(
            "SELECT count(*) FROM jobs_job j WHERE j.client_id = %s AND NOT EXISTS ("
            " SELECT FROM jobs_jobevent e WHERE e.job_id = j.id AND e.to_status = 'processing'"
            " AND e.at <= %s)",
            [a.pk, b_done_at],
        )[0][0]
        wait_terminal(n + late, timeout=max(60, n / 200))
        backends = sorted(set(backends) | set(backend_pids()))
        cpu_worker = cpu_seconds([worker.pid]) - cpu_before[0]
        cpu_pg = cpu_seconds(backends) - cpu_before[1]
        first_claim, last_finish, claim_tx = sql(
            "SELECT (SELECT min(at) FROM jobs_jobevent WHERE to_status = 'processing'),"
            " (SELECT max(finished_at) FROM jobs_job),"
            " (SELECT count(DISTINCT (actor, at)) FROM jobs_jobevent"
            "  WHERE to_status = 'processing')"
        )[0]
        seconds = (last_finish - first_claim).total_seconds()
        drains[fair] = seconds
        worker.stop()
        label = "fair" if fair else "plain"
        yield {
            "code": f"{ctx.code.label} {label}",
            "figure": f"client B's {late} jobs behind client A's {n:,} on a {label} queue, "
            "one default runworker",
            "value": float(b_wait),
            "unit": "s until B's last job is done",
            "target": "<= 3 s, A still draining (fair)" if fair else None,
            "summary": (
                f"B's {late} done {float(b_wait):.2f}s after submission with {a_waiting:,} of "
                f"A's {n:,} not yet started; whole drain {seconds:.2f}s "
                f"({(n + late) / seconds:,.0f} jobs/s) in {claim_tx:,} claim statements; "
                f"CPU per job: worker {cpu_worker / n * 1e6:.0f} us, "
                f"postgres {cpu_pg / n * 1e6:.0f} us"
                + (f"; {seconds / drains[False] - 1:+.1%} against the plain queue" if fair else "")
            ),
            "details": {
                "jobs": n,
                "late": late,
                "fair": fair,
                "b_wait_s": float(b_wait),
                "a_not_started_when_b_done": a_waiting,
                "drain_s": seconds,
                "drain_jobs_per_s": (n + late) / seconds,
                "claim_statements": claim_tx,
                "cpu_worker_s": cpu_worker,
                "cpu_postgres_s": cpu_pg,
            },
        }


# --- end-to-end latency --------------------------------------------------------------------------


def commit_floor(n: int) -> dict[str, float]:
    """Client-side time of a one-row INSERT that commits (WAL flush): the floor under
    each of the two commits between submission and claim."""
    sql("CREATE TABLE IF NOT EXISTS bench_commit_probe (id bigserial PRIMARY KEY, at timestamptz)")
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        sql("INSERT INTO bench_commit_probe (at) VALUES (now())")
        times.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.002)
    return percentiles(times)


@scenario("latency")
def latency(ctx: Context) -> Iterator[dict]:
    """Jobs submitted one at a time to idle workers (--concurrency 64): created_at ->
    finished_at."""
    yield from submission_to_done(ctx, tuned=True)


@scenario("latency-default")
def latency_default(ctx: Context) -> Iterator[dict]:
    """The same with two `runworker` at their defaults, as users start them."""
    yield from submission_to_done(ctx, tuned=False)


def submission_to_done(ctx: Context, *, tuned: bool) -> Iterator[dict]:
    from jobs import services

    n, gap = (30, 0.01) if ctx.quick else (1000, 0.01)
    concurrency = (ctx.args.concurrency or 64) if tuned else None
    for code, variant in ctx.setups():
        reset(ctx)
        apply_variant(variant)
        procs = [
            ctx.procs.worker(*worker_args(ctx, concurrency), root=code.root, ready=True)
            for _ in range(2)
        ]
        time.sleep(0.5)
        floor = commit_floor(50 if ctx.quick else 300)
        for _ in range(n):
            services.submit("echo", {})
            time.sleep(gap)
        wait_terminal(n, timeout=60)
        rows = sql(
            """SELECT extract(epoch FROM j.finished_at - j.created_at) * 1000,
                      extract(epoch FROM e.at - j.created_at) * 1000,
                      extract(epoch FROM j.finished_at - e.at) * 1000
               FROM jobs_job j JOIN jobs_jobevent e
                 ON e.job_id = j.id AND e.to_status = 'processing'"""
        )
        for p in procs:
            p.stop()
        pct = percentiles([float(r[0]) for r in rows])
        to_claim = percentiles([float(r[1]) for r in rows])
        to_finish = percentiles([float(r[2]) for r in rows])
        yield {
            "code": labelled(code.label, variant),
            "figure": "submission -> done of a no-op job on idle workers (p99)",
            "value": pct["p99"],
            "unit": "ms",
            "target": "p99 <= 4 ms",
            "summary": fmt_pcts(pct)
            + f"; one job every {gap * 1000:.0f} ms, 2 workers, "
            + f"--concurrency {concurrency or 'default'}"
            + f"\n    created -> claimed: {fmt_pcts(to_claim)}"
            + f"\n    claimed -> finished: {fmt_pcts(to_finish)}"
            + f"\n    floor, one-row INSERT + commit on this server: {fmt_pcts(floor)}",
            "details": {
                "percentiles_ms": pct,
                "created_to_claimed_ms": to_claim,
                "claimed_to_finished_ms": to_finish,
                "commit_floor_ms": floor,
                "jobs": n,
                "gap_s": gap,
                "workers": 2,
                "concurrency": concurrency,
            },
        }


# --- worker start -----------------------------------------------------------------------------


@scenario("worker-start")
def worker_start(ctx: Context) -> Iterator[dict]:
    """`manage.py runworker` at its defaults: process start -> its "worker started" line,
    each code in turn, several times (alternating, so both see the same load)."""
    n = 3 if ctx.quick else 10
    times: dict[str, list[float]] = {code.label: [] for code in ctx.codes()}
    cpu: dict[str, list[float]] = {code.label: [] for code in ctx.codes()}
    for _ in range(n):
        for code in ctx.codes():
            started = time.perf_counter()
            proc = ctx.procs.worker(root=code.root, ready=True)
            times[code.label].append((time.perf_counter() - started) * 1000)
            cpu[code.label].append(cpu_seconds([proc.pid]) * 1000)
            proc.stop()
    for code in ctx.codes():
        pct = percentiles(times[code.label])
        cpu_pct = percentiles(cpu[code.label])
        yield {
            "code": code.label,
            "figure": "runworker start: process start -> worker started (p50)",
            "value": pct["p50"],
            "unit": "ms",
            "summary": fmt_pcts(pct) + f"; {n} starts, alternating with the other code"
            f"\n    CPU of the process until then: {fmt_pcts(cpu_pct)}",
            "details": {"start_ms": times[code.label], "cpu_ms": cpu[code.label]},
        }


# --- claim latency ----------------------------------------------------------------------


def fill_finished(rows: int) -> float:
    """Add `rows` finished jobs (history not included) as fixture data, in bulk.

    The lifecycle trigger admits only queued inserts, so this fixture load runs with
    session_replication_role = replica (triggers off) on the scratch database; the
    check constraints still apply to every row.
    """
    started = time.perf_counter()
    step = 250_000
    for start in range(0, rows, step):
        size = min(step, rows - start)
        sql(
            """SET session_replication_role = replica;
               INSERT INTO jobs_job (task, payload, queue, priority, status, result, run_at,
                   max_retries, retry_count, lease_version, created_at, updated_at,
                   finished_at, updated_by)
               SELECT 'echo', '{}', 'default', 0, 'done', '{}',
                      now() - interval '1 day', 3, 0, 1,
                      now() - interval '1 day', now() - interval '1 day',
                      now() - interval '1 day' + g * interval '1 ms', 'bench-fixture'
               FROM generate_series(1, %s) AS g;
               SET session_replication_role = origin;""",
            [size],
        )
    sql("VACUUM ANALYZE jobs_job")
    return time.perf_counter() - started


def claim_latency(ctx: Context, finished_rows: int) -> Iterator[dict]:
    claimers = ctx.args.claimers or (4 if ctx.quick else 16)
    seconds = 1.0 if ctx.quick else 5.0
    jobs = 2000 if ctx.quick else 40000
    fill_s = fill_finished(finished_rows) if finished_rows else 0.0
    preload(jobs)
    sql("ANALYZE jobs_job")
    env = {**ctx.procs.env, "LOG_LEVEL": "WARNING"}
    argv = [sys.executable, "-m", "bench.claimer", str(seconds)]
    docs = released_together(argv, claimers, timeout=seconds + 60, env=env)
    timings: list[float] = []
    server: list[float] = []
    for doc in docs:
        timings.extend(doc["claims_ms"])
        server.extend(doc["server_ms"])
    pct = percentiles(timings)
    server_pct = percentiles(server)
    label = f"{finished_rows:,} finished rows" if finished_rows else "an empty history"
    yield {
        "code": ctx.code.label,
        "figure": f"claim statement latency, {claimers} concurrent claimers, {label} (p99)",
        "value": pct["p99"],
        "unit": "ms",
        "target": "p99 < 10 ms",
        "summary": fmt_pcts(pct)
        + f"; {len(timings) / seconds:,.0f} claims/s; claim_next(limit 1) + complete"
        + f"\n    server-side (statement start -> end, same statements): {fmt_pcts(server_pct)}",
        "details": {
            "percentiles_ms": pct,
            "server_percentiles_ms": server_pct,
            "claimers": claimers,
            "seconds": seconds,
            "finished_rows": finished_rows,
            "fill_seconds": fill_s,
        },
    }


@scenario("claim")
def claim(ctx: Context) -> Iterator[dict]:
    yield from claim_latency(ctx, 0)


@scenario("claim-big")
def claim_big(ctx: Context) -> Iterator[dict]:
    yield from claim_latency(ctx, ctx.args.finished_rows)


# --- recovery ----------------------------------------------------------------------------------


@scenario("recovery")
def recovery(ctx: Context) -> Iterator[dict]:
    """kill -9 a worker holding jobs; time until they are terminal (reaper + another worker)."""
    lease = ctx.args.lease if ctx.args.lease is not None else (2.0 if ctx.quick else None)
    env: dict[str, str] = {}
    label = "service defaults (lease 15 s, reaper every 5 s)"
    if lease is not None:
        interval = max(0.2, lease / 4)
        env = {"JOBS_LEASE_SECONDS": str(lease), "JOBS_REAPER_INTERVAL": str(interval)}
        label = f"SHORT LEASE {lease:g} s, reaper every {interval:g} s (not the defaults)"
    held = 8
    victim = ctx.procs.worker("--concurrency", str(held), ready=True, **env)
    preload(held, task="bench.hold_first", payload={"seconds": 300})
    wait_until(
        lambda: counts_by_status().get("processing", 0) == held, 30, "jobs held by the victim"
    )
    rescuer = ctx.procs.worker("--concurrency", str(held), ready=True, **env)
    victim.kill()
    killed_at = sql("SELECT clock_timestamp()")[0][0]
    ctx.procs.reaper(**env)
    wait_terminal(held, timeout=120)
    requeued, finished = sql(
        """SELECT (SELECT max(at) FROM jobs_jobevent WHERE actor = 'reaper'),
                  (SELECT max(finished_at) FROM jobs_job)"""
    )[0]
    rescuer.stop()
    to_requeue = (requeued - killed_at).total_seconds()
    to_terminal = (finished - killed_at).total_seconds()
    yield {
        "code": ctx.code.label,
        "figure": f"recovery after kill -9 of a worker holding {held} jobs, {label}",
        "value": to_terminal,
        "unit": "s",
        "summary": f"kill -> requeued by the reaper {to_requeue:.2f}s, -> all done "
        f"{to_terminal:.2f}s; statuses {counts_by_status()}",
        "details": {
            "lease": lease,
            "held": held,
            "to_requeue_s": to_requeue,
            "to_terminal_s": to_terminal,
        },
    }


# --- HTTP -------------------------------------------------------------------------------------


def api_available() -> bool:
    return (ROOT / "jobs" / "api" / "views.py").exists()


def _http(ctx: Context, name: str, measure: Callable[[Context], Iterator[dict]]):
    if not api_available():
        yield http_load.not_measured(name)
        return
    yield from measure(ctx)


@scenario("http-single")
def http_single(ctx: Context) -> Iterator[dict]:
    yield from _http(ctx, "http-single", http_load.single)


@scenario("peer-pgqueuer-enqueue")
def peer_pgqueuer_enqueue(ctx: Context) -> Iterator[dict]:
    """The peer beside http-single: pgqueuer's in-process enqueue (bench.peer_pgqueuer)."""
    from bench import peer_pgqueuer

    yield from peer_pgqueuer.enqueue(ctx)


@scenario("http-single-wrk")
def http_single_wrk(ctx: Context) -> Iterator[dict]:
    yield from _http(ctx, "http-single-wrk", http_load.single_wrk)


@scenario("http-front")
def http_front(ctx: Context) -> Iterator[dict]:
    yield from _http(ctx, "http-front", http_load.front)


@scenario("http-bulk")
def http_bulk(ctx: Context) -> Iterator[dict]:
    yield from _http(ctx, "http-bulk", http_load.bulk)


# --- completion events to Kafka -----------------------------------------------------------------


def _kafka_env(bootstrap: str, topic: str) -> dict[str, str]:
    return {"JOBS_KAFKA_BOOTSTRAP_SERVERS": bootstrap, "JOBS_KAFKA_TOPIC": topic,
            "JOBS_KAFKA_CONFIG": '{"linger.ms": 5}'}  # fmt: skip


def _kafka_cursor() -> int | None:
    rows = sql("SELECT last_id FROM jobs_outboxcursor WHERE name = 'kafka'")
    return rows[0][0] if rows else None


def _last_event() -> int:
    return sql("SELECT COALESCE(max(id), 0) FROM jobs_jobevent")[0][0]


@scenario("kafka")
def kafka_sink(ctx: Context) -> Iterator[dict]:
    """The outbox's Kafka sink against a local broker (Tansu, memory storage): how fast a
    runreaper relays a backlog of finished jobs' events, then the drain rate of two
    workers beside a reaper with the sink off and on, side by side."""
    from harness import KafkaBroker

    n = ctx.args.jobs or (300 if ctx.quick else 10000)
    concurrency = ctx.args.concurrency or 128
    broker = KafkaBroker(ctx.logdir / "tansu.log").start()
    try:
        # 1. A backlog: n jobs finished with no relay, then one runreaper relays them all.
        broker.create_topic("bench.backlog", partitions=12)
        sql("DELETE FROM jobs_outboxcursor WHERE name = 'kafka'")
        workers = [ctx.procs.worker(*worker_args(ctx, concurrency), ready=True)
                   for _ in range(2)]  # fmt: skip
        preload(n)
        wait_terminal(n, timeout=max(60, n / 200))
        for p in workers:
            p.stop()
        last = _last_event()
        sql("INSERT INTO jobs_outboxcursor (name, last_id, updated_at) VALUES ('kafka', 0, now())")
        env = _kafka_env(broker.bootstrap, "bench.backlog")
        reaper = ctx.procs.reaper("--interval", "5", **env)
        wait_until(lambda: (_kafka_cursor() or 0) > 0, 60, "the relay's first batch", interval=0.01)
        started, first = time.perf_counter(), _kafka_cursor()
        wait_until(lambda: _kafka_cursor() >= last, max(60, n / 100), "the backlog relayed",
                   interval=0.01)  # fmt: skip
        seconds = time.perf_counter() - started
        reaper.stop()
        events = sql("SELECT count(*) FROM jobs_jobevent WHERE kind = 'transition' "
                     "AND id > %s AND id <= %s", [first, last])[0][0]  # fmt: skip
        on_topic = len(broker.read("bench.backlog", expect=3 * n, timeout=60))
        yield {
            "scenario": "kafka",
            "figure": "Kafka sink: a backlog relayed by one runreaper (12 partitions, acks=all)",
            # The rate is read after the relay's first batch (its start-up left out): a
            # backlog that fits in that batch (--quick) leaves nothing to time.
            "value": events / seconds if events else None,
            "note": None
            if events
            else "NOT MEASURED: the whole backlog fit in the relay's "
            "first batch; run with more --jobs",
            "unit": "events/s",
            "summary": f"{events} events after the first batch in {seconds:.2f}s; "
            f"{on_topic} messages on the topic for {3 * n} events",
            "details": {"jobs": n, "events": events, "seconds": seconds, "on_topic": on_topic},
        }
        # 2. Two workers draining n jobs beside a runreaper: the sink off, then on.
        broker.create_topic("bench.drain", partitions=12)
        for label, env in (("off", {}), ("on", _kafka_env(broker.bootstrap, "bench.drain"))):
            reset(ctx)
            sql("DELETE FROM jobs_outboxcursor WHERE name = 'kafka'")
            if env:  # the sink starts where the operator says (D193): at the present
                placed = ctx.procs.start("outbox", "start", "kafka", "--from", "now")
                if placed.wait(60) != 0:
                    raise RuntimeError(f"outbox start kafka failed:\n{placed.output()}")
            reaper = ctx.procs.reaper("--interval", "5", **env)
            procs = [ctx.procs.worker(*worker_args(ctx, concurrency), ready=True)
                     for _ in range(2)]  # fmt: skip
            cpu_before = cpu_seconds([reaper.pid])
            preload(n)
            wait_terminal(n, timeout=max(60, n / 200))
            finished = time.perf_counter()
            first_claim, last_finish = sql(
                "SELECT min(at), (SELECT max(finished_at) FROM jobs_job) FROM jobs_jobevent "
                "WHERE to_status = 'processing'"
            )[0]
            drain_s = (last_finish - first_claim).total_seconds()
            behind = 0.0
            if env:
                upto = _last_event()
                wait_until(lambda upto=upto: _kafka_cursor() >= upto, max(60, n / 100),
                           "relay caught up", interval=0.01)  # fmt: skip
                behind = time.perf_counter() - finished
            cpu_reaper = cpu_seconds([reaper.pid]) - cpu_before
            for p in [*procs, reaper]:
                p.stop()
            yield {
                "scenario": "kafka",
                "code": f"sink {label}",
                "figure": f"drain {n} no-op jobs with 2 runworker processes and a runreaper, "
                f"Kafka sink {label}",
                "value": n / drain_s,
                "unit": "jobs/s",
                "summary": f"first claim -> last finish {drain_s:.3f}s; reaper CPU "
                f"{cpu_reaper:.2f}s"
                + (f"; relay caught up {behind:.2f}s after the last finish" if env else ""),
                "details": {"jobs": n, "seconds": drain_s, "sink": label,
                            "reaper_cpu_s": cpu_reaper, "caught_up_after_s": behind},
            }  # fmt: skip
    finally:
        broker.stop()


@scenario("http-waits")
def http_waits(ctx: Context) -> Iterator[dict]:
    yield from _http(ctx, "http-waits", http_load.waits)
