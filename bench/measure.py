"""What the scenarios measure with: SQL on the scratch database, percentiles, CPU time
from /proc, client processes released together, and py-spy attached to processes
(--profile)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import ROOT


def sql(query: str, params: Any = None) -> list[tuple]:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(query, params)
        return cur.fetchall() if cur.description else []


def hot_table() -> str:
    """The table live jobs are written in: the hot partition once jobs_job is partitioned."""
    return "jobs_job_hot" if sql("SELECT to_regclass('jobs_job_hot')")[0][0] else "jobs_job"


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)

    def rank(p: float) -> float:
        return s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))]

    return {
        "n": len(s),
        "p50": rank(50),
        "p90": rank(90),
        "p95": rank(95),
        "p99": rank(99),
        "max": s[-1],
        "mean": statistics.fmean(s),
    }


def fmt_pcts(p: dict[str, float], unit: str = "ms") -> str:
    return ", ".join(f"{k} {v:.2f}{unit}" for k, v in p.items() if k != "n") + f" (n={p['n']})"


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User+system CPU of these processes (and their threads) so far, from /proc."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += int(fields[11]) + int(fields[12])
    return total / _TICK


def backend_pids() -> list[int]:
    """PostgreSQL backends connected to the scratch database (same machine)."""
    return [
        r[0]
        for r in sql(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        )
    ]


class Profiler:
    """py-spy attached to worker processes for the length of a measurement (--profile)."""

    def __init__(self, directory: Path | None, procs: list, label: str) -> None:
        self.runs = []
        self.dir = directory
        if not self.dir:
            return
        spy = Path(sys.executable).parent / "py-spy"
        self.dir.mkdir(parents=True, exist_ok=True)
        for n, p in enumerate(procs):
            out = self.dir / f"{label}-{n}.txt"
            self.runs.append(
                (
                    out,
                    subprocess.Popen(
                        [
                            str(spy),
                            "record",
                            "--pid",
                            str(p.pid),
                            "--rate",
                            "250",
                            "--format",
                            "raw",
                            "--threads",
                            "--gil",
                            "--nonblocking",
                            "--subprocesses",
                            "-o",
                            str(out),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    ),
                )
            )
        time.sleep(1.0)  # py-spy attaches

    def stop(self) -> list[str]:
        for _, proc in self.runs:
            proc.send_signal(signal.SIGINT)
        for _, proc in self.runs:
            proc.wait(30)
        return [str(out) for out, _ in self.runs]


def released_together(
    argv: list[str], count: int, timeout: float, env: dict[str, str] | None = None
) -> list[dict]:
    """Run `count` client processes that each print "ready" and wait for a line on stdin;
    release them all at once, and return each one's last output line, parsed as JSON.

    The clients' start-up is kept out of the measurement, and they all measure the same
    moment.
    """
    procs = [
        subprocess.Popen(
            argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(count)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    docs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        docs.append(json.loads(out.strip().splitlines()[-1]))
    return docs
