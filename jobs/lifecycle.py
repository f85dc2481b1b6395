"""The job lifecycle: states, legal transitions, the terminal set (SPEC §2).

This is the one place the rules live. The model's check constraints, the
database trigger, the services and the admin all read them from here.
"""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    QUEUED = "queued"
    PROCESSING = "processing"
    DONE = "done"
    FAILED = "failed"
    ENQUEUE_FAILED = "enqueue_failed"


STATUSES: tuple[str, ...] = tuple(s.value for s in Status)
TERMINAL: frozenset[Status] = frozenset({Status.DONE, Status.FAILED})
# Rows that hold no lease: nobody owns them and nobody has claimed them.
UNOWNED: frozenset[Status] = frozenset(set(Status) - {Status.PROCESSING})

# (from, to) pairs a row may take. Keeping the status is not a transition.
TRANSITIONS: frozenset[tuple[Status, Status]] = frozenset(
    {
        (Status.QUEUED, Status.ENQUEUE_FAILED),  # API: Redis push failed after commit
        (Status.ENQUEUE_FAILED, Status.QUEUED),  # reaper / staff: repair
        (Status.QUEUED, Status.PROCESSING),  # worker: claim
        (Status.PROCESSING, Status.DONE),  # worker: fenced final write
        (Status.PROCESSING, Status.QUEUED),  # retry, lease expired, release, revoke
        (Status.PROCESSING, Status.FAILED),  # budget exhausted, permanent error
        (Status.QUEUED, Status.FAILED),  # over budget, cancel
        (Status.ENQUEUE_FAILED, Status.FAILED),  # over budget, cancel
        (Status.FAILED, Status.QUEUED),  # staff only: manual retry
    }
)
# Transitions that hand the job to a new holder: the fencing token must grow.
LEASE_BUMPING: frozenset[tuple[Status, Status]] = frozenset(
    {(Status.QUEUED, Status.PROCESSING), (Status.PROCESSING, Status.QUEUED)}
)
INITIAL: Status = Status.QUEUED


def due_sql(alias: str = "") -> str:
    """When a job became due (SPEC §6), the start of its SLO clock: the scheduled run_at
    or a staff retry (stored in due_at), else its submission. A worker's retry or a
    recovered lease keeps the job's due time: those delays count against the SLO."""
    return f"COALESCE({alias}due_at, {alias}created_at)"


def is_legal(old: str, new: str) -> bool:
    """True when old → new is allowed; staying in a state is always allowed."""
    return old == new or (Status(old), Status(new)) in TRANSITIONS


def is_terminal(status: str) -> bool:
    return Status(status) in TERMINAL


def _sql_list(values) -> str:
    return ", ".join(f"'{v}'" for v in sorted(str(x) for x in values))


def _sql_pairs(pairs) -> str:
    return ", ".join(f"'{a}>{b}'" for a, b in sorted(pairs))


def guard_trigger_sql(table: str, history_table: str) -> str:
    """The database-side guard, generated from the tables above.

    BEFORE INSERT/UPDATE/DELETE on the jobs table:
    - a new row starts in the initial state with lease_version 0;
    - a status change must be in TRANSITIONS;
    - lease_version never decreases, and grows on every LEASE_BUMPING transition;
    - a processing row keeps its owner unless the lease grows;
    - only terminal rows may be deleted (retention);
    - updated_at is stamped with the database clock.
    AFTER INSERT/UPDATE, once per statement (transition tables): one history row
    per status change, with the actor recorded in the row's updated_by column by
    whoever made the change.
    """
    return f"""
CREATE OR REPLACE FUNCTION {table}_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF NEW.status <> '{INITIAL}' OR NEW.lease_version <> 0 THEN
      RAISE EXCEPTION 'illegal job insert: status % lease_version %', NEW.status, NEW.lease_version
        USING ERRCODE = 'check_violation', CONSTRAINT = '{table}_legal_insert';
    END IF;
    RETURN NEW;
  END IF;
  IF TG_OP = 'DELETE' THEN
    IF OLD.status NOT IN ({_sql_list(TERMINAL)}) THEN
      RAISE EXCEPTION 'illegal job delete: job % is %', OLD.id, OLD.status
        USING ERRCODE = 'check_violation', CONSTRAINT = '{table}_delete_terminal_only';
    END IF;
    RETURN OLD;
  END IF;
  IF NEW.lease_version < OLD.lease_version THEN
    RAISE EXCEPTION 'illegal lease_version decrease on job %: % -> %',
      OLD.id, OLD.lease_version, NEW.lease_version
      USING ERRCODE = 'check_violation', CONSTRAINT = '{table}_lease_monotonic';
  END IF;
  IF NEW.status <> OLD.status THEN
    IF (OLD.status || '>' || NEW.status) NOT IN ({_sql_pairs(TRANSITIONS)}) THEN
      RAISE EXCEPTION 'illegal job transition on job %: % -> %', OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = '{table}_legal_transition';
    END IF;
    IF (OLD.status || '>' || NEW.status) IN ({_sql_pairs(LEASE_BUMPING)})
       AND NEW.lease_version <= OLD.lease_version THEN
      RAISE EXCEPTION 'job % changed hands (% -> %) without a lease bump',
        OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'check_violation', CONSTRAINT = '{table}_lease_bump';
    END IF;
  ELSIF NEW.status = '{Status.PROCESSING}'
        AND NEW.owned_by IS NOT NULL AND NEW.owned_by IS DISTINCT FROM OLD.owned_by
        AND NEW.lease_version <= OLD.lease_version THEN
    RAISE EXCEPTION 'job % changed owner without a lease bump', OLD.id
      USING ERRCODE = 'check_violation', CONSTRAINT = '{table}_lease_bump';
  END IF;
  NEW.updated_at := now();
  RETURN NEW;
END
$$;

-- History, one statement per write: the rows a statement changed are read from its
-- transition tables, so a batch of N transitions costs one INSERT, not N trigger calls.
CREATE OR REPLACE FUNCTION {table}_history_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO {history_table}
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error)
  SELECT n.id, now(), NULL, n.status, COALESCE(n.updated_by, ''), n.lease_version,
         n.retry_count, CASE WHEN n.status = '{Status.DONE}' THEN NULL ELSE n.error END
  FROM {table}_new n;
  RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION {table}_history_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO {history_table}
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error)
  SELECT n.id, now(), o.status, n.status, COALESCE(n.updated_by, ''), n.lease_version,
         n.retry_count, CASE WHEN n.status = '{Status.DONE}' THEN NULL ELSE n.error END
  FROM {table}_new n JOIN {table}_old o ON o.id = n.id
  WHERE n.status <> o.status;
  RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS {table}_guard ON {table};
CREATE TRIGGER {table}_guard BEFORE INSERT OR UPDATE OR DELETE ON {table}
  FOR EACH ROW EXECUTE FUNCTION {table}_guard();
DROP TRIGGER IF EXISTS {table}_history ON {table};
DROP FUNCTION IF EXISTS {table}_history();
DROP TRIGGER IF EXISTS {table}_history_insert ON {table};
CREATE TRIGGER {table}_history_insert AFTER INSERT ON {table}
  REFERENCING NEW TABLE AS {table}_new
  FOR EACH STATEMENT EXECUTE FUNCTION {table}_history_insert();
DROP TRIGGER IF EXISTS {table}_history_update ON {table};
CREATE TRIGGER {table}_history_update AFTER UPDATE ON {table}
  REFERENCING OLD TABLE AS {table}_old NEW TABLE AS {table}_new
  FOR EACH STATEMENT EXECUTE FUNCTION {table}_history_update();
"""


def drop_trigger_sql(table: str) -> str:
    return f"""
DROP TRIGGER IF EXISTS {table}_history ON {table};
DROP TRIGGER IF EXISTS {table}_history_insert ON {table};
DROP TRIGGER IF EXISTS {table}_history_update ON {table};
DROP TRIGGER IF EXISTS {table}_guard ON {table};
DROP FUNCTION IF EXISTS {table}_history();
DROP FUNCTION IF EXISTS {table}_history_insert();
DROP FUNCTION IF EXISTS {table}_history_update();
DROP FUNCTION IF EXISTS {table}_guard();
"""
