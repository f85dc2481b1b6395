"""Staff repairs on selected jobs, each through its lifecycle service.

`run_staff_action` is to these what Django's `delete_selected` is to deletion:
a module-level action with its permission, a confirmation page, a LogEntry per
changed job and a message counting what it did and what it skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.db import transaction
from django.db.models import Manager, Model, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.functional import Promise
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy as _lazy
from django.utils.translation import ngettext_lazy

from jobs import lifecycle, selectors, services
from jobs.admin.display import budget_text, error_detail_html
from jobs.lifecycle import Move, Status
from jobs.models import Job


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
# service; the label, the button's label and the verb. The confirmation page explains
# each in the template admin/jobs/job/actions/<name>.html.
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


def staff_actor(request: HttpRequest) -> str:
    return lifecycle.actor(lifecycle.Role.STAFF, request.user.get_username())


def log_change(request: HttpRequest, objects: Iterable[Model], message: str) -> None:
    """A CHANGE entry in the admin log for each object, by the request's staff user."""
    LogEntry.objects.log_actions(request.user.pk, objects, CHANGE, change_message=message)


def log_changed(
    request: HttpRequest, rows: QuerySet | Manager, pks: Sequence, message: str
) -> None:
    """`log_change` for the rows of `rows` whose primary key an action changed, if any."""
    if pks:
        log_change(request, rows.filter(pk__in=pks), message)


def tally(done: Promise, skipped: Promise, applied: int, passed_over: int, **params: Any) -> str:
    """An action's count, as in "3 retried, 1 skipped: …". `done` and `skipped` are
    `ngettext_lazy(…, "count")`, each plural by its own count; the skipped part only
    when some were."""
    text = done % {"count": applied, **params}
    if passed_over:
        text += skipped % {"count": passed_over, **params}
    return text


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


def run_staff_action(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet, spec: StaffAction
) -> TemplateResponse | None:
    """Confirm first; on confirmation run the service chunk by chunk and report."""
    if request.POST.get("post") != "yes":
        return confirmation(modeladmin, request, queryset, spec)
    actor = staff_actor(request)
    cap = modeladmin.action_count_cap
    selected, exact = selectors.capped_count(queryset, cap)
    applied = 0
    message = f"{spec.label}: {spec.verb} by {actor}"
    for chunk in eligible_id_chunks(queryset, spec, modeladmin.action_chunk_size):
        with transaction.atomic():
            done = spec.service(chunk, actor)
            log_changed(request, Job.objects.only("id", "task", "status"), done, message)
        applied += len(done)
    skipped = selected - applied if exact else 0
    text = tally(
        ngettext_lazy("%(count)d %(verb)s", "%(count)d %(verb)s", "count"),
        ngettext_lazy(", %(count)d skipped: %(reason)s",
                      ", %(count)d skipped: %(reason)s", "count"),
        applied, skipped, verb=spec.verb, reason=spec.skipped_because,
    )  # fmt: skip
    if not exact:
        text += _(" (over %(cap)s selected: the skipped are not counted)") % {"cap": f"{cap:,}"}
    modeladmin.message_user(request, text, messages.WARNING if skipped else messages.SUCCESS)
    return None


def confirmation(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet, spec: StaffAction
) -> TemplateResponse:
    """What will change, to how many, and a sample with the errors staff decide on."""
    cap = modeladmin.action_count_cap
    selected, selected_exact = selectors.capped_count(queryset, cap)
    eligible_qs = queryset.eligible_for(spec.move)
    eligible, eligible_exact = selectors.capped_count(eligible_qs, cap)
    # The budget spent and the last error with its traceback: a "card declined"
    # should not be retried blindly.
    sample = [
        {
            **row,
            "budget": budget_text(row["retry_count"], row["max_retries"]),
            "error_html": error_detail_html(
                row["error"], row["error_class"], row["error_traceback"], open_traceback=False
            ),
        }
        for row in eligible_qs.order_by("pk").values(
            "pk", "task", "queue", "status", "retry_count", "max_retries",
            "error", "error_class", "error_traceback",
        )[:20]
    ]  # fmt: skip
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": spec.label,
        "opts": modeladmin.opts,
        "spec": spec,
        "selected_count": selected,
        "eligible_count": eligible,
        "skipped_count": selected - eligible if selected_exact and eligible_exact else 0,
        "selected_exact": selected_exact,
        "eligible_exact": eligible_exact,
        "sample": sample,
        "eligible_states": ", ".join(s.value for s in spec.eligible),
        "selected_ids": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
        "select_across": request.POST.get("select_across", "0"),
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "actor": staff_actor(request),
        "changelist_url": request.get_full_path(),
    }
    return TemplateResponse(request, "admin/jobs/job/action_confirmation.html", context)


def make_action(spec: StaffAction) -> Callable:
    """The admin action for one spec: its permission, its label, `run_staff_action`."""

    @admin.action(permissions=[spec.permission], description=spec.label)
    def action(modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet):
        return run_staff_action(modeladmin, request, queryset, spec)

    action.__name__ = spec.name
    return action
