"""The Queue controls in the staff console: edit limits, pause and resume (audited).

Rows come from JOBS_QUEUES (`jobs.queuecontrol.sync`): none is added or deleted
here. A staff edit stays across restarts unless the deployment changes the same
setting in JOBS_QUEUES (docs/queue-controls.md).
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.db import transaction
from django.http import HttpRequest
from django.utils.translation import gettext_lazy, ngettext_lazy

from jobs import queuecontrol, queues
from jobs.admin.actions import log_changed, staff_actor
from jobs.models import Queue
from jobs.staff import tally


class QueueAdmin(admin.ModelAdmin):
    list_display = ["name", "state", "concurrency", "rate", "weight", "fair", "key_concurrency",
                    "key_rate", "updated_at"]  # fmt: skip
    list_filter = ["paused"]
    fields = ["name", "paused", "concurrency", "rate_limit", "rate_period", "weight", "fair",
              "key_concurrency", "key_rate_limit", "key_rate_period", "declared",
              "updated_at"]  # fmt: skip
    readonly_fields = ["name", "paused", "declared", "updated_at"]
    actions = ["pause_queues", "resume_queues"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def has_pause_permission(self, request) -> bool:
        return request.user.has_perm("jobs.pause_queue")

    @admin.display(description=gettext_lazy("state"), ordering="paused")
    def state(self, obj: Queue) -> str:
        return gettext_lazy("paused") if obj.paused else gettext_lazy("active")

    @admin.display(description=gettext_lazy("rate"))
    def rate(self, obj: Queue) -> str:
        return queues.format_rate(obj.rate_limit, obj.rate_period) or "-"

    @admin.display(description=gettext_lazy("throttle per key"))
    def key_rate(self, obj: Queue) -> str:
        return queues.format_key_rate(obj.key_rate_limit, obj.key_rate_period) or "-"

    def _set_paused(self, request: HttpRequest, queryset, paused: bool) -> None:
        verb = "paused" if paused else "resumed"
        changed = []
        with transaction.atomic(durable=True):
            for name in queryset.values_list("name", flat=True):
                try:
                    if queuecontrol.set_paused(name, paused, durable=False):
                        changed.append(name)
                except queuecontrol.UnknownQueue:  # a row left from an older JOBS_QUEUES
                    continue
            log_changed(request, Queue.objects, changed, f"Queue {verb} by {staff_actor(request)}")
        skipped = queryset.count() - len(changed)
        text = tally(
            ngettext_lazy("%(count)d queue %(verb)s", "%(count)d queues %(verb)s", "count"),
            ngettext_lazy(", %(count)d skipped: already %(verb)s or not declared",
                          ", %(count)d skipped: already %(verb)s or not declared", "count"),
            len(changed), skipped, verb=verb,
        )  # fmt: skip
        self.message_user(request, text, messages.SUCCESS)

    @admin.action(permissions=["pause"], description=gettext_lazy("Pause selected queues"))
    def pause_queues(self, request: HttpRequest, queryset) -> None:
        self._set_paused(request, queryset, True)

    @admin.action(permissions=["pause"], description=gettext_lazy("Resume selected queues"))
    def resume_queues(self, request: HttpRequest, queryset) -> None:
        self._set_paused(request, queryset, False)
