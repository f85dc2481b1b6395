"""The admin's shape: its look lives in static CSS files (no inline styles), its
labels are translatable, and saving a new API client goes through ModelAdmin's
own save. Real PostgreSQL and Redis, Django's test client."""

from __future__ import annotations

import re

import pytest
from django.contrib import admin
from django.contrib.admin import site as admin_site
from django.contrib.auth.models import User
from django.contrib.staticfiles import finders
from django.core.cache import cache
from django.urls import reverse
from django.utils.functional import Promise

from jobs import services
from jobs.models import Client, Job
from tests.factories import JobFactory, raw

pytestmark = pytest.mark.django_db

STYLESHEET = re.compile(r'<link [^>]*href="/static/(jobs/admin/[\w.]+\.css)"[^>]*>')


@pytest.fixture
def root(client):
    user = User.objects.create_superuser("root", password="pw")
    client.force_login(user)
    cache.clear()
    yield user
    cache.clear()


def job_pages(client) -> dict[str, str]:
    """Every page the jobs app draws or restyles, rendered with jobs in every state."""
    failed = JobFactory.create(status="failed")
    JobFactory.create(status="enqueue_failed")
    JobFactory.create(status="done")
    running = JobFactory.create(status="processing")
    lease = services.claim("w-2", JobFactory.create().pk)
    services.heartbeat([lease], [{"done": 1, "total": 4, "message": "a quarter"}])
    changelist = reverse("admin:jobs_job_changelist")
    confirm = client.post(
        changelist, {"action": "retry_jobs", "_selected_action": [str(failed.pk)]}
    )
    token = client.post(reverse("admin:jobs_client_add"), {"name": "styles"})
    return {
        "index": client.get(reverse("admin:index")),
        "changelist": client.get(changelist),
        "detail (failed)": client.get(reverse("admin:jobs_job_change", args=[failed.pk])),
        "detail (processing)": client.get(reverse("admin:jobs_job_change", args=[running.pk])),
        "dashboard": client.get(reverse("admin:jobs_job_dashboard")),
        "confirmation": confirm,
        "token": token,
    }


def test_job_pages_have_no_inline_css_and_link_static_stylesheets(client, root):
    for name, response in job_pages(client).items():
        assert response.status_code == 200, name
        html = response.content.decode()
        assert "<style" not in html, name
        assert " style=" not in html, (name, html[html.index(" style=") - 200 :][:400])
        sheets = STYLESHEET.findall(html)
        assert sheets, name
        for sheet in sheets:
            assert finders.find(sheet), (name, sheet)  # collectstatic picks it up


def test_badge_colours_come_from_the_stylesheet():
    """Each state has its own colour in the CSS the job pages load."""
    css = open(finders.find("jobs/admin/jobs.css")).read()
    dashboard_css = open(finders.find("jobs/admin/dashboard.css")).read()
    for state in [value for value, _ in Job._meta.get_field("status").choices]:
        assert f".job-badge-{state} {{ background:" in css, state
        assert f".jd-fill-{state} {{ fill:" in dashboard_css, state


def test_labels_and_descriptions_are_translatable():
    """Column headers, filter titles and action labels are lazy translations, as in
    Django's own admin, so a translation catalogue can change them per request."""
    for model in (Job, Client):
        model_admin = admin_site._registry[model]
        for name in model_admin.list_display:
            attr = getattr(model_admin, name, None)
            if callable(attr) and hasattr(attr, "short_description"):
                assert isinstance(attr.short_description, Promise), (model, name)
        for action in model_admin.actions:
            func = getattr(model_admin, action) if isinstance(action, str) else action
            assert isinstance(func.short_description, Promise), (model, action)
        for list_filter in model_admin.list_filter:
            if isinstance(list_filter, type) and issubclass(list_filter, admin.ListFilter):
                assert isinstance(list_filter.title, Promise), list_filter


def test_client_add_saves_through_the_model_admin(client, root, monkeypatch):
    """The token is issued in save_model, which then hands over to ModelAdmin.save_model
    (its hooks and the form's instance), not a side write of its own."""
    saved = []
    original = admin.ModelAdmin.save_model

    def spy(self, request, obj, form, change):
        saved.append((type(self).__name__, obj.name, change, bool(obj.token_hash)))
        return original(self, request, obj, form, change)

    monkeypatch.setattr(admin.ModelAdmin, "save_model", spy)
    response = client.post(reverse("admin:jobs_client_add"), {"name": "billing"})
    assert response.status_code == 200
    assert saved == [("ClientAdmin", "billing", False, True)]
    created = Client.objects.get(name="billing")
    assert created.token_hash == Client.hash_token(response.context["token"])
    assert created.created_at is not None


def test_dashboard_latency_is_the_slo_reports_statement(settings):
    """One latency query: the dashboard runs `manage.py slo`'s statement, so the two
    can never disagree about a percentile or about what counts as within the SLO."""
    from jobs import selectors
    from jobs.admin import dashboard

    statements = {name: sql for name, sql, _ in dashboard.dashboard_queries()}
    assert statements["latency"] is selectors.SLO_SQL
    settings.JOBS_SLO_SECONDS = 25
    for seconds in (3, 10, 40):
        job = JobFactory.create(status="done")
        raw(
            "UPDATE jobs_job SET due_at = finished_at - %s * interval '1 second' WHERE id = %s",
            [seconds, job.pk],
        )
    board = dashboard.dashboard()
    report = selectors.slo_report(dashboard.DASHBOARD_WINDOW_SECONDS, 25)
    assert (board.latency_p50, board.latency_p95, board.latency_p99) == (
        report.p50,
        report.p95,
        report.p99,
    )
    assert board.latency_p50 == pytest.approx(10, abs=0.5)
    assert (board.finished, board.within_slo) == (report.terminal, report.within_slo) == (3, 2)


def test_stylesheets_are_collected_with_hashed_names_in_production(tmp_path, django_db_setup):
    """Under production settings (whitenoise's manifest storage) both stylesheets are
    collected, and `{% static %}` and `Media` name the hashed, cache-forever files."""
    import json
    import subprocess
    import sys

    from tests.test_production import ROOT, manage, production_env

    static = tmp_path / "static"
    r = manage("collectstatic", "--noinput", STATIC_ROOT=str(static))
    assert r.returncode == 0, r.stderr
    manifest = json.loads((static / "staticfiles.json").read_text())["paths"]
    probe = (
        "import django; django.setup()\n"
        "from django.contrib import admin\n"
        "from django.templatetags.static import static\n"
        "from jobs.models import Job\n"
        "print(static('jobs/admin/dashboard.css'))\n"
        "print(admin.site._registry[Job].media['css'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=production_env(STATIC_ROOT=str(static)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for name in ("jobs/admin/jobs.css", "jobs/admin/dashboard.css"):
        hashed = manifest[name]
        assert hashed != name and (static / hashed).exists(), (name, hashed)
        assert (static / hashed).read_text() == (ROOT / "jobs/static" / name).read_text()
        assert f"/static/{hashed}" in out.stdout, (name, out.stdout)
