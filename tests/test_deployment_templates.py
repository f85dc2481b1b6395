"""The deployment's own pages live in the top-level templates/ (found through
TEMPLATES["DIRS"]), the app's in jobs/templates/: the front page, the admin's branding and
the error pages outside /api/ are the deployment's, and the wheel carries none of them."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.conf import settings
from django.template.loader import get_template
from django.test import RequestFactory

from jobs.api.errors import handler500

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENT = ROOT / "templates"


def test_the_deployment_finds_its_templates_first():
    (engine,) = settings.TEMPLATES
    assert engine["DIRS"] == [DEPLOYMENT] and engine["APP_DIRS"]
    for page in ("base.html", "home.html", "404.html", "500.html", "admin/base_site.html"):
        origin = Path(get_template(page).origin.name)
        assert origin == DEPLOYMENT / page, origin
    # The app's admin pages still come from the app.
    origin = Path(get_template("admin/jobs/job/dashboard.html").origin.name)
    assert origin.is_relative_to(ROOT / "jobs" / "templates")


def test_the_front_page_is_the_deployments_template(client):
    r = client.get("/")
    assert r.status_code == 200
    assert "home.html" in [t.name for t in r.templates]
    assert 'href="/admin/"' in r.content.decode()


@pytest.mark.django_db
def test_the_admin_carries_the_deployments_branding_around_the_apps_pages(admin_client):
    page = admin_client.get("/admin/").content.decode()
    assert "jobservice admin" in page and "Django administration" not in page
    assert "Job dashboard" in page  # the app's own admin/index.html, inside the branding
    dashboard = admin_client.get("/admin/jobs/job/dashboard/")
    assert dashboard.status_code == 200 and "jobservice admin" in dashboard.content.decode()


def test_a_page_that_matches_nothing_is_the_deployments_404_and_the_api_keeps_json(client):
    r = client.get("/no-such-page/")
    assert r.status_code == 404 and "Nothing is served at this address" in r.content.decode()
    api = client.get("/api/v1/no-such-endpoint/")
    assert api.status_code == 404 and api.json()["code"] == "not_found"


def test_a_server_error_outside_the_api_is_the_deployments_500():
    r = handler500(RequestFactory().get("/somewhere/"))
    assert r.status_code == 500 and b"Server error" in r.content
    api = handler500(RequestFactory().get("/api/v1/jobs/"))
    assert api.status_code == 500 and b'"server_error"' in api.content


def test_the_image_copies_the_templates():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "\nCOPY . .\n" in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not {"templates", "templates/", "/templates"} & set(ignored)
