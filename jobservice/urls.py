"""URL map: a front page, API under /api/v1/, admin, health and metrics."""

from django.contrib import admin
from django.urls import include, path, re_path

from jobs import health
from jobs.api.errors import api_not_found
from jobservice.views import home

urlpatterns = [
    path("", home, name="home"),
    path("admin/", admin.site.urls),
    path("api/v1/", include("jobs.api.urls")),
    re_path(r"^api/", api_not_found),  # every /api/ answer is JSON, a miss included
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("", include("django_prometheus.urls")),
]

handler404 = "jobs.api.errors.handler404"
handler500 = "jobs.api.errors.handler500"
