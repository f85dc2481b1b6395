"""gunicorn settings for the API, from the environment."""

import os

bind = os.environ.get("BIND", "127.0.0.1:8000")
workers = int(os.environ.get("WEB_CONCURRENCY", "2"))
threads = int(os.environ.get("WEB_THREADS", "1"))
timeout = int(os.environ.get("WEB_TIMEOUT", "30"))
graceful_timeout = 10
accesslog = os.environ.get("WEB_ACCESS_LOG") or None
errorlog = "-"
