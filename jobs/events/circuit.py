"""Per-endpoint containment of webhook deliveries: a concurrency bound and a circuit breaker.

Both live in PostgreSQL, so they hold across every worker process:

- Slots: an attempt holds one of JOBS_WEBHOOK_ENDPOINT_CONCURRENCY session advisory
  locks of its endpoint while it calls it (jobs.events.endpoints: held by the process
  while its threads keep it busy). A lock dies with its session, so a killed worker
  leaks none.
- The breaker (`jobs_webhook.circuit_*`): JOBS_WEBHOOK_CIRCUIT_FAILURES failed attempts
  in a row (no answer in time, a connection error, 5xx or 429) open it for
  JOBS_WEBHOOK_CIRCUIT_OPEN_SECONDS, doubled for each further failure up to
  JOBS_WEBHOOK_CIRCUIT_MAX_OPEN_SECONDS. Once that has passed, the first attempt takes
  the probe (half open, until its own deadline); any other answer closes the circuit,
  a failure opens it again for longer.

An attempt that finds its endpoint open or busy does not call it and does not spend
its retry budget: the delivery parks (queued with a later run_at, like a durable
sleep) and runs again then. Writes carry the attempt's job fence like every holder
write (SPEC §3): a stale attempt's verdict about the endpoint does not land.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

from django.db import connection
from django.utils import timezone

from jobs import metrics
from jobs.conf import settings
from jobs.lifecycle import Status
from jobs.models import CircuitState, Webhook

log = logging.getLogger(__name__)

# A delivery parked for a busy endpoint or an ongoing probe looks again this soon.
BUSY_WAIT = (0.5, 1.5)
# A probe's deadline: its attempt's, plus room for its bookkeeping.
PROBE_MARGIN = 5.0

# The attempt's own job must still be held by this worker (the holder-write predicate).
HELD = f"""EXISTS (SELECT 1 FROM jobs_job j WHERE j.id = %(job)s AND j.lease_version = %(lv)s
  AND j.owned_by = %(owner)s AND j.status = '{Status.PROCESSING}')"""

_CLOSED, _OPEN = CircuitState.CLOSED.value, CircuitState.OPEN.value
_HALF = CircuitState.HALF_OPEN.value
# The first attempt after the open period takes the probe; the others see it taken.
_ADMIT_SQL = f"""
WITH probe AS (
  UPDATE jobs_webhook w SET circuit_state = '{_HALF}',
         circuit_open_until = now() + %(probe)s * interval '1 second'
  WHERE w.id = %(webhook)s AND w.circuit_state <> '{_CLOSED}' AND w.circuit_open_until <= now()
    AND {HELD}
  RETURNING w.id)
SELECT 'probe', 0.0, 0 FROM probe
UNION ALL
SELECT w.circuit_state,
       greatest(0, extract(epoch FROM w.circuit_open_until - now()))::float8,
       w.circuit_failures
FROM jobs_webhook w WHERE w.id = %(webhook)s AND NOT EXISTS (SELECT 1 FROM probe)
"""
_FAILED_SQL = f"""
UPDATE jobs_webhook w SET circuit_failures = w.circuit_failures + 1,
  circuit_state = CASE WHEN w.circuit_failures + 1 >= %(threshold)s THEN '{_OPEN}'
                       ELSE w.circuit_state END,
  circuit_open_until = CASE WHEN w.circuit_failures + 1 >= %(threshold)s
    THEN now() + least(%(max)s, %(base)s * power(2, least(
           w.circuit_failures + 1 - %(threshold)s, 30))) * interval '1 second'
    ELSE w.circuit_open_until END
WHERE w.id = %(webhook)s AND %(threshold)s > 0 AND {HELD}
RETURNING w.circuit_state, w.circuit_failures, w.circuit_open_until
"""
# Only when there is something to reset: a healthy endpoint's answers write nothing.
# RETURNING's subquery reads the statement's snapshot: the state before the reset.
_ANSWERED_SQL = f"""
UPDATE jobs_webhook w SET circuit_state = '{_CLOSED}', circuit_failures = 0,
       circuit_open_until = NULL
WHERE w.id = %(webhook)s AND (w.circuit_failures <> 0 OR w.circuit_state <> '{_CLOSED}')
  AND {HELD}
RETURNING (SELECT circuit_state FROM jobs_webhook WHERE id = %(webhook)s)
"""


@dataclass(frozen=True)
class Verdict:
    """Whether an attempt may call its endpoint now; if not, how long it parks."""

    go: bool
    probe: bool = False
    wait: float = 0.0
    reason: str = ""
    # Closed with no failure counted: an answer has nothing to reset (no write).
    clean: bool = False


def busy_wait() -> float:
    return random.uniform(*BUSY_WAIT)


def admit(webhook_id: int, fence: dict[str, Any]) -> Verdict:
    """Closed: go. Open and due: go as the probe. Open: park until it is due (plus
    jitter, so the parked deliveries do not all come back at once). Half open: park
    briefly while the probe is out."""
    probe = settings.JOBS_WEBHOOK_TIMEOUT + PROBE_MARGIN
    with connection.cursor() as cur:
        cur.execute(_ADMIT_SQL, {**fence, "webhook": webhook_id, "probe": probe})
        row = cur.fetchone()
    if row is None:
        return Verdict(True)
    state, wait, failures = row
    if state == _CLOSED:
        return Verdict(True, clean=failures == 0)
    if state == "probe":
        metrics.WEBHOOK_CIRCUIT.labels(_HALF).inc()
        return Verdict(True, probe=True)
    if state == _HALF:
        return Verdict(False, wait=min(wait, BUSY_WAIT[1]) + busy_wait(), reason="probing")
    return Verdict(False, wait=wait + random.uniform(0, 1), reason="open")


def failed(webhook_id: int, fence: dict[str, Any]) -> str | None:
    """Count a failed attempt; the state it left the circuit in (None: not written)."""
    params = {**fence, "webhook": webhook_id,
              "threshold": settings.JOBS_WEBHOOK_CIRCUIT_FAILURES,
              "base": settings.JOBS_WEBHOOK_CIRCUIT_OPEN_SECONDS,
              "max": settings.JOBS_WEBHOOK_CIRCUIT_MAX_OPEN_SECONDS}  # fmt: skip
    with connection.cursor() as cur:
        cur.execute(_FAILED_SQL, params)
        row = cur.fetchone()
    if row is None:
        return None
    state, failures, _ = row
    if state == _OPEN and failures == settings.JOBS_WEBHOOK_CIRCUIT_FAILURES:
        metrics.WEBHOOK_CIRCUIT.labels(_OPEN).inc()
    elif state == _OPEN and failures > settings.JOBS_WEBHOOK_CIRCUIT_FAILURES:
        metrics.WEBHOOK_CIRCUIT.labels("reopened").inc()
    return state


def answered(webhook_id: int, fence: dict[str, Any]) -> bool:
    """The endpoint answered: reset the count, close the circuit. True if it was open."""
    with connection.cursor() as cur:
        cur.execute(_ANSWERED_SQL, {**fence, "webhook": webhook_id})
        row = cur.fetchone()
    opened = row is not None and row[0] != _CLOSED
    if opened:
        metrics.WEBHOOK_CIRCUIT.labels(_CLOSED).inc()
    return opened


def describe(hook: Webhook) -> dict[str, Any]:
    """The breaker as the API and the admin show it: an open circuit whose period is
    over is half open (its next attempt is the probe)."""
    state = hook.circuit_state
    if state == _OPEN and hook.circuit_open_until and hook.circuit_open_until <= timezone.now():
        state = _HALF
    return {"state": state, "failures": hook.circuit_failures,
            "open_until": hook.circuit_open_until if state != _CLOSED else None}  # fmt: skip
