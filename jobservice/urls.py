"""URL map: API under /api/v1/, admin, health and metrics."""

from django.contrib import admin
from django.urls import include, path

from jobs import health

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("jobs.api.urls")),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("", include("django_prometheus.urls")),
]
