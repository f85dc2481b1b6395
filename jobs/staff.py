"""Staff repairs on jobs, whoever asks for them: the admin's actions and `manage.py
jobs` run the same spec through the same service, chunk by chunk, and leave the same
audit (the history row with actor `staff:<username>`, written by the service's
trigger, and one admin LogEntry per changed job), so neither can drift from the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from django.contrib.admin.models import CHANGE, LogEntry
from django.db import transaction
from django.db.models import Model, QuerySet
from django.utils.functional import Promise
from django.utils.translation import gettext_lazy as _lazy
from django.utils.translation import ngettext_lazy

from jobs import lifecycle, services
from jobs.lifecycle import Move, Status
from jobs.models import Job

CHUNK_SIZE = 1000  # jobs per transaction: one service call and its LogEntries


@dataclass(frozen=True)
class StaffAction:
    """One repair a staff member may run on selected jobs."""

    permission: str  # has_<permission>_permission, backed by jobs.<permission>_job
    move: Move  # the lifecycle move the service makes: its sources are the eligible states
    service: Callable[[Sequence[int], str], list[int]]
    label: str | Promise
    button: str | Promise  # short label on the job's detail page
    verb: str | Promise  # "3 retried"
    # "1 skipped: not failed"; by default, the eligible states the job was not in.
    skip_reason: str | Promise | None = None

    @property
    def name(self) -> str:
        return f"{self.permission}_jobs"

    @property
    def codename(self) -> str:
        """The permission a user needs, as `User.has_perm` takes it."""
        return f"jobs.{self.permission}_job"

    @property
    def skipped_because(self) -> str | Promise:
        return self.skip_reason or _lazy("not %s") % " or ".join(s.value for s in self.eligible)

    @property
    def explanation_template(self) -> str:
        """What the action does, in words, on its confirmation page."""
        return f"admin/jobs/job/actions/{self.name}.html"

    @property
    def eligible(self) -> tuple[Status, ...]:
        return self.move.states


# Each: the permission (the action is "<permission>_jobs"), the lifecycle move, the
# service; the label, the button's label and the verb. The admin's confirmation page
# explains each in the template admin/jobs/job/actions/<name>.html.
# fmt: off
# A failed job runs again with a fresh retry budget.
RETRY = StaffAction(
    "retry", lifecycle.STAFF_RETRY, services.staff_retry,
    _lazy("Retry failed jobs (resets the retry budget)"), _lazy("Retry"), _lazy("retried"),
    skip_reason=_lazy("not failed, or its unique key is taken"),
)
# An enqueue_failed job is queued again and re-signalled.
REPAIR = StaffAction(
    "repair", lifecycle.REPAIR, services.staff_repair,
    _lazy("Repair enqueue_failed jobs (requeue and re-signal)"),
    _lazy("Repair"), _lazy("repaired"),
)
# The worker running it is fenced off and the job queued again, no retry spent.
REVOKE = StaffAction(
    "revoke", lifecycle.REVOKE, services.revoke,
    _lazy("Revoke lease and requeue processing jobs"), _lazy("Revoke lease"), _lazy("revoked"),
)
# The handler is asked to stop at its next heartbeat; the lease stays.
CANCEL_RUNNING = StaffAction(
    "cancel_running", lifecycle.CANCEL_RUNNING, services.staff_cancel_running,
    _lazy("Cancel running jobs (ask the handler to stop)"), _lazy("Cancel running"),
    _lazy("asked to stop"),
)
# A job that has not started ends failed and never runs.
CANCEL = StaffAction(
    "cancel", lifecycle.CANCEL, services.cancel,
    _lazy("Cancel jobs that have not started"), _lazy("Cancel"), _lazy("cancelled"),
    skip_reason=_lazy("already started or finished"),
)
# fmt: on
STAFF_ACTIONS: tuple[StaffAction, ...] = (RETRY, REPAIR, REVOKE, CANCEL_RUNNING, CANCEL)


class StaffRefused(Exception):
    """The user may not run the action: the admin would not offer it to them."""


def actor(user: Any) -> str:
    """`staff:<username>`, the history's actor for a staff user's repairs."""
    return lifecycle.actor(lifecycle.Role.STAFF, user.get_username())


def check_allowed(user: Any, spec: StaffAction) -> None:
    """What the admin asks before it shows an action: an active staff user who may view
    jobs and holds the action's own permission."""
    name = user.get_username()
    if not (user.is_active and user.is_staff):
        raise StaffRefused(f"{name!r} is not an active staff user")
    for perm in ("jobs.view_job", spec.codename):
        if not user.has_perm(perm):
            raise StaffRefused(f"{name!r} lacks the permission {perm}")


def audit_message(spec: StaffAction, by: str) -> str:
    """The change message of each LogEntry an action writes."""
    return f"{spec.label}: {spec.verb} by {by}"


def log_change(user_pk: Any, objects: Iterable[Model], message: str) -> None:
    """A CHANGE entry in the admin log for each object, by the staff user."""
    LogEntry.objects.log_actions(user_pk, objects, CHANGE, change_message=message)


def eligible_id_chunks(
    queryset: QuerySet, spec: StaffAction, chunk_size: int
) -> Iterator[list[int]]:
    """Ids of the selected jobs in an eligible state, in pk order, a chunk at a time.

    Keyset pagination keeps each read small and lets select-across act on a
    filtered set of any size without holding its ids in memory at once.
    """
    eligible = queryset.eligible_for(spec.move).order_by("pk")
    last = 0
    while True:
        chunk = list(eligible.filter(pk__gt=last).values_list("pk", flat=True)[:chunk_size])
        if not chunk:
            return
        yield chunk
        last = chunk[-1]


def run(spec: StaffAction, queryset: QuerySet, user: Any, chunk_size: int = CHUNK_SIZE) -> int:
    """The action on the eligible jobs of `queryset`, by `user`; how many it changed.

    Each chunk is one transaction: the service's fenced write and the LogEntry of
    every job it changed commit together. Jobs that moved out of an eligible state
    meanwhile are left alone by the service's own compare-and-set."""
    by = actor(user)
    message = audit_message(spec, by)
    applied = 0
    for chunk in eligible_id_chunks(queryset, spec, chunk_size):
        with transaction.atomic():
            done = spec.service(chunk, by)
            if done:
                log_change(
                    user.pk, Job.objects.only("id", "task", "status").filter(pk__in=done), message
                )
        applied += len(done)
    return applied


def tally(done: Promise, skipped: Promise, applied: int, passed_over: int, **params: Any) -> str:
    """An action's count, as in "3 retried, 1 skipped: …". `done` and `skipped` are
    `ngettext_lazy(…, "count")`, each plural by its own count; the skipped part only
    when some were."""
    text = done % {"count": applied, **params}
    if passed_over:
        text += skipped % {"count": passed_over, **params}
    return text


def outcome(spec: StaffAction, applied: int, skipped: int) -> str:
    """What the admin's message says after the action: "1 retried, 1 skipped: …"."""
    return tally(
        ngettext_lazy("%(count)d %(verb)s", "%(count)d %(verb)s", "count"),
        ngettext_lazy(", %(count)d skipped: %(reason)s",
                      ", %(count)d skipped: %(reason)s", "count"),
        applied, skipped, verb=spec.verb, reason=spec.skipped_because,
    )  # fmt: skip
