"""The errors the submission pipeline, the services and the API share: one class per
refusal, raised where it is found and mapped to an HTTP answer by jobs.api.errors, with
no translation layer in between. Imports nothing of the project."""

from __future__ import annotations

from typing import Any

RETRY_AFTER_SECONDS = 5


class SubmissionError(Exception):
    """A submission that was refused; nothing was written.

    `code` is stable and machine-readable; `field` names the offending input
    (None when the request as a whole is refused).
    """

    code = "invalid"

    def __init__(self, message: str, *, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        if code is not None:
            self.code = code


class UnknownTask(SubmissionError):
    code = "unknown_task"


class InvalidSubmission(SubmissionError):
    """A field is out of range or of the wrong type, or the task's validator refused it."""


class UnknownQueue(SubmissionError):
    """The queue is not declared in JOBS_QUEUES (jobs.queues)."""

    code = "unknown_queue"


def first_message(errors: dict[str, list[dict[str, str]]]) -> str:
    """An error body's `detail`: the first real message (a client printing only `detail`
    sees what to fix), and how many more `errors` holds."""
    lines = _lines(errors)
    if not lines:
        return "Invalid request."
    more = len(lines) - 1
    return lines[0] + (f" (and {more} more in errors)" if more else "")


def _lines(errors: dict[str, list[dict[str, str]]]) -> list[str]:
    """Each message, prefixed by its field unless it names it already."""
    return [
        message if field in ("non_field_errors", "") or message.startswith(field)
        else f"{field}: {message}"
        for field, errs in errors.items()
        for message in (e["message"] for e in errs)
    ]  # fmt: skip


class RequestInvalid(SubmissionError):
    """Several rules broken at once; `errors` maps each field to [{message, code}]."""

    def __init__(self, errors: dict[str, list[dict[str, str]]]) -> None:
        codes = {e["code"] for items in errors.values() for e in items}
        super().__init__(first_message(errors), code=codes.pop() if len(codes) == 1 else "invalid")
        self.errors = errors

    def __str__(self) -> str:
        """Every broken rule (a traceback shows only this): `message` keeps the first."""
        return "; ".join(_lines(self.errors)) or self.message


class PayloadTooLarge(SubmissionError):
    code = "payload_too_large"


class QueueFull(SubmissionError):
    """Backpressure (SPEC §8): the target queue is past JOBS_MAX_QUEUE_DEPTH."""

    code = "queue_full"

    def __init__(self, queue: str, depth: int, limit: int) -> None:
        super().__init__(
            f"queue {queue!r} holds more than {limit} queued jobs; retry later",
            field="queue",
        )
        self.queue = queue
        self.depth = depth
        self.limit = limit
        self.retry_after = RETRY_AFTER_SECONDS


class ClientQueueFull(QueueFull):
    """A client's own share of a queue is full (D198): its backlog, parked jobs included,
    is refused to it alone, with the Retry-After of backpressure."""

    code = "client_queue_full"

    def __init__(self, queue: str, held: int, limit: int) -> None:
        super().__init__(queue, held, limit)
        self.message = (
            f"you hold {limit} or more queued jobs in queue {queue!r}, your share; "
            "retry when some have run, or ask staff to raise your limit"
        )
        self.args = (self.message,)


class RateLimited(SubmissionError):
    """A submission's `rate_limit` (jobs.flow.keyrate): its concurrency key had as many
    accepted submissions as the limit in the window; `retry_after` is the whole seconds
    until the oldest of them leaves it."""

    code = "rate_limited"

    def __init__(self, key: str, limit: int, period: int, retry_after: int) -> None:
        super().__init__(
            f"concurrency key {key!r} had {limit} submissions in the last {period} s, its "
            f"rate_limit; retry in {retry_after} s",
            field="rate_limit",
        )
        self.retry_after = retry_after


class DebounceConflict(SubmissionError):
    """A debounce key gathers submissions of one task in one queue: this one names
    another while the key's job has not started."""

    code = "debounce_conflict"

    def __init__(self, key: str, job_id: int) -> None:
        super().__init__(
            f"debounce key {key!r} is gathering job {job_id} of another task or queue; "
            "use another key",
            field="debounce_key",
        )
        self.job_id = job_id


class QuotaExceeded(SubmissionError):
    """A client holds as many schedules or webhooks, or a job as many signals, as its
    quota allows (jobs.admission); the message names the limit."""

    code = "quota_exceeded"


class _KeyReused(SubmissionError):
    """The idempotency key was used before, for `holder`, with a different request."""

    code = "idempotency_conflict"

    def __init__(self, holder: str) -> None:
        super().__init__(
            f"idempotency key already used for {holder} with a different request",
            field="idempotency_key",
        )


class WorkflowIdempotencyConflict(_KeyReused):
    """The idempotency key was used before for a workflow with a different request."""

    def __init__(self, workflow_id: int) -> None:
        super().__init__(f"workflow {workflow_id}")
        self.workflow_id = workflow_id


class IdempotencyConflict(_KeyReused):
    """The idempotency key was used before with a different request."""

    def __init__(self, job: Any) -> None:
        super().__init__(f"job {job.pk}")
        self.job = job


# --- many at once ---------------------------------------------------------------


class BatchInvalid(SubmissionError):
    """Jobs of a batch were refused; nothing was written.

    `errors` maps "jobs.<index>.<field>" to [{message, code}] (the API's error shape).
    """

    code = "invalid_batch"

    def __init__(self, errors: dict[str, list[dict[str, str]]], refused: int, total: int):
        super().__init__(f"{refused} of {total} job(s) refused; nothing was written")
        self.errors = errors
        self.refused = refused


class BatchIdempotencyConflict(SubmissionError):
    """Jobs of a batch reuse an idempotency key with a different request; nothing written."""

    code = "idempotency_conflict"

    def __init__(self, conflicts: dict[int, int]) -> None:
        super().__init__(
            f"{len(conflicts)} idempotency key(s) already used with a different request; "
            "nothing was written"
        )
        self.conflicts = conflicts  # item index -> the job that holds the key
        self.errors = {
            f"jobs.{n}.idempotency_key": [
                {
                    "message": f"idempotency key already used for job {job_id} "
                    "with a different request",
                    "code": self.code,
                }
            ]
            for n, job_id in conflicts.items()
        }


class NotCancellable(Exception):
    """A finished job (done or failed) was asked to cancel; nothing was written. The
    API answers it 409 with the same `code`."""

    code = "not_cancellable"

    def __init__(self, job_id: int, status: str):
        super().__init__(f"job {job_id} is {status}; a finished job cannot be cancelled")
        self.job_id = job_id
        self.status = status
