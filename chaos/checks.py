"""The invariants the fault suite proves, one function each (SPEC §1–§6).

Every check reads the database through `conn` (a psycopg connection or Django's
`connection`: anything whose `cursor()` runs `%s`-style SQL) and returns the
violations it found; an empty list means the invariant held. They read only
committed facts — the jobs table, the transition history (`jobs_jobevent`,
including `fence_rejected` rows) and the demo app's effect table — never logs,
so a run can be judged after the fact, and each check can be tested alone on
rows built to break it (tests/test_chaos_checks.py).

`accepted` is the harness's list of job ids the system acknowledged (a 201/200
from the API, or a committed direct submission). Checks that are about every
row in the database ignore it; the others use it to find jobs that vanished.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from jobs.lifecycle import LEASE_BUMPING, NOT_STARTED, TERMINAL, Role, Status, is_legal

TERMINAL_STATES = frozenset(str(s) for s in TERMINAL)
_TERMINAL_LIST = ", ".join(f"'{s}'" for s in sorted(TERMINAL_STATES))
# Tasks that can never end as done: their handler always fails.
NEVER_DONE_TASKS = frozenset(
    {
        "demo.permanent",
        "fail",
        "demo.crash",
        "chaos.bad_result",
        "chaos.hang",
        "chaos.exit",
        "chaos.die",
    }
)
# The task that writes one demo_effect row inside its fenced completion.
EFFECT_TASK = "demo.record"
# Error prefixes of permanent failures (worker and services wording), which end a
# job without spending its budget (decision D3).
PERMANENT_ERRORS: dict[str, str] = {
    "unknown task": "the task is not registered",
    "invalid payload": "the task's validator refused the payload",
    "invalid result": "the handler returned a result jsonb cannot store",
    "PermanentError": "the handler raised PermanentError",
    "cancelled": "cancelled before it started",
    "dependency failed": "a workflow parent failed (on_failure=fail_dependents)",
    "skipped": "its concurrency key was busy (key_strategy skip_new, jobs.flow)",
}
# The payload field in which the workload names a debounced job's key (chaos.load): a
# job does not keep its debounce_key, and a join replaces the payload with another of
# the same key.
DEBOUNCE_MARK = "debounce_key"
# How far a checkpoint's clock may pass the end of its lease: its statement may start
# (now()) just after the statement that ends the lease started, and still commit first.
STEP_CLOCK_SLACK = 0.5


@dataclass(frozen=True)
class Violation:
    check: str
    job_id: int | None
    detail: str

    def __str__(self) -> str:
        job = f"job {self.job_id}: " if self.job_id is not None else ""
        return f"[{self.check}] {job}{self.detail}"


def _rows(conn: Any, sql: str, params: Iterable[Any] = ()) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute(sql, list(params))
        return cur.fetchall()


def _events(conn: Any) -> dict[int, list[tuple]]:
    """History per job, in write order: (id, kind, from, to, actor, lease_version)."""
    out: dict[int, list[tuple]] = defaultdict(list)
    for row in _rows(
        conn,
        """SELECT job_id, id, kind, from_status, to_status, actor, lease_version
           FROM jobs_jobevent ORDER BY job_id, id""",
    ):
        out[row[0]].append(row[1:])
    return out


# --- 1. nothing lost, nothing stuck --------------------------------------------------


def lost_or_stuck(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """Every accepted job exists and is terminal; no row at all is left unfinished."""
    name = "lost_or_stuck"
    out: list[Violation] = []
    rows = dict(_rows(conn, "SELECT id, status FROM jobs_job"))
    for job_id in sorted(set(accepted)):
        status = rows.get(job_id)
        if status is None:
            out.append(Violation(name, job_id, "accepted but not in the database (lost)"))
    for job_id, status in sorted(rows.items()):
        if status not in TERMINAL_STATES:
            who = "accepted" if job_id in accepted else "unacknowledged"
            out.append(Violation(name, job_id, f"{who} job left {status} (stuck)"))
    return out


# --- 2. exactly-once effects ------------------------------------------------------------


def effects_at_most_once(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """≤ 1 committed effect per job; exactly 1 per done demo.record job; none for a
    job that is not done (a failed or stale attempt's effect must roll back)."""
    name = "effects_at_most_once"
    out: list[Violation] = []
    for job_id, n, status, task in _rows(
        conn,
        """SELECT e.job_id, count(*), j.status, j.task FROM demo_effect e
           LEFT JOIN jobs_job j ON j.id = e.job_id GROUP BY e.job_id, j.status, j.task""",
    ):
        if n > 1:
            out.append(Violation(name, job_id, f"{n} committed effects (at most 1 allowed)"))
        if status is None:
            out.append(Violation(name, job_id, "effect for a job that does not exist"))
        elif status != Status.DONE:
            out.append(Violation(name, job_id, f"effect committed but the job is {status}"))
        elif task != EFFECT_TASK:
            out.append(Violation(name, job_id, f"effect written by a {task!r} job"))
    for (job_id,) in _rows(
        conn,
        """SELECT j.id FROM jobs_job j WHERE j.task = %s AND j.status = 'done'
             AND NOT EXISTS (SELECT 1 FROM demo_effect e WHERE e.job_id = j.id)""",
        [EFFECT_TASK],
    ):
        out.append(Violation(name, job_id, "done demo.record job without its effect"))
    return out


def done_exactly_once(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """A done job has exactly one processing → done in its history; any other job none."""
    name = "done_exactly_once"
    out: list[Violation] = []
    for job_id, status, n in _rows(
        conn,
        """SELECT j.id, j.status, count(e.id) FROM jobs_job j
           LEFT JOIN jobs_jobevent e ON e.job_id = j.id AND e.kind = 'transition'
                                     AND e.to_status = 'done'
           GROUP BY j.id, j.status
           HAVING count(e.id) <> CASE WHEN j.status = 'done' THEN 1 ELSE 0 END""",
    ):
        out.append(Violation(name, job_id, f"{n} transitions to done, job is {status}"))
    return out


# --- 3. the final write was made under the final lease ----------------------------------


def results_under_final_lease(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """Every done job was completed by the holder of its final lease.

    The claim at the final lease_version names the holder; the done transition
    must be that holder's write. demo.record results and effects carry the lease
    (and worker) they were written under, which must be the final ones too.
    """
    name = "results_under_final_lease"
    out: list[Violation] = []
    rows = _rows(
        conn,
        """SELECT j.id, j.task, j.lease_version,
                  (SELECT e.actor FROM jobs_jobevent e WHERE e.job_id = j.id
                     AND e.kind = 'transition' AND e.to_status = 'processing'
                     AND e.lease_version = j.lease_version ORDER BY e.id DESC LIMIT 1),
                  (SELECT e.actor FROM jobs_jobevent e WHERE e.job_id = j.id
                     AND e.kind = 'transition' AND e.to_status = 'done'
                   ORDER BY e.id DESC LIMIT 1),
                  j.result ->> 'lease_version', j.result ->> 'recorded_by',
                  (SELECT array_agg(f.lease_version ORDER BY f.id) FROM demo_effect f
                     WHERE f.job_id = j.id),
                  (SELECT array_agg(f.worker_id ORDER BY f.id) FROM demo_effect f
                     WHERE f.job_id = j.id)
           FROM jobs_job j WHERE j.status = 'done'""",
    )
    for (
        job_id,
        task,
        lease,
        claimer,
        finisher,
        res_lease,
        res_worker,
        eff_leases,
        eff_workers,
    ) in rows:
        if claimer is None:
            out.append(Violation(name, job_id, f"done, but nobody claimed lease {lease}"))
            continue
        if finisher != claimer:
            out.append(
                Violation(
                    name,
                    job_id,
                    f"done written by {finisher!r}, but lease {lease} belongs to {claimer!r}",
                )
            )
        if task != EFFECT_TASK:
            continue
        holder = claimer.removeprefix("worker:")
        if res_lease is None or int(res_lease) != lease:
            out.append(
                Violation(name, job_id, f"result written under lease {res_lease}, final is {lease}")
            )
        if res_worker is not None and res_worker != holder:
            out.append(
                Violation(name, job_id, f"result recorded by {res_worker}, lease held by {holder}")
            )
        for eff_lease, eff_worker in zip(eff_leases or [], eff_workers or [], strict=True):
            if eff_lease != lease or eff_worker != holder:
                out.append(
                    Violation(
                        name,
                        job_id,
                        f"effect written under lease {eff_lease} by {eff_worker}; "
                        f"final lease {lease} held by {holder}",
                    )
                )
    return out


# --- 4. the fencing token only grows ------------------------------------------------------


def lease_never_decreases(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """lease_version never decreases along a job's history, the row is at least at
    the last recorded lease, and the fence turned away only writes whose lease was
    superseded (or whose job had already left processing under it)."""
    name = "lease_never_decreases"
    out: list[Violation] = []
    final = dict(_rows(conn, "SELECT id, lease_version FROM jobs_job"))
    for job_id, events in _events(conn).items():
        highest, state = -1, None
        for _, kind, _, to_status, actor, lease in events:
            if kind == "fence_rejected":
                # Legitimate only if the lease was superseded, or the job had already
                # left processing under it (a repeated write after its own completion).
                if lease > highest or (lease == highest and state == Status.PROCESSING):
                    out.append(
                        Violation(
                            name,
                            job_id,
                            f"write by {actor} under lease {lease} was rejected while that "
                            f"lease was current (history at {highest}, {state})",
                        )
                    )
                continue
            if lease < highest:
                out.append(
                    Violation(
                        name, job_id, f"lease_version went {highest} → {lease} (to {to_status})"
                    )
                )
            highest, state = max(highest, lease), to_status
        row_lease = final.get(job_id)
        if row_lease is not None and row_lease < highest:
            out.append(
                Violation(name, job_id, f"row at lease {row_lease}, history reached {highest}")
            )
    return out


# --- 5. every transition is legal and the history is complete ------------------------------


def transitions_legal(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """The history of every job is one unbroken chain of legal transitions.

    It starts with the insert as queued, each step leaves the state the previous
    one entered, each is allowed by `jobs.lifecycle.is_legal`, hand-overs bump
    the lease, failed → queued is staff-only, and the chain ends where the row is.
    """
    name = "transitions_legal"
    out: list[Violation] = []
    status_of = dict(_rows(conn, "SELECT id, status FROM jobs_job"))
    history = _events(conn)
    for job_id in sorted(set(status_of) | set(history)):
        state: str | None = None
        lease = None
        for n, (_, kind, frm, to, actor, lv) in enumerate(history.get(job_id, [])):
            if kind != "transition":
                continue
            if n == 0 or state is None:
                if frm is not None or to != Status.QUEUED:
                    out.append(Violation(name, job_id, f"history starts with {frm} → {to}"))
            elif frm != state:
                out.append(
                    Violation(name, job_id, f"gap in history: was {state}, next step {frm} → {to}")
                )
            if frm is not None:
                try:
                    legal = is_legal(frm, to)
                except ValueError:
                    legal = False
                if not legal:
                    out.append(Violation(name, job_id, f"illegal transition {frm} → {to}"))
                elif (frm, to) in {(str(a), str(b)) for a, b in LEASE_BUMPING} and (
                    lease is not None and lv <= lease
                ):
                    out.append(Violation(name, job_id, f"{frm} → {to} without a lease bump ({lv})"))
                elif (frm, to) == (Status.FAILED, Status.QUEUED) and not actor.startswith("staff:"):
                    out.append(Violation(name, job_id, f"failed → queued by {actor!r}"))
            state, lease = to, lv
        row_status = status_of.get(job_id)
        if row_status is None:
            out.append(Violation(name, job_id, "history for a job that does not exist"))
        elif state is None:
            out.append(Violation(name, job_id, f"job is {row_status} with no history"))
        elif state != row_status:
            out.append(Violation(name, job_id, f"history ends at {state}, row is {row_status}"))
    return out


# --- 6. failures are justified ---------------------------------------------------------------


def permanent_reason(error: str | None) -> str | None:
    """Which permanent failure an error records, or None for a retryable one."""
    for prefix in PERMANENT_ERRORS:
        if (error or "").startswith(prefix):
            return prefix
    return None


def failures_justified(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """Failed jobs are exactly those that failed permanently or spent their budget.

    A failed job either has retry_count > max_retries (its budget is spent) or a
    permanent error; a done job never ran past its budget; a task that always
    fails is never done.
    """
    name = "failures_justified"
    out: list[Violation] = []
    for job_id, task, status, error, retries, budget in _rows(
        conn,
        """SELECT id, task, status, error, retry_count, max_retries FROM jobs_job
           WHERE status IN ('done', 'failed')""",
    ):
        if status == Status.FAILED:
            spent = retries > budget
            reason = permanent_reason(error)
            if not spent and reason is None:
                out.append(
                    Violation(
                        name,
                        job_id,
                        f"failed with budget left ({retries} of {budget} retries) and a "
                        f"retryable error: {(error or '')[:120]!r}",
                    )
                )
            if reason == "PermanentError" and task not in NEVER_DONE_TASKS:
                out.append(Violation(name, job_id, f"{task!r} failed with {error[:80]!r}"))
        else:
            if retries > budget:
                out.append(
                    Violation(name, job_id, f"done after {retries} retries, budget {budget}")
                )
            if task in NEVER_DONE_TASKS:
                out.append(Violation(name, job_id, f"{task!r} can never succeed, but is done"))
    return out


# --- 7. crash charges only started attempts ------------------------------------------------


def crash_charges_started(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """Crash recovery (the reaper: worker gone, lease expired) spends a retry only of an
    attempt whose handler was called (D77): a job it failed has `started_at` set at or
    after its last claim, and a requeue it marked as not started spent no retry."""
    name = "crash_charges_started"
    out: list[Violation] = []
    reaper, processing = Role.REAPER.value, Status.PROCESSING.value
    for job_id, started, claimed in _rows(
        conn,
        """SELECT j.id, j.started_at,
                  (SELECT max(c.at) FROM jobs_jobevent c
                   WHERE c.job_id = j.id AND c.to_status = %s)
           FROM jobs_job j
           WHERE j.status = %s AND EXISTS (
             SELECT FROM jobs_jobevent e WHERE e.job_id = j.id AND e.actor = %s
               AND e.from_status = %s AND e.to_status = %s)""",
        [processing, Status.FAILED.value, reaper, processing, Status.FAILED.value],
    ):
        if started is None or (claimed is not None and started < claimed):
            detail = f"failed by crash recovery; its last attempt ({claimed}) never started"
            out.append(Violation(name, job_id, detail))
    for job_id, spent, before in _rows(
        conn,
        """SELECT e.job_id, e.retry_count,
                  (SELECT c.retry_count FROM jobs_jobevent c WHERE c.job_id = e.job_id
                   AND c.id < e.id AND c.to_status = %s ORDER BY c.id DESC LIMIT 1)
           FROM jobs_jobevent e
           WHERE e.actor = %s AND e.from_status = %s AND e.error LIKE %s""",
        [processing, reaper, processing, f"%{NOT_STARTED}"],
    ):
        if before is not None and spent != before:
            out.append(Violation(name, job_id, f"requeued unstarted by crash recovery with a "
                                 f"retry spent ({before} -> {spent})"))  # fmt: skip
    return out


# --- 8. durable steps and workflows -------------------------------------------------------


def steps_under_held_lease(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """Every step checkpoint was written under a lease its writer held: a claim of that
    lease by that worker exists, and the checkpoint is no later than that lease's end
    (the next move out of processing). A stale worker's checkpoint breaks one or both."""
    name = "steps_under_held_lease"
    out: list[Violation] = []
    leases: dict[tuple[int, int], tuple[str, Any, Any]] = {}
    for job_id, lease, actor, claimed, ended in _rows(
        conn,
        """SELECT c.job_id, c.lease_version, c.actor, c.at,
                  (SELECT min(e.at) FROM jobs_jobevent e
                   WHERE e.job_id = c.job_id AND e.id > c.id AND e.kind = 'transition'
                     AND e.from_status = %s)
           FROM jobs_jobevent c WHERE c.kind = 'transition' AND c.to_status = %s""",
        [Status.PROCESSING.value, Status.PROCESSING.value],
    ):
        leases[(job_id, lease)] = (actor, claimed, ended)
    for job_id, step, lease, worker, at in _rows(
        conn, "SELECT job_id, name, lease_version, worker_id, created_at FROM jobs_jobstep"
    ):
        held = leases.get((job_id, lease))
        if held is None or held[0] != f"worker:{worker}":
            out.append(Violation(name, job_id, f"step {step!r} under lease {lease} by {worker}, "
                                 "which never held it"))  # fmt: skip
            continue
        _, claimed, ended = held
        late = ended is not None and (at - ended).total_seconds() > STEP_CLOCK_SLACK
        if at < claimed or late:
            out.append(Violation(name, job_id, f"step {step!r} written at {at} outside its "
                                 f"lease {lease} ({claimed} .. {ended})"))  # fmt: skip
    return out


def children_after_parents(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """No workflow job is claimed before every parent ended; under fail_dependents, not
    unless every parent is done."""
    name = "children_after_parents"
    out: list[Violation] = []
    for child, parent, mode, claimed, parent_end, parent_status in _rows(
        conn,
        """WITH first_claim AS (
             SELECT job_id, min(at) AS at FROM jobs_jobevent
             WHERE kind = 'transition' AND to_status = %s GROUP BY job_id),
           first_end AS (
             SELECT job_id, min(at) AS at FROM jobs_jobevent
             WHERE kind = 'transition' AND to_status = ANY(%s) GROUP BY job_id)
           SELECT d.child_id, d.parent_id, w.on_failure, c.at, e.at, p.status
           FROM jobs_jobdependency d
           JOIN jobs_workflownode wn ON wn.job_id = d.child_id
           JOIN jobs_workflow w ON w.id = wn.workflow_id
           JOIN jobs_job p ON p.id = d.parent_id
           JOIN first_claim c ON c.job_id = d.child_id
           LEFT JOIN first_end e ON e.job_id = d.parent_id""",
        [Status.PROCESSING.value, sorted(TERMINAL_STATES)],
    ):
        if parent_end is None or claimed < parent_end:
            out.append(Violation(name, child, f"claimed at {claimed} before parent {parent} "
                                 f"ended ({parent_end})"))  # fmt: skip
        elif mode == "fail_dependents" and parent_status != Status.DONE:
            out.append(Violation(name, child, f"ran although parent {parent} is "
                                 f"{parent_status} (fail_dependents)"))  # fmt: skip
    return out


def chains_whole(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """Every durable job that continued as new (issue 45) is one chain: runs numbered
    1..n without a gap or a double, each continued run done with a link to the next,
    the links and previous_run_ids agreeing, and only its last run not continued."""
    name = "chains_whole"
    out: list[Violation] = []
    chains: dict[int, list[tuple]] = {}
    for row in _rows(
        conn,
        """SELECT chain_id, id, coalesce(run_number, 1), status, next_run_id, previous_run_ids
           FROM jobs_job WHERE chain_id IS NOT NULL ORDER BY chain_id, run_number""",
    ):
        chains.setdefault(row[0], []).append(row[1:])
    for chain_id, runs in chains.items():
        numbers = [r[1] for r in runs]
        if numbers != list(range(1, len(runs) + 1)) or runs[0][0] != chain_id:
            out.append(Violation(name, chain_id, f"runs numbered {numbers}: lost or doubled"))
            continue
        for before, after in zip(runs, runs[1:], strict=False):
            if before[2] != Status.DONE or before[3] != after[0]:
                why = f"run {before[1]} is {before[2]} with next {before[3]}"
                out.append(Violation(name, before[0], f"{why}, not done linked to {after[0]}"))
            if (after[4] or [])[-1:] != [before[0]]:
                out.append(Violation(name, after[0], f"previous_run_ids {after[4]} do not end "
                                     f"with run {before[0]}"))  # fmt: skip
        if runs[-1][3] is not None:
            out.append(Violation(name, runs[-1][0], f"the last run links to {runs[-1][3]}, "
                                 "which does not exist"))  # fmt: skip
    return out


def partitions_whole(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """Every period table of jobs and history is attached: none left detach pending by an
    interrupted DETACH … CONCURRENTLY (the reaper attaches it again, D214), none detached
    (a run archives nothing). A pending partition's rows are neither written nor read."""
    out = []
    for name, parent, pending in _rows(
        conn,
        """SELECT c.relname, i.inhparent::regclass::text, i.inhdetachpending
           FROM pg_class c LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
           WHERE c.relkind = 'r' AND c.relnamespace = current_schema()::regnamespace
             AND (c.relname ~ '^jobs_job(event)?_p[0-9]{8}$'
                  OR c.relname IN ('jobs_job_hot', 'jobs_jobevent_legacy'))
           ORDER BY 1""",
    ):
        if parent is None:
            out.append(Violation("partitions_whole", None, f"{name} is detached"))
        elif pending:
            out.append(Violation("partitions_whole", None, f"{name} is detach pending"))
    return out


def sequences_serial(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """No two attempts of jobs with one sequence_key overlap, and the jobs of a key
    start in the order they were submitted (id order within the one request that
    submits a chaos key's jobs): every attempt of a job ends before the next job's
    first claim (jobs.flow)."""
    name = "sequences_serial"
    out: list[Violation] = []
    spans: dict[tuple, list[tuple]] = defaultdict(list)
    for owner, key, job_id, claimed, ended in _rows(
        conn,
        """WITH claims AS (
             SELECT e.job_id, e.id AS event_id, e.at FROM jobs_jobevent e
             WHERE e.kind = 'transition' AND e.to_status = %s)
           SELECT COALESCE(j.client_id, 0), j.sequence_key, c.job_id, c.at,
                  (SELECT min(x.at) FROM jobs_jobevent x WHERE x.job_id = c.job_id
                   AND x.kind = 'transition' AND x.from_status = %s AND x.id > c.event_id)
           FROM claims c JOIN jobs_job j ON j.id = c.job_id
           WHERE j.sequence_key IS NOT NULL""",
        [Status.PROCESSING.value, Status.PROCESSING.value],
    ):
        spans[(owner, key)].append((claimed, ended, job_id))
    for (_, key), attempts in sorted(spans.items(), key=lambda kv: str(kv[0])):
        attempts.sort(key=lambda a: (a[0], a[2]))
        for (_, end, job), (nxt_start, _, nxt) in zip(attempts, attempts[1:], strict=False):
            if end is None or nxt_start < end:
                out.append(Violation(name, nxt, f"sequence {key}: job {nxt} claimed at "
                                     f"{nxt_start} while job {job} ran (ended {end})"))  # fmt: skip
            if nxt < job:
                out.append(Violation(name, nxt, f"sequence {key}: job {nxt} ran after job "
                                     f"{job}, submitted later"))  # fmt: skip
    return out


def debounce_gathers(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """A debounce key never had two jobs waiting for their first start at once: each job
    of a key is made only once the one before it started or ended (D331), so the keys'
    not-yet-started spans, from a job's first history row to its first claim (or its end
    without one), never overlap. Measured in the history's row ids, not its clocks: the
    key's row lock makes a submission draw its ids after the claim it waited for drew
    its own, while `at` is each transaction's start. Two running at once is no breach:
    a key's next job is made while one runs (D362)."""
    name = "debounce_gathers"
    out: list[Violation] = []
    spans: dict[tuple, list[tuple]] = defaultdict(list)
    for owner, key, job_id, made, started in _rows(
        conn,
        f"""SELECT COALESCE(j.client_id, 0), j.payload ->> %s, j.id,
                  (SELECT min(e.id) FROM jobs_jobevent e WHERE e.job_id = j.id),
                  (SELECT min(e.id) FROM jobs_jobevent e WHERE e.job_id = j.id
                   AND e.kind = 'transition' AND e.from_status IS NOT NULL
                   AND (e.to_status = %s OR e.to_status IN ({_TERMINAL_LIST})))
           FROM jobs_job j WHERE j.payload ? %s""",
        [DEBOUNCE_MARK, Status.PROCESSING.value, DEBOUNCE_MARK],
    ):
        if made is not None:
            spans[(owner, key)].append((made, started if started is not None else math.inf, job_id))
    for (_, key), waits in sorted(spans.items(), key=lambda kv: str(kv[0])):
        waits.sort()
        for (_, ended, job), (made, _, nxt) in zip(waits, waits[1:], strict=False):
            if made < ended:
                out.append(Violation(name, nxt, f"debounce key {key}: job {nxt} made while "
                                     f"job {job} of the key had not started"))  # fmt: skip
    return out


def key_rate_held(conn: Any, accepted: Collection[int]) -> list[Violation]:
    """No concurrency key of a queue with a `key_rate` started more than its limit in
    any window of its period (jobs.flow.keyrate): every claim of a job with a key, read
    from the history's start times (the claim statement's time, as the throttle counts
    them), windows (t - period, t]. A retry's new attempt is a start too (D330)."""
    name = "key_rate_held"
    out: list[Violation] = []
    starts: dict[tuple, list] = defaultdict(list)
    limits: dict[str, tuple[int, int]] = {}
    for queue, limit, period, owner, key, at in _rows(
        conn,
        """SELECT q.name, q.key_rate_limit, q.key_rate_period, COALESCE(j.client_id, 0),
                  j.concurrency_key, e.at
           FROM jobs_queue q JOIN jobs_job j ON j.queue = q.name
           JOIN jobs_jobevent e ON e.job_id = j.id
           WHERE q.key_rate_limit IS NOT NULL AND j.concurrency_key IS NOT NULL
             AND e.kind = 'transition' AND e.to_status = %s""",
        [Status.PROCESSING.value],
    ):
        limits[queue] = (limit, period)
        starts[(queue, owner, key)].append(at)
    for (queue, _, key), ats in sorted(starts.items(), key=lambda kv: str(kv[0])):
        limit, period = limits[queue]
        ats.sort()
        lo = 0
        for hi, at in enumerate(ats):
            while (at - ats[lo]).total_seconds() >= period:
                lo += 1
            if hi - lo + 1 > limit:
                out.append(Violation(name, None, f"queue {queue} key {key}: {hi - lo + 1} "
                                     f"starts in the {period} s up to {at}, key_rate "
                                     f"{limit}"))  # fmt: skip
                break
    return out


# --- running them -------------------------------------------------------------------------------

Check = Callable[[Any, Collection[int]], list[Violation]]
CHECKS: dict[str, Check] = {
    "lost_or_stuck": lost_or_stuck,
    "effects_at_most_once": effects_at_most_once,
    "done_exactly_once": done_exactly_once,
    "results_under_final_lease": results_under_final_lease,
    "lease_never_decreases": lease_never_decreases,
    "transitions_legal": transitions_legal,
    "failures_justified": failures_justified,
    "crash_charges_started": crash_charges_started,
    "steps_under_held_lease": steps_under_held_lease,
    "children_after_parents": children_after_parents,
    "chains_whole": chains_whole,
    "partitions_whole": partitions_whole,
    "sequences_serial": sequences_serial,
    "debounce_gathers": debounce_gathers,
    "key_rate_held": key_rate_held,
}


def run_all(conn: Any, accepted: Collection[int]) -> dict[str, list[Violation]]:
    accepted = frozenset(accepted)
    return {name: check(conn, accepted) for name, check in CHECKS.items()}


# --- latency (reported; asserted only where the profile says so) -------------------------------


@dataclass(frozen=True)
class Latency:
    jobs: int
    terminal: int
    within_slo: int
    slo_seconds: float
    p50: float | None
    p95: float | None
    p99: float | None
    max: float | None
    done: int
    failed: int

    @property
    def share_within_slo(self) -> float | None:
        """Of all accepted jobs (an unfinished one counts as late)."""
        return self.within_slo / self.jobs if self.jobs else None


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def latency(conn: Any, accepted: Collection[int], slo_seconds: float = 25.0) -> Latency:
    """Submission → terminal (database clock: created_at → finished_at) of accepted jobs."""
    ids = sorted(set(accepted))
    rows = _rows(
        conn,
        """SELECT status, extract(epoch FROM finished_at - created_at)::float8
           FROM jobs_job WHERE id = ANY(%s)""",
        [ids],
    )
    values = sorted(float(s) for status, s in rows if s is not None)
    return Latency(
        jobs=len(ids),
        terminal=len(values),
        within_slo=sum(1 for v in values if v <= slo_seconds),
        slo_seconds=slo_seconds,
        p50=_percentile(values, 0.50),
        p95=_percentile(values, 0.95),
        p99=_percentile(values, 0.99),
        max=values[-1] if values else None,
        done=sum(1 for status, _ in rows if status == Status.DONE),
        failed=sum(1 for status, _ in rows if status == Status.FAILED),
    )
