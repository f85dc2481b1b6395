"""`python -m bench [--scenario NAME ...] [--quick] [--baseline REF]`.

Starts real processes (runworker, runreaper, gunicorn) on a scratch database and a
private redis-server, measures each scenario with database timestamps where the
database has them, prints the figure with the exact command that produced it, and
appends JSON lines to bench/results/. It reports; it never asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

# scaling, fillfactor, table_growth and webhooks register their scenarios when imported.
from bench import fillfactor, scaling, scenarios, table_growth, variants, webhooks  # noqa: F401
from bench.env import Code, processes, scratch_database, setup_django
from harness import ROOT, PgBouncer, RedisServer

RESULTS = ROOT / "bench" / "results"


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return out.stdout.strip()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument(
        "--scenario",
        action="append",
        choices=list(scenarios.ALL),
        help="Run only these (repeatable). Default: all.",
    )
    p.add_argument("--quick", action="store_true", help="Tiny sizes: a smoke test, not a figure.")
    p.add_argument(
        "--baseline",
        metavar="REF",
        help="Also run the worker scenarios with the workers of git REF, side by side.",
    )
    p.add_argument(
        "--variant",
        action="append",
        choices=list(variants.VARIANTS),
        help="Database variants to measure side by side in drain, latency, drain-sinks and "
        "the HTTP submissions (repeatable).",
    )
    p.add_argument("--repeat", type=int, default=1, help="Run each measurement this many times.")
    p.add_argument("--jobs", type=int, help="Jobs per drain run (default 20000; quick 300).")
    p.add_argument(
        "--concurrency", type=int, default=None, help="runworker --concurrency for the drains."
    )
    p.add_argument("--worker-args", default="", help="Extra runworker arguments for the drains.")
    p.add_argument(
        "--claimers", type=int, default=None, help="Claim-latency processes (default 16)."
    )
    p.add_argument(
        "--finished-rows",
        type=int,
        default=1_000_000,
        help="Finished rows in the table for claim-big (default 1,000,000).",
    )
    p.add_argument(
        "--lease",
        type=float,
        default=None,
        help="Recovery with this JOBS_LEASE_SECONDS (and reaper interval lease/4), "
        "labelled as a short lease; default: the service defaults (15 s / 5 s).",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="Attach py-spy to the drain workers; raw stacks go to DIR.",
    )
    p.add_argument(
        "--web-concurrency",
        type=int,
        default=None,
        help="API server worker processes for the HTTP scenarios (default: each tree's own).",
    )
    p.add_argument(
        "--server",
        action="append",
        metavar="LABEL[:VAR=VALUE,...]",
        help="An API server setup for the HTTP scenarios, measured side by side in this run "
        "(repeatable), e.g. 'gthread:JOBS_HTTP_SERVER=gunicorn,WEB_WORKER_CLASS=gthread'. "
        "Default: the tree's own default server.",
    )
    p.add_argument(
        "--pgbouncer",
        action="store_true",
        help="Run the stack's processes through a PgBouncer of the bench's own (transaction "
        "mode; presence sessions direct, JOBS_DIRECT_DATABASE_URL).",
    )
    p.add_argument(
        "--growth-jobs",
        type=int,
        default=None,
        help="Jobs per layout for table-growth (default 50,000,000; quick 20,000).",
    )
    p.add_argument(
        "--growth-layout",
        action="append",
        choices=["today", "partitioned"],
        help="Only this layout in table-growth (repeatable; default both, in turn).",
    )
    p.add_argument(
        "--webhook-receiver",
        action="append",
        choices=["fast", "failing"],
        help="Only this receiver in webhook-throughput (repeatable; default both).",
    )
    p.add_argument(
        "--receiver-in-bench",
        action="store_true",
        help="The webhook scenarios' receiver as an http.server thread of the bench's own "
        "process (the receiver before 0.3.6) instead of a process of its own.",
    )
    p.add_argument(
        "--deliveries-after-sinks",
        action="store_true",
        help="drain-sinks with the drain's workers on the default queue only and a webhooks "
        "worker started once every cursor has passed the last event: the sinks' lag without "
        "the deliveries' work beside the relays.",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON lines file to append to.")
    p.add_argument("--keep-db", action="store_true", help="Do not drop the scratch database.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    names = args.scenario or scenarios.default_names(args.quick)
    RESULTS.mkdir(parents=True, exist_ok=True)
    run_id = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + f"-{os.getpid()}"
    out = args.out or RESULTS / f"{run_id}.jsonl"
    meta = {
        "run": run_id,
        "git": _git("rev-parse", "--short", "HEAD")
        + ("+dirty" if _git("status", "--porcelain") else ""),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "quick": args.quick,
    }
    db = scratch_database().create()
    redis = RedisServer().start()
    logdir = Path(tempfile.mkdtemp(prefix="jobservice-bench-logs-"))
    code = Code()
    bouncer = None
    baseline = Code(args.baseline) if args.baseline else None
    print(f"bench {run_id}: database {db.name}, redis {redis.url}, logs {logdir}", flush=True)
    try:
        setup_django(db.url(), redis.url)
        procs = processes(db.url(), redis.url, logdir)
        if args.pgbouncer:
            bouncer = PgBouncer(db.admin_url).start()
            procs.env.update(DATABASE_URL=bouncer.url(db.url()), JOBS_DIRECT_DATABASE_URL=db.url())
            meta["pgbouncer"] = True
        ctx = scenarios.Context(args, db, redis, procs, code, baseline, logdir)
        summary: list[dict] = []
        with open(out, "a") as fh:
            for name in names:
                for record in scenarios.run(name, ctx):
                    record = {**meta, **record, "at": datetime.now(UTC).isoformat()}
                    record["command"] = command_for(name, args, record)
                    fh.write(json.dumps(record, default=str) + "\n")
                    fh.flush()
                    print(format_record(record), flush=True)
                    summary.append(record)
                procs.stop_all()
        print(format_summary(summary))
    finally:
        try:
            from django.db import connections

            connections.close_all()
        except Exception:
            pass
        redis.stop()
        if bouncer is not None:
            bouncer.stop()
        if not args.keep_db:
            db.drop()
        code.close()
        if baseline:
            baseline.close()
    print(f"results: {out}")
    return 0


def command_for(name: str, args: argparse.Namespace, record: dict) -> str:
    """The command that reproduces this figure (the options that shaped it)."""
    parts = ["python", "-m", "bench", "--scenario", name]
    if args.quick:
        parts.append("--quick")
    for opt in ("jobs", "concurrency", "claimers", "lease", "repeat", "web_concurrency"):
        value = getattr(args, opt)
        if value is not None and not (opt == "repeat" and value == 1):
            parts += [f"--{opt.replace('_', '-')}", str(value)]
    if args.worker_args:
        parts += ["--worker-args", args.worker_args]
    if name == "table-growth" and args.growth_jobs:
        parts += ["--growth-jobs", str(args.growth_jobs)]
    if name == "table-growth":
        for layout in args.growth_layout or []:
            parts += ["--growth-layout", layout]
    if name == "webhook-throughput":
        for receiver in args.webhook_receiver or []:
            parts += ["--webhook-receiver", receiver]
    if name in ("webhook-throughput", "drain-sinks") and args.receiver_in_bench:
        parts.append("--receiver-in-bench")
    if name == "drain-sinks" and args.deliveries_after_sinks:
        parts.append("--deliveries-after-sinks")
    if name == "claim-big":
        parts += ["--finished-rows", str(args.finished_rows)]
    if args.baseline:
        parts += ["--baseline", args.baseline]
    if args.pgbouncer:
        parts.append("--pgbouncer")
    if os.environ.get("DB_PREPARED_STATEMENTS"):
        parts.insert(0, f"DB_PREPARED_STATEMENTS={os.environ['DB_PREPARED_STATEMENTS']}")
    for v in args.variant or []:
        parts += ["--variant", v]
    if name.startswith("http"):
        for server in args.server or []:
            parts += ["--server", server]
    return shlex.join(parts)


def format_summary(records: list[dict]) -> str:
    """One line per figure, in scenario order: the default worker next to the tuned one,
    the single HTTP submission next to the batch endpoint, each code side by side."""
    lines = ["summary (figure: value [code], load average at start):"]
    for r in beside_the_drains(records):
        value = r.get("value")
        shown = "NOT MEASURED" if value is None else f"{value:,.2f} {r.get('unit', '')}"
        load = (r.get("loadavg_1m") or ["?"])[0]
        line = f"  {r['scenario']:<16} {shown:>18}  [{r.get('code', '')}]  load {load}"
        lines.append(line + (f"\n      {r['brief']}" if r.get("brief") else ""))
    return "\n".join(lines)


def beside_the_drains(records: list[dict]) -> list[dict]:
    """drain-sinks' figures right after the drains' (issue 41: each sink's lag is read
    beside the drain rate)."""
    sinks = [r for r in records if r["scenario"] == "drain-sinks"]
    rest = [r for r in records if r["scenario"] != "drain-sinks"]
    drains = [i for i, r in enumerate(rest) if r["scenario"].startswith("drain")]
    at = drains[-1] + 1 if drains else len(rest)
    return rest[:at] + sinks + rest[at:]


def format_record(r: dict) -> str:
    value = r.get("value")
    shown = "NOT MEASURED" if value is None else f"{value:,.2f} {r.get('unit', '')}"
    code = f" [{r['code']}]" if r.get("code") else ""
    line = f"{r['scenario']:<14}{code} {r['figure']}: {shown}"
    if r.get("target"):
        line += f"  (target {r['target']})"
    extra = r.get("summary")
    if extra:
        line += f"\n    {extra}"
    if r.get("note"):
        line += f"\n    note: {r['note']}"
    return line + f"\n    $ {r['command']}"


if __name__ == "__main__":
    sys.exit(main())
