"""The archive of expired periods, read-only: what prunejobs archived, where, and how a
period comes back (`manage.py archive restore`)."""

from __future__ import annotations

from django.contrib import admin
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from jobs.admin.display import iso_time
from jobs.admin.readonly import SeenWithJobs, WrittenByServices
from jobs.models import ArchivedPeriod


def archived_message(job_id: int, period: ArchivedPeriod) -> str:
    return _(
        "job %(id)s was archived at %(at)s in period %(period)s; restore with "
        "`manage.py archive restore %(period)s`"
    ) % {"id": job_id, "at": iso_time(period.archived_at), "period": f"{period.period:%Y-%m-%d}"}


class ArchivedPeriodAdmin(SeenWithJobs, WrittenByServices, admin.ModelAdmin):
    list_display = (
        "period",
        "jobs",
        "events",
        "job_ids",
        "megabytes",
        "archived",
        "restored",
        "location",
    )
    ordering = ("-period",)
    readonly_fields = [f.name for f in ArchivedPeriod._meta.fields] + ["restore_with"]

    @admin.display(description=gettext_lazy("job ids"))
    def job_ids(self, obj: ArchivedPeriod) -> str:
        return f"{obj.min_job_id}–{obj.max_job_id}" if obj.min_job_id is not None else "—"

    @admin.display(description=gettext_lazy("MB"))
    def megabytes(self, obj: ArchivedPeriod) -> str:
        return f"{obj.bytes / 1e6:.1f}"

    @admin.display(description=gettext_lazy("archived at"), ordering="archived_at")
    def archived(self, obj: ArchivedPeriod) -> str:
        return iso_time(obj.archived_at)

    @admin.display(description=gettext_lazy("restored at"))
    def restored(self, obj: ArchivedPeriod) -> str:
        return iso_time(obj.restored_at)

    @admin.display(description=gettext_lazy("restore with"))
    def restore_with(self, obj: ArchivedPeriod) -> str:
        return f"manage.py archive restore {obj.period:%Y-%m-%d}"
