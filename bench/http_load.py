"""HTTP submission through gunicorn: single jobs and batches of 1000.

The load itself comes from `bench.http_client` processes (standard library only).
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import sys
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
from harness import Service, free_port


def not_measured(name: str) -> dict:
    return {
        "scenario": name,
        "figure": "HTTP submission through gunicorn",
        "value": None,
        "unit": "jobs/s",
        "note": "NOT MEASURED: the REST API (jobs/api/) is not on this branch yet",
    }


def _gunicorn(ctx: Any, code: Any, web_concurrency: int | None) -> tuple[Service, str]:
    """gunicorn from `code`'s tree with that tree's own defaults (gunicorn.conf.py), unless
    --web-concurrency says how many workers."""
    port = free_port()
    web = {"WEB_CONCURRENCY": str(web_concurrency)} if web_concurrency else {}
    server = ctx.procs.api(
        port,
        root=code.root,
        LOG_LEVEL="WARNING",
        JOBS_MAX_QUEUE_DEPTH="100000000",
        JOBS_API_THROTTLE="100000000/minute",
        **web,
    )
    return server, f"http://127.0.0.1:{port}"


def _children(pid: int) -> list[int]:
    """gunicorn's master and its workers."""
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


def _run(
    ctx: Any, code: Any, name: str, body: Any, jobs_per_request: int, clients: int, threads: int
):
    web = ctx.args.web_concurrency
    seconds = 2.0 if ctx.quick else 10.0
    server, url = _gunicorn(ctx, code, web)
    path = "/api/v1/jobs/batch/" if jobs_per_request > 1 else "/api/v1/jobs/"
    # Each gunicorn worker imports the URLconf, DRF and the schema code on its first
    # requests: warm them up so the figures (and CPU per request) are the steady state.
    _load(ctx, url + path, body, 0.5 if ctx.quick else 1.5, clients, threads)
    before = sql("SELECT coalesce(max(id), 0) FROM jobs_job")[0][0]
    profiler = Profiler(ctx.args.profile, [server], f"{name}-{code.label}")
    # CPU per request of the API's processes and their database backends: on a busy
    # machine, a steadier side-by-side figure than requests per second.
    web_pids = _children(server.pid)
    cpu0 = cpu_seconds(web_pids), cpu_seconds(backend_pids())
    got = _load(ctx, url + path, body, seconds, clients, threads)
    cpu1 = cpu_seconds(web_pids), cpu_seconds(backend_pids())
    profiler.stop()
    server.stop()
    created = sql(
        "SELECT count(*), min(created_at), max(created_at) FROM jobs_job WHERE id > %s", [before]
    )[0]
    ok = got["statuses"].get("201", 0)
    pct = percentiles(got["latencies"])
    jobs = ok * jobs_per_request
    db_span = (created[2] - created[1]).total_seconds() if created[0] > 1 else 0.0
    target = ">= 30,000 jobs/s" if jobs_per_request > 1 else ">= 1,000 jobs/s"
    return {
        "scenario": name,
        "code": code.label,
        "figure": f"HTTP POST {path} through gunicorn "
        f"({f'{web} workers' if web else 'its gunicorn.conf.py defaults'}), "
        f"{jobs_per_request} job(s) per request",
        "value": jobs / got["seconds"],
        "unit": "jobs/s",
        "target": target,
        "summary": f"{ok} x 201 in {got['seconds']:.2f}s ({ok / got['seconds']:,.0f} req/s), "
        f"statuses {got['statuses']}, {created[0]} rows; request latency "
        + (fmt_pcts(pct) if pct else "-")
        + f"; {clients}x{threads} client threads; CPU per request: gunicorn "
        f"{1000 * (cpu1[0] - cpu0[0]) / max(ok, 1):.2f} ms, PostgreSQL "
        f"{1000 * (cpu1[1] - cpu0[1]) / max(ok, 1):.2f} ms, the Python client itself "
        f"{1000 * got['client_cpu_seconds'] / max(ok, 1):.2f} ms",
        "details": {
            "requests_ok": ok,
            "client_cpu_ms_per_request": 1000 * got["client_cpu_seconds"] / max(ok, 1),
            "statuses": got["statuses"],
            "seconds": got["seconds"],
            "rows": created[0],
            "db_span_s": db_span,
            "latency_ms": pct,
            "web_concurrency": web,
            "client_threads": clients * threads,
            "gunicorn_cpu_ms_per_request": 1000 * (cpu1[0] - cpu0[0]) / max(ok, 1),
            "postgres_cpu_ms_per_request": 1000 * (cpu1[1] - cpu0[1]) / max(ok, 1),
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
    duration = f"-d{max(1, round(seconds))}s"
    argv = ["wrk", f"-t{threads}", f"-c{threads}", duration, "--latency", "-s", str(script), url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60).stdout
    done = re.search(r"(\d+) requests in", out)
    if done is None:
        raise RuntimeError(f"wrk did not run: {argv}\n{out}")
    requests = int(done.group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    latency = {
        f"p{p}": _ms(v, unit)
        for p, v, unit in re.findall(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s)$", out, re.M)
    }
    return {
        "requests": requests,
        "non_2xx": int(bad.group(1)) if bad else 0,
        "socket_errors": errors.group(1) if errors else None,
        "seconds": float(seconds),
        "latency": latency,
        "output": out,
    }


def _ms(value: str, unit: str) -> float:
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def single_wrk(ctx: Any) -> Iterator[dict]:
    """8 client threads of wrk (one connection each), each code's gunicorn in turn."""
    if shutil.which("wrk") is None:
        yield {
            "scenario": "http-single-wrk",
            "figure": "HTTP POST /api/v1/jobs/ through gunicorn, wrk",
            "value": None,
            "unit": "jobs/s",
            "note": "NOT MEASURED: wrk is not installed (Debian package wrk)",
        }
        return
    body = {"task": "echo", "payload": {"n": 1}}
    seconds = 2.0 if ctx.quick else 10.0
    web = ctx.args.web_concurrency
    workers = f"{web} workers" if web else "its gunicorn.conf.py defaults"
    for code in ctx.codes():
        server, url = _gunicorn(ctx, code, web)
        url += "/api/v1/jobs/"
        _wrk(ctx, url, body, 1 if ctx.quick else 2, 8)  # warm-up, as for `single` (whole s)
        before = sql("SELECT coalesce(max(id), 0) FROM jobs_job")[0][0]
        web_pids = _children(server.pid)
        cpu0 = cpu_seconds(web_pids), cpu_seconds(backend_pids())
        got = _wrk(ctx, url, body, seconds, 8)
        cpu1 = cpu_seconds(web_pids), cpu_seconds(backend_pids())
        server.stop()
        rows = sql("SELECT count(*) FROM jobs_job WHERE id > %s", [before])[0][0]
        ok = got["requests"] - got["non_2xx"]
        yield {
            "scenario": "http-single-wrk",
            "code": code.label,
            "figure": f"HTTP POST /api/v1/jobs/ through gunicorn ({workers}), "
            "1 job per request, load from wrk",
            "value": ok / got["seconds"],
            "unit": "jobs/s",
            "target": ">= 1,000 jobs/s",
            "summary": f"{got['requests']} requests ({got['non_2xx']} not 2xx, socket errors "
            f"{got['socket_errors'] or 'none'}), {rows} rows in {got['seconds']:.0f}s; latency "
            + ", ".join(f"{k} {v:.2f}ms" for k, v in got["latency"].items())
            + f"; wrk -t8 -c8; CPU per request: gunicorn "
            f"{1000 * (cpu1[0] - cpu0[0]) / max(ok, 1):.2f} ms, PostgreSQL "
            f"{1000 * (cpu1[1] - cpu0[1]) / max(ok, 1):.2f} ms",
            "details": {
                "requests": got["requests"],
                "non_2xx": got["non_2xx"],
                "rows": rows,
                "latency_ms": got["latency"],
                "gunicorn_cpu_ms_per_request": 1000 * (cpu1[0] - cpu0[0]) / max(ok, 1),
                "postgres_cpu_ms_per_request": 1000 * (cpu1[1] - cpu0[1]) / max(ok, 1),
            },
        }


def single(ctx: Any) -> Iterator[dict]:
    """8 client threads (2 processes x 4), each code's gunicorn in turn (baseline first)."""
    for code in ctx.codes():
        yield _run(ctx, code, "http-single", {"task": "echo", "payload": {"n": 1}}, 1, 2, 4)


def bulk(ctx: Any) -> Iterator[dict]:
    size = 1000
    body = {"jobs": [{"task": "echo", "payload": {"n": n}} for n in range(size)]}
    for code in ctx.codes():
        yield _run(ctx, code, "http-bulk", body, size, 1, 2)
