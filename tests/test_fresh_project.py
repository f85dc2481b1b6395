"""docs/django.md, run as written in a project made by `startproject` in a scratch
directory: the wheel built from pyproject.toml installed into a fresh virtualenv, no
JOBS_* setting, a task enqueued through django.tasks, run by `runworker --burst`, its
result read back, seen in the admin (list and job page), the API refusing without a
token, the built-in `echo` refused to a client (no test task is public in a host
project), its schema page served, a metrics scrape; then `check` on a bad TASKS, a
bad JOBS_QUEUES and a missing django.contrib.postgres prints each check and its
hint, no traceback. On Django 6 the page's "Django 6:" comments are followed (the
backport's line dropped, `django.tasks` imported).

`make test` runs the fast variant: the fresh virtualenv takes the app from the wheel
only and the app's dependencies from this checkout's virtualenv (a path line, so none of
its editable installs). `make fresh-project` and every cell of `make test-matrix`
(FRESH_PROJECT_FULL=1) install the wheel with no extra and its dependencies resolved by
pip, as a user's `pip install` does, with the running Django's version: then neither
pyarrow nor confluent-kafka is installed, and `check` names the extra that a Kafka or
archive setting needs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import django
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "django.md"
FULL = os.environ.get("FRESH_PROJECT_FULL") == "1"
SERVER = "postgres://root@127.0.0.1:5432"
DJANGO_6 = django.VERSION >= (6,)

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(600 if FULL else 240)]


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), flags=re.S)


def python_block(first_line: str) -> str:
    (source,) = [b for b in blocks("python") if b.startswith(first_line + "\n")]
    return for_this_django(source)


def for_this_django(source: str) -> str:
    """The page's code as a user of this Django writes it: on Django 6 a line commented
    "Django 6: drop it" goes and one commented "Django 6: CODE" becomes CODE."""
    if not DJANGO_6:
        return source
    out = []
    for line in source.splitlines(keepends=True):
        code, sep, note = line.partition("Django 6: ")
        if not sep or "#" not in code:
            out.append(line)
        elif not note.startswith("drop it"):
            out.append(code[: len(code) - len(code.lstrip())] + note)
    return "".join(out)


def run(cmd: list[str] | str, cwd: Path, env: dict[str, str], timeout: float = 120):
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
        shell=isinstance(cmd, str), executable="/bin/bash" if isinstance(cmd, str) else None,
    )  # fmt: skip
    return done


def source_copy(src: Path) -> Path:
    """What the wheel and sdist are built from, copied clean (an in-tree build/ keeps
    deleted files): the app, and the deployment beside it that they must leave out."""
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("jobs", "jobservice"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def build_wheel(out: Path) -> Path:
    """The wheel of a clean copy of the sources."""
    src = source_copy(out / "src")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("jobservice-*.whl")
    return wheel


def user_requirements(wheel: Path) -> list[str]:
    """What a user of this Python and this Django asks pip for: the wheel without extras
    and that Django (the newest one otherwise); Django 5.2 on Python 3.12+ names the
    backport's extra, as the page says."""
    major_minor = ".".join(map(str, django.VERSION[:2]))
    backport = not DJANGO_6 and sys.version_info >= (3, 12)
    return [f"jobservice[tasks-backport] @ {wheel.as_uri()}" if backport else str(wheel),
            f"Django=={major_minor}.*"]  # fmt: skip


def fresh_venv(venv: Path, wheel: Path) -> None:
    if FULL:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
               *user_requirements(wheel)]  # fmt: skip
    else:
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
        )
        site = next(venv.glob("lib/python3*/site-packages"))
        # The dependencies only: a path line, so the checkout's editable install of jobs
        # (a .pth of that directory) is not read and `jobs` comes from the wheel alone.
        (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        cmd = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
               "install", "-q", "--no-deps", str(wheel)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture
def project_db():
    name = f"jobs_fresh_{os.getpid()}"
    subprocess.run(["psql", "-h", "127.0.0.1", "-U", "root", "-d", "postgres", "-qc",
                    f"CREATE DATABASE {name}"], check=True)  # fmt: skip
    yield name
    subprocess.run(["psql", "-h", "127.0.0.1", "-U", "root", "-d", "postgres", "-qc",
                    f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"], check=False)  # fmt: skip


ADMIN_AND_API = (
    "python manage.py shell -c '"
    'from django.test import Client; c = Client(HTTP_HOST="localhost"); '
    'assert c.login(username="admin", password="change-me"); '
    'page = c.get("/admin/jobs/job/").content.decode(); '
    'print("admin lists", page.count("shop.tasks.add") > 0); '
    'from jobs.models import Job; job = Job.objects.get(task="shop.tasks.add"); '
    'page = c.get(f"/admin/jobs/job/{job.pk}/change/"); '
    'print("admin job page", page.status_code, b"shop.tasks.add" in page.content); '
    'print("api without token", Client(HTTP_HOST="localhost").get("/jobs/api/jobs/").status_code); '
    'miss = c.get("/jobs/api/nope/"); print("api miss", miss.status_code, miss["Content-Type"]); '
    'api = [c.get(f"/jobs/api/{p}/").status_code for p in ("schema", "docs")]; '
    'print("schema", *api); '
    'm = Client(HTTP_HOST="localhost").get("/jobs/metrics"); '
    'print("metrics", m.status_code, b"# TYPE jobs_submitted_total counter" in m.content); '
    # The built-in test tasks are no public API tasks in a host project (D196).
    'from jobs.models import Client as C; _, t = C.create_with_token("fresh"); '
    'api = Client(HTTP_HOST="localhost", HTTP_AUTHORIZATION="Token " + t); '
    'e = api.post("/jobs/api/jobs/", {"task": "echo", "payload": {}}, '
    'content_type="application/json"); print("api echo", e.status_code, e.json()["code"]); '
    'anon = Client(HTTP_HOST="localhost", raise_request_exception=False); '
    'print("schema page", anon.get("/jobs/api/schema/").status_code)\''
)


LOGS = "# mysite/settings.py, for log lines that name their job"
# A task that fails in the worker (str + int): its log line names the job and the task.
FAILED_ATTEMPT_LOGGED = """
BAD=$(python manage.py shell -v 0 -c 'from shop.tasks import add; print(add.enqueue("a", 2).id)')
python manage.py runworker --burst 2> worker.log
grep 'attempt failed: TypeError' worker.log | grep "job_id=$BAD " | grep -q 'task=shop.tasks.add'
echo "failed attempt logged with its job"
"""


def test_the_django_page_runs_in_a_fresh_project_from_the_wheel(tmp_path, project_db):
    started = time.monotonic()
    wheel = build_wheel(tmp_path / "dist")
    built = time.monotonic()
    work = tmp_path / "project"
    work.mkdir()
    venv = work / ".venv"
    fresh_venv(venv, wheel)
    installed = time.monotonic()

    install, commands = blocks("sh")
    lines = install.splitlines()
    assert lines[:2] == [
        "python3 -m venv .venv && . .venv/bin/activate",
        "pip install jobservice",
    ]
    settings = python_block("# mysite/settings.py")
    assert '"NAME": "mysite"' in settings and '"USER": "postgres"' in settings
    settings = settings.replace('"NAME": "mysite"', f'"NAME": "{project_db}"')
    settings = settings.replace('"USER": "postgres"', '"USER": "root"')
    assert "JOBS_" not in settings
    commands = commands.replace("python manage.py runserver", ADMIN_AND_API)
    assert ADMIN_AND_API in commands
    script = "\n".join([
        ". .venv/bin/activate",
        'python -c "import jobs, sys; print(\'jobs from\', jobs.__file__)"',
        'python -c "import django; print(\'django\', django.get_version())"',
        "python -c \"import importlib.util as u; print('extras', "
        "[m for m in ('pyarrow', 'confluent_kafka') if u.find_spec(m)])\"",
        *lines[2:],
        f"cat >> mysite/settings.py <<'DOC_EOF'\n{settings}DOC_EOF",
        f"cat >> mysite/settings.py <<'DOC_EOF'\n{python_block(LOGS)}DOC_EOF",
        f"cat > mysite/urls.py <<'DOC_EOF'\n{python_block('# mysite/urls.py')}DOC_EOF",
        f"cat > shop/tasks.py <<'DOC_EOF'\n{python_block('# shop/tasks.py')}DOC_EOF",
        commands,
        FAILED_ATTEMPT_LOGGED,
    ])  # fmt: skip
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JOBS_", "DJANGO_", "REDIS_", "DATABASE_", "VIRTUAL_ENV", "PYTHON"))
    }
    env["PATH"] = os.pathsep.join(
        p for p in env["PATH"].split(os.pathsep) if not p.startswith(str(ROOT))
    )  # fmt: skip
    done = run(["bash", "-euo", "pipefail", "-c", script], work, env, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert f"jobs from {venv}" in done.stdout, done.stdout  # the wheel's, nothing else
    assert f"django {django.get_version()}" in done.stdout, done.stdout  # this cell's
    if FULL:  # pip resolved the wheel's dependencies: no optional one came along
        assert "extras []" in done.stdout, done.stdout
    assert "SUCCESSFUL 5" in done.stdout, out[-3000:]
    assert "admin lists True" in done.stdout, out[-3000:]
    assert "api without token 401" in done.stdout, out[-3000:]
    assert "api miss 404 application/json" in done.stdout, out[-3000:]  # under jobs/api/
    assert "metrics 200 True" in done.stdout, out[-3000:]  # the metrics include
    assert "failed attempt logged with its job" in done.stdout, out[-3000:]  # the page's LOGGING
    assert "schema 200 200" in done.stdout, out[-3000:]  # whatever REST_FRAMEWORK says
    assert "0 job(s) of gone workers requeued" in done.stdout, out[-3000:]  # runreaper --once
    assert "api echo 400 unknown_task" in done.stdout, out[-3000:]  # not public here
    assert "admin job page 200 True" in done.stdout, out[-3000:]
    ran = time.monotonic()

    # A misconfigured host project: each check's message and hint, no traceback. The
    # TASKS check runs although nothing imported the Tasks framework (Django 6).
    with open(work / "mysite" / "settings.py", "a") as f:
        f.write(
            '\nTASKS = {"default": {"BACKEND": "jobs.backends.JobServiceBackend", '
            '"QUEUES": ["default", "no spaces"]}}\n'
            'JOBS_QUEUES = {"default": {"colour": "red"}}\n'
            'INSTALLED_APPS.remove("django.contrib.postgres")\n'
            'JOBS_KAFKA_BOOTSTRAP_SERVERS = "127.0.0.1:9092"\n'
            f'JOBS_ARCHIVE_DIR = "{tmp_path / "archive"}"\n'
        )
    check = run([str(venv / "bin" / "python"), "manage.py", "check"], work, env)
    assert check.returncode != 0, check.stdout + check.stderr
    expected = [
        "(jobs.E101) TASKS['default']['QUEUES'] holds 'no spaces', not a valid queue name",
        "HINT: 1-100 characters of letters, digits",
        "(jobs.E103) JOBS_QUEUES['default'] has unknown setting(s) colour",
        "HINT: JOBS_QUEUES maps queue names to settings",
        "(jobs.E105) django.contrib.postgres is not in INSTALLED_APPS; the jobs app needs it",
        "Django 6 refuses them without it (postgres.E005)",
    ]
    if FULL:  # no extras installed
        expected += [
            "(jobs.E111) JOBS_KAFKA_BOOTSTRAP_SERVERS is set, but confluent-kafka is not installed",
            "HINT: pip install 'jobservice[kafka]'",
            "(jobs.E111) JOBS_ARCHIVE_DIR is set, but pyarrow is not installed",
            "HINT: pip install 'jobservice[archive]'",
        ]
    for says in expected:
        assert says in check.stderr, check.stderr
    assert "Traceback" not in check.stderr, check.stderr
    print(
        f"fresh project: wheel {built - started:.1f} s, virtualenv {installed - built:.1f} s "
        f"({'full' if FULL else 'fast'}), page {ran - installed:.1f} s, "
        f"checks {time.monotonic() - ran:.1f} s"
    )
    # The API's schema page (Swagger's source) under the host's own REST_FRAMEWORK: last,
    # so that a 500 there does not hide the rest.
    assert "schema page 200" in done.stdout, out[-3000:]
