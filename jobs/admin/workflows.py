"""Durable jobs and workflows in the staff console: a job's steps and signals, the
audited "send signal" form, and a workflow page that draws its graph (server-side SVG,
like the dashboard) with each job's state and a link to it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from jobs import selectors, signals, workflows
from jobs.admin.actions import log_change, staff_actor
from jobs.admin.display import iso_time, time_column
from jobs.admin.readonly import ListsFromReplica, SeenWithJobs, WrittenByServices
from jobs.durable import max_steps
from jobs.exceptions import SubmissionError
from jobs.models import Job, JobSignal, JobStep, Workflow

PREVIEW_CHARS = 200


def _preview(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + "…"


def _preview_column(field: str, description: Any) -> Callable[[Any, Any], str]:
    """A column showing one JSON field as `_preview` does (its first characters)."""

    def column(admin_self: Any, obj: Any) -> str:
        return _preview(getattr(obj, field))

    column.__name__ = f"{field}_preview"
    return admin.display(description=description)(column)


class _ReadOnly(WrittenByServices, SeenWithJobs):
    """Steps, signals and workflows are written by the services; job viewers see them."""


class _JobPartInline(_ReadOnly, admin.TabularInline):
    """Rows of a job shown on its page: read-only, oldest first, with their time."""

    fk_name = "job"
    ordering = ("id",)
    extra = 0
    max_num = 0
    can_delete = False
    at_utc = time_column("created_at", gettext_lazy("at"))

    def get_readonly_fields(self, request, obj=None):
        return self.fields


class JobStepInline(_JobPartInline):
    """The job's committed checkpoints (~ names are its waits), oldest first."""

    model = JobStep
    verbose_name = gettext_lazy("step")
    verbose_name_plural = gettext_lazy("Steps (checkpoints)")
    fields = ("name", "result_preview", "at_utc", "lease_version", "worker_id")
    result_preview = _preview_column("result", gettext_lazy("result"))


class JobSignalInline(_JobPartInline):
    """Signals delivered to the job; one without a `~signal:<key>` step is pending."""

    model = JobSignal
    verbose_name = gettext_lazy("signal")
    verbose_name_plural = gettext_lazy("Signals")
    fields = ("key", "payload_preview", "sent_by", "at_utc", "consumed")
    payload_preview = _preview_column("payload", gettext_lazy("payload"))

    @admin.display(description=gettext_lazy("consumed"), boolean=True)
    def consumed(self, obj: JobSignal) -> bool:
        return JobStep.objects.filter(job_id=obj.job_id, name=f"~signal:{obj.key}").exists()


# --- send signal ----------------------------------------------------------------------


def _job_link(job_id: int) -> str:
    url = reverse("admin:jobs_job_change", args=[job_id])
    return format_html('<a href="{}">{}</a>', url, job_id)


class DurableFields:
    """A job's durable side on its page: its history's size against JOBS_MAX_STEPS, its
    runs (continue-as-new) and a warning for a signal wait without a timeout on an old
    run (D319)."""

    @admin.display(description=gettext_lazy("history"))
    def history_size(self, obj: Job) -> str:
        h = selectors.job_history(obj.pk)
        used = h["steps"] + h["waits"]
        text = _("%(steps)d steps, %(waits)d waits, %(bytes)d bytes (%(used)d of %(max)d)") % {
            **h, "used": used, "max": max_steps()}  # fmt: skip
        if used >= 0.8 * max_steps():
            return format_html('<strong class="errornote">{}</strong> {}', text,
                               _("continue as new before the limit"))  # fmt: skip
        return text

    @admin.display(description=gettext_lazy("runs"))
    def chain_runs(self, obj: Job) -> str:
        if obj.chain_id is None:
            return "-"
        parts = [format_html(_("run {} of chain {}"), obj.run_number or 1, _job_link(obj.chain_id))]
        if obj.previous_run_ids:
            links = format_html_join(", ", "{}", ((_job_link(i),) for i in obj.previous_run_ids))
            parts.append(format_html(_("previous: {}"), links))
        if obj.next_run_id is not None:
            parts.append(format_html(_("continued as {}"), _job_link(obj.next_run_id)))
        return format_html_join("; ", "{}", ((p,) for p in parts))

    @admin.display(description=gettext_lazy("open wait"))
    def open_wait(self, obj: Job) -> str:
        if not selectors.open_wait_is_old(obj):
            return "-"
        warning = _(
            "waits for a signal with no timeout on a run older than JOBS_OPEN_WAIT_WARN_AGE: "
            "prefer wait_for_signal(key, timeout=...) in a loop that continues as new"
        )
        return format_html('<strong class="errornote">{}</strong>', warning)


class SignalForm(forms.Form):
    key = forms.CharField(max_length=signals.MAX_KEY)
    payload = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 4}), required=False, initial="null",
        help_text=gettext_lazy("JSON; returned by the job's wait_for_signal(key)."),
    )  # fmt: skip

    def clean_payload(self) -> Any:
        try:
            return json.loads(self.cleaned_data["payload"] or "null")
        except ValueError as exc:
            raise forms.ValidationError(_("Not JSON: %(error)s") % {"error": exc}) from None


def send_signal_view(modeladmin: admin.ModelAdmin, request: HttpRequest, object_id: str):
    """Staff "send signal" (permission jobs.signal_job), audited with a LogEntry."""
    if not request.user.has_perm("jobs.signal_job"):
        raise PermissionDenied
    job = get_object_or_404(Job, pk=object_id)
    form = SignalForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        key, payload = form.cleaned_data["key"], form.cleaned_data["payload"]
        actor = staff_actor(request)
        try:
            woke = signals.signal_job(job.pk, key, payload, actor=actor)
        except (signals.SignalRefused, SubmissionError) as exc:
            form.add_error(None, str(exc))
        else:
            log_change(request, [job], f"signal {key!r} sent by {actor}")
            text = _("Signal “%(key)s” sent: %(what)s.") % {
                "key": key,
                "what": _("the job was waiting for it and is due now")
                if woke
                else _("kept until the job waits for it"),
            }
            modeladmin.message_user(request, text, messages.SUCCESS)
            return HttpResponseRedirect(reverse("admin:jobs_job_change", args=[job.pk]))
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": _("Send a signal to job %(id)s") % {"id": job.pk},
        "opts": modeladmin.opts,
        "original": job,
        "form": form,
    }
    return TemplateResponse(request, "admin/jobs/job/send_signal.html", context)


# --- workflows --------------------------------------------------------------------------

NODE_W, NODE_H, GAP_X, GAP_Y, PAD = 150, 28, 60, 12, 10


def graph_layout(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Columns by depth (longest path from a root), nodes stacked in each column, edges
    from a parent's right side to its child's left side: coordinates for the SVG."""
    by_id = {s["id"]: s for s in steps}
    depth: dict[str, int] = {}
    for step in steps:  # steps come in creation order; parents may come later: iterate
        stack = [step["id"]]
        while stack:
            top = stack[-1]
            missing = [p for p in by_id[top]["after"] if p not in depth]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            depth[top] = 1 + max((depth[p] for p in by_id[top]["after"]), default=-1)
    columns: dict[int, list[str]] = {}
    for step in steps:
        columns.setdefault(depth[step["id"]], []).append(step["id"])
    pos = {}
    for col, ids in columns.items():
        for row, step_id in enumerate(ids):
            pos[step_id] = (PAD + col * (NODE_W + GAP_X), PAD + row * (NODE_H + GAP_Y))
    nodes = [
        {
            "x": pos[s["id"]][0], "y": pos[s["id"]][1], "w": NODE_W, "h": NODE_H,
            "label": s["id"][:20], "status": s["status"], "title":
            f"{s['id']}: job {s['job_id']} {s['task']} [{s['status']}]"
            + (f" waiting: {s['wait_reason']}" if s["wait_reason"] else "")
            + (f" — {s['error']}" if s["error"] else ""),
            "url": reverse("admin:jobs_job_change", args=[s["job_id"]]),
        }
        for s in steps
    ]  # fmt: skip
    edges = [
        {
            "x1": pos[p][0] + NODE_W, "y1": pos[p][1] + NODE_H / 2,
            "x2": pos[s["id"]][0], "y2": pos[s["id"]][1] + NODE_H / 2,
        }
        for s in steps
        for p in s["after"]
    ]  # fmt: skip
    width = PAD * 2 + (max(columns, default=0) + 1) * (NODE_W + GAP_X) - GAP_X
    height = PAD * 2 + max((len(v) for v in columns.values()), default=1) * (NODE_H + GAP_Y)
    return {"nodes": nodes, "edges": edges, "width": width, "height": height}


class WorkflowAdmin(ListsFromReplica, _ReadOnly, admin.ModelAdmin):
    list_display = ("id", "name", "on_failure", "unfinished", "created", "finished")
    list_per_page = 100
    ordering = ("-id",)
    search_fields = ("=id", "name")
    show_full_result_count = False

    @admin.display(description=gettext_lazy("created"))
    def created(self, obj: Workflow) -> str:
        return iso_time(obj.created_at)

    @admin.display(description=gettext_lazy("finished"))
    def finished(self, obj: Workflow) -> str:
        return iso_time(obj.finished_at) if obj.finished_at else "—"

    def change_view(self, request, object_id, form_url="", extra_context=None):
        """The graph page: each step a box coloured by its job's state, linked to it."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        found = workflows.detail(int(object_id)) if object_id.isdigit() else None
        if found is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        counts: dict[str, int] = {}
        for step in found["steps"]:
            counts[step["status"]] = counts.get(step["status"], 0) + 1
        context = {
            **self.admin_site.each_context(request),
            "title": _("Workflow %(id)s: %(name)s") % found,
            "opts": self.opts,
            "workflow": found,
            "graph": graph_layout(found["steps"]),
            "summary": ", ".join(
                ngettext("%(n)d %(status)s", "%(n)d %(status)s", n) % {"n": n, "status": s}
                for s, n in sorted(counts.items())
            ),
        }
        return TemplateResponse(request, "admin/jobs/workflow/graph.html", context)
