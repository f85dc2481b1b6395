"""Submitting jobs through the real HTTP API at a steady rate, and remembering
every job the service acknowledged.

A pacer thread feeds a bounded queue at `rate` per second; a few sender threads
(each with its own `http.client` connection) post them. Every request carries an
Idempotency-Key, so a request whose reply was lost (API killed, connection
reset) is retried safely: the service answers 200 with the job it already
committed. A job is *accepted* once the API returned 201 or 200 with its id.
"""

from __future__ import annotations

import http.client
import json
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from chaos.checks import DEBOUNCE_MARK
from chaos.profiles import POOL_QUEUE, THROTTLED_QUEUE, Profile

JOBS_PATH = "/api/v1/jobs/"
WORKFLOWS_PATH = "/api/v1/workflows/"
BATCH_PATH = "/api/v1/jobs/batch/"
SEQUENCE_JOBS = 4  # jobs per sequence key, submitted in one batch (their order is its order)


@dataclass
class Request:
    seq: int
    kind: str
    body: dict[str, Any]
    key: str
    cancel: bool = False
    replay: bool = False
    path: str = JOBS_PATH


@dataclass
class Accepted:
    job_id: int
    kind: str
    source: str  # "api" or "orphan"
    at: float = field(default_factory=time.monotonic)


def make_request(kind: str, seq: int, rng: random.Random, profile: Profile, tag: str) -> Request:
    """The body for one workload kind (see profiles.DEFAULT_MIX)."""
    key = f"chaos-{tag}-{seq}"
    slow = profile.lease + rng.uniform(*profile.slow_extra)
    brief = round(rng.uniform(0.1, 0.5), 2)
    bad = rng.choice(["set", "nan", "nul"])

    def ahead(lo: float, hi: float) -> str:
        return (datetime.now(UTC) + timedelta(seconds=rng.uniform(lo, hi))).isoformat()

    bodies: dict[str, dict[str, Any]] = {
        "echo": {"task": "echo", "payload": {"n": seq}},
        "record": {"task": "demo.record", "payload": {}},
        "record_brief": {"task": "demo.record", "payload": {"seconds": brief}},
        "record_slow": {"task": "demo.record", "payload": {"seconds": round(slow, 2)}},
        "sleep_slow": {"task": "sleep", "payload": {"seconds": round(slow, 2)}},
        "flaky": {"task": "demo.flaky", "payload": {"p": 0.4}},
        "flaky_low_budget": {"task": "demo.flaky", "payload": {"p": 0.5}, "max_retries": 1},
        "permanent": {"task": "demo.permanent", "payload": {}},
        "fail": {"task": "fail", "payload": {"message": "chaos"}, "max_retries": 1},
        "bad_result": {"task": "chaos.bad_result", "payload": {"kind": bad}},
        "hang": {"task": "chaos.hang", "payload": {}, "max_retries": 0},
        "exit": {"task": "chaos.exit", "payload": {}, "max_retries": 1},
        "die": {"task": "chaos.die", "payload": {}, "max_retries": 1, "queue": POOL_QUEUE},
        "scheduled": {"task": "echo", "payload": {"n": seq}, "run_at": ahead(1, 4)},
        "cancelled": {"task": "echo", "payload": {"n": seq}, "run_at": ahead(3, 6)},
        "idempotent_replay": {"task": "echo", "payload": {"n": seq}},
        "steps": {"task": "chaos.steps", "payload": {"steps": 4, "seconds": brief / 2}},
        "nap": {"task": "chaos.nap", "payload": {"seconds": round(rng.uniform(0.5, 2), 2)}},
        # Flow control per key (jobs.flow): a few debounce keys gather many submissions
        # (no Idempotency-Key: a retry joins the same job); a busy key skips new jobs;
        # a key's rate refuses past 3 a second (429 with Retry-After, retried).
        # The payload names its debounce key: the checks find a key's jobs by it.
        "debounced": {"task": "demo.record",
                      "payload": {"n": seq, DEBOUNCE_MARK: f"{tag}-d{seq % 7}"},
                      "debounce_key": f"{tag}-d{seq % 7}", "debounce_seconds": 0.3},
        "skip_new": {"task": "echo", "payload": {"n": seq},
                     "concurrency_key": f"{tag}-k{seq % 3}", "key_strategy": "skip_new"},
        "rate_limited": {"task": "echo", "payload": {"n": seq}, "concurrency_key": f"{tag}-r",
                         "rate_limit": {"limit": 3, "period": 1}},
        "throttled": {"task": "echo", "payload": {"n": seq}, "queue": THROTTLED_QUEUE,
                      "concurrency_key": f"{tag}-t"},
        "chain": {"task": "chaos.chain", "payload": {"per_run": 3, "runs": 3}, "max_retries": 5},
    }  # fmt: skip
    if kind == "workflow":  # a diamond: a → (b, c) → d; b may fail for good
        steps = [
            {"id": "a", "task": "echo", "payload": {"n": seq}},
            {"id": "b", "task": "demo.flaky", "payload": {"p": 0.4}, "max_retries": 1,
             "after": ["a"]},
            {"id": "c", "task": "chaos.steps", "payload": {"steps": 3, "seconds": brief / 3},
             "after": ["a"]},
            {"id": "d", "task": "demo.record", "payload": {}, "after": ["b", "c"]},
        ]  # fmt: skip
        on_failure = rng.choice(["fail_dependents", "continue"])
        body = {"name": f"chaos-{seq}", "steps": steps, "on_failure": on_failure}
        return Request(seq, kind, body, key, path=WORKFLOWS_PATH)
    if kind == "sequence":  # one key's jobs, strictly one at a time in order (jobs.flow)
        jobs = [
            {"task": "demo.record", "payload": {"seconds": round(rng.uniform(0.05, 0.3), 2)},
             "sequence_key": key, "max_retries": 10, "idempotency_key": f"{key}-{i}"}
            for i in range(SEQUENCE_JOBS)
        ]  # fmt: skip
        return Request(seq, kind, {"jobs": jobs}, key, path=BATCH_PATH)
    if kind not in bodies:
        raise ValueError(f"unknown workload kind {kind!r}")
    return Request(
        seq,
        kind,
        bodies[kind],
        "" if "debounce_key" in bodies[kind] else key,
        cancel=kind == "cancelled",
        replay=kind == "idempotent_replay",
    )


class ApiClient:
    """One connection to the API (not thread-safe: one per sender thread)."""

    def __init__(self, port: int, token: str, timeout: float = 10.0) -> None:
        self.port = port
        self.token = token
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def call(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        if self._conn is None:
            self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        data = json.dumps(body).encode() if body is not None else b""
        hdrs = {"Authorization": f"Token {self.token}", "Content-Length": str(len(data))}
        if body is not None:
            hdrs["Content-Type"] = "application/json"
        hdrs.update(headers or {})
        try:
            self._conn.request(method, path, body=data, headers=hdrs)
            resp = self._conn.getresponse()
            raw = resp.read()
            if resp.getheader("Connection", "").lower() == "close":
                self.close()
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            payload = raw.decode(errors="replace")
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class LoadGenerator:
    """Steady submissions with bounded concurrency; records what was accepted."""

    RETRY_DEADLINE = 30.0

    def __init__(
        self,
        port: int,
        token: str,
        profile: Profile,
        rng: random.Random,
        tag: str,
        rate: float | None = None,
    ) -> None:
        self.port = port
        self.token = token
        self.profile = profile
        self.rng = rng
        self.tag = tag
        self.rate = rate or profile.rate
        self.max_jobs = profile.max_jobs
        self._queue: queue.Queue[Request | None] = queue.Queue(maxsize=profile.senders * 4)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.accepted: dict[int, Accepted] = {}
        self.stats: Counter[str] = Counter()
        self.problems: list[str] = []  # contract breaches seen from the client side
        self._threads: list[threading.Thread] = []
        self.started_at = 0.0
        self.sent = 0
        self.handled = 0  # requests whose submission ended (accepted, refused or given up)
        kinds = [n for _, n in profile.mix]
        self._kinds, self._weights = kinds, [w for w, _ in profile.mix]

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._threads = [threading.Thread(target=self._pace, name="pacer", daemon=True)]
        self._threads += [
            threading.Thread(target=self._send_loop, name=f"sender-{i}", daemon=True)
            for i in range(self.profile.senders)
        ]
        for t in self._threads:
            t.start()

    def finished_pacing(self) -> bool:
        return not self._threads[0].is_alive()

    def all_sent(self) -> bool:
        """With max_jobs: every paced request has been answered (or given up on)."""
        with self._lock:
            return self.finished_pacing() and self.handled >= self.sent

    def stop(self, timeout: float = 45.0) -> None:
        """Stop pacing; let requests in flight finish (they retry for up to 30 s)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._threads[0].join(timeout)
        while True:  # drop what was paced but not sent
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self.stats["not_sent"] += 1
        for _ in self._threads[1:]:
            try:
                self._queue.put(None, timeout=1)
            except queue.Full:
                break
        deadline = time.monotonic() + timeout
        for t in self._threads[1:]:
            t.join(max(0.1, deadline - time.monotonic()))

    def accepted_ids(self) -> list[int]:
        with self._lock:
            return list(self.accepted)

    def record(self, job_id: int, kind: str, source: str) -> None:
        with self._lock:
            self.accepted.setdefault(job_id, Accepted(job_id, kind, source))

    # --- threads ---------------------------------------------------------------------

    def _pace(self) -> None:
        seq = 0
        t0 = time.monotonic()
        while not self._stop.is_set():
            if self.max_jobs is not None and seq >= self.max_jobs:
                return
            due = t0 + seq / self.rate
            delay = due - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                return
            kind = self.rng.choices(self._kinds, self._weights)[0]
            req = make_request(kind, seq, self.rng, self.profile, self.tag)
            while not self._stop.is_set():
                try:
                    self._queue.put(req, timeout=0.5)
                    break
                except queue.Full:
                    continue
            seq += 1
            self.sent = seq

    def _send_loop(self) -> None:
        client = ApiClient(self.port, self.token)
        try:
            while True:
                req = self._queue.get()
                if req is None:
                    return
                try:
                    self._submit(client, req)
                finally:
                    with self._lock:
                        self.handled += 1
        finally:
            client.close()

    def _post(self, client: ApiClient, req: Request) -> tuple[int | None, Any]:
        """POST with retries on errors, 5xx and 429; (status, body) or (None, last error)."""
        deadline = time.monotonic() + self.RETRY_DEADLINE
        attempt = 0
        last: Any = None
        while True:
            attempt += 1
            try:
                status, headers, body = client.call(
                    "POST", req.path, req.body, {"Idempotency-Key": req.key} if req.key else {}
                )
            except (OSError, http.client.HTTPException) as exc:
                status, headers, body = None, {}, f"{exc.__class__.__name__}: {exc}"
                self.stats["connection_errors"] += 1
            last = body
            if status is not None and status < 500 and status != 429:
                if attempt > 1:
                    self.stats["retried_submissions"] += 1
                return status, body
            if status == 429:
                self.stats["throttled_429"] += 1
                wait = min(2.0, float(headers.get("retry-after", "1") or 1))
            else:
                if status is not None:
                    self.stats[f"http_{status}"] += 1
                wait = min(2.0, 0.1 * 2**attempt)
            if time.monotonic() + wait > deadline or (self._stop.is_set() and attempt > 3):
                return None, last
            time.sleep(wait)

    def _submit(self, client: ApiClient, req: Request) -> None:
        status, body = self._post(client, req)
        if status is None:
            self.stats["unacknowledged"] += 1
            return
        if status in (200, 201) and req.path == WORKFLOWS_PATH and isinstance(body, dict):
            self.stats["accepted_workflows"] += 1
            for step in body.get("steps", []):
                self.record(int(step["job_id"]), f"{req.kind}:{step['id']}", "api")
            return
        if status in (200, 201) and req.path == BATCH_PATH and isinstance(body, dict):
            self.stats["accepted_sequences"] += 1
            for job in body.get("jobs", []):
                self.record(int(job["id"]), req.kind, "api")
            return
        if status in (200, 201) and isinstance(body, dict) and "id" in body:
            job_id = int(body["id"])
            self.stats[f"accepted_{status}"] += 1
            self.record(job_id, req.kind, "api")
            if req.replay:
                self._replay(client, req, job_id)
            if req.cancel:
                self._cancel(client, job_id)
            return
        self.stats[f"refused_{status}"] += 1
        with self._lock:
            self.problems.append(f"valid {req.kind} request refused: {status} {str(body)[:200]}")

    def _replay(self, client: ApiClient, req: Request, job_id: int) -> None:
        status, body = self._post(client, req)
        if status is None:
            return
        got = body.get("id") if isinstance(body, dict) else None
        if status != 200 or got != job_id:
            with self._lock:
                self.problems.append(
                    f"idempotent replay of job {job_id} answered {status} with id {got}"
                )
        else:
            self.stats["replays_answered_200_same_job"] += 1

    def _cancel(self, client: ApiClient, job_id: int) -> None:
        try:
            status, _, body = client.call("POST", f"{JOBS_PATH}{job_id}/cancel/")
        except (OSError, http.client.HTTPException):
            self.stats["cancel_errors"] += 1
            return
        if status == 200:
            self.stats["cancelled"] += 1
        elif status == 409:
            self.stats["cancel_too_late"] += 1
        else:
            self.stats[f"cancel_{status}"] += 1
