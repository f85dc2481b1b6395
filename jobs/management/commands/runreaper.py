"""manage.py runreaper — recover expired leases, parked and unsignalled jobs (SPEC §5)."""

from __future__ import annotations

import threading

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from jobs import metrics, replica
from jobs.collectors import (
    ConsumersCollector,
    DepthCollector,
    DurableHistoryCollector,
    PartitionCollector,
    QueueControlsCollector,
    WaitingCollector,
    WebhookCircuitsCollector,
    reaper_gauges,
    replica_gauges,
    scheduler_gauges,
)
from jobs.conf import settings
from jobs.events.lag import OutboxLagCollector
from jobs.events.outbox import dispatchers
from jobs.lifecycle import Status
from jobs.reaper import Reaper
from jobs.runtime import HEADLESS_CHECKS, add_metrics_arguments, start_metrics_server
from jobs.schedules.define import sync_periodic
from jobs.schedules.scheduler import Scheduler

RECOVERY_KINDS = (
    "worker_gone",
    "lease",
    Status.ENQUEUE_FAILED.value,  # the state it repairs
    "lost_signal",
    "scheduled",
    "over_budget",
)


class Command(BaseCommand):
    help = (
        "Run the reaper: requeue the jobs of gone workers, sweep for expired leases, "
        "enqueue_failed rows and lost signals; fire due schedules."
    )
    requires_system_checks = HEADLESS_CHECKS

    def add_arguments(self, parser):
        parser.add_argument(
            "--interval",
            type=float,
            default=None,
            help="Seconds between sweeps [JOBS_REAPER_INTERVAL, 5].",
        )
        parser.add_argument(
            "--lease",
            type=float,
            default=None,
            help="Seconds without heartbeat before a lease expires [JOBS_LEASE_SECONDS, 15].",
        )
        parser.add_argument("--batch", type=int, default=500, help="Rows per statement.")
        parser.add_argument("--once", action="store_true", help="Run one sweep and exit.")
        add_metrics_arguments(parser)

    def handle(self, *args, **opts):
        for name in ("interval", "lease"):
            if opts[name] is not None and opts[name] <= 0:
                raise CommandError(f"--{name} must be positive")
        if opts["batch"] < 1:
            raise CommandError("--batch must be at least 1")
        reaper = Reaper(interval=opts["interval"], lease=opts["lease"], batch=opts["batch"])
        try:
            outbox_dispatchers = dispatchers()
        except ImproperlyConfigured as exc:  # JOBS_KAFKA_CONFIG
            raise CommandError(str(exc)) from exc
        sync_periodic()
        scheduler = Scheduler()  # every reaper fires schedules (docs/schedules.md)
        if opts["once"]:
            scheduler.tick()
            report = reaper.sweep()
            self.stdout.write(
                f"sweep in {report.seconds:.3f}s: {report.worker_gone} job(s) of gone "
                f"workers requeued, {report.lease_requeued} requeued and "
                f"{report.lease_failed} failed (expired lease), {report.repaired} repaired, "
                f"{report.over_budget} over budget, {report.came_due} came due, "
                f"{report.lost_signal} re-signalled"
            )
            return
        if opts["metrics_port"]:
            from prometheus_client import REGISTRY

            # Depth and age by state come from the reaper only: one cached query per
            # deployment instead of one per process and scrape.
            depth = DepthCollector()
            REGISTRY.register(depth)
            REGISTRY.register(ConsumersCollector(depth))
            REGISTRY.register(QueueControlsCollector())
            REGISTRY.register(WaitingCollector(depth))  # parked and blocked jobs by reason
            REGISTRY.register(DurableHistoryCollector())  # the largest live durable history
            REGISTRY.register(WebhookCircuitsCollector())
            REGISTRY.register(PartitionCollector())  # hot rows, mover lag, runway
            REGISTRY.register(reaper_gauges(reaper))
            REGISTRY.register(scheduler_gauges(scheduler))
            REGISTRY.register(
                OutboxLagCollector([n for d in outbox_dispatchers for n in d.cursor_names])
            )
            if replica.configured():
                REGISTRY.register(replica_gauges())  # jobs_replica_lag_seconds
            for kind in RECOVERY_KINDS:  # every kind shows 0 before its first repair
                metrics.RECOVERED.labels(kind)
        # Handlers first: whoever sees the metrics answer may already send SIGTERM.
        reaper.install_signal_handlers()
        start_metrics_server(opts["metrics_port"], opts["metrics_host"])
        scheduler.start(reaper.stop)
        # The outbox dispatchers (completion events, docs/events.md) tick beside the sweeps.
        for dispatcher in outbox_dispatchers:
            threading.Thread(target=dispatcher.run, args=(reaper.stop,), daemon=True).start()
        if settings.LOG_FORMAT != "json":  # else "reaper started" is logged as JSON
            self.stdout.write(f"reaper: lease {reaper.lease}s, interval {reaper.interval}s")
        reaper.run()
