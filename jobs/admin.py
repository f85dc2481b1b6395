"""The staff console: inspect jobs, and repair them only through the services.

Jobs are never edited, added or deleted here: every field is read-only and
every change goes through a lifecycle service (`jobs.services`) as a
compare-and-set, with the staff user as the actor, so the database trigger
writes the history row and the guard refuses anything illegal. Each action
has its own permission, a confirmation page, a LogEntry per changed job and a
count of what it did and skipped. Lists stay cheap on a million rows: no full
count, indexed filters, exact-id search.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import transaction
from django.db.models import F, Q, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.cache import add_never_cache_headers
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join

from jobs import lifecycle, selectors, services
from jobs import tasks as task_registry
from jobs.lifecycle import Move, Status
from jobs.models import Client, Job, JobEvent
from jobs.selectors import progress_of

BADGE_COLOURS = {
    Status.QUEUED: "#1f6feb",
    Status.PROCESSING: "#9a6700",
    Status.DONE: "#1a7f37",
    Status.FAILED: "#cf222e",
    Status.ENQUEUE_FAILED: "#8250df",
}


# States that hold few rows: a list narrowed to one of them may sort by any column.
NARROW_STATES = {Status.QUEUED, Status.PROCESSING, Status.ENQUEUE_FAILED, Status.FAILED}


def status_badge_html(status: str) -> str:
    colour = BADGE_COLOURS.get(status, "#57606a")
    return format_html(
        '<span class="job-badge job-badge-{}" style="display:inline-block;padding:1px 8px;'
        "border-radius:10px;color:#fff;background:{};font-weight:600;font-size:11px;"
        'white-space:nowrap">{}</span>',
        status,
        colour,
        status,
    )


def short_duration(value: timedelta | float | None) -> str:
    """'3d 4h', '2h 5m', '4m 10s', '12s' — enough to read at a glance."""
    if value is None:
        return "—"
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    sign = "-" if seconds < 0 else ""
    s = int(abs(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{sign}{days}d {hours}h"
    if hours:
        return f"{sign}{hours}h {minutes}m"
    if minutes:
        return f"{sign}{minutes}m {s}s"
    return f"{sign}{s}s"


def iso_time(value: datetime | None) -> str:
    """UTC to the millisecond: lease and heartbeat questions need seconds."""
    if value is None:
        return "—"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


LAST_ERROR_CHARS = 60
LAST_ERROR_TITLE_CHARS = 500


def truncate(text: str, limit: int) -> str:
    """First line of `text`, at most `limit` characters; an ellipsis says more was cut."""
    text = text.strip()
    line = text.split("\n", 1)[0]
    if len(line) > limit:
        return line[: limit - 1] + "…"
    return line if line == text else line + " …"


def budget_text(retry_count: int, max_retries: int) -> str:
    """The retry budget in words: "4 attempts (3 retries)" once spent, else how much is used."""
    if retry_count > max_retries:
        retries = retry_count - 1
        return f"{retry_count} attempts ({retries} retr{'y' if retries == 1 else 'ies'})"
    return f"{retry_count} of {max_retries} retries"


def error_detail_html(
    error: str | None,
    error_class: str | None,
    traceback: str | None,
    *,
    open_traceback: bool = True,
) -> str:
    """An error, its exception class and its traceback (folded unless `open_traceback`)."""
    if not error:
        return "—"
    parts = [
        format_html('<pre class="job-error" style="margin:0;white-space:pre-wrap">{}</pre>', error)
    ]
    if error_class:
        parts.append(format_html('<div class="job-error-class">{}</div>', error_class))
    if traceback:
        parts.append(
            format_html(
                '<details class="job-traceback"{}><summary>traceback</summary>'
                '<pre style="white-space:pre-wrap;font-size:11px">{}</pre></details>',
                " open" if open_traceback else "",
                traceback,
            )
        )
    return format_html_join("", "{}", ((part,) for part in parts))


def pretty_json(value: Any) -> str:
    if value is None:
        return "—"
    return format_html(
        '<pre style="margin:0;white-space:pre-wrap;max-height:30em;overflow:auto">{}</pre>',
        json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False),
    )


# --- counting without counting a million rows --------------------------------------


class CappedCountPaginator(Paginator):
    """Counts exactly up to `cap` rows; past that uses the planner's estimate.

    The unfiltered list reads pg_class.reltuples, a filtered one EXPLAIN's row
    estimate, so no page view scans the whole table to print a number.
    """

    cap = 10_000

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.count_is_exact = True

    @cached_property
    def count(self) -> int:
        n, self.count_is_exact = selectors.capped_count(self.object_list, self.cap)
        return n


# --- list filters ---------------------------------------------------------------------


class StuckFilter(admin.SimpleListFilter):
    """processing jobs whose heartbeat is older than the lease (database clock)."""

    title = "stuck"
    parameter_name = "stuck"

    def lookups(self, request, model_admin):
        return [("yes", f"processing, no heartbeat for > {settings.JOBS_LEASE_SECONDS:g} s")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.stuck(settings.JOBS_LEASE_SECONDS)
        return queryset


class _ValueFilter(admin.SimpleListFilter):
    """Exact match on one column; the choices come from somewhere cheap, never
    from SELECT DISTINCT over the table."""

    field = ""

    def known(self) -> list[str]:
        raise NotImplementedError

    def lookups(self, request, model_admin):
        values = set(self.known())
        if self.value():
            values.add(self.value())
        return [(v, v) for v in sorted(values)]

    def queryset(self, request, queryset):
        if self.value():
            return queryset.filter(**{self.field: self.value()})
        return queryset


class TaskFilter(_ValueFilter):
    title = "task"
    parameter_name = "task"
    field = "task"

    def known(self) -> list[str]:
        return task_registry.names()


class QueueFilter(_ValueFilter):
    title = "queue"
    parameter_name = "queue"
    field = "queue"

    def known(self) -> list[str]:
        """Queues with live jobs or among the newest jobs (cached, index-bounded)."""
        return ["default", *selectors.known_queues()]


# --- staff actions -------------------------------------------------------------------


@dataclass(frozen=True)
class StaffAction:
    """One repair a staff member may run on selected jobs."""

    name: str
    permission: str  # has_<permission>_permission, backed by jobs.<permission>_job
    label: str
    button: str  # short label on the job's detail page
    verb: str  # "3 retried"
    move: Move  # the lifecycle move the service makes: its sources are the eligible states
    skip_reason: str  # "1 skipped: not failed"
    explanation: str
    service: Callable[[Sequence[int], str], list[int]]

    @property
    def eligible(self) -> tuple[Status, ...]:
        return self.move.states


RETRY = StaffAction(
    name="retry_jobs",
    permission="retry",
    label="Retry failed jobs (resets the retry budget)",
    button="Retry",
    verb="retried",
    move=lifecycle.STAFF_RETRY,
    skip_reason="not failed",
    explanation=(
        "Each failed job goes back to queued with retry_count reset to 0, its result "
        "cleared and run_at set to now; workers are signalled after commit. Jobs that "
        "are not failed are left alone."
    ),
    service=services.staff_retry,
)
REPAIR = StaffAction(
    name="repair_jobs",
    permission="repair",
    label="Repair enqueue_failed jobs (requeue and re-signal)",
    button="Repair",
    verb="repaired",
    move=lifecycle.REPAIR,
    skip_reason="not enqueue_failed",
    explanation=(
        "Each enqueue_failed job goes back to queued and its id is pushed to Redis "
        "again after commit. Jobs in any other state are left alone."
    ),
    service=services.staff_repair,
)
REVOKE = StaffAction(
    name="revoke_jobs",
    permission="revoke",
    label="Revoke lease and requeue processing jobs",
    button="Revoke lease",
    verb="revoked",
    move=lifecycle.REVOKE,
    skip_reason="not processing",
    explanation=(
        "Each processing job goes back to queued with lease_version bumped and its "
        "owner cleared, so the worker still running it is fenced off: its heartbeat and "
        "its final write are rejected. No retry is spent. Jobs that are not processing "
        "are left alone."
    ),
    service=services.revoke,
)
CANCEL_RUNNING = StaffAction(
    name="cancel_running_jobs",
    permission="cancel_running",
    label="Cancel running jobs (ask the handler to stop)",
    button="Cancel running",
    verb="asked to stop",
    move=lifecycle.CANCEL_RUNNING,
    skip_reason="not processing",
    explanation=(
        "Each processing job gets a cancel request: its worker tells the handler at its "
        "next heartbeat (within a third of the lease). A handler that stops ends failed "
        'with the error "cancelled"; one that finishes anyway ends done (the cancel came '
        "too late). A retry or an expired lease never runs it again. The lease is not "
        "revoked. Jobs that are not processing are left alone."
    ),
    service=services.staff_cancel_running,
)
CANCEL = StaffAction(
    name="cancel_jobs",
    permission="cancel",
    label="Cancel jobs that have not started",
    button="Cancel",
    verb="cancelled",
    move=lifecycle.CANCEL,
    skip_reason="already started or finished",
    explanation=(
        'Each queued or enqueue_failed job ends as failed with the error "cancelled". '
        "Jobs already processing or finished are left alone (revoke a processing job "
        "first if it must not run)."
    ),
    service=services.cancel,
)
STAFF_ACTIONS: tuple[StaffAction, ...] = (RETRY, REPAIR, REVOKE, CANCEL_RUNNING, CANCEL)


def staff_actor(request: HttpRequest) -> str:
    return lifecycle.actor(lifecycle.Role.STAFF, request.user.get_username())


def _make_action(spec: StaffAction) -> Callable:
    @admin.action(permissions=[spec.permission], description=spec.label)
    def action(modeladmin: JobAdmin, request: HttpRequest, queryset: QuerySet):
        return modeladmin.run_staff_action(request, queryset, spec)

    action.__name__ = spec.name
    return action


# --- inlines -------------------------------------------------------------------------


class JobEventInline(admin.TabularInline):
    """The job's full history, oldest first, read-only."""

    model = JobEvent
    fk_name = "job"
    verbose_name = "history event"
    verbose_name_plural = "History"
    fields = (
        "at_utc",
        "kind",
        "actor",
        "transition",
        "lease_version",
        "retry_count",
        "error_with_traceback",
    )
    readonly_fields = fields
    ordering = ("id",)
    extra = 0
    max_num = 0
    can_delete = False
    show_change_link = False

    @admin.display(description="at")
    def at_utc(self, obj: JobEvent) -> str:
        return iso_time(obj.at)

    @admin.display(description="from → to")
    def transition(self, obj: JobEvent) -> str:
        return f"{obj.from_status or '(new)'} → {obj.to_status}"

    @admin.display(description="error")
    def error_with_traceback(self, obj: JobEvent) -> str:
        """The attempt's error; for a failed attempt, its class and full traceback."""
        return error_detail_html(obj.error, obj.error_class, obj.error_traceback)

    def has_view_permission(self, request, obj=None) -> bool:
        return request.user.has_perm("jobs.view_job")

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


# --- jobs ----------------------------------------------------------------------------


class JobChangeList(ChangeList):
    def get_queryset(self, request, exclude_parameters=None):
        # A page of 100 rows has no use for up to 8 KiB of traceback each.
        return super().get_queryset(request, exclude_parameters).defer("error_traceback")


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "status_badge",
        "progress_bar",
        "task",
        "queue",
        "priority",
        "retries",
        "last_error",
        "lease_version",
        "owned_by",
        "client",
        "age",
        "in_state",
    )
    list_display_links = ("id",)
    list_filter = ("status", StuckFilter, TaskFilter, QueueFilter, "client")
    list_select_related = ("client",)
    list_per_page = 100
    list_max_show_all = 500
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facet counts would GROUP BY the whole table
    paginator = CappedCountPaginator
    ordering = ("-id",)
    sortable_by = ("id", "age", "priority", "retries", "lease_version", "in_state")
    search_fields = ("=id", "=idempotency_key")
    search_help_text = "Exact job id or idempotency key."
    actions = [_make_action(spec) for spec in STAFF_ACTIONS]
    inlines = [JobEventInline]
    action_chunk_size = 1000
    # Confirmation and action count the selection up to this many (D15), then estimate.
    action_count_cap = 10_000
    fieldsets = (
        (None, {"fields": ("id", "status_badge", "task", "queue", "priority", "client")}),
        (
            "Lease",
            {"fields": ("lease_version", "owned_by", "claimed", "heartbeat", "heartbeat_age")},
        ),
        ("Progress", {"fields": ("progress_detail", "cancel_requested")}),
        ("Retries", {"fields": ("retries", "max_retries", "run", "error_text")}),
        ("Times", {"fields": ("created", "updated", "finished", "in_state", "updated_by")}),
        ("Payload", {"fields": ("payload_pretty",)}),
        ("Result", {"fields": ("result_pretty",)}),
        ("Idempotency", {"fields": ("idempotency_key", "request_hash")}),
    )
    readonly_fields = tuple(f for _, opts in fieldsets for f in opts["fields"])

    def get_changelist(self, request, **kwargs):
        return JobChangeList

    # Jobs are written only by the services: no add, change or delete here.
    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def has_retry_permission(self, request) -> bool:
        return request.user.has_perm("jobs.retry_job")

    def has_repair_permission(self, request) -> bool:
        return request.user.has_perm("jobs.repair_job")

    def has_revoke_permission(self, request) -> bool:
        return request.user.has_perm("jobs.revoke_job")

    def has_cancel_permission(self, request) -> bool:
        return request.user.has_perm("jobs.cancel_job")

    def has_cancel_running_permission(self, request) -> bool:
        return request.user.has_perm("jobs.cancel_running_job")

    def get_queryset(self, request):
        # Ages from the database clock, like every other time in the system.
        return (
            super()
            .get_queryset(request)
            .annotate(
                _age=Now() - F("created_at"),
                _in_state=Now() - F("updated_at"),
                _heartbeat_age=Now() - F("heartbeat_at"),
            )
        )

    def get_sortable_by(self, request):
        """Only id order is indexed on the whole table; other columns sort once the
        list is narrowed to a small state (a million-row sort is not a page view)."""
        narrowed = (
            request.GET.get("status__exact") in NARROW_STATES
            or request.GET.get("stuck")
            or request.GET.get("q")
        )
        return self.sortable_by if narrowed else ("id", "age")

    def get_changelist_instance(self, request):
        """PostgreSQL text cannot hold NUL: a query carrying one is an invalid lookup
        (Django's "?e=1" page), never a database error."""
        if any("\x00" in part for k, vs in request.GET.lists() for part in (k, *vs)):
            raise IncorrectLookupParameters("NUL in the query string")
        return super().get_changelist_instance(request)

    def get_search_results(self, request, queryset, search_term):
        """Exact id or idempotency key only: no icontains over a million rows."""
        term = search_term.strip()
        if not term:
            return queryset, False
        # The key is unique per client, indexed as (client_id, idempotency_key): naming
        # every client lets that index answer instead of a scan of the table.
        client_ids = list(Client.objects.values_list("pk", flat=True))
        query = Q(client_id__in=client_ids, idempotency_key=term) | Q(
            client_id__isnull=True, idempotency_key=term
        )
        if term.isascii() and term.isdigit() and int(term) < 2**63:  # not "²"
            query |= Q(pk=int(term))
        return queryset.filter(query), False

    # --- columns

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Job) -> str:
        return status_badge_html(obj.status)

    @admin.display(description="retries", ordering="retry_count")
    def retries(self, obj: Job) -> str:
        return budget_text(obj.retry_count, obj.max_retries)

    @admin.display(description="last error")
    def last_error(self, obj: Job) -> str:
        """The latest error, cut to one short line; the detail page has all of it."""
        if not obj.error:
            return "—"
        return format_html(
            '<span class="job-last-error" title="{}">{}</span>',
            obj.error[:LAST_ERROR_TITLE_CHARS],
            truncate(obj.error, LAST_ERROR_CHARS),
        )

    @admin.display(description="progress")
    def progress_bar(self, obj: Job) -> str:
        """A bar for processing jobs that reported a total; the count alone otherwise."""
        if obj.status != Status.PROCESSING:
            return ""
        report = progress_of(obj)
        if report is None:
            return "—"
        if report["fraction"] is None:
            return f"{report['done']:g}"
        return format_html(
            '<progress class="job-progress" value="{}" max="1" title="{}"></progress> {}%',
            report["fraction"],
            report["message"],
            round(report["fraction"] * 100),
        )

    @admin.display(description="progress")
    def progress_detail(self, obj: Job) -> str:
        report = progress_of(obj)
        if report is None:
            return "—"
        total = "?" if report["total"] is None else f"{report['total']:g}"
        share = "" if report["fraction"] is None else f" ({report['fraction']:.0%})"
        return format_html(
            '<div class="job-progress-count">{} of {}{}</div>'
            '<div class="job-progress-message">{}</div>'
            '<div class="job-progress-at">reported at {}</div>',
            f"{report['done']:g}",
            total,
            share,
            report["message"] or "—",
            report["updated_at"] or "—",
        )

    @admin.display(description="cancel requested at")
    def cancel_requested(self, obj: Job) -> str:
        if obj.cancel_requested_at is None:
            return "—"
        late = " — the handler finished anyway (too late)" if obj.status == Status.DONE else ""
        return iso_time(obj.cancel_requested_at) + late

    @admin.display(description="age", ordering="id")  # submission order, on the pk index
    def age(self, obj: Job) -> str:
        return short_duration(getattr(obj, "_age", None))

    @admin.display(description="in state for", ordering="updated_at")
    def in_state(self, obj: Job) -> str:
        return short_duration(getattr(obj, "_in_state", None))

    @admin.display(description="created at")
    def created(self, obj: Job) -> str:
        return iso_time(obj.created_at)

    @admin.display(description="updated at")
    def updated(self, obj: Job) -> str:
        return iso_time(obj.updated_at)

    @admin.display(description="finished at")
    def finished(self, obj: Job) -> str:
        return iso_time(obj.finished_at)

    @admin.display(description="claimed at")
    def claimed(self, obj: Job) -> str:
        return iso_time(obj.claimed_at)

    @admin.display(description="heartbeat at")
    def heartbeat(self, obj: Job) -> str:
        return iso_time(obj.heartbeat_at)

    @admin.display(description="run at")
    def run(self, obj: Job) -> str:
        return iso_time(obj.run_at)

    @admin.display(description="since heartbeat")
    def heartbeat_age(self, obj: Job) -> str:
        age = getattr(obj, "_heartbeat_age", None)
        if age is None:
            return "—"
        lease = timedelta(seconds=settings.JOBS_LEASE_SECONDS)
        note = " — past the lease: the reaper will requeue it" if age > lease else ""
        return f"{short_duration(age)} (lease {settings.JOBS_LEASE_SECONDS:g} s){note}"

    @admin.display(description="error")
    def error_text(self, obj: Job) -> str:
        return error_detail_html(obj.error, obj.error_class, obj.error_traceback)

    @admin.display(description="payload")
    def payload_pretty(self, obj: Job) -> str:
        return pretty_json(obj.payload)

    @admin.display(description="result")
    def result_pretty(self, obj: Job) -> str:
        return pretty_json(obj.result)

    # --- actions

    def _eligible_id_chunks(self, queryset: QuerySet, spec: StaffAction) -> Iterator[list[int]]:
        """Ids of the selected jobs in an eligible state, in pk order, a chunk at a time.

        Keyset pagination keeps each read small and lets select-across act on a
        filtered set of any size without holding its ids in memory at once.
        """
        eligible = queryset.eligible_for(spec.move).order_by("pk")
        last = 0
        while True:
            chunk = list(
                eligible.filter(pk__gt=last).values_list("pk", flat=True)[
                    : self.action_chunk_size
                ]
            )
            if not chunk:
                return
            yield chunk
            last = chunk[-1]

    def run_staff_action(
        self, request: HttpRequest, queryset: QuerySet, spec: StaffAction
    ) -> HttpResponse | None:
        """Confirm first; on confirmation run the service chunk by chunk and report."""
        if request.POST.get("post") != "yes":
            return self._confirmation(request, queryset, spec)
        actor = staff_actor(request)
        selected, exact = selectors.capped_count(queryset, self.action_count_cap)
        applied = 0
        message = f"{spec.label}: {spec.verb} by {actor}"
        for chunk in self._eligible_id_chunks(queryset, spec):
            with transaction.atomic():
                done = spec.service(chunk, actor)
                if done:
                    LogEntry.objects.log_actions(
                        request.user.pk,
                        Job.objects.filter(pk__in=done).only("id", "task", "status"),
                        CHANGE,
                        change_message=message,
                    )
            applied += len(done)
        skipped = selected - applied if exact else 0
        text = f"{applied} {spec.verb}"
        if skipped:
            text += f", {skipped} skipped: {spec.skip_reason}"
        elif not exact:
            text += f" (over {self.action_count_cap:,} selected: the skipped are not counted)"
        self.message_user(request, text, messages.WARNING if skipped else messages.SUCCESS)
        return None

    def _confirmation(
        self, request: HttpRequest, queryset: QuerySet, spec: StaffAction
    ) -> TemplateResponse:
        cap = self.action_count_cap
        selected, selected_exact = selectors.capped_count(queryset, cap)
        eligible_qs = queryset.eligible_for(spec.move)
        eligible, eligible_exact = selectors.capped_count(eligible_qs, cap)
        # What staff need to decide: the budget spent and the last error with its
        # traceback (a "card declined" should not be retried blindly).
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
            **self.admin_site.each_context(request),
            "title": spec.label,
            "opts": self.opts,
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

    def change_view(self, request, object_id, form_url="", extra_context=None):
        """The read-only detail, with buttons for the actions this job and user allow."""
        extra_context = dict(extra_context or {})
        job = self.get_object(request, object_id)
        if job is not None:
            extra_context["job_actions"] = [
                spec
                for spec in STAFF_ACTIONS
                if job.status in spec.eligible
                and getattr(self, f"has_{spec.permission}_permission")(request)
            ]
            extra_context["action_checkbox_name"] = helpers.ACTION_CHECKBOX_NAME
            if job.status == Status.QUEUED and not selectors.queue_consumers()(job.queue):
                self.message_user(
                    request,
                    f"No worker serves the queue “{job.queue}”: this job waits until a "
                    f"worker runs with --queues naming it (or --queues '*').",
                    messages.WARNING,
                )
        return super().change_view(request, object_id, form_url, extra_context)

    # --- dashboard

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        return [
            path(
                "dashboard/",
                self.admin_site.admin_view(self.dashboard_view),
                name="{}_{}_dashboard".format(*info),
            ),
            *super().get_urls(),
        ]

    def dashboard_view(self, request: HttpRequest) -> TemplateResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        board = selectors.cached_dashboard()
        context = {
            **self.admin_site.each_context(request),
            "title": "Job dashboard",
            "opts": self.opts,
            "board": board,
            "chart": throughput_chart(board),
            "state_bars": state_bars(board),
            "slo_target": 0.95,
            "window_minutes": board.window_seconds // 60,
            "slo_percent": percent(board.slo_attainment),
            "success_percent": percent(board.success_rate),
            "changelist_url": reverse("admin:jobs_job_changelist"),
        }
        return TemplateResponse(request, "admin/jobs/job/dashboard.html", context)


def percent(share: float | None) -> str:
    """0.6667 → '66.7%' (one decimal, so 94.96% never reads as the 95% target)."""
    if share is None:
        return "—"
    return f"{math.floor(share * 1000 + 1e-9) / 10:.1f}%"  # truncated, never rounded up


def state_bars(board: selectors.Dashboard) -> list[dict[str, Any]]:
    """Horizontal CSS bars for the state counts, scaled to the largest."""
    counts = board.state_counts
    top = max(counts.values(), default=0) or 1
    bars = []
    for label, count in counts.items():
        state = label.split(" ")[0]  # "done (window)" → "done"
        bars.append(
            {
                "label": label,
                "count": count,
                "percent": round(100 * count / top, 1),
                "colour": BADGE_COLOURS.get(state, "#57606a"),
                "status": state,
            }
        )
    return bars


def throughput_chart(
    board: selectors.Dashboard, width: int = 720, height: int = 140
) -> dict[str, Any]:
    """Stacked per-minute bars (done below, failed on top) as SVG rectangles."""
    minutes = board.minutes
    n = max(len(minutes), 1)
    top = max((m.total for m in minutes), default=0) or 1
    slot = width / n
    bars = []
    for i, m in enumerate(minutes):
        h_done = height * m.done / top
        h_failed = height * m.failed / top
        bars.append(
            {
                "x": round(i * slot + 1, 2),
                "w": round(max(slot - 2, 1), 2),
                "done_y": round(height - h_done, 2),
                "done_h": round(h_done, 2),
                "failed_y": round(height - h_done - h_failed, 2),
                "failed_h": round(h_failed, 2),
                "label": f"{m.minute:%H:%M} UTC: {m.done} done, {m.failed} failed",
            }
        )
    return {"width": width, "height": height, "bars": bars, "max": top}


# --- API clients -----------------------------------------------------------------------


@admin.register(Client)
class ClientAdmin(admin.ModelAdmin):
    """API clients: create (token shown once), deactivate. Never deleted: jobs refer to them."""

    list_display = ("name", "is_active", "created_at")
    list_filter = ("is_active",)
    search_fields = ("name",)
    readonly_fields = ("created_at",)
    actions = ["deactivate_clients"]

    def get_fields(self, request, obj=None):
        return ("name",) if obj is None else ("name", "is_active", "created_at")

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def save_model(self, request, obj, form, change):
        if change:
            return super().save_model(request, obj, form, change)
        created, token = Client.create_with_token(obj.name)
        obj.pk = created.pk
        obj.token_hash = created.token_hash
        obj.created_at = created.created_at
        obj._state.adding = False
        obj._state.db = created._state.db
        obj._new_token = token

    def response_add(self, request, obj, post_url_continue=None):
        """Show the token on this one page; it is not stored and cannot be shown again."""
        context = {
            **self.admin_site.each_context(request),
            "title": f"API client {obj.name} created",
            "opts": self.opts,
            "client": obj,
            "token": obj._new_token,
        }
        response = TemplateResponse(request, "admin/jobs/client/token_created.html", context)
        add_never_cache_headers(response)
        return response

    @admin.action(permissions=["change"], description="Deactivate selected clients")
    def deactivate_clients(self, request, queryset):
        targets = list(queryset.filter(is_active=True).values_list("pk", flat=True))
        with transaction.atomic():
            Client.objects.filter(pk__in=targets).update(is_active=False)
            if targets:
                LogEntry.objects.log_actions(
                    request.user.pk,
                    Client.objects.filter(pk__in=targets),
                    CHANGE,
                    change_message=f"Deactivated by staff:{request.user.get_username()}",
                )
        skipped = queryset.count() - len(targets)
        text = f"{len(targets)} deactivated"
        if skipped:
            text += f", {skipped} skipped: already inactive"
        self.message_user(request, text, messages.SUCCESS)
