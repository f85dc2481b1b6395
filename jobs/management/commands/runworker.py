"""manage.py runworker — run jobs until stopped (SPEC §9)."""

from __future__ import annotations

import os
import sys

from django.conf import settings as django_settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from jobs import deliveries, dispatch, queuecontrol, reloading
from jobs.collectors import worker_gauges
from jobs.conf import settings
from jobs.dispatch import QueueSpec
from jobs.runtime import HEADLESS_CHECKS, add_metrics_arguments, start_metrics_server
from jobs.worker import MAX_PREFETCH, Worker
from jobs.worker.pools import DEFAULT_CONCURRENCY, POOLS


def parse_queues(value: str) -> QueueSpec:
    try:
        return dispatch.parse_queues(value)
    except dispatch.QueueSpecError as exc:
        raise CommandError(f"--queues: {exc}") from exc


class Command(BaseCommand):
    help = "Run a worker: claim jobs from PostgreSQL (woken by Redis) and run them."
    requires_system_checks = HEADLESS_CHECKS

    def add_arguments(self, parser):
        parser.add_argument(
            "--concurrency",
            type=int,
            default=None,
            help="Jobs run at once: handler threads, or child processes with --pool "
            "processes [{threads} threads; {processes} processes].".format(**DEFAULT_CONCURRENCY),
        )
        parser.add_argument(
            "--queues",
            default="default,webhooks",
            help="Queues to serve, as name[:weight],... ('*' serves every queue; "
            "'webhooks' is the built-in queue of webhook deliveries). "
            "Each poll visits the queues in a random order weighted by weight; "
            "without weights, earlier queues weigh more (n, n-1, ..., 1) [%(default)s].",
        )
        parser.add_argument("--burst", action="store_true", help="Exit once no work is left.")
        parser.add_argument(
            "--max-jobs",
            type=int,
            default=None,
            help="Exit after claiming this many jobs [no limit].",
        )
        parser.add_argument(
            "--grace",
            type=float,
            default=10.0,
            help="Seconds running jobs get to finish on the first signal [%(default)s].",
        )
        parser.add_argument(
            "--poll-interval",
            type=float,
            default=1.0,
            help="Seconds of Redis silence before claiming from Postgres [%(default)s].",
        )
        parser.add_argument(
            "--flush-interval",
            type=float,
            default=0.0,
            help="Seconds the flusher waits to gather more results per write "
            "(0: write whatever finished while the previous write ran) [%(default)s].",
        )
        parser.add_argument(
            "--prefetch",
            type=int,
            default=None,
            help="Most jobs held claimed, running ones included (never fewer than "
            "--concurrency): short jobs are claimed ahead up to what the threads finish "
            "within 1/15 of the lease, long jobs one per free thread; 0 claims only for "
            "free threads [JOBS_WORKER_PREFETCH, 128].",
        )
        parser.add_argument(
            "--webhook-concurrency",
            type=int,
            default=None,
            help="Threads of this process's own webhook delivery worker, apart from "
            "--concurrency, when it serves 'webhooks' besides other queues "
            "[JOBS_WEBHOOK_CONCURRENCY, 4].",
        )
        parser.add_argument(
            "--pool",
            choices=POOLS,
            default="threads",
            help="Where handlers run: threads of this process, or pre-forked child "
            "processes, one job per child at a time (CPU-bound or leaky handlers, "
            "handlers that must be killable; docs/pools.md) [%(default)s].",
        )
        parser.add_argument(
            "--max-tasks-per-child",
            type=int,
            default=0,
            help="--pool processes: replace a child after this many jobs (0: never) [%(default)s].",
        )
        parser.add_argument(
            "--max-memory-per-child",
            type=int,
            default=0,
            metavar="MB",
            help="--pool processes: replace a child once its resident memory after a job "
            "exceeds this many MB (0: never) [%(default)s].",
        )
        parser.add_argument(
            "--reload",
            action="store_true",
            help="Development: restart the worker (warm: running jobs finish, the rest are "
            "released) when a Python file changes; refused when DEBUG is off.",
        )
        parser.add_argument(
            "--force-reload",
            action="store_true",
            help="With --reload: reload even though DEBUG is off.",
        )
        add_metrics_arguments(parser)

    def handle(self, *args, **opts):
        if connection.in_atomic_block:
            # A TestCase's transaction: the worker's threads have sessions of their own,
            # which cannot see its rows, and closing the caller's would end the test's.
            raise CommandError(
                "runworker cannot run inside a transaction (a TestCase's): its threads "
                "cannot see uncommitted jobs. Use jobs.testing.run_jobs(), or a "
                "TransactionTestCase (docs/testing.md)"
            )
        if opts["concurrency"] is not None and opts["concurrency"] < 1:  # None: the pool's default
            raise CommandError("--concurrency must be at least 1")
        if not 0 <= opts["flush_interval"] <= 5:
            raise CommandError("--flush-interval must be between 0 and 5 seconds")
        if opts["prefetch"] is not None and not 0 <= opts["prefetch"] <= MAX_PREFETCH:
            raise CommandError(f"--prefetch must be between 0 and {MAX_PREFETCH}")
        if opts["max_jobs"] is not None and opts["max_jobs"] < 1:
            raise CommandError("--max-jobs must be at least 1")
        for name in ("max_tasks_per_child", "max_memory_per_child"):
            flag = "--" + name.replace("_", "-")
            if opts[name] < 0:
                raise CommandError(f"{flag} must be at least 0 (0: never)")
            if opts[name] and opts["pool"] != "processes":
                raise CommandError(f"{flag} applies to --pool processes only")
        webhook_concurrency = opts["webhook_concurrency"]
        if webhook_concurrency is None:
            webhook_concurrency = settings.JOBS_WEBHOOK_CONCURRENCY
        if webhook_concurrency < 1:
            raise CommandError("--webhook-concurrency must be at least 1")
        spec, own_deliveries = deliveries.split(parse_queues(opts["queues"]))
        if opts["force_reload"] and not opts["reload"]:
            raise CommandError("--force-reload applies to --reload only")
        if opts["reload"]:
            if opts["burst"] or opts["max_jobs"] is not None:
                raise CommandError("--reload serves until stopped: not with --burst or --max-jobs")
            if not django_settings.DEBUG and not opts["force_reload"]:
                raise CommandError(
                    "--reload is for development and DEBUG is off; add --force-reload to "
                    "reload anyway"
                )
            if not reloading.in_child():
                # This process only restarts the one that serves (D229).
                raise SystemExit(reloading.supervise())
        queuecontrol.sync()  # JOBS_QUEUES changes a deployment made reach the Queue rows
        worker = Worker(
            spec,
            opts["concurrency"],
            burst=opts["burst"],
            max_jobs=opts["max_jobs"],
            grace=opts["grace"],
            poll_interval=opts["poll_interval"],
            flush_interval=opts["flush_interval"],
            prefetch=opts["prefetch"],
            pool=opts["pool"],
            max_tasks_per_child=opts["max_tasks_per_child"],
            max_memory_per_child=opts["max_memory_per_child"],
        )
        runner: Worker | deliveries.Pair = worker
        if own_deliveries:
            own = deliveries.delivery_worker(worker, webhook_concurrency)
            runner = deliveries.Pair(worker, own)
        # Handlers first: whoever sees the metrics answer may already send SIGTERM.
        runner.install_signal_handlers()
        watcher = None
        if opts["reload"]:
            watcher = reloading.Watcher(lambda: worker.stopping.is_set() or runner.request_stop())
            watcher.start()
        if opts["metrics_port"]:
            from prometheus_client import REGISTRY

            REGISTRY.register(worker_gauges(worker))
        start_metrics_server(opts["metrics_port"], opts["metrics_host"])
        # With JSON logs, the "worker started/stopped" log lines say this; stdout stays JSON.
        banners = settings.LOG_FORMAT != "json"
        if banners:
            self.stdout.write(f"worker {worker.worker_id} on queues {','.join(worker.queues)}")
            if isinstance(runner, deliveries.Pair):
                self.stdout.write(f"webhook deliveries: worker {runner.deliveries.worker_id}, "
                                  f"{webhook_concurrency} thread(s) of their own")  # fmt: skip
        finished = runner.run()
        if banners:
            self.stdout.write(f"worker {worker.worker_id} stopped after {finished} job(s)")
        if watcher is not None and watcher.changed:
            self.stdout.flush()
            raise SystemExit(reloading.RESTART_EXIT_CODE)  # the parent starts the new code
        if worker.restart_requested:
            # Threads stuck in handlers cannot be killed: a fresh process (same pid and
            # arguments, so a supervisor sees no exit) serves in their place (D84).
            self.stdout.flush()
            os.execv(sys.executable, [sys.executable, *sys.argv])
