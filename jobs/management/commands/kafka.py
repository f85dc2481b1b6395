"""manage.py kafka create-topic|status (docs/events.md): the Kafka sink of the outbox."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.events import kafka
from jobs.events.lag import lag
from jobs.events.sources import DOMAIN, HISTORY


class Command(BaseCommand):
    help = (
        "Create the topic the outbox's Kafka sink produces to (auto-creation is not "
        "assumed), or show the sink's state: topic, partitions and how far behind it is."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create-topic", help="Create JOBS_KAFKA_TOPIC (or --topic).")
        create.add_argument("--topic", default=None, help="[JOBS_KAFKA_TOPIC, jobs.events]")
        create.add_argument("--partitions", type=int, default=12, help="[12]")
        create.add_argument("--replication-factor", type=int, default=3, help="[3]")
        sub.add_parser("status", help="The topic's partitions and the sink's lag.")

    def handle(self, *args, **opts) -> None:
        if not kafka.configured():
            raise CommandError("JOBS_KAFKA_BOOTSTRAP_SERVERS is not set: the sink is off")
        topic = opts.get("topic") or kafka.topic()
        try:
            if opts["action"] == "create-topic":
                self._create(topic, opts["partitions"], opts["replication_factor"])
            else:
                self._status(topic)
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        except kafka.KafkaUnavailable as exc:
            raise CommandError(str(exc)) from exc

    def _create(self, topic: str, partitions: int, replication_factor: int) -> None:
        if partitions < 1 or replication_factor < 1:
            raise CommandError("--partitions and --replication-factor must be at least 1")
        if kafka.create_topic(topic, partitions, replication_factor):
            self.stdout.write(
                f"topic {topic} created: {partitions} partitions, "
                f"replication factor {replication_factor}"
            )
        else:
            self.stdout.write(f"topic {topic} already exists")

    def _status(self, topic: str) -> None:
        count = kafka.partitions(topic)
        shown = "missing" if count is None else f"{count} partitions"
        self.stdout.write(f"topic {topic}: {shown}")
        rows = {r.subscriber: r for r in lag()}
        for label, suffix in (("relay", HISTORY.suffix), ("domain events", DOMAIN.suffix)):
            name = kafka.KafkaSink.name + suffix
            row = rows.get(name)
            if row is None:
                self.stdout.write(f"{label}: not started, relays nothing (manage.py outbox "
                                  f"start {name} --from beginning|now|ID)")  # fmt: skip
            else:
                self.stdout.write(
                    f"{label}: acknowledged up to event {row.last_id}, {row.events} behind, "
                    f"oldest {row.seconds:.1f}s"
                )
