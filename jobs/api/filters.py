"""Filters for a client's job list: status, task, queue and a created_at range."""

from __future__ import annotations

from datetime import UTC

import django_filters
from django.core.exceptions import ValidationError
from django_filters.fields import IsoDateTimeField

from jobs.lifecycle import STATUSES
from jobs.models import Job


class UTCIsoDateTimeField(IsoDateTimeField):
    """ISO 8601, sent to PostgreSQL in UTC: an offset PostgreSQL refuses (past ±15:59,
    e.g. -18:05) or a time that leaves the calendar in UTC is a 400, not a DataError."""

    def to_python(self, value):
        try:
            parsed = super().to_python(value)
            return parsed.astimezone(UTC) if parsed is not None else None
        except (OverflowError, ValueError):
            raise ValidationError(self.error_messages["invalid"], code="invalid") from None


class UTCIsoDateTimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UTCIsoDateTimeField


class JobFilter(django_filters.FilterSet):
    status = django_filters.MultipleChoiceFilter(
        choices=[(s, s) for s in STATUSES],
        help_text="Repeat to match any of several: ?status=queued&status=failed",
    )
    task = django_filters.CharFilter()
    queue = django_filters.CharFilter()
    created_after = UTCIsoDateTimeFilter(
        field_name="created_at", lookup_expr="gte", help_text="created_at >= this (ISO 8601)."
    )
    created_before = UTCIsoDateTimeFilter(
        field_name="created_at", lookup_expr="lt", help_text="created_at < this (ISO 8601)."
    )
    schedule = django_filters.NumberFilter(
        field_name="schedule_id",
        min_value=1,
        max_value=2**63 - 1,
        decimal_places=0,
        help_text="The jobs one of your schedules made (its id).",
    )

    class Meta:
        model = Job
        fields = ["status", "task", "queue", "created_after", "created_before", "schedule"]
