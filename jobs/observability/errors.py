"""Failed attempts to Sentry (docs/observability.md): one event per failed attempt whose
write-back landed, tagged with the job; an attempt that will run again is marked handled;
a stale write (fenced off) reports nothing: its job is another attempt's now.

sentry-sdk is not imported here until there is something to send: only a process that
initialised it (the settings, with a DSN) can have an active client, and that process
imported it, so without it in `sys.modules` the worker's hooks return after one check;
the other processes start 80 ms sooner. The worker logs a failed attempt at WARNING or
INFO, below the level Sentry's logging integration sends (ERROR): the report below is
the attempt's one event.
"""

from __future__ import annotations

import sys
from typing import Any


def active() -> bool:
    sdk = sys.modules.get("sentry_sdk")  # imported by whatever initialised it, or absent
    return sdk is not None and sdk.get_client().is_active()


def report(exc: BaseException, tags: dict[str, Any], will_retry: bool) -> None:
    """One event for a failed attempt, with the job in its tags (never in the message,
    so Sentry groups the attempts of one bug together)."""
    import sentry_sdk
    from sentry_sdk.utils import event_from_exception

    client = sentry_sdk.get_client()
    event, hint = event_from_exception(
        exc,
        client_options=client.options,
        mechanism={"type": "jobservice", "handled": will_retry},
    )
    event["level"] = "warning" if will_retry else "error"
    with sentry_sdk.new_scope() as scope:
        for key, value in tags.items():
            scope.set_tag(key, value)
        scope.set_context("job", tags)
        scope.capture_event(event, hint=hint)
