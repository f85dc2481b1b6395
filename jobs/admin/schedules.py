"""Schedules in the staff console: list with next and last run and recent jobs,
pause and resume, and "run now" (confirmed, audited). Writes go through
jobs.schedules (define, firing), so a schedule is held to the API's rules."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db import transaction
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy, ngettext

from jobs.admin.actions import log_change, staff_actor
from jobs.admin.display import iso_time, status_badge_html
from jobs.exceptions import RequestInvalid, SubmissionError
from jobs.models import Job, Schedule
from jobs.schedules import define, firing

RECENT_JOBS = 10


class ScheduleForm(forms.ModelForm):
    """The model's fields, checked by jobs.schedules.define (cron, zone, task, payload...)."""

    class Meta:
        model = Schedule
        fields = [*define.FIELDS, "client"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "client" in self.fields:
            self.fields["client"].required = False

    def clean(self):
        data = super().clean()
        values = {k: data.get(k) for k in define.FIELDS}
        values["cron"] = values["cron"] or None
        try:
            self.checked = define.check(values)
        except RequestInvalid as exc:
            for field, items in exc.errors.items():
                for item in items:
                    self.add_error(field if field in self.fields else None, item["message"])
        except SubmissionError as exc:
            self.add_error(exc.field if exc.field in self.fields else None, exc.message)
        return data


class ScheduleAdmin(admin.ModelAdmin):
    form = ScheduleForm
    list_display = (
        "name", "client", "timing", "task", "queue", "enabled", "next_run", "last_run",
        "recent_jobs_link",
    )  # fmt: skip
    list_filter = ("enabled", "origin", "catch_up", "overlap")
    search_fields = ("name", "task")
    ordering = ("name", "id")
    actions = ["pause_schedules", "resume_schedules", "run_schedules_now"]
    readonly_fields = ("origin", "next_run", "last_run", "recent_jobs")
    fieldsets = (
        (None, {"fields": ("name", "client", "origin", "enabled")}),
        (gettext_lazy("When"), {"fields": ("cron", "interval_seconds", "timezone", "catch_up",
                                           "overlap", "next_run", "last_run")}),
        (gettext_lazy("Job"), {"fields": ("task", "payload", "queue", "priority", "max_retries",
                                          "timeout")}),
        (gettext_lazy("Recent jobs"), {"fields": ("recent_jobs",)}),
    )  # fmt: skip

    class Media:
        css = {"all": ("jobs/admin/jobs.css",)}  # the status badges of recent jobs

    def save_model(self, request, obj, form, change):
        """Through jobs.schedules.define: next_fire_at follows the timing and `enabled`."""
        values = {k: form.checked[k] for k in define.FIELDS}
        with transaction.atomic():
            if change:
                define.update(Schedule.objects.select_for_update().get(pk=obj.pk), values)
            else:
                saved = define.create(
                    values, client=form.cleaned_data.get("client"), origin=Schedule.Origin.ADMIN
                )
                obj.pk = saved.pk

    def get_readonly_fields(self, request, obj=None):
        # A schedule stays its client's (the API shows it to that client only).
        return (*self.readonly_fields, "client") if obj is not None else self.readonly_fields

    def has_run_permission(self, request) -> bool:
        return request.user.has_perm("jobs.run_schedule")

    # --- columns

    @admin.display(description=gettext_lazy("timing"))
    def timing(self, obj: Schedule) -> str:
        zone = "" if obj.interval_seconds else f" ({obj.timezone})"
        return f"{obj.every}{zone}"

    @admin.display(description=gettext_lazy("next run"), ordering="next_fire_at")
    def next_run(self, obj: Schedule) -> str:
        if not obj.enabled:
            return gettext_lazy("paused")
        return iso_time(obj.next_fire_at) if obj.next_fire_at else "-"

    @admin.display(description=gettext_lazy("last run"), ordering="last_fire_at")
    def last_run(self, obj: Schedule) -> str:
        return iso_time(obj.last_fire_at) if obj.last_fire_at else "-"

    def _jobs_url(self, obj: Schedule) -> str:
        return f"{reverse('admin:jobs_job_changelist')}?schedule__id__exact={obj.pk}"

    @admin.display(description=gettext_lazy("jobs"))
    def recent_jobs_link(self, obj: Schedule) -> str:
        return format_html('<a href="{}">{}</a>', self._jobs_url(obj), gettext_lazy("jobs"))

    @admin.display(description=gettext_lazy("recent jobs"))
    def recent_jobs(self, obj: Schedule) -> str:
        if obj.pk is None:
            return "-"
        jobs = Job.objects.filter(schedule_id=obj.pk).order_by("-created_at", "-id")[:RECENT_JOBS]
        rows = format_html_join(
            "",
            '<li><a href="{}">{}</a> {} {}</li>',
            (
                (reverse("admin:jobs_job_change", args=[j.pk]), j.pk, status_badge_html(j.status),
                 iso_time(j.fire_time) if j.fire_time else "")
                for j in jobs
            ),
        )  # fmt: skip
        return format_html(
            '<ul class="schedule-recent-jobs">{}</ul><a href="{}">{}</a>',
            rows,
            self._jobs_url(obj),
            gettext_lazy("all jobs of this schedule"),
        )

    # --- actions

    def _set_enabled(self, request, queryset, enabled: bool, verb: str) -> None:
        changed = 0
        with transaction.atomic():
            for schedule in queryset.select_for_update().order_by("pk"):
                if schedule.enabled == enabled:
                    continue
                define.update(schedule, {"enabled": enabled})
                log_change(request, [schedule], f"{verb} by {staff_actor(request)}")
                changed += 1
        self.message_user(
            request,
            ngettext("%(count)d schedule %(verb)s", "%(count)d schedules %(verb)s", changed)
            % {"count": changed, "verb": verb},
            messages.SUCCESS,
        )

    @admin.action(permissions=["change"], description=gettext_lazy("Pause selected schedules"))
    def pause_schedules(self, request, queryset):
        self._set_enabled(request, queryset, False, "paused")

    @admin.action(permissions=["change"], description=gettext_lazy("Resume selected schedules"))
    def resume_schedules(self, request, queryset):
        self._set_enabled(request, queryset, True, "resumed")

    @admin.action(permissions=["run"], description=gettext_lazy("Run selected schedules now"))
    def run_schedules_now(self, request, queryset):
        """Confirm first; then one job per schedule, whatever its overlap policy, recorded
        in scheduler_runs as manual, in the job's history and in the admin log."""
        if request.POST.get("post") != "yes":
            context = {
                **self.admin_site.each_context(request),
                "title": gettext_lazy("Run schedules now"),
                "opts": self.opts,
                "schedules": list(queryset.order_by("name")),
                "selected_ids": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
                "select_across": request.POST.get("select_across", "0"),
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                "actor": staff_actor(request),
            }
            return TemplateResponse(request, "admin/jobs/schedule/run_now.html", context)
        actor = staff_actor(request)
        made = 0
        for schedule in queryset.order_by("pk"):
            with transaction.atomic():
                fired = firing.run_now(schedule.pk, actor)
                if fired is None or fired.job_id is None:
                    continue
                log_change(request, [schedule], f"Run now by {actor}: job {fired.job_id}")
                made += 1
        self.message_user(
            request,
            ngettext("%(count)d job made", "%(count)d jobs made", made) % {"count": made},
            messages.SUCCESS,
        )
        return None
