"""Staff repairs on selected jobs, each through its lifecycle service.

`run_staff_action` is to these what Django's `delete_selected` is to deletion:
a module-level action with its permission, a confirmation page, a LogEntry per
changed job and a message counting what it did and what it skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import Manager, Model, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.translation import gettext as _

from jobs import selectors, staff
from jobs.admin.display import budget_text, error_detail_html

# The specs and their runner live in jobs.staff, shared with `manage.py jobs`.
from jobs.staff import StaffAction


def staff_actor(request: HttpRequest) -> str:
    return staff.actor(request.user)


def log_change(request: HttpRequest, objects: Iterable[Model], message: str) -> None:
    """A CHANGE entry in the admin log for each object, by the request's staff user."""
    staff.log_change(request.user.pk, objects, message)


def log_changed(
    request: HttpRequest, rows: QuerySet | Manager, pks: Sequence, message: str
) -> None:
    """`log_change` for the rows of `rows` whose primary key an action changed, if any."""
    if pks:
        log_change(request, rows.filter(pk__in=pks), message)


def run_staff_action(
    modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet, spec: StaffAction
) -> TemplateResponse | None:
    """Confirm first; on confirmation run the service chunk by chunk and report."""
    if request.POST.get("post") != "yes":
        return confirmation(modeladmin, request, queryset, spec)
    cap = modeladmin.action_count_cap
    selected, exact = selectors.capped_count(queryset, cap)
    applied = staff.run(spec, queryset, request.user, modeladmin.action_chunk_size)
    skipped = selected - applied if exact else 0
    text = staff.outcome(spec, applied, skipped)
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
