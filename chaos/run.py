"""One fault-suite run: set up, load and hurt the stack, heal, drain, check, report."""

from __future__ import annotations

import logging
import os
import random
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable

from chaos import checks
from chaos.faults import Injector, plan
from chaos.load import LoadGenerator
from chaos.profiles import Profile
from chaos.report import RunResult, failure_reasons, observed, render, replay_command
from chaos.stack import Stack
from harness import DEFAULT_ADMIN_URL, ROOT, ScratchDatabase, checkout_tag

log = logging.getLogger("chaos")


def _count_unfinished(db: ScratchDatabase) -> tuple[int, int]:
    with db.connect("chaos-harness", autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE status NOT IN ('done', 'failed')), count(*) "
            "FROM jobs_job"
        ).fetchone()
    return int(row[0]), int(row[1])


def run(
    profile: Profile,
    seed: int,
    *,
    admin_url: str = DEFAULT_ADMIN_URL,
    keep: bool = False,
    echo: Callable[[str], None] = print,
) -> RunResult:
    """Run the fault suite once; the result says whether every invariant held."""
    started = time.monotonic()
    schedule = plan(seed, profile)
    result = RunResult(profile, seed, schedule)
    db = ScratchDatabase("chaos", admin_url)
    logdir = ROOT / "var" / "chaos" / db.name
    logdir.mkdir(parents=True, exist_ok=True)
    result.logdir = str(logdir)
    echo(profile.describe())
    echo(f"seed {seed}; replay with: {replay_command(result)}")
    echo(f"fault schedule ({len(schedule)} faults):")
    for f in schedule:
        echo(f"  {f.describe()}")
    for stale in db.drop_stale():
        echo(f"dropped leftover database {stale}")
    db.create()
    echo(f"scratch database {db.name}; logs in {logdir}")
    stack = Stack(profile, db, logdir)
    load: LoadGenerator | None = None
    injector: Injector | None = None
    try:
        stack.migrate()
        token = stack.create_client(f"chaos-{seed}")
        stack.start()
        tag = f"{checkout_tag()}-{os.getpid()}-{seed}"
        load = LoadGenerator(stack.api_port, token, profile, random.Random(seed), tag)
        injector = Injector(schedule, stack, load, seed)
        echo(f"stack up in {time.monotonic() - started:.0f}s; load and faults for "
             f"{profile.duration:g}s")  # fmt: skip
        load.start()
        injector.start()
        t0 = time.monotonic()
        every = max(10.0, profile.duration / 10)
        next_progress = t0 + every
        while time.monotonic() - t0 < profile.duration or (
            # A fixed number of jobs: keep going (faults over) until all were submitted.
            profile.max_jobs is not None
            and not load.all_sent()
            and time.monotonic() - t0 < 2 * profile.duration + 60
        ):
            time.sleep(0.5)
            stack.watch()
            if time.monotonic() >= next_progress:
                next_progress += every
                unfinished, rows = _count_unfinished(db)
                echo(f"  +{time.monotonic() - t0:4.0f}s submitted {load.sent}, accepted "
                     f"{len(load.accepted)}, rows {rows}, unfinished {unfinished}, faults "
                     f"{sum(injector.injected.values())}")  # fmt: skip
        injector.stop()
        load.stop()
        result.load_seconds = time.monotonic() - t0
        stack.heal()
        # Drain: everything up, no more faults; every row must reach done or failed.
        d0 = time.monotonic()
        while True:
            stack.watch()
            unfinished, rows = _count_unfinished(db)
            if unfinished == 0:
                result.drained = True
                break
            if time.monotonic() - d0 > profile.drain_timeout:
                break
            time.sleep(0.5)
        result.drain_seconds = time.monotonic() - d0
        echo(f"drain: {'all terminal' if result.drained else f'{unfinished} unfinished'} "
             f"after {result.drain_seconds:.1f}s")  # fmt: skip
        stack.shutdown()
        # Checks, on one consistent snapshot of a database nobody writes any more.
        accepted = set(load.accepted)
        with db.connect("chaos-harness") as conn:
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            result.violations = checks.run_all(conn, accepted)
            result.latency = checks.latency(conn, accepted, profile.slo_seconds)
            result.observed = observed(conn)
            result.failures = failure_reasons(conn)
            result.rows = conn.execute("SELECT count(*) FROM jobs_job").fetchone()[0]
        if profile.enforce_slo:
            share = result.latency.share_within_slo or 0.0
            result.violations["slo"] = (
                []
                if share >= profile.slo_share
                else [
                    checks.Violation(
                        "slo",
                        None,
                        f"{share:.2%} of jobs terminal within {profile.slo_seconds:g}s, "
                        f"required {profile.slo_share:.0%}",
                    )
                ]
            )
        result.client = Counter(load.stats)
        result.sources = Counter(a.source for a in load.accepted.values())
        result.submitted = load.sent
        result.injected = Counter(injector.injected)
        result.fault_notes = Counter(injector.notes)
        result.problems = [*load.problems, *stack.unexpected_exits, *injector.errors]
    except BaseException as exc:
        result.problems.append(f"harness error: {exc.__class__.__name__}: {exc}")
        raise
    finally:
        if injector is not None and injector.is_alive():
            injector.stop()
        if load is not None:
            load.stop(timeout=5)
        stack.shutdown()
        result.wall_seconds = time.monotonic() - started
        if not keep:
            try:
                db.drop()
            except Exception as exc:  # a leftover is dropped by the next run (drop_stale)
                echo(f"could not drop {db.name}: {exc}")
            if result.ok:
                shutil.rmtree(logdir, ignore_errors=True)
        else:
            echo(f"kept database {db.name} and logs in {logdir}")
    echo(render(result))
    sys.stdout.flush()
    return result
