"""List filters whose choices and queries stay on indexes (never DISTINCT over the table)."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Q
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from jobs import selectors
from jobs import tasks as task_registry
from jobs.conf import settings
from jobs.lifecycle import Status


class StuckFilter(admin.SimpleListFilter):
    """processing jobs whose heartbeat is older than the lease (database clock)."""

    title = gettext_lazy("stuck")
    parameter_name = "stuck"

    def lookups(self, request, model_admin):
        return [
            (
                "yes",
                _("%(state)s, no heartbeat for > %(lease)s s")
                % {"state": Status.PROCESSING, "lease": f"{settings.JOBS_LEASE_SECONDS:g}"},
            )
        ]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.stuck(settings.JOBS_LEASE_SECONDS)
        return queryset


class _ValueFilter(admin.SimpleListFilter):
    """Exact match on one column; the choices come from somewhere cheap."""

    field = ""

    def known(self) -> list[str]:
        raise NotImplementedError

    def lookups(self, request, model_admin):
        values = set(self.known())
        if self.value():
            values.add(self.value())
        return [(v, v) for v in sorted(values)]

    def queryset(self, request, queryset):
        if self.value():
            return queryset.filter(**{self.field: self.value()})
        return queryset


class TaskFilter(_ValueFilter):
    title = gettext_lazy("task")
    parameter_name = "task"
    field = "task"

    def known(self) -> list[str]:
        return task_registry.names()


class QueueFilter(_ValueFilter):
    title = gettext_lazy("queue")
    parameter_name = "queue"
    field = "queue"

    def known(self) -> list[str]:
        """Queues with live jobs or among the newest jobs (cached, index-bounded)."""
        return ["default", *selectors.known_queues()]


# Tasks the app runs for itself (webhook deliveries): by the thousand, they would crowd
# staff's own jobs off the list's first pages.
INTERNAL_TASK_PREFIXES = ("webhook.",)


class InternalFilter(admin.SimpleListFilter):
    """Internal tasks hidden unless asked for (or a task filter names one)."""

    title = gettext_lazy("internal tasks")
    parameter_name = "internal"

    def lookups(self, request, model_admin):
        return [("all", _("shown")), ("only", _("only"))]

    def choices(self, changelist):
        yield {
            "selected": self.value() is None,
            "query_string": changelist.get_query_string(remove=[self.parameter_name]),
            "display": _("hidden"),
        }
        for value, title in self.lookup_choices:
            yield {
                "selected": self.value() == value,
                "query_string": changelist.get_query_string({self.parameter_name: value}),
                "display": title,
            }

    def queryset(self, request, queryset):
        internal = Q()
        for prefix in INTERNAL_TASK_PREFIXES:
            internal |= Q(task__startswith=prefix)
        if self.value() == "only":
            return queryset.filter(internal)
        if self.value() is None and TaskFilter.parameter_name not in request.GET:
            return queryset.exclude(internal)
        return queryset
