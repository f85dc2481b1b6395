"""Webhooks and their deliveries in the staff console (issue 16).

A delivery's status is its delivery job's (done = delivered, failed = a dead letter).
Redeliver puts dead letters back to queued with a fresh budget through the same
service as the job's Retry (`services.staff_retry`), audited with a LogEntry each.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.translation import gettext, gettext_lazy, ngettext_lazy

from jobs import services
from jobs.admin.actions import log_changed, staff_actor
from jobs.admin.readonly import ListsFromReplica, WrittenByServices
from jobs.events import circuit, signing
from jobs.lifecycle import Status
from jobs.models import CircuitState, Webhook, WebhookDelivery
from jobs.staff import tally

DELIVERY_STATUS = {Status.DONE: "delivered", Status.FAILED: "failed (dead letter)"}


class WebhookAdmin(admin.ModelAdmin):
    list_display = ("id", "client", "url", "events", "enabled", "disabled_reason",
                    "circuit_status", "created_at")  # fmt: skip
    list_filter = ("enabled", "circuit_state", "client")
    search_fields = ("=id", "url")
    # The URL is checked (SSRF) where the client registers it; staff may pause or filter.
    # The breaker is the deliveries' to write (jobs.events.circuit).
    readonly_fields = ("client", "url", "secret_salt", "disabled_reason", "circuit_status",
                       "circuit_state", "circuit_failures", "circuit_open_until", "created_at",
                       "updated_at", "after_event_id")  # fmt: skip
    ordering = ("id",)

    @admin.display(description=gettext_lazy("circuit"), ordering="circuit_state")
    def circuit_status(self, obj: Webhook) -> str:
        shown = circuit.describe(obj)
        if shown["state"] == CircuitState.CLOSED:
            return gettext("closed")
        if shown["state"] == CircuitState.OPEN:
            return gettext("open until %(until)s after %(n)d failures") % {
                "until": date_format(timezone.localtime(shown["open_until"]), "DATETIME_FORMAT"),
                "n": shown["failures"]}  # fmt: skip
        return gettext("half open (probing) after %(n)d failures") % {"n": shown["failures"]}

    def has_add_permission(self, request, obj=None) -> bool:
        return False  # the client registers its endpoints (the secret is shown there once)


class DeliveryStatusFilter(admin.SimpleListFilter):
    title = gettext_lazy("status")
    parameter_name = "status"

    def lookups(self, request, model_admin):
        dead = Status.FAILED.value  # a dead letter is a failed delivery job
        return [("pending", "pending"), ("delivered", "delivered"), (dead, dead)]

    def queryset(self, request, queryset):
        value = self.value()
        if value == "delivered":
            return queryset.filter(job__status=Status.DONE)
        if value == Status.FAILED:
            return queryset.filter(job__status=Status.FAILED)
        if value == "pending":
            return queryset.exclude(job__status__in=[Status.DONE, Status.FAILED])
        return queryset


@admin.action(permissions=["redeliver"], description=gettext_lazy("Redeliver dead letters"))
def redeliver(modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet) -> None:
    """failed → queued with a fresh budget, same message id; others are skipped."""
    selected = list(queryset.values_list("pk", "job_id"))
    job_ids = [job_id for _, job_id in selected if job_id is not None]
    actor = staff_actor(request)
    with transaction.atomic():
        retried = set(services.staff_retry(job_ids, actor))
        done = [pk for pk, job_id in selected if job_id in retried]
        log_changed(request, WebhookDelivery.objects, done, f"redelivered by {actor}")
    skipped = len(selected) - len(done)
    text = tally(
        ngettext_lazy("%(count)d redelivered", "%(count)d redelivered", "count"),
        ngettext_lazy(", %(count)d skipped: not a dead letter",
                      ", %(count)d skipped: not a dead letter", "count"),
        len(done), skipped,
    )  # fmt: skip
    modeladmin.message_user(request, text, messages.WARNING if skipped else messages.SUCCESS)


class WebhookDeliveryAdmin(ListsFromReplica, WrittenByServices, admin.ModelAdmin):
    list_display = ("id", "webhook", "type", "source_job_id", "seq", "delivery_status",
                    "attempts", "last_status_code", "last_error", "last_attempt_at",
                    "job")  # fmt: skip
    list_filter = (DeliveryStatusFilter, "webhook")
    list_select_related = ("job", "webhook")
    search_fields = ("=source_job_id", "=id")
    ordering = ("-id",)
    actions = [redeliver]
    readonly_fields = ("webhook", "event_id", "message_id", "source_job_id", "seq", "type",
                       "body", "job", "attempts", "last_status_code", "last_error",
                       "last_attempt_at", "created_at")  # fmt: skip
    exclude = ()

    @admin.display(description=gettext_lazy("status"))
    def delivery_status(self, obj: WebhookDelivery) -> str:
        return DELIVERY_STATUS.get(obj.job.status, "pending") if obj.job else "pending"

    @admin.display(description=gettext_lazy("message id"))
    def message_id(self, obj: WebhookDelivery) -> str:
        return signing.message_id(obj.event_id)

    def has_redeliver_permission(self, request) -> bool:
        return request.user.has_perm("jobs.redeliver_webhookdelivery")
