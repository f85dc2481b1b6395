"""The fault schedule (a pure function of seed and profile) and the thread that plays it."""

from __future__ import annotations

import heapq
import logging
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chaos.profiles import Profile

if TYPE_CHECKING:
    from chaos.load import LoadGenerator
    from chaos.stack import Stack

log = logging.getLogger("chaos")

WEIGHTS: dict[str, float] = {
    "worker_kill": 3,
    "worker_stop": 2,
    "pg_terminate": 2,
    "duplicate_push": 2,
    "redis_restart": 1,
    "redis_flushall": 1,
    "reaper_kill": 1,
    "api_kill": 1,
    "orphan_submit": 1,
    "child_pause": 1,
    "detach_pending": 1,
}
UNITS = {
    "worker_kill": "s down",
    "reaper_kill": "s down",
    "worker_stop": "s stopped",
    "redis_restart": "s down",
    "duplicate_push": " ids",
    "orphan_submit": " rows",
    "child_pause": "s armed",
}
CHILD_PAUSE = 0.05  # seconds a child's main thread sleeps after each `end` (issue 39)


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after load starts
    kind: str
    target: str | None
    value: float  # pause, duration or count, by kind

    def describe(self) -> str:
        target = f" {self.target}" if self.target else ""
        unit = UNITS.get(self.kind)
        value = "" if unit is None else f" ({self.value:g}{unit})"
        return f"+{self.at:7.2f}s {self.kind}{target}{value}"


def plan(seed: int, profile: Profile) -> list[Fault]:
    """A seeded schedule: every kind in the profile at least once, the rest by weight.

    A target (a worker slot, a reaper, Redis, the API) takes one fault at a time,
    at least one worker is always left running, and every fault is over before
    the load stops, so the drain starts from a healed system.
    """
    rng = random.Random(seed)
    kinds = list(profile.fault_kinds)
    if not kinds:
        return []
    workers = [f"worker-{i + 1}" for i in range(profile.workers)]
    # The children of the process-pool workers (the last `pool_workers`): paused apart
    # from their worker's own faults.
    children = [f"{w}/children" for w in workers[len(workers) - profile.pool_workers :]]
    reapers = [f"reaper-{i + 1}" for i in range(profile.reapers)]
    n = max(len(kinds), round(profile.duration / profile.fault_every))
    extra = rng.choices(kinds, [WEIGHTS.get(k, 1) for k in kinds], k=n - len(kinds))
    start, end = 2.0, profile.duration - 1.0
    lease = profile.lease
    busy: dict[str, list[tuple[float, float]]] = {}

    def free(resource: str, a: float, b: float) -> bool:
        return all(b <= s or a >= e for s, e in busy.get(resource, []))

    def params(kind: str) -> tuple[float, float]:
        """(value, span): the fault's pause/duration/count, and how long it holds its target."""
        if kind in ("worker_kill", "reaper_kill"):
            value = round(rng.uniform(0.5, 3.0), 2)
            return value, value + 2.0  # the restarted process needs a moment to start
        if kind == "worker_stop":
            value = round(lease * rng.uniform(1.3, 2.5), 2)
            return value, value + 1.0
        if kind == "redis_restart":
            value = round(rng.uniform(max(2.0, lease * 0.7), max(6.0, lease * 1.3)), 2)
            return value, value + 1.0
        if kind == "duplicate_push":
            return rng.randint(20, 200), 0.5
        if kind == "orphan_submit":
            return rng.randint(3, 15), 5.0
        if kind == "child_pause":
            value = round(rng.uniform(3.0, 8.0), 2)
            return value, value + 0.5
        if kind == "detach_pending":
            return 0, 3.0  # one pending detach at a time (PostgreSQL allows no second)
        return 0, 3.0 if kind == "api_kill" else 0.5

    def candidates(kind: str, a: float, b: float) -> list[str]:
        if kind in ("worker_kill", "worker_stop"):
            if sum(not free(w, a, b) for w in workers) >= len(workers) - 1:
                return []  # one worker always keeps running
            return [w for w in workers if free(w, a, b)]
        if kind == "reaper_kill":
            return [r for r in reapers if free(r, a, b)]
        if kind == "child_pause":
            return [c for c in children if free(c, a, b)]
        if kind == "pg_terminate":
            pool = [*workers, *workers, *reapers, "api"]  # workers twice as likely
            return [x for x in pool if free(x, a, b)]
        resource = {
            "redis_restart": "redis",
            "redis_flushall": "redis",
            "duplicate_push": "redis",
            "api_kill": "api",
            "orphan_submit": "orphan",
            "detach_pending": "partitions",
        }[kind]
        return [resource] if free(resource, a, b) else []

    out: list[Fault] = []

    def place(kind: str, times: list[float]) -> None:
        value, span = params(kind)
        for t in times:
            if t + span > end:
                continue
            found = candidates(kind, t, t + span)
            if found:
                target = rng.choice(found)
                busy.setdefault(target, []).append((t, t + span))
                shown = None if target in ("redis", "orphan", "partitions") else target
                out.append(Fault(round(t, 2), kind, shown, value))
                return

    # One of each kind first, anywhere there is room; then the rest, each at a random
    # time or (if its target is taken) up to 12 s later.
    for kind in rng.sample(kinds, len(kinds)):
        place(kind, [rng.uniform(start, end) for _ in range(50)])
    for kind in extra:
        at = rng.uniform(start, end)
        place(kind, [at + shift for shift in range(12)])
    return sorted(out, key=lambda f: f.at)


class Injector(threading.Thread):
    """Plays a schedule against the stack; undoes (restart, SIGCONT, Redis up) on time."""

    def __init__(self, schedule: list[Fault], stack: Stack, load: LoadGenerator, seed: int) -> None:
        super().__init__(name="injector", daemon=True)
        self.stack = stack
        self.load = load
        self.rng = random.Random(seed + 1)
        self.injected: Counter[str] = Counter()
        self.notes: Counter[str] = Counter()
        self.log: list[str] = []
        self.errors: list[str] = []
        self._events: list[tuple[float, int, str, Callable[[], str]]] = []
        self._seq = 0
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self.t0 = 0.0
        for f in schedule:
            self._push(f.at, f"{f.kind}", lambda f=f: self._inject(f))

    def _push(self, at: float, label: str, action: Callable[[], str]) -> None:
        with self._lock:
            self._seq += 1
            heapq.heappush(self._events, (at, self._seq, label, action))

    def start(self) -> None:
        self.t0 = time.monotonic()
        super().start()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> None:
        while not self._halt.is_set():
            with self._lock:
                head = self._events[0] if self._events else None
            if head is None:
                self._halt.wait(0.2)
                continue
            delay = head[0] - self.now()
            if delay > 0:
                self._halt.wait(min(delay, 0.2))
                continue
            with self._lock:
                _, _, label, action = heapq.heappop(self._events)
            self._run(label, action)

    def _run(self, label: str, action: Callable[[], str]) -> None:
        try:
            what = action()
        except Exception as exc:  # a fault that could not be applied is reported, not fatal
            what = f"{label} FAILED: {exc.__class__.__name__}: {exc}"
            self.errors.append(what)
        line = f"+{self.now():7.2f}s {what}"
        self.log.append(line)
        log.info(line)

    def stop(self) -> None:
        """Stop injecting; undo what is still pending (restarts, SIGCONT, Redis up) now."""
        self._halt.set()
        self.join(15)
        with self._lock:
            pending = sorted(self._events)
            self._events = []
        for _, _, label, action in pending:
            if label.startswith("undo"):
                self._run(label, action)

    # --- the faults ---------------------------------------------------------------

    def _later(self, delay: float, label: str, action: Callable[[], str]) -> None:
        self._push(self.now() + delay, f"undo {label}", action)

    def _inject(self, f: Fault) -> str:
        st = self.stack
        kind = f.kind
        self.injected[kind] += 1
        if kind in ("worker_kill", "reaper_kill"):
            svc = st.service(f.target)
            svc.expected_down = True
            if not svc.kill():
                self.notes[f"{kind}: target was not running"] += 1
            self._later(f.value, kind, lambda: self._restart(svc))
            return f"kill -9 {svc.name}; restart in {f.value:g}s"
        if kind == "worker_stop":
            svc = st.service(f.target)
            svc.signal(signal.SIGSTOP, group=True)
            self._later(f.value, kind, lambda: self._cont(svc))
            return f"SIGSTOP {svc.name} for {f.value:g}s (lease {st.profile.lease:g}s)"
        if kind == "redis_restart":
            st.redis.stop()
            self._later(f.value, kind, self._redis_up)
            return f"redis stopped for {f.value:g}s"
        if kind == "redis_flushall":
            st.redis.flushall()
            return "redis FLUSHALL"
        if kind == "duplicate_push":
            ids = self.load.accepted_ids()
            sample = self.rng.sample(ids, min(len(ids), int(f.value)))
            if sample:
                st.redis.client().rpush(st.queue_key("default"), *sample)
            self.notes["duplicate ids pushed"] += len(sample)
            return f"RPUSH {len(sample)} ids already pushed"
        if kind == "pg_terminate":
            n = st.terminate_backends(f.target)
            self.notes["postgres backends terminated"] += n
            return f"pg_terminate_backend: {n} connection(s) of {f.target}"
        if kind == "api_kill":
            children = st.api.children()
            if not children:
                self.notes["api_kill: no gunicorn worker up"] += 1
                return "api_kill: no gunicorn worker to kill"
            pid = self.rng.choice(children)
            st.kill_pid(pid)
            return f"kill -9 gunicorn worker {pid}"
        if kind == "child_pause":
            # Every child of the worker, after each attempt's `end`, sleeps on its main
            # thread while its reader takes the next `run` and its flags (D210).
            svc = st.service(f.target.split("/")[0])
            hook = st.pause_file(svc.name)
            hook.write_text(str(CHILD_PAUSE))
            self._later(f.value, kind, lambda: self._unpause(hook, svc.name))
            return (f"{svc.name}'s children pause {CHILD_PAUSE * 1000:g} ms after each end "
                    f"for {f.value:g}s")  # fmt: skip
        if kind == "orphan_submit":
            seed = self.rng.randrange(2**31)
            threading.Thread(
                target=self._orphans, args=(int(f.value), seed), name="orphans", daemon=True
            ).start()
            return f"orphan submit of {int(f.value)} rows (commit, then exit before the push)"
        if kind == "detach_pending":
            table = st.interrupt_detach()
            self.notes["partitions left detach pending"] += 1
            return f"DETACH {table} CONCURRENTLY cut off by pg_terminate_backend: pending"
        raise ValueError(f"unknown fault kind {kind!r}")

    def _restart(self, svc) -> str:
        svc.start()
        return f"restart {svc.name}"

    def _cont(self, svc) -> str:
        svc.signal(signal.SIGCONT, group=True)
        return f"SIGCONT {svc.name}"

    def _unpause(self, hook, name: str) -> str:
        hook.unlink(missing_ok=True)
        return f"{name}'s children no longer pause"

    def _redis_up(self) -> str:
        self.stack.redis.start()
        return "redis started (empty)"

    def _orphans(self, count: int, seed: int) -> None:
        try:
            ids = self.stack.orphan_submit(count, seed)
        except Exception as exc:
            self.errors.append(f"orphan_submit FAILED: {exc}")
            return
        for job_id, kind in ids:
            self.load.record(job_id, kind, "orphan")
        self.notes["signal-less rows committed"] += len(ids)
