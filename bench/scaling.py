"""The scaling curve (`--scenario scale`): throughput against processes, straight to
PostgreSQL and through a PgBouncer (transaction mode, presence sessions direct).

- workers: 1, 2, 4, 8 `runworker` processes drain the same preloaded jobs (jobs/s from
  the database clock), then as many claim loops (`bench.claimer`) time the claim
  statement (p99);
- API: 1, 2, 4 gunicorn workers take single POSTs from the same client load (jobs/s).

Meanwhile a sampler reads `pg_stat_activity` every 20 ms: what the database's active
sessions were doing (CPU, or the wait event) and how many sessions the database held,
so where the curve bends is read from the server, not guessed.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg

from bench import http_load
from bench.measure import backend_pids, cpu_seconds, percentiles, released_together, sql
from bench.scenarios import Context, preload, reset, scenario, wait_terminal
from harness import PgBouncer, free_port

WORKERS = (1, 2, 4, 8)
APIS = (1, 2, 4)

ACTIVITY_SQL = """
SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU'), count(*)
FROM pg_stat_activity
WHERE datname = current_database() AND state = 'active' AND pid <> pg_backend_pid()
GROUP BY 1"""
SESSIONS_SQL = """SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()"""


class ActivitySampler:
    """Samples the scratch database's sessions on a connection of its own."""

    def __init__(self, url: str, every: float = 0.02) -> None:
        self.url, self.every = url, every
        self.events: Counter[str] = Counter()
        self.samples = 0
        self.max_sessions = 0
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ActivitySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._halt.set()
        self._thread.join(10)

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._halt.wait(self.every):
                for event, count in conn.execute(ACTIVITY_SQL).fetchall():
                    self.events[event] += count
                self.samples += 1
                (sessions,) = conn.execute(SESSIONS_SQL).fetchone()
                self.max_sessions = max(self.max_sessions, sessions)

    def summary(self) -> dict[str, Any]:
        """Average active sessions per state (CPU or wait event) and the most sessions."""
        n = max(self.samples, 1)
        active = {e: round(c / n, 2) for e, c in self.events.most_common()}
        return {"active": active, "active_total": round(sum(active.values()), 2),
                "max_sessions": self.max_sessions}  # fmt: skip


def _top(waits: dict[str, Any]) -> str:
    top = ", ".join(f"{e} {v:.2f}" for e, v in list(waits["active"].items())[:4])
    return (f"active sessions {waits['active_total']:.2f} ({top or 'none'}), "
            f"{waits['max_sessions']} sessions at most")  # fmt: skip


def _routes(ctx: Context) -> Iterator[tuple[str, dict[str, str]]]:
    yield "direct", {}
    bouncer = PgBouncer(ctx.db.admin_url).start()
    try:
        yield (
            "pgbouncer",
            {
                "DATABASE_URL": bouncer.url(ctx.db.url()),
                "JOBS_DIRECT_DATABASE_URL": ctx.db.url(),
            },
        )
    finally:
        bouncer.stop()


def _claims(ctx: Context, n: int, env: dict[str, str]) -> dict[str, Any]:
    """n claim loops on the route: claim statement latency (ms) and claims/s."""
    seconds = 1.0 if ctx.quick else 4.0
    preload(500 if ctx.quick else 20000)
    argv = [sys.executable, "-m", "bench.claimer", str(seconds)]
    docs = released_together(argv, n, timeout=seconds + 60,
                             env={**ctx.procs.env, **env, "LOG_LEVEL": "WARNING"})  # fmt: skip
    timings = [t for d in docs for t in d["claims_ms"]]
    return {"claim_ms": percentiles(timings), "claims_per_s": len(timings) / seconds}


def _drain(ctx: Context, route: str, n: int, env: dict[str, str]) -> dict:
    jobs = ctx.args.jobs or (300 if ctx.quick else 8000)
    concurrency = ctx.args.concurrency or 32
    reset(ctx)
    workers = [ctx.procs.worker("--concurrency", str(concurrency), ready=True, **env)
               for _ in range(n)]  # fmt: skip
    backends = backend_pids()
    cpu0 = cpu_seconds(backends)
    with ActivitySampler(ctx.db.url()) as sampler:
        preload(jobs)
        wait_terminal(jobs, timeout=max(120, jobs / 100))
    cpu_pg = cpu_seconds(sorted(set(backends) | set(backend_pids()))) - cpu0
    first, last = sql("""SELECT (SELECT min(at) FROM jobs_jobevent WHERE to_status = 'processing'),
                                (SELECT max(finished_at) FROM jobs_job)""")[0]  # fmt: skip
    seconds = (last - first).total_seconds()
    for w in workers:
        w.stop()
    reset(ctx)
    claims = _claims(ctx, n, env)
    waits = sampler.summary()
    p99 = claims["claim_ms"].get("p99")
    return {
        "scenario": "scale",
        "code": ctx.code.label,
        "figure": f"drain {jobs} no-op jobs, {n} runworker process(es), {route}",
        "value": jobs / seconds,
        "unit": "jobs/s",
        "summary": f"{seconds:.2f}s; claim statement p99 {p99:.2f} ms with {n} claim loop(s) "
        f"({claims['claims_per_s']:,.0f} claims/s); PostgreSQL CPU per job "
        f"{cpu_pg / jobs * 1e6:.0f} us; {_top(waits)}",
        "details": {
            "kind": "workers",
            "route": route,
            "processes": n,
            "jobs": jobs,
            "concurrency": concurrency,
            "seconds": seconds,
            **claims,
            "cpu_postgres_s": cpu_pg,
            "waits": waits,
        },  # fmt: skip
    }


def _api(ctx: Context, route: str, n: int, env: dict[str, str]) -> dict:
    reset(ctx)
    port = free_port()
    server = ctx.procs.api(port, LOG_LEVEL="WARNING", WEB_CONCURRENCY=str(n),
                           **http_load.UNREFUSED, **env)  # fmt: skip
    url = f"http://127.0.0.1:{port}/api/v1/jobs/"
    body = {"task": "echo", "payload": {"n": 1}}
    clients, threads = (2, 2) if ctx.quick else (4, 4)
    http_load._load(ctx, url, body, 0.5 if ctx.quick else 1.5, clients, threads)  # warm up
    with ActivitySampler(ctx.db.url()) as sampler:
        got = http_load._load(ctx, url, body, 2.0 if ctx.quick else 8.0, clients, threads)
    server.stop()
    ok = got["statuses"].get("201", 0)
    pct = percentiles(got["latencies"])
    waits = sampler.summary()
    return {
        "scenario": "scale",
        "code": ctx.code.label,
        "figure": f"HTTP POST /api/v1/jobs/, {n} gunicorn worker(s), {route}",
        "value": ok / got["seconds"],
        "unit": "jobs/s",
        "summary": f"{ok} x 201, statuses {got['statuses']}, request p99 "
        f"{pct.get('p99', 0):.1f} ms, {clients}x{threads} client threads; {_top(waits)}",
        "details": {
            "kind": "api",
            "route": route,
            "processes": n,
            "latency_ms": pct,
            "statuses": got["statuses"],
            "waits": waits,
        },  # fmt: skip
    }


@scenario("scale")
def scale(ctx: Context) -> Iterator[dict]:
    started = time.monotonic()
    for route, env in _routes(ctx):
        for n in WORKERS:
            yield _drain(ctx, route, n, env)
        for n in APIS:
            yield _api(ctx, route, n, env)
    print(f"scale: {time.monotonic() - started:.0f}s", flush=True)
