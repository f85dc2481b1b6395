"""Filters for a client's job list: status, task, queue and a created_at range."""

from __future__ import annotations

import django_filters

from jobs.lifecycle import STATUSES
from jobs.models import Job


class JobFilter(django_filters.FilterSet):
    status = django_filters.MultipleChoiceFilter(
        choices=[(s, s) for s in STATUSES],
        help_text="Repeat to match any of several: ?status=queued&status=failed",
    )
    task = django_filters.CharFilter()
    queue = django_filters.CharFilter()
    created_after = django_filters.IsoDateTimeFilter(
        field_name="created_at", lookup_expr="gte", help_text="created_at >= this (ISO 8601)."
    )
    created_before = django_filters.IsoDateTimeFilter(
        field_name="created_at", lookup_expr="lt", help_text="created_at < this (ISO 8601)."
    )

    class Meta:
        model = Job
        fields = ["status", "task", "queue", "created_after", "created_before"]
