"""An endpoint's due deliveries in runs, on the slot a delivery already holds (issue 41).

A delivery is still a job, but a job per call was the cost: a claim, a start mark, a
load, a circuit read, the attempt's bookkeeping and a completion per delivery, and a
fast endpoint got about 150 calls a second. So a delivery that found its endpoint fast
(its own call answered 2xx within FAST_SECONDS) keeps the slot and takes the
endpoint's next due deliveries itself, a batch at a time: one statement claims them
(their attempts marked started), one reads them, each is called in turn on the slot's
kept-alive connection, and one transaction writes every attempt's bookkeeping, the
completions, the failures (retried like any) and the release of those not called.

A run keeps every promise of the single path: only deliveries with a job of their
own are taken (so per-job `seq` order holds: a chain has one such job at a time); the
slot bounds the endpoint's calls; a failure is counted by the circuit and ends the
run (the rest go back unspent, and the next attempts pass the breaker as usual); each
call has its total deadline; the address is checked (SSRF) once per batch; a run ends
after RUN_SECONDS, at the first slow call, when a thread of this process waits for the
slot, or when the worker stops.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import connection, transaction

from jobs import metrics, selectors, services
from jobs.errors import class_path
from jobs.events import backlog, circuit, endpoints, signing, ssrf
from jobs.lifecycle import Status

log = logging.getLogger(__name__)

# A call answered within this keeps the run going; a slower one ends it.
FAST_SECONDS = 0.05
# How long one delivery's thread goes on with its endpoint's others before it returns.
RUN_SECONDS = 0.5
# Deliveries claimed at once (fewer when calls take longer: a batch lasts ~BATCH_SECONDS).
BATCH = 64
BATCH_SECONDS = 0.05
# A delivery of this process waiting for the slot gets it after this much of a run (the
# run's batch then ends within endpoints.RUN_HANDOVER).
HANDOVER_AFTER = 0.1

_LOAD_SQL = """
SELECT d.id, d.job_id, d.body, d.event_id, e.at
FROM jobs_webhookdelivery d
LEFT JOIN jobs_jobevent e ON e.id = d.event_id
WHERE d.job_id = ANY(%(jobs)s) AND d.webhook_id = %(webhook)s
"""
_WEBHOOK_SQL = "SELECT url, enabled, secret_salt FROM jobs_webhook WHERE id = %s"
# Each attempt's bookkeeping, under its own job's fence (the holder-write predicate).
_ATTEMPTS_SQL = f"""
UPDATE jobs_webhookdelivery d SET attempts = d.attempts + 1, last_status_code = a.code,
       last_error = a.error, last_attempt_at = now()
FROM unnest(%s::bigint[], %s::int[], %s::text[], %s::bigint[], %s::bigint[], %s::text[])
     AS a(id, code, error, job, lv, owner)
JOIN jobs_job j ON j.id = a.job AND j.lease_version = a.lv AND j.owned_by = a.owner
     AND j.status = '{Status.PROCESSING}'
WHERE d.id = a.id
"""
_DISABLE_SQL = f"""
UPDATE jobs_webhook SET enabled = false, disabled_reason = %(reason)s, updated_at = now()
WHERE id = %(webhook)s AND enabled AND {circuit.HELD}
"""

# What the single path's caller gives a run: POST (url, address, headers, body, slot)
# → (status, head, headers), raising like jobs.events.webhooks.post.
Send = Callable[..., tuple[int, bytes, dict]]


@dataclass
class Called:
    """One delivery of a batch and what its call ended with."""

    lease: services.Lease
    delivery_id: int
    code: int | None = None
    error: str = ""
    failure: BaseException | None = None  # not delivered: retried (or gone, 410)
    retry_after: float | None = None


def worth_running(seconds: float) -> bool:
    """Whether an endpoint that answered 2xx in `seconds` gets a run."""
    return seconds <= FAST_SECONDS and endpoints.SLOTS.limit() > 0


def run(ctx, webhook_id: int, slot: endpoints.Taken, send: Send,
        retry_after: Callable[[dict], float | None]) -> int:  # fmt: skip
    """Deliver the endpoint's due deliveries on `slot` for up to RUN_SECONDS; how many
    were called. `ctx` is the attempt that holds the slot (its worker id claims)."""
    started = time.monotonic()
    called = 0
    call_seconds = 0.0
    with endpoints.SLOTS.running(webhook_id):
        while (elapsed := time.monotonic() - started) < RUN_SECONDS and not ctx.stop.is_set():
            if elapsed >= HANDOVER_AFTER and endpoints.SLOTS.waiting(webhook_id):
                break  # another delivery here waits for the slot: hand it over
            if backlog.HOLD.on():
                break  # the outbox is far behind: its relays first (D409)
            lent, fast = _lent(webhook_id, slot)
            called += lent
            if not fast:
                break
            size = BATCH if call_seconds <= 0 else int(BATCH_SECONDS / call_seconds)
            size = max(1, min(BATCH, size))
            n, seconds, go_on = _batch(ctx.worker_id, webhook_id, slot, send, retry_after, size)
            if n:
                call_seconds = seconds / n
            called += n
            if not go_on and (n or not lent):
                break  # a failure, a slow answer, or nothing left to send
    return called


def _lent(webhook_id: int, slot: endpoints.Taken) -> tuple[int, bool]:
    """Make the calls this process's other deliveries lent the run (each writes its own
    bookkeeping); (calls made, whether the endpoint stayed fast). After a failure or a
    slow answer the rest go back uncalled."""
    made, fast = 0, True
    for item in endpoints.SLOTS.lent(webhook_id):
        if fast:
            began = time.monotonic()
            try:
                item.answer = item.call(slot.slot)
            except BaseException as exc:  # handed to the delivery that lent the call
                item.error = exc
            item.seconds = time.monotonic() - began
            item.called = True
            made += 1
            code = item.answer[0] if item.error is None else None
            fast = code is not None and 200 <= code < 300 and item.seconds <= FAST_SECONDS
        item.done.set()
    return made, fast


def _batch(worker_id: str, webhook_id: int, slot: endpoints.Taken, send: Send,
           retry_after: Callable[[dict], float | None],
           size: int) -> tuple[int, float, bool]:  # fmt: skip
    """One batch: claim, call, write back. (calls, their seconds, whether to go on)."""
    hook = _webhook(webhook_id)
    if hook is None or not hook[1]:
        return 0, 0.0, False
    url, _, salt = hook
    ids = selectors.due_deliveries(webhook_id, signing.WEBHOOK_QUEUE, size)
    leases = services.claim_ids(worker_id, ids, start=len(ids)) if ids else []
    if not leases:
        return 0, 0.0, False
    with connection.cursor() as cur:
        cur.execute(_LOAD_SQL, {"jobs": [x.job_id for x in leases], "webhook": webhook_id})
        rows = {r[1]: r for r in cur.fetchall()}
    try:
        address = ssrf.check(url)[0]
    except ssrf.UnsafeURL:
        address = None  # the single path refuses it (and ends the delivery) with the reason
    done: list[Called] = []
    unrun: list[services.Lease] = []
    go_on = address is not None
    spent = 0.0
    for lease in leases:
        row = rows.get(lease.job_id)
        if not go_on or row is None or row[0] != (lease.payload or {}).get("delivery_id"):
            unrun.append(lease)  # not this run's to send: the single path decides
            continue
        delivery_id, _, body, event_id, event_at = row
        item = Called(lease, delivery_id)
        headers = signing.sign(salt, signing.message_id(event_id), datetime.now(UTC), body)
        began = time.monotonic()
        try:
            item.code, head, headers_in = send(url, address, headers, body, slot=slot.slot)
        except Exception as exc:  # like the single path: retried
            item.failure, item.error = exc, f"{exc.__class__.__name__}: {exc}"[:500]
        seconds = time.monotonic() - began
        spent += seconds
        done.append(item)
        code = item.code
        if code is not None and 200 <= code < 300:
            if event_at is not None:
                metrics.WEBHOOK_LAG.observe(max(0.0, time.time() - event_at.timestamp()))
            go_on = seconds <= FAST_SECONDS
            continue
        go_on = False
        if code is not None:
            item.error = head.decode("utf-8", "replace")[:500]
            item.retry_after = retry_after(headers_in)
            item.failure = _HttpFailure(f"webhook {webhook_id} answered HTTP {code}")
        if code is None or code >= 500 or code == 429:
            circuit.failed(webhook_id, _fence(lease))
    _write_back(webhook_id, done, unrun)
    return len(done), spent, go_on


class _HttpFailure(Exception):
    """A receiver's non-2xx answer, as the single path's RetryableError reads."""


def _fence(lease: services.Lease) -> dict[str, Any]:
    return {"job": lease.job_id, "lv": lease.lease_version, "owner": lease.worker_id}


def _webhook(webhook_id: int) -> tuple[str, bool, str] | None:
    with connection.cursor() as cur:
        cur.execute(_WEBHOOK_SQL, [webhook_id])
        return cur.fetchone()


def _write_back(webhook_id: int, done: list[Called], unrun: list[services.Lease]) -> None:
    """Every attempt's bookkeeping, the completions, the failures and the release of the
    deliveries not called, in one transaction (one commit for the batch)."""
    ok = [c for c in done if c.failure is None]
    gone = [c for c in done if c.code == 410]
    failed = [c for c in done if c.failure is not None and c.code != 410]
    with transaction.atomic():
        if done:
            with connection.cursor() as cur:
                cur.execute(_ATTEMPTS_SQL, [
                    [c.delivery_id for c in done], [c.code for c in done],
                    [c.error if c.failure is not None else "" for c in done],
                    [c.lease.job_id for c in done], [c.lease.lease_version for c in done],
                    [c.lease.worker_id for c in done]])  # fmt: skip
                for c in gone:
                    cur.execute(_DISABLE_SQL, {**_fence(c.lease), "webhook": webhook_id,
                                               "reason": "410 Gone"})  # fmt: skip
        services.complete([(c.lease, {"status": c.code}) for c in ok])
        services.fail(
            [(c.lease, f"webhook {webhook_id} answered 410 Gone: disabled", True,
              "jobs.events.webhooks.Gone") for c in gone]
            + [(c.lease, _message(webhook_id, c), False, class_path(c.failure), None,
                c.retry_after) for c in failed]
        )  # fmt: skip
        services.release(unrun, "not called in its endpoint's run", unstarted=True)
    for outcome, n in (("delivered", len(ok)), ("gone", len(gone))):
        if n:
            metrics.WEBHOOK_DELIVERIES.labels(outcome).inc(n)
    for c in failed:
        metrics.WEBHOOK_DELIVERIES.labels(_outcome(c)).inc()
    if gone:
        log.warning("webhook %s answered 410: disabled", webhook_id,
                    extra={"job_id": gone[0].lease.job_id,
                           "lease_version": gone[0].lease.lease_version,
                           "worker_id": gone[0].lease.worker_id})  # fmt: skip


def _outcome(c: Called) -> str:
    if c.code is not None:
        return "http_error"
    return "timeout" if "Timeout" in c.error or "Deadline" in c.error else "error"


def _message(webhook_id: int, c: Called) -> str:
    if c.code is not None:
        return f"webhook {webhook_id} answered HTTP {c.code}"
    return f"webhook {webhook_id}: {c.error}"
