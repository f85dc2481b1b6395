"""WSGI entry point for gunicorn and granian: Django behind the single submission's lane."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "jobservice.settings")
django_application = get_wsgi_application()

from jobs.api.fastlane import FastLane  # noqa: E402  (needs the apps loaded)

application = FastLane(django_application)
