"""jobs/conf.py owns every setting the app reads: a read of a setting it does not
declare fails here (and at the first read), so a setting added anywhere in the app
without its default and its docs/settings.md row is caught before a host project
meets it as an AttributeError."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest
from django.test import override_settings

from jobs import conf

ROOT = Path(__file__).resolve().parents[1]


def _is_app_setting(name: str) -> bool:
    return name.startswith("JOBS_") or name in conf.UNPREFIXED


def setting_reads(source: str) -> list[tuple[str, str]]:
    """(how, name) for each `settings.NAME` / getattr(settings, "NAME") of an app setting;
    how is "django" when the module took `settings` from django.conf, else "jobs"."""
    tree = ast.parse(source)
    how = "jobs"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "django.conf":
            if any(a.name == "settings" and a.asname is None for a in node.names):
                how = "django"
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in ("settings", "django_settings"):
                name = node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
        if name and _is_app_setting(name):
            found.append((how, name))
    return found


def app_sources() -> dict[str, str]:
    return {
        str(p.relative_to(ROOT)): p.read_text()
        for p in sorted((ROOT / "jobs").rglob("*.py"))
        if "migrations" not in p.parts and p.name != "conf.py"
    }


def test_every_setting_the_app_reads_is_declared_in_jobs_conf():
    unknown = sorted(
        f"{path}: {name}"
        for path, source in app_sources().items()
        for _, name in setting_reads(source)
        if name not in conf.SETTINGS
    )
    assert not unknown, f"declare these in jobs/conf.py SETTINGS (and docs/settings.md): {unknown}"


def test_app_code_reads_its_settings_through_jobs_conf():
    direct = sorted(
        f"{path}: {name}"
        for path, source in app_sources().items()
        for how, name in setting_reads(source)
        if how == "django"
    )
    assert not direct, f"read these through `from jobs.conf import settings`: {direct}"


def test_the_deployment_sets_only_declared_settings():
    tree = ast.parse((ROOT / "jobservice" / "settings.py").read_text())
    assigned = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    stray = sorted(n for n in assigned if n.startswith("JOBS_") and n not in conf.SETTINGS)
    assert not stray, f"jobservice/settings.py sets settings jobs/conf.py does not own: {stray}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from django.conf import settings\nx = settings.JOBS_NEW_THING\n",
         [("django", "JOBS_NEW_THING")]),
        ("from jobs.conf import settings\nx = getattr(settings, 'JOBS_OTHER', 1)\n",
         [("jobs", "JOBS_OTHER")]),
        ("from jobs.conf import settings\nx = settings.REDIS_URL\n", [("jobs", "REDIS_URL")]),
        ("from django.conf import settings\nx = settings.SECRET_KEY\n", []),
    ],
)  # fmt: skip
def test_the_scan_sees_each_way_of_reading_a_setting(source, expected):
    assert setting_reads(source) == expected


def test_an_undeclared_setting_fails_at_the_first_read():
    with pytest.raises(AttributeError, match="JOBS_NOT_DECLARED is not a jobs setting"):
        conf.settings.JOBS_NOT_DECLARED  # noqa: B018


def test_defaults_apply_when_the_project_sets_nothing(settings):
    del settings.JOBS_LEASE_SECONDS
    del settings.JOBS_QUEUES
    del settings.JOBS_WEBHOOK_KEY
    assert conf.settings.JOBS_LEASE_SECONDS == 15.0
    assert conf.settings.JOBS_QUEUES == {"default": {}}
    assert conf.settings.JOBS_WEBHOOK_KEY == settings.SECRET_KEY  # the documented fallback
    with override_settings(JOBS_LEASE_SECONDS=4.0):
        assert conf.settings.JOBS_LEASE_SECONDS == 4.0
    assert conf.settings.SECRET_KEY == settings.SECRET_KEY  # Django's own pass through


def test_the_environment_reads_each_setting_as_its_defaults_type():
    import environ

    env = environ.Env()
    environ.Env.ENVIRON = {
        "JOBS_LEASE_SECONDS": "4.5",
        "JOBS_MAX_RETRIES": "7",
        "JOBS_WEBHOOK_ALLOW_PRIVATE": "1",
        "JOBS_TASK_MODULES": "a.tasks,b.tasks",
        "JOBS_QUEUES": '{"default": {}}',
    }
    try:
        found = conf.from_environment(env)
    finally:
        environ.Env.ENVIRON = os.environ
    assert found == {
        "JOBS_LEASE_SECONDS": 4.5,
        "JOBS_MAX_RETRIES": 7,
        "JOBS_WEBHOOK_ALLOW_PRIVATE": True,
        "JOBS_TASK_MODULES": ["a.tasks", "b.tasks"],
        "JOBS_QUEUES": '{"default": {}}',
    }


def test_docs_settings_table_lists_every_setting_with_its_default():
    text = (ROOT / "docs" / "settings.md").read_text()
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| `([^`]*)` \|", text, re.MULTILINE))
    assert rows == {name: repr(s.default) for name, s in conf.SETTINGS.items()}
