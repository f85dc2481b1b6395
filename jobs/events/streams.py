"""The Redis stream `<prefix>events`: every outbox event, for internal consumers.

Another subscriber of the outbox: the XADDs run inside the dispatcher's transaction,
before its cursor moves, so a Redis outage rolls the batch back and the next tick
sends it again; the append skips what the stream's tail shows is already in it, so a
repeated batch is not added twice (`id` is the same id as the webhook message).
Trimmed with `MAXLEN ~ JOBS_EVENTS_STREAM_MAXLEN`.
"""

from __future__ import annotations

from collections.abc import Sequence

from jobs.conf import settings
from jobs.transport import get_transport


class StreamPublisher:
    name = "stream"
    starts_at_beginning = True  # a built-in subscriber: its cursor is the migration's

    def handle(self, events: Sequence) -> int:
        """`events`: the outbox's events (`msg_id`, `type`, `body`), in outbox order."""
        get_transport().append_events(
            [{"id": e.msg_id, "type": e.type, "body": e.body} for e in events],
            settings.JOBS_EVENTS_STREAM_MAXLEN,
        )
        return len(events)
