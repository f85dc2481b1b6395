"""HTTP submission through the API server: single jobs and batches of 1000.

The load itself comes from `bench.http_client` processes (standard library only).
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from harness import Service, free_port


def not_measured(name: str) -> dict:
    return {
        "scenario": name,
        "figure": "HTTP submission through the API server",
        "value": None,
        "unit": "jobs/s",
        "note": "NOT MEASURED: the REST API (jobs/api/) is not on this branch yet",
    }


class Setup:
    """One API server to measure: a tree (`code`) with extra environment (`env`), on a
    database variant (bench.variants.VARIANTS)."""

    def __init__(self, code: Any, label: str = "", env: dict[str, str] | None = None,
                 variant: str = "default") -> None:  # fmt: skip
        self.code = code
        self.root = code.root
        self.env = env or {}
        self.variant = variant
        self.label = labelled(f"{code.label} {label}".strip(), variant)


def parse_server(spec: str) -> tuple[str, dict[str, str]]:
    """'gthread:JOBS_HTTP_SERVER=gunicorn,WEB_WORKER_CLASS=gthread' -> label, environment."""
    label, _, rest = spec.partition(":")
    env = dict(item.split("=", 1) for item in rest.split(",") if item)
    return label, env


def setups(ctx: Any) -> list[Setup]:
    """The baseline tree with its defaults, then this tree with each --server (its
    default server without any), on each --variant of the database in turn."""
    out = []
    for variant in ctx.args.variant or ["default"]:
        if ctx.baseline:
            out.append(Setup(ctx.baseline, variant=variant))
        specs = ctx.args.server or []
        if not specs:
            out.append(Setup(ctx.code, variant=variant))
        else:
            out += [Setup(ctx.code, *parse_server(s), variant=variant) for s in specs]
    return out


# No worker drains what the scenarios submit: neither backpressure (the queue's depth, a
# client's share of it, D198) nor the throttle may answer them 429.
UNREFUSED = {
    "JOBS_MAX_QUEUE_DEPTH": "100000000",
    "JOBS_MAX_CLIENT_QUEUE_DEPTH": "100000000",
    "JOBS_API_THROTTLE": "100000000/minute",
}


def _server(ctx: Any, setup: Setup, web_concurrency: int | None) -> tuple[Service, str]:
    """The API server of `setup`'s tree with that tree's own defaults, unless
    --web-concurrency says how many workers."""
    port = free_port()
    web = {"WEB_CONCURRENCY": str(web_concurrency)} if web_concurrency else {}
    server = ctx.procs.api(
        port,
        root=setup.root,
        LOG_LEVEL="WARNING",
        **UNREFUSED,
        **web,
        **setup.env,
    )
    return server, f"http://127.0.0.1:{port}"


def _children(pid: int) -> list[int]:
    """The server's main process and its workers."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    return [pid, *map(int, kids)]


def _load(ctx: Any, url: str, body: Any, seconds: float, clients: int, threads: int) -> dict:
    from jobs.models import Client

    _, token = Client.create_with_token(f"bench-{secrets.token_hex(6)}")
    body_file = ctx.logdir / f"body-{id(body)}.json"
    body_file.write_text(json.dumps(body))
    argv = [sys.executable, "-m", "bench.http_client", url, token, str(body_file), str(seconds),
            str(threads)]  # fmt: skip
    docs = released_together(argv, clients, timeout=seconds + 120)
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    elapsed = 0.0
    client_cpu = 0.0
    for doc in docs:
        client_cpu += doc.get("cpu_seconds", 0.0)
        for k, v in doc["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
        latencies.extend(doc["latencies_ms"])
        elapsed = max(elapsed, doc["seconds"])
    return {
        "statuses": statuses,
        "latencies": latencies,
        "seconds": elapsed,
        "client_cpu_seconds": client_cpu,
    }


def _measured(ctx: Any, code: Any, name: str, path: str, load: Any) -> tuple[dict, Any, int]:
    """`load(url, seconds)` against `code`'s API server, warmed up first: what it returned,
    the CPU seconds of the server's processes and of the database backends meanwhile, and
    the last job id before it."""
    apply_variant(code.variant)  # the setup's shape of the schema, on emptied tables
    server, url = _server(ctx, code, ctx.args.web_concurrency)
    # Each server worker imports the URLconf, DRF and the schema code on its first
    # requests: warm them up so the figures (and CPU per request) are the steady state.
    load(url + path, 0.5 if ctx.quick else 1.5)
    before = sql("SELECT coalesce(max(id), 0) FROM jobs_job")[0][0]
    profiler = Profiler(ctx.args.profile, [server], f"{name}-{code.label}")
    # CPU per request of the API's processes and their database backends: on a busy
    # machine, a steadier side-by-side figure than requests per second.
    web_pids = _children(server.pid)
    cpu0 = cpu_seconds(web_pids), cpu_seconds(backend_pids())
    got = load(url + path, 2.0 if ctx.quick else 10.0)
    cpu1 = cpu_seconds(web_pids), cpu_seconds(backend_pids())
    profiler.stop()
    server.stop()
    return got, (cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]), before


def _cpu_per_request(cpu: Any, ok: int) -> dict[str, float]:
    return {
        "server_cpu_ms_per_request": 1000 * cpu[0] / max(ok, 1),
        "postgres_cpu_ms_per_request": 1000 * cpu[1] / max(ok, 1),
    }


def _cpu_summary(per_request: dict[str, float]) -> str:
    return (
        f"CPU per request: server {per_request['server_cpu_ms_per_request']:.2f} ms, "
        f"PostgreSQL {per_request['postgres_cpu_ms_per_request']:.2f} ms"
    )


def _workers(ctx: Any) -> str:
    web = ctx.args.web_concurrency
    return f"{web} workers" if web else "its defaults"


def _run(
    ctx: Any, code: Any, name: str, body: Any, jobs_per_request: int, clients: int, threads: int
):
    path = "/api/v1/jobs/batch/" if jobs_per_request > 1 else "/api/v1/jobs/"
    # Every tree starts from empty tables and a fresh checkpoint: otherwise the tree
    # measured second inserts into the first one's rows and pays its checkpoint.
    sql("TRUNCATE jobs_job, jobs_jobevent")
    sql("CHECKPOINT")
    got, cpu, before = _measured(
        ctx, code, name, path, lambda url, s: _load(ctx, url, body, s, clients, threads)
    )
    created = sql(
        "SELECT count(*), min(created_at), max(created_at) FROM jobs_job WHERE id > %s", [before]
    )[0]
    ok = got["statuses"].get("201", 0)
    pct = percentiles(got["latencies"])
    jobs = ok * jobs_per_request
    db_span = (created[2] - created[1]).total_seconds() if created[0] > 1 else 0.0
    target = ">= 30,000 jobs/s" if jobs_per_request > 1 else ">= 1,000 jobs/s"
    per_request = _cpu_per_request(cpu, ok)
    client_cpu = 1000 * got["client_cpu_seconds"] / max(ok, 1)
    return {
        "scenario": name,
        "code": code.label,
        "figure": f"HTTP POST {path} through the API server ({_workers(ctx)}), "
        f"{jobs_per_request} job(s) per request",
        "value": jobs / got["seconds"],
        "unit": "jobs/s",
        "target": target,
        "summary": f"{ok} x 201 in {got['seconds']:.2f}s ({ok / got['seconds']:,.0f} req/s), "
        f"statuses {got['statuses']}, {created[0]} rows; request latency "
        + (fmt_pcts(pct) if pct else "-")
        + f"; {clients}x{threads} client threads; {_cpu_summary(per_request)}, "
        f"the Python client itself {client_cpu:.2f} ms",
        "details": {
            "requests_ok": ok,
            "client_cpu_ms_per_request": client_cpu,
            "statuses": got["statuses"],
            "seconds": got["seconds"],
            "rows": created[0],
            "db_span_s": db_span,
            "latency_ms": pct,
            "web_concurrency": ctx.args.web_concurrency,
            "client_threads": clients * threads,
            **per_request,
        },
    }


_WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = [[%(body)s]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Token %(token)s"
"""


def _wrk(ctx: Any, url: str, body: Any, seconds: float, threads: int) -> dict:
    """wrk (C, one connection per thread): the load generator's own CPU, which the 2-core
    machine shares with the server, is a few percent of the Python client's."""
    from jobs.models import Client

    _, token = Client.create_with_token(f"bench-{secrets.token_hex(6)}")
    script = ctx.logdir / f"wrk-{secrets.token_hex(4)}.lua"
    script.write_text(_WRK_SCRIPT % {"body": json.dumps(body), "token": token})
    seconds = max(1, round(seconds))  # wrk takes whole seconds
    argv = ["wrk", f"-t{threads}", f"-c{threads}", f"-d{seconds}s", "--latency", "-s",
            str(script), url]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60).stdout
    done = re.search(r"(\d+) requests in", out)
    if done is None:
        raise RuntimeError(f"wrk did not run: {argv}\n{out}")
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    latency = {
        f"p{p}": _ms(v, unit)
        for p, v, unit in re.findall(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s)$", out, re.M)
    }
    return {
        "requests": int(done.group(1)),
        "non_2xx": int(bad.group(1)) if bad else 0,
        "socket_errors": errors.group(1) if errors else None,
        "seconds": float(seconds),
        "latency": latency,
    }


def _ms(value: str, unit: str) -> float:
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def single_wrk(ctx: Any) -> Iterator[dict]:
    """8 client threads of wrk (one connection each), each setup's API server in turn."""
    if shutil.which("wrk") is None:
        yield {
            "scenario": "http-single-wrk",
            "figure": "HTTP POST /api/v1/jobs/, wrk",
            "value": None,
            "unit": "jobs/s",
            "note": "NOT MEASURED: wrk is not installed (Debian package wrk)",
        }
        return
    body = {"task": "echo", "payload": {"n": 1}}
    for code in setups(ctx):
        got, cpu, before = _measured(
            ctx, code, "http-single-wrk", "/api/v1/jobs/", lambda url, s: _wrk(ctx, url, body, s, 8)
        )
        rows = sql("SELECT count(*) FROM jobs_job WHERE id > %s", [before])[0][0]
        ok = got["requests"] - got["non_2xx"]
        per_request = _cpu_per_request(cpu, ok)
        yield {
            "scenario": "http-single-wrk",
            "code": code.label,
            "figure": f"HTTP POST /api/v1/jobs/ through the API server ({_workers(ctx)}), "
            "1 job per request, load from wrk",
            "value": ok / got["seconds"],
            "unit": "jobs/s",
            "target": ">= 1,000 jobs/s",
            "summary": f"{got['requests']} requests ({got['non_2xx']} not 2xx, socket errors "
            f"{got['socket_errors'] or 'none'}), {rows} rows in {got['seconds']:.0f}s; latency "
            + ", ".join(f"{k} {v:.2f}ms" for k, v in got["latency"].items())
            + f"; wrk -t8 -c8; {_cpu_summary(per_request)}",
            "details": {
                "requests": got["requests"],
                "non_2xx": got["non_2xx"],
                "rows": rows,
                "latency_ms": got["latency"],
                **per_request,
            },
        }


def single(ctx: Any) -> Iterator[dict]:
    """8 client threads (2 processes x 4), each setup's API server in turn (baseline first)."""
    for code in setups(ctx):
        yield _run(ctx, code, "http-single", {"task": "echo", "payload": {"n": 1}}, 1, 2, 4)


def bulk(ctx: Any) -> Iterator[dict]:
    size = 1000
    body = {"jobs": [{"task": "echo", "payload": {"n": n}} for n in range(size)]}
    for code in setups(ctx):
        yield _run(ctx, code, "http-bulk", body, size, 1, 2)


# --- the front (HAProxy) and slow clients -------------------------------------------------------

STALLED, IDLE = 64, 1000  # issue 39: the hostile load the front must absorb


def front(ctx: Any) -> Iterator[dict]:
    """Single submissions (8 client threads) on one API server: straight to granian, through
    the front (HAProxy, `python -m jobservice.proxy`), and through the front while 64 bodies
    that stall with credentials and 1,000 silent connections are held open (each one the
    front answers 408 or closes is reopened at once). Same server, same run: the front's
    own cost and what the slow clients take from the rate. Figures only; nothing here
    asserts."""
    from harness import front as front_proxy
    from harness.front import Front
    from harness.slow_clients import Held, connect, credentialed_stalls
    from jobs.models import Client

    if why := front_proxy.available():
        yield {"scenario": "http-front", "figure": "HTTP POST /api/v1/jobs/ through the front",
               "value": None, "unit": "jobs/s", "note": f"NOT MEASURED: {why}"}  # fmt: skip
        return
    body = {"task": "echo", "payload": {"n": 1}}
    for code in setups(ctx):
        server, direct = _server(ctx, code, ctx.args.web_concurrency)
        # As deployed: one HAProxy thread per core.
        env = {**server.env, "PROXY_THREADS": "auto"}
        proxy = Front(int(direct.rpartition(":")[2]), env).start()
        through = f"http://127.0.0.1:{proxy.port}"
        _, token = Client.create_with_token(f"bench-hostile-{secrets.token_hex(6)}")
        seconds = 2.0 if ctx.quick else 10.0
        try:
            for url in (direct, through):  # warm both paths: imports, upstream keep-alive
                _load(ctx, url + "/api/v1/jobs/", body, 0.5 if ctx.quick else 1.5, 2, 4)
            for label, url, hostile in (("granian alone", direct, False),
                                        ("through the front", through, False),
                                        (f"through the front, {STALLED} stalled + {IDLE} idle "
                                         "connections held", through, True)):  # fmt: skip
                sql("TRUNCATE jobs_job, jobs_jobevent")
                held = []
                if hostile:
                    held = [Held(credentialed_stalls(proxy.port, token), STALLED).start(),
                            Held(functools.partial(connect, proxy.port), IDLE).start()]  # fmt: skip
                web_pids, front_pids = _children(server.pid), _children(proxy.service.pid)
                cpu0 = cpu_seconds(web_pids), cpu_seconds(backend_pids())
                front0 = cpu_seconds(front_pids)
                got = _load(ctx, url + "/api/v1/jobs/", body, seconds, 2, 4)
                cpu1 = cpu_seconds(web_pids), cpu_seconds(backend_pids())
                front_cpu = cpu_seconds(front_pids) - front0
                replaced = [h.stop() for h in held]
                cpu = (cpu1[0] - cpu0[0], cpu1[1] - cpu0[1])
                yield _front_record(code, label, got, cpu, front_cpu, replaced)
        finally:
            proxy.stop()
            server.stop()


def _front_record(
    code: Any, label: str, got: dict, cpu: Any, front_cpu: float, replaced: list[int]
) -> dict:
    ok = got["statuses"].get("201", 0)
    pct = percentiles(got["latencies"])
    per_request = _cpu_per_request(cpu, ok)
    per_request["front_cpu_ms_per_request"] = 1000 * front_cpu / max(ok, 1)
    held = f"; held connections reopened after the front cut them: {replaced}" if replaced else ""
    return {
        "scenario": "http-front",
        "code": code.label,
        "figure": f"HTTP POST /api/v1/jobs/, 1 job per request, {label}",
        "value": ok / got["seconds"],
        "unit": "jobs/s",
        "summary": f"{ok} x 201 in {got['seconds']:.2f}s, statuses {got['statuses']}; latency "
        + (fmt_pcts(pct) if pct else "-")
        + f"; 2x4 client threads; {_cpu_summary(per_request)}, HAProxy "
        f"{per_request['front_cpu_ms_per_request']:.2f} ms{held}",
        "details": {
            "statuses": got["statuses"],
            "seconds": got["seconds"],
            "latency_ms": pct,
            "held_reopened": replaced,
            **per_request,
        },  # fmt: skip
    }


_WAITERS = """
import http.client, json, sys, threading, time
host, port, token, ids, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
answers = {}
lock = threading.Lock()
def one(job_id):
    c = http.client.HTTPConnection(host, port, timeout=float(wait) + 30)
    auth = {"Authorization": f"Token {token}"}
    c.request("GET", f"/api/v1/jobs/{job_id}/?wait={wait}", headers=auth)
    r = c.getresponse(); r.read()
    with lock:
        key = f"{r.status} {r.getheader('Jobs-Wait')}"
        answers[key] = answers.get(key, 0) + 1
threads = [threading.Thread(target=one, args=(int(i),)) for i in ids.split(",")]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(answers))
"""


def waits(ctx: Any) -> Iterator[dict]:
    """Submissions alone, then with 500 clients each holding `?wait=` on a job of their
    own that does not end meanwhile (no worker runs), then alone again: the submission
    rate kept, and the most PostgreSQL connections held from before the waiters connect
    to after they are answered (issue 42.2, D235, D238)."""
    from jobs import services
    from jobs.models import Client

    n_waiters, seconds = 500, (3.0 if ctx.quick else 8.0)
    body = {"task": "echo", "payload": {"n": 1}}
    sql("TRUNCATE jobs_job, jobs_jobevent")
    server, url = _server(ctx, Setup(ctx.code), ctx.args.web_concurrency)
    try:
        _load(ctx, url + "/api/v1/jobs/", body, 1.0, 2, 4)  # warm up
        alone = _load(ctx, url + "/api/v1/jobs/", body, seconds, 2, 4)
        owner, token = Client.create_with_token(f"bench-wait-{secrets.token_hex(4)}")
        ids = [services.submit("echo", {}, client_id=owner.pk)[0].pk for _ in range(n_waiters)]
        host, port = url.removeprefix("http://").split(":")
        wait_for = seconds + 10
        most = [0]
        stop = threading.Event()
        count_sql = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
        )

        def sample() -> None:  # from before the waiters arrive to after they are answered
            while not stop.wait(0.02):
                most[0] = max(most[0], sql(count_sql)[0][0])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        waiters = subprocess.Popen(
            [sys.executable, "-c", _WAITERS, host, port, token, ",".join(map(str, ids)),
             str(wait_for)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(3.0)  # every waiter connected and waiting
        during = _load(ctx, url + "/api/v1/jobs/", body, seconds, 2, 4)
        answers = json.loads(waiters.communicate(timeout=wait_for + 60)[0] or "{}")
        stop.set()
        sampler.join()
        # Alone again once the waits are answered: on a shared machine the rate drifts,
        # and the share is taken against the mean of the two runs around the waits.
        after = _load(ctx, url + "/api/v1/jobs/", body, seconds, 2, 4)
    finally:
        server.stop()

    def rate(run: dict) -> float:
        return run["statuses"].get("201", 0) / run["seconds"]

    rate_before, rate_during, rate_after = rate(alone), rate(during), rate(after)
    rate_alone = (rate_before + rate_after) / 2
    kept = rate_during / rate_alone if rate_alone else 0.0
    yield {
        "scenario": "http-waits",
        "code": ctx.code.label,
        "figure": f"HTTP submissions with {n_waiters} concurrent ?wait= clients "
        f"({_workers(ctx)}), share of the rate measured alone",
        "value": 100 * kept,
        "unit": "%",
        "target": ">= 80 %",
        "summary": f"{rate_alone:,.0f} jobs/s alone ({rate_before:,.0f} before the waits, "
        f"{rate_after:,.0f} after), {rate_during:,.0f} jobs/s with "
        f"{n_waiters} waits held ({100 * kept:.0f} %); at most {most[0]} PostgreSQL client "
        f"connections meanwhile (this bench's own included); wait answers {answers}",
        "details": {
            "alone": rate_alone,
            "before": rate_before,
            "after": rate_after,
            "during": rate_during,
            "connections_max": most[0],
            "answers": answers,
        },  # fmt: skip
    }
