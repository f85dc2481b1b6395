"""The admin as this deployment installs it: its registrations load where pages are served."""

from __future__ import annotations

import sys

from django.contrib.admin.apps import AdminConfig as DjangoAdminConfig
from django.contrib.admin.apps import SimpleAdminConfig

# Commands that never serve a page: they skip the admin's autodiscovery, which imports
# every app's admin module (the job console, its forms and templates, the API's
# serializers through them): a third of a worker's start-up (D137).
HEADLESS_COMMANDS = frozenset({"runworker", "runreaper"})


def headless(argv: list[str] = sys.argv) -> bool:
    """A `manage.py` process running one of HEADLESS_COMMANDS."""
    return len(argv) > 1 and argv[0].endswith("manage.py") and argv[1] in HEADLESS_COMMANDS


class AdminConfig(DjangoAdminConfig):
    def ready(self) -> None:
        if headless():
            SimpleAdminConfig.ready(self)  # the admin's checks, without the imports
        else:
            super().ready()
