"""Sequences and batches in the staff console (issue 46): a key's page shows whose turn
it is, the failed job that halted it and what waits, with resume and skip as audited
actions (the same service as the API and `manage.py sequence`); a batch's page its
progress and the callback jobs it made."""

from __future__ import annotations

from django.contrib import admin, messages
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy

from jobs.admin.actions import log_change, staff_actor
from jobs.admin.display import iso_time
from jobs.admin.readonly import ListsFromReplica, SeenWithJobs, WrittenByServices
from jobs.flow import sequences
from jobs.models import Batch, Sequence


def _job_link(job_id: int | None) -> str:
    if job_id is None:
        return "—"
    return format_html('<a href="{}">{}</a>', reverse("admin:jobs_job_change", args=[job_id]),
                       job_id)  # fmt: skip


class _ReadOnly(ListsFromReplica, WrittenByServices, SeenWithJobs, admin.ModelAdmin):
    list_per_page = 100
    show_full_result_count = False


class SequenceAdmin(_ReadOnly):
    list_display = ("key", "owner", "state", "active", "halted", "halted_when", "updated")
    list_filter = (("halted_job_id", admin.EmptyFieldListFilter),)
    search_fields = ("=key",)
    ordering = ("owner", "key")
    actions = ("resume_sequences", "skip_failed_jobs")
    fields = ("key", "owner", "state", "active", "halted", "halted_when", "waiting_jobs")
    readonly_fields = fields

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.retry_job")

    @admin.display(description=gettext_lazy("state"))
    def state(self, obj: Sequence) -> str:
        if obj.halted_job_id is not None:
            return "halted"
        return "running" if obj.active_job_id is not None else "idle"

    @admin.display(description=gettext_lazy("turn of job"))
    def active(self, obj: Sequence) -> str:
        return _job_link(obj.active_job_id)

    @admin.display(description=gettext_lazy("halted by job"))
    def halted(self, obj: Sequence) -> str:
        return _job_link(obj.halted_job_id)

    @admin.display(description=gettext_lazy("halted at"))
    def halted_when(self, obj: Sequence) -> str:
        return iso_time(obj.halted_at) if obj.halted_at else "—"

    @admin.display(description=gettext_lazy("updated"))
    def updated(self, obj: Sequence) -> str:
        return iso_time(obj.updated_at)

    @admin.display(description=gettext_lazy("waiting, in order"))
    def waiting_jobs(self, obj: Sequence) -> str:
        found = sequences.detail(None, obj.key, owner=obj.owner)
        if found is None or not found.next_jobs:
            return "—"
        more = found.waiting - len(found.next_jobs)
        return format_html(
            "{}{}",
            format_html_join(", ", "{}", ((_job_link(j.pk),) for j in found.next_jobs)),
            f" … and {more} more" if more > 0 else "",
        )

    def _act(self, request: HttpRequest, queryset, action: str, verb: str) -> None:
        done = []
        for row in queryset:
            client_id = row.owner or None
            try:
                getattr(sequences, action)(client_id, row.key, staff_actor(request))
            except sequences.SequenceRefused as refused:
                self.message_user(request, str(refused), messages.WARNING)
                continue
            done.append(row)
        if done:
            log_change(request, done, f"{verb} (sequence halted)")
            self.message_user(request, f"{len(done)} sequence(s) {verb}.", messages.SUCCESS)

    @admin.action(description=gettext_lazy("Resume: run the failed job again, then the rest"),
                  permissions=["retry"])  # fmt: skip
    def resume_sequences(self, request: HttpRequest, queryset) -> None:
        self._act(request, queryset, "resume", "resumed")

    @admin.action(description=gettext_lazy("Skip the failed job: the next one runs"),
                  permissions=["retry"])  # fmt: skip
    def skip_failed_jobs(self, request: HttpRequest, queryset) -> None:
        self._act(request, queryset, "skip", "skipped")


class BatchAdmin(_ReadOnly):
    list_display = ("id", "name", "client", "total", "pending", "succeeded", "failures",
                    "progress", "created", "finished")  # fmt: skip
    search_fields = ("=id", "name")
    ordering = ("-id",)
    fields = ("name", "client", "total", "pending", "succeeded", "failures", "progress",
              "callback_kinds", "callback_jobs", "created", "finished")  # fmt: skip
    readonly_fields = fields

    @admin.display(description=gettext_lazy("failed jobs"))
    def failures(self, obj: Batch) -> int:
        return obj.failed

    @admin.display(description=gettext_lazy("progress"))
    def progress(self, obj: Batch) -> str:
        ended = obj.succeeded + obj.failed
        return f"{ended}/{obj.total} ({100 * ended / obj.total:.0f} %)" if obj.total else "—"

    @admin.display(description=gettext_lazy("callbacks"))
    def callback_kinds(self, obj: Batch) -> str:
        return ", ".join(f"{k}: {v['task']}" for k, v in obj.callbacks.items()) or "—"

    @admin.display(description=gettext_lazy("callback jobs"))
    def callback_jobs(self, obj: Batch) -> str:
        if not obj.callback_job_ids:
            return "—"
        return format_html_join(", ", "{}", ((_job_link(i),) for i in obj.callback_job_ids))

    @admin.display(description=gettext_lazy("created"))
    def created(self, obj: Batch) -> str:
        return iso_time(obj.created_at)

    @admin.display(description=gettext_lazy("finished"))
    def finished(self, obj: Batch) -> str:
        return iso_time(obj.finished_at) if obj.finished_at else "—"
