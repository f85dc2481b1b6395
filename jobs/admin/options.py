"""The staff console's ModelAdmins: inspect jobs, repair them only through the services.

Jobs are never edited, added or deleted here: every field is read-only and
every change goes through a lifecycle service (`jobs.services`) as a
compare-and-set, with the staff user as the actor, so the database trigger
writes the history row and the guard refuses anything illegal. Lists stay
cheap on a million rows: no full count, indexed filters, exact-id search.
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ChangeList
from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.cache import add_never_cache_headers
from django.utils.html import format_html
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext_lazy

from jobs import selectors, services
from jobs.admin import dashboard
from jobs.admin.actions import log_changed, make_action
from jobs.admin.archive import archived_message
from jobs.admin.display import (
    budget_text,
    duration_column,
    error_detail_html,
    iso_time,
    last_error_html,
    pretty_json,
    progress_bar_html,
    progress_detail_html,
    short_duration,
    status_badge_html,
    time_column,
)
from jobs.admin.filters import InternalFilter, QueueFilter, StuckFilter, TaskFilter
from jobs.admin.paginator import CappedCountPaginator
from jobs.admin.readonly import ListsFromReplica, SeenWithJobs, WrittenByServices
from jobs.admin.workflows import DurableFields, JobSignalInline, JobStepInline, send_signal_view
from jobs.archive.restore import archived_period_of
from jobs.conf import settings
from jobs.lifecycle import TERMINAL, Status
from jobs.models import Client, Job, JobEvent
from jobs.selectors import progress_of
from jobs.staff import STAFF_ACTIONS, tally

# States that hold few rows: a list narrowed to one of them may sort by any column.
NARROW_STATES = frozenset(Status) - {Status.DONE}

# The look of every job page (badges, errors, the 1,400 px list, the detail's buttons).
JOBS_CSS = "jobs/admin/jobs.css"


# --- inlines -------------------------------------------------------------------------


class JobEventInline(WrittenByServices, SeenWithJobs, admin.TabularInline):
    """The job's full history, oldest first, read-only."""

    model = JobEvent
    fk_name = "job"
    verbose_name = gettext_lazy("history event")
    verbose_name_plural = gettext_lazy("History")
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

    @admin.display(description=gettext_lazy("at"))
    def at_utc(self, obj: JobEvent) -> str:
        return iso_time(obj.at)

    @admin.display(description=gettext_lazy("from → to"))
    def transition(self, obj: JobEvent) -> str:
        text = f"{obj.from_status or '(new)'} → {obj.to_status}"
        # Every other way back to queued (retry, release, reaper) records its reason.
        if (obj.from_status, obj.to_status) == (Status.PROCESSING, Status.QUEUED) and (
            not obj.error and obj.kind == JobEvent.TRANSITION
        ):
            text += " " + _("(parked by its handler: a durable sleep or wait)")
        return text

    @admin.display(description=gettext_lazy("error"))
    def error_with_traceback(self, obj: JobEvent) -> str:
        """The attempt's error; for a failed attempt, its class and full traceback."""
        return error_detail_html(obj.error, obj.error_class, obj.error_traceback)


# --- jobs ----------------------------------------------------------------------------


class JobChangeList(ChangeList):
    def get_queryset(self, request, exclude_parameters=None):
        # A page of 100 rows has no use for up to 8 KiB of traceback each.
        return super().get_queryset(request, exclude_parameters).defer("error_traceback")


class JobAdmin(ListsFromReplica, WrittenByServices, DurableFields, admin.ModelAdmin):
    """Jobs, read-only, with the staff actions of `jobs.admin.actions` and a dashboard."""

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
    list_filter = ("status", StuckFilter, TaskFilter, QueueFilter, InternalFilter, "client")
    list_select_related = ("client",)
    list_per_page = 100
    list_max_show_all = 500
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facet counts would GROUP BY the whole table
    paginator = CappedCountPaginator
    ordering = ("-id",)
    sortable_by = ("id", "age", "priority", "retries", "lease_version", "in_state")
    search_fields = ("=id", "=idempotency_key")
    search_help_text = gettext_lazy("Exact job id or idempotency key.")
    actions = [make_action(spec) for spec in STAFF_ACTIONS]
    # Durable jobs (jobs.admin.workflows): committed steps and delivered signals.
    inlines = [JobEventInline, JobStepInline, JobSignalInline]
    action_chunk_size = 1000
    # Confirmation and action count the selection up to this many (D15), then estimate.
    action_count_cap = 10_000
    fieldsets = (
        (None, {"fields": ("id", "status_badge", "task", "queue", "priority", "client")}),
        (
            gettext_lazy("Lease"),
            {"fields": ("lease_version", "owned_by", "claimed", "heartbeat", "heartbeat_age")},
        ),
        (gettext_lazy("Progress"), {"fields": ("progress_detail", "cancel_requested")}),
        (gettext_lazy("Waiting for"), {"fields": ("waiting_for", "wait_key", "open_wait")}),
        (gettext_lazy("Durable history"), {"fields": ("history_size", "chain_runs")}),
        (gettext_lazy("Retries"), {"fields": ("retries", "max_retries", "run", "error_text")}),
        (
            gettext_lazy("Times"),
            {"fields": ("created", "updated", "finished", "in_state", "updated_by")},
        ),
        (gettext_lazy("Payload"), {"fields": ("payload_pretty",)}),
        (gettext_lazy("Result"), {"fields": ("result_pretty",)}),
        (
            gettext_lazy("Idempotency"),
            {"fields": ("idempotency_key", "request_hash", "unique_key")},
        ),
        (gettext_lazy("Schedule"), {"fields": ("made_by_schedule", "fire_time")}),
    )
    readonly_fields = tuple(f for _, opts in fieldsets for f in opts["fields"])

    class Media:
        css = {"all": (JOBS_CSS,)}

    def get_inline_instances(self, request, obj=None):
        """Steps and signals only on the jobs that have some (durable jobs)."""
        inlines = super().get_inline_instances(request, obj)
        durable = (JobStepInline, JobSignalInline)
        return [
            i
            for i in inlines
            if not isinstance(i, durable)
            or (obj is not None and i.model.objects.filter(job_id=obj.pk).exists())
        ]

    def get_changelist(self, request, **kwargs):
        return JobChangeList

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
            found = queryset.filter(query)
            if not found.exists():
                self._say_if_archived(request, int(term))
            return found, False
        return queryset.filter(query), False

    def _say_if_archived(self, request, job_id: int) -> bool:
        """Tell staff where a job that is not here went, if an archived period held it."""
        period = archived_period_of(job_id)
        if period is None:
            return False
        self.message_user(request, archived_message(job_id, period), messages.WARNING)
        return True

    def _get_obj_does_not_exist_redirect(self, request, opts, object_id):
        if not (object_id.isascii() and object_id.isdigit() and int(object_id) < 2**63):
            return super()._get_obj_does_not_exist_redirect(request, opts, object_id)
        if not self._say_if_archived(request, int(object_id)):
            return super()._get_obj_does_not_exist_redirect(request, opts, object_id)
        return HttpResponseRedirect(reverse("admin:jobs_job_changelist"))

    # --- columns

    def lookup_allowed(self, lookup, value, request=None) -> bool:
        # The schedule admin links to a schedule's jobs (indexed: job_schedule_created_idx).
        return lookup == "schedule__id__exact" or super().lookup_allowed(lookup, value, request)

    @admin.display(description=gettext_lazy("schedule"))
    def made_by_schedule(self, obj: Job) -> str:
        if obj.schedule_id is None:
            return "-"
        url = reverse("admin:jobs_schedule_change", args=[obj.schedule_id])
        return format_html('<a href="{}">{}</a>', url, obj.schedule_id)

    @admin.display(description=gettext_lazy("status"), ordering="status")
    def status_badge(self, obj: Job) -> str:
        return status_badge_html(obj.status)

    @admin.display(description=gettext_lazy("retries"), ordering="retry_count")
    @admin.display(description=gettext_lazy("wait reason"))
    def waiting_for(self, obj: Job) -> str:
        """Parked, blocked on parents, or held by its paused queue; "-" when not waiting."""
        return selectors.wait_reason(obj) or "-"

    def retries(self, obj: Job) -> str:
        return budget_text(obj.retry_count, obj.max_retries)

    @admin.display(description=gettext_lazy("last error"))
    def last_error(self, obj: Job) -> str:
        """The latest error, cut to one short line; the detail page has all of it."""
        return last_error_html(obj.error)

    @admin.display(description=gettext_lazy("progress"))
    def progress_bar(self, obj: Job) -> str:
        """A bar for processing jobs that reported a total; the count alone otherwise."""
        if obj.status != Status.PROCESSING:
            return ""
        return progress_bar_html(progress_of(obj))

    @admin.display(description=gettext_lazy("progress"))
    def progress_detail(self, obj: Job) -> str:
        return progress_detail_html(progress_of(obj))

    @admin.display(description=gettext_lazy("cancel requested at"))
    def cancel_requested(self, obj: Job) -> str:
        if obj.cancel_requested_at is None:
            return "—"
        if obj.status == Status.DONE:
            return _("%(at)s — the handler finished anyway (too late)") % {
                "at": iso_time(obj.cancel_requested_at)
            }
        return iso_time(obj.cancel_requested_at)

    # Age in submission order, on the pk index.
    age = duration_column("_age", gettext_lazy("age"), ordering="id")
    in_state = duration_column("_in_state", gettext_lazy("in state for"), ordering="updated_at")
    created = time_column("created_at", gettext_lazy("created at"))
    updated = time_column("updated_at", gettext_lazy("updated at"))
    finished = time_column("finished_at", gettext_lazy("finished at"))
    claimed = time_column("claimed_at", gettext_lazy("claimed at"))
    heartbeat = time_column("heartbeat_at", gettext_lazy("heartbeat at"))
    run = time_column("run_at", gettext_lazy("run at"))

    @admin.display(description=gettext_lazy("since heartbeat"))
    def heartbeat_age(self, obj: Job) -> str:
        age = getattr(obj, "_heartbeat_age", None)
        if age is None:
            return "—"
        lease = timedelta(seconds=settings.JOBS_LEASE_SECONDS)
        text = _("%(age)s (lease %(lease)s s)") % {
            "age": short_duration(age),
            "lease": f"{settings.JOBS_LEASE_SECONDS:g}",
        }
        if age > lease:
            text += _(" — past the lease: the reaper will requeue it")
        return text

    @admin.display(description=gettext_lazy("error"))
    def error_text(self, obj: Job) -> str:
        return error_detail_html(obj.error, obj.error_class, obj.error_traceback)

    @admin.display(description=gettext_lazy("payload"))
    def payload_pretty(self, obj: Job) -> str:
        return pretty_json(obj.payload)

    @admin.display(description=gettext_lazy("result"))
    def result_pretty(self, obj: Job) -> str:
        return pretty_json(obj.result)

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
            extra_context["can_signal"] = job.status not in TERMINAL and request.user.has_perm(
                "jobs.signal_job"
            )
            if job.status == Status.QUEUED and not selectors.queue_consumers()(job.queue):
                self.message_user(
                    request,
                    _(
                        "No worker serves the queue “%(queue)s”: this job waits until a "
                        "worker runs with --queues naming it (or --queues '*')."
                    )
                    % {"queue": job.queue},
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
            path(
                "<path:object_id>/signal/",
                self.admin_site.admin_view(partial(send_signal_view, self)),
                name="{}_{}_signal".format(*info),
            ),
            *super().get_urls(),
        ]

    def dashboard_view(self, request: HttpRequest) -> TemplateResponse:
        return dashboard.dashboard_view(self, request)


# --- API clients -----------------------------------------------------------------------


class ClientAdmin(admin.ModelAdmin):
    """API clients: create (token shown once), deactivate. Never deleted: jobs refer to them."""

    list_display = ("name", "is_active", "created_at")
    list_filter = ("is_active",)
    search_fields = ("name",)
    readonly_fields = ("created_at",)
    actions = ["deactivate_clients"]

    def get_fields(self, request, obj=None):
        quotas = ("max_schedules", "max_webhooks", "max_signals_per_job", "max_queue_depth")
        return ("name",) if obj is None else ("name", "is_active", *quotas, "created_at")

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def save_model(self, request, obj, form, change):
        """A new client gets its token here; `response_add` shows it this once."""
        if not change:
            obj._new_token = obj.issue_token()
        super().save_model(request, obj, form, change)

    def response_add(self, request, obj, post_url_continue=None):
        """Show the token on this one page; it is not stored and cannot be shown again."""
        context = {
            **self.admin_site.each_context(request),
            "title": _("API client %(name)s created") % {"name": obj.name},
            "opts": self.opts,
            "client": obj,
            "token": obj._new_token,
        }
        response = TemplateResponse(request, "admin/jobs/client/token_created.html", context)
        add_never_cache_headers(response)
        return response

    @admin.action(permissions=["change"], description=gettext_lazy("Deactivate selected clients"))
    def deactivate_clients(self, request, queryset):
        with transaction.atomic():
            # Through the service: it also revokes the clients' cached tokens at once.
            targets = services.deactivate_clients(list(queryset.values_list("pk", flat=True)))
            actor = f"staff:{request.user.get_username()}"
            log_changed(request, Client.objects, targets, f"Deactivated by {actor}")
        skipped = queryset.count() - len(targets)
        text = tally(
            ngettext_lazy("%(count)d deactivated", "%(count)d deactivated", "count"),
            ngettext_lazy(", %(count)d skipped: already inactive",
                          ", %(count)d skipped: already inactive", "count"),
            len(targets), skipped,
        )  # fmt: skip
        self.message_user(request, text, messages.SUCCESS)
