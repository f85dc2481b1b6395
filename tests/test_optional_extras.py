"""The optional dependencies (jobs/extras.py): without its extra a feature is a clear error
naming the `pip install` line, at `check` when its setting is on and where it starts; the
rest of the app imports and runs without them. The fresh project of tests/
test_fresh_project.py shows the same with the extras really absent (FRESH_PROJECT_FULL)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import django
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import modify_settings

from harness import ROOT
from jobs import checks, extras
from jobs.models import ArchivedPeriod
from tests.factories import JobFactory
from tests.test_archive import attached, layout, move, prune  # noqa: F401  (layout: a fixture)


def without(monkeypatch, *modules: str) -> None:
    """Imports of these modules fail in this process, as in an install without them."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def extra_errors() -> list:
    return [e for e in checks.check_setup() if e.id == "jobs.E111"]


@pytest.mark.parametrize(
    "setting, value, module, extra, distribution",
    [
        ("JOBS_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092", "confluent_kafka", "kafka",
         "confluent-kafka"),
        ("JOBS_ARCHIVE_DIR", "/var/lib/jobs-archive", "pyarrow", "archive", "pyarrow"),
    ],
)  # fmt: skip
def test_check_names_the_extra_a_setting_needs(
    settings, monkeypatch, setting, value, module, extra, distribution
):
    setattr(settings, setting, value)
    assert extra_errors() == []  # installed here: nothing to say
    without(monkeypatch, module)
    (error,) = extra_errors()
    assert error.msg == f"{setting} is set, but {distribution} is not installed"
    assert f"pip install 'jobservice[{extra}]'" in error.hint
    setattr(settings, setting, "")
    assert extra_errors() == []  # the feature is off: its library is not needed


@pytest.mark.parametrize(
    "variable, value, module, extra, setting, distribution",
    [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318", "opentelemetry.sdk.trace",
         "otel", "OTEL_TRACES_EXPORTER or OTEL_EXPORTER_OTLP_ENDPOINT", "opentelemetry-sdk"),
        ("SENTRY_DSN", "http://key@127.0.0.1:9/1", "sentry_sdk", "sentry", "SENTRY_DSN",
         "sentry-sdk"),
    ],
)  # fmt: skip
def test_check_names_the_extra_a_variable_needs(
    monkeypatch, variable, value, module, extra, setting, distribution
):
    """Traces and error reports are turned on by their tools' own variables (D302)."""
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", variable):
        monkeypatch.delenv(name, raising=False)
    without(monkeypatch, module)
    assert extra_errors() == []  # not asked for: its library is not needed
    monkeypatch.setenv(variable, value)
    (error,) = extra_errors()
    assert error.msg == f"{setting} is set, but {distribution} is not installed"
    assert f"pip install 'jobservice[{extra}]'" in error.hint


def test_the_kafka_sink_and_command_refuse_naming_the_extra(settings, monkeypatch):
    from jobs.events import kafka

    settings.JOBS_KAFKA_BOOTSTRAP_SERVERS = "127.0.0.1:9092"
    without(monkeypatch, "confluent_kafka")
    with pytest.raises(extras.MissingExtra, match=r"pip install 'jobservice\[kafka\]'"):
        kafka.KafkaSink()  # what runreaper starts when the sink is configured
    with pytest.raises(CommandError, match=r"pip install 'jobservice\[kafka\]'"):
        call_command("kafka", "status")


def test_prunejobs_without_pyarrow_refuses_before_detaching_anything(
    layout,  # noqa: F811
    tmp_path,
    settings,
    monkeypatch,
):
    day = layout
    ids = [JobFactory.create(status="done").pk for _ in range(2)]
    move(ids, day)
    settings.JOBS_ARCHIVE_DIR = str(tmp_path / "archive")
    without(monkeypatch, "pyarrow")
    with pytest.raises(CommandError, match=r"pip install 'jobservice\[archive\]'"):
        prune()
    assert attached(f"jobs_job_p{day:%Y%m%d}")
    assert not ArchivedPeriod.objects.exists()


@pytest.mark.skipif(django.VERSION >= (6,), reason="Django 6 has django.tasks built in")
def test_django_5_2_without_the_backport_is_told_its_extra(settings, monkeypatch):
    settings.TASKS = {"default": {"BACKEND": "jobs.backends.JobServiceBackend"}}
    with monkeypatch.context() as m:  # undone before TASKS is (the backport reloads it)
        without(m, "django_tasks")
        (error,) = extra_errors()
    assert "django-tasks is not installed" in error.msg
    assert "pip install 'jobservice[tasks-backport]'" in error.hint


@pytest.mark.skipif(django.VERSION < (6,), reason="Django 5.2 needs the backport")
def test_django_6_needs_no_backport(settings, monkeypatch):
    settings.TASKS = {"default": {"BACKEND": "jobs.backends.JobServiceBackend"}}
    with monkeypatch.context() as m:
        without(m, "django_tasks")
        assert extra_errors() == []


def test_check_asks_for_django_contrib_postgres():
    with modify_settings(INSTALLED_APPS={"remove": ["django.contrib.postgres"]}):
        errors = [e for e in checks.check_setup() if e.id == "jobs.E105"]
    (error,) = errors
    assert "django.contrib.postgres" in error.msg and "postgres.E005" in error.hint


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "jobservice.test_settings"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_tasks_check_is_registered_without_importing_the_framework():
    """Django 6 registers its check of TASKS when django.tasks is imported, which nothing
    in `manage.py check` does: the app's ready() does it, so jobs.E101/E102 run."""
    done = run_python(
        """
        import sys
        import django
        django.setup()
        from django.core.checks.registry import registry
        found = [c.__module__ for c in registry.get_checks()
                 if c.__module__ in ("django.tasks.checks", "django_tasks.checks")]
        print("registered", found)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "registered ['django" in done.stdout, done.stdout + done.stderr


def test_every_module_of_the_app_imports_without_the_optional_extras():
    """The admin, the API, the commands and the worker load with neither pyarrow nor
    confluent-kafka (nor granian, OpenTelemetry or sentry-sdk): only the features that
    need them refuse."""
    done = run_python(
        """
        import sys
        for name in ("pyarrow", "confluent_kafka", "granian", "opentelemetry", "sentry_sdk"):
            sys.modules[name] = None
        import django
        django.setup()
        import importlib, pkgutil, jobs
        failed = []
        for info in pkgutil.walk_packages(jobs.__path__, "jobs."):
            # The deployment's API middleware (jobservice/wsgi.py) needs django-prometheus.
            if ".migrations." in info.name or info.name == "jobs.api.fastlane":
                continue
            try:
                importlib.import_module(info.name)
            except Exception as exc:
                failed.append(f"{info.name}: {exc!r}")
        print("failed", failed)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "failed []" in done.stdout, done.stdout
