"""The app in other hands: the deployment's front page, what `make run`'s workers serve,
runstack outside the deployment, and the wheel's contents."""

from __future__ import annotations

import os

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from jobs.management.commands.runstack import served_queues


def test_the_url_make_run_prints_is_a_page_with_the_way_on(client):
    r = client.get("/")
    assert r.status_code == 200 and r["Content-Type"].startswith("text/html")
    page = r.content.decode()
    for href in ('href="/admin/"', 'href="/api/v1/docs/"', 'href="/api/v1/schema/"'):
        assert href in page, page


def test_make_run_serves_every_declared_queue(settings):
    settings.JOBS_QUEUES = {"default": {}, "reports": {"concurrency": 2}}
    assert served_queues() == "default:1,reports:1,webhooks:1"


def test_runstack_outside_the_deployment_says_what_to_run_instead():
    with override_settings(SETTINGS_MODULE="mysite.settings"):
        with pytest.raises(
            CommandError, match="run `manage.py runworker` and `manage.py runreaper`"
        ):
            call_command("runstack")


def test_the_readmes_startapp_in_the_root_leaves_make_lint_green(tmp_path):
    """startapp's files import what they do not use (F401): the README's `myapp/` in the
    checkout's root is excluded from ruff (and git); any other app name is linted."""
    import shutil
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shutil.copy(root / "pyproject.toml", tmp_path / "pyproject.toml")
    ruff = Path(sys.executable).with_name("ruff")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    for app in ("myapp", "otherapp"):
        subprocess.run(
            [sys.executable, "-m", "django", "startapp", app], cwd=tmp_path, env=env, check=True
        )
    lint = subprocess.run([ruff, "check", "."], cwd=tmp_path, capture_output=True, text=True)
    assert lint.returncode != 0 and "otherapp/" in lint.stdout, lint.stdout  # not silenced
    assert "myapp/" not in lint.stdout, lint.stdout
    ignored = (root / ".gitignore").read_text().splitlines()
    assert "myapp/" in ignored
    config = tomllib.loads((root / "pyproject.toml").read_text())
    assert config["tool"]["pytest"]["ini_options"]["testpaths"] == ["tests"]  # make test


def test_checks_name_a_database_that_is_not_postgresql_and_a_missing_app(monkeypatch):
    from django.conf import settings as django_settings

    from jobs import checks

    assert checks.check_setup() == []
    sqlite = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    with override_settings(DATABASES={**django_settings.DATABASES, **sqlite}):
        (error,) = checks.check_setup()
    assert error.id == "jobs.E104" and "django.db.backends.postgresql" in error.hint
    monkeypatch.setitem(checks.REQUIRED_APPS, "django.contrib.humanize", "a test's reason")
    (error,) = checks.check_setup()
    assert error.id == "jobs.E105" and "django.contrib.humanize" in error.msg and error.hint
