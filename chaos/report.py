"""The one-screen report, and what the history shows the faults actually did."""

from __future__ import annotations

import textwrap
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from chaos.checks import Latency, Violation, permanent_reason
from chaos.faults import Fault
from chaos.profiles import Profile

SHOWN_PER_CHECK = 5


def observed(conn: Any) -> Counter[str]:
    """Recoveries recorded in the history: proof that the faults had teeth."""
    with conn.cursor() as cur:
        cur.execute(
            """SELECT
                 count(*) FILTER (WHERE kind = 'fence_rejected'),
                 count(*) FILTER (WHERE from_status = 'processing' AND actor = 'reaper'
                                    AND to_status = 'queued'),
                 count(*) FILTER (WHERE from_status = 'processing' AND actor = 'reaper'
                                    AND to_status = 'failed'),
                 count(*) FILTER (WHERE to_status = 'enqueue_failed'),
                 count(*) FILTER (WHERE from_status = 'enqueue_failed' AND to_status = 'queued'),
                 count(*) FILTER (WHERE from_status = 'processing' AND to_status = 'queued'
                                    AND actor LIKE 'worker:%%'
                                    AND error NOT LIKE 'released by%%'),
                 count(*) FILTER (WHERE from_status = 'processing' AND to_status = 'queued'
                                    AND error LIKE 'released by%%'),
                 count(*) FILTER (WHERE from_status IN ('queued', 'enqueue_failed')
                                    AND to_status = 'failed' AND actor = 'reaper'),
                 count(*) FILTER (WHERE to_status = 'processing')
               FROM jobs_jobevent"""
        )
        row = cur.fetchone()
        # Durable steps and workflows: checkpoints written, jobs that resumed from a
        # checkpoint under a later lease, workflows run, children failed by a parent.
        cur.execute(
            """SELECT (SELECT count(*) FROM jobs_jobstep),
                      (SELECT count(DISTINCT s.job_id) FROM jobs_jobstep s
                       JOIN jobs_jobstep t ON t.job_id = s.job_id
                        AND t.lease_version > s.lease_version),
                      (SELECT count(*) FROM jobs_workflow),
                      (SELECT count(*) FROM jobs_jobstep WHERE name LIKE '~sleep:%%'),
                      (SELECT count(*) FROM jobs_job WHERE error LIKE 'dependency failed:%%'),
                      (SELECT count(*) FROM jobs_jobevent
                       WHERE error LIKE 'worker child exited:%%'),
                      (SELECT count(*) FROM jobs_job WHERE sequence_key IS NOT NULL)"""
        )
        row = (*row, *cur.fetchone())
    names = [
        "fence_rejected",  # stale writes turned away by the fence
        "lease_expired_requeued",  # reaper: processing → queued
        "lease_expired_failed",  # reaper: processing → failed, budget spent
        "parked_enqueue_failed",  # API: push failed after commit
        "repaired",  # reaper: enqueue_failed → queued
        "retried",  # worker: failed attempt, budget left
        "released",  # worker: graceful stop
        "over_budget_failed",  # reaper: queued/enqueue_failed → failed
        "claims",
        "step_checkpoints",
        "steps_resumed_after_recovery",
        "workflows",
        "parked_sleeps",
        "dependency_failed",
        "child_deaths",  # attempts a process-pool child died under (chaos.die)
        "sequence_jobs",  # jobs of a sequence_key (jobs.flow): one at a time, in order
    ]
    return Counter(dict(zip(names, (int(x) for x in row), strict=True)))


def failure_reasons(conn: Any) -> Counter[str]:
    with conn.cursor() as cur:
        cur.execute("SELECT error, retry_count > max_retries FROM jobs_job WHERE status = 'failed'")
        rows = cur.fetchall()
    out: Counter[str] = Counter()
    for error, spent in rows:
        out["budget spent" if spent else (permanent_reason(error) or "UNEXPLAINED")] += 1
    return out


@dataclass
class RunResult:
    profile: Profile
    seed: int
    schedule: list[Fault]
    violations: dict[str, list[Violation]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    latency: Latency | None = None
    client: Counter[str] = field(default_factory=Counter)
    injected: Counter[str] = field(default_factory=Counter)
    fault_notes: Counter[str] = field(default_factory=Counter)
    observed: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    sources: Counter[str] = field(default_factory=Counter)
    rows: int = 0
    submitted: int = 0
    load_seconds: float = 0.0
    drain_seconds: float = 0.0
    drained: bool = False
    wall_seconds: float = 0.0
    logdir: str = ""

    @property
    def accepted(self) -> int:
        return sum(self.sources.values())

    @property
    def ok(self) -> bool:
        return not self.problems and not any(self.violations.values())


def replay_command(r: RunResult) -> str:
    p = r.profile
    return (
        f"python -m chaos --profile {p.name} --seed {r.seed} "
        f"--duration {p.duration:g} --rate {p.rate:g}"
    )


def _counts(c: Counter[str], ordered: bool = False) -> str:
    items = c.items() if ordered else sorted(c.items())
    return ", ".join(f"{k} {v}" for k, v in items) or "none"


def _wrapped(label: str, text: str) -> list[str]:
    """`label` then text wrapped to 100 columns, continuation lines indented."""
    return textwrap.wrap(
        text, width=100, initial_indent=f"{label:<10}", subsequent_indent=" " * 10,
        break_on_hyphens=False,
    )  # fmt: skip


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


def render(r: RunResult) -> str:
    p = r.profile
    lines = [
        "",
        f"=== fault suite report: profile {p.name}, seed {r.seed} ===",
        f"replay:   {replay_command(r)}",
        f"timings:  lease {p.lease:g}s, reaper every {p.reaper_interval:g}s, lost-signal "
        f"{p.lost_signal:g}s, backoff base {p.backoff_base:g}s; {p.workers} workers x "
        f"{p.concurrency}, {p.reapers} reapers, {p.api_processes} API processes",
        f"wall:     {r.wall_seconds:.0f}s (load {r.load_seconds:.0f}s, drain "
        f"{r.drain_seconds:.1f}s{'' if r.drained else ' - DID NOT DRAIN'})",
        f"jobs:     {r.accepted} accepted ({_counts(r.sources)}), {r.rows} rows in the database; "
        f"{r.submitted} submissions paced at {r.submitted / max(r.load_seconds, 1):.1f}/s",
    ]
    lines += _wrapped("client:", _counts(r.client))
    lines += _wrapped("faults:", f"{sum(r.injected.values())} injected: {_counts(r.injected)}")
    if r.fault_notes:
        lines += _wrapped("", _counts(r.fault_notes))
    lines += _wrapped("history:", _counts(r.observed, ordered=True))
    if r.latency is not None:
        lat = r.latency
        share = lat.share_within_slo
        lines += _wrapped(
            "outcome:",
            f"done {lat.done}, failed {lat.failed} ({_counts(r.failures)}); "
            f"success rate {lat.done / max(lat.terminal, 1):.1%}",
        )
        lines.append(
            f"latency:  submission -> terminal p50 {_s(lat.p50)}, p95 {_s(lat.p95)}, "
            f"p99 {_s(lat.p99)}, max {_s(lat.max)}; "
            f"{'-' if share is None else f'{share:.2%}'} within {lat.slo_seconds:g}s"
            + (f" (required >= {p.slo_share:.0%})" if p.enforce_slo else " (reported)")
        )
    lines.append("invariants:")
    for name, found in r.violations.items():
        lines.append(f"  {'PASS' if not found else 'FAIL'}  {name}" + (
            f" ({len(found)} violations)" if found else ""))  # fmt: skip
        for v in found[:SHOWN_PER_CHECK]:
            lines.append(f"        {v}")
    if r.problems:
        lines.append(f"problems ({len(r.problems)}):")
        lines += [f"  - {x}" for x in r.problems[:10]]
    if not r.ok:
        lines.append(f"logs:     {r.logdir}")
    lines.append(f"RESULT:   {'PASS' if r.ok else 'FAIL'}")
    return "\n".join(lines)
