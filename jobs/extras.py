"""The optional dependencies: each feature that needs one names the extra to install.

`pip install jobservice` brings what every host needs; a feature most hosts never turn on
brings its library as an extra (pyproject.toml): `kafka` (confluent-kafka), `archive`
(pyarrow), `otel` (the OpenTelemetry SDK and OTLP exporter), `sentry` (sentry-sdk), and
on Django 5.2 under Python 3.12+ `tasks-backport` (django-tasks). Without
it, `check` says so when the setting that turns the feature on is set (jobs.E111), and
the feature itself refuses with the same words where it starts, never with a bare
ModuleNotFoundError from deep inside.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import django
from django.core.exceptions import ImproperlyConfigured

from jobs.conf import settings

BACKEND_PATH = "jobs.backends.JobServiceBackend"


class MissingExtra(ImproperlyConfigured):
    """A feature was used whose optional dependency is not installed."""


def _kafka_on() -> bool:
    return bool(settings.JOBS_KAFKA_BOOTSTRAP_SERVERS)


def _archive_on() -> bool:
    return bool(settings.JOBS_ARCHIVE_DIR)


def _otel_on() -> bool:
    """The standard variables ask for a trace exporter (the deployment configures the
    SDK from them, docs/observability.md)."""
    exporters = os.environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if exporters:
        return exporters != "none"
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def _sentry_on() -> bool:
    return bool(os.environ.get("SENTRY_DSN"))


def _tasks_backend_on() -> bool:
    """TASKS names this backend on a Django without django.tasks."""
    if django.VERSION >= (6,):
        return False
    tasks = getattr(settings, "TASKS", None) or {}
    return any(isinstance(c, dict) and c.get("BACKEND") == BACKEND_PATH for c in tasks.values())


@dataclass(frozen=True)
class Extra:
    name: str
    module: str  # what is imported
    distribution: str  # what pip installs
    feature: str
    setting: str  # what turns the feature on, as `check` names it
    on: Callable[[], bool]

    def installed(self) -> bool:
        try:
            importlib.import_module(self.module)
        except ImportError:
            return False
        return True

    def message(self) -> str:
        return (
            f"{self.feature} needs {self.distribution}, which is not installed: "
            f"pip install 'jobservice[{self.name}]'"
        )


EXTRAS = {
    e.name: e
    for e in (
        Extra(
            "kafka",
            "confluent_kafka",
            "confluent-kafka",
            "The Kafka sink of completion events",
            "JOBS_KAFKA_BOOTSTRAP_SERVERS is set",
            _kafka_on,
        ),
        Extra(
            "archive",
            "pyarrow",
            "pyarrow",
            "The Parquet archive of retention",
            "JOBS_ARCHIVE_DIR is set",
            _archive_on,
        ),
        Extra(
            "otel",
            "opentelemetry.sdk.trace",
            "opentelemetry-sdk",
            "Traces to an OTLP collector",
            "OTEL_TRACES_EXPORTER or OTEL_EXPORTER_OTLP_ENDPOINT is set",
            _otel_on,
        ),
        Extra(
            "sentry",
            "sentry_sdk",
            "sentry-sdk",
            "Error reports to Sentry",
            "SENTRY_DSN is set",
            _sentry_on,
        ),
        Extra(
            "tasks-backport",
            "django_tasks",
            "django-tasks",
            "The Tasks framework on Django 5.2",
            f"TASKS names {BACKEND_PATH}",
            _tasks_backend_on,
        ),
    )
}


def require(name: str) -> None:
    """Refuse the feature at its start, naming the extra, when its library is missing."""
    extra = EXTRAS[name]
    if not extra.installed():
        raise MissingExtra(extra.message())


def missing_for_settings() -> list[Extra]:
    """The extras the settings turn on and that are not installed (`check`)."""
    return [e for e in EXTRAS.values() if e.on() and not e.installed()]


class Lazy:
    """Stands for a module of an extra, imported at its first use (D373): pyarrow and
    numpy cost every API process a tenth of a second at start, for an archive it rarely
    reads. Without the extra, the module that imports it still imports (and its parts
    that do not need it work); the first use raises MissingExtra."""

    def __init__(self, module: str, name: str) -> None:
        self._module_name = module
        self._name = name
        self._module: Any = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            try:
                module = importlib.import_module(self._module_name)
            except ImportError as exc:
                raise MissingExtra(EXTRAS[self._name].message()) from exc
            self._module = module
        return getattr(module, attr)
