"""Trigger SQL as each migration installed it, frozen (issue 34).

`jobs.lifecycle.guard_trigger_sql` and `jobs.graph.triggers_sql` generate the triggers
from today's rules; a migration that called them would install a later version than
the one it was written for, and a change to the rules would silently change what an
old migration does. So each migration installs (and its reverse restores) a text kept
here, and a change to the rules ships as a new migration with a new text here:
`tests/test_migrations_frozen.py` fails while the newest text differs from what the
modules generate, or while a migration imports them. The leading underscore keeps
Django's migration loader from reading this module as a migration.
"""

# 0002_lifecycle_guard: the guard, and a history trigger per row.
GUARD_0002 = """
CREATE OR REPLACE FUNCTION jobs_job_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF NEW.status <> 'queued' OR NEW.lease_version <> 0 THEN
      RAISE EXCEPTION 'illegal job insert: status % lease_version %', NEW.status, NEW.lease_version
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_insert';
    END IF;
    RETURN NEW;
  END IF;
  IF TG_OP = 'DELETE' THEN
    IF OLD.status NOT IN ('done', 'failed') THEN
      RAISE EXCEPTION 'illegal job delete: job % is %', OLD.id, OLD.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_delete_terminal_only';
    END IF;
    RETURN OLD;
  END IF;
  IF NEW.lease_version < OLD.lease_version THEN
    RAISE EXCEPTION 'illegal lease_version decrease on job %: % -> %',
      OLD.id, OLD.lease_version, NEW.lease_version
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_monotonic';
  END IF;
  IF NEW.status <> OLD.status THEN
    IF (OLD.status || '>' || NEW.status) NOT IN ('enqueue_failed>failed', 'enqueue_failed>queued', 'failed>queued', 'processing>done', 'processing>failed', 'processing>queued', 'queued>enqueue_failed', 'queued>failed', 'queued>processing') THEN
      RAISE EXCEPTION 'illegal job transition on job %: % -> %', OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_transition';
    END IF;
    IF (OLD.status || '>' || NEW.status) IN ('processing>queued', 'queued>processing')
       AND NEW.lease_version <= OLD.lease_version THEN
      RAISE EXCEPTION 'job % changed hands (% -> %) without a lease bump',
        OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
    END IF;
  ELSIF NEW.status = 'processing'
        AND NEW.owned_by IS NOT NULL AND NEW.owned_by IS DISTINCT FROM OLD.owned_by
        AND NEW.lease_version <= OLD.lease_version THEN
    RAISE EXCEPTION 'job % changed owner without a lease bump', OLD.id
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
  END IF;
  NEW.updated_at := now();
  RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION jobs_job_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' OR NEW.status <> OLD.status THEN
    INSERT INTO jobs_jobevent
      (job_id, at, from_status, to_status, actor, lease_version, retry_count, error)
    VALUES (NEW.id, now(), CASE WHEN TG_OP = 'INSERT' THEN NULL ELSE OLD.status END,
            NEW.status, COALESCE(NEW.updated_by, ''), NEW.lease_version, NEW.retry_count,
            CASE WHEN NEW.status = 'done' THEN NULL ELSE NEW.error END);
  END IF;
  RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS jobs_job_guard ON jobs_job;
CREATE TRIGGER jobs_job_guard BEFORE INSERT OR UPDATE OR DELETE ON jobs_job
  FOR EACH ROW EXECUTE FUNCTION jobs_job_guard();
DROP TRIGGER IF EXISTS jobs_job_history ON jobs_job;
CREATE TRIGGER jobs_job_history AFTER INSERT OR UPDATE ON jobs_job
  FOR EACH ROW EXECUTE FUNCTION jobs_job_history();
"""

# Unapplying 0002: every trigger and function any version installed.
DROP_GUARD = """
DROP TRIGGER IF EXISTS jobs_job_history ON jobs_job;
DROP TRIGGER IF EXISTS jobs_job_history_insert ON jobs_job;
DROP TRIGGER IF EXISTS jobs_job_history_update ON jobs_job;
DROP TRIGGER IF EXISTS jobs_job_guard ON jobs_job;
DROP FUNCTION IF EXISTS jobs_job_history();
DROP FUNCTION IF EXISTS jobs_job_history_insert();
DROP FUNCTION IF EXISTS jobs_job_history_update();
DROP FUNCTION IF EXISTS jobs_job_guard();
"""

# Unapplying 0006: back to 0002's history trigger per row.
HISTORY_PER_ROW = """
DROP TRIGGER IF EXISTS jobs_job_history_insert ON jobs_job;
DROP TRIGGER IF EXISTS jobs_job_history_update ON jobs_job;
DROP FUNCTION IF EXISTS jobs_job_history_insert();
DROP FUNCTION IF EXISTS jobs_job_history_update();
CREATE OR REPLACE FUNCTION jobs_job_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' OR NEW.status <> OLD.status THEN
    INSERT INTO jobs_jobevent
      (job_id, at, from_status, to_status, actor, lease_version, retry_count, error)
    VALUES (NEW.id, now(), CASE WHEN TG_OP = 'INSERT' THEN NULL ELSE OLD.status END,
            NEW.status, COALESCE(NEW.updated_by, ''), NEW.lease_version, NEW.retry_count,
            CASE WHEN NEW.status = 'done' THEN NULL ELSE NEW.error END);
  END IF;
  RETURN NULL;
END
$$;
CREATE TRIGGER jobs_job_history AFTER INSERT OR UPDATE ON jobs_job
  FOR EACH ROW EXECUTE FUNCTION jobs_job_history();
"""

# 0006_history_per_statement: history once per statement (transition tables).
GUARD_0006 = """
CREATE OR REPLACE FUNCTION jobs_job_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF NEW.status <> 'queued' OR NEW.lease_version <> 0 THEN
      RAISE EXCEPTION 'illegal job insert: status % lease_version %', NEW.status, NEW.lease_version
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_insert';
    END IF;
    RETURN NEW;
  END IF;
  IF TG_OP = 'DELETE' THEN
    IF OLD.status NOT IN ('done', 'failed') THEN
      RAISE EXCEPTION 'illegal job delete: job % is %', OLD.id, OLD.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_delete_terminal_only';
    END IF;
    RETURN OLD;
  END IF;
  IF NEW.lease_version < OLD.lease_version THEN
    RAISE EXCEPTION 'illegal lease_version decrease on job %: % -> %',
      OLD.id, OLD.lease_version, NEW.lease_version
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_monotonic';
  END IF;
  IF NEW.status <> OLD.status THEN
    IF (OLD.status || '>' || NEW.status) NOT IN ('enqueue_failed>failed', 'enqueue_failed>queued', 'failed>queued', 'processing>done', 'processing>failed', 'processing>queued', 'queued>enqueue_failed', 'queued>failed', 'queued>processing') THEN
      RAISE EXCEPTION 'illegal job transition on job %: % -> %', OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_transition';
    END IF;
    IF (OLD.status || '>' || NEW.status) IN ('processing>queued', 'queued>processing')
       AND NEW.lease_version <= OLD.lease_version THEN
      RAISE EXCEPTION 'job % changed hands (% -> %) without a lease bump',
        OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
    END IF;
  ELSIF NEW.status = 'processing'
        AND NEW.owned_by IS NOT NULL AND NEW.owned_by IS DISTINCT FROM OLD.owned_by
        AND NEW.lease_version <= OLD.lease_version THEN
    RAISE EXCEPTION 'job % changed owner without a lease bump', OLD.id
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
  END IF;
  NEW.updated_at := now();
  RETURN NEW;
END
$$;

-- History, one statement per write: the rows a statement changed are read from its
-- transition tables, so a batch of N transitions costs one INSERT, not N trigger calls.
CREATE OR REPLACE FUNCTION jobs_job_history_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error)
  SELECT n.id, now(), NULL, n.status, COALESCE(n.updated_by, ''), n.lease_version,
         n.retry_count, CASE WHEN n.status = 'done' THEN NULL ELSE n.error END
  FROM jobs_job_new n;
  RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION jobs_job_history_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error)
  SELECT n.id, now(), o.status, n.status, COALESCE(n.updated_by, ''), n.lease_version,
         n.retry_count, CASE WHEN n.status = 'done' THEN NULL ELSE n.error END
  FROM jobs_job_new n JOIN jobs_job_old o ON o.id = n.id
  WHERE n.status <> o.status;
  RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS jobs_job_guard ON jobs_job;
CREATE TRIGGER jobs_job_guard BEFORE INSERT OR UPDATE OR DELETE ON jobs_job
  FOR EACH ROW EXECUTE FUNCTION jobs_job_guard();
DROP TRIGGER IF EXISTS jobs_job_history ON jobs_job;
DROP FUNCTION IF EXISTS jobs_job_history();
DROP TRIGGER IF EXISTS jobs_job_history_insert ON jobs_job;
CREATE TRIGGER jobs_job_history_insert AFTER INSERT ON jobs_job
  REFERENCING NEW TABLE AS jobs_job_new
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_history_insert();
DROP TRIGGER IF EXISTS jobs_job_history_update ON jobs_job;
CREATE TRIGGER jobs_job_history_update AFTER UPDATE ON jobs_job
  REFERENCING OLD TABLE AS jobs_job_old NEW TABLE AS jobs_job_new
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_history_update();
"""

# 0007_error_detail_and_due_at: the attempt's error class and traceback, due_at.
GUARD_0007 = """
CREATE OR REPLACE FUNCTION jobs_job_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF NEW.status <> 'queued' OR NEW.lease_version <> 0 THEN
      RAISE EXCEPTION 'illegal job insert: status % lease_version %', NEW.status, NEW.lease_version
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_insert';
    END IF;
    NEW.due_at := greatest(NEW.created_at, NEW.run_at);
    RETURN NEW;
  END IF;
  IF TG_OP = 'DELETE' THEN
    IF OLD.status NOT IN ('done', 'failed') THEN
      RAISE EXCEPTION 'illegal job delete: job % is %', OLD.id, OLD.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_delete_terminal_only';
    END IF;
    RETURN OLD;
  END IF;
  IF NEW.lease_version < OLD.lease_version THEN
    RAISE EXCEPTION 'illegal lease_version decrease on job %: % -> %',
      OLD.id, OLD.lease_version, NEW.lease_version
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_monotonic';
  END IF;
  IF NEW.status <> OLD.status THEN
    IF (OLD.status || '>' || NEW.status) NOT IN ('enqueue_failed>failed', 'enqueue_failed>queued', 'failed>queued', 'processing>done', 'processing>failed', 'processing>queued', 'queued>enqueue_failed', 'queued>failed', 'queued>processing') THEN
      RAISE EXCEPTION 'illegal job transition on job %: % -> %', OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_transition';
    END IF;
    IF (OLD.status || '>' || NEW.status) IN ('processing>queued', 'queued>processing')
       AND NEW.lease_version <= OLD.lease_version THEN
      RAISE EXCEPTION 'job % changed hands (% -> %) without a lease bump',
        OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
    END IF;
    IF NEW.status = 'processing' THEN
      -- A new attempt starts without the last one's error detail.
      NEW.error_class := NULL;
      NEW.error_traceback := NULL;
    END IF;
  ELSIF NEW.status = 'processing'
        AND NEW.owned_by IS NOT NULL AND NEW.owned_by IS DISTINCT FROM OLD.owned_by
        AND NEW.lease_version <= OLD.lease_version THEN
    RAISE EXCEPTION 'job % changed owner without a lease bump', OLD.id
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
  END IF;
  NEW.updated_at := statement_timestamp();
  RETURN NEW;
END
$$;

-- History, one statement per write: the rows a statement changed are read from its
-- transition tables, so a batch of N transitions costs one INSERT, not N trigger calls.
CREATE OR REPLACE FUNCTION jobs_job_history_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error)
  SELECT n.id, statement_timestamp(), NULL, n.status, COALESCE(n.updated_by, ''), n.lease_version,
         n.retry_count, CASE WHEN n.status = 'done' THEN NULL ELSE n.error END
  FROM jobs_job_new n;
  RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION jobs_job_history_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error,
     error_class, error_traceback)
  SELECT n.id, statement_timestamp(), o.status, n.status, COALESCE(n.updated_by, ''),
         n.lease_version, n.retry_count,
         CASE WHEN n.status = 'done' THEN NULL ELSE n.error END,
         CASE WHEN o.status = 'processing' THEN n.error_class END,
         CASE WHEN o.status = 'processing' THEN n.error_traceback END
  FROM jobs_job_new n JOIN jobs_job_old o ON o.id = n.id
  WHERE n.status <> o.status;
  RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS jobs_job_guard ON jobs_job;
CREATE TRIGGER jobs_job_guard BEFORE INSERT OR UPDATE OR DELETE ON jobs_job
  FOR EACH ROW EXECUTE FUNCTION jobs_job_guard();
DROP TRIGGER IF EXISTS jobs_job_history ON jobs_job;
DROP FUNCTION IF EXISTS jobs_job_history();
DROP TRIGGER IF EXISTS jobs_job_history_insert ON jobs_job;
CREATE TRIGGER jobs_job_history_insert AFTER INSERT ON jobs_job
  REFERENCING NEW TABLE AS jobs_job_new
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_history_insert();
DROP TRIGGER IF EXISTS jobs_job_history_update ON jobs_job;
CREATE TRIGGER jobs_job_history_update AFTER UPDATE ON jobs_job
  REFERENCING OLD TABLE AS jobs_job_old NEW TABLE AS jobs_job_new
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_history_update();
"""

# 0009_progress_and_cancel_request: a cancel request ends a requeued job.
GUARD_0009 = """
CREATE OR REPLACE FUNCTION jobs_job_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF NEW.status <> 'queued' OR NEW.lease_version <> 0 THEN
      RAISE EXCEPTION 'illegal job insert: status % lease_version %', NEW.status, NEW.lease_version
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_insert';
    END IF;
    NEW.due_at := greatest(NEW.created_at, NEW.run_at);
    RETURN NEW;
  END IF;
  IF TG_OP = 'DELETE' THEN
    IF OLD.status NOT IN ('done', 'failed') THEN
      RAISE EXCEPTION 'illegal job delete: job % is %', OLD.id, OLD.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_delete_terminal_only';
    END IF;
    RETURN OLD;
  END IF;
  IF NEW.lease_version < OLD.lease_version THEN
    RAISE EXCEPTION 'illegal lease_version decrease on job %: % -> %',
      OLD.id, OLD.lease_version, NEW.lease_version
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_monotonic';
  END IF;
  IF OLD.status = 'processing' AND NEW.status = 'queued'
     AND NEW.cancel_requested_at IS NOT NULL THEN
    NEW.status := 'failed';
    NEW.error := 'cancelled';
    NEW.finished_at := statement_timestamp();
  END IF;
  IF NEW.status <> OLD.status THEN
    IF (OLD.status || '>' || NEW.status) NOT IN ('enqueue_failed>failed', 'enqueue_failed>queued', 'failed>queued', 'processing>done', 'processing>failed', 'processing>queued', 'queued>enqueue_failed', 'queued>failed', 'queued>processing') THEN
      RAISE EXCEPTION 'illegal job transition on job %: % -> %', OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_transition';
    END IF;
    IF (OLD.status || '>' || NEW.status) IN ('processing>queued', 'queued>processing')
       AND NEW.lease_version <= OLD.lease_version THEN
      RAISE EXCEPTION 'job % changed hands (% -> %) without a lease bump',
        OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
    END IF;
    IF NEW.status = 'processing' THEN
      -- A new attempt starts without the last one's error detail or progress.
      NEW.error_class := NULL;
      NEW.error_traceback := NULL;
      NEW.progress := NULL;
    END IF;
  ELSIF NEW.status = 'processing'
        AND NEW.owned_by IS NOT NULL AND NEW.owned_by IS DISTINCT FROM OLD.owned_by
        AND NEW.lease_version <= OLD.lease_version THEN
    RAISE EXCEPTION 'job % changed owner without a lease bump', OLD.id
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
  END IF;
  NEW.updated_at := statement_timestamp();
  RETURN NEW;
END
$$;

-- History, one statement per write: the rows a statement changed are read from its
-- transition tables, so a batch of N transitions costs one INSERT, not N trigger calls.
CREATE OR REPLACE FUNCTION jobs_job_history_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error)
  SELECT n.id, statement_timestamp(), NULL, n.status, COALESCE(n.updated_by, ''), n.lease_version,
         n.retry_count, CASE WHEN n.status = 'done' THEN NULL ELSE n.error END
  FROM jobs_job_new n;
  RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION jobs_job_history_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error,
     error_class, error_traceback)
  SELECT n.id, statement_timestamp(), o.status, n.status, COALESCE(n.updated_by, ''),
         n.lease_version, n.retry_count,
         CASE WHEN n.status = 'done' THEN NULL ELSE n.error END,
         CASE WHEN o.status = 'processing' THEN n.error_class END,
         CASE WHEN o.status = 'processing' THEN n.error_traceback END
  FROM jobs_job_new n JOIN jobs_job_old o ON o.id = n.id
  WHERE n.status <> o.status;
  RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS jobs_job_guard ON jobs_job;
CREATE TRIGGER jobs_job_guard BEFORE INSERT OR UPDATE OR DELETE ON jobs_job
  FOR EACH ROW EXECUTE FUNCTION jobs_job_guard();
DROP TRIGGER IF EXISTS jobs_job_history ON jobs_job;
DROP FUNCTION IF EXISTS jobs_job_history();
DROP TRIGGER IF EXISTS jobs_job_history_insert ON jobs_job;
CREATE TRIGGER jobs_job_history_insert AFTER INSERT ON jobs_job
  REFERENCING NEW TABLE AS jobs_job_new
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_history_insert();
DROP TRIGGER IF EXISTS jobs_job_history_update ON jobs_job;
CREATE TRIGGER jobs_job_history_update AFTER UPDATE ON jobs_job
  REFERENCING OLD TABLE AS jobs_job_old NEW TABLE AS jobs_job_new
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_history_update();
"""

# 0013_event_outbox: event_seq on jobs and on their history rows.
GUARD_0013 = """
CREATE OR REPLACE FUNCTION jobs_job_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF NEW.status <> 'queued' OR NEW.lease_version <> 0 THEN
      RAISE EXCEPTION 'illegal job insert: status % lease_version %', NEW.status, NEW.lease_version
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_insert';
    END IF;
    NEW.due_at := greatest(NEW.created_at, NEW.run_at);
    NEW.event_seq := 1;
    RETURN NEW;
  END IF;
  IF TG_OP = 'DELETE' THEN
    IF OLD.status NOT IN ('done', 'failed') THEN
      RAISE EXCEPTION 'illegal job delete: job % is %', OLD.id, OLD.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_delete_terminal_only';
    END IF;
    RETURN OLD;
  END IF;
  IF NEW.lease_version < OLD.lease_version THEN
    RAISE EXCEPTION 'illegal lease_version decrease on job %: % -> %',
      OLD.id, OLD.lease_version, NEW.lease_version
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_monotonic';
  END IF;
  IF OLD.status = 'processing' AND NEW.status = 'queued'
     AND NEW.cancel_requested_at IS NOT NULL THEN
    NEW.status := 'failed';
    NEW.error := 'cancelled';
    NEW.finished_at := statement_timestamp();
  END IF;
  IF NEW.status <> OLD.status THEN
    IF (OLD.status || '>' || NEW.status) NOT IN ('enqueue_failed>failed', 'enqueue_failed>queued', 'failed>queued', 'processing>done', 'processing>failed', 'processing>queued', 'queued>enqueue_failed', 'queued>failed', 'queued>processing') THEN
      RAISE EXCEPTION 'illegal job transition on job %: % -> %', OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_transition';
    END IF;
    IF (OLD.status || '>' || NEW.status) IN ('processing>queued', 'queued>processing')
       AND NEW.lease_version <= OLD.lease_version THEN
      RAISE EXCEPTION 'job % changed hands (% -> %) without a lease bump',
        OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
    END IF;
    NEW.event_seq := COALESCE(OLD.event_seq, 0) + 1;
    IF NEW.status = 'processing' THEN
      -- A new attempt starts without the last one's error detail or progress.
      NEW.error_class := NULL;
      NEW.error_traceback := NULL;
      NEW.progress := NULL;
    END IF;
  ELSIF NEW.status = 'processing'
        AND NEW.owned_by IS NOT NULL AND NEW.owned_by IS DISTINCT FROM OLD.owned_by
        AND NEW.lease_version <= OLD.lease_version THEN
    RAISE EXCEPTION 'job % changed owner without a lease bump', OLD.id
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
  END IF;
  NEW.updated_at := statement_timestamp();
  RETURN NEW;
END
$$;

-- History, one statement per write: the rows a statement changed are read from its
-- transition tables, so a batch of N transitions costs one INSERT, not N trigger calls.
CREATE OR REPLACE FUNCTION jobs_job_history_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error, seq)
  SELECT n.id, statement_timestamp(), NULL, n.status, COALESCE(n.updated_by, ''), n.lease_version,
         n.retry_count, CASE WHEN n.status = 'done' THEN NULL ELSE n.error END,
         n.event_seq
  FROM jobs_job_new n;
  RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION jobs_job_history_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error,
     error_class, error_traceback, seq)
  SELECT n.id, statement_timestamp(), o.status, n.status, COALESCE(n.updated_by, ''),
         n.lease_version, n.retry_count,
         CASE WHEN n.status = 'done' THEN NULL ELSE n.error END,
         CASE WHEN o.status = 'processing' THEN n.error_class END,
         CASE WHEN o.status = 'processing' THEN n.error_traceback END,
         n.event_seq
  FROM jobs_job_new n JOIN jobs_job_old o ON o.id = n.id
  WHERE n.status <> o.status;
  RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS jobs_job_guard ON jobs_job;
CREATE TRIGGER jobs_job_guard BEFORE INSERT OR UPDATE OR DELETE ON jobs_job
  FOR EACH ROW EXECUTE FUNCTION jobs_job_guard();
DROP TRIGGER IF EXISTS jobs_job_history ON jobs_job;
DROP FUNCTION IF EXISTS jobs_job_history();
DROP TRIGGER IF EXISTS jobs_job_history_insert ON jobs_job;
CREATE TRIGGER jobs_job_history_insert AFTER INSERT ON jobs_job
  REFERENCING NEW TABLE AS jobs_job_new
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_history_insert();
DROP TRIGGER IF EXISTS jobs_job_history_update ON jobs_job;
CREATE TRIGGER jobs_job_history_update AFTER UPDATE ON jobs_job
  REFERENCING OLD TABLE AS jobs_job_old NEW TABLE AS jobs_job_new
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_history_update();
"""

# 0012_steps_workflows: workflow wake-ups and failures (jobs.graph).
WORKFLOW_TRIGGERS_0012 = """
CREATE OR REPLACE FUNCTION jobs_job_wait_clear() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  NEW.wait_reason := NULL;
  NEW.wait_key := NULL;
  RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS jobs_job_wait_clear ON jobs_job;
CREATE TRIGGER jobs_job_wait_clear BEFORE UPDATE ON jobs_job FOR EACH ROW
  WHEN (OLD.wait_reason IS NOT NULL AND NEW.status = 'processing'
        AND OLD.status <> 'processing')
  EXECUTE FUNCTION jobs_job_wait_clear();

CREATE OR REPLACE FUNCTION jobs_job_dependents() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NOT EXISTS (
    SELECT 1 FROM jobs_job_dep_new n JOIN jobs_job_dep_old o ON o.id = n.id
    JOIN jobs_workflownode wn ON wn.job_id = n.id
    WHERE n.status IN ('done', 'failed') AND o.status <> n.status) THEN
    RETURN NULL;
  END IF;

  WITH RECURSIVE roots AS (
    SELECT n.id, wn.key FROM jobs_job_dep_new n JOIN jobs_job_dep_old o ON o.id = n.id
    JOIN jobs_workflownode wn ON wn.job_id = n.id
    JOIN jobs_workflow w ON w.id = wn.workflow_id
    WHERE n.status = 'failed' AND o.status <> 'failed'
      AND w.on_failure = 'fail_dependents'
  ), descendants(id, root) AS (
    SELECT d.child_id, r.key FROM jobs_jobdependency d JOIN roots r ON d.parent_id = r.id
    UNION
    SELECT d.child_id, x.root FROM jobs_jobdependency d JOIN descendants x ON d.parent_id = x.id
  ), victims AS (
    SELECT id, min(root) AS root FROM descendants GROUP BY id
  )
  UPDATE jobs_job j SET status = 'failed', error = 'dependency failed: ' || v.root,
         finished_at = statement_timestamp(), result = NULL, wait_reason = NULL,
         updated_by = 'api'
  FROM victims v
  WHERE j.id = v.id AND j.status IN ('queued', 'enqueue_failed');

  WITH ended AS (
    SELECT n.id FROM jobs_job_dep_new n JOIN jobs_job_dep_old o ON o.id = n.id
    WHERE n.status IN ('done', 'failed') AND o.status <> n.status
  ), settled AS (
    UPDATE jobs_jobdependency d SET settled = true
    WHERE d.parent_id IN (SELECT id FROM ended) AND NOT d.settled
    RETURNING d.child_id
  ), counted AS (
    SELECT child_id, count(*) AS k FROM settled GROUP BY child_id
  ), pending AS (
    UPDATE jobs_workflownode wn SET pending_parents = greatest(wn.pending_parents - c.k, 0)
    FROM counted c WHERE wn.job_id = c.child_id
    RETURNING wn.job_id, wn.pending_parents
  )
  UPDATE jobs_job j SET run_at = now(), due_at = now(), wait_reason = NULL,
         updated_by = 'api'
  FROM pending p
  WHERE j.id = p.job_id AND p.pending_parents = 0
    AND j.status = 'queued' AND j.wait_reason = 'parents';

  WITH ended AS (
    UPDATE jobs_workflownode wn SET ended = true
    FROM jobs_job_dep_new n JOIN jobs_job_dep_old o ON o.id = n.id
    WHERE wn.job_id = n.id AND n.status IN ('done', 'failed') AND o.status <> n.status
      AND NOT wn.ended
    RETURNING wn.workflow_id
  ), counted AS (
    SELECT workflow_id, count(*) AS k FROM ended GROUP BY workflow_id
  )
  UPDATE jobs_workflow w SET unfinished = greatest(w.unfinished - c.k, 0),
         finished_at = CASE WHEN w.unfinished - c.k <= 0 THEN statement_timestamp()
                            ELSE w.finished_at END
  FROM counted c WHERE w.id = c.workflow_id;
  RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS jobs_job_dependents ON jobs_job;
CREATE TRIGGER jobs_job_dependents AFTER UPDATE ON jobs_job
  REFERENCING OLD TABLE AS jobs_job_dep_old NEW TABLE AS jobs_job_dep_new
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_dependents();
"""

# Unapplying 0012.
DROP_WORKFLOW_TRIGGERS_0012 = """
DROP TRIGGER IF EXISTS jobs_job_dependents ON jobs_job;
DROP FUNCTION IF EXISTS jobs_job_dependents();
DROP TRIGGER IF EXISTS jobs_job_wait_clear ON jobs_job;
DROP FUNCTION IF EXISTS jobs_job_wait_clear();
"""

# 0016_linear_workflows_backpressure: the dependents function walks each job once and
# writes no edge (D107); the triggers are created only if missing, so on a live table
# this replaces the two functions and takes no lock on jobs_job.
WORKFLOW_TRIGGERS_0016 = """
CREATE OR REPLACE FUNCTION jobs_job_wait_clear() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  NEW.wait_reason := NULL;
  NEW.wait_key := NULL;
  RETURN NEW;
END
$$;
DO $do$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'jobs_job'::regclass
                 AND tgname = 'jobs_job_wait_clear') THEN
    CREATE TRIGGER jobs_job_wait_clear BEFORE UPDATE ON jobs_job FOR EACH ROW
      WHEN (OLD.wait_reason IS NOT NULL AND NEW.status = 'processing'
            AND OLD.status <> 'processing')
      EXECUTE FUNCTION jobs_job_wait_clear();
  END IF;
END $do$;

CREATE OR REPLACE FUNCTION jobs_job_dependents() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  root record;
  ended_now bigint[];
  failed_now bigint[];
  victims bigint[];
  ended_ids bigint[];
  ended_workflows bigint[];
  children bigint[];
  settled int[];
  woken bigint[];
BEGIN
  SELECT array_agg(t.id), array_agg(t.id) FILTER (WHERE t.status = 'failed')
  INTO ended_now, failed_now FROM (
    SELECT id, status FROM jobs_job_dep_new WHERE status IN ('done', 'failed')
    EXCEPT
    SELECT id, status FROM jobs_job_dep_old WHERE status IN ('done', 'failed')) t;
  IF ended_now IS NULL
     OR NOT EXISTS (SELECT 1 FROM jobs_workflownode WHERE job_id = ANY(ended_now)) THEN
    RETURN NULL;
  END IF;

  FOR root IN
    SELECT wn.job_id AS id, wn.key FROM jobs_workflownode wn
    WHERE wn.job_id = ANY(failed_now)
      AND (SELECT w.on_failure FROM jobs_workflow w WHERE w.id = wn.workflow_id)
          = 'fail_dependents'
      AND EXISTS (SELECT 1 FROM jobs_jobdependency d WHERE d.parent_id = wn.job_id
                  AND (SELECT c.status FROM jobs_job c WHERE c.id = d.child_id) IN ('enqueue_failed', 'queued'))
    ORDER BY wn.key, wn.job_id
  LOOP
    WITH RECURSIVE reach(id) AS (
      SELECT root.id
      UNION
      SELECT s.child_id FROM reach x CROSS JOIN LATERAL (
        SELECT d.child_id FROM jobs_jobdependency d WHERE d.parent_id = x.id
          AND (SELECT c.status FROM jobs_job c WHERE c.id = d.child_id) IN ('enqueue_failed', 'queued')
        OFFSET 0) s
    )
    SELECT array_agg(id) INTO victims FROM reach WHERE id <> root.id;
    UPDATE jobs_job SET status = 'failed', error = 'dependency failed: ' || root.key,
           finished_at = statement_timestamp(), result = NULL, wait_reason = NULL,
           updated_by = 'api'
    WHERE id = ANY(victims) AND status IN ('enqueue_failed', 'queued');
  END LOOP;

  WITH ended AS (
    UPDATE jobs_workflownode SET ended = true WHERE job_id = ANY(ended_now) AND NOT ended
    RETURNING job_id, workflow_id
  )
  SELECT array_agg(job_id), array_agg(workflow_id) INTO ended_ids, ended_workflows FROM ended;
  IF ended_ids IS NULL THEN
    RETURN NULL;
  END IF;

  SELECT array_agg(s.child_id), array_agg(s.k) INTO children, settled FROM (
    SELECT e.child_id, count(*)::int AS k FROM unnest(ended_ids) AS p(id)
    CROSS JOIN LATERAL (
      SELECT d.child_id FROM jobs_jobdependency d WHERE d.parent_id = p.id OFFSET 0) e
    GROUP BY e.child_id) s;
  WITH pending AS (
    UPDATE jobs_workflownode wn SET pending_parents = greatest(wn.pending_parents - u.k, 0)
    FROM unnest(children, settled) AS u(id, k)
    WHERE wn.job_id = u.id AND NOT wn.ended
    RETURNING wn.job_id, wn.pending_parents
  )
  SELECT array_agg(job_id) INTO woken FROM pending WHERE pending_parents = 0;
  UPDATE jobs_job SET run_at = now(), due_at = now(), wait_reason = NULL,
         updated_by = 'api'
  WHERE id = ANY(woken)
    AND status = 'queued' AND wait_reason = 'parents';

  WITH counted AS (
    SELECT e.id, count(*) AS k FROM unnest(ended_workflows) AS e(id) GROUP BY e.id
  )
  UPDATE jobs_workflow w SET unfinished = greatest(w.unfinished - c.k, 0),
         finished_at = CASE WHEN w.unfinished - c.k <= 0 THEN statement_timestamp()
                            ELSE w.finished_at END
  FROM counted c WHERE w.id = c.id;
  RETURN NULL;
END
$$;
DO $do$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'jobs_job'::regclass
                 AND tgname = 'jobs_job_dependents') THEN
    CREATE TRIGGER jobs_job_dependents AFTER UPDATE ON jobs_job
      REFERENCING OLD TABLE AS jobs_job_dep_old NEW TABLE AS jobs_job_dep_new
      FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_dependents();
  END IF;
END $do$;
"""

# 0016: the history trigger joins its transition tables by hash (D107); body untouched.
HISTORY_PLAN_0016 = """ALTER FUNCTION jobs_job_history_update() SET enable_nestloop = off;
"""
HISTORY_PLAN_RESET = "ALTER FUNCTION jobs_job_history_update() RESET enable_nestloop;\n"

# 0021_partitions: history rows carry the job's created_at (the key of the partitioned
# jobs_jobevent); a move between partitions (a change of period) passes the guard as one
# update, its insert half included.
GUARD_0021 = """
CREATE OR REPLACE FUNCTION jobs_job_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF current_setting('jobs.moving_job', true) = NEW.id::text THEN
      -- The insert half of a row moving between partitions: checked as an update.
      PERFORM set_config('jobs.moving_job', '', true);
      RETURN NEW;
    END IF;
    IF NEW.status <> 'queued' OR NEW.lease_version <> 0 THEN
      RAISE EXCEPTION 'illegal job insert: status % lease_version %', NEW.status, NEW.lease_version
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_insert';
    END IF;
    NEW.due_at := greatest(NEW.created_at, NEW.run_at);
    NEW.event_seq := 1;
    RETURN NEW;
  END IF;
  IF TG_OP = 'DELETE' THEN
    IF OLD.status NOT IN ('done', 'failed') THEN
      RAISE EXCEPTION 'illegal job delete: job % is %', OLD.id, OLD.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_delete_terminal_only';
    END IF;
    RETURN OLD;
  END IF;
  IF NEW.lease_version < OLD.lease_version THEN
    RAISE EXCEPTION 'illegal lease_version decrease on job %: % -> %',
      OLD.id, OLD.lease_version, NEW.lease_version
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_monotonic';
  END IF;
  IF OLD.status = 'processing' AND NEW.status = 'queued'
     AND NEW.cancel_requested_at IS NOT NULL THEN
    NEW.status := 'failed';
    NEW.error := 'cancelled';
    NEW.finished_at := statement_timestamp();
  END IF;
  IF NEW.status <> OLD.status THEN
    IF (OLD.status || '>' || NEW.status) NOT IN ('enqueue_failed>failed', 'enqueue_failed>queued', 'failed>queued', 'processing>done', 'processing>failed', 'processing>queued', 'queued>enqueue_failed', 'queued>failed', 'queued>processing') THEN
      RAISE EXCEPTION 'illegal job transition on job %: % -> %', OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_legal_transition';
    END IF;
    IF (OLD.status || '>' || NEW.status) IN ('processing>queued', 'queued>processing')
       AND NEW.lease_version <= OLD.lease_version THEN
      RAISE EXCEPTION 'job % changed hands (% -> %) without a lease bump',
        OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
    END IF;
    NEW.event_seq := COALESCE(OLD.event_seq, 0) + 1;
    IF NEW.status = 'processing' THEN
      -- A new attempt starts without the last one's error detail or progress.
      NEW.error_class := NULL;
      NEW.error_traceback := NULL;
      NEW.progress := NULL;
    END IF;
  ELSIF NEW.status = 'processing'
        AND NEW.owned_by IS NOT NULL AND NEW.owned_by IS DISTINCT FROM OLD.owned_by
        AND NEW.lease_version <= OLD.lease_version THEN
    RAISE EXCEPTION 'job % changed owner without a lease bump', OLD.id
      USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_job_lease_bump';
  END IF;
  IF NEW.period IS DISTINCT FROM OLD.period THEN
    -- The row moves to another partition: its delete and insert halves follow.
    PERFORM set_config('jobs.moving_job', NEW.id::text, true);
    IF NEW.status = OLD.status THEN
      RETURN NEW;  -- a move alone (the mover) is no change of the job: updated_at stays
    END IF;
  END IF;
  NEW.updated_at := statement_timestamp();
  RETURN NEW;
END
$$;

-- History, one statement per write: the rows a statement changed are read from its
-- transition tables, so a batch of N transitions costs one INSERT, not N trigger calls.
CREATE OR REPLACE FUNCTION jobs_job_history_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error, seq,
     job_created_at)
  SELECT n.id, statement_timestamp(), NULL, n.status, COALESCE(n.updated_by, ''), n.lease_version,
         n.retry_count, CASE WHEN n.status = 'done' THEN NULL ELSE n.error END,
         n.event_seq, n.created_at
  FROM jobs_job_new n;
  RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION jobs_job_history_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO jobs_jobevent
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error,
     error_class, error_traceback, seq, job_created_at)
  SELECT n.id, statement_timestamp(), o.status, n.status, COALESCE(n.updated_by, ''),
         n.lease_version, n.retry_count,
         CASE WHEN n.status = 'done' THEN NULL ELSE n.error END,
         CASE WHEN o.status = 'processing' THEN n.error_class END,
         CASE WHEN o.status = 'processing' THEN n.error_traceback END,
         n.event_seq, n.created_at
  FROM jobs_job_new n JOIN jobs_job_old o ON o.id = n.id
  WHERE n.status <> o.status;
  RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS jobs_job_guard ON jobs_job;
CREATE TRIGGER jobs_job_guard BEFORE INSERT OR UPDATE OR DELETE ON jobs_job
  FOR EACH ROW EXECUTE FUNCTION jobs_job_guard();
DROP TRIGGER IF EXISTS jobs_job_history ON jobs_job;
DROP FUNCTION IF EXISTS jobs_job_history();
DROP TRIGGER IF EXISTS jobs_job_history_insert ON jobs_job;
CREATE TRIGGER jobs_job_history_insert AFTER INSERT ON jobs_job
  REFERENCING NEW TABLE AS jobs_job_new
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_history_insert();
DROP TRIGGER IF EXISTS jobs_job_history_update ON jobs_job;
CREATE TRIGGER jobs_job_history_update AFTER UPDATE ON jobs_job
  REFERENCING OLD TABLE AS jobs_job_old NEW TABLE AS jobs_job_new
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_history_update();
"""


# Sequences and batches (jobs.flow.triggers), installed by 0027.
FLOW_TRIGGERS_0027 = """
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
    UPDATE jobs_job SET run_at = now(), due_at = now(), wait_reason = NULL,
           updated_by = 'api'
    WHERE id = w.job_id AND status = 'queued' AND wait_reason IN ('sequence', 'sequence_halted')
      AND period = 'infinity'
    RETURNING id INTO woken;
    IF woken IS NOT NULL THEN
      UPDATE jobs_sequence SET active_job_id = woken, updated_at = now() WHERE id = seq;
      RETURN woken;
    END IF;
  END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION jobs_job_sequence_enter() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  s record;
BEGIN
  IF NEW.status IN ('done', 'failed') THEN  -- a finished job the mover moves between partitions
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
      UPDATE jobs_job SET wait_reason = 'sequence'
      WHERE id = ANY(ARRAY(SELECT job_id FROM jobs_sequencewait WHERE sequence_id = s.id))
        AND status = 'queued' AND wait_reason = 'sequence_halted' AND period = 'infinity';
      RETURN NEW;
    END IF;
  END IF;
  IF s.halted_job_id IS NULL AND (
       s.active_job_id IS NULL OR s.active_job_id = NEW.id
       OR NOT EXISTS (SELECT 1 FROM jobs_job j WHERE j.id = s.active_job_id
                      AND j.status IN ('enqueue_failed', 'processing', 'queued') AND j.period = 'infinity')) THEN
    UPDATE jobs_sequence SET active_job_id = NEW.id WHERE id = s.id;
    RETURN NEW;
  END IF;
  UPDATE jobs_sequence SET last_position = s.last_position + 1 WHERE id = s.id;
  INSERT INTO jobs_sequencewait (sequence_id, position, job_id)
  VALUES (s.id, s.last_position + 1, NEW.id);
  NEW.run_at := '9999-01-01 00:00:00+00';
  NEW.wait_reason := CASE WHEN s.halted_job_id IS NULL THEN 'sequence'
                          ELSE 'sequence_halted' END;
  RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION jobs_batch_finish(b bigint) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
  bt record;
  cb record;
  summary jsonb;
  made bigint;
  ids bigint[] := '{}';
BEGIN
  SELECT * INTO bt FROM jobs_batch WHERE id = b;
  summary := jsonb_build_object(
    'id', bt.id,
    'name', bt.name,
    'total', bt.total,
    'succeeded', bt.succeeded,
    'failed', bt.failed,
    'failed_ids', COALESCE((SELECT jsonb_agg(job_id ORDER BY job_id)
                            FROM jobs_batchfailure WHERE batch_id = b), '[]'::jsonb));
  FOR cb IN
    SELECT k.kind, bt.callbacks -> k.kind AS spec
    FROM unnest(ARRAY['on_complete', 'on_success', 'on_failure']) WITH ORDINALITY AS k(kind, ord)
    WHERE bt.callbacks ? k.kind
      AND (k.kind = 'on_complete' OR (k.kind = 'on_success') = (bt.failed = 0))
    ORDER BY k.ord
  LOOP
    INSERT INTO jobs_job (task, payload, queue, priority, max_retries, timeout, client_id,
                     updated_by, status, retry_count, lease_version)
    VALUES (cb.spec ->> 'task',
            CASE WHEN (cb.spec ->> 'kwargs')::boolean
                 THEN jsonb_set(cb.spec -> 'payload', '{kwargs,batch}', summary)
                 ELSE (cb.spec -> 'payload') || jsonb_build_object('batch', summary) END,
            cb.spec ->> 'queue', (cb.spec ->> 'priority')::int,
            (cb.spec ->> 'max_retries')::int, (cb.spec ->> 'timeout')::float8,
            bt.client_id, 'api', 'queued', 0, 0)
    RETURNING id INTO made;
    ids := ids || made;
  END LOOP;
  UPDATE jobs_batch SET callback_job_ids = ids WHERE id = b;
END
$$;

CREATE OR REPLACE FUNCTION jobs_job_flow() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  e record;
  s record;
  finished bigint[];
  b bigint;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM jobs_job_flow_new
                 WHERE sequence_key IS NOT NULL OR batch_id IS NOT NULL) THEN
    RETURN NULL;
  END IF;

  FOR e IN
    SELECT n.id, n.status, n.error, n.client_id, n.sequence_key
    FROM (SELECT id, status, error, client_id, sequence_key FROM jobs_job_flow_new
          WHERE sequence_key IS NOT NULL AND status IN ('done', 'failed')) n
    JOIN (SELECT id FROM jobs_job_flow_old
          WHERE sequence_key IS NOT NULL AND status NOT IN ('done', 'failed')) o ON o.id = n.id
    ORDER BY n.id
  LOOP
    SELECT id, active_job_id INTO s FROM jobs_sequence
    WHERE owner = COALESCE(e.client_id, 0) AND key = e.sequence_key FOR UPDATE;
    IF FOUND AND s.active_job_id = e.id THEN
      IF e.status = 'failed' AND e.error IS DISTINCT FROM 'cancelled' THEN
        UPDATE jobs_sequence SET active_job_id = NULL, halted_job_id = e.id,
               halted_at = now(), updated_at = now() WHERE id = s.id;
        UPDATE jobs_job SET wait_reason = 'sequence_halted'
      WHERE id = ANY(ARRAY(SELECT job_id FROM jobs_sequencewait WHERE sequence_id = s.id))
        AND status = 'queued' AND wait_reason = 'sequence' AND period = 'infinity';
      ELSE
        PERFORM jobs_sequence_wake(s.id);
      END IF;
    END IF;
  END LOOP;

  WITH ch AS MATERIALIZED (
    SELECT n.id, n.batch_id, n.status AS now_status, o.status AS was_status
    FROM (SELECT id, batch_id, status FROM jobs_job_flow_new WHERE batch_id IS NOT NULL) n
    JOIN (SELECT id, status FROM jobs_job_flow_old WHERE batch_id IS NOT NULL) o ON o.id = n.id
    WHERE (n.status IN ('done', 'failed')) <> (o.status IN ('done', 'failed'))
  ), failures AS (
    INSERT INTO jobs_batchfailure (batch_id, job_id)
    SELECT batch_id, id FROM ch WHERE now_status = 'failed'
    ON CONFLICT DO NOTHING
  ), revived AS (
    DELETE FROM jobs_batchfailure f USING ch
    WHERE ch.was_status = 'failed' AND f.batch_id = ch.batch_id AND f.job_id = ch.id
  ), counted AS (
    SELECT batch_id,
           sum(CASE WHEN now_status IN ('done', 'failed') THEN -1 ELSE 1 END) AS d_pending,
           count(*) FILTER (WHERE now_status = 'done')
             - count(*) FILTER (WHERE was_status = 'done') AS d_done,
           count(*) FILTER (WHERE now_status = 'failed')
             - count(*) FILTER (WHERE was_status = 'failed') AS d_failed
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
ALTER FUNCTION jobs_job_flow() SET enable_nestloop = off;
DO $do$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'jobs_job'::regclass
                 AND tgname = 'jobs_job_sequence_enter') THEN
    CREATE TRIGGER jobs_job_sequence_enter BEFORE INSERT ON jobs_job FOR EACH ROW
      WHEN (NEW.sequence_key IS NOT NULL AND NEW.status NOT IN ('done', 'failed'))
      EXECUTE FUNCTION jobs_job_sequence_enter();
  END IF;
END $do$;
DO $do$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'jobs_job'::regclass
                 AND tgname = 'jobs_job_sequence_revive') THEN
    CREATE TRIGGER jobs_job_sequence_revive BEFORE UPDATE ON jobs_job FOR EACH ROW
      WHEN (NEW.sequence_key IS NOT NULL AND OLD.status IN ('done', 'failed')
            AND NEW.status NOT IN ('done', 'failed'))
      EXECUTE FUNCTION jobs_job_sequence_enter();
  END IF;
END $do$;
DO $do$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'jobs_job'::regclass
                 AND tgname = 'jobs_job_flow') THEN
    CREATE TRIGGER jobs_job_flow AFTER UPDATE ON jobs_job
      REFERENCING OLD TABLE AS jobs_job_flow_old NEW TABLE AS jobs_job_flow_new
      FOR EACH STATEMENT EXECUTE FUNCTION jobs_job_flow();
  END IF;
END $do$;
"""

DROP_FLOW_TRIGGERS_0027 = """
DROP TRIGGER IF EXISTS jobs_job_flow ON jobs_job;
DROP TRIGGER IF EXISTS jobs_job_sequence_revive ON jobs_job;
DROP TRIGGER IF EXISTS jobs_job_sequence_enter ON jobs_job;
DROP FUNCTION IF EXISTS jobs_job_flow();
DROP FUNCTION IF EXISTS jobs_job_sequence_enter();
DROP FUNCTION IF EXISTS jobs_batch_finish(bigint);
DROP FUNCTION IF EXISTS jobs_sequence_wake(bigint);
"""
