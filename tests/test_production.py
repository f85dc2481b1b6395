"""Production settings, checked the way they run: in a fresh process with
JOBS_PRODUCTION=1, as the container starts them."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path

import pytest
from django.conf import settings

from tests.harness import free_port

ROOT = Path(__file__).resolve().parent.parent
STRONG_KEY = secrets.token_urlsafe(64)


def production_env(**overrides: str | None) -> dict[str, str]:
    """The environment of a production process; None removes a variable."""
    db = settings.DATABASES["default"]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DJANGO_", "JOBS_", "SECURE_", "CSRF_")) and k != "DEBUG"
    }
    env.update(
        DJANGO_SETTINGS_MODULE="jobservice.settings",
        JOBS_PRODUCTION="1",
        DEBUG="0",
        SECRET_KEY=STRONG_KEY,
        DATABASE_URL=f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        REDIS_URL=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        ALLOWED_HOSTS="jobs.example.com,localhost",
        CSRF_TRUSTED_ORIGINS="https://jobs.example.com",
    )
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def manage(*args: str, **env: str | None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=production_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_deploy_is_clean_in_production():
    r = manage("check", "--deploy", "--fail-level", "WARNING")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "System check identified no issues" in r.stdout


def test_security_checks_are_clean_in_production():
    r = manage("check", "--deploy", "--tag", "security", "--fail-level", "WARNING")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "System check identified no issues" in r.stdout


@pytest.mark.parametrize(
    "env,warning",
    [({"DEBUG": "1"}, "security.W018"), ({"SECURE_SSL_REDIRECT": "0"}, "security.W008")],
)
def test_security_checks_catch_a_weakened_deployment(env, warning):
    """The check above can fail: weakening one setting makes it fail."""
    r = manage("check", "--deploy", "--tag", "security", "--fail-level", "WARNING", **env)
    assert r.returncode != 0
    assert warning in r.stdout + r.stderr


@pytest.mark.parametrize("missing", ["SECRET_KEY", "DATABASE_URL", "REDIS_URL"])
def test_production_refuses_to_start_without_required_settings(missing):
    r = manage("check", **{missing: None})
    assert r.returncode != 0
    assert f"production needs {missing}" in r.stderr


@pytest.mark.parametrize(
    "key,why",
    [
        ("dev-insecure-" + "x" * 50, "default or placeholder"),
        ("django-insecure-" + secrets.token_urlsafe(50), "default or placeholder"),
        ("changeme", "default or placeholder"),
        (secrets.token_urlsafe(20), "at least 50 needed"),
        ("ab" * 40, "fewer than 5 distinct"),
    ],
    # Stable ids: random keys in the ids would differ between pytest-xdist's workers.
    ids=["dev-insecure", "django-insecure", "changeme", "short", "repetitive"],
)
def test_production_rejects_a_weak_secret_key(key, why):
    r = manage("check", SECRET_KEY=key)
    assert r.returncode != 0
    assert "SECRET_KEY is too weak for production" in r.stderr
    assert why in r.stderr


def test_development_still_starts_with_the_default_key():
    r = manage("check", JOBS_PRODUCTION=None, SECRET_KEY=None)
    assert r.returncode == 0, r.stderr


def _get(url: str, headers: dict[str, str]) -> tuple[int, Message, bytes]:
    """Status, headers (looked up by any case: granian sends them lowercase), body."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


@pytest.mark.slow
def test_admin_and_static_files_work_under_the_api_server_in_production(tmp_path, django_db_setup):
    """The image's path: collectstatic with production settings, then the API server.
    The admin page renders and its CSS is served by whitenoise with a hashed name."""
    static = tmp_path / "static"
    r = manage("collectstatic", "--noinput", STATIC_ROOT=str(static))
    assert r.returncode == 0, r.stderr
    assert (static / "staticfiles.json").exists()  # the manifest storage's index

    port = free_port()
    env = production_env(STATIC_ROOT=str(static), WEB_CONCURRENCY="1", BIND=f"127.0.0.1:{port}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobservice.serve"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    https = {"Host": "jobs.example.com", "X-Forwarded-Proto": "https"}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                status, _, _ = _get(f"{base}/healthz", {"Host": "localhost"})
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "the API server did not come up"
                time.sleep(0.2)
        # Probes over plain http are not redirected.
        assert status == 200
        # Everything else is sent to https ...
        status, headers, _ = _get(f"{base}/admin/login/", {"Host": "jobs.example.com"})
        assert status == 301
        assert headers["Location"].startswith("https://jobs.example.com/")
        # ... and served there with HSTS and secure cookies.
        status, headers, body = _get(f"{base}/admin/login/", https)
        assert status == 200
        assert "max-age=31536000" in headers["Strict-Transport-Security"]
        assert "Secure" in headers["Set-Cookie"]
        page = body.decode()
        css = page.split('href="/static/admin/css/base.')[1].split('"')[0]
        assert len(css.split(".")[0]) == 12, f"static name is not hashed: base.{css}"
        status, headers, body = _get(f"{base}/static/admin/css/base.{css}", https)
        assert status == 200
        assert headers["Content-Type"].startswith("text/css")
        assert "immutable" in headers["Cache-Control"]
        # An unknown host is refused.
        status, _, _ = _get(f"{base}/admin/login/", {**https, "Host": "evil.example.org"})
        assert status == 400
    finally:
        proc.terminate()
        proc.wait(10)
