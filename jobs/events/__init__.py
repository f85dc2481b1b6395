"""Completion events and the outbox (docs/events.md), and domain events from Django code:

    from jobs.events import publish, subscriber

    @subscriber("invoice.paid")
    def notify_accounting(event, ctx):   # event: {"id", "type", "payload", "created_at"}
        ...

    with transaction.atomic():
        invoice.save()
        publish("invoice.paid", {"invoice": invoice.pk})

`publish()` writes the event row and one job per subscriber of its type inside the
caller's transaction, exactly like `submit()`: a rollback leaves neither, a commit
runs each subscriber once (at least once, as every job: handlers are idempotent, and
the event id tells a repeat). List the subscribers' module in JOBS_TASK_MODULES.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction

from jobs import services, tasks
from jobs.models import DomainEvent

SUBSCRIBER_TASK_PREFIX = "event:"


@dataclass(frozen=True)
class Subscriber:
    event_type: str
    task: str
    queue: str
    max_retries: int | None


_subscribers: dict[str, list[Subscriber]] = {}

_INSERT_SQL = f"""
INSERT INTO {DomainEvent._meta.db_table} (type, payload, key, at)
VALUES (%s, %s::jsonb, %s, now())
RETURNING id, at
"""
KEY_MAX_LENGTH = 255


def subscriber(
    event_type: str,
    *,
    name: str | None = None,
    queue: str = "default",
    max_retries: int | None = None,
) -> Callable:
    """Register `fn(event, ctx)` to run as a job for each published `event_type`."""

    def register(fn: Callable) -> Callable:
        task_name = SUBSCRIBER_TASK_PREFIX + (name or f"{fn.__module__}.{fn.__qualname__}")
        tasks.task(task_name, public=False)(fn)  # run for published events only
        subs = _subscribers.setdefault(event_type, [])
        if all(s.task != task_name for s in subs):
            subs.append(Subscriber(event_type, task_name, queue, max_retries))
        return fn

    return register


def subscribers(event_type: str) -> list[Subscriber]:
    tasks.load()  # the subscribers' modules register on import
    return list(_subscribers.get(event_type, ()))


def domain_event_body(event_id: int, event_type: str, payload: Any, at: datetime) -> dict:
    """What a subscriber gets as `event`, and the Kafka sink as the message value."""
    return {"id": f"dev_{event_id}", "type": event_type, "payload": payload,
            "created_at": at.isoformat()}  # fmt: skip


def publish(event_type: str, payload: Any = None, key: str | None = None) -> int:
    """Write a domain event and one job per subscriber in the caller's transaction;
    returns the event id. `key`: the Kafka message key (events sharing one share a
    partition, in publish order); the event id when None."""
    if key is not None and not (isinstance(key, str) and 0 < len(key) <= KEY_MAX_LENGTH):
        raise ValueError(f"key must be a non-empty string of at most {KEY_MAX_LENGTH} characters")
    body = json.dumps(payload if payload is not None else {})
    subs = subscribers(event_type)
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute(_INSERT_SQL, [event_type, body, key])
            event_id, at = cur.fetchone()
        event = domain_event_body(event_id, event_type, json.loads(body), at)
        if subs:
            services.submit_many(
                [services.NewJob(s.task, event, queue=s.queue, max_retries=s.max_retries)
                 for s in subs],
                actor="api:events",
            )  # fmt: skip
    return event_id
