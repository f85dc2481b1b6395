"""manage.py queue pause|resume NAME, queue list, queue sync (docs/queue-controls.md)."""

from __future__ import annotations

import logging

from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs import gauges, queuecontrol, queues, selectors
from jobs.flow import batches, sequences

log = logging.getLogger(__name__)


def _key_controls(q: gauges.QueueState) -> str:
    """The queue's controls per client and key, when it has any (docs/queue-controls.md)."""
    parts = ["fair"] if q.fair else []
    if q.key_concurrency is not None:
        parts.append(f"{q.key_concurrency} processing per key")
    if q.key_rate_limit is not None:
        parts.append(f"throttle {queues.format_key_rate(q.key_rate_limit, q.key_rate_period)}")
    return f"\t{', '.join(parts)}" if parts else ""


class Command(BaseCommand):
    help = (
        "Pause or resume a queue (a paused queue accepts jobs and keeps them queued; no "
        "worker starts one), list the queues' controls, or sync them from JOBS_QUEUES."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        for action, what in (("pause", "Stop starting jobs"), ("resume", "Start jobs again")):
            cmd = sub.add_parser(action, help=f"{what} of queue NAME.")
            cmd.add_argument("name", metavar="NAME")
        sub.add_parser("list", help="Each queue's controls and what they hold back now.")
        sub.add_parser("sync", help="Apply JOBS_QUEUES changes to the Queue rows now.")

    def handle(self, *args, **opts) -> None:
        action = opts["action"]
        if action == "sync":
            changes = queuecontrol.sync()
            self.stdout.write("\n".join(changes) if changes else "queues already in sync")
            return
        if action == "list":
            for q in gauges.queue_states():
                cap = "-" if q.concurrency is None else f"{q.processing}/{q.concurrency}"
                rate = queues.format_rate(q.rate_limit, q.rate_period) or "-"
                tokens = "" if q.rate_tokens is None else f" ({q.rate_tokens} left)"
                # What a job of a paused queue shows as its wait_reason, API and admin.
                state = f"paused (jobs wait: {selectors.QUEUE_PAUSED})" if q.paused else "active"
                keys = _key_controls(q)
                self.stdout.write(f"{q.name}\t{state}\tprocessing {cap}\trate {rate}{tokens}{keys}")
            # Controls per key of work (jobs.flow): what they hold back now.
            seqs = sequences.counts()
            halted = ", ".join(s.key for s in sequences.halted(5))
            self.stdout.write(f"sequences\t{seqs['running']} running\t{seqs['halted']} halted"
                              + (f" ({halted})" if halted else ""))  # fmt: skip
            self.stdout.write(f"batches\t{batches.open_count()} open")
            return
        name = opts["name"]
        try:
            changed = queuecontrol.set_paused(name, action == "pause")
        except queuecontrol.UnknownQueue:
            declared = ", ".join(sorted(queues.declared()))
            raise CommandError(
                f"unknown queue {name!r}: not declared in JOBS_QUEUES ({declared})"
            ) from None
        done = "paused" if action == "pause" else "resumed"
        log.info("queue %s from the command line", done, extra={"queue": name})
        self.stdout.write(f"queue {name} {done}" if changed else f"queue {name} already {done}")
