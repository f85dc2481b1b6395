"""Every write to a job, one compare-and-set per transition (SPEC §2–§5), in rooms that
follow the job's life: inserts (submit), claims, fencing (heartbeat, start, complete,
fail, release), recovery (the reaper's sweeps), repairs (staff and callers), retention,
waits (durable steps and signals), workflows; what they share (common: the lease, a
finished row, how a statement runs, the Redis signals sent after commit).

Each write is a single statement whose WHERE clause states the state it expects, and
the rows it returns say whether it held. Callers import the names below from here; the
rooms import each other only downward (tests/test_architecture.py).
"""

from jobs.services.claims.limited import Gated, claim_limited_under_queue_lock
from jobs.services.claims.plain import claim, claim_ids, claim_next
from jobs.services.claims.turns import CAP_RECHECK_SECONDS, Turns, claim_fair
from jobs.services.common import (
    Finished,
    Lease,
    mark_enqueue_failed,
    moved_retry,
    push_now_ignoring_rollback,
    signal_after_commit,
    signal_woken_children,
    worker_actor,
)
from jobs.services.fencing import (
    Held,
    complete,
    fail,
    heartbeat,
    mark_started,
    record_fence_rejections,
    release,
    still_held,
)
from jobs.services.inserts import NewJob, Submitted, key_holder, submit, submit_many
from jobs.services.recovery import (
    fail_over_budget,
    forget_workers,
    presence_lock_key,
    reap_expired,
    reap_gone_owners,
    worker_beat,
    worker_leave,
)
from jobs.services.repairs import (
    cancel,
    deactivate_clients,
    repair_enqueue_failed,
    request_cancel,
    revoke,
    staff_cancel_running,
    staff_repair,
    staff_retry,
)
from jobs.services.retention import prune_finished
from jobs.services.waits import (
    SignalRefused,
    checkpoint_step,
    continue_as_new,
    deliver_signal,
    suspend,
)
from jobs.services.workflows import create_workflow

__all__ = [
    "CAP_RECHECK_SECONDS",
    "Finished",
    "Gated",
    "Held",
    "Lease",
    "NewJob",
    "SignalRefused",
    "Submitted",
    "Turns",
    "cancel",
    "checkpoint_step",
    "claim",
    "claim_fair",
    "claim_ids",
    "claim_limited_under_queue_lock",
    "claim_next",
    "complete",
    "continue_as_new",
    "create_workflow",
    "deactivate_clients",
    "deliver_signal",
    "fail",
    "fail_over_budget",
    "forget_workers",
    "heartbeat",
    "key_holder",
    "mark_enqueue_failed",
    "mark_started",
    "moved_retry",
    "prune_finished",
    "presence_lock_key",
    "push_now_ignoring_rollback",
    "reap_expired",
    "reap_gone_owners",
    "record_fence_rejections",
    "release",
    "repair_enqueue_failed",
    "request_cancel",
    "revoke",
    "signal_after_commit",
    "signal_woken_children",
    "staff_cancel_running",
    "staff_repair",
    "staff_retry",
    "still_held",
    "submit",
    "submit_many",
    "suspend",
    "worker_actor",
    "worker_beat",
    "worker_leave",
]
