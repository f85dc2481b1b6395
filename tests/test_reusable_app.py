"""The app in other hands: the deployment's front page, what `make run`'s workers serve,
runstack outside the deployment, and the wheel's contents."""

from __future__ import annotations

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
