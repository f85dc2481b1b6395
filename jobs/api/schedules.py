"""The schedules API: a client's own periodic jobs (docs/schedules.md). Another
client's schedule is a 404, as for jobs; a refused definition is a 400 and writes
nothing (the rules are jobs.schedules.define's, the same a submission obeys)."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.urls import reverse
from drf_spectacular.utils import OpenApiExample
from rest_framework import status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from jobs.api.errors import exception_handler
from jobs.api.parsers import BoundedJSONParser
from jobs.api.policy import APIPolicy
from jobs.api.schema import extend_schema
from jobs.api.serializers import ScheduleSerializer, ScheduleWriteSerializer
from jobs.api.views import IdCursorPagination, error_responses
from jobs.exceptions import InvalidSubmission, RequestInvalid
from jobs.models import Schedule
from jobs.schedules import define


class ScheduleCursorPagination(IdCursorPagination):
    """Oldest first, by id."""

    ordering = ("id",)


_errors = error_responses({
    400: "Refused (see `code` and `errors`); nothing was written.",
    404: "No such schedule for this client.",
})  # fmt: skip


def _body(data: Any, *, partial: bool) -> dict[str, Any]:
    """The JSON object of a request: known fields only; all required ones unless partial."""
    if not isinstance(data, dict):
        raise InvalidSubmission("the body must be a JSON object", code="invalid")
    errors: dict[str, list[dict[str, str]]] = {}
    for name in sorted(set(data) - set(define.FIELDS), key=str):
        errors[str(name)[:100]] = [
            {
                "message": f"Unknown field; allowed: {', '.join(define.FIELDS)}.",
                "code": "unknown_field",
            }
        ]
    if not partial:
        for name in ("name", "task"):
            if name not in data:
                errors[name] = [{"message": "This field is required.", "code": "required"}]
        if "cron" not in data and "interval_seconds" not in data:
            errors["cron"] = [{"message": "Give cron or interval_seconds.", "code": "required"}]
    if errors:
        raise RequestInvalid(errors)
    return dict(data)


class ScheduleViewSet(APIPolicy, viewsets.GenericViewSet):
    serializer_class = ScheduleSerializer
    parser_classes = [BoundedJSONParser]
    pagination_class = ScheduleCursorPagination
    filter_backends: list[Any] = []

    def get_exception_handler(self) -> Any:
        return exception_handler

    def get_queryset(self) -> Any:
        if getattr(self, "swagger_fake_view", False):  # schema generation
            return Schedule.objects.none()
        return Schedule.objects.filter(client=self.request.user)

    @extend_schema(
        summary="Create a schedule",
        description="Exactly one of `cron` (5 fields, or 6 with seconds first) and "
        "`interval_seconds` (at least 1). Cron times are wall-clock times in `timezone` "
        "(IANA, default UTC). `catch_up` after downtime: `skip` (default) makes one job "
        "for the missed period, `all` one per missed slot (bounded). `overlap`: `allow` "
        "(default), or `skip` while the schedule's previous job is queued or processing.",
        request=ScheduleWriteSerializer,
        responses={201: ScheduleSerializer, **_errors(400, 401, 413, 415)},
        examples=[
            OpenApiExample(
                "nightly",
                value={
                    "name": "nightly-report",
                    "cron": "0 3 * * *",
                    "timezone": "Europe/Berlin",
                    "task": "echo",
                    "payload": {"report": "daily"},
                },
                request_only=True,
            )
        ],
    )
    def create(self, request: Request) -> Response:
        values = _body(request.data, partial=False)
        with transaction.atomic(durable=True):
            schedule = define.create(values, client=request.user, origin=Schedule.Origin.API)
        return Response(
            ScheduleSerializer(schedule).data,
            status=status.HTTP_201_CREATED,
            headers={"Location": reverse("schedule-detail", args=[schedule.pk])},
        )

    @extend_schema(
        summary="The client's schedules, oldest first",
        responses={200: ScheduleSerializer(many=True), **_errors(400, 401)},
    )
    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(ScheduleSerializer(page, many=True).data)

    @extend_schema(summary="A schedule", responses={200: ScheduleSerializer, **_errors(401, 404)})
    def retrieve(self, request: Request, pk: int) -> Response:
        return Response(ScheduleSerializer(self.get_object()).data)

    @extend_schema(
        summary="Change a schedule",
        description="Any subset of the fields. A new timing, or `enabled: true` on a "
        "paused schedule, starts from the next slot after now (nothing is caught up "
        "for the time it was paused).",
        request=ScheduleWriteSerializer(partial=True),
        responses={200: ScheduleSerializer, **_errors(400, 401, 404, 413, 415)},
    )
    def partial_update(self, request: Request, pk: int) -> Response:
        schedule = self.get_object()
        values = _body(request.data, partial=True)
        with transaction.atomic(durable=True):
            schedule = define.update(schedule, values)
        return Response(ScheduleSerializer(schedule).data)

    @extend_schema(summary="Delete a schedule", responses={204: None, **_errors(401, 404)})
    def destroy(self, request: Request, pk: int) -> Response:
        """It fires no more; the jobs it made stay (their `schedule` keeps its id)."""
        schedule = self.get_object()
        with transaction.atomic(durable=True):
            schedule.delete()
        return Response(status=status.HTTP_204_NO_CONTENT)
