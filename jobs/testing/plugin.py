"""The pytest plugin: a `run_jobs` fixture (docs/testing.md).

Registered under its module path (pyproject's pytest11 entry), so a conftest.py that also
lists it in `pytest_plugins` loads it once. Nothing Django-side is imported until the
fixture runs: pytest loads plugins before Django is configured.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def run_jobs(db):  # pytest-django's `db`: the test's transaction, rolled back after it
    """jobs.testing.run_jobs, inside the test's database transaction."""
    from jobs.testing import run_jobs

    return run_jobs
