"""A host project's URLconf: the app's includes under prefixes of its own choosing, and
Django's own handler404/handler500 (HTML), as `startproject` leaves them."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("jobs/api/", include("jobs.api.urls")),
    path("jobs/metrics", include("jobs.metrics_urls")),
]
