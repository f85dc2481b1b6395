"""docs/django.md, run as written in a project made by `startproject` in a scratch
directory: the wheel built from pyproject.toml installed into a fresh virtualenv, no
JOBS_* setting, a task enqueued through django.tasks, run by `runworker --burst`, seen
in the admin and refused by the API without a token, the built-in `echo` refused to a
client (no test task is public in a host project); then `check` on a bad TASKS and a
bad JOBS_QUEUES prints the check and its hint, no traceback.

`make test` runs the fast variant: the fresh virtualenv takes the app from the wheel
only and the app's dependencies from this checkout's virtualenv (a path line, so none of
its editable installs). `make fresh-project` (FRESH_PROJECT_FULL=1) installs the wheel
with its dependencies resolved by pip, as a user's `pip install` does.
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

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "django.md"
FULL = os.environ.get("FRESH_PROJECT_FULL") == "1"
SERVER = "postgres://root@127.0.0.1:5432"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600 if FULL else 240)]


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), flags=re.S)


def python_block(first_line: str) -> str:
    (source,) = [b for b in blocks("python") if b.startswith(first_line + "\n")]
    return source


def run(cmd: list[str] | str, cwd: Path, env: dict[str, str], timeout: float = 120):
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
        shell=isinstance(cmd, str), executable="/bin/bash" if isinstance(cmd, str) else None,
    )  # fmt: skip
    return done


def build_wheel(out: Path) -> Path:
    """The wheel of a clean copy of the sources (an in-tree build/ keeps deleted files)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "jobs", src / "jobs", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("jobservice-*.whl")
    return wheel


def fresh_venv(venv: Path, wheel: Path) -> None:
    if FULL:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)]
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
    'content_type="application/json"); print("api echo", e.status_code, e.json()["code"])\''
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
        "python3.11 -m venv .venv && . .venv/bin/activate",
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
    assert "SUCCESSFUL 5" in done.stdout, out[-3000:]
    assert "admin lists True" in done.stdout, out[-3000:]
    assert "api without token 401" in done.stdout, out[-3000:]
    assert "api miss 404 application/json" in done.stdout, out[-3000:]  # under jobs/api/
    assert "metrics 200 True" in done.stdout, out[-3000:]  # the metrics include
    assert "failed attempt logged with its job" in done.stdout, out[-3000:]  # the page's LOGGING
    assert "schema 200 200" in done.stdout, out[-3000:]  # whatever REST_FRAMEWORK says
    assert "0 job(s) of gone workers requeued" in done.stdout, out[-3000:]  # runreaper --once
    assert "api echo 400 unknown_task" in done.stdout, out[-3000:]  # not public here
    ran = time.monotonic()

    # A misconfigured host project: each check's message and hint, no traceback.
    with open(work / "mysite" / "settings.py", "a") as f:
        f.write(
            '\nTASKS = {"default": {"BACKEND": "jobs.backends.JobServiceBackend", '
            '"QUEUES": ["default", "no spaces"]}}\n'
            'JOBS_QUEUES = {"default": {"colour": "red"}}\n'
        )
    check = run([str(venv / "bin" / "python"), "manage.py", "check"], work, env)
    assert check.returncode != 0, check.stdout + check.stderr
    for says in [
        "(jobs.E101) TASKS['default']['QUEUES'] holds 'no spaces', not a valid queue name",
        "HINT: 1-100 characters of letters, digits",
        "(jobs.E103) JOBS_QUEUES['default'] has unknown setting(s) colour",
        "HINT: JOBS_QUEUES maps queue names to settings",
    ]:
        assert says in check.stderr, check.stderr
    assert "Traceback" not in check.stderr, check.stderr
    print(
        f"fresh project: wheel {built - started:.1f} s, virtualenv {installed - built:.1f} s "
        f"({'full' if FULL else 'fast'}), page {ran - installed:.1f} s, "
        f"checks {time.monotonic() - ran:.1f} s"
    )
