"""Workflows: graphs of jobs created together (issue 17).

`Workflow("etl").step("load", "echo", {...}, after=["fetch"]).submit()` from Django,
`POST /api/v1/workflows/` from clients: the same rules (`build`). Every job of the
graph is inserted in one transaction; a job with parents starts queued with
wait_reason "parents" and run_at BLOCKED_RUN_AT, so no claim takes it, and the
database makes it due when its last parent ends (jobs.graph). A refused graph
(a cycle, an unknown step id or task, more than MAX_STEPS steps or
JOBS_WORKFLOW_MAX_EDGES `after` entries, a full queue) writes nothing.
"""

from __future__ import annotations

import graphlib
import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jobs import admission, selectors, services, submission, tasks, validation
from jobs.conf import settings
from jobs.exceptions import InvalidSubmission, RequestInvalid, SubmissionError
from jobs.models import Client, OnFailure
from jobs.observability import tracing

MAX_STEPS = 1000
MAX_NAME = 200
MAX_STEP_ID = 100
STEP_FIELDS = (
    "id", "task", "payload", "queue", "priority", "max_retries", "concurrency_key", "timeout",
    "after",
)  # fmt: skip
WORKFLOW_FIELDS = ("name", "steps", "on_failure")
_JOB_FIELDS = ("task", "payload", "queue", "priority", "max_retries", "concurrency_key", "timeout")
# Hashed only when given, so requests from before these fields existed keep their hash.
_HASHED_WHEN_GIVEN = frozenset({"concurrency_key", "timeout"})


@dataclass(frozen=True)
class Step:
    """One checked step: its id, parents and the checked submission arguments."""

    id: str
    after: tuple[str, ...]
    job: dict[str, Any]


@dataclass(frozen=True)
class Graph:
    name: str
    on_failure: str
    steps: tuple[Step, ...]
    request_hash: str = ""  # SHA-256 of the canonical request: what a replay must match


def _err(errors: dict, where: str, message: str, code: str = "invalid") -> None:
    errors.setdefault(where, []).append({"message": message, "code": code})


def _steps(raw_steps: list, errors: dict, for_client: bool) -> list[Step]:
    steps: list[Step] = []
    for n, raw in enumerate(raw_steps):
        where = f"steps[{n}]"
        if not isinstance(raw, dict):
            _err(errors, where, "each step must be a JSON object")
            continue
        for name in sorted(set(raw) - set(STEP_FIELDS), key=str):
            _err(errors, f"{where}.{submission._shown_name(name)}",
                 f"Unknown field; allowed: {', '.join(STEP_FIELDS)}.", "unknown_field")  # fmt: skip
        step_id = raw.get("id")
        if not isinstance(step_id, str) or not 1 <= len(step_id) <= MAX_STEP_ID:
            _err(errors, f"{where}.id", f"id must be a string of 1-{MAX_STEP_ID} characters")
            continue
        if why := validation.why_unstorable(step_id):
            _err(errors, f"{where}.id", f"id may not contain {why}")
            continue
        after = raw.get("after", [])
        if not isinstance(after, list) or not all(isinstance(a, str) for a in after):
            _err(errors, f"{where}.after", "after must be a list of step ids")
            continue
        item, refusals = submission._request_item(
            {k: v for k, v in raw.items() if k in _JOB_FIELDS}, _JOB_FIELDS, for_client=for_client
        )
        for exc in refusals:
            _err(errors, f"{where}.{exc.field or 'step'}", exc.message, exc.code)
        if not refusals:
            steps.append(Step(step_id, tuple(dict.fromkeys(after)), item))
    return steps


def build(body: Any, *, for_client: bool = False) -> Graph:
    """Check a workflow request (decoded JSON); raises RequestInvalid naming each
    broken rule, SubmissionError for a refusal of the request as a whole. A client's
    workflow runs public tasks only (`for_client`)."""
    if not isinstance(body, dict):
        raise InvalidSubmission("the request must be a JSON object", code="invalid")
    errors: dict[str, list[dict[str, str]]] = {}
    for name in sorted(set(body) - set(WORKFLOW_FIELDS), key=str):
        _err(errors, submission._shown_name(name),
             f"Unknown field; allowed: {', '.join(WORKFLOW_FIELDS)}.", "unknown_field")  # fmt: skip
    name = body.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
        _err(errors, "name", f"name must be a string of 1-{MAX_NAME} characters", "required")
    elif why := validation.why_unstorable(name):
        _err(errors, "name", f"name may not contain {why}")
    on_failure = body.get("on_failure", OnFailure.FAIL_DEPENDENTS.value)
    if on_failure not in OnFailure.values:
        _err(errors, "on_failure", f"on_failure must be one of {', '.join(OnFailure.values)}")
    raw_steps = body.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        _err(errors, "steps", "steps must be a non-empty list", "required")
        raise RequestInvalid(errors)
    if len(raw_steps) > MAX_STEPS:
        _err(errors, "steps", f"a workflow has at most {MAX_STEPS} steps, not {len(raw_steps)}",
             "too_many_steps")  # fmt: skip
        raise RequestInvalid(errors)
    steps = _steps(raw_steps, errors, for_client)
    edges, max_edges = sum(len(s.after) for s in steps), settings.JOBS_WORKFLOW_MAX_EDGES
    if edges > max_edges:
        # Before the graph checks: their cost grows with the edges (D107).
        _err(errors, "steps", f"a workflow has at most {max_edges} edges (`after` entries), "
             f"not {edges}", "too_many_edges")  # fmt: skip
        raise RequestInvalid(errors)
    ids = [s.id for s in steps]
    seen: set[str] = set()
    for n, step_id in enumerate(ids):
        if step_id in seen:
            _err(errors, f"steps[{n}].id", f"duplicate step id {step_id!r}", "duplicate_id")
        seen.add(step_id)
    for n, step in enumerate(steps):
        for parent in step.after:
            if parent not in seen:
                _err(errors, f"steps[{n}].after", f"unknown step id {parent!r}", "unknown_step")
    if not errors:
        try:
            graphlib.TopologicalSorter({s.id: s.after for s in steps}).prepare()
        except graphlib.CycleError as exc:
            cycle = " → ".join(exc.args[1])
            _err(errors, "steps", f"the steps form a cycle: {cycle}", "cycle")
    if errors:
        raise RequestInvalid(errors)
    canonical = {
        "name": name,
        "on_failure": on_failure,
        "steps": [{"id": st.id, "after": list(st.after),
                   **{k: st.job[k] for k in _JOB_FIELDS
                      if st.job[k] is not None or k not in _HASHED_WHEN_GIVEN}}
                  for st in steps],
    }  # fmt: skip
    digest = hashlib.sha256(
        json.dumps(canonical, sort_keys=True, separators=(",", ":"), default=str).encode()
    ).hexdigest()
    return Graph(name, on_failure, tuple(steps), digest)


def check_idempotency_key(key: Any) -> str | None:
    if key is not None and (
        not isinstance(key, str) or not validation.IDEMPOTENCY_KEY_RE.fullmatch(key)
    ):
        raise InvalidSubmission(
            "idempotency key must be 1-200 printable ASCII characters without spaces",
            field="idempotency_key",
            code="invalid_idempotency_key",
        )
    return key


def create(
    graph: Graph,
    *,
    client: Client | None = None,
    actor: str = "app",
    idempotency_key: str | None = None,
) -> tuple[int, bool]:
    """Write a checked graph: every job, node and edge in one transaction; the roots are
    signalled once it commits. Returns (workflow id, created): the same idempotency key
    with the same request returns the workflow it created (WorkflowIdempotencyConflict
    with another request). Every step counts against JOBS_MAX_QUEUE_DEPTH like a batch
    (QueueFull, nothing written); a replay is answered whatever the depth."""
    client_id = client.pk if client is not None else None
    key = check_idempotency_key(idempotency_key)
    per_queue = Counter(s.job["queue"] for s in graph.steps)

    def new_per_queue() -> Counter[str]:
        replay = key is not None and selectors.workflow_key_used(client_id, key)
        return Counter() if replay else per_queue

    admission.check_room(per_queue, new_per_queue, client)
    workflow_id, created = services.create_workflow(
        graph.name,
        graph.on_failure,
        [(s.id, s.after, s.job) for s in graph.steps],
        client_id=client_id,
        actor=actor,
        idempotency_key=key,
        request_hash=graph.request_hash if key is not None else None,
        trace_context=tracing.current(),  # every step goes on in the caller's trace
    )
    if created:
        admission.count_accepted(per_queue, client_id)
    return workflow_id, created


def submit_request(
    body: Any,
    *,
    client: Client | None = None,
    actor: str = "app",
    idempotency_key: str | None = None,
) -> tuple[int, bool]:
    graph = build(body, for_client=client is not None)
    return create(graph, client=client, actor=actor, idempotency_key=idempotency_key)


@dataclass
class Workflow:
    """Build a workflow in Django code, with the API's rules:

        wf = Workflow("nightly")
        wf.step("fetch", "fetch-data", {"day": "2026-11-30"})
        wf.step("load", load_day, args=["2026-11-30"], after=["fetch"])  # a Django task
        workflow_id = wf.submit()

    `submit()` writes inside the caller's transaction like `jobs.submission.submit()`
    (the jobs exist exactly when the caller's change does) and raises RequestInvalid.
    """

    name: str
    on_failure: str = OnFailure.FAIL_DEPENDENTS.value
    steps: list[dict[str, Any]] = field(default_factory=list)

    def step(
        self,
        id: str,
        task: Any,
        payload: Any = None,
        *,
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        after: Sequence[str] = (),
        queue: str | None = None,
        priority: int | None = None,
        max_retries: int | None = None,
        concurrency_key: str | None = None,
        timeout: float | None = None,
    ) -> Workflow:
        """Add a step running `task`: a Django task object with its `args` and `kwargs`
        (its queue, priority, retries and timeout unless given here), or a registered
        name with its `payload`. A step that could not run is refused here (D223)."""
        job = tasks.job_of(task, payload, args, kwargs)
        given = {"queue": queue, "priority": priority, "max_retries": max_retries,
                 "timeout": timeout, "concurrency_key": concurrency_key}  # fmt: skip
        raw: dict[str, Any] = {"id": id, "task": job["task"], "payload": job["payload"],
                               "queue": "default", "priority": 0}  # fmt: skip
        for name, value in given.items():
            value = value if value is not None else job.get(name)
            if value is not None:
                raw[name] = value
        raw["after"] = list(after)
        errors: dict[str, list[dict[str, str]]] = {}
        _steps([raw], errors, for_client=False)
        if errors:  # its place in the list, not steps[0]
            raise RequestInvalid(
                {where.replace("steps[0]", f"steps[{len(self.steps)}]"): v
                 for where, v in errors.items()}
            )  # fmt: skip
        self.steps.append(raw)
        return self

    def submit(
        self,
        *,
        client: Client | None = None,
        actor: str = "app",
        idempotency_key: str | None = None,
    ) -> int:
        """Create the workflow; returns its id (the existing one for a reused key)."""
        body = {"name": self.name, "steps": self.steps, "on_failure": self.on_failure}
        return submit_request(body, client=client, actor=actor, idempotency_key=idempotency_key)[0]


def detail(workflow_id: int, client: Client | None = None) -> dict[str, Any] | None:
    """The workflow and each step's job and state, or None (not found, or another client's)."""
    return selectors.workflow_detail(workflow_id, client.pk if client is not None else None)


def cancel(workflow_id: int, *, actor: str, client: Client | None = None) -> list[int] | None:
    """Cancel the steps that have not started (their descendants follow under
    fail_dependents); running steps finish. Returns the cancelled job ids, or None."""
    found = detail(workflow_id, client)
    if found is None:
        return None
    ids = [s["job_id"] for s in found["steps"]]
    return services.cancel(ids, actor, client_id=client.pk if client is not None else None)


__all__ = ["Graph", "RequestInvalid", "Step", "SubmissionError", "Workflow", "build", "create"]
