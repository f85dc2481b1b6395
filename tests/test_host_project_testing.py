"""docs/testing.md, run as written in a project made by `startproject` (its settings from
docs/django.md) in a scratch directory: Django's runner runs the page's TestCase and
TransactionTestCase (runworker --burst, then the test database's teardown), pytest its
fixture test; each test that enqueues, runs and asserts takes under a second."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_fresh_project import python_block as django_block

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "testing.md"

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(300)]


def block(first_line: str) -> str:
    found = re.findall(r"```(?:python|ini)\n(.*?)```", DOC.read_text(), flags=re.S)
    (source,) = [b for b in found if b.startswith(first_line + "\n")]
    return source


def psql(sql: str) -> None:
    subprocess.run(["psql", "-h", "127.0.0.1", "-U", "root", "-d", "postgres", "-qc", sql],
                   check=False, capture_output=True)  # fmt: skip


@pytest.fixture
def project(tmp_path):
    name = f"jobs_host_{os.getpid()}"
    work = tmp_path / "project"
    work.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JOBS_", "DJANGO_", "REDIS_", "DATABASE_", "PYTEST_"))
    }
    python = sys.executable  # this checkout's virtualenv: jobs installed from it
    for cmd in (["-m", "django", "startproject", "mysite", "."], ["manage.py", "startapp", "shop"]):
        subprocess.run([python, *cmd], cwd=work, env=env, check=True, timeout=60)
    settings = django_block("# mysite/settings.py")
    settings = settings.replace('"NAME": "mysite"', f'"NAME": "{name}"')
    settings = settings.replace('"USER": "postgres"', '"USER": "root"')
    with open(work / "mysite" / "settings.py", "a") as f:
        f.write(settings)
    for path in ("shop/tasks.py", "shop/tests.py", "shop/test_with_pytest.py", "conftest.py",
                 "pytest.ini"):  # fmt: skip
        (work / path).write_text(block(f"# {path}"))
    with open(work / "shop" / "tests.py", "a") as f:
        f.write(TIMED)
    yield work, env, python
    for db in (name, f"test_{name}"):
        psql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


# Appended to the page's shop/tests.py: each test's own time (setUp to tearDown), printed.
TIMED = """

import time as _time
import unittest as _unittest

_run = _unittest.TestCase.run


def _timed(self, result=None):
    started = _time.monotonic()
    try:
        return _run(self, result)
    finally:
        print(f"took {self.id()} {_time.monotonic() - started:.3f}")


_unittest.TestCase.run = _timed
"""


def test_the_testing_page_runs_in_a_host_project(project):
    work, env, python = project
    done = subprocess.run(
        [python, "manage.py", "test", "shop", "-v", "2", "--timing", "--noinput"],
        cwd=work, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert "Ran 3 tests" in out and "OK" in out, out[-3000:]
    # The TransactionTestCase's teardown, then the test database's destruction, passed.
    assert "being accessed by other users" not in out, out[-3000:]
    took = {m[1].rsplit(".", 1)[1]: float(m[2]) for m in re.finditer(r"took (\S+) (\S+)", out)}
    assert took.keys() == {"test_add", "test_flaky_is_retried", "test_runworker_burst"}, out
    assert took["test_add"] < 1 and took["test_flaky_is_retried"] < 1, took

    done = subprocess.run(
        [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--durations=0",
         "--durations-min=0", "shop/test_with_pytest.py"],
        cwd=work, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert "1 passed" in out, out[-3000:]
    call = re.search(r"(\d+\.\d+)s call\s+shop/test_with_pytest.py::test_add", out)
    assert call is not None and float(call[1]) < 1, out[-3000:]
