"""Test settings: the real PostgreSQL and Redis on 127.0.0.1, never the embedded server."""

import hashlib
import json
import os
from pathlib import Path

os.environ.setdefault("DATABASE_URL", "postgres://root@127.0.0.1:5432/jobservice")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")
# A prefix of our own per checkout, so parallel checkouts on one machine never share keys.
_checkout = hashlib.sha1(str(Path(__file__).resolve().parent.parent).encode()).hexdigest()[:8]
os.environ.setdefault("JOBS_REDIS_PREFIX", f"jobs-test-{_checkout}:")
# With pytest-xdist each worker process (gw0, gw1, ...) gets a prefix of its own, as it gets
# a test database of its own (pytest-django suffixes the name). The controller has already
# set the variable above, and the workers inherit it: derive theirs from it.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker and not os.environ["JOBS_REDIS_PREFIX"].endswith(f"{_worker}:"):
    os.environ["JOBS_REDIS_PREFIX"] = os.environ["JOBS_REDIS_PREFIX"].rstrip(":") + f"-{_worker}:"
# The queues the suite submits to (only declared queues accept jobs); inherited by the
# processes the tests start.
_TEST_QUEUES = (
    "default mail slow reports other high urgent bulk critical txn reap repairq live q a b "
    "obs-a obs-b obs-c obs-commit obs-reap obs-term obs-staff obs-quiet obs-parked"
)
os.environ.setdefault("JOBS_QUEUES", json.dumps({q: {} for q in _TEST_QUEUES.split()}))
# The test and example tasks the suite submits as a client, opened by name (D196): a
# deployment opens none of them. Inherited by the processes the tests start.
_TEST_PUBLIC_TASKS = "echo sleep fail demo.record demo.flaky demo.permanent demo.crash"
os.environ.setdefault("JOBS_PUBLIC_TASKS", ",".join(_TEST_PUBLIC_TASKS.split()))

from jobservice.settings import *  # noqa: E402,F403
from jobservice.settings import DATABASES  # noqa: E402

DATABASES["default"]["TEST"] = {"NAME": f"test_jobservice_{_checkout}"}
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DEBUG = False

# WhiteNoise warns on every request when STATIC_ROOT is missing; tests never collect.
Path(STATIC_ROOT).mkdir(parents=True, exist_ok=True)  # noqa: F405
