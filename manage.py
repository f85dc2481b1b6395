#!/usr/bin/env python
"""Django's command-line utility for jobservice."""

import os
import sys

SINGLE_PROCESS_EXPORTERS = ("runworker", "runreaper")
MULTIPROC_ENV = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "jobservice.settings")
    if len(sys.argv) > 1 and sys.argv[1] in SINGLE_PROCESS_EXPORTERS:
        # Workers and reapers serve their own registry on --metrics-port; the
        # multiprocess directory is the API's (gunicorn.conf.py) and must not leak in.
        # prometheus_client reads it when first imported, so drop it before Django starts.
        for name in MULTIPROC_ENV:
            os.environ.pop(name, None)
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
