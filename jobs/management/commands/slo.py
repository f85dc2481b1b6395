"""manage.py slo — share of jobs terminal within the SLO over a window (SPEC §6)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from jobs import replica
from jobs.conf import settings
from jobs.selectors import slo_report

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: str) -> float:
    """'90s', '15m', '1h', '7d' → seconds."""
    value = value.strip().lower()
    try:
        if value and value[-1] in UNITS:
            seconds = float(value[:-1]) * UNITS[value[-1]]
        else:
            seconds = float(value)
    except ValueError:
        raise CommandError(f"not a duration: {value!r} (use e.g. 90s, 15m, 1h, 7d)") from None
    if seconds <= 0:
        raise CommandError("a duration must be positive")
    return seconds


class Command(BaseCommand):
    help = (
        "Report due→terminal latency (from submission, or run_at when later) and SLO "
        "attainment over a window."
    )

    def add_arguments(self, parser):
        parser.add_argument("--window", default="1h", help="e.g. 15m, 1h, 1d [1h]")
        parser.add_argument(
            "--slo", type=float, default=None, help="SLO in seconds [JOBS_SLO_SECONDS, 25]"
        )

    def handle(self, *args, **opts):
        window = parse_duration(opts["window"])
        slo = opts["slo"] or settings.JOBS_SLO_SECONDS
        with replica.reads():  # a report reads the replica when one is usable
            r = slo_report(window, slo)
        if not r.terminal:
            self.stdout.write(f"no job reached a terminal state in the last {opts['window']}")
            return

        def fmt(x):
            return "-" if x is None else f"{x:.3f}s"

        self.stdout.write(
            f"window {opts['window']}: {r.terminal} terminal ({r.done} done, {r.failed} failed)\n"
            f"SLO: {r.attainment:.2%} terminal within {slo:g}s (target 95%)\n"
            f"success rate: {r.success_rate:.2%}\n"
            f"due→terminal p50 {fmt(r.p50)} p95 {fmt(r.p95)} p99 {fmt(r.p99)}"
        )
