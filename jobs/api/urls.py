"""Routes under /api/v1/ (or wherever a project includes them). The schema and its docs
page are public: they describe the API, and every job endpoint still needs a client
token. The last route answers every other path under the prefix with a JSON 404."""

from __future__ import annotations

from django.urls import path, re_path
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.views import SCHEMA_KWARGS, SpectacularAPIView, SpectacularSwaggerView
from rest_framework.permissions import AllowAny
from rest_framework.renderers import JSONRenderer

from jobs.api.errors import api_not_found
from jobs.api.flow import (
    BatchCreateView,
    BatchDetailView,
    SequenceDetailView,
    SequenceResumeView,
    SequenceSkipView,
)
from jobs.api.schedules import ScheduleViewSet
from jobs.api.schema import extend_schema  # and the token scheme, registered on import
from jobs.api.views import JobHistoryView, JobViewSet
from jobs.api.webhooks import DeliveryViewSet, WebhookViewSet
from jobs.api.workflows import (
    JobSignalView,
    WorkflowCancelView,
    WorkflowCreateView,
    WorkflowDetailView,
)


class JSONErrors:
    """Errors of the schema (YAML) and docs (HTML) views are JSON, like every API error.
    Their own schema class too, as on every API view (APIPolicy): the generator walks
    them, and a host whose REST_FRAMEWORK names no DEFAULT_SCHEMA_CLASS would give them
    DRF's, which drf-spectacular refuses (a 500 on the schema page)."""

    schema = AutoSchema()

    def finalize_response(self, request, response, *args, **kwargs):
        if getattr(response, "exception", False):
            request.accepted_renderer = JSONRenderer()
            request.accepted_media_type = JSONRenderer.media_type
        return super().finalize_response(request, response, *args, **kwargs)


class SchemaView(JSONErrors, SpectacularAPIView):
    @extend_schema(**SCHEMA_KWARGS)  # the library's own, built on the host's default
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)


class DocsView(JSONErrors, SpectacularSwaggerView):
    @extend_schema(exclude=True)
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)


_public = {"authentication_classes": [], "permission_classes": [AllowAny], "throttle_classes": []}

urlpatterns = [
    path("jobs/", JobViewSet.as_view({"get": "list", "post": "create"}), name="job-list"),
    path("jobs/batch/", JobViewSet.as_view({"post": "create_batch"}), name="job-batch"),
    path("jobs/<int:pk>/", JobViewSet.as_view({"get": "retrieve"}), name="job-detail"),
    path("jobs/<int:pk>/cancel/", JobViewSet.as_view({"post": "cancel"}), name="job-cancel"),
    path("jobs/<int:pk>/history/", JobHistoryView.as_view(), name="job-history"),
    path(
        "schedules/",
        ScheduleViewSet.as_view({"get": "list", "post": "create"}),
        name="schedule-list",
    ),
    path(
        "schedules/<int:pk>/",
        ScheduleViewSet.as_view(
            {"get": "retrieve", "patch": "partial_update", "delete": "destroy"}
        ),
        name="schedule-detail",
    ),
    path("jobs/<int:pk>/signal/", JobSignalView.as_view(), name="job-signal"),
    path("workflows/", WorkflowCreateView.as_view(), name="workflow-list"),
    path("workflows/<int:pk>/", WorkflowDetailView.as_view(), name="workflow-detail"),
    path("workflows/<int:pk>/cancel/", WorkflowCancelView.as_view(), name="workflow-cancel"),
    path("batches/", BatchCreateView.as_view(), name="batch-list"),
    path("batches/<int:pk>/", BatchDetailView.as_view(), name="batch-detail"),
    path("sequences/", SequenceDetailView.as_view(), name="sequence-detail"),
    path("sequences/resume/", SequenceResumeView.as_view(), name="sequence-resume"),
    path("sequences/skip/", SequenceSkipView.as_view(), name="sequence-skip"),
    path(
        "webhooks/", WebhookViewSet.as_view({"get": "list", "post": "create"}), name="webhook-list"
    ),
    path(
        "webhooks/<int:pk>/",
        WebhookViewSet.as_view({"get": "retrieve", "patch": "partial_update", "delete": "destroy"}),
        name="webhook-detail",
    ),
    path(
        "webhooks/<int:pk>/rotate-secret/",
        WebhookViewSet.as_view({"post": "rotate_secret"}),
        name="webhook-rotate-secret",
    ),
    path(
        "webhooks/<int:webhook_pk>/deliveries/",
        DeliveryViewSet.as_view({"get": "list"}),
        name="webhook-deliveries",
    ),
    path(
        "webhooks/<int:webhook_pk>/deliveries/<int:pk>/redeliver/",
        DeliveryViewSet.as_view({"post": "redeliver"}),
        name="webhook-redeliver",
    ),
    path("schema/", SchemaView.as_view(**_public), name="api-schema"),
    path("docs/", DocsView.as_view(url_name="api-schema", **_public), name="api-docs"),
    # Last: a miss under the prefix is the API's JSON 404, not the host's HTML page.
    re_path(r"^", api_not_found),
]
