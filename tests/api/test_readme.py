"""The README's 60-second walk-through runs as written against a live server, and the
API page's example of a submission from Django code compiles."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from jobs.models import Client, Job

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTED_BASE = "http://127.0.0.1:8000"


def section_blocks(document: str, title: str, lang: str) -> list[str]:
    text = (ROOT / document).read_text()
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def walkthrough() -> str:
    (script,) = section_blocks("README.md", "A 60-second walk-through", "sh")
    return script


def test_readme_documents_every_call():
    script = walkthrough()
    for call in ["createclient demo", "/jobs/", "/jobs/$JOB/", "?task=echo&status=",
                 "Idempotency-Key", "/cancel/", "/history/"]:  # fmt: skip
        assert call in script, call
    (python,) = section_blocks("docs/api.md", "Submitting from Django code", "python")
    assert "from jobs.submission import" in python and "submit(" in python
    compile(python, "docs/api.md", "exec")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_readme_curl_walkthrough_runs_as_written(live_server):
    script = walkthrough()
    assert DOCUMENTED_BASE in script
    script = script.replace(DOCUMENTED_BASE, live_server.url)
    db = connection.settings_dict
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "DJANGO_SETTINGS_MODULE": "jobservice.test_settings",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "201\n200\n" in done.stdout
    from django.contrib.auth import authenticate

    staff = authenticate(username="admin", password="change-me")  # the admin's login
    assert staff is not None and staff.is_staff
    assert '"code": "idempotency_conflict"' in done.stdout

    demo = Client.objects.get(name="demo")
    jobs = {j.payload.get("hello") or j.payload.get("order") or "later": j for j in demo.jobs.all()}
    assert set(jobs) == {"world", 42, "later"}
    assert jobs[42].idempotency_key == "order-42"
    assert (jobs["later"].status, jobs["later"].error) == ("failed", "cancelled")
    assert Job.objects.count() == 3
