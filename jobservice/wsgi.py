"""WSGI entry point for gunicorn and granian: Django behind the single submission's lane,
each request on one of the process's WEB_THREADS lent database connections (D238)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "jobservice.settings")
django_application = get_wsgi_application()

from jobs.api.fastlane import FastLane  # noqa: E402  (needs the apps loaded)
from jobs.lending import LendingApp  # noqa: E402
from jobservice import observability  # noqa: E402
from jobservice.serve import web_threads  # noqa: E402

application = observability.wsgi(LendingApp(FastLane(django_application), web_threads()))
