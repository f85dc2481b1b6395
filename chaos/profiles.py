"""Run profiles: how long, how fast, which timings, which faults and which workload."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

FAULT_KINDS: tuple[str, ...] = (
    "worker_kill",  # kill -9 a worker, restart it after a pause
    "reaper_kill",  # kill -9 a reaper, restart it after a pause
    "worker_stop",  # SIGSTOP a worker past its lease, then SIGCONT (a stale writer)
    "redis_restart",  # stop Redis (submissions go on), start it again empty
    "redis_flushall",  # FLUSHALL on the harness's own Redis
    "duplicate_push",  # RPUSH ids already pushed (and finished) again
    "pg_terminate",  # pg_terminate_backend on a process's connections
    "api_kill",  # kill -9 a gunicorn worker mid-traffic (commit without push or reply)
    "orphan_submit",  # commit rows and die before the on-commit push: signal-less queued rows
    "child_pause",  # process-pool children pause right after `end` (the next `run` comes)
    "detach_pending",  # DETACH ... CONCURRENTLY of the current job partition, cut off: pending
)

POOL_QUEUE = "children"  # served by process-pool workers only
# A queue with a throttle per concurrency key (jobs.flow.keyrate): at most LIMIT starts of
# a key in any PERIOD seconds; the "throttled" workload submits to it faster than that.
THROTTLED_QUEUE = "throttled"
THROTTLE = {"limit": 2, "period": 3}

# (weight, name): the workload mix. Names are resolved by chaos.load.make_request.
DEFAULT_MIX: tuple[tuple[float, str], ...] = (
    (38, "echo"),
    (16, "record"),  # demo.record: one effect row in the fenced completion
    (4, "record_brief"),  # demo.record working 0.1-0.5 s: in flight when a worker dies
    (2, "record_slow"),  # demo.record working past the lease (heartbeats keep it)
    (1, "sleep_slow"),  # built-in sleep past the lease
    (15, "flaky"),  # demo.flaky: retryable failures, sometimes the budget runs out
    (4, "flaky_low_budget"),  # demo.flaky with max_retries 1
    (3, "permanent"),  # demo.permanent: failed at once
    (2, "fail"),  # built-in fail with max_retries 1: budget spent
    (1, "bad_result"),  # chaos.bad_result: a result jsonb cannot store fails the job (D20)
    (1, "hang"),  # chaos.hang: ignores ctx.stop past its 1 s timeout (the watchdog ends it)
    (1, "exit"),  # chaos.exit: sys.exit() in a handler fails the attempt, not the worker
    (1, "die"),  # chaos.die: os._exit() in a process-pool child (queue POOL_QUEUE)
    (5, "scheduled"),  # echo with run_at a few seconds ahead
    (2, "cancelled"),  # scheduled, then cancelled through the API (or started first)
    (8, "idempotent_replay"),  # echo submitted twice with the same Idempotency-Key
    (4, "steps"),  # chaos.steps: checkpointed steps (jobs.durable) under kills and freezes
    (2, "workflow"),  # a 4-job diamond workflow (POST /workflows/), either on_failure
    (2, "nap"),  # chaos.nap: a durable sleep parks the job between two steps
    (2, "sequence"),  # 4 demo.record jobs of one sequence_key: one at a time, in order
    (3, "debounced"),  # demo.record under 7 debounce keys: many submissions, few jobs
    (2, "skip_new"),  # echo on 3 busy keys with key_strategy skip_new
    (1, "rate_limited"),  # echo whose key's rate_limit refuses past 3 a second (429)
    (4, "throttled"),  # echo on one key of THROTTLED_QUEUE, whose key_rate makes it wait
    (2, "chain"),  # chaos.chain: a durable loop that continues as new (3 runs)
)


@dataclass(frozen=True)
class Profile:
    name: str
    duration: float  # seconds of load and faults
    rate: float  # submissions per second
    lease: float  # JOBS_LEASE_SECONDS
    reaper_interval: float  # JOBS_REAPER_INTERVAL
    lost_signal: float  # JOBS_LOST_SIGNAL_SECONDS
    backoff_base: float  # JOBS_RETRY_BACKOFF_BASE
    # JOBS_HOT_FINISHED_SECONDS: the mover moves finished jobs during the run (past the
    # replays of a job's Idempotency-Key, which a pending partition would hide).
    hot_finished: float = 10.0
    workers: int = 3
    # The last `pool_workers` workers run `--pool processes` and alone serve POOL_QUEUE
    # (chaos.die would take a thread-pool worker down with it).
    pool_workers: int = 1
    concurrency: int = 4
    reapers: int = 2
    api_processes: int = 2
    api_threads: int = 2
    senders: int = 8  # client threads submitting
    fault_every: float = 3.0  # mean seconds between faults
    fault_kinds: tuple[str, ...] = FAULT_KINDS
    drain_timeout: float = 60.0
    max_jobs: int | None = None  # stop submitting after this many
    slow_extra: tuple[float, float] = (1.0, 2.0)  # slow jobs run lease + U(a, b) seconds
    mix: tuple[tuple[float, str], ...] = DEFAULT_MIX
    enforce_slo: bool = False  # fail the run when < slo_share terminal within slo_seconds
    slo_seconds: float = 25.0
    slo_share: float = 0.95
    extra_env: dict[str, str] = field(default_factory=dict)

    def with_(self, **changes: object) -> Profile:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        return (
            f"profile {self.name}: {self.duration:g}s at {self.rate:g} jobs/s, "
            f"lease {self.lease:g}s, reaper every {self.reaper_interval:g}s, "
            f"lost-signal after {self.lost_signal:g}s, backoff base {self.backoff_base:g}s; "
            f"{self.workers} workers x {self.concurrency}, {self.reapers} reapers, "
            f"{self.api_processes} API processes; a fault every ~{self.fault_every:g}s"
        )


PROFILES: dict[str, Profile] = {
    # CI: short but realistic timings (lease 3 s, sweep 1 s), every fault kind at least once.
    "short": Profile(
        name="short",
        duration=60,
        rate=12,
        lease=3,
        reaper_interval=1,
        lost_signal=2,
        backoff_base=0.2,
        workers=3,
        concurrency=3,
        fault_every=2.5,
        drain_timeout=60,
    ),
    # The SPEC defaults (lease 15 s, sweep 5 s): the 25 s SLO must hold under faults.
    "long": Profile(
        name="long",
        duration=660,
        rate=36,
        lease=15,
        reaper_interval=5,
        lost_signal=10,
        backoff_base=1,
        workers=3,
        concurrency=6,
        fault_every=8,
        drain_timeout=240,
        mix=tuple((w / 4 if n in ("record_slow", "sleep_slow") else w, n) for w, n in DEFAULT_MIX),
        enforce_slo=True,
    ),
}

# The end-to-end SLO run (tests/test_e2e_slo.py): 2,000 jobs at the SPEC timings while
# a worker is killed every few seconds; nothing else goes wrong.
PROFILES["slo"] = PROFILES["short"].with_(
    name="slo",
    lease=15,
    reaper_interval=5,
    lost_signal=10,
    backoff_base=1,
    rate=45,
    max_jobs=2000,
    duration=2000 / 45 + 1,
    workers=3,
    concurrency=5,
    fault_kinds=("worker_kill",),
    fault_every=3.0,
    pool_workers=0,
    mix=((60, "echo"), (25, "record"), (15, "record_brief")),
    drain_timeout=60,
)
