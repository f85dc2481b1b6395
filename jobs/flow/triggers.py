"""The database side of sequences and batches: functions and triggers on jobs_job.

Generated here, installed frozen by migration 0027 (jobs/migrations/_triggers.py;
tests/test_flow_triggers.py holds the two equal). They add to the guard, history and
workflow triggers; they replace none. Every path that ends or revives a job (the
worker's fenced writes, the reaper, cancels, staff retries, raw SQL) runs through them,
so no caller has to remember a sequence or a batch.

Sequences (one job of a key at a time, in submission order):
- `jobs_job_sequence_enter` (BEFORE INSERT of a live job, and BEFORE UPDATE when a
  terminal job is made live again, per row, only for rows with a sequence_key; the
  mover's row movement inserts finished jobs, which it leaves alone): takes the key's
  jobs_sequence row lock (an upsert, so concurrent submissions queue behind each other
  and positions follow the order they got the lock). The job runs at once when the
  sequence is idle; else it waits with run_at BLOCKED_RUN_AT and wait_reason
  `sequence` (`sequence_halted` while halted), in jobs_sequencewait at the next
  position. A staff retry of the job that halted the sequence resumes it.
- `jobs_job_flow` (AFTER UPDATE, per statement): when the sequence's active job ends
  done (or cancelled) the next waiting job is made due (`jobs_sequence_wake`); when it
  fails, the sequence halts and its waiting jobs show `sequence_halted`.
  The active job id is checked against the jobs table, never trusted: an insert that
  ON CONFLICT skipped leaves a phantom id, which the next submission takes over.

Batches (callbacks once every job ended):
- `jobs_job_flow` also counts, per statement, the batch jobs that ended (and those a
  staff retry made live again) into jobs_batch; the statement that takes `pending` to
  zero sets finished_at and inserts the callback jobs (`jobs_batch_finish`) in the same
  transaction: the batch row lock makes it exactly one statement. Failed ids are kept
  in jobs_batchfailure as they happen, so the callback never scans the batch's jobs.
"""

from __future__ import annotations

from jobs.lifecycle import (
    BLOCKED_RUN_AT,
    CANCELLED,
    NON_TERMINAL,
    TERMINAL,
    Role,
    Status,
    hot_sql,
    sql_list,
)
from jobs.lifecycle import WaitReason as W

T = "jobs_job"
_TERMINAL = sql_list(TERMINAL)
_LIVE = sql_list(NON_TERMINAL)
_WAITING = f"'{W.SEQUENCE}', '{W.SEQUENCE_HALTED}'"
CALLBACKS = ("on_complete", "on_success", "on_failure")


def _halt_marks(seq: str, old: str, new: str) -> str:
    """Every waiting job of sequence `seq` from wait_reason `old` to `new`."""
    return f"""UPDATE {T} SET wait_reason = '{new}'
      WHERE id = ANY(ARRAY(SELECT job_id FROM jobs_sequencewait WHERE sequence_id = {seq}))
        AND status = '{Status.QUEUED}' AND wait_reason = '{old}' AND {hot_sql()}"""


def sequence_sql() -> str:
    return f"""
CREATE OR REPLACE FUNCTION jobs_sequence_wake(seq bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
  w record;
  woken bigint;
BEGIN
  LOOP
    SELECT id, job_id INTO w FROM jobs_sequencewait WHERE sequence_id = seq
    ORDER BY position LIMIT 1;
    IF NOT FOUND THEN
      UPDATE jobs_sequence SET active_job_id = NULL, updated_at = now() WHERE id = seq;
      RETURN NULL;
    END IF;
    DELETE FROM jobs_sequencewait WHERE id = w.id;
    UPDATE {T} SET run_at = now(), due_at = now(), wait_reason = NULL,
           updated_by = '{Role.API}'
    WHERE id = w.job_id AND status = '{Status.QUEUED}' AND wait_reason IN ({_WAITING})
      AND {hot_sql()}
    RETURNING id INTO woken;
    IF woken IS NOT NULL THEN
      UPDATE jobs_sequence SET active_job_id = woken, updated_at = now() WHERE id = seq;
      RETURN woken;
    END IF;
  END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION {T}_sequence_enter() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  s record;
BEGIN
  IF NEW.status IN ({_TERMINAL}) THEN  -- a finished job the mover moves between partitions
    RETURN NEW;
  END IF;
  INSERT INTO jobs_sequence AS q (owner, key, last_position, created_at, updated_at)
  VALUES (COALESCE(NEW.client_id, 0), NEW.sequence_key, 0, now(), now())
  ON CONFLICT (owner, key) DO UPDATE SET updated_at = now()
  RETURNING q.id, q.active_job_id, q.halted_job_id, q.last_position INTO s;
  IF TG_OP = 'UPDATE' THEN
    DELETE FROM jobs_sequencewait WHERE sequence_id = s.id AND job_id = NEW.id;
    IF s.halted_job_id = NEW.id THEN  -- the job that halted it, retried: resume
      UPDATE jobs_sequence SET halted_job_id = NULL, halted_at = NULL,
             active_job_id = NEW.id, updated_at = now() WHERE id = s.id;
      {_halt_marks("s.id", W.SEQUENCE_HALTED, W.SEQUENCE)};
      RETURN NEW;
    END IF;
  END IF;
  IF s.halted_job_id IS NULL AND (
       s.active_job_id IS NULL OR s.active_job_id = NEW.id
       OR NOT EXISTS (SELECT 1 FROM {T} j WHERE j.id = s.active_job_id
                      AND j.status IN ({_LIVE}) AND {hot_sql("j")})) THEN
    UPDATE jobs_sequence SET active_job_id = NEW.id WHERE id = s.id;
    RETURN NEW;
  END IF;
  UPDATE jobs_sequence SET last_position = s.last_position + 1 WHERE id = s.id;
  INSERT INTO jobs_sequencewait (sequence_id, position, job_id)
  VALUES (s.id, s.last_position + 1, NEW.id);
  NEW.run_at := '{BLOCKED_RUN_AT}';
  NEW.wait_reason := CASE WHEN s.halted_job_id IS NULL THEN '{W.SEQUENCE}'
                          ELSE '{W.SEQUENCE_HALTED}' END;
  RETURN NEW;
END
$$;
"""


# What a callback's payload gets under "batch": each key and its SQL.
SUMMARY = {
    "id": "bt.id",
    "name": "bt.name",
    "total": "bt.total",
    "succeeded": "bt.succeeded",
    "failed": "bt.failed",
    "failed_ids": "COALESCE((SELECT jsonb_agg(job_id ORDER BY job_id)\n"
    "                            FROM jobs_batchfailure WHERE batch_id = b), '[]'::jsonb)",
}


def _summary_sql() -> str:
    return ",\n    ".join(f"'{key}', {value}" for key, value in SUMMARY.items())


def batch_sql() -> str:
    kinds = ", ".join(f"'{k}'" for k in CALLBACKS)
    return f"""
CREATE OR REPLACE FUNCTION jobs_batch_finish(b bigint) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
  bt record;
  cb record;
  summary jsonb;
  made bigint;
  ids bigint[] := '{{}}';
BEGIN
  SELECT * INTO bt FROM jobs_batch WHERE id = b;
  summary := jsonb_build_object(
    {_summary_sql()});
  FOR cb IN
    SELECT k.kind, bt.callbacks -> k.kind AS spec
    FROM unnest(ARRAY[{kinds}]) WITH ORDINALITY AS k(kind, ord)
    WHERE bt.callbacks ? k.kind
      AND (k.kind = 'on_complete' OR (k.kind = 'on_success') = (bt.failed = 0))
    ORDER BY k.ord
  LOOP
    INSERT INTO {T} (task, payload, queue, priority, max_retries, timeout, client_id,
                     updated_by, status, retry_count, lease_version)
    VALUES (cb.spec ->> 'task',
            CASE WHEN (cb.spec ->> 'kwargs')::boolean
                 THEN jsonb_set(cb.spec -> 'payload', '{{kwargs,batch}}', summary)
                 ELSE (cb.spec -> 'payload') || jsonb_build_object('batch', summary) END,
            cb.spec ->> 'queue', (cb.spec ->> 'priority')::int,
            (cb.spec ->> 'max_retries')::int, (cb.spec ->> 'timeout')::float8,
            bt.client_id, '{Role.API}', '{Status.QUEUED}', 0, 0)
    RETURNING id INTO made;
    ids := ids || made;
  END LOOP;
  UPDATE jobs_batch SET callback_job_ids = ids WHERE id = b;
END
$$;
"""


def flow_function_sql() -> str:
    """The statement trigger's function. The transition tables are filtered to the
    flow's rows before they are joined, and joined by hash (a nested loop over two
    tables the planner guesses at one row each would be rows x rows)."""
    return f"""
CREATE OR REPLACE FUNCTION {T}_flow() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  e record;
  s record;
  finished bigint[];
  b bigint;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM {T}_flow_new
                 WHERE sequence_key IS NOT NULL OR batch_id IS NOT NULL) THEN
    RETURN NULL;
  END IF;

  FOR e IN
    SELECT n.id, n.status, n.error, n.client_id, n.sequence_key
    FROM (SELECT id, status, error, client_id, sequence_key FROM {T}_flow_new
          WHERE sequence_key IS NOT NULL AND status IN ({_TERMINAL})) n
    JOIN (SELECT id FROM {T}_flow_old
          WHERE sequence_key IS NOT NULL AND status NOT IN ({_TERMINAL})) o ON o.id = n.id
    ORDER BY n.id
  LOOP
    SELECT id, active_job_id INTO s FROM jobs_sequence
    WHERE owner = COALESCE(e.client_id, 0) AND key = e.sequence_key FOR UPDATE;
    IF FOUND AND s.active_job_id = e.id THEN
      IF e.status = '{Status.FAILED}' AND e.error IS DISTINCT FROM '{CANCELLED}' THEN
        UPDATE jobs_sequence SET active_job_id = NULL, halted_job_id = e.id,
               halted_at = now(), updated_at = now() WHERE id = s.id;
        {_halt_marks("s.id", W.SEQUENCE, W.SEQUENCE_HALTED)};
      ELSE
        PERFORM jobs_sequence_wake(s.id);
      END IF;
    END IF;
  END LOOP;

  WITH ch AS MATERIALIZED (
    SELECT n.id, n.batch_id, n.status AS now_status, o.status AS was_status
    FROM (SELECT id, batch_id, status FROM {T}_flow_new WHERE batch_id IS NOT NULL) n
    JOIN (SELECT id, status FROM {T}_flow_old WHERE batch_id IS NOT NULL) o ON o.id = n.id
    WHERE (n.status IN ({_TERMINAL})) <> (o.status IN ({_TERMINAL}))
  ), failures AS (
    INSERT INTO jobs_batchfailure (batch_id, job_id)
    SELECT batch_id, id FROM ch WHERE now_status = '{Status.FAILED}'
    ON CONFLICT DO NOTHING
  ), revived AS (
    DELETE FROM jobs_batchfailure f USING ch
    WHERE ch.was_status = '{Status.FAILED}' AND f.batch_id = ch.batch_id AND f.job_id = ch.id
  ), counted AS (
    SELECT batch_id,
           sum(CASE WHEN now_status IN ({_TERMINAL}) THEN -1 ELSE 1 END) AS d_pending,
           count(*) FILTER (WHERE now_status = '{Status.DONE}')
             - count(*) FILTER (WHERE was_status = '{Status.DONE}') AS d_done,
           count(*) FILTER (WHERE now_status = '{Status.FAILED}')
             - count(*) FILTER (WHERE was_status = '{Status.FAILED}') AS d_failed
    FROM ch GROUP BY batch_id
  ), updated AS (
    UPDATE jobs_batch bt SET pending = bt.pending + c.d_pending,
           succeeded = bt.succeeded + c.d_done, failed = bt.failed + c.d_failed,
           finished_at = CASE WHEN bt.pending + c.d_pending <= 0 THEN statement_timestamp() END
    FROM counted c WHERE bt.id = c.batch_id AND bt.finished_at IS NULL
    RETURNING bt.id, bt.finished_at
  )
  SELECT array_agg(id ORDER BY id) INTO finished FROM updated WHERE finished_at IS NOT NULL;
  IF finished IS NOT NULL THEN
    FOREACH b IN ARRAY finished LOOP
      PERFORM jobs_batch_finish(b);
    END LOOP;
  END IF;
  RETURN NULL;
END
$$;
ALTER FUNCTION {T}_flow() SET enable_nestloop = off;
"""


def _trigger_once(name: str, definition: str) -> str:
    """Create the trigger only if it is missing: a DROP/CREATE on a live jobs_job would
    wait for an exclusive lock."""
    return f"""DO $do$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = '{T}'::regclass
                 AND tgname = '{name}') THEN
    {definition};
  END IF;
END $do$;
"""


def triggers_sql() -> str:
    """Every function and trigger; names sort after jobs_job_guard, so the guard has
    checked the row before a sequence blocks it."""
    return (
        sequence_sql()
        + batch_sql()
        + flow_function_sql()
        + _trigger_once(
            f"{T}_sequence_enter",
            f"""CREATE TRIGGER {T}_sequence_enter BEFORE INSERT ON {T} FOR EACH ROW
      WHEN (NEW.sequence_key IS NOT NULL AND NEW.status NOT IN ({_TERMINAL}))
      EXECUTE FUNCTION {T}_sequence_enter()""",
        )
        + _trigger_once(
            f"{T}_sequence_revive",
            f"""CREATE TRIGGER {T}_sequence_revive BEFORE UPDATE ON {T} FOR EACH ROW
      WHEN (NEW.sequence_key IS NOT NULL AND OLD.status IN ({_TERMINAL})
            AND NEW.status NOT IN ({_TERMINAL}))
      EXECUTE FUNCTION {T}_sequence_enter()""",
        )
        + _trigger_once(
            f"{T}_flow",
            f"""CREATE TRIGGER {T}_flow AFTER UPDATE ON {T}
      REFERENCING OLD TABLE AS {T}_flow_old NEW TABLE AS {T}_flow_new
      FOR EACH STATEMENT EXECUTE FUNCTION {T}_flow()""",
        )
    )


def drop_triggers_sql() -> str:
    return f"""
DROP TRIGGER IF EXISTS {T}_flow ON {T};
DROP TRIGGER IF EXISTS {T}_sequence_revive ON {T};
DROP TRIGGER IF EXISTS {T}_sequence_enter ON {T};
DROP FUNCTION IF EXISTS {T}_flow();
DROP FUNCTION IF EXISTS {T}_sequence_enter();
DROP FUNCTION IF EXISTS jobs_batch_finish(bigint);
DROP FUNCTION IF EXISTS jobs_sequence_wake(bigint);
"""
