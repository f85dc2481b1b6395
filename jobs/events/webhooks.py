"""The built-in delivery task: one POST of one event to one webhook per attempt.

A delivery is a job (task `webhook.deliver`, queue `webhooks`), so it gets the
lease, fencing, retries with exponential backoff and jitter, and the dead letter
(`failed`) of every job. 2xx is success; 410 disables the webhook and ends the
delivery; anything else, a timeout included, is a retryable failure, held back by
the answer's Retry-After when it asks for longer than the backoff.

Contained (issue 27): runworker runs deliveries on slots of their own (jobs.deliveries);
an attempt ends within JOBS_WEBHOOK_TIMEOUT whatever the receiver does
(jobs.events.deadline), reads at most JOBS_WEBHOOK_MAX_RESPONSE_BYTES of the answer,
holds one of its endpoint's slots and passes its circuit breaker (jobs.events.circuit).
An endpoint that is busy or open parks the delivery without a call and without
spending its budget.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import NoReturn

import urllib3
from django.db import connection

from jobs import metrics
from jobs.conf import settings
from jobs.durable import Suspend
from jobs.events import batches, circuit, endpoints, signing, ssrf
from jobs.events.deadline import Deadline, DeadlineExceeded
from jobs.lifecycle import Status, WaitReason
from jobs.observability import hooks
from jobs.tasks import JobContext, PermanentError, RetryableError, task

log = logging.getLogger(__name__)

# A receiver may ask for a pause (Retry-After), not for a delivery to wait for days.
MAX_RETRY_AFTER = 3600.0

_LOAD_SQL = """
SELECT d.body, d.event_id, w.id, w.url, w.enabled, w.secret_salt, e.at
FROM jobs_webhookdelivery d
JOIN jobs_webhook w ON w.id = d.webhook_id
LEFT JOIN jobs_jobevent e ON e.id = d.event_id
WHERE d.id = %(delivery)s AND d.job_id = %(job)s
"""
# The attempt's own job must still be held by this worker: a stale attempt's
# bookkeeping does not land (the same predicate as every holder write, SPEC §3).
_HELD = circuit.HELD
_ATTEMPT_SQL = f"""
UPDATE jobs_webhookdelivery SET attempts = attempts + 1, last_status_code = %(code)s,
       last_error = %(error)s, last_attempt_at = now()
WHERE id = %(delivery)s AND {_HELD}
"""
_DISABLE_SQL = f"""
UPDATE jobs_webhook SET enabled = false, disabled_reason = %(reason)s, updated_at = now()
WHERE id = %(webhook)s AND enabled AND {_HELD}
"""


_FAILURE_RATES_SQL = f"""
SELECT w.id, w.url, w.enabled, count(d.id), COALESCE(sum(d.attempts), 0),
       count(d.id) FILTER (WHERE j.status = '{Status.DONE}'),
       count(d.id) FILTER (WHERE j.status = '{Status.FAILED}')
FROM jobs_webhook w
LEFT JOIN jobs_webhookdelivery d
  ON d.webhook_id = w.id AND d.created_at > now() - %s * interval '1 second'
LEFT JOIN jobs_job j ON j.id = d.job_id
GROUP BY w.id, w.url, w.enabled
ORDER BY count(d.id) FILTER (WHERE j.status = '{Status.FAILED}') DESC, w.id
LIMIT %s
"""


def failure_rates(window_seconds: int = 86400, limit: int = 20) -> list[dict]:
    """Per endpoint over the window: deliveries, attempts, delivered, dead letters and the
    share of attempts that failed (the admin dashboard's webhook table)."""
    with connection.cursor() as cur:
        cur.execute(_FAILURE_RATES_SQL, [window_seconds, limit])
        rows = cur.fetchall()
    return [
        {"id": i, "url": url, "enabled": enabled, "deliveries": n, "attempts": attempts,
         "delivered": ok, "dead": dead,
         "failure_rate": (attempts - ok) / attempts if attempts else None}
        for i, url, enabled, n, attempts, ok, dead in rows
    ]  # fmt: skip


class Gone(PermanentError):
    """The receiver answered 410: the webhook is disabled, the delivery ends."""


def _execute(sql: str, params: dict) -> int:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.rowcount


def _fence(ctx: JobContext) -> dict:
    return {"job": ctx.job_id, "lv": ctx.lease_version, "owner": ctx.worker_id}


def post(
    url: str,
    address: str,
    headers: dict[str, str],
    body: str,
    seconds: float | None = None,
    slot: endpoints.Slot | None = None,
) -> tuple[int, bytes, dict]:
    """POST to `address` (checked by ssrf.resolve) with the URL's host name for Host and
    TLS: no second DNS lookup between the check and the call. Raises DeadlineExceeded
    unless the whole exchange ends within `seconds` [JOBS_WEBHOOK_TIMEOUT]. On `slot`'s
    kept-alive connection when given (a new connection closed after, otherwise)."""
    seconds = settings.JOBS_WEBHOOK_TIMEOUT if seconds is None else seconds
    own = slot is None
    slot = endpoints.Slot(0, -1, None) if slot is None else slot
    try:
        with Deadline(seconds) as deadline:
            try:
                answer = _post(url, address, headers, body, deadline, slot)
            except (urllib3.exceptions.HTTPError, OSError):
                slot.close_connections()
                if not deadline.expired:
                    raise
                answer = None
            if answer is None or deadline.expired:
                slot.close_connections()
                raise DeadlineExceeded(f"no complete answer within {seconds:g} s") from None
            return answer
    finally:
        if own:
            slot.close_connections()


def _post(
    url: str,
    address: str,
    headers: dict[str, str],
    body: str,
    deadline: Deadline,
    slot: endpoints.Slot,
) -> tuple[int, bytes, dict]:
    scheme, host, port, path = ssrf.split(url)
    name = f"[{host}]" if ":" in host else host
    default_port = 443 if scheme == "https" else 80
    headers = {**headers, "content-type": "application/json", "user-agent": "jobservice-webhooks",
               "host": name if port == default_port else f"{name}:{port}"}  # fmt: skip
    remaining = deadline.remaining()
    return slot.connection(scheme, address, port, host).post(
        path, headers, body.encode(), deadline=deadline,
        connect=min(settings.JOBS_WEBHOOK_CONNECT_TIMEOUT, remaining),
        read=min(settings.JOBS_WEBHOOK_READ_TIMEOUT, remaining),
        limit=settings.JOBS_WEBHOOK_MAX_RESPONSE_BYTES,
    )  # fmt: skip


def _outcome(outcome: str) -> None:
    metrics.WEBHOOK_DELIVERIES.labels(outcome).inc()


@task(signing.DELIVER_TASK, public=False)
def deliver(payload: dict, ctx: JobContext) -> dict:
    """Send one delivery (`{"delivery_id"}`); raise to retry, return when delivered."""
    delivery_id = payload["delivery_id"]
    with connection.cursor() as cur:
        # Only the delivery the outbox attached to this very job: a payload naming
        # another delivery (another client's) reads, sends and writes nothing.
        cur.execute(_LOAD_SQL, {"delivery": delivery_id, "job": ctx.job_id})
        row = cur.fetchone()
    if row is None:
        _outcome("dropped")
        return {"skipped": "no delivery of this job (the webhook was deleted)"}
    body, event_id, webhook_id, url, enabled, salt, event_at = row
    if not enabled:
        _outcome("disabled")
        raise PermanentError("the webhook is disabled")
    fence = _fence(ctx)
    try:
        addresses = ssrf.check(url)
    except ssrf.UnsafeURL as exc:
        _execute(_ATTEMPT_SQL, {**fence, "delivery": delivery_id, "code": None,
                                "error": str(exc)[:500]})  # fmt: skip
        _outcome("refused")
        raise PermanentError(f"not called: {exc}") from None
    call = _Call(ctx, fence, delivery_id, webhook_id, url, addresses[0], salt, event_id,
                 event_at, body)  # fmt: skip
    # A run of this endpoint going on in this process makes the call on its slot, its
    # circuit admitted by the run's first answer (D261).
    lent = endpoints.SLOTS.lend(webhook_id, call.post, LEND_WAIT)
    if lent is not None:
        return call.answered(lent.error or lent.answer, lent.seconds, _CLEAN, None)
    slot = endpoints.SLOTS.take(webhook_id)
    if slot is None:
        _park(ctx, webhook_id, circuit.busy_wait(), "the endpoint's slots are busy")
    try:
        verdict = circuit.admit(webhook_id, fence)
        if not verdict.go:
            _park(ctx, webhook_id, verdict.wait, f"circuit {verdict.reason}")
        started = time.monotonic()
        try:
            answer = call.post(slot.slot)
        except urllib3.exceptions.HTTPError as exc:
            answer = exc
        result = call.answered(answer, time.monotonic() - started, verdict, slot)
        if not slot.given:  # a fast answer: the endpoint's next deliveries on this slot
            result["run"] = batches.run(ctx, webhook_id, slot, post, retry_after)
        return result
    finally:
        slot.give()


def _park(ctx: JobContext, webhook_id: int, seconds: float, why: str) -> NoReturn:
    """End the attempt without calling the endpoint: the delivery is queued again for
    later, its budget untouched (jobs.durable parks it under the fence)."""
    _outcome("deferred")
    log.info("webhook %s delivery deferred %.1fs: %s", webhook_id, seconds, why,
             extra={"job_id": ctx.job_id, "lease_version": ctx.lease_version,
                    "worker_id": ctx.worker_id})  # fmt: skip
    raise Suspend(WaitReason.SLEEP, seconds=seconds)


# How long a delivery waits for the run holding its endpoint's slot to make its call.
LEND_WAIT = 0.5
_CLEAN = circuit.Verdict(True, clean=True)


@dataclass
class _Call:
    """One attempt's call to its endpoint and its bookkeeping."""

    ctx: JobContext
    fence: dict
    delivery_id: int
    webhook_id: int
    url: str
    address: str
    salt: str
    event_id: int
    event_at: datetime | None
    body: str

    def post(self, slot: endpoints.Slot) -> tuple[int, bytes, dict]:
        headers = signing.sign(self.salt, signing.message_id(self.event_id), datetime.now(UTC),
                               self.body)  # fmt: skip
        with hooks.http_call("POST", self.url, headers) as call:  # the client span
            answer = post(self.url, self.address, headers, self.body, slot=slot)
            call.answered(answer[0])
        return answer

    def answered(self, answer: tuple | BaseException, seconds: float,
                 verdict: circuit.Verdict, slot: endpoints.Taken | None) -> dict:  # fmt: skip
        """The circuit's verdict on the endpoint and the attempt's bookkeeping. The slot
        goes back once the verdict is written (the next call sees this one's failure
        counted), before the rest of the bookkeeping; kept after a fast 2xx, for a run.
        An answer to a circuit that was closed with no failure counted writes nothing
        (and reads nothing more): a failure counted meanwhile by a concurrent call is
        reset by the next answer instead."""
        ctx, fence, webhook_id = self.ctx, self.fence, self.webhook_id
        attempt = {**fence, "delivery": self.delivery_id}
        if isinstance(answer, BaseException):
            if not isinstance(answer, urllib3.exceptions.HTTPError):
                raise answer  # as if raised here: the worker fails the attempt
            circuit.failed(webhook_id, fence)
            if slot is not None:
                slot.give(seconds)
            error = f"{answer.__class__.__name__}: {answer}"[:500]
            _execute(_ATTEMPT_SQL, {**attempt, "code": None, "error": error})
            timeout = isinstance(answer, urllib3.exceptions.TimeoutError)
            _outcome("timeout" if timeout else "error")
            raise RetryableError(f"webhook {webhook_id}: {error}") from None
        code, head, headers_in = answer
        if code >= 500 or code == 429:
            circuit.failed(webhook_id, fence)
        elif not verdict.clean and circuit.answered(webhook_id, fence):
            log.info("webhook %s answered %s: circuit closed", webhook_id, code,
                     extra={"job_id": ctx.job_id, "lease_version": ctx.lease_version,
                            "worker_id": ctx.worker_id})  # fmt: skip
        if slot is not None and 200 <= code < 300 and batches.worth_running(seconds):
            slot.note(seconds)  # kept for the endpoint's run (jobs.events.batches)
        elif slot is not None:
            slot.give(seconds)
        error = "" if 200 <= code < 300 else head.decode("utf-8", "replace")[:500]
        _execute(_ATTEMPT_SQL, {**attempt, "code": code, "error": error})
        if 200 <= code < 300:
            _outcome("delivered")
            if self.event_at is not None:
                metrics.WEBHOOK_LAG.observe(max(0.0, time.time() - self.event_at.timestamp()))
            return {"status": code, "seconds": round(seconds, 3)}
        if code == 410:
            _execute(_DISABLE_SQL, {**fence, "webhook": webhook_id, "reason": "410 Gone"})
            _outcome("gone")
            log.warning("webhook %s answered 410: disabled", webhook_id,
                        extra={"job_id": ctx.job_id})  # fmt: skip
            raise Gone(f"webhook {webhook_id} answered 410 Gone: disabled")
        _outcome("http_error")
        raise RetryableError(
            f"webhook {webhook_id} answered HTTP {code}", retry_after=retry_after(headers_in)
        )


def retry_after(headers: dict[str, str]) -> float | None:
    """A Retry-After header (seconds or an HTTP date) as seconds from now, at most
    MAX_RETRY_AFTER; None when absent or unreadable."""
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            seconds = (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)
