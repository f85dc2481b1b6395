"""The job lifecycle: states, legal transitions, the terminal set (SPEC §2).

This is the one place the rules live. The model's check constraints, the
database trigger, the services and the admin all read them from here.
"""

from __future__ import annotations

from typing import NamedTuple

from django.db import models


class Status(models.TextChoices):
    # Labels are the values: the API, the admin and the database all speak them.
    QUEUED = "queued", "queued"
    PROCESSING = "processing", "processing"
    DONE = "done", "done"
    FAILED = "failed", "failed"
    ENQUEUE_FAILED = "enqueue_failed", "enqueue_failed"


STATUSES: tuple[str, ...] = tuple(Status.values)
TERMINAL: frozenset[Status] = frozenset({Status.DONE, Status.FAILED})
# Live rows: the reaper watches them, the depth gauges count them, retention keeps them.
NON_TERMINAL: tuple[Status, ...] = tuple(s for s in Status if s not in TERMINAL)
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
        (Status.PROCESSING, Status.FAILED),  # budget exhausted, permanent error, cancelled
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
# The error of a job that ended because someone cancelled it.
CANCELLED = "cancelled"
# What crash recovery adds to its error when no start of the attempt is on record (its
# handler was not called, D77): it is requeued without spending a retry.
NOT_STARTED = "no start on record: requeued, no retry spent"


class Move(NamedTuple):
    """A change a service makes: the states it takes a job from (its `WHERE status`)
    and the states it may leave it in. `tests/test_vocabulary.py` checks every
    move against TRANSITIONS."""

    sources: frozenset[Status]
    targets: frozenset[Status]

    @property
    def states(self) -> tuple[Status, ...]:
        """The sources in the order Status declares them (for display)."""
        return tuple(s for s in Status if s in self.sources)

    def where(self, column: str = "status") -> str:
        """The SQL predicate for the sources: `=` for one state, so a partial index
        on that state still matches, `IN (...)` for several. A move of live jobs only
        also names the hot partition, so the plan reads no other (D161)."""
        if len(self.sources) == 1:
            sql = f"{column} = '{next(iter(self.sources))}'"
        else:
            sql = f"{column} IN ({sql_list(self.sources)})"
        if self.sources.isdisjoint(TERMINAL):
            sql += f" AND {hot_sql(column.rpartition('.')[0])}"
        return sql


# The hot partition's period (jobs_job_hot): every live job is there (job_cold_is_finished).
HOT_PERIOD = "'infinity'"


def hot_sql(alias: str = "") -> str:
    """`period = 'infinity'`: a predicate that prunes a jobs_job plan to jobs_job_hot."""
    return f"{alias + '.' if alias else ''}period = {HOT_PERIOD}"


def _move(sources: set[Status], *targets: Status) -> Move:
    return Move(frozenset(sources), frozenset(targets))


Q, P, D, F, E = (Status.QUEUED, Status.PROCESSING, Status.DONE, Status.FAILED,
                 Status.ENQUEUE_FAILED)  # fmt: skip
PARK = _move({Q}, E)  # the API: the push failed after commit
CLAIM = _move({Q}, P)  # a worker
COMPLETE = _move({P}, D)  # the lease holder's fenced final write
FAIL_ATTEMPT = _move({P}, Q, F)  # the lease holder: retry if the budget allows
RELEASE = _move({P}, Q, F)  # the holder gives it back (failed if a cancel is pending)
EXPIRE = _move({P}, Q, F)  # the reaper: lease expired or its worker gone
REPAIR = _move({E}, Q)  # the reaper or staff: requeue and re-signal
OVER_BUDGET = _move({Q, E}, F)  # the reaper: a row that may not run again
STAFF_RETRY = _move({F}, Q)  # staff: a new budget
REVOKE = _move({P}, Q, F)  # staff: fence the holder off (failed if a cancel is pending)
CANCEL = _move({Q, E}, F)  # staff or client: a job that has not started
CANCEL_RUNNING = _move({P}, P)  # staff: a cancel request; the holder ends the job
REQUEST_CANCEL = _move({Q, E, P}, F, P)  # client: CANCEL, or CANCEL_RUNNING if it runs
SUSPEND = _move({P}, Q, F)  # the holder parks a durable job (sleep, signal wait), no retry spent
CONTINUE_AS_NEW = _move({P}, D)  # the holder ends a durable run; its next run is a new job
WAKE = _move({Q}, Q)  # a signal or a parent's end makes a parked or blocked job due now
FAIL_DEPENDENTS = _move({Q, E}, F)  # a workflow parent failed: its blocked descendants fail
del Q, P, D, F, E
MOVES: dict[str, Move] = {
    "park": PARK,
    "claim": CLAIM,
    "complete": COMPLETE,
    "fail_attempt": FAIL_ATTEMPT,
    "release": RELEASE,
    "expire": EXPIRE,
    "repair": REPAIR,
    "over_budget": OVER_BUDGET,
    "staff_retry": STAFF_RETRY,
    "revoke": REVOKE,
    "cancel": CANCEL,
    "cancel_running": CANCEL_RUNNING,
    "request_cancel": REQUEST_CANCEL,
    "suspend": SUSPEND,
    "continue_as_new": CONTINUE_AS_NEW,
    "wake": WAKE,
    "fail_dependents": FAIL_DEPENDENTS,
}


class WaitReason(models.TextChoices):
    """Why a queued job is not due (`Job.wait_reason`): a durable job parked by its
    handler, or a workflow job whose parents have not all finished. The status stays
    queued (SPEC §2); run_at is the wake-up, the timeout or BLOCKED_RUN_AT."""

    SLEEP = "sleep"
    SIGNAL = "signal"
    PARENTS = "parents"
    SEQUENCE = "sequence"  # an earlier job of its sequence has not ended (jobs.flow)
    SEQUENCE_HALTED = "sequence_halted"  # an earlier job of its sequence failed


# run_at of a job that waits with no deadline (parents, a signal without timeout):
# far in the future but inside Python's datetime range, so every reader can load it.
BLOCKED_RUN_AT = "9999-01-01 00:00:00+00"


class Role(models.TextChoices):
    """Who made a change, as an API client may see it: the actor's kind, never its
    identity (hosts, pids and usernames stay in the admin). An actor is recorded as
    `<role>:<identity>` (see `actor`), or a bare role."""

    WORKER = "worker"
    REAPER = "reaper"
    STAFF = "staff"
    CLIENT = "client"
    API = "api"  # the service itself: the application's own code, migrations, repairs


def actor(role: Role, identity: str | None = None) -> str:
    """The `updated_by` / history actor: `worker:<id>`, `staff:<username>`, `reaper`."""
    return f"{role.value}:{identity}" if identity is not None else role.value


def actor_sql(role: Role, identity_sql: str) -> str:
    """`actor` as an SQL expression over a column or parameter."""
    return f"'{role.value}:' || {identity_sql}"


def actor_role(actor: str | None) -> str:
    """`worker:<host>:<pid>:…` → "worker", `staff:<username>` → "staff", and so on."""
    kind = (actor or "").split(":", 1)[0]
    return kind if kind in Role.values and kind != Role.API else Role.API


def due_sql(alias: str = "") -> str:
    """SQL for when a job became due, where its latency SLO starts (SPEC §6):
    `due_at` (the later of submission and run_at, restarted by a staff retry), or
    created_at on rows written before that column existed."""
    p = f"{alias}." if alias else ""
    return f"coalesce({p}due_at, {p}created_at)"


def is_legal(old: str, new: str) -> bool:
    """True when old → new is allowed; staying in a state is always allowed."""
    return old == new or (Status(old), Status(new)) in TRANSITIONS


def sql_list(values) -> str:
    """`'a', 'b'` for an SQL `IN (...)`, from a set of statuses (sorted: stable text)."""
    return ", ".join(f"'{v}'" for v in sorted(str(x) for x in values))


def _sql_pairs(pairs) -> str:
    return ", ".join(f"'{a}>{b}'" for a, b in sorted(pairs))


def guard_trigger_sql(table: str, history_table: str) -> str:
    """The database-side guard, generated from the tables above.

    BEFORE INSERT/UPDATE/DELETE on the jobs table:
    - a new row starts in the initial state with lease_version 0, and is due
      (`due_at`, where the SLO clock starts) at the later of its creation and run_at;
    - a claim clears the previous attempt's error class, traceback and progress;
    - a processing job with a cancel request pending (`cancel_requested_at`) that
      is put back to queued (retry, expired lease, revoke, release) ends failed
      with error "cancelled" instead: a cancel request outlives its attempt, and
      every requeue path, present or future, honours it;
    - a status change must be in TRANSITIONS;
    - lease_version never decreases, and grows on every LEASE_BUMPING transition;
    - a processing row keeps its owner unless the lease grows;
    - only terminal rows may be deleted (retention);
    - updated_at is stamped with the database clock;
    - `event_seq` counts the row's status changes (1 on insert): the per-job
      sequence number its history rows and completion events carry;
    - a change of `period` moves the row between partitions (a delete and an insert,
      D157): the insert half of that move is not a new job, and a move alone leaves
      updated_at as it was.
    AFTER INSERT/UPDATE, once per statement (transition tables): one history row
    per status change (a move between partitions is none), with the job's created_at
    (the history partition's key, D160), the actor recorded in the row's updated_by column by
    whoever made the change, and the job's `event_seq`. A change out of processing
    ends an attempt: its row
    also carries the attempt's error class and traceback (NULL unless it failed).
    Times are the statement's clock (`statement_timestamp()`), not the
    transaction's: a transactional handler's final write is stamped when it is
    made, not when the handler's transaction began.
    """
    return f"""
CREATE OR REPLACE FUNCTION {table}_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF current_setting('jobs.moving_job', true) = NEW.id::text THEN
      -- The insert half of a row moving between partitions: checked as an update.
      PERFORM set_config('jobs.moving_job', '', true);
      RETURN NEW;
    END IF;
    IF NEW.status <> '{INITIAL}' OR NEW.lease_version <> 0 THEN
      RAISE EXCEPTION 'illegal job insert: status % lease_version %', NEW.status, NEW.lease_version
        USING ERRCODE = 'check_violation', CONSTRAINT = '{table}_legal_insert';
    END IF;
    NEW.due_at := greatest(NEW.created_at, NEW.run_at);
    NEW.event_seq := 1;
    RETURN NEW;
  END IF;
  IF TG_OP = 'DELETE' THEN
    IF OLD.status NOT IN ({sql_list(TERMINAL)}) THEN
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
  IF OLD.status = '{Status.PROCESSING}' AND NEW.status = '{Status.QUEUED}'
     AND NEW.cancel_requested_at IS NOT NULL THEN
    NEW.status := '{Status.FAILED}';
    NEW.error := '{CANCELLED}';
    NEW.finished_at := statement_timestamp();
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
    NEW.event_seq := COALESCE(OLD.event_seq, 0) + 1;
    IF NEW.status = '{Status.PROCESSING}' THEN
      -- A new attempt starts without the last one's error detail or progress.
      NEW.error_class := NULL;
      NEW.error_traceback := NULL;
      NEW.progress := NULL;
    END IF;
  ELSIF NEW.status = '{Status.PROCESSING}'
        AND NEW.owned_by IS NOT NULL AND NEW.owned_by IS DISTINCT FROM OLD.owned_by
        AND NEW.lease_version <= OLD.lease_version THEN
    RAISE EXCEPTION 'job % changed owner without a lease bump', OLD.id
      USING ERRCODE = 'check_violation', CONSTRAINT = '{table}_lease_bump';
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
CREATE OR REPLACE FUNCTION {table}_history_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO {history_table}
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error, seq,
     job_created_at)
  SELECT n.id, statement_timestamp(), NULL, n.status, COALESCE(n.updated_by, ''), n.lease_version,
         n.retry_count, CASE WHEN n.status = '{Status.DONE}' THEN NULL ELSE n.error END,
         n.event_seq, n.created_at
  FROM {table}_new n;
  RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION {table}_history_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO {history_table}
    (job_id, at, from_status, to_status, actor, lease_version, retry_count, error,
     error_class, error_traceback, seq, job_created_at)
  SELECT n.id, statement_timestamp(), o.status, n.status, COALESCE(n.updated_by, ''),
         n.lease_version, n.retry_count,
         CASE WHEN n.status = '{Status.DONE}' THEN NULL ELSE n.error END,
         CASE WHEN o.status = '{Status.PROCESSING}' THEN n.error_class END,
         CASE WHEN o.status = '{Status.PROCESSING}' THEN n.error_traceback END,
         n.event_seq, n.created_at
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
