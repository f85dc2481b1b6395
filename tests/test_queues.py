"""JOBS_QUEUES: only declared queues accept jobs; a malformed setting stops every command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from jobs import queues
from tests.api.conftest import counts

ROOT = Path(__file__).resolve().parents[1]


def test_default_declares_only_the_default_queue():
    assert queues.parse(queues.DEFAULT) == {"default": {}}


def test_settings_per_queue_are_kept():
    conf = '{"default": {}, "critical": {"weight": 3, "paused": false}}'
    assert queues.parse(conf)["critical"] == {"weight": 3, "paused": False}


@pytest.mark.parametrize(
    "text,says",
    [
        ("{default: {}}", "not valid JSON"),
        ("[]", "non-empty JSON object"),
        ("{}", "non-empty JSON object"),
        ('{"default": []}', "must be a JSON object of settings"),
        ('{"default": {"weigth": 2}}', "unknown setting(s) weigth"),
        ('{"default\\n": {}}', "is not a queue name"),
        ('{"no spaces": {}}', "is not a queue name"),
        ('{"' + "q" * 101 + '": {}}', "is not a queue name"),
    ],
)
def test_malformed_setting_is_refused_with_a_clear_message(text, says):
    with pytest.raises(ImproperlyConfigured) as info:
        queues.parse(text)
    assert says in str(info.value)


def test_a_command_refuses_to_start_on_a_malformed_setting_with_a_hint():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "jobservice.settings",
           "JOBS_QUEUES": '{"default": {"colour": "red"}}'}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "jobs.E103" in done.stderr and "unknown setting(s) colour" in done.stderr
    assert "HINT: JOBS_QUEUES maps queue names to settings" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.django_db
def test_an_undeclared_queue_is_400_unknown_queue_on_both_endpoints(settings):
    from tests.api.conftest import authed, new_client

    settings.JOBS_QUEUES = {"default": {}, "mail": {}}
    api = authed(new_client()[1])
    before = counts()
    body = {"task": "echo", "payload": 1, "queue": "elsewhere"}
    r = api.post("/api/v1/jobs/", json.dumps(body), content_type="application/json")
    assert r.status_code == 400 and r.json()["code"] == "unknown_queue", r.content
    batch = json.dumps({"jobs": [body]})
    r = api.post("/api/v1/jobs/batch/", batch, content_type="application/json")
    assert r.status_code == 400
    assert r.json()["errors"]["jobs.0.queue"][0]["code"] == "unknown_queue"
    assert counts() == before
    ok = {**body, "queue": "mail"}
    r = api.post("/api/v1/jobs/", json.dumps(ok), content_type="application/json")
    assert r.status_code == 201 and r.json()["queue"] == "mail"


@pytest.mark.django_db
def test_django_code_is_held_to_the_same_list(settings):
    from jobs.submission import UnknownQueue, submit

    settings.JOBS_QUEUES = {"default": {}}
    with pytest.raises(UnknownQueue):
        submit("echo", {}, queue="mail")
