"""The webhooks fan-out's write for one outbox batch, in one statement (issue 41).

Per tick the fan-out wrote the batch's delivery rows, read which chains (webhook,
source job) were busy, read each idle chain's first waiting delivery, submitted one
job per such delivery and attached the jobs to their rows: five statements, and a
drain's thousands of events a second kept the webhooks cursor seconds behind. Here
the delivery rows and the ids of their jobs are drawn first (as submit_many draws a
job's), so one statement writes the new rows with their jobs already attached, the
jobs themselves (queued, like submit_many's), and the job of an idle chain's older
waiting row. A chain still gets a job only for its first waiting delivery, and only
while its delivery job is not running: per-job `seq` order as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import psycopg
from django.db import connection, transaction

from jobs import metrics, services
from jobs.conf import settings
from jobs.events import signing
from jobs.lifecycle import TERMINAL, Status, sql_list
from jobs.models import Job, WebhookDelivery

J = Job._meta.db_table
D = WebhookDelivery._meta.db_table

_FAN_OUT_SQL = f"""
WITH input AS MATERIALIZED (
  SELECT u.*, nextval(pg_get_serial_sequence('{D}', 'id')) AS id
  FROM unnest(%(webhooks)b::bigint[], %(events)b::bigint[], %(sources)b::bigint[],
              %(seqs)b::int[], %(types)b::text[], %(bodies)b::text[], %(traces)b::text[])
       AS u(webhook_id, event_id, source_job_id, seq, type, body, trace)
  WHERE NOT EXISTS (SELECT FROM {D} x  -- a batch repeated after a crash
                    WHERE x.webhook_id = u.webhook_id AND x.event_id = u.event_id)
), idle AS (
  SELECT c.webhook_id, c.source_job_id
  FROM unnest(%(chain_webhooks)b::bigint[], %(chain_sources)b::bigint[])
       AS c(webhook_id, source_job_id)
  WHERE NOT EXISTS (
    SELECT FROM {D} b JOIN {J} j ON j.id = b.job_id
    WHERE b.webhook_id = c.webhook_id AND b.source_job_id = c.source_job_id
      AND j.status NOT IN ({sql_list(TERMINAL)}))
), waiting AS (
  SELECT d.id, d.webhook_id, d.source_job_id, d.seq, false AS new, NULL::text AS trace
  FROM {D} d JOIN idle USING (webhook_id, source_job_id) WHERE d.job_id IS NULL
  UNION ALL
  SELECT i.id, i.webhook_id, i.source_job_id, i.seq, true, i.trace
  FROM input i JOIN idle USING (webhook_id, source_job_id)
), firsts AS MATERIALIZED (
  SELECT DISTINCT ON (webhook_id, source_job_id) id, new, source_job_id, trace
  FROM waiting ORDER BY webhook_id, source_job_id, seq, id
), heads AS MATERIALIZED (
  SELECT f.id AS delivery_id, f.new, f.source_job_id, f.trace,
         nextval(pg_get_serial_sequence('{J}', 'id')) AS job_id
  FROM (SELECT * FROM firsts ORDER BY id LIMIT %(room)s) f
), jobs AS (
  INSERT INTO {J} (id, task, payload, queue, priority, run_at, max_retries, client_id,
                   updated_by, status, retry_count, lease_version, trace_context)
  SELECT job_id, %(task)s, jsonb_build_object('delivery_id', delivery_id), %(queue)s, 0,
         now(), %(max_retries)s, NULL, %(actor)s, '{Status.QUEUED}', 0, 0,
         -- a delivery goes on in its source job's trace (D303): its call's traceparent,
         -- read with the batch's event, or for an older waiting delivery from its job
         CASE WHEN heads.new THEN heads.trace
              ELSE (SELECT s.trace_context FROM {J} s WHERE s.id = heads.source_job_id) END
  FROM heads
  RETURNING id
), added AS (
  INSERT INTO {D} (id, webhook_id, event_id, source_job_id, seq, type, body, attempts,
                   last_error, created_at, job_id)
  SELECT i.id, i.webhook_id, i.event_id, i.source_job_id, i.seq, i.type, i.body, 0, '',
         now(), h.job_id
  FROM input i LEFT JOIN heads h ON h.delivery_id = i.id AND h.new
  ON CONFLICT (webhook_id, event_id) DO NOTHING
  RETURNING id
), attached AS (
  UPDATE {D} d SET job_id = h.job_id FROM heads h WHERE d.id = h.delivery_id AND NOT h.new
  RETURNING d.id
)
SELECT (SELECT count(*) FROM added), (SELECT count(*) FROM firsts),
       ARRAY(SELECT id FROM jobs ORDER BY id), (SELECT count(*) FROM attached)
"""


@dataclass(frozen=True, slots=True)
class FannedOut:
    added: int  # delivery rows written
    released: int  # delivery jobs submitted (one per idle chain, as room allowed)
    held: int  # idle chains left without a job: the webhooks queue was full


def fan_out(rows: Sequence[tuple], chains: Iterable[tuple[int, int]], room: int,
            actor: str) -> FannedOut:  # fmt: skip
    """Write `rows` (webhook, event, source job, seq, type, body, the source job's trace
    context) as waiting deliveries and give each idle chain among `chains` (webhook,
    source job) a job for its first waiting delivery, up to `room` jobs, in one
    statement; the jobs are signalled once the caller's transaction commits."""
    chains = sorted(set(chains))
    columns = [list(c) for c in zip(*rows, strict=True)] if rows else [[]] * 7
    params = dict(zip(("webhooks", "events", "sources", "seqs", "types", "bodies", "traces"),
                      columns, strict=True))  # fmt: skip
    params.update(
        chain_webhooks=[c[0] for c in chains], chain_sources=[c[1] for c in chains],
        room=max(room, 0), task=signing.DELIVER_TASK, queue=signing.WEBHOOK_QUEUE,
        max_retries=settings.JOBS_WEBHOOK_MAX_RETRIES, actor=actor,
    )  # fmt: skip
    # Bound by the server, the arrays sent in binary: Django's cursor quotes each body
    # into the text of the statement in Python, a fifth of the relay's CPU (issue 41).
    # Through Django's cursor wrapper all the same: its execute wrappers and query log.
    connection.ensure_connection()
    with connection._prepare_cursor(psycopg.Cursor(connection.connection)) as cur:
        cur.execute(_FAN_OUT_SQL, params)
        added, firsts, jobs, _ = cur.fetchone()
    if jobs:
        queue = signing.WEBHOOK_QUEUE
        submitted = metrics.child(metrics.SUBMITTED, queue, signing.DELIVER_TASK)
        n = len(jobs)
        transaction.on_commit(lambda: submitted.inc(n))
        services.signal_after_commit([(j, queue) for j in jobs], park_on_failure=True)
    return FannedOut(added, len(jobs), firsts - len(jobs))
