"""The Kafka sink: every outbox event produced to `JOBS_KAFKA_TOPIC` (docs/events.md).

Another subscriber of the outbox (jobs/events/outbox.py), with a dispatcher thread of
its own in every runreaper. A batch's cursor moves only once the broker has
acknowledged every event of the batch (`acks=all`, idempotent producer); otherwise the
tick rolls back and the next one waits for the same events. So a broker that is down or
frozen delays events and never loses them, and a crash repeats a batch (at least once;
consumers drop repeats by the `id` header or body field).

Order: key = the job id (a domain event's: its publisher's key, else its id), so one
job's events share a partition, and the idempotent
producer keeps each partition in produce order through its retries. Messages never
time out in the producer (`message.timeout.ms` 0 unless configured): an event that has
been produced once is waited for, never produced again behind a later one of its job by
this process. The only repeats are a whole batch after a crash or a failed delivery
report, and a repeat always follows the first copy of every event before it.

The only module that imports confluent_kafka, the `kafka` extra: without it this module
imports and `configured()` answers, and the sink and the admin calls refuse naming it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured

from jobs import extras, metrics
from jobs.conf import settings
from jobs.observability import hooks
from jobs.transport import TransportError

if TYPE_CHECKING:
    import confluent_kafka as ck
    from confluent_kafka import admin as ck_admin
else:  # imported at first use (D373); without the `kafka` extra that use raises MissingExtra
    ck = extras.Lazy("confluent_kafka", "kafka")
    ck_admin = extras.Lazy("confluent_kafka.admin", "kafka")

log = logging.getLogger(__name__)

DEFAULT_TOPIC = "jobs.events"
# Events per relay tick: one transaction, one cursor move and one wait for the broker's
# acknowledgements each. A repeat after a crash is at most this many events.
BATCH = 2000
# What at-least-once in seq order needs: not overridable by JOBS_KAFKA_CONFIG.
REQUIRED_CONFIG = {"enable.idempotence": True, "acks": "all"}
# Overridable defaults: wait for the broker as long as it takes (the tick's own deadline
# bounds each wait), and a client id the broker's logs can name.
DEFAULT_CONFIG = {"message.timeout.ms": 0, "client.id": "jobservice-outbox"}


class KafkaUnavailable(TransportError):
    """The broker did not answer (or acknowledge every event of a batch) in time."""


def configured() -> bool:
    return bool(getattr(settings, "JOBS_KAFKA_BOOTSTRAP_SERVERS", ""))


def topic() -> str:
    return getattr(settings, "JOBS_KAFKA_TOPIC", "") or DEFAULT_TOPIC


def client_config() -> dict[str, Any]:
    """librdkafka settings: JOBS_KAFKA_CONFIG (security, compression, linger…) over our
    defaults, the bootstrap servers and the two settings the guarantees rest on."""
    extra = getattr(settings, "JOBS_KAFKA_CONFIG", None) or {}
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError as exc:
            raise ImproperlyConfigured(f"JOBS_KAFKA_CONFIG is not JSON: {exc}") from exc
    if not isinstance(extra, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str | int | float | bool) for k, v in extra.items()
    ):
        raise ImproperlyConfigured(
            "JOBS_KAFKA_CONFIG must be a JSON object of librdkafka settings (name: value)"
        )
    overridden = sorted(k for k in extra if k in REQUIRED_CONFIG and extra[k] != REQUIRED_CONFIG[k])
    if overridden:
        raise ImproperlyConfigured(
            f"JOBS_KAFKA_CONFIG may not change {', '.join(overridden)}: at-least-once "
            "delivery in seq order needs enable.idempotence=true and acks=all"
        )
    return {
        **DEFAULT_CONFIG,
        **extra,
        "bootstrap.servers": settings.JOBS_KAFKA_BOOTSTRAP_SERVERS,
        **REQUIRED_CONFIG,
    }


def ack_timeout() -> float:
    return float(getattr(settings, "JOBS_KAFKA_ACK_TIMEOUT", 5.0))


_PENDING, _ACKED, _REFUSED = "pending", "acked", "refused"


class KafkaSink:
    """Produce a batch, wait for its acknowledgements, or raise so the cursor stays."""

    name = "kafka"
    # Added by an operator to a deployment with history: relays nothing until told where
    # to start (manage.py outbox start kafka, D193).
    starts_at_beginning = False

    def __init__(self, config: dict[str, Any] | None = None, topic_name: str | None = None,
                 timeout: float | None = None) -> None:  # fmt: skip
        extras.require("kafka")
        self.config = client_config() if config is None else config
        self.topic = topic() if topic_name is None else topic_name
        self.timeout = ack_timeout() if timeout is None else timeout
        self._producer: ck.Producer | None = self._new_producer()  # a bad setting fails here
        # Event id → _PENDING / _ACKED / _REFUSED for events this producer has produced
        # and whose batch has not committed yet.
        self._state: dict[str, str] = {}

    def _new_producer(self) -> ck.Producer:
        try:
            return ck.Producer({**self.config, "error_cb": self._on_error})
        except ck.KafkaException as exc:
            raise ImproperlyConfigured(f"JOBS_KAFKA_CONFIG: {exc.args[0].str()}") from exc

    def _get_producer(self) -> ck.Producer:
        if self._producer is None:
            self._producer = self._new_producer()
        return self._producer

    def _on_error(self, err: ck.KafkaError) -> None:
        metrics.KAFKA_ERRORS.labels(reason=_reason(err)).inc()
        log.warning("kafka producer: %s", err)
        if err.fatal():  # the idempotent producer cannot go on: start a new one
            self._producer = None
            self._state.clear()

    def _delivered(self, event_id: str, err: ck.KafkaError | None, _msg) -> None:
        if err is None:
            self._state[event_id] = _ACKED
            metrics.KAFKA_PRODUCED.inc()
        else:
            self._state[event_id] = _REFUSED
            metrics.KAFKA_ERRORS.labels(reason=_reason(err)).inc()
            log.warning("kafka delivery of %s failed: %s", event_id, err)

    def handle(self, events: Sequence) -> int:
        """`events`: the outbox's events (`msg_id`, `type`, `body`, `key`), in order."""
        producer = self._get_producer()
        wanted = {e.msg_id for e in events}
        # Forget what an earlier, since committed or abandoned, batch left acknowledged.
        for event_id in [k for k, v in self._state.items() if v == _ACKED and k not in wanted]:
            del self._state[event_id]
        try:
            for e in events:
                if self._state.get(e.msg_id) in (_PENDING, _ACKED):
                    continue  # produced already: waited for, never produced again
                self._state[e.msg_id] = _PENDING
                producer.produce(
                    self.topic,
                    key=e.key.encode(),
                    value=e.body.encode(),
                    headers=[
                        ("id", e.msg_id.encode()),
                        ("type", e.type.encode()),
                        *hooks.record_headers(getattr(e, "trace", None)),
                    ],
                    on_delivery=partial(self._delivered, e.msg_id),
                )
        except (BufferError, ck.KafkaException) as exc:
            self._state.pop(e.msg_id, None)
            metrics.KAFKA_ERRORS.labels(reason=type(exc).__name__).inc()
            raise KafkaUnavailable(f"kafka: produce refused: {exc}") from exc
        # flush: sends what lingers at once and serves the delivery reports until every
        # message in flight (this batch's, and any an abandoned one left) is settled.
        producer.flush(self.timeout)
        unacked = [e for e in events if self._state.get(e.msg_id) != _ACKED]
        if unacked:
            metrics.KAFKA_ERRORS.labels(reason="not_acknowledged").inc()
            raise KafkaUnavailable(
                f"kafka: {len(unacked)} of {len(events)} events not acknowledged within "
                f"{self.timeout:g}s (first {unacked[0].msg_id}); the batch will be retried"
            )
        for e in events:
            self._state.pop(e.msg_id, None)
        return len(events)

    def close(self, timeout: float = 5.0) -> None:
        """Give what is in flight `timeout` seconds, then let the producer go."""
        if self._producer is not None:
            self._producer.flush(timeout)
            self._producer = None
            self._state.clear()


def _reason(err: ck.KafkaError) -> str:
    """A bounded label value: librdkafka's error name (never an id)."""
    return err.name().lower().lstrip("_") or "unknown"


def _admin() -> ck_admin.AdminClient:
    """An admin client with the producer's connection settings (security included)."""
    extras.require("kafka")
    return ck_admin.AdminClient(
        {k: v for k, v in client_config().items() if k not in REQUIRED_CONFIG}
    )


def create_topic(name: str, partitions: int, replication_factor: int,
                 timeout: float = 30.0) -> bool:  # fmt: skip
    """Create the topic; False if it exists already. Topic auto-creation is not assumed."""
    admin = _admin()  # kept referenced: the futures fail once the client is destroyed
    futures = admin.create_topics(
        [ck_admin.NewTopic(name, num_partitions=partitions, replication_factor=replication_factor)],
        operation_timeout=timeout,
        request_timeout=timeout,
    )
    try:
        futures[name].result(timeout)
    except ck.KafkaException as exc:
        if exc.args and exc.args[0].code() == ck.KafkaError.TOPIC_ALREADY_EXISTS:
            return False
        raise KafkaUnavailable(f"kafka: {exc.args[0] if exc.args else exc}") from exc
    return True


def partitions(name: str, timeout: float = 10.0) -> int | None:
    """The topic's partition count, or None if the broker does not know it."""
    try:
        found = _admin().list_topics(name, timeout=timeout).topics.get(name)
    except ck.KafkaException as exc:
        raise KafkaUnavailable(f"kafka: {exc.args[0] if exc.args else exc}") from exc
    if found is None or found.error is not None:
        return None
    return len(found.partitions)
