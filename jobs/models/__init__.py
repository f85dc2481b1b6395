"""Tables of the job system, in rooms that follow what each serves: the job, its client
and history (`jobs`), the queues and the workers serving them (`queues`), flow control
per key and batches (`flow`), schedules (`schedules`), durable parts and workflows
(`durable`), webhooks and the outbox (`events`). Per-state invariants are named check
constraints built from `lifecycle`; transitions are guarded by a trigger (see
migrations).

Django loads the app's models from this package, and callers import every model and
public name from here (`from jobs.models import Job`), never from a room. The rooms
import only `jobs.models.jobs` beside them (tests/test_architecture.py, D401).
"""

from jobs.models.durable import (
    JobDependency,
    JobPart,
    JobSignal,
    JobStep,
    OnFailure,
    Workflow,
    WorkflowNode,
)
from jobs.models.events import CircuitState, DomainEvent, OutboxCursor, Webhook, WebhookDelivery
from jobs.models.flow import Batch, BatchFailure, Debounce, KeyHit, Sequence, SequenceWait
from jobs.models.jobs import (
    PRIORITY_MAX,
    PRIORITY_MIN,
    ArchivedPeriod,
    Client,
    Job,
    JobEvent,
    JobQuerySet,
)
from jobs.models.queues import Queue, WorkerProcess
from jobs.models.schedules import CatchUp, Origin, Overlap, Schedule, SchedulerRun

__all__ = [
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "ArchivedPeriod",
    "Batch",
    "BatchFailure",
    "CatchUp",
    "CircuitState",
    "Client",
    "Debounce",
    "DomainEvent",
    "Job",
    "JobDependency",
    "JobEvent",
    "JobPart",
    "JobQuerySet",
    "JobSignal",
    "JobStep",
    "KeyHit",
    "OnFailure",
    "Origin",
    "OutboxCursor",
    "Overlap",
    "Queue",
    "Schedule",
    "SchedulerRun",
    "Sequence",
    "SequenceWait",
    "Webhook",
    "WebhookDelivery",
    "WorkerProcess",
    "Workflow",
    "WorkflowNode",
]
